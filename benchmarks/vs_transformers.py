"""Suite `transformers`: kvtrace's engine against Hugging Face `generate` in left-padded static batches.

Same weights, same token-id prompts, exactly the same number of output tokens per request (EOS
cleared in transformers, ignore_eos in kvtrace). transformers runs `batch_size` requests at a time,
in workload order, each batch as long as its longest request; kvtrace batches continuously with at
most `batch_size` sequences. Only the requested tokens count as output. Interleaved after a warm-up.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.kvtrace_runner import KvtraceRunner, ensure_weights
from benchmarks.peer import PeerProcess
from benchmarks.results import Section, markdown_table
from benchmarks.run_result import SERVING_HEADER, agreement, serving_row
from benchmarks.stats import fmt_ratio, interleave, median, ratios
from benchmarks.workload import describe, longest, random_requests

BLOCK_SIZE = 32
GOAL = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each engine")
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' batch = kvtrace's max_num_seqs")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--traced", action="store_true", help="kvtrace with the Parquet tracer on")
    parser.add_argument("--weights", type=Path, default=None, help="HF folder (default: exported once to the cache)")


def run(args: argparse.Namespace) -> None:
    weights = ensure_weights(args.weights)
    requests = random_requests(args.num_requests, (16, 400), (16, 128), seed=args.seed)
    max_model_len = longest(requests)
    num_blocks = args.batch_size * -(-max_model_len // BLOCK_SIZE)  # every running sequence at full length
    kvtrace = KvtraceRunner(weights, block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=args.batch_size,
                            max_num_batched_tokens=2048, max_model_len=max_model_len)
    section = Section("transformers")
    section.add(f"Workload: {describe(requests)}. transformers: `generate` in left-padded batches of "
                f"{args.batch_size} in workload order, greedy, generation-config EOS cleared; kvtrace: continuous "
                f"batching, max {args.batch_size} sequences, {num_blocks} KV blocks of {BLOCK_SIZE} (no preemption), "
                f"tracer {'on' if args.traced else 'off'}. 2 torch threads each. {args.repeats} timed runs each, "
                f"interleaved, after one warm-up run each.")
    print("starting transformers (not timed) ...", flush=True)
    with PeerProcess("hf", "transformers_driver.py", {"model": str(weights), "batch_size": args.batch_size}) as hf:
        info = hf.info
        section.peer_software = (f"transformers {info['transformers']} (torch {info['torch']}, "
                                 f"{info['torch_threads']} threads, attention {info['attn_implementation']})")
        kvtrace.run(requests, traced=args.traced)
        hf.run_result(requests)
        runs = interleave({"kvtrace": lambda: kvtrace.run(requests, traced=args.traced),
                           "transformers": lambda: hf.run_result(requests)}, args.repeats)
    kv, peer = runs["kvtrace"], runs["transformers"]
    throughput = ratios([r.output_tokens_per_s for r in kv], [r.output_tokens_per_s for r in peer])
    met = median(throughput) >= GOAL
    section.add(markdown_table(SERVING_HEADER, [serving_row("kvtrace" + (" (traced)" if args.traced else ""), kv),
                                                serving_row(f"transformers (batch {args.batch_size})", peer)])
                + f"\n\n- output tok/s, kvtrace / transformers: **{fmt_ratio(throughput)}** (median of pairwise "
                  f"ratios, range)\n- greedy tokens: {agreement(kv[0], peer[0])}\n"
                  f"- transformers' TTFT/ITL are per batch: a request waits for the batches before it.\n\n"
                  f"Goal kvtrace ≥ {GOAL:.0f}× transformers: **{'met' if met else 'missed'}**.")
    section.write(f"kvtrace / transformers output tok/s: {fmt_ratio(throughput)}; goal ≥ {GOAL:.0f}×: "
                  f"{'met' if met else 'missed'}")
