"""Suite `vllm`: kvtrace's engine (Parquet tracer on) against vLLM's CPU build, same weights and workload.

Both engines get the same token-id prompts and output lengths (ignore_eos), the same KV capacity in
tokens (vLLM gets one block more: its reserved null block), the same block size, the same most
concurrent sequences and token budget, prefix caching on, recompute preemption, and 2 threads each
(vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU=0 runs its model on both cores). Runs alternate kvtrace,
vLLM, kvtrace, vLLM, ... after one untimed warm-up run each; vLLM's start-up is not timed.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from benchmarks.kvtrace_runner import KvtraceRunner, ensure_weights
from benchmarks.peer import PeerProcess
from benchmarks.results import Section, markdown_table
from benchmarks.run_result import SERVING_HEADER, agreement, same_tokens_fraction, serving_row
from benchmarks.stats import fmt_ratio, interleave, median, percentile, ratios
from benchmarks.workload import describe, longest, random_requests
from engine.model.loader import load_weights

BLOCK_SIZE = 32
MAX_NUM_BATCHED_TOKENS = 2048
VLLM_ENV = {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@dataclass
class Variant:
    name: str
    num_blocks: int       # usable KV blocks of BLOCK_SIZE tokens, in both engines
    max_num_seqs: int


VARIANTS = {
    "ample": Variant("ample KV (96 blocks = 3,072 tokens, 8 seqs)", 96, 8),
    "constrained": Variant("constrained KV (16 blocks = 512 tokens, 16 seqs): preempts", 16, 16),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each engine per variant")
    parser.add_argument("--variants", default="ample,constrained", help="comma-separated: ample, constrained")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", type=Path, default=None, help="HF folder (default: exported once to the cache)")


def run(args: argparse.Namespace) -> None:
    weights = ensure_weights(args.weights)
    requests = random_requests(args.num_requests, (20, 200), (32, 96), seed=args.seed)
    max_model_len = longest(requests)
    loaded = load_weights(str(weights))
    section = Section("vllm")
    section.add(f"Workload: {describe(requests)}. Weights: SmolLM2-135M fp32 ({weights}). Block size "
                f"{BLOCK_SIZE}, token budget {MAX_NUM_BATCHED_TOKENS} per step, max_model_len {max_model_len}. "
                f"Threads: 2 for each engine (kvtrace: torch's 2 threads; vLLM: VLLM_CPU_NUM_OF_RESERVED_CPU=0, "
                f"model on both cores). kvtrace runs with the Parquet tracer on; its duration includes closing "
                f"the trace. Every run starts cold: a fresh kvtrace engine, and vLLM's prefix cache reset (else "
                f"every prompt would hit the previous run's blocks). {args.repeats} timed runs each, interleaved, "
                f"after one warm-up run each.")
    peer_software = ""
    throughput_medians: dict[str, float] = {}
    throughput_ratios: dict[str, str] = {}
    startups = []
    for key in args.variants.split(","):
        variant = VARIANTS[key]
        kvtrace = KvtraceRunner(weights, block_size=BLOCK_SIZE, num_blocks=variant.num_blocks,
                                max_num_seqs=variant.max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                max_model_len=max_model_len, loaded=loaded)
        config = {"model": str(weights), "block_size": BLOCK_SIZE, "num_blocks": variant.num_blocks,
                  "max_model_len": max_model_len, "max_num_seqs": variant.max_num_seqs,
                  "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS}
        print(f"{variant.name}: starting vLLM (not timed) ...", flush=True)
        with PeerProcess("vllm", "vllm_driver.py", config, env=VLLM_ENV) as vllm:
            info = vllm.info
            peer_software = (f"vLLM {info['vllm']} (torch {info['torch']}, {info['torch_threads']} threads, "
                             f"reserved CPUs {info['reserved_cpus']})")
            startups.append(f"{info['startup_s']:.0f} s")
            print(f"  vLLM ready after {info['startup_s']:.0f} s; warm-up runs", flush=True)
            kvtrace.run(requests, traced=True)
            vllm.run_result(requests)
            runs = interleave({"kvtrace": lambda: kvtrace.run(requests, traced=True),
                               "vllm": lambda: vllm.run_result(requests)}, args.repeats)
        kv, peer = runs["kvtrace"], runs["vllm"]
        throughput = ratios([r.output_tokens_per_s for r in kv], [r.output_tokens_per_s for r in peer])
        ttft = ratios([percentile(r.ttft_s, 50) for r in kv], [percentile(r.ttft_s, 50) for r in peer])
        itl = ratios([percentile(r.itl_s, 50) for r in kv], [percentile(r.itl_s, 50) for r in peer])
        section.add(f"### {variant.name}\n\n"
                    + markdown_table(SERVING_HEADER, [serving_row("kvtrace (traced)", kv), serving_row("vLLM", peer)])
                    + f"\n\n- output tok/s, kvtrace / vLLM: **{fmt_ratio(throughput)}** (median of pairwise ratios, "
                      f"range)\n- TTFT p50, kvtrace / vLLM: {fmt_ratio(ttft)} (lower is better)\n"
                      f"- ITL p50, kvtrace / vLLM: {fmt_ratio(itl)} (lower is better)\n"
                      f"- greedy tokens, first runs: {agreement(kv[0], peer[0])}; later runs repeat their engine's "
                      f"first run in {min(same_tokens_fraction(kv[0], r) for r in kv) * 100:.0f} % (kvtrace) and "
                      f"{min(same_tokens_fraction(peer[0], r) for r in peer) * 100:.0f} % (vLLM) of sequences")
        throughput_medians[key] = median(throughput)
        throughput_ratios[key] = fmt_ratio(throughput)
    met = all(r >= 1.0 for r in throughput_medians.values())
    section.add(f"vLLM start-up (not timed): {', '.join(startups)}. vLLM binds its 2 OpenMP threads to cores 0 and 1; "
                f"kvtrace's are not bound.\n\nGoal kvtrace ≥ vLLM output tok/s with tracing on: "
                f"**{'met' if met else 'missed'}** "
                f"({'; '.join(f'{k}: {r:.3f}×' for k, r in throughput_medians.items())}).")
    section.peer_software = peer_software
    section.write(f"kvtrace / vLLM output tok/s, tracer on: "
                  f"{'; '.join(f'{k} {r}' for k, r in throughput_ratios.items())}; goal ≥ 1×: "
                  f"{'met' if met else 'missed'}")
