"""The Prometheus exporter's figures (`kvtrace capture metrics`) two ways: as the SQL library
computes them on a run converted from a capture folder, and as the exporter serves them."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvtrace.trace import db
from kvtrace.trace.schema import SCHEMA_VERSION
from kvtrace.vllm.importer import convert, read_chunks
from kvtrace.vllm.metrics import ITL_CAUSES, Exporter

Figures = dict[tuple[str, frozenset], float]   # (sample name, its labels) -> value
# the folder's figures, not a server's
HEALTH = ("kvtrace_capture_up", "kvtrace_capture_chunks_read_total", "kvtrace_capture_chunks_skipped_total",
          "kvtrace_capture_dropped_chunks_total")
COUNTERS = ("kvtrace_preemptions_total", "kvtrace_recomputed_tokens_total", "kvtrace_reprefill_cached_tokens_total",
            "kvtrace_requests_finished_total", "kvtrace_steps_total", "kvtrace_itl_seconds_count",
            "kvtrace_itl_seconds_sum", "kvtrace_itl_seconds_bucket")


def sql_figures(capture: Path, scratch: Path) -> Figures:
    """The exporter's figures as the SQL library computes them on the whole capture, converted as
    `kvtrace record --engine vllm` converts it (kvtrace.vllm.importer)."""
    run = scratch / "whole"
    convert(capture, run, "whole", [], 0.0, interrupted=False)
    (run / "meta.json").write_text(json.dumps({"run_id": "whole", "schema_version": SCHEMA_VERSION,
                                               "status": "completed"}))
    con = db.connect([run])
    figures: Figures = {}

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
    con.close()
    return figures


def sql_verdict(capture: Path, scratch: Path, window_s: float) -> str:
    """thrash.sql's verdict on the run of the capture's last `window_s` seconds (up to its last step's end)."""
    end = max(read_chunks(capture)["steps"]["end_s"])
    run = scratch / "last-window"
    convert(capture, run, "last-window", [], 0.0, interrupted=False, window=(end - window_s, end))
    (run / "meta.json").write_text(json.dumps({"run_id": "last-window", "schema_version": SCHEMA_VERSION,
                                               "status": "completed"}))
    con = db.connect([run])
    verdict = db.records(db.run_analysis(con, "thrash"))[0]["verdict"]
    con.close()
    return verdict


def scraped(exporter: Exporter) -> Figures:
    """What a scrape of `exporter` reads, parsed back from the exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}


def assert_figures(got: Figures, expected: Figures) -> None:
    for key, value in expected.items():
        assert got.get(key) == pytest.approx(value, rel=1e-9, abs=1e-9), key


def per_server(figures: Figures) -> dict[str, Figures]:
    """A scrape's figures of each server, its `server` label taken off ('' where they carry none: a folder of
    one server)."""
    found: dict[str, Figures] = {}
    for (name, labels), value in figures.items():
        if name not in HEALTH:
            server = dict(labels).get("server", "")
            found.setdefault(server, {})[name, frozenset((k, v) for k, v in labels if k != "server")] = value
    return found


def one_server_folder(capture: Path, server_id: str, folder: Path) -> Path:
    """`folder`: the server's identity and chunks of the capture folder, as if it had written there alone."""
    (folder / "servers").mkdir(parents=True)
    (folder / "chunks").mkdir()
    (folder / "servers" / f"{server_id}.json").write_bytes((capture / "servers" / f"{server_id}.json").read_bytes())
    for path in (capture / "chunks").glob(f"{server_id}_*"):
        (folder / "chunks" / path.name).write_bytes(path.read_bytes())
    return folder


def ranks_figures(capture: Path, server_ids: dict[int, str], scratch: Path) -> tuple[dict[str, Figures],
                                                                                     dict[str, Figures]]:
    """The exporter's figures of each data-parallel rank (`server_ids`: rank -> server id) on the folder of
    them all, by server label, and the exporter's on a folder of each rank alone, by the same label."""
    exporters = {"both": Exporter(capture)} | {f"dp{rank}": Exporter(one_server_folder(
        capture, server_id, scratch / f"alone{rank}")) for rank, server_id in server_ids.items()}
    figures = {}
    try:
        for name, exporter in exporters.items():
            exporter.poll()
            figures[name] = per_server(scraped(exporter))
    finally:
        for exporter in exporters.values():
            exporter.close()
    both = figures.pop("both")
    return both, {label: alone[""] for label, alone in figures.items()}
