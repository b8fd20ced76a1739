"""Several servers' captures read as one: `kvtrace capture ls` and `capture run` of the data-parallel
ranks of one server and of a fleet's folders, built by hand (no vLLM; tests/vllm/test_capture_live_ranks.py
and test_capture_on_vllm.py run vLLM's own).

Two servers, ranks 0 and 1, wrote into one folder, each with requests a–e and steps 0–19: the same
request ids and step numbers. Their monotonic clocks differ (rank 0's is the wall clock less 1,000,000 s,
rank 1's less 995,000 s) and rank 1 runs a quarter of a second behind rank 0 on the wall clock. One step a
second from t = 100 to 119 (rank 0's wall 1,000,100 …):
    a: arrives 100, finishes 104;  b: 102–108;  c: 107–110;  d: 109–116;  e: arrives 118, never finishes
Rank 0 thrashes: its pool is full from step 8 on and d is preempted in each of the steps 10–14, re-prefilled
in the next (40 positions computed again each time). Rank 1 never preempts.

The joined run must keep every row of each server apart: each server's figures in it equal those of
the run of that server alone (`--server`), on the same window.
"""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvtrace.cli.app import app
from kvtrace.trace import db
from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.sink import CHUNK_COLUMNS
from tests.helpers.cli import one_line_error
from tests.helpers.servers import assert_each_server_alone, rows_of

WALL = 1_000_000.0                      # rank 0's wall clock less its monotonic clock
RANK0, RANK1 = "20261201T030000Z-4242", "20261201T030000Z-4343"
SERVERS = {RANK0: {"rank": 0, "mono": WALL, "late": 0.0, "thrash": True},
           RANK1: {"rank": 1, "mono": WALL - 5000, "late": 0.25, "thrash": False}}
REQUESTS = {"a": (100, 104), "b": (102, 108), "c": (107, 110), "d": (109, 116), "e": (118, None)}
SINCE, UNTIL = WALL + 99, WALL + 125    # before every arrival (the runs' clocks start there) to after the end


def _rows(lo: int, hi: int, thrash: bool, shift: float) -> dict[str, list[dict]]:
    """A server's rows of its seconds lo <= t < hi, its monotonic times `shift` after t."""
    rows: dict[str, list[dict]] = {t: [] for t in CHUNK_COLUMNS}
    for t in range(lo, hi):
        step, m = t - 100, t + shift
        preempted = thrash and 110 <= t <= 114
        reprefilled = thrash and 111 <= t <= 115
        rows["steps"].append({"step": step, "start_s": m, "end_s": m + 0.5, "running": 2, "waiting": 0, "swapped": 0,
                              "prefill_tokens": 40 if reprefilled else 0, "decode_tokens": 2,
                              "recompute_tokens": 40 if reprefilled else 0, "preemptions": int(preempted),
                              "free_blocks": 0 if thrash and t >= 108 else 10,
                              "used_blocks": 16 if thrash and t >= 108 else 6, "cached_blocks": 0,
                              "total_blocks": 16, "kv_tokens": 40,
                              "admission_stop": "preemption" if preempted else "nothing-waiting"})

        events = rows["kv_events"]

        def event(kind: str, rid: str, **values) -> None:   # a step's events numbered from 10 x its second
            seq = t * 10 + sum(e["step"] == step for e in events)
            events.append({"seq": seq, "step": step, "ts_s": m + 0.5, "kind": kind, "req_id": rid, "sample": 0,
                           **values})
        for rid, (arrival, finish) in REQUESTS.items():
            if arrival == t:
                rows["arrivals"].append({"req_id": rid, "arrival_s": m, "prompt_tokens": 40, "max_tokens": 16,
                                         "priority": 0, "block_hashes": [11, 22]})
                event("admit", rid, num_tokens=40, reason="new")
            if rid == "d" and preempted:
                event("preempt", rid, num_tokens=40, reason="recompute", requester_req_id="b",
                      requester_sample=0, victim_reason="newest")
            if rid == "d" and reprefilled:
                event("admit", rid, num_tokens=40, reason="resume-recompute")
                event("reprefill", rid, num_tokens=40, num_cached_tokens=0, num_recomputed_tokens=40)
            if arrival <= t and (finish is None or t < finish) and not (rid == "d" and preempted):
                rows["tokens"].append({"req_id": rid, "sample": 0, "idx": t - arrival, "token_id": None,
                                       "step": step, "ts_s": m + 0.5})
            if finish == t:
                rows["requests"].append({"req_id": rid, "sample": 0, "n": 1, "priority": 0,
                                         "arrival_s": arrival + shift,
                                         "prompt_tokens": 40, "max_tokens": 16, "output_tokens": finish - arrival,
                                         "first_scheduled_s": arrival + shift, "first_token_s": arrival + shift + 0.5,
                                         "finish_s": finish + shift, "finish_reason": "length",
                                         "preemptions": 5 if rid == "d" and thrash else 0, "swaps": 0,
                                         "recomputed_tokens": 200 if rid == "d" and thrash else 0,
                                         "prefix_hit_tokens": 0})
                event("finish", rid, num_tokens=finish - arrival, reason="length")
    return rows


def write_server(folder, server_id: str, rank: int | None, mono: float, late: float, thrash: bool,
                 host: str = "gpu-node-1") -> None:
    """One server's identity and chunks in `folder`: its monotonic clock is the wall clock less `mono`
    (its rows carry t - WALL + mono, t its wall second) and its steps start `late` s after rank 0's."""
    shift = WALL - mono + late
    (folder / "servers").mkdir(parents=True, exist_ok=True)
    identity = {"server_id": server_id, "started_at": "1970-01-12T13:48:19+00:00", "pid": int(server_id[-4:]),
                "vllm_version": "0.33.0", "model": "/models/smollm2-135m", "scheduler": "KvtraceScheduler",
                "async_scheduling": False, "salt_id": "abcd1234", "token_ids": False, "wall_minus_monotonic": mono,
                "block_size": 16, "num_gpu_blocks": 17, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                "max_model_len": 256, "enable_prefix_caching": True, "policy": "fcfs", "host": host,
                "vllm_instance_id": "a1b2c", "data_parallel_rank": rank, "data_parallel_size": 2}
    (folder / "servers" / f"{server_id}.json").write_text(json.dumps(identity))
    (folder / "chunks").mkdir(exist_ok=True)
    for part in range(10):   # two seconds a chunk
        rows = _rows(100 + 2 * part, 102 + 2 * part, thrash, shift)
        cols = {t: {c: [r.get(c) for r in rows[t]] for c in cs} for t, cs in CHUNK_COLUMNS.items() if rows[t]}
        first, last = WALL + late + 100 + 2 * part, WALL + late + 101.5 + 2 * part
        (folder / "chunks" / f"{server_id}_{part:06d}_{first:.3f}_{last:.3f}_{len(rows['arrivals'])}.kvtc"
         ).write_bytes(chunk_format.encode(cols))


def _cli(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks") / "capture"
    for server_id, s in SERVERS.items():
        write_server(folder, server_id, s["rank"], s["mono"], s["late"], s["thrash"])
    return folder


@pytest.fixture(scope="module")
def runs(folder, tmp_path_factory):
    """The joined run of both ranks and each rank's run alone, on one window."""
    root = tmp_path_factory.mktemp("runs")
    window = ["--since", SINCE, "--until", UNTIL]
    _cli("capture", "run", folder, "-o", root / "joined", *window)
    for server_id, s in SERVERS.items():
        _cli("capture", "run", folder, "-o", root / f"dp{s['rank']}", "--server", server_id, *window)
    return root


def test_ls_lists_each_rank_with_its_host(folder):
    out = _cli("capture", "ls", folder)
    assert out.splitlines()[0].endswith("2 servers, " + out.splitlines()[0].split(", ")[1])
    assert f"server {RANK0}  rank 0/2  host gpu-node-1" in out and f"server {RANK1}  rank 1/2  host gpu-node-1" in out
    assert "kvtrace capture run joins the 2 servers" in out
    listed = json.loads(_cli("capture", "ls", folder, "--json"))["servers"]
    assert [(s["data_parallel_rank"], s["host"], s["vllm_instance_id"]) for s in listed] == [
        (0, "gpu-node-1", "a1b2c"), (1, "gpu-node-1", "a1b2c")]


def test_the_joined_run_carries_each_rows_server(runs):
    con = db.connect([runs / "joined"])
    for table in ("requests", "steps", "kv_events", "tokens"):
        assert dict(con.sql(f"SELECT server, count(*) FROM {table} GROUP BY 1").fetchall()).keys() == {"dp0", "dp1"}
    # request ids and steps collide between the servers: prefixed and keyed by server, nothing lost
    assert sorted(r[0] for r in con.sql("SELECT req_id FROM requests").fetchall()) == [
        f"dp{rank}/{rid}" for rank in (0, 1) for rid in "abcde"]
    assert con.execute("SELECT count(*), count(DISTINCT (server, step)) FROM steps").fetchall() == [(40, 40)]
    assert con.execute("SELECT count(*) FROM kv_events WHERE split_part(req_id, '/', 1) <> server "
                   "AND req_id <> ''").fetchall() == [(0,)]
    requesters = con.sql("SELECT requester_req_id FROM kv_events WHERE kind = 'preempt' GROUP BY 1").fetchall()
    assert requesters == [("dp0/b",)]
    seqs = [r[0] for r in con.sql("SELECT seq FROM kv_events ORDER BY seq").fetchall()]
    assert seqs == list(range(len(seqs)))   # one order of events in the run
    # on one clock: rank 1's steps a quarter of a second after rank 0's, though its own clock is 5,000 s off
    assert con.sql("SELECT server, min(start_s) FROM steps GROUP BY 1 ORDER BY 1").fetchall() == [
        ("dp0", pytest.approx(1.0)), ("dp1", pytest.approx(1.25))]
    meta = json.loads((runs / "joined" / "meta.json").read_text())
    assert [(s["label"], s["server_id"], s["data_parallel_rank"]) for s in meta["capture"]["servers"]] == [
        ("dp0", RANK0, 0), ("dp1", RANK1, 1)]
    assert meta["schema_version"] == 4
    # a run of one server is written as before: no server column, its ids vLLM's own
    alone = db.connect([runs / "dp1"])
    assert alone.sql("SELECT DISTINCT server FROM steps").fetchall() == [("",)]
    assert sorted(r[0] for r in alone.sql("SELECT req_id FROM requests").fetchall()) == list("abcde")


# each analysis of one server's rows, with the params that pick its rows: (name, joined params, alone params)
PER_SERVER = [
    ("pool", {}, {}),
    ("step_costs", {}, {}),
    ("preemptions", {}, {}),
    ("wait_causes", {}, {}),
    ("request_story", {}, {}),
    ("recompute_by_request", {}, {}),
    ("itl_cliffs", {"threshold_ms": 900}, {"threshold_ms": 900}),
    ("request_pool", {"req_id": "{label}/d", "buckets": 20}, {"req_id": "d", "buckets": 20}),
    ("step_sequences", {"step": 11, "server": "{label}"}, {"step": 11}),
    ("thrash_windows", {}, {}),
]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_servers_figures_in_the_joined_run_are_its_run_alone(runs, rank):
    label = f"dp{rank}"
    joined, alone = db.connect([runs / "joined"]), db.connect([runs / label])
    assert_each_server_alone(joined, alone, label, PER_SERVER)
    assert rows_of(alone, "thrash")[0]["verdict"] == ("sustained" if rank == 0 else "none")


def test_the_runs_figures_add_its_servers_up(runs):
    joined = rows_of(db.connect([runs / "joined"]), "summary")[0]
    alone = [rows_of(db.connect([runs / f"dp{rank}"]), "summary")[0] for rank in (0, 1)]
    assert joined["servers"] == 2 and [a["servers"] for a in alone] == [1, 1]
    assert joined["preemptions"] == sum(a["preemptions"] for a in alone) == 5
    assert joined["recomputed_tokens"] == sum(a["recomputed_tokens"] for a in alone) == 200
    assert joined["completed_requests"] == sum(a["completed_requests"] for a in alone) == 8
    assert joined["thrash_verdict"] == "sustained"   # a server thrashed
    # a pool is a server's: the fleet's share of full-pool steps is over both servers' steps, never a sum of pools
    thrash = rows_of(db.connect([runs / "joined"]), "thrash")[0]
    assert thrash["full_pool_step_share"] == pytest.approx(12 / 40)


def test_the_dashboard_shows_each_server(runs):
    out = _cli("analyze", runs / "joined")
    assert "2 servers: dp0, dp1" in out
    assert re.search(r"dp0 thrash SUSTAINED", out) and re.search(r"dp1 thrash NONE", out)
    assert out.count("100%▕") == 2   # a pool strip per server
    figures = json.loads(_cli("analyze", runs / "joined", "--json"))["runs"][0]
    assert [(s["server"], s["verdict"]) for s in figures["servers"]] == [("dp0", "sustained"), ("dp1", "none")]
    fullest = {}   # each strip is its server's pool: rank 0's full, rank 1's never above 6 of 16 blocks
    for row in figures["pool_timeline"]:
        fullest[row["server"]] = max(fullest.get(row["server"], 0), row["max_used_frac"] or 0)
    assert fullest == {"dp0": 1.0, "dp1": 6 / 16}
    compared = _cli("analyze", runs / "joined", runs / "dp1")
    assert "dp0 sustained dp1 none" in compared


def test_explain_tells_the_servers_apart(runs):
    assert "'d' names 2 requests (dp0/d, dp1/d)" in one_line_error(["explain", str(runs / "joined"), "d"])
    story = json.loads(_cli("explain", runs / "joined", "dp0/d", "--json"))
    assert story["server"] == "dp0" and story["req_id"] == "dp0/d" and len(story["preemptions"]) == 5
    assert all(p["requester_req_id"] == "dp0/b" for p in story["preemptions"])
    assert "dp1/d in run joined on server dp1" in _cli("explain", runs / "joined", "dp1/d")


def test_what_lays_out_one_engine_refuses_a_joined_run_in_one_line(runs, tmp_path):
    """The Perfetto timeline (one engine track a run), the explorer and a workload made of the run."""
    for args in (["export", "perfetto", str(runs / "joined"), "-o", str(tmp_path / "t.pftrace")],
                 ["explore", str(runs / "joined")],
                 ["workload", "from-run", str(runs / "joined"), "-o", str(tmp_path / "w.jsonl")]):
        line = one_line_error(args)
        assert "joins several servers (dp0, dp1)" in line and "--server or --rank" in line, args
    _cli("workload", "from-run", runs / "dp0", "-o", tmp_path / "dp0.jsonl")   # one server's: as before


def test_ranks_and_servers_choose_some(folder, tmp_path):
    _cli("capture", "run", folder, "-o", tmp_path / "rank1", "--rank", "1")
    con = db.connect([tmp_path / "rank1"])
    assert json.loads((tmp_path / "rank1" / "meta.json").read_text())["vllm"]["server_id"] == RANK1
    assert con.sql("SELECT DISTINCT server FROM steps").fetchall() == [("",)]   # one server: as before
    _cli("capture", "run", folder, "-o", tmp_path / "both", "--server", RANK1, "--rank", "0")
    labels = [s["label"] for s in json.loads((tmp_path / "both" / "meta.json").read_text())["capture"]["servers"]]
    assert labels == ["dp0", "dp1"]


def test_several_hosts_folders_read_as_one_fleet(tmp_path):
    """One folder per host, each with its rank 0: labelled by host."""
    for host, server_id in (("node-a", RANK0), ("node-b", RANK1)):
        write_server(tmp_path / host, server_id, 0, WALL, 0.0, host == "node-a", host=host)
    out = _cli("capture", "ls", tmp_path / "node-a", tmp_path / "node-b")
    assert f"{tmp_path / 'node-a'}: 1 server" in out and f"{tmp_path / 'node-b'}: 1 server" in out
    _cli("capture", "run", tmp_path / "node-a", tmp_path / "node-b", "-o", tmp_path / "fleet")
    con = db.connect([tmp_path / "fleet"])
    assert con.sql("SELECT server, count(*) FROM requests GROUP BY 1 ORDER BY 1").fetchall() == [
        ("node-a-dp0", 5), ("node-b-dp0", 5)]


@pytest.mark.parametrize("args, message", [
    (["--server", "nope"], "--server nope: no server of that id"),
    (["--server", "20261201"], "--server 20261201: more than one server of that id"),
    (["--rank", "7"], "--rank 7: no server of that data-parallel rank (the folder's: 0, 1)"),
])
def test_bad_selections_are_one_line(folder, tmp_path, args, message):
    assert message in one_line_error(["capture", "run", str(folder), "-o", str(tmp_path / "x"), *args])


def test_a_server_in_two_folders_is_one_line(folder, tmp_path):
    import shutil
    shutil.copytree(folder, tmp_path / "copy")
    line = one_line_error(["capture", "ls", str(folder), str(tmp_path / "copy")])
    assert f"server {RANK0} is in both" in line


def test_servers_of_different_models_are_not_joined(tmp_path):
    write_server(tmp_path / "c", RANK0, 0, WALL, 0.0, False)
    write_server(tmp_path / "c", RANK1, 1, WALL, 0.0, False)
    identity = tmp_path / "c" / "servers" / f"{RANK1}.json"
    identity.write_text(json.dumps({**json.loads(identity.read_text()), "model": "/models/other"}))
    line = one_line_error(["capture", "run", str(tmp_path / "c"), "-o", str(tmp_path / "x")])
    assert "the servers chosen differ in model" in line
