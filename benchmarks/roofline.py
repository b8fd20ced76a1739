"""Suite `roofline`: each decode step against its memory-bandwidth lower bound, at batch 1, 8 and 32.

A decode step must read every weight once (30 layers and the LM head) and the KV of every position
its sequences attend to, so no step can be faster than (weight bytes + KV bytes) / bandwidth. The
bandwidth is measured here with large tensor copies (STREAM's convention: bytes read + bytes
written) and with a large sum (bytes read); the bound uses the higher, i.e. the tighter bound.
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


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s), medians of `repeats`."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    copies, reads = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * num_bytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        src.sum()
        reads.append(num_bytes / (time.perf_counter() - t0) / 1e9)
    return median(copies[1:]), median(reads[1:])


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


def decode_steps(runner: KvtraceRunner, batch: int, context: int, rounds: int
                 ) -> tuple[list[StepRecord], list[float], float]:
    """Prefill `batch` sequences of `context` tokens, then `rounds` of 4 timed decode steps, each
    followed by one pass of the linear layers alone. Returns the steps' records, the linear passes'
    times and the mean positions attended per sequence."""
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
    first = len(log.records)
    floor = []
    for _ in range(rounds):
        for _ in range(4):
            engine.step()
        floor.append(linear_pass_ms(model, inputs))
    engine.flush()
    records = [r for r in log.records[first:] if r.num_decode_tokens == batch and not r.num_prefill_tokens]
    return records, floor, context + 2 + 2 * rounds


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
    kernels = engine.model.cpu_kernels
    if kernels is not None:  # the profiler sees no ctypes call: name kvtrace's kernels for it
        for name in ("linear", "paged_decode_attention"):
            setattr(kernels, name, _labelled(getattr(kernels, name), f"kvtrace::{name}"))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            profiled_ms = (time.perf_counter() - t0) * 1000 / num_steps
    finally:
        if kernels is not None:
            del kernels.linear, kernels.paged_decode_attention
    groups = {"linear layers (kvtrace / oneDNN / aten::mm)": ("kvtrace::linear", "mkldnn::_linear_pointwise",
                                                              "aten::mm", "aten::addmm"),
              "attention (kvtrace paged / SDPA kernel)": ("kvtrace::paged_decode_attention",
                                                          "aten::_scaled_dot_product_flash_attention_for_cpu"),
              "KV gather (index_select)": ("aten::index_select",),
              "KV write (index_copy_)": ("aten::index_copy_",),
              "RMSNorm (all its ops)": ("aten::rms_norm",),
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
    rows.append(["every other op (RoPE, residual adds, SiLU, views, ...)", f"{rest_ops:.1f}",
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
    copy_gbs, read_gbs = measure_bandwidth()
    rows = []
    ratio_at = {}
    profiles = []
    for batch in batches:
        max_len = args.context + 4 * args.rounds + 8
        runner = KvtraceRunner(weights_dir, block_size=BLOCK_SIZE, num_blocks=batch * -(-max_len // BLOCK_SIZE) + 1,
                               max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.context))
        model = runner.engine().model
        weight_bytes = sum(lin.weight_bytes for lin in linear_layers(model))
        kv_per_token = model.config.kv_bytes_per_token
        records, floor, mean_positions = decode_steps(runner, batch, args.context, args.rounds)
        step_ms = [1000 * (r.end_s - r.start_s) for r in records]
        forward_ms = [r.device_ms for r in records]
        kv_bytes = batch * mean_positions * kv_per_token
        bound_ms = 1000 * (weight_bytes + kv_bytes) / (max(copy_gbs, read_gbs) * 1e9)
        ratio_at[batch] = median(step_ms) / bound_ms
        rows.append([str(batch), f"{mean_positions:.0f}", f"{weight_bytes / 1e6:.0f} + {kv_bytes / 1e6:.0f}",
                     f"{bound_ms:.1f}", f"{median(floor):.1f}",
                     f"{median(forward_ms):.1f}",
                     f"{median(step_ms):.1f} ({percentile(step_ms, 10):.1f}–{percentile(step_ms, 90):.1f})",
                     f"{median(floor) / bound_ms:.2f}×", f"**{ratio_at[batch]:.2f}×**",
                     f"{1000 * batch / median(step_ms):.0f}"])
        if batch == 8 or len(batches) == 1:
            profiles.append(profile_step(runner, batch, args.context, median(step_ms)))
        print(f"  batch {batch}: step {median(step_ms):.1f} ms, bound {bound_ms:.1f} ms", flush=True)
    section.add(f"Memory bandwidth: {copy_gbs:.1f} GB/s by 1 GiB copies (read + write counted), {read_gbs:.1f} GB/s "
                f"by 1 GiB sums (read), medians of 5; the bound uses the higher. Decode steps after prefilling "
                f"{args.context} tokens per sequence: {args.rounds} rounds of 4 steps, each round followed by one "
                f"pass of the linear layers alone; fp32, block size {BLOCK_SIZE}. Weights read per step: every "
                f"linear layer and the LM head (the embedding rows looked up are negligible).")
    section.add(markdown_table(["batch", "positions / seq", "MB read: weights + KV", "bound ms", "linear only ms",
                                "forward ms", "step ms (p10–p90)", "linear / bound", "step / bound", "tok/s"], rows))
    for text in profiles:
        section.add(text)
    if 8 in ratio_at:
        met = ratio_at[8] <= GOAL
        section.add(f"Goal: decode step within {GOAL}× of the bound at batch 8: **{'met' if met else 'missed'}** "
                    f"({ratio_at[8]:.2f}×).")
    section.write()
