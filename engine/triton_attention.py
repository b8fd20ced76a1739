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

Any block size works (the table lookup is per position). Scores and the softmax run in fp32; fp32
inputs use full-precision dots (not TF32) so results match torch's SDPA, the reference path.
`KVTRACE_TRITON=0` turns the kernels off (torch's SDPA path runs instead). Set `TRITON_INTERPRET=1`
before importing triton and the kernels run on CPU tensors (how the tests check them without a GPU).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: the SDPA path is used
    triton = None

LOG2E = 1.4426950408889634


def enabled(device: torch.device) -> bool:
    """Use these kernels for a model on `device`?"""
    if triton is None or os.environ.get("KVTRACE_TRITON", "1") == "0":
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
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int) -> None:
    """out[i] = softmax(q[i] K_i^T * scale) V_i over the first context_lens[i] positions of sequence i.

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
    partial_acc = partial_m = partial_l = out  # unused when not split
    if num_splits > 1:
        partial_acc = torch.empty(num_seqs, nh, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        partial_m = torch.empty(num_seqs, nh, num_splits, dtype=torch.float32, device=q.device)
        partial_l = torch.empty_like(partial_m)
    _decode_kernel[(num_seqs, nkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_acc, partial_m, partial_l,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_size,
        NUM_KV_HEADS=nkv, GROUP=group, GROUP_PAD=_pow2(group, 16), HEAD_DIM=hd, DIM_PAD=dim_pad,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION=_precision(q),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, nh)](
            partial_acc, partial_m, partial_l, out, out.stride(0), out.stride(1),
            NUM_HEADS=nh, HEAD_DIM=hd, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
        )


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      chunks: torch.Tensor, max_chunk_len: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of prefill chunks over everything before them in the cache.

    q, out: [num_tokens, nh, hd] (the step's flat token rows); chunks: [3, num_chunks] int: each chunk's
    first row in q, its number of tokens, its first position; block_tables: [num_chunks, >= blocks
    covering each chunk's end]. The chunk's own K and V must already be in the cache.
    """
    num_chunks = chunks.shape[1]
    _, nh, hd = q.shape
    _, block_size, nkv, _ = k_cache.shape
    _check(q, k_cache, v_cache, out)
    assert block_tables.stride(1) == 1 and chunks.stride(1) == 1
    dim_pad = _pow2(hd, 16)
    block_m = 32 if dim_pad <= 64 else 16
    block_n = 32
    grid = (num_chunks, nh, -(-max_chunk_len // block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, chunks[0], chunks[1], chunks[2],
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_size,
        NUM_KV_HEADS=nkv, GROUP=nh // nkv, HEAD_DIM=hd, DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=_precision(q),
    )


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous per layer"
    assert q.stride(-1) == 1 and out.stride(-1) == 1, "head dimension must be contiguous"
    assert q.dtype == k_cache.dtype == out.dtype, f"dtypes differ: q {q.dtype}, cache {k_cache.dtype}, out {out.dtype}"


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                       partial_acc_ptr, partial_m_ptr, partial_l_ptr,
                       qk_scale, q_stride_seq, q_stride_head, out_stride_seq, out_stride_head, table_stride,
                       block_size,
                       NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
        # this split's positions [start, end): whole tiles, the last split may be short or empty
        tiles_per_split = tl.cdiv(tl.cdiv(context_len, BLOCK_N), NUM_SPLITS)
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        head = kv_head * GROUP + g                                  # the query heads of this KV head
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + seq * q_stride_seq + head[:, None] * q_stride_head + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)   # q: [GROUP_PAD, DIM_PAD]
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)     # running max (log2 units)
        l_i = tl.zeros([GROUP_PAD], tl.float32)                   # running sum of exp2
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        slot_stride = NUM_KV_HEADS * HEAD_DIM
        for tile in range(start, end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            ok = pos < end
            block = tl.load(block_tables_ptr + seq * table_stride + pos // block_size, mask=ok, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
            kv_offset = slot[:, None] * slot_stride + kv_head * HEAD_DIM + d[None, :]
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_offset, mask=kv_ok, other=0.0)          # [BLOCK_N, DIM_PAD]
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_offset, mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + seq * out_stride_seq + head[:, None] * out_stride_head + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:  # unnormalised partials; an empty split leaves m = -inf, l = 0, acc = 0
            part = (seq * NUM_KV_HEADS * GROUP + head) * NUM_SPLITS + split
            tl.store(partial_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=g_ok[:, None])
            tl.store(partial_m_ptr + part, m_i, mask=g_ok)
            tl.store(partial_l_ptr + part, l_i, mask=g_ok)

    @triton.jit
    def _merge_splits_kernel(partial_acc_ptr, partial_m_ptr, partial_l_ptr, out_ptr, out_stride_seq,
                             out_stride_head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, DIM_PAD)
        part = (seq * NUM_HEADS + head) * NUM_SPLITS + s
        m = tl.load(partial_m_ptr + part)
        weight = tl.exp2(m - tl.max(m, 0))   # split 0 is never empty, so the max is finite
        total = tl.sum(tl.load(partial_l_ptr + part) * weight, 0)
        acc = tl.load(partial_acc_ptr + part[:, None] * DIM_PAD + d[None, :])
        out = tl.sum(acc * weight[:, None], 0) / total
        tl.store(out_ptr + seq * out_stride_seq + head * out_stride_head + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)

    @triton.jit
    def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, chunk_rows_ptr,
                        chunk_lens_ptr, chunk_starts_ptr,
                        qk_scale, q_stride_tok, q_stride_head, out_stride_tok, out_stride_head, table_stride,
                        block_size,
                        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
        chunk = tl.program_id(0)
        head = tl.program_id(1)
        m_tile = tl.program_id(2)
        kv_head = head // GROUP
        first_row = tl.load(chunk_rows_ptr + chunk).to(tl.int32)
        chunk_len = tl.load(chunk_lens_ptr + chunk).to(tl.int32)
        first_pos = tl.load(chunk_starts_ptr + chunk).to(tl.int32)
        r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)   # rows of this tile within the chunk
        r_ok = r < chunk_len
        q_pos = first_pos + r
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        io_ok = r_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + (first_row + r)[:, None] * q_stride_tok + head * q_stride_head + d[None, :],
                    mask=io_ok, other=0.0)                       # [BLOCK_M, DIM_PAD]
        # keys up to this tile's last query (none when the tile is past the chunk's end)
        end = tl.where(m_tile * BLOCK_M < chunk_len, first_pos + tl.minimum((m_tile + 1) * BLOCK_M, chunk_len), 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        slot_stride = NUM_KV_HEADS * HEAD_DIM
        for tile in range(0, end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            ok = pos < end
            block = tl.load(block_tables_ptr + chunk * table_stride + pos // block_size, mask=ok, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
            kv_offset = slot[:, None] * slot_stride + kv_head * HEAD_DIM + d[None, :]
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_offset, mask=kv_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale   # [BLOCK_M, BLOCK_N]
            # position 0 is in the first tile and visible to every row: m_i is finite after it
            scores = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_offset, mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(r_ok, l_i, 1.0)[:, None]   # rows past the chunk: no keys, not stored
        tl.store(out_ptr + (first_row + r)[:, None] * out_stride_tok + head * out_stride_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_ok)
