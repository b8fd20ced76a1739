"""Suite `roofline`: each decode step against its memory-bandwidth lower bound, at batch 1, 8 and 32.

A decode step must read every weight once (30 layers and the LM head) and the KV of every position
its sequences attend to, so no step can be faster than (weight bytes + KV bytes) / bandwidth. The
bandwidth is the read rate of a sum over 1 GiB, measured before every round of steps (best of two),
because on a shared machine it moves with the neighbours' load: each step is set against the bound
of its own round, and the goal is the median of those ratios.
Beside the step, the same linear layers alone (the engine's `linear` on its fused weights) show
what the matmul kernels cost by themselves, and a profile of the step says where the rest goes.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from benchmarks.kvtrace_runner import KvtraceRunner, ensure_weights
from benchmarks.results import Section, markdown_table
from benchmarks.stats import median, percentile
from engine.events import StepRecord
from engine.kernels import host_memory
from engine.model.linear import Linear
from engine.sequence import SamplingParams

BLOCK_SIZE = 32
GOAL = 1.5          # at batch 8, step time / bound


class _StepLog:
    """A tracer that keeps what the roofline needs from each step record."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence before decoding")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of 4 decode steps and one linear-only pass")
    parser.add_argument("--weights", type=Path, default=None, help="HF folder (default: exported once to the cache)")


def read_bandwidth(buffer: torch.Tensor) -> float:
    """GB/s reading `buffer` (a sum over it), best of two."""
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * buffer.element_size() / (time.perf_counter() - t0) / 1e9)
    return best


def peak_gflops(kernel: str) -> float:
    """The machine's fp32 multiply-add rate: the best of a large GEMM (torch) and the engine's own
    linear kernel on a weight that stays in cache (64 rows), each best of 20."""
    best = 0.0
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    lin, x = Linear(torch.randn(1536, 576), None, kernel), torch.randn(64, 576)
    with torch.inference_mode():
        for fn, flops in ((lambda: torch.mm(a, b), 2 * 2048 * 576 * 1536), (lambda: lin(x), 2 * 64 * 576 * 1536)):
            fn()
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    return best


def linear_layers(model) -> list:
    layers = [lin for layer in model.layers for lin in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])]
    return layers + [model.lm_head]


def linear_pass_ms(model, inputs: dict[int, torch.Tensor]) -> float:
    """One pass of the step's matmuls alone through the engine's own linear layers (the LM head on
    every row, as in a decode step)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        for lin in linear_layers(model):
            lin(inputs[lin.in_features])
        return (time.perf_counter() - t0) * 1000


def decode_steps(runner: KvtraceRunner, batch: int, context: int, rounds: int, buffer: torch.Tensor
                 ) -> tuple[list[tuple[StepRecord, float]], list[float], float]:
    """Prefill `batch` sequences of `context` tokens, then `rounds` of: the read bandwidth, 4 timed
    decode steps, one pass of the linear layers alone. Returns each step's record with its round's
    bandwidth, the linear passes' times and the mean positions attended per sequence."""
    log = _StepLog()
    engine = runner.engine(log)
    model = engine.model
    inputs = {lin.in_features: torch.randn(batch, lin.in_features) for lin in linear_layers(model)}
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(17, 49_152) for _ in range(context)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4 * rounds + 4, ignore_eos=True), arrival_s=0.0)
    while any(s.num_output_tokens == 0 for s in engine.outputs.values()):
        engine.step()
    for _ in range(2):  # settle
        engine.step()
    linear_pass_ms(model, inputs)
    steps = []
    floor = []
    for _ in range(rounds):
        bandwidth = read_bandwidth(buffer)
        first = len(log.records)
        for _ in range(4):
            engine.step()
        steps += [(r, bandwidth) for r in log.records[first:]]
        floor.append(linear_pass_ms(model, inputs))
    engine.flush()
    steps = [(r, bw) for r, bw in steps if r.num_decode_tokens == batch and not r.num_prefill_tokens]
    return steps, floor, context + 2 + 2 * rounds


def _labelled(fn, label: str):
    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return call


def profile_step(runner: KvtraceRunner, batch: int, context: int, step_ms: float) -> str:
    """Where a decode step's time goes, by operator (torch.profiler's self time on the engine's
    thread, which waits for its worker threads), against the step's wall time without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine = runner.engine()
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(17, 49_152) for _ in range(context)],
                           SamplingParams(max_tokens=12, ignore_eos=True), arrival_s=0.0)
    for _ in range(3):
        engine.step()
    num_steps = 5
    # the profiler sees no ctypes call: name kvtrace's kernels for it (the library's functions, which
    # both the forward and the Python wrappers call)
    lib = engine.model.cpu_kernels.lib if engine.model.cpu_kernels is not None else None
    names = ("linear", "paged_decode_attention", "rms_norm", "silu_mul", "rope_and_cache")
    originals = {name: getattr(lib, f"kvt_{name}") for name in names} if lib is not None else {}
    for name, fn in originals.items():
        setattr(lib, f"kvt_{name}", _labelled(fn, f"kvtrace::{name}"))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            profiled_ms = (time.perf_counter() - t0) * 1000 / num_steps
    finally:
        for name, fn in originals.items():
            setattr(lib, f"kvt_{name}", fn)
    groups = {"linear layers (kvtrace / oneDNN / aten::mm)": ("kvtrace::linear", "mkldnn::_linear_pointwise",
                                                              "aten::mm", "aten::addmm"),
              "attention (kvtrace paged / SDPA kernel)": ("kvtrace::paged_decode_attention",
                                                          "aten::_scaled_dot_product_flash_attention_for_cpu"),
              "KV gather (index_select)": ("aten::index_select",),
              "RoPE + KV write (kvtrace fused / index_copy_)": ("kvtrace::rope_and_cache", "aten::index_copy_"),
              "RMSNorm (kvtrace fused with the residual add / all of torch's ops)": ("kvtrace::rms_norm",
                                                                                     "aten::rms_norm"),
              "SiLU·mul (kvtrace fused)": ("kvtrace::silu_mul",),
              "sampling (argmax)": ("aten::argmax",)}
    events = {e.key: e for e in prof.key_averages()}
    rows = []
    listed = 0.0
    for name, keys in groups.items():
        # RMSNorm is a composite: count its whole subtree; the others are leaf kernels
        ms = sum((events[k].cpu_time_total if k == "aten::rms_norm" else events[k].self_cpu_time_total)
                 for k in keys if k in events) / num_steps / 1000
        listed += ms
        rows.append([name, f"{ms:.1f}", f"{100 * ms / profiled_ms:.0f} %"])
    all_ops = sum(e.self_cpu_time_total for e in events.values()) / num_steps / 1000
    rest_ops = max(0.0, all_ops - listed)
    rows.append(["every other op (torch's RoPE, residual adds, SiLU; allocations, views, ...)", f"{rest_ops:.1f}",
                 f"{100 * rest_ops / profiled_ms:.0f} %"])
    outside = profiled_ms - listed - rest_ops
    rows.append(["outside ops (Python, scheduler, bookkeeping)", f"{outside:.1f}",
                 f"{100 * outside / profiled_ms:.0f} %"])
    return (markdown_table([f"batch {batch} decode step, profiled ({profiled_ms:.1f} ms; {step_ms:.1f} ms without "
                            f"the profiler)", "ms per step", "share"], rows)
            + "\n\nThe profiler adds its own cost to every op. RMSNorm's own ops are in its row, not in "
              "'every other op'.")


def run(args: argparse.Namespace) -> None:
    weights_dir = ensure_weights(args.weights)
    batches = [int(b) for b in args.batches.split(",")]
    section = Section("roofline")
    buffer = host_memory.empty((1 << 30) // 4).fill_(1.0)  # on huge pages, as the engine's weights and KV
    gflops = 0.0
    rows = []
    ratio_at = {}
    profiles = []
    for batch in batches:
        max_len = args.context + 4 * args.rounds + 8
        runner = KvtraceRunner(weights_dir, block_size=BLOCK_SIZE, num_blocks=batch * -(-max_len // BLOCK_SIZE) + 1,
                               max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.context))
        model = runner.engine().model
        gflops = gflops or peak_gflops(model.linear_kernel)
        weight_bytes = sum(lin.weight_bytes for lin in linear_layers(model))
        kv_per_token = model.config.kv_bytes_per_token
        steps, floor, mean_positions = decode_steps(runner, batch, args.context, args.rounds, buffer)
        kv_bytes = batch * mean_positions * kv_per_token
        compute_ms = 1000 * 2 * batch * weight_bytes / 4 / (gflops * 1e9)  # one multiply-add per weight and row
        step_ms = [1000 * (r.end_s - r.start_s) for r, _ in steps]
        bounds = [1000 * (weight_bytes + kv_bytes) / (bw * 1e9) for _, bw in steps]
        step_ratios = [t / b for t, b in zip(step_ms, bounds)]
        bound_ms = median(bounds)
        ratio_at[batch] = median(step_ratios)
        rows.append([str(batch), f"{mean_positions:.0f}", f"{weight_bytes / 1e6:.0f} + {kv_bytes / 1e6:.0f}",
                     f"{median([bw for _, bw in steps]):.1f}", f"{bound_ms:.1f}", f"{compute_ms:.1f}",
                     f"{median(floor):.1f}",
                     f"{median([r.device_ms for r, _ in steps]):.1f}",
                     f"{median(step_ms):.1f} ({percentile(step_ms, 10):.1f}–{percentile(step_ms, 90):.1f})",
                     f"{median(floor) / bound_ms:.2f}×",
                     f"**{ratio_at[batch]:.2f}×** ({min(step_ratios):.2f}–{max(step_ratios):.2f})",
                     f"{1000 * batch / median(step_ms):.0f}"])
        if batch == 8 or len(batches) == 1:
            profiles.append(profile_step(runner, batch, args.context, median(step_ms)))
        print(f"  batch {batch}: step {median(step_ms):.1f} ms, bound {bound_ms:.1f} ms", flush=True)
    kernel = model.linear_kernel
    section.add(f"Decode steps after prefilling {args.context} tokens per sequence: {args.rounds} rounds, each of "
                f"a read-bandwidth measurement (sum over 1 GiB on huge pages, best of two), 4 steps and one pass of the linear "
                f"layers alone; fp32, block size {BLOCK_SIZE}, linear layers on the `{kernel}` kernels. Weights "
                f"read per step: every linear layer and the LM head (the embedding rows looked up are "
                f"negligible). Each step is divided by its own round's bound; the ratio column is the median "
                f"of those, with its range.")
    section.add(f"Compute: {gflops:.0f} GFLOP/s fp32 (the best of a 2048×576×1536 GEMM and the engine's linear "
                f"kernel on a cache-resident weight). The compute column is the linear layers' multiply-adds at "
                f"that rate (2 FLOPs per weight per sequence): a second floor, not part of the goal's bound.")
    section.add(markdown_table(["batch", "positions / seq", "MB read: weights + KV", "read GB/s", "bound ms",
                                "compute ms", "linear only ms", "forward ms", "step ms (p10–p90)", "linear / bound",
                                "step / bound", "tok/s"], rows))
    for text in profiles:
        section.add(text)
    headline = "decode step / its memory bound: " + ", ".join(f"batch {b} {r:.2f}×" for b, r in ratio_at.items())
    if 8 in ratio_at:
        met = ratio_at[8] <= GOAL
        section.add(f"Goal: decode step within {GOAL}× of the bound at batch 8: **{'met' if met else 'missed'}** "
                    f"({ratio_at[8]:.2f}×).")
        headline += f"; goal ≤ {GOAL}× at batch 8: {'met' if met else 'missed'}"
    section.write(headline)
