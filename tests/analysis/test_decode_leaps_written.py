"""A simulated replay's leaps (engine/sim/leap.py: decode-only steps taken at once)
reach the trace writer whole (TraceWriter.on_decode_leap: no record made per step), and the tables
written are the ones the same steps give handed over one by one (the records the engine gives a tracer
without that method): every row of every table, with chunks closing inside and between leaps."""
from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.build import build_engine
from engine.config import EngineConfig
from kvtrace.record.recorder import TraceWriter
from kvtrace.record.replay import prepare, replay
from tests.engine.test_simulation import backlog_workload

KEYS = {"steps": ["step"], "kv_events": ["seq"], "tokens": ["step", "req_id", "sample", "idx"],
        "requests": ["req_id", "sample"]}


class StepByStep:
    """The writer without `on_decode_leap`: the engine hands it each leap's step records."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer

    def on_step(self, record) -> None:
        self.writer.on_step(record)


class Leaps:
    """The writer as it is, counting the leaps and steps it takes at once."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer, self.leaps, self.steps, self.events, self.copies = writer, 0, 0, 0, 0

    def on_step(self, record) -> None:
        self.writer.on_step(record)

    def on_decode_leap(self, leap) -> None:
        self.leaps += 1
        self.steps += leap.num_steps
        self.events += len(leap.events)
        self.copies += len(leap.copy_events)
        self.writer.on_decode_leap(leap)


def replayed(tmp_path, name: str, wrap, max_rows: int, settings: dict):
    """Replay the workload on the simulator into run folder `name`; return (the tracer, the tables)."""
    requests = backlog_workload(5, num_requests=14)
    rng = random.Random(11)
    for r in requests:   # long outputs, arrivals apart: decode-only steps between them
        r.arrival_s = round(rng.uniform(0.0, 0.3), 4)
        r.max_tokens = rng.randint(30, 70)
        r.output_tokens = rng.choice([None, rng.randint(20, r.max_tokens)])
    writer = TraceWriter(tmp_path / name, "run", max_rows=max_rows, engine_makes_tables=True)
    tracer = wrap(writer)
    engine = build_engine(EngineConfig(model="tiny", load_format="dummy", engine="sim", hardware="a100-80gb",
                                       block_size=4, watermark=0.0, max_num_batched_tokens=64, **settings), tracer)
    items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=False, workload_name="w")
    replay(engine, items)
    writer.close()
    tables = {}
    for table, key in KEYS.items():
        parts = sorted((tmp_path / name / table).glob("part-*.parquet"))
        tables[table] = pa.concat_tables(pq.read_table(p) for p in parts).sort_by([(k, "ascending") for k in key])
    return tracer, tables


@pytest.mark.parametrize("max_rows", [40, 200_000])
@pytest.mark.parametrize("settings", [dict(num_gpu_blocks=200), dict(num_gpu_blocks=40),
                                      dict(num_gpu_blocks=60, enable_prefix_caching=False),
                                      # a host KV tier's stores finishing in leaps' steps (one that evicts)
                                      dict(num_gpu_blocks=200, num_offload_blocks=64),
                                      dict(num_gpu_blocks=40, num_offload_blocks=12)])
def test_leaps_are_written_as_their_steps_one_by_one(tmp_path, settings, max_rows):
    leaped, tables = replayed(tmp_path, "leaps", Leaps, max_rows, settings)
    _, expected = replayed(tmp_path, "steps", StepByStep, max_rows, settings)
    # leaps of several steps, taking blocks and caching full ones as they go
    assert leaped.leaps >= 5 and leaped.steps >= 3 * leaped.leaps and leaped.events >= 5
    assert (leaped.copies >= 3) == ("num_offload_blocks" in settings), leaped.copies
    for name, table in tables.items():
        assert table.num_rows == expected[name].num_rows, name
        for column in table.column_names:
            assert table[column].equals(expected[name][column]), f"{name}.{column}"
