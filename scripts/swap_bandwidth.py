"""Swap bandwidth of the engine's own copy path: device -> host and back, for a batch of blocks."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="shape preset (dummy weights)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    model = args.model or ("llama-3.2-1b" if args.device.startswith("cuda") else "smollm2-135m")
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device=args.device, dtype=dtype,
                                    num_gpu_blocks=args.blocks * 2, num_cpu_blocks=args.blocks,
                                    preemption_mode="swap"))
    runner = engine.runner
    out_map = [(2 * i, i) for i in range(args.blocks)]          # scattered device blocks
    in_map = [(i, 2 * i + 1) for i in range(args.blocks)]
    nbytes = args.blocks * engine.geometry.bytes_per_block
    results = {"swap_out": [], "swap_in": []}
    for _ in range(args.repeat):
        for name, fn, mapping in (("swap_out", runner.swap_out, out_map), ("swap_in", runner.swap_in, in_map)):
            if runner.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            timing = fn(mapping)
            if runner.is_cuda:
                torch.cuda.synchronize()
                ms = timing[0].elapsed_time(timing[1])
            else:
                ms = (time.perf_counter() - t0) * 1000
            results[name].append(nbytes / (ms / 1000) / 1e9)
    print(f"{model} {dtype} on {args.device}: {args.blocks} blocks x {engine.geometry.bytes_per_block} B = {nbytes / 1e6:.1f} MB")
    for name, rates in results.items():
        print(f"{name}: median {statistics.median(rates):.2f} GB/s (min {min(rates):.2f}, max {max(rates):.2f})")


if __name__ == "__main__":
    main()
