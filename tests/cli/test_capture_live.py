"""`kvtrace capture metrics` and `kvtrace capture watch` on a capture folder of real vLLM.

The folder is tests/fixtures/captures/bursts (vLLM 0.32.0's CPU build, two bursts of requests into
a pool too small for them; see tests/fixtures/README.md). Every figure the exporter serves must be
the SQL library's on a run converted from the same chunks (kvtrace.vllm.importer, as `kvtrace
record --engine vllm` converts): scraped by a real Prometheus server, and read chunk by chunk while
a tiny retention removes the oldest, with a short window that makes the exporter forget.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.trace import db
from kvtrace.trace.schema import SCHEMA_VERSION
from kvtrace.vllm.importer import convert
from kvtrace.vllm.metrics import ITL_CAUSES, ChunkReader, Exporter

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "captures" / "bursts"
PROMETHEUS = shutil.which("prometheus")
COUNTERS = ("kvtrace_preemptions_total", "kvtrace_recomputed_tokens_total", "kvtrace_reprefill_cached_tokens_total",
            "kvtrace_requests_finished_total", "kvtrace_steps_total", "kvtrace_itl_seconds_count",
            "kvtrace_itl_seconds_sum", "kvtrace_itl_seconds_bucket")


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[tuple[str, frozenset], float]:
    """The exporter's figures as the SQL library computes them on the whole capture, converted."""
    run = tmp_path_factory.mktemp("capture-sql") / "whole"
    convert(FIXTURE, run, "whole", [], 0.0, interrupted=False)
    (run / "meta.json").write_text(json.dumps({"run_id": "whole", "schema_version": SCHEMA_VERSION,
                                               "status": "completed"}))
    con = db.connect([run])
    figures: dict[tuple[str, frozenset], float] = {}

    def put(name: str, value: float, **labels: str) -> None:
        figures[name, frozenset(labels.items())] = value

    preemptions = Counter(r["reason"] for r in db.records(db.run_analysis(con, "preemptions")))
    for reason in ("recompute", "swap", "swap-full-fallback"):
        put("kvtrace_preemptions_total", preemptions[reason], reason=reason)
    recompute = db.records(db.run_analysis(con, "recompute"))[0]
    put("kvtrace_recomputed_tokens_total", recompute["recomputed_tokens"])
    put("kvtrace_reprefill_cached_tokens_total", recompute["reprefill_cached_tokens"])
    for reason, count in con.execute("SELECT finish_reason, count(*) FROM requests GROUP BY 1").fetchall():
        put("kvtrace_requests_finished_total", count, finish_reason=reason)
    put("kvtrace_steps_total", con.execute("SELECT count(*) FROM steps").fetchone()[0])
    # every gap is a cliff above a threshold of a nanosecond: itl_cliffs' cause of every gap
    cliffs = db.records(db.run_analysis(con, "itl_cliffs", threshold_ms=1e-6))
    assert len(cliffs) == con.execute("SELECT count(*) FROM _itl").fetchone()[0]   # no gap of zero length
    for cause in ITL_CAUSES:
        gaps = [c["gap_ms"] / 1000 for c in cliffs if c["cause"] == cause]
        put("kvtrace_itl_seconds_count", len(gaps), cause=cause)
        put("kvtrace_itl_seconds_sum", sum(gaps), cause=cause)
        put("kvtrace_itl_seconds_bucket", sum(g <= 0.1 for g in gaps), cause=cause, le="0.1")
        put("kvtrace_itl_seconds_bucket", len(gaps), cause=cause, le="+Inf")
    last = db.records(db.run_analysis(con, "pool"))[-1]
    for name in ("used", "cached", "free", "total"):
        put(f"kvtrace_kv_{name}_blocks", last[f"{name}_blocks"])
    verdict = db.records(db.run_analysis(con, "thrash"))[0]["verdict"]
    for name in ("none", "occasional", "sustained"):
        put("kvtrace_thrash_verdict", float(name == verdict), verdict=name)
    assert preemptions["recompute"] == 10 and verdict == "occasional"   # the fixture shows something
    return figures


def scraped(exporter: Exporter) -> dict[tuple[str, frozenset], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}


def assert_figures(got: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert got.get(key) == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_chunk_by_chunk_under_retention_the_counters_only_grow_and_end_at_the_sql(tmp_path, expected):
    """The capture's chunks arrive five at a time, retention keeps the last six, a chunk is being
    written (.tmp); the exporter keeps 3 s of rows: what it forgot must not change a figure."""
    chunks = sorted((FIXTURE / "chunks").glob("*.pkl"), key=lambda p: int(p.stem.split("-")[1]))
    capture = tmp_path / "capture"
    (capture / "chunks").mkdir(parents=True)
    shutil.copy(FIXTURE / "capture.json", capture)
    exporter = Exporter(capture, window_s=3.0)
    before: dict = {}
    for i in range(0, len(chunks), 5):
        for path in chunks[i:i + 5]:
            shutil.copy(path, capture / "chunks" / path.name)
        for old in sorted((capture / "chunks").glob("*.pkl"))[:-6]:
            old.unlink()
        (capture / "chunks" / f".{chunks[0].stem}-999999.pkl.tmp").write_bytes(b"\x80\x04half a chunk")
        exporter.poll()
        now = scraped(exporter)
        for key, value in before.items():
            assert now[key] >= value, key
        before = {key: value for key, value in now.items() if key[0] in COUNTERS}
    assert_figures(now, {k: v for k, v in expected.items() if k[0] != "kvtrace_thrash_verdict"})
    assert exporter.reader.num_read == len(chunks) and exporter.reader.num_unreadable == 0


def test_a_chunk_removed_between_listing_and_reading_is_skipped(tmp_path, monkeypatch):
    capture = tmp_path / "capture"
    shutil.copytree(FIXTURE, capture)
    gone = sorted((capture / "chunks").glob("*.pkl"))[0]
    real = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path.name == gone.name:
            path.unlink()
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    reader = ChunkReader(capture)
    assert len(reader.new_chunks()) == len(list((FIXTURE / "chunks").glob("*.pkl"))) - 1
    assert reader.new_chunks() == []   # each chunk once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()
    except OSError:
        return None


def _wait(what: str, check, timeout_s: float = 90.0, procs: tuple = ()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's prometheus package; "
                                               "scripts/test.sh installs it)")
def test_prometheus_scrapes_the_sql_of_the_window(tmp_path, expected):
    """A real Prometheus server scrapes the exporter; its HTTP API answers the SQL's figures."""
    exporter_port, prometheus_port = _free_port(), _free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "kvtrace", "capture", "metrics", str(FIXTURE),
                                 "--port", str(exporter_port), "--refresh", "500ms", "--window", "10m"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: kvtrace\n    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n")
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prometheus_port}/api/v1/query?query="

    def query(expr: str) -> list[dict] | None:
        body = _get(api + urllib.parse.quote(expr))
        return json.loads(body)["data"]["result"] if body else None

    try:
        _wait("the exporter", lambda: _get(f"http://127.0.0.1:{exporter_port}/metrics"), procs=(exporter,))
        _wait("a scrape", lambda: query('kvtrace_steps_total{job="kvtrace"}') or None, procs=(prometheus,))
        got = {}
        for name in sorted({name for name, _ in expected}):
            for series in query(f'{name}{{job="kvtrace"}}'):
                labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "job", "instance")}
                got[name, frozenset(labels.items())] = float(series["value"][1])
        assert_figures(got, expected)
        assert query('up{job="kvtrace"}')[0]["value"][1] == "1"
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        exporter.send_signal(signal.SIGINT)   # Ctrl-C
        out, _ = exporter.communicate(timeout=30)
    assert exporter.returncode == 0, out
    assert f"serving metrics of {FIXTURE}" in out and "Traceback" not in out


def test_watch_once_draws_the_dashboard_of_the_last_window():
    result = CliRunner().invoke(app, ["capture", "watch", str(FIXTURE), "--once", "--window", "90s"],
                                env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "server 24953, last 90 s" in result.output
    assert "vLLM 0.32.0" in result.output and "thrash" in result.output


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
