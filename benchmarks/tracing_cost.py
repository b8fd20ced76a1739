"""Suite `tracing`: what recording costs. The same replay with the Parquet tracer and with the no-op
tracer, interleaved (traced, untraced, traced, ...), each on a fresh engine; the traced duration
includes closing the trace (every chunk on disk)."""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.kvtrace_runner import MODEL
from benchmarks.results import Section, markdown_table
from benchmarks.stats import fmt_ratio, interleave, median, ratios
from engine.build import build_engine
from engine.config import EngineConfig
from engine.model.loader import load_weights
from kvtrace.record.recorder import TraceWriter
from kvtrace.record.replay import prepare, replay
from kvtrace.workload import load_workload

GOAL = 1.02
EXAMPLES = Path(__file__).resolve().parent.parent / "traces" / "examples"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", type=Path, default=EXAMPLES / "bursty.jsonl")
    parser.add_argument("--max-requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed replays of each")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=64, help="small enough to preempt (more events)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--model", default=MODEL)


def run(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                          max_num_seqs=args.max_num_seqs, preemption_mode="recompute")
    loaded = load_weights(args.model)
    requests = load_workload(args.workload)[:args.max_requests]
    rows_written: list[int] = []

    def replay_once(traced: bool) -> tuple[float, int, int]:
        """(seconds, output tokens, preemptions) of one backlog replay on a fresh engine."""
        trace_dir = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
        try:
            writer = TraceWriter(trace_dir, "bench") if traced else None
            engine = build_engine(config, tracer=writer, loaded=loaded)
            items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=True,
                            workload_name=str(args.workload))
            t0 = time.perf_counter()
            stats = replay(engine, items)
            if writer is not None:
                writer.close()
                rows_written.append(sum(writer.rows_written.values()))
            return time.perf_counter() - t0, stats.num_output_tokens, stats.num_preemptions
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)

    section = Section("tracing")
    replay_once(True)  # warm-up
    runs = interleave({"Parquet tracer": lambda: replay_once(True), "no-op tracer": lambda: replay_once(False)},
                      args.repeats)
    traced, untraced = runs["Parquet tracer"], runs["no-op tracer"]
    slowdown = ratios([t[0] for t in traced], [t[0] for t in untraced])
    rows = [[name, " ".join(f"{t[0]:.2f}" for t in results), f"{median([t[0] for t in results]):.2f}",
             f"{median([t[1] / t[0] for t in results]):.1f}", str(results[0][1]), str(results[0][2])]
            for name, results in runs.items()]
    met = median(slowdown) <= GOAL
    section.add(f"Replay of the first {len(requests)} requests of `{args.workload.name}` as a backlog (all at t=0), "
                f"{config.model}, block size {config.block_size}, {config.num_gpu_blocks} KV blocks, "
                f"max {config.max_num_seqs} sequences, recompute preemption; {args.repeats} replays each, "
                f"interleaved, after one warm-up. Trace rows written per traced replay: "
                f"{median(rows_written[1:] or rows_written):,.0f}.")
    section.add(markdown_table(["tracer", "each replay s", "median s", "median tok/s", "output tokens", "preemptions"],
                               rows)
                + f"\n\nTraced / untraced duration: **{fmt_ratio(slowdown)}** (median of pairwise ratios, range). "
                  f"Goal ≤ {GOAL:.2f} (≤ 2 % slower): **{'met' if met else 'missed'}**.")
    section.write(f"traced / untraced replay: {fmt_ratio(slowdown)}; goal ≤ {GOAL:.2f}: {'met' if met else 'missed'}")
