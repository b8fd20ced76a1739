"""`kvtrace capture metrics` and `kvtrace capture watch` on a folder of several servers: the two data-parallel
ranks built by hand in tests/helpers/ranks.py (rank 0 thrashes, rank 1 never preempts; the same request ids
and step numbers, monotonic clocks 5,000 s apart), and a restart.

Each server's figures, labelled `server` (dp0, dp1: what `kvtrace capture run` calls it), must be those the
exporter serves on a folder holding that server alone, where they carry no label: its counters, its pool and
its verdict, poll after poll while the chunks arrive and a short window forgets.
"""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.vllm.metrics import Exporter
from tests.helpers.capture_figures import COUNTERS, per_server, scraped
from tests.helpers.cli import one_line_error
from tests.helpers.ranks import RANK0, RANK1, SERVERS, WALL, write_ranks, write_server

GAUGES = {"kvtrace_kv_used_blocks", "kvtrace_kv_cached_blocks", "kvtrace_kv_free_blocks", "kvtrace_kv_total_blocks",
          "kvtrace_thrash_verdict"}
RESTART = "20261201T031000Z-5151"   # rank 0 again, started after RANK0 on the same host


@pytest.fixture(scope="module")
def chunks(tmp_path_factory) -> dict[str, list]:
    """Each rank's chunk files (ten of two seconds), written once: rank -> [path, ...]."""
    root = tmp_path_factory.mktemp("ranks")
    for server_id, s in SERVERS.items():
        write_server(root / server_id, server_id, s["rank"], s["mono"], s["late"], s["thrash"])
    return {server_id: sorted((root / server_id / "chunks").glob("*.kvtc")) for server_id in SERVERS}


def _folder(path, server_ids: list[str], source) -> None:
    (path / "chunks").mkdir(parents=True)
    (path / "servers").mkdir()
    for server_id in server_ids:
        shutil.copy(source[server_id][0].parents[1] / "servers" / f"{server_id}.json", path / "servers")


def test_each_servers_figures_are_those_of_its_folder_alone(tmp_path, chunks):
    """The chunks arrive three of each rank at a time; 12 s of rows are kept (a rank's 20 s do not fit)."""
    both, alone = tmp_path / "both", {s: tmp_path / s for s in SERVERS}
    _folder(both, list(SERVERS), chunks)
    for server_id, folder in alone.items():
        _folder(folder, [server_id], chunks)
    exporters = {folder: Exporter(folder, window_s=12.0) for folder in (both, *alone.values())}
    labels = {RANK0: "dp0", RANK1: "dp1"}
    before: dict = {}
    try:
        for i in range(0, 10, 3):
            for server_id, paths in chunks.items():
                for path in paths[i:i + 3]:
                    shutil.copy(path, both / "chunks")
                    shutil.copy(path, alone[server_id] / "chunks")
            for exporter in exporters.values():
                exporter.poll()
            got = per_server(scraped(exporters[both]))
            assert set(got) == {"dp0", "dp1"}
            for server_id, folder in alone.items():
                own = per_server(scraped(exporters[folder]))
                assert set(own) == {""}   # one server: no label, as before
                assert got[labels[server_id]] == pytest.approx(own[""], rel=1e-12), (i, server_id)
            now = {(s, key): v for s, figures in got.items() for key, v in figures.items() if key[0] in COUNTERS}
            assert all(now[key] >= value for key, value in before.items())   # counters never go backwards
            before = now
        verdicts = {s: {dict(k[1])["verdict"] for k, v in f.items() if k[0] == "kvtrace_thrash_verdict" and v == 1}
                    for s, f in got.items()}
        assert verdicts == {"dp0": {"sustained"}, "dp1": {"none"}}
        assert got["dp0"]["kvtrace_kv_used_blocks", frozenset()] == 16 and got["dp1"][
            "kvtrace_kv_used_blocks", frozenset()] == 6
        assert got["dp0"]["kvtrace_preemptions_total", frozenset({("reason", "recompute")})] == 5
    finally:
        for exporter in exporters.values():
            exporter.close()


def test_a_restarted_server_keeps_its_counters_and_gives_up_its_gauges(tmp_path):
    """Rank 0 stopped and started again (a later start of the same rank on the same host): the two are
    told apart by their ids, each one's counters its own; the pool and the verdict are the new one's."""
    folder = tmp_path / "restart"
    write_server(folder, RANK0, 0, WALL, 0.0, True)
    write_server(folder, RESTART, 0, WALL, 30.0, False)
    identity = folder / "servers" / f"{RESTART}.json"
    identity.write_text(json.dumps({**json.loads(identity.read_text()), "started_at": "1970-01-12T13:48:50+00:00"}))
    write_server(tmp_path / "old", RANK0, 0, WALL, 0.0, True)
    write_server(tmp_path / "new", RESTART, 0, WALL, 30.0, False)
    exporters = [Exporter(f, window_s=12.0) for f in (folder, tmp_path / "old", tmp_path / "new")]
    try:
        for exporter in exporters:
            exporter.poll()
        got, old, new = (per_server(scraped(e)) for e in exporters)
        assert set(got) == {RANK0, RESTART}
        assert got[RESTART] == pytest.approx(new[""], rel=1e-12)
        assert got[RANK0] == pytest.approx({k: v for k, v in old[""].items() if k[0] in COUNTERS}, rel=1e-12)
        assert {name for name, _ in old[""]} >= GAUGES   # alone, it had them
    finally:
        for exporter in exporters:
            exporter.close()


def _watch(*args) -> str:
    result = CliRunner().invoke(app, ["capture", "watch", *map(str, args), "--once", "--window", "30s"],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("watch") / "capture"
    write_ranks(folder)
    return folder


def test_watch_shows_the_server_that_wrote_last_and_says_how_to_pick(ranks):
    out = _watch(ranks)   # rank 1's steps end a quarter of a second after rank 0's, on the wall clock
    assert out.splitlines()[0] == ("the folder holds 2 servers (dp0, dp1): showing dp1, the one that wrote last "
                                   "(--server or --rank picks one; kvtrace capture ls lists them)")
    assert f"server dp1 ({RANK1}), last 30 s" in out and "thrash NONE" in out


@pytest.mark.parametrize("args", [["--rank", "0"], ["--server", RANK0], ["--server", RANK0[:-1]]])
def test_watch_shows_the_server_chosen(ranks, args):
    out = _watch(ranks, *args)
    assert out.splitlines()[0] == "the folder holds 2 servers (dp0, dp1): showing dp0"
    assert f"server dp0 ({RANK0}), last 30 s" in out and "thrash SUSTAINED" in out


@pytest.mark.parametrize("args, message", [
    (["--rank", "7"], "--rank 7: no server of that data-parallel rank (the folder's: 0, 1)"),
    (["--server", "nope"], "--server nope: no server of that id"),
])
def test_watch_refuses_a_bad_choice_in_one_line(ranks, args, message):
    assert message in one_line_error(["capture", "watch", str(ranks), "--once", *args])
