"""Paged attention in Triton: K and V read in place through the block tables, no gather, no padding.

Two kernels, both over the engine's KV layout (per layer, K and V each [num_blocks, block_size, nkv, hd],
so token position p of a sequence lives at slot table[p // block_size] * block_size + p % block_size):

- decode: one query token per sequence. A program takes one sequence, one KV head and one split of
  its context; the query heads that share the KV head are the rows of one tile (grouped-query
  attention without repeating K/V). Splits (flash-decoding) keep the GPU busy at small batches; a
  second kernel merges them by their log-sum-exp. The grid depends only on the batch size, so a
  captured CUDA graph replays it for any context lengths.
- prefill: one program per (chunk, query head, tile of BLOCK_M query rows) over all positions up to
  its last query, causally masked. A chunk may start anywhere (chunked prefill, prefix-cache hits):
  its own K and V are already in the cache when it runs, so history and chunk are read alike.

A layer with a sliding window W (the query at position p attends the keys at (p - W, p], as
transformers and vLLM) reads only the positions some query of the program can see: a decode its last
W, a prefill tile from its first query's window on; a layer without one runs the kernels as before
(SLIDING is a compile-time switch).

Any block size works (the table lookup is per position). Scores and the softmax run in fp32; fp32
inputs use full-precision dots (not TF32) so results match torch's SDPA, the reference path.
`KVTRACE_TRITON=0` turns the kernels off (torch's SDPA path runs instead). Set `TRITON_INTERPRET=1`
before importing triton and the kernels run on CPU tensors (how the tests check them without a GPU).
"""
from __future__ import annotations

import importlib.util
import os

import torch

LOG2E = 1.4426950408889634


def enabled(device: torch.device) -> bool:
    """Use these kernels for a model on `device`? (CPU builds of torch come without Triton.)"""
    if os.environ.get("KVTRACE_TRITON", "1") == "0" or importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, n - 1).bit_length())


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int | None = None) -> int:
    """How many parts each sequence's context is split into: enough programs to fill a large GPU
    (about 256), at most 16, a power of two; no more than it has tiles when that is known."""
    splits = min(16, _pow2(-(-256 // (num_seqs * num_kv_heads))))
    if max_context_len is not None:
        splits = min(splits, _pow2(-(-max_context_len // 64)))
    return splits


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int,
                     sliding_window: int | None = None) -> None:
    """out[i] = softmax(q[i] K_i^T * scale) V_i over the first context_lens[i] positions of sequence i
    (the last `sliding_window` of them with a window).

    q: [num_seqs, nh, hd] (rows may be strided); k_cache, v_cache: [num_blocks, block_size, nkv, hd];
    block_tables: [num_seqs, >= max blocks] int; context_lens: [num_seqs] int (>= 1); out: [num_seqs, nh, hd].
    """
    num_seqs, nh, hd = q.shape
    _, block_size, nkv, _ = k_cache.shape
    _check(q, k_cache, v_cache, out)
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    group = nh // nkv
    dim_pad = _pow2(hd, 16)
    block_n = 64 if dim_pad <= 64 else 32
    from engine.kernels.triton_kernels import decode_kernel, merge_splits_kernel

    partial_acc = partial_m = partial_l = out  # unused when not split
    if num_splits > 1:
        partial_acc = torch.empty(num_seqs, nh, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        partial_m = torch.empty(num_seqs, nh, num_splits, dtype=torch.float32, device=q.device)
        partial_l = torch.empty_like(partial_m)
    decode_kernel[(num_seqs, nkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_acc, partial_m, partial_l,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_size,
        sliding_window or 0,
        NUM_KV_HEADS=nkv, GROUP=group, GROUP_PAD=_pow2(group, 16), HEAD_DIM=hd, DIM_PAD=dim_pad,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, SLIDING=sliding_window is not None, PRECISION=_precision(q),
    )
    if num_splits > 1:
        merge_splits_kernel[(num_seqs, nh)](
            partial_acc, partial_m, partial_l, out, out.stride(0), out.stride(1),
            NUM_HEADS=nh, HEAD_DIM=hd, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
        )


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      chunks: torch.Tensor, max_chunk_len: int, scale: float, out: torch.Tensor,
                      sliding_window: int | None = None) -> None:
    """Causal attention of prefill chunks over everything before them in the cache (over the last
    `sliding_window` positions up to each query with a window).

    q, out: [num_tokens, nh, hd] (the step's flat token rows); chunks: [3, num_chunks] int: each chunk's
    first row in q, its number of tokens, its first position; block_tables: [num_chunks, >= blocks
    covering each chunk's end]. The chunk's own K and V must already be in the cache.
    """
    num_chunks = chunks.shape[1]
    _, nh, hd = q.shape
    _, block_size, nkv, _ = k_cache.shape
    _check(q, k_cache, v_cache, out)
    assert block_tables.stride(1) == 1 and chunks.stride(1) == 1
    from engine.kernels.triton_kernels import prefill_kernel

    dim_pad = _pow2(hd, 16)
    block_m = 32 if dim_pad <= 64 else 16
    block_n = 32
    grid = (num_chunks, nh, -(-max_chunk_len // block_m))
    prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, chunks[0], chunks[1], chunks[2],
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_size,
        sliding_window or 0,
        NUM_KV_HEADS=nkv, GROUP=nh // nkv, HEAD_DIM=hd, DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        SLIDING=sliding_window is not None, PRECISION=_precision(q),
    )


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous per layer"
    assert q.stride(-1) == 1 and out.stride(-1) == 1, "head dimension must be contiguous"
    assert q.dtype == k_cache.dtype == out.dtype, f"dtypes differ: q {q.dtype}, cache {k_cache.dtype}, out {out.dtype}"


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs

