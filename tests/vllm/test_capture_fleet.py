"""Several servers' captures read as one: `kvtrace capture ls` and `capture run` of the data-parallel
ranks of one server and of a fleet's folders, built by hand (no vLLM; tests/vllm/test_capture_ranks_on_vllm.py
and test_vllm_data_parallel.py run vLLM's own).

The folder: tests/helpers/ranks.py (two ranks, 0 and 1, with the same request ids and steps; rank 0
thrashes, rank 1 never preempts).

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
from kvtrace.trace.schema import SCHEMA_VERSION
from tests.helpers.cli import one_line_error
from tests.helpers.ranks import RANK0, RANK1, SERVERS, WALL, write_ranks, write_server
from tests.helpers.servers import assert_each_server_alone, rows_of

SINCE, UNTIL = WALL + 99, WALL + 125    # before every arrival (the runs' clocks start there) to after the end


def _cli(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks") / "capture"
    write_ranks(folder)
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
    assert meta["schema_version"] == SCHEMA_VERSION
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
