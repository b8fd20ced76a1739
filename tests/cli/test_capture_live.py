"""`kvtrace capture metrics` and `kvtrace capture watch` on a capture folder of real vLLM.

The folder is tests/fixtures/captures/bursts (vLLM 0.32.0's CPU build, two bursts of requests into
a pool too small for them; see tests/fixtures/README.md). Every figure the exporter serves must be
the SQL library's on a run converted from the same chunks (kvtrace.vllm.importer, as `kvtrace
record --engine vllm` converts): scraped by a real Prometheus server, and read chunk by chunk while
a tiny retention removes the oldest, with a short window that makes the exporter forget.
"""
from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.vllm.follow import ChunkReader
from kvtrace.vllm.metrics import Exporter
from tests.helpers.capture_figures import (
    COUNTERS,
    assert_figures,
    scraped,
    sql_figures,
    sql_verdict,
)
from tests.helpers.cli import interruptible
from tests.helpers.prometheus import PROMETHEUS, exporter_scraped, get, wait

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "captures" / "bursts"


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[tuple[str, frozenset], float]:
    figures = sql_figures(FIXTURE, tmp_path_factory.mktemp("capture-sql"))
    assert figures["kvtrace_preemptions_total", frozenset({("reason", "recompute")})] == 10   # the fixture shows
    assert figures["kvtrace_thrash_verdict", frozenset({("verdict", "occasional")})] == 1     # something
    return figures


def test_chunk_by_chunk_under_retention_the_counters_only_grow_and_end_at_the_sql(tmp_path, expected):
    """The capture's chunks arrive five at a time, retention keeps the last six, a chunk is being
    written (.tmp); the exporter keeps 3 s of rows: what it forgot must not change a figure."""
    chunks = sorted((FIXTURE / "chunks").glob("*.kvtc"))
    capture = tmp_path / "capture"
    (capture / "chunks").mkdir(parents=True)
    shutil.copy(FIXTURE / "capture.json", capture)
    shutil.copytree(FIXTURE / "servers", capture / "servers")
    exporter = Exporter(capture, window_s=3.0)
    before: dict = {}
    for i in range(0, len(chunks), 5):
        for path in chunks[i:i + 5]:
            shutil.copy(path, capture / "chunks" / path.name)
        for old in sorted((capture / "chunks").glob("*.kvtc"))[:-6]:
            old.unlink()
        (capture / "chunks" / f".{chunks[0].name}.tmp").write_bytes(b"KVTRACE-CHUNK 1\nhalf a chunk")
        exporter.poll()
        now = scraped(exporter)
        for key, value in before.items():
            assert now[key] >= value, key
        before = {key: value for key, value in now.items() if key[0] in COUNTERS}
    assert_figures(now, {k: v for k, v in expected.items() if k[0] != "kvtrace_thrash_verdict"})
    verdict = sql_verdict(FIXTURE, tmp_path, 3.0)   # of the exporter's window, not of the whole capture
    assert {k[1] for k, v in now.items() if k[0] == "kvtrace_thrash_verdict" and v == 1} == {
        frozenset({("verdict", verdict)})}
    assert exporter.reader.num_read == len(chunks) and exporter.reader.num_unreadable == 0


def test_the_exporters_runs_of_new_tokens_carry_each_tokens_predecessor_as_a_whole_run_would(tmp_path):
    """The exporter writes each token once, in the poll that read it: its predecessor (the gap's
    start) must be the one a run of every chunk finds, the last token of an earlier poll included,
    while a 3 s window prunes what the figures no longer need."""
    import pyarrow.parquet as pq

    from kvtrace.trace.schema import token_predecessors
    from kvtrace.vllm.follow import LiveTrace
    from kvtrace.vllm.importer import read_chunk

    chunks = sorted((FIXTURE / "chunks").glob("*.kvtc"))
    trace, written, every = LiveTrace(3.0), [], {c: [] for c in ("req_id", "sample", "idx", "step", "ts_s")}
    across = 0   # tokens whose predecessor came in an earlier poll
    for i, path in enumerate(chunks):
        chunk = read_chunk(path)
        t = chunk.get("tokens") or {name: [] for name in every}   # a chunk of no decode step has none
        for name in every:
            every[name].extend(t[name])
        trace.add("1", chunk)
        run = tmp_path / f"poll-{i}"
        rows = trace.write_run("1", run, "live", window_s=None, info={}, command="", tokens="new")
        assert rows["tokens"] == len(t["idx"])                        # the new ones, no more
        if rows["tokens"]:
            here = set(zip(t["req_id"], t["sample"], t["idx"]))
            for r in pq.read_table(run / "tokens").to_pylist():      # the gap: on any clock the same
                gap = None if r["prev_ts_s"] is None else round(r["ts_s"] - r["prev_ts_s"], 6)
                written.append((r["req_id"], r["sample"], r["idx"], r["prev_step"], gap))
                across += gap is not None and (r["req_id"], r["sample"], r["idx"] - 1) not in here
        trace.prune(every_s=0.3)
    prev_step, prev_ts = token_predecessors(every["req_id"], every["sample"], every["idx"], every["step"],
                                            every["ts_s"])
    whole = sorted((r, n, i, p, round(t - pt, 6) if pt is not None else None)
                   for r, n, i, p, t, pt in zip(every["req_id"], every["sample"], every["idx"], prev_step,
                                                every["ts_s"], prev_ts))
    assert sorted(written) == whole
    assert across > 10


def test_the_verdict_is_thrash_sqls_on_the_last_window(tmp_path):
    exporter = Exporter(FIXTURE, window_s=60.0)
    exporter.poll()
    server = "20261119T000008Z-24953"   # the fixture's one server
    assert exporter.verdicts == {server: sql_verdict(FIXTURE, tmp_path, 60.0)}
    assert exporter.verdicts[server] == "occasional"   # 3 preemptions in it
    exporter.close()


def test_a_chunk_removed_between_listing_and_reading_is_skipped(tmp_path, monkeypatch):
    capture = tmp_path / "capture"
    shutil.copytree(FIXTURE, capture)
    gone = sorted((capture / "chunks").glob("*.kvtc"))[0]
    real = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path.name == gone.name:
            path.unlink()
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    reader = ChunkReader(capture)
    assert len(reader.new_chunks()) == len(list((FIXTURE / "chunks").glob("*.kvtc"))) - 1
    assert reader.new_chunks() == []   # each chunk once


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's prometheus package; "
                                               "scripts/test.sh installs it)")
def test_prometheus_scrapes_the_sql_of_the_window(tmp_path, expected):
    """A real Prometheus server scrapes the exporter; its HTTP API answers the SQL's figures."""
    with exporter_scraped(FIXTURE, tmp_path) as scrape:
        def query(expr: str) -> list[dict] | None:
            body = get(f"{scrape.api}/query?query=" + urllib.parse.quote(expr))
            return json.loads(body)["data"]["result"] if body else None

        wait("the exporter", lambda: get(f"http://127.0.0.1:{scrape.exporter_port}/metrics"), (scrape.exporter,))
        wait("a scrape", lambda: query('kvtrace_steps_total{job="kvtrace"}') or None, (scrape.prometheus,))
        got = {}
        for name in sorted({name for name, _ in expected}):
            for series in query(f'{name}{{job="kvtrace"}}'):
                labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "job", "instance")}
                got[name, frozenset(labels.items())] = float(series["value"][1])
        assert_figures(got, expected)
        assert query('up{job="kvtrace"}')[0]["value"][1] == "1"
    assert scrape.exporter.returncode == 0, scrape.output
    assert f"serving metrics of {FIXTURE}" in scrape.output and "Traceback" not in scrape.output


def test_watch_once_draws_the_dashboard_of_the_last_window():
    result = CliRunner().invoke(app, ["capture", "watch", str(FIXTURE), "--once", "--window", "90s"],
                                env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "server 20261119T000008Z-24953, last 90 s" in result.output
    assert "vLLM 0.32.0" in result.output and "thrash" in result.output


def test_watch_redraws_until_ctrl_c():
    """On a terminal (a pty: Rich's Live draws only there), the dashboard comes, then Ctrl-C ends it."""
    primary, secondary = pty.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "kvtrace", "capture", "watch", str(FIXTURE), "--refresh", "200ms"],
                             cwd=ROOT, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary,
                             env={**os.environ, "COLUMNS": "100", "LINES": "60"}, preexec_fn=interruptible)
    os.close(secondary)
    out, deadline, interrupted = b"", time.monotonic() + 120, False
    while watch.poll() is None and time.monotonic() < deadline:
        if select.select([primary], [], [], 0.5)[0]:
            try:
                out += os.read(primary, 65536)
            except OSError:   # the other side closed
                break
        if not interrupted and out.count(b"server 20261119T000008Z-24953") >= 2:   # drawn, and drawn again
            watch.send_signal(signal.SIGINT)
            interrupted = True
    watch.wait(timeout=30)
    os.close(primary)
    assert interrupted, out[-2000:]
    assert watch.returncode == 0 and b"Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--window", "five"], "--window: expected a positive duration"),
    (["--refresh", "0s"], "--refresh: expected a positive duration"),
])
def test_watch_refuses_a_bad_duration(args, message):
    result = CliRunner().invoke(app, ["capture", "watch", str(FIXTURE), "--once", *args])
    assert result.exit_code == 2 and message in result.output


def test_metrics_refuses_a_missing_folder(tmp_path):
    result = CliRunner().invoke(app, ["capture", "metrics", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such capture folder" in result.output
