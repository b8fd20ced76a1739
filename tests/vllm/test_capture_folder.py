"""`kvtrace capture ls` and `kvtrace capture run` on a capture folder built by hand (no vLLM): the
layout the capture writes (servers/<id>.json, chunks/<id>_<part>_<first>_<last>_<arrivals>.kvtc),
windows with requests in flight across their edges, retention's gaps, and bad input.

The folder holds one server whose monotonic clock is the wall clock less 1,000,000 s. Five requests,
one step a second from t = 100 to 119 (wall 1,000,100 …):
    a: arrives 100, finishes 104            (before the window 106–112)
    b: arrives 102, finishes 108            (in flight at the window's start)
    c: arrives 107, finishes 110            (inside)
    d: arrives 109, finishes 116            (in flight at the window's end)
    e: arrives 118, never finishes          (after the window)
"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtrace.cli.app import app
from kvtrace.trace import db
from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.sink import CHUNK_COLUMNS
from tests.helpers.cli import one_line_error

OFFSET = 1_000_000.0
SERVER = "20261201T030000Z-4242"
REQUESTS = {"a": (100, 104), "b": (102, 108), "c": (107, 110), "d": (109, 116), "e": (118, None)}


def _rows(lo: int, hi: int) -> dict[str, list[dict]]:
    """The capture's rows of the seconds lo <= t < hi."""
    rows: dict[str, list[dict]] = {t: [] for t in CHUNK_COLUMNS}
    for t in range(lo, hi):
        rows["steps"].append({"step": t - 100, "start_s": t, "end_s": t + 0.5, "running": 1, "waiting": 0,
                              "swapped": 0, "prefill_tokens": 0, "decode_tokens": 1, "recompute_tokens": 0,
                              "preemptions": 0, "free_blocks": 10, "used_blocks": 6, "cached_blocks": 0,
                              "total_blocks": 16, "kv_tokens": 40, "admission_stop": "nothing-waiting"})
        for rid, (arrival, finish) in REQUESTS.items():
            if arrival == t:
                rows["arrivals"].append({"req_id": rid, "arrival_s": t, "prompt_tokens": 40, "max_tokens": 16,
                                         "priority": 0, "block_hashes": [11, 22] if rid in "bc" else [33]})
                rows["kv_events"].append({"seq": t * 10, "step": t - 100, "ts_s": t + 0.5, "kind": "admit",
                                          "req_id": rid, "sample": 0, "num_tokens": 40, "reason": "new"})
            if arrival <= t and (finish is None or t < finish):
                rows["tokens"].append({"req_id": rid, "sample": 0, "idx": t - arrival, "token_id": None,
                                       "step": t - 100, "ts_s": t + 0.5})
            if rid == "d" and t == 111:
                rows["kv_events"].append({"seq": t * 10 + 1, "step": t - 100, "ts_s": t + 0.5, "kind": "preempt",
                                          "req_id": rid, "sample": 0, "num_tokens": 42, "reason": "recompute"})
            if finish == t:
                rows["requests"].append({"req_id": rid, "sample": 0, "n": 1, "priority": 0, "arrival_s": arrival,
                                         "prompt_tokens": 40, "max_tokens": 16, "output_tokens": finish - arrival,
                                         "first_scheduled_s": arrival + 0.1, "first_token_s": arrival + 0.5,
                                         "finish_s": finish, "finish_reason": "length", "preemptions": int(rid == "d"),
                                         "swaps": 0, "recomputed_tokens": 0, "prefix_hit_tokens": 0})
                rows["kv_events"].append({"seq": t * 10 + 2, "step": t - 100, "ts_s": t + 0.5, "kind": "finish",
                                          "req_id": rid, "sample": 0, "num_tokens": finish - arrival, "reason": "length"})
    return rows


def _write(folder, parts=range(10)) -> None:
    (folder / "servers").mkdir(parents=True)
    (folder / "servers" / f"{SERVER}.json").write_text(json.dumps({
        "server_id": SERVER, "started_at": "1970-01-12T13:48:19+00:00", "pid": 4242, "vllm_version": "0.33.0",
        "model": "/models/smollm2-135m", "scheduler": "KvtraceAsyncScheduler", "async_scheduling": True,
        "salt_id": "abcd1234", "token_ids": False, "wall_minus_monotonic": OFFSET, "block_size": 16,
        "num_gpu_blocks": 17, "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 256,
        "enable_prefix_caching": True, "policy": "fcfs"}))
    chunks = folder / "chunks"
    chunks.mkdir(parents=True)
    for part in parts:   # two seconds a chunk
        rows = _rows(100 + 2 * part, 102 + 2 * part)
        cols = {t: {c: [r.get(c) for r in rows[t]] for c in cs} for t, cs in CHUNK_COLUMNS.items() if rows[t]}
        first, last = OFFSET + 100 + 2 * part, OFFSET + 101.5 + 2 * part
        (chunks / f"{SERVER}_{part:06d}_{first:.3f}_{last:.3f}_{len(rows['arrivals'])}.kvtc").write_bytes(
            chunk_format.encode(cols))


def _cli(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def folder(tmp_path):
    _write(tmp_path / "capture")
    return tmp_path / "capture"


def test_ls_shows_the_server_its_span_requests_and_retentions_gaps(tmp_path):
    _write(tmp_path / "capture", parts=range(3, 10))   # retention removed chunks 0-2
    lines = _cli("capture", "ls", tmp_path / "capture").splitlines()
    assert lines[1].startswith(f"server {SERVER}") and "pid 4242" in lines[1] and "vLLM 0.33.0" in lines[1]
    assert "smollm2-135m" in lines[1] and "async scheduling" in lines[1]
    assert "1970-01-12 13:48:26Z – 1970-01-12 13:48:39Z (14 s)" in lines[2]
    assert "3 requests" in lines[2] and "token ids not kept" in lines[2]   # c, d and e arrived in the kept chunks
    assert lines[3].startswith("  gap: chunks 0–2 removed by retention")
    (server,) = json.loads(_cli("capture", "ls", tmp_path / "capture", "--json"))["servers"]
    assert server["num_chunks"] == 7 and server["gaps"] == [lines[3].removeprefix("  gap: ")]


@pytest.mark.long   # tens of seconds, and it never loads the capture's scheduler (the mutation check's target)
def test_a_window_holds_every_request_of_its_span_marked_across_its_edges(folder, tmp_path):
    run = tmp_path / "window"
    _cli("capture", "run", folder, "-o", run, "--since", OFFSET + 106, "--until", "1970-01-12T13:48:32Z")
    con = db.connect([run])
    rows = con.execute("SELECT req_id, arrival_s, finish_s, finish_reason, output_tokens, preemptions, "
                       "in_flight_at_start, in_flight_at_end, block_hashes FROM requests "
                       "JOIN capture_requests USING (req_id, sample) ORDER BY req_id").fetchall()
    # the run's clock starts at b's arrival (102), the window's at 4 s on it
    assert rows == [("b", 0.0, 6.0, "length", 6, 0, True, False, [11, 22]),
                    ("c", 5.0, 8.0, "length", 3, 0, False, False, [11, 22]),
                    ("d", 7.0, 10.0, "in-flight", 3, 1, False, True, [33])]   # tokens at 109.5, 110.5, 111.5
    assert con.execute("SELECT min(start_s), max(start_s) FROM steps").fetchone() == (4.0, 10.0)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["capture"]["window"]["since_unix"] == OFFSET + 106 and meta["vllm"]["server_id"] == SERVER
    assert (meta["capture"]["window"]["start_s"], meta["capture"]["window"]["end_s"]) == (4.0, 10.0)
    for info in db.list_analyses():   # every analysis runs on it
        db.run_analysis(con, info.name)
    assert "smollm2-135m" in _cli("analyze", run)
    _cli("export", "perfetto", run, "-o", tmp_path / "window.pftrace")
    _cli("report", run, "-o", tmp_path / "window.html")
    assert "recompute" in _cli("explain", run, "d")
    # the window's traffic as a workload: the prefix structure from the capture's salted hashes
    _cli("workload", "from-run", run, "-o", tmp_path / "window.jsonl")
    replay = [json.loads(line) for line in (tmp_path / "window.jsonl").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert [r["prompt_tokens"] for r in replay] == [40, 40, 40] and all("prompt" not in r for r in replay)
    b, c, d = (r["hash_ids"] for r in replay)
    assert b == c and len(b) == 2 and d[0] != b[0] and len(d) == 1
    assert {11, 22, 33}.isdisjoint(b + d)   # renumbered: not the capture's values


def test_last_is_the_newest_data_less_the_duration(folder, tmp_path):
    run = tmp_path / "last"
    _cli("capture", "run", folder, "-o", run, "--last", "3s")
    ids = [r[0] for r in db.connect([run]).execute("SELECT req_id FROM requests ORDER BY req_id").fetchall()]
    assert ids == ["e"]   # 116.5–119.5: d finished at 116, before the window


@pytest.mark.parametrize("args, message", [
    (["--since", "yesterday"], "--since 'yesterday': expected an ISO time"),
    (["--last", "15 minutes"], "--last '15 minutes': expected a duration"),
    (["--last", "5s", "--since", "0"], "give --since or --last, not both"),
    (["--since", "0", "--until", "1"], "no server captured anything in that window"),
    (["--server", "nope"], "--server nope: no server of that id"),
])
def test_bad_input_is_one_line(folder, tmp_path, args, message):
    assert message in one_line_error(["capture", "run", str(folder), "-o", str(tmp_path / "x"), *args])


def test_a_folder_that_is_no_capture_is_one_line(tmp_path):
    assert "not a kvtrace capture folder" in one_line_error(["capture", "ls", str(tmp_path)])
    assert "no such folder" in one_line_error(["capture", "ls", str(tmp_path / "missing")])


def _write_many(path: str, rounds: int, start) -> None:
    from pathlib import Path

    from kvtrace.vllm.capture.files import write_file

    start.wait()   # both at once
    for i in range(rounds):
        write_file(Path(path), json.dumps({"round": i, "pad": "x" * 4000}).encode())


def test_two_processes_writing_one_file_at_once_both_succeed(tmp_path):
    """A data-parallel server's ranks start together and each writes the folder's capture.json: each
    through a temporary name of its own, so that neither renames the other's file away (which made a
    rank's capture step aside)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    workers = [context.Process(target=_write_many, args=(str(tmp_path / "capture.json"), 1000, start))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [w.exitcode for w in workers] == [0, 0]
    assert json.loads((tmp_path / "capture.json").read_text())["round"] == 999
    assert [p.name for p in tmp_path.iterdir()] == ["capture.json"]   # no temporary file left
