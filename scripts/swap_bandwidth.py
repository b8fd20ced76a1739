"""Swap bandwidth of the engine's own copy path: device -> host and back, for a batch of blocks.

On CUDA it is set against the peak of the same bytes in one pinned cudaMemcpyAsync each way (the
most a swap of that size can reach on this PCIe/NVLink link); the goal is engine / peak >= 0.8.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("KVTRACE_CUDA_GRAPHS", "0")  # no decode steps here: skip capturing graphs

from engine.build import build_engine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kernels import host_memory  # noqa: E402


def pinned_peak(nbytes: int, device: str, repeat: int) -> dict[str, float]:
    """GB/s of one pinned-host <-> device cudaMemcpyAsync of nbytes each way, median of `repeat`."""
    host = host_memory.pinned_empty(nbytes, torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates: dict[str, list[float]] = {"swap_out": [], "swap_in": []}
    for _ in range(repeat):
        for name, dst, src in (("swap_out", host, dev), ("swap_in", dev, host)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates[name].append(nbytes / (start.elapsed_time(end) / 1000) / 1e9)
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="shape preset (dummy weights)")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    model = args.model or ("llama-3.2-1b" if args.device.startswith("cuda") else "smollm2-135m")
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    engine = build_engine(EngineConfig(model=model, load_format="dummy", device=args.device, dtype=dtype,
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
    figures = {"model": model, "dtype": dtype, "device": args.device, "bytes": nbytes,
               "engine_gb_s": {name: statistics.median(rates) for name, rates in results.items()}}
    if runner.is_cuda:
        figures["pinned_peak_gb_s"] = pinned_peak(nbytes, args.device, args.repeat)
        figures["ratio"] = {name: figures["engine_gb_s"][name] / figures["pinned_peak_gb_s"][name] for name in results}
    for name, rates in results.items():
        line = f"{name}: median {statistics.median(rates):.2f} GB/s (min {min(rates):.2f}, max {max(rates):.2f})"
        if runner.is_cuda:
            line += (f"; pinned cudaMemcpyAsync peak {figures['pinned_peak_gb_s'][name]:.2f} GB/s, "
                     f"engine / peak {figures['ratio'][name]:.2f} (goal >= 0.8)")
        print(line)
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
