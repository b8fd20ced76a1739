"""Each token's predecessor is in the trace (schema 2: tokens.prev_step, prev_ts_s), so that ITL is
a scan. The recorded columns must say exactly what the window over each sequence's tokens says
(the definition older traces are analysed with), through preemption, swap and n > 1; and a trace
without them (schema 1) must be analysed as before."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from engine.events import RequestStats
from kvtrace.cli.app import app
from kvtrace.record import run as run_module
from kvtrace.record.recorder import TraceWriter
from kvtrace.trace import db
from tests.helpers.tracegen import recompute_run, swap_run

# the same sequence's previous token by the definition of analyses/_itl.sql's fallback
WINDOWED = """
    SELECT req_id, sample, idx, step, ts_s, prev_step, prev_ts_s,
           lag(step) OVER seq AS lag_step, lag(ts_s) OVER seq AS lag_ts_s
    FROM tokens
    WINDOW seq AS (PARTITION BY run_id, req_id, sample ORDER BY idx)"""


def record(tmp_path: Path, name: str, *args: str) -> Path:
    prompts = [[11 + i + j for j in range(7 + i % 3)] for i in range(6)]
    rows = [{"id": f"r{i}", "arrival_s": 0.0, "prompt_token_ids": p, "max_tokens": 6 + i % 4, "ignore_eos": True,
             **({"n": 3, "temperature": 1.0, "seed": 5} if i in (1, 4) else {})} for i, p in enumerate(prompts)]
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "-w", str(workload), "-o", str(out), "-q",
                                      "--block-size", "4", "--num-gpu-blocks", "12", "--watermark", "0",
                                      "--backlog", "--no-enable-prefix-caching", *args])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("engine", ["real", "sim"])
@pytest.mark.parametrize("max_rows", [None, 5])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_recorded_predecessors_are_the_windowed_ones(tmp_path, monkeypatch, mode, max_rows, engine):
    """Also with chunks of 5 rows: a sequence's first token in a chunk finds its predecessor in an
    earlier chunk (the writer works out each chunk's predecessors on its own); and from the simulator,
    whose chunks the engine's thread writes itself."""
    if max_rows:
        monkeypatch.setattr(run_module, "TraceWriter", functools.partial(TraceWriter, max_rows=max_rows))
    sim = ["--engine", "sim", "--hardware", "a100-80gb"] if engine == "sim" else []
    run = record(tmp_path, mode, "--preemption-mode", mode, "--num-cpu-blocks", "32", *sim)
    if max_rows:
        assert len(list((run / "tokens").glob("part-*.parquet"))) > 10
    con = db.connect([run])
    assert con.sql("SELECT token_gaps_recorded FROM runs").fetchall() == [(True,)]
    rows = con.sql(WINDOWED).fetchall()
    mismatched = [r for r in rows if (r[5], r[6]) != (r[7], r[8])]
    assert not mismatched, mismatched[:5]
    # the run exercises what could set them apart: preemptions of this mode, n > 1 samples, and
    # gaps that span a preemption (the predecessor is the token before it, not a re-emitted one)
    kinds = dict(con.sql("SELECT kind, count(*) FROM kv_events GROUP BY kind").fetchall())
    assert kinds.get("preempt", 0) >= 2
    assert kinds.get("swap_out" if mode == "swap" else "reprefill", 0) >= 1
    assert con.sql("SELECT count(DISTINCT sample) FROM tokens WHERE req_id = 'r1'").fetchall() == [(3,)]
    spanning = con.sql("""
        SELECT count(*) FROM tokens t JOIN kv_events e USING (run_id, req_id, sample)
        WHERE e.kind = 'preempt' AND e.step > t.prev_step AND e.step <= t.step""").fetchall()[0][0]
    assert spanning >= 2
    assert sum(1 for r in rows if r[2] == 0) == con.sql("SELECT count(*) FROM requests").fetchall()[0][0]
    assert all(r[5] is None and r[6] is None for r in rows if r[2] == 0)


def analyses_of(run_dirs: list[Path]) -> dict[str, list[dict]]:
    con = db.connect(run_dirs)
    return {info.name: db.records(db.run_analysis(con, info.name)) for info in db.list_analyses()}


@pytest.mark.long  # records a run through the CLI
def test_a_trace_without_them_is_analysed_the_same(tmp_path):
    """Schema 1 runs (no prev_* columns): _itl computes them with the window; every analysis
    gives what it gives on the same run with them, alone and beside a schema 2 run."""
    new = [recompute_run(tmp_path / "new"), swap_run(tmp_path / "new")]
    old = [recompute_run(tmp_path / "old", token_gaps=False), swap_run(tmp_path / "old", token_gaps=False)]
    con = db.connect(old)
    assert con.sql("SELECT token_gaps_recorded FROM runs").fetchall() == [(False,), (False,)]
    assert con.sql("SELECT count(*) FROM tokens WHERE prev_ts_s IS NOT NULL").fetchall() == [(0,)]
    assert con.sql("SELECT count(*) FROM _itl").fetchall() == [(10,)]   # per run: A 4 tokens, B 3
    assert analyses_of(old) == analyses_of(new)
    mixed = analyses_of([old[0], new[1]])
    assert mixed == analyses_of([new[0], new[1]])
    assert any(row["metric"] == "itl" for row in mixed["latency"])


@pytest.mark.long  # records a run through the CLI
def test_a_writer_that_leaves_them_null_is_read_as_schema_1(tmp_path):
    """A trace with the columns but no values in them (a writer that adopted the schema but not
    the predecessors) must not lose its ITL: the analyses compute the predecessors."""
    run = recompute_run(tmp_path / "new")
    nulls = tmp_path / "nulls" / "rec"
    shutil.copytree(run, nulls)
    for chunk in (nulls / "tokens").glob("part-*.parquet"):
        table = pq.read_table(chunk)
        for name, kind in (("prev_step", pa.int64()), ("prev_ts_s", pa.float64())):
            table = table.set_column(table.schema.get_field_index(name), name, pa.nulls(table.num_rows, kind))
        pq.write_table(table, chunk)
    con = db.connect([nulls])
    assert con.sql("SELECT token_gaps_recorded FROM runs").fetchall() == [(False,)]
    assert con.sql("SELECT count(*) FROM _itl").fetchall() == [(5,)]
    assert analyses_of([nulls]) == analyses_of([run])


def test_the_vllm_importer_writes_them(tmp_path):
    """A vLLM capture is converted whole: its tokens get the same predecessors as the window's,
    with several tokens of a sequence in one step (same ts_s) and a window that cuts a sequence."""
    from kvtrace.vllm.importer import convert
    from tests.helpers.vllm_runs import ITEMS, chunk, write_capture

    tokens = [{"req_id": "1_kvt3-deadbeef", "sample": 0, "idx": i, "token_id": 5, "step": 3 + i // 2,
               "ts_s": 101.0 + i // 2} for i in range(6)]            # two tokens a step
    tokens += [{"req_id": "kvt0-1a2b3c4d", "sample": 0, "idx": i, "token_id": 5, "step": i, "ts_s": 99.0 + i}
               for i in range(4)]                                    # idx 0 falls before the window
    write_capture(tmp_path / "capture", [chunk({"tokens": tokens[::-1],
                                                   "steps": [{"step": 0, "start_s": 99.0, "end_s": 99.1}]})])
    run = tmp_path / "run"
    convert(tmp_path / "capture", run, "run", list(ITEMS.values()), origin=100.0, interrupted=False,
            window=(99.5, 200.0))
    (run / "meta.json").write_text('{"run_id": "run", "schema_version": 2}')
    con = db.connect([run])
    assert con.sql("SELECT token_gaps_recorded FROM runs").fetchall() == [(True,)]
    rows = con.sql(WINDOWED).fetchall()
    assert len(rows) == 9 and all((r[5], r[6]) == (r[7], r[8]) for r in rows), rows
    # a step's two tokens are one delivery: a gap for the first only, from the step before (none of 0 ms)
    assert sorted(round(g, 6) for (g,) in con.sql("SELECT gap_ms FROM _itl").fetchall()) == [1000.0] * 4


@pytest.mark.parametrize("engine_makes_tables", [False, True])
def test_a_chunk_that_cannot_be_written_fails_the_flush(tmp_path, monkeypatch, engine_makes_tables):
    """Whichever thread makes the chunks' tables, a write that fails is reported on the engine's thread."""
    writer = TraceWriter(tmp_path / "run", "run", engine_makes_tables=engine_makes_tables)

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "_store", broken)
    writer.add_request(RequestStats(req_id="r0", sample=0, n=1, priority=0, arrival_s=0.0, prompt_tokens=4,
                                    max_tokens=2, output_tokens=2, first_scheduled_s=0.0, first_token_s=0.1,
                                    finish_s=0.2, finish_reason="length", preemptions=0, swaps=0,
                                    recomputed_tokens=0, prefix_hit_tokens=0))
    with pytest.raises(RuntimeError, match="writing the trace failed: disk full"):
        writer.close()
