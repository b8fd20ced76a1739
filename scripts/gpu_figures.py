"""The GPU figures scripts/gpu_check.sh records: decode roofline, tracing overhead, syncs per step.

    python scripts/gpu_figures.py roofline --out roofline.json   # decode step vs its HBM bound, batch 1/8/64
    python scripts/gpu_figures.py tracing --out tracing.json     # traced / untraced replay time
    python scripts/gpu_figures.py syncs --out syncs.json         # host-device synchronisations per step

Dummy weights of a real shape (llama-3.2-1b by default) in bf16; each prints a table and writes JSON.
`--device cpu --model tiny --dtype float32` is a dry run of the script itself (no figure means anything).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.build import build_engine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.loader import load_weights  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "traces" / "examples"


class Records:
    """A tracer that keeps the step records (device_ms comes from CUDA events)."""

    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


def hbm_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), best of five."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = 0.0
    if device.type == "cpu":  # a dry run of the script on a machine without a GPU
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * src.numel() / (time.perf_counter() - t0)
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = max(best, 2 * src.numel() / (start.elapsed_time(end) / 1000))
    return best


def roofline(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    loaded = load_weights(args.model, "dummy", dtype=dtype, seed=0)
    bandwidth = hbm_bandwidth(device)
    rows = []
    budget = 4096
    for batch in args.batches:
        tracer = Records()
        # every sequence keeps decoding until the last one is prefilled, then `steps` more
        max_tokens = args.steps + 8 + -(-batch * args.context // budget)
        tokens_per_seq = -(-(args.context + max_tokens + 1) // 16) * 16
        engine = build_engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                                           max_num_seqs=batch, max_num_batched_tokens=budget,
                                           kv_cache_memory=batch * tokens_per_seq * loaded.config.kv_values_per_token
                                           * dtype.itemsize), tracer, loaded=loaded)
        rng = random.Random(batch)
        for i in range(batch):
            engine.add_request(str(i), [rng.randrange(3, loaded.config.vocab_size) for _ in range(args.context)],
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        engine.flush()
        weight_bytes = sum(t.numel() * t.element_size() for t in _weights(engine.model))
        kv_bytes_per_position = engine.model_config.kv_values_per_token * dtype.itemsize
        full = [r for r in tracer.records if r.num_decode_tokens == batch and not r.num_prefill_tokens][2:]
        assert len(full) >= args.steps // 2, f"batch {batch}: only {len(full)} decode-only steps at full batch"
        # each step against its own bound: weights once, plus the KV of every position it attends to
        ratios = [r.device_ms / ((weight_bytes + r.num_kv_tokens * kv_bytes_per_position) / bandwidth * 1000)
                  for r in full]
        step_ms = statistics.median(r.device_ms for r in full)
        kv_bytes = statistics.median(r.num_kv_tokens for r in full) * kv_bytes_per_position
        rows.append({"batch": batch, "step_ms": step_ms, "bound_ms": (weight_bytes + kv_bytes) / bandwidth * 1000,
                     "ratio": statistics.median(ratios), "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                     "steps_timed": len(full), "graphs": engine.runner.decode_graphs is not None})
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"decode roofline, {args.model} {args.dtype}, context {args.context}, HBM {bandwidth / 1e9:.0f} GB/s "
          f"(device-to-device copy)")
    print("batch  step ms  bound ms  step/bound")
    for r in rows:
        print(f"{r['batch']:>5}  {r['step_ms']:7.3f}  {r['bound_ms']:8.3f}  {r['ratio']:10.2f}")
    return {"model": args.model, "dtype": args.dtype, "context": args.context, "hbm_bytes_s": bandwidth,
            "rows": rows, "goal": "step / bound at batch 64 <= 1.5"}


def _weights(model) -> list[torch.Tensor]:
    """Every tensor a decode step reads in full: the linear weights and the final norm (the embedding
    table is read a row per token, except where it is the tied LM head)."""
    tensors = [model.lm_head.weight, model.norm]
    for layer in model.layers:
        tensors += [layer["input_norm"], layer["post_norm"]]
        tensors += [layer[name].weight for name in ("qkv", "o", "gate_up", "down")]
    return tensors


def tracing(args: argparse.Namespace) -> dict:
    from kvtrace.record.recorder import TraceWriter
    from kvtrace.record.replay import prepare, replay
    from kvtrace.workload import load_workload

    loaded = load_weights(args.model, "dummy", dtype=getattr(torch, args.dtype), seed=0)
    config = EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                          max_num_seqs=32, kv_cache_memory=args.kv_cache_memory)
    requests = load_workload(EXAMPLES / "bursty.jsonl")[:args.requests]

    def replay_once(traced: bool) -> float:
        folder = Path(tempfile.mkdtemp(prefix="kvtrace-gpu-"))
        try:
            writer = TraceWriter(folder, "bench") if traced else None
            engine = build_engine(config, tracer=writer, loaded=loaded)
            items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=True,
                            workload_name="bursty")
            t0 = time.perf_counter()
            replay(engine, items)
            if writer is not None:
                writer.close()
            return time.perf_counter() - t0
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    replay_once(True)  # warm-up
    traced, untraced = [], []
    for _ in range(args.repeats):  # interleaved
        traced.append(replay_once(True))
        untraced.append(replay_once(False))
    ratio = statistics.median(t / u for t, u in zip(traced, untraced))
    print(f"tracing: {args.requests} bursty requests as a backlog, {args.model} {args.dtype}")
    print(f"traced s {traced}\nuntraced s {untraced}\ntraced / untraced (median of pairs) {ratio:.3f}")
    return {"traced_s": traced, "untraced_s": untraced, "ratio": ratio, "goal": "<= 1.02"}


def syncs(args: argparse.Namespace) -> dict:
    """Synchronisations torch reports (sync debug mode 'warn') over a replay, by where they happened."""
    loaded = load_weights(args.model, "dummy", dtype=getattr(torch, args.dtype), seed=0)
    engine = build_engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                                       max_num_seqs=16, kv_cache_memory="64MiB", preemption_mode="swap",
                                       swap_space="256MiB"), loaded=loaded)
    rng = random.Random(0)
    for i in range(24):
        prompt = [rng.randrange(3, min(1000, loaded.config.vocab_size)) for _ in range(rng.randint(16, 400))]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(8, 64), ignore_eos=True))
    execute, inside = engine.runner.execute, []

    def counted(out):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = execute(out)
        inside.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))
        return result

    engine.runner.execute = counted
    steps = 0
    is_cuda = engine.runner.is_cuda
    if is_cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as everywhere:
            warnings.simplefilter("always")
            while engine.has_unfinished():
                engine.step()
                steps += 1
            engine.flush()
    finally:
        if is_cuda:
            torch.cuda.set_sync_debug_mode(0)
    # the runner's own warnings were caught inside `counted`, so they are not among `everywhere`'s
    total = sum("synchroniz" in str(w.message) for w in everywhere) + len(inside)
    print(f"syncs: {steps} steps, {total} synchronisations in all ({total / steps:.2f} per step), "
          f"{len(inside)} inside the runner's step (goal 0), preemptions {engine.num_preemptions}")
    for message in sorted(set(inside))[:10]:
        print("  inside:", message)
    return {"steps": steps, "syncs_total": total, "syncs_inside_step": len(inside),
            "preemptions": engine.num_preemptions, "examples_inside": sorted(set(inside))[:10]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=["roofline", "tracing", "syncs"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=1024, help="roofline: prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=24, help="roofline: decode steps per batch")
    parser.add_argument("--requests", type=int, default=32, help="tracing: requests replayed")
    parser.add_argument("--repeats", type=int, default=3, help="tracing: traced/untraced pairs")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="tracing: device KV pool")
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the figures")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():   # before loading a model's weights
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    figures = {"roofline": roofline, "tracing": tracing, "syncs": syncs}[args.figure](args)
    args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
