"""Suite `kernels`: kvtrace's CPU kernels against the torch ops they replace, side by side.

- Linear layers: every linear layer of SmolLM2-135M (30 layers' qkv, o, gate_up, down and the LM head,
  538 MB of fp32 weights) at 1, 8, 32 and 256 rows, through kvtrace's kernel on its packed panels,
  oneDNN on its reordered weights and F.linear, passes interleaved.
- Decode attention: one layer's decode attention for 8 sequences over 128–1024 positions in a KV pool
  too large for the caches (each repeat reads other blocks), kvtrace's paged kernel against the torch
  path (index_select of the blocks, a mask, SDPA), interleaved.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kvtrace_runner import ensure_weights
from benchmarks.results import Section, markdown_table
from benchmarks.stats import fmt_ratio, median, ratios
from engine.kernels import cpu_kernels
from engine.model.linear import Linear, pick_kernel
from engine.model.loader import load_weights

KERNELS = ("kvtrace", "onednn", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,8,32,256", help="rows (tokens) per linear pass")
    parser.add_argument("--positions", default="128,1024", help="positions per sequence for decode attention")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--weights", type=Path, default=None, help="HF folder (default: exported once to the cache)")


def smollm2_linear_weights(folder: Path) -> list[torch.Tensor]:
    """[out, in] weights as the engine fuses them: qkv, o, gate_up, down per layer, then the LM head."""
    loaded = load_weights(str(folder))
    w, c = loaded.weights, loaded.config
    out = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.append(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        out.append(w[p + "self_attn.o_proj.weight"])
        out.append(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        out.append(w[p + "mlp.down_proj.weight"])
    return out + [w["model.embed_tokens.weight"]]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def linear_section(section: Section, weights: list[torch.Tensor], rows_list: list[int], repeats: int) -> str:
    """Adds the linear layers' table; returns its speed-ups over oneDNN in a line."""
    layers = {kernel: [Linear(w, None, kernel) for w in weights] for kernel in KERNELS}
    weight_bytes = sum(w.numel() * 4 for w in weights)
    table = []
    speedups = []
    with torch.inference_mode():
        for rows in rows_list:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            ms: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}
            for rep in range(repeats + 1):
                for kernel in KERNELS:
                    t = timed(lambda: [lin(inputs[lin.in_features]) for lin in layers[kernel]])
                    if rep:  # the first pass of each is a warm-up
                        ms[kernel].append(t)
            table.append([str(rows)] + [f"{median(ms[k]):.1f} ({weight_bytes / median(ms[k]) / 1e6:.0f} GB/s)"
                                        for k in KERNELS]
                         + [fmt_ratio(ratios(ms["onednn"], ms["kvtrace"])), fmt_ratio(ratios(ms["torch"], ms["kvtrace"]))])
            speedups.append(f"{rows} {median(ratios(ms['onednn'], ms['kvtrace'])):.2f}×")
            print(f"  linear, {rows} rows done", flush=True)
    section.add(f"Linear layers: all {len(weights)} of SmolLM2-135M ({weight_bytes / 1e6:.0f} MB fp32), one pass = "
                f"each layer once on `rows` random rows; {repeats} passes per kernel, interleaved, after one warm-up. "
                f"GB/s = weight bytes / pass time.")
    section.add(markdown_table(["rows", "kvtrace ms", "oneDNN ms", "F.linear ms", "speed-up vs oneDNN",
                                "speed-up vs F.linear"], table))
    return "linear vs oneDNN at " + ", ".join(speedups) + " rows"


def torch_decode_attention(q, k_cache, v_cache, tables, lens, scale):
    """The engine's torch path: gather whole blocks, mask past each length, SDPA with grouped heads."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    keys = k_cache.index_select(0, tables.view(-1)).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, tables.view(-1)).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(tables.shape[1] * block_size) < lens[:, None])[:, None, None, :]
    qd = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, scale=scale)


def attention_section(section: Section, kernels, positions_list: list[int], repeats: int) -> str:
    """Adds the decode attention's table; returns its speed-ups over the torch path in a line."""
    num_seqs, num_heads, num_kv_heads, head_dim, block_size = 8, 9, 3, 64, 32
    pool_blocks = 4096  # 4096 blocks x 24 KB x 2 = 200 MB: no repeat finds the last one's blocks in cache
    k_cache = torch.randn(pool_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(pool_blocks, block_size, num_kv_heads, head_dim)
    table = []
    speedups = []
    with torch.inference_mode():
        for positions in positions_list:
            per_seq = -(-positions // block_size)
            lens = torch.full((num_seqs,), positions)
            q = torch.randn(num_seqs, num_heads + num_kv_heads, head_dim)[:, :num_heads]
            ms: dict[str, list[float]] = {"kvtrace": [], "torch": []}
            cursor = 0  # the next run's first block: runs walk the pool
            for rep in range(repeats + 1):
                for name in ms:
                    if cursor + num_seqs * per_seq > pool_blocks:
                        cursor = 0
                    tables = torch.arange(cursor, cursor + num_seqs * per_seq).view(num_seqs, per_seq)
                    cursor += num_seqs * per_seq
                    fn = kernels.paged_decode_attention if name == "kvtrace" else torch_decode_attention
                    t = timed(lambda: fn(q, k_cache, v_cache, tables, lens, head_dim ** -0.5))
                    if rep:
                        ms[name].append(t)
            kv_bytes = 2 * num_seqs * positions * num_kv_heads * head_dim * 4
            table.append([str(positions), f"{kv_bytes / 1e6:.1f}"]
                         + [f"{1000 * median(ms[n]):.0f} ({kv_bytes / median(ms[n]) / 1e6:.0f} GB/s)" for n in ms]
                         + [fmt_ratio(ratios(ms["torch"], ms["kvtrace"]))])
            speedups.append(f"{positions} {median(ratios(ms['torch'], ms['kvtrace'])):.2f}×")
    section.add(f"Decode attention, one layer: {num_seqs} sequences, {num_heads} query heads on {num_kv_heads} KV heads "
                f"of {head_dim}, blocks of {block_size}, each repeat on blocks no earlier repeat touched; {repeats} "
                f"repeats each, interleaved, after one warm-up. GB/s = K and V bytes read / time.")
    section.add(markdown_table(["positions / seq", "KV MB read", "kvtrace µs", "torch µs (gather + mask + SDPA)",
                                "speed-up"], table))
    return "paged decode attention vs torch at " + ", ".join(speedups) + " positions"


def run(args: argparse.Namespace) -> None:
    kernels = cpu_kernels.load()
    if kernels is None or pick_kernel(torch.device("cpu"), torch.float32) != "kvtrace":
        raise SystemExit(f"kvtrace's CPU kernels are not available here: {cpu_kernels.unavailable_reason()}")
    section = Section("kernels")
    weights = smollm2_linear_weights(ensure_weights(args.weights))
    linear = linear_section(section, weights, [int(r) for r in args.rows.split(",")], args.repeats)
    del weights
    attention = attention_section(section, kernels, [int(p) for p in args.positions.split(",")], args.repeats)
    section.write(f"kvtrace's kernels: {linear}; {attention}")
