"""`kvtrace workload from-run`: a run's traffic as a workload, and the round trip that checks it.

A backlog run of kvtrace's engine, turned into a workload and replayed by the simulator with the same
settings, makes the same scheduling decisions event for event (token ids aside), whether the prefix
structure comes from the replayed prompts' ids or, with the workload file gone, from the run's
kv_events alone.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtrace.trace import db
from kvtrace.trace.db import connect
from kvtrace.vllm.importer import convert
from kvtrace.workload import load_workload
from tests.helpers.cli import one_line_error, write_workload
from tests.helpers.cli import record as record_cli
from tests.helpers.vllm_runs import ITEMS, chunk, write_capture
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app

POOL = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks", "24", "--watermark", "0", "--max-num-batched-tokens", "64"]
SETTINGS = {
    "recompute": [],
    "swap": ["--preemption-mode", "swap", "--num-cpu-blocks", "40"],
}


def backlog_rows(seed: int, num_requests: int = 12) -> list[dict]:
    """Requests sharing a few system prompts, some with n > 1 (greedy and sampled), some stopping
    before their cap, all arriving at once (tests/engine/test_simulation.py's backlog, as rows)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(17, 512) for _ in range(rng.randint(6, 20))] for _ in range(3)]
    rows = []
    for i in range(num_requests):
        max_tokens = rng.randint(2, 24)
        row = {"id": f"r{i}", "arrival_s": 0, "max_tokens": max_tokens, "ignore_eos": True, "seed": i,
               "prompt_token_ids": rng.choice(prefixes) + [rng.randrange(17, 512) for _ in range(rng.randint(1, 30))],
               "n": rng.choice([1, 1, 2, 3]), "temperature": rng.choice([0.0, 0.0, 0.9])}
        if rng.random() < 0.5:
            row["output_tokens"] = rng.randint(1, max_tokens)
        rows.append(row)
    return rows


def record(tmp_path, workload, name, *args):
    result, out = record_cli(tmp_path, workload, name, *args)
    assert result.exit_code == 0, result.output
    return out


def from_run(run, out):
    result = CliRunner().invoke(app, ["workload", "from-run", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return result.stderr


def decisions(run) -> dict[str, list]:
    con = connect([run])
    return {
        "kv_events": con.sql("""SELECT step, kind, req_id, sample, blocks, src_blocks, num_tokens, reason,
                                       num_cached_tokens, num_recomputed_tokens, bytes, requester_req_id,
                                       victim_reason FROM kv_events ORDER BY seq""").fetchall(),
        "steps": con.sql("""SELECT step, running, waiting, swapped, prefill_tokens, decode_tokens, recompute_tokens,
                                   preemptions, free_blocks, used_blocks, cached_blocks, kv_tokens, admission_stop
                            FROM steps ORDER BY step""").fetchall(),
        "requests": con.sql("""SELECT req_id, sample, n, priority, prompt_tokens, max_tokens, output_tokens,
                                      finish_reason, preemptions, swaps, recomputed_tokens, prefix_hit_tokens
                               FROM requests ORDER BY req_id, sample""").fetchall(),
        "tokens": con.sql("SELECT req_id, sample, idx, step FROM tokens ORDER BY req_id, sample, idx").fetchall(),
    }


@pytest.mark.parametrize("name", SETTINGS)
def test_a_backlog_run_replays_in_the_simulator_decision_for_decision(tmp_path, name):
    workload = write_workload(tmp_path / "w.jsonl", backlog_rows(seed=1))
    settings = [*POOL, *SETTINGS[name]]
    real = record(tmp_path, workload, "real", "--backlog", *settings)
    want = decisions(real)
    kinds = {row[1] for row in want["kv_events"]}
    assert {"preempt", "prefix_hit"} <= kinds   # the run exercises what the round trip claims
    if name == "swap":
        assert "swap_out" in kinds
    for source in ("tokens", "kv_events"):
        if source == "kv_events":
            workload.unlink()   # the replayed prompts are gone: the structure comes from the events
        summary = from_run(real, tmp_path / f"{source}.jsonl")
        assert f"prefix structure from {source}" in summary
        sim = record(tmp_path, tmp_path / f"{source}.jsonl", f"sim-{source}", "--engine", "sim", *settings)
        got = decisions(sim)
        for table in want:
            assert got[table] == want[table], (source, table)


def test_a_simulated_run_round_trips_too_and_the_workload_carries_no_tokens(tmp_path):
    workload = write_workload(tmp_path / "w.jsonl", backlog_rows(seed=2))
    first = record(tmp_path, workload, "first", "--engine", "sim", "--backlog", *POOL)
    from_run(first, tmp_path / "a.jsonl")
    second = record(tmp_path, tmp_path / "a.jsonl", "second", "--engine", "sim", *POOL)
    assert decisions(second) == decisions(first)
    text = (tmp_path / "a.jsonl").read_text()
    assert "prompt_token_ids" not in text and '"prompt"' not in text
    requests = load_workload(tmp_path / "a.jsonl")
    assert all(r.hash_block_size == 4 and len(r.hash_ids) == r.prompt_tokens // 4 for r in requests)
    # renumbered from 0 in order of first appearance: no hash value of the run is written
    seen = [h for r in requests for h in r.hash_ids]
    assert sorted(set(seen)) == list(range(len(set(seen))))
    # sampling and the rest, as the workload had them
    given = {row["id"]: row for row in backlog_rows(seed=2)}
    for r in requests:
        assert (r.n, r.temperature, r.seed) == (given[r.id]["n"], given[r.id]["temperature"], given[r.id]["seed"])


def test_arrivals_are_relative_and_a_request_that_never_finished_gets_the_rules_length(tmp_path):
    rows = [{"id": "a", "arrival_s": 2.0, "prompt_tokens": 9, "max_tokens": 6, "output_tokens": 3},
            {"id": "b", "arrival_s": 2.5, "prompt_tokens": 9, "max_tokens": 5, "priority": 2}]
    run = record(tmp_path, write_workload(tmp_path / "w.jsonl", rows), "run", "--engine", "sim", *POOL)
    requests = {r.id: r for r in _from_run_requests(run, tmp_path)}
    assert (requests["a"].arrival_s, requests["a"].output_tokens, requests["a"].max_tokens) == (0.0, 3, 6)
    # b ran to its cap: no output_tokens, so a replay stops it there with reason `length` again
    assert (requests["b"].arrival_s, requests["b"].output_tokens, requests["b"].priority) == (0.5, None, 2)
    # a request cut off by an interrupted run (3 tokens produced): the median of the finished (b's 5), or
    # its cap, or what it had produced
    _set_column(run, "requests", "finish_reason", lambda rid, value: "aborted" if rid == "a" else value)
    assert _from_run_requests(run, tmp_path)[0].output_tokens == 5
    from kvtrace.workload.from_run import workload_from_run
    assert workload_from_run(run, "max-tokens").requests[0].output_tokens is None
    assert workload_from_run(run, "seen").requests[0].output_tokens == 3


def _from_run_requests(run, tmp_path):
    out = tmp_path / f"out-{random.random()}.jsonl"
    from_run(run, out)
    return load_workload(out)


def _set_column(run, table, name, change) -> None:
    for path in (run / table).glob("part-*.parquet"):
        data = pq.read_table(path)
        values = [change(rid, v) for rid, v in zip(data["req_id"].to_pylist(), data[name].to_pylist())]
        data = data.set_column(data.schema.get_field_index(name), name, pa.array(values, data.schema.field(name).type))
        pq.write_table(data, path)


def test_recorded_block_hashes_are_the_prefix_structure_of_a_content_free_capture(tmp_path):
    rows = [{"id": "a", "arrival_s": 0, "prompt_tokens": 12, "max_tokens": 2},
            {"id": "b", "arrival_s": 1, "prompt_tokens": 12, "max_tokens": 2}]
    run = record(tmp_path, write_workload(tmp_path / "w.jsonl", rows), "run", "--engine", "sim", *POOL)
    (tmp_path / "w.jsonl").unlink()
    # a capture's own (salted) hash of every block it allocated: a's blocks and b's are told equal there,
    # though the cache of this run never served b from a's
    for path in (run / "kv_events").glob("part-*.parquet"):
        data = pq.read_table(path)
        hashes = [[1000 + i for i in range(len(blocks))] if kind == "alloc" and blocks else None
                  for kind, blocks in zip(data["kind"].to_pylist(), data["blocks"].to_pylist())]
        pq.write_table(data.append_column("block_hashes", pa.array(hashes, pa.list_(pa.int64()))), path)
    out = tmp_path / "h.jsonl"
    assert "prefix structure from hashes" in from_run(run, out)
    a, b = load_workload(out)
    assert a.hash_ids == b.hash_ids == [0, 1, 2]


def test_a_vllm_captured_run_becomes_a_workload(tmp_path):
    """The importer's run of a capture (no vLLM needed): ids mapped back, n from the workload, the
    second request served its first block from the first one's."""
    capture = tmp_path / "capture"

    def request(raw, finish, out, **extra):
        return {"req_id": raw, "sample": 0, "n": 1, "priority": 0, "arrival_s": 100.0, "prompt_tokens": 40,
                "max_tokens": 8, "output_tokens": out, "first_scheduled_s": 100.1, "first_token_s": 100.2,
                "finish_s": finish, "finish_reason": "length", "preemptions": 0, "swaps": 0,
                "recomputed_tokens": 0, "prefix_hit_tokens": 0, **extra}

    def event(seq, kind, raw, blocks, reason):
        return {"seq": seq, "step": seq, "ts_s": 100.2, "kind": kind, "req_id": raw, "sample": 0, "blocks": blocks,
                "num_blocks": len(blocks), "num_tokens": 32 * len(blocks) if kind == "prefix_hit" else 0,
                "bytes": 0, "reason": reason}

    write_capture(capture, [chunk({
        "requests": [request("kvt0-1a2b", 103.0, 8),
                     request("0_kvt3-beef", 104.0, 4, arrival_s=100.5, prompt_tokens=60, max_tokens=16, priority=1),
                     request("1_kvt3-beef", 104.5, 4, arrival_s=100.5, prompt_tokens=60, max_tokens=16, priority=1)],
        "steps": [{"step": 0, "start_s": 100.1, "end_s": 100.2, "total_blocks": 16}],
        "kv_events": [event(0, "alloc", "kvt0-1a2b", [1, 2], "prefill"),
                      event(1, "prefix_hit", "0_kvt3-beef", [1], "new"),
                      event(2, "alloc", "0_kvt3-beef", [3], "prefill"),
                      event(3, "prefix_hit", "1_kvt3-beef", [1], "new"),
                      event(4, "alloc", "1_kvt3-beef", [4], "prefill")]})])
    run = tmp_path / "run"
    convert(capture, run, "run", list(ITEMS.values()), origin=100.0, interrupted=False)
    (run / "meta.json").write_text(json.dumps({"run_id": "run", "kv_pool": {"block_size": 32},
                                               "engine_config": {"engine": "vllm"}}))
    out = tmp_path / "w.jsonl"
    assert "prefix structure from kv_events" in from_run(run, out)
    a, b = load_workload(out)
    assert (a.id, a.arrival_s, a.prompt_tokens, a.max_tokens, a.output_tokens, a.n, a.hash_ids) == (
        "chat-a", 0.0, 40, 8, None, 1, [0])
    assert (b.id, b.arrival_s, b.prompt_tokens, b.max_tokens, b.output_tokens, b.n, b.priority, b.hash_ids) == (
        "chat-b", 0.5, 60, 16, 4, 2, 1, [0])
    assert (a.temperature, b.temperature) == (0.0, 0.0)   # a capture does not record sampling: greedy


def test_a_run_that_cannot_be_a_workload_is_refused_in_one_line(tmp_path):
    assert one_line_error(["workload", "from-run", str(tmp_path / "none")]) == (
        f"kvtrace: error: run folder not found: {tmp_path / 'none'}")
    (tmp_path / "bare").mkdir()
    assert one_line_error(["workload", "from-run", str(tmp_path / "bare")]) == (
        f"kvtrace: error: {tmp_path / 'bare'}: cannot be turned into a workload: no meta.json (not a run folder)")
    rows = [{"id": "a", "arrival_s": 0, "prompt_tokens": 9, "max_tokens": 2}]
    run = record(tmp_path, write_workload(tmp_path / "w.jsonl", rows), "run", "--engine", "sim", *POOL)
    meta = json.loads((run / "meta.json").read_text())
    no_block_size = tmp_path / "no-block-size"
    shutil.copytree(run, no_block_size)
    del meta["kv_pool"]["block_size"], meta["engine_config"]["block_size"]
    (no_block_size / "meta.json").write_text(json.dumps(meta))
    assert one_line_error(["workload", "from-run", str(no_block_size)]) == (
        f"kvtrace: error: {no_block_size}: cannot be turned into a workload: meta.json gives no block size "
        "(kv_pool.block_size)")
    _set_column(run, "requests", "prompt_tokens", lambda rid, value: None)
    assert one_line_error(["workload", "from-run", str(run)]) == (
        f"kvtrace: error: {run}: cannot be turned into a workload: 1 request(s) lack an arrival time, a prompt "
        "length or max_tokens (first: 'a')")
    for path in (run / "requests").glob("part-*.parquet"):
        pq.write_table(pq.read_table(path).slice(0, 0), path)
    assert one_line_error(["workload", "from-run", str(run)]) == (
        f"kvtrace: error: {run}: cannot be turned into a workload: its requests table is empty")


def test_a_windows_edges_are_kept_and_said(tmp_path):
    """A 40 s window of the capture fixture, mid-traffic: requests in flight at its start keep their
    arrivals (the replay's warm-up is the time before the window's start), finished ones their real
    lengths, unfinished ones the length of the rule, and the header says both."""
    import statistics

    from kvtrace.workload.from_run import workload_from_run

    capture = Path(__file__).resolve().parents[1] / "fixtures" / "captures" / "bursts"
    run = tmp_path / "window"
    result = CliRunner().invoke(app, ["capture", "run", str(capture), "-o", str(run),
                                      "--since", "2026-11-18T12:00:30Z", "--until", "2026-11-18T12:01:10Z"])
    assert result.exit_code == 0, result.output
    con = db.connect([run])
    rows = {r[0]: r[1:] for r in con.execute(
        "SELECT req_id, output_tokens, finish_reason, max_tokens, arrival_s FROM requests").fetchall()}
    done = [o for o, f, _, _ in rows.values() if f in ("stop", "length")]
    typical = sorted(done)[len(done) // 2]
    assert done and any(f == "in-flight" for _, f, _, _ in rows.values())
    window = json.loads((run / "meta.json").read_text())["capture"]["window"]
    for rule in ("typical", "seen", "max-tokens"):
        made = workload_from_run(run, rule)
        by_id = {r.id: r for r in made.requests}
        for rid, (out, finish, cap, _) in rows.items():
            got = by_id[rid].output_tokens
            if finish in ("stop", "length"):
                assert got == (None if out == cap and finish == "length" else out), rid
            else:
                expected = {"typical": max(out, typical), "seen": max(out, 1), "max-tokens": cap}[rule]
                assert (got or cap) == min(expected, cap), (rule, rid)
        assert made.warmup_s == pytest.approx(window["start_s"] - min(a for *_, a in rows.values()))
        (unfinished,) = [e for e in made.edges if e.startswith("unfinished:")]
        assert f"by rule {rule}" in unfinished and (rule != "typical" or f"{typical} tokens" in unfinished)
        assert any(e.startswith("window: ") and f"first {made.warmup_s:.1f} s are warm-up" in e for e in made.edges)
    assert statistics.median_low(done) == typical
    out = tmp_path / "w.jsonl"
    assert CliRunner().invoke(app, ["workload", "from-run", str(run), "-o", str(out)]).exit_code == 0
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert any(line.startswith("# unfinished:") for line in header) and any(line.startswith("# window:") for line in header)
