"""The Triton kernels behind engine/kernels/triton_attention.py (its docstring says what they compute).

Imported only when they are used, so that the CPU engine does not pay for importing Triton.
"""
import triton
import triton.language as tl


# table_stride is the step's widest block table: unspecialised, so that its value (1, a multiple of
# 16 or neither) never makes another variant of the kernel. sliding_window: the layer's window, read
# only when SLIDING (a layer without one compiles to the kernel it was before windows)
@triton.jit(do_not_specialize=["table_stride", "sliding_window"])
def decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                  partial_acc_ptr, partial_m_ptr, partial_l_ptr,
                  qk_scale, q_stride_seq, q_stride_head, out_stride_seq, out_stride_head, table_stride,
                  block_size, sliding_window,
                  NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # the positions attended, [first, context_len): all, or the last sliding_window of them
    first = 0
    if SLIDING:
        first = tl.maximum(context_len - sliding_window, 0)
    # this split's positions [start, end): whole tiles, the last split may be short or empty
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - first, BLOCK_N), NUM_SPLITS)
    start = first + split * tiles_per_split * BLOCK_N
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
def merge_splits_kernel(partial_acc_ptr, partial_m_ptr, partial_l_ptr, out_ptr, out_stride_seq,
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

@triton.jit(do_not_specialize=["table_stride", "sliding_window"])   # as decode_kernel's
def prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, chunk_rows_ptr,
                   chunk_lens_ptr, chunk_starts_ptr,
                   qk_scale, q_stride_tok, q_stride_head, out_stride_tok, out_stride_head, table_stride,
                   block_size, sliding_window,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SLIDING: tl.constexpr, PRECISION: tl.constexpr):
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
    # from the first key that the tile's first query sees: 0, or the start of its sliding window
    first_key = 0
    if SLIDING:
        tl.static_assert(BLOCK_M <= BLOCK_N, "a row would see no key of the first tile (its max would be -inf)")
        first_key = tl.maximum(first_pos + m_tile * BLOCK_M - sliding_window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    slot_stride = NUM_KV_HEADS * HEAD_DIM
    for tile in range(first_key, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        ok = pos < end
        block = tl.load(block_tables_ptr + chunk * table_stride + pos // block_size, mask=ok, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_offset = slot[:, None] * slot_stride + kv_head * HEAD_DIM + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offset, mask=kv_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale   # [BLOCK_M, BLOCK_N]
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        # every row sees a key of the first tile, so m_i is finite after it: without a window position 0;
        # with one, row j of the tile sees position first_key + j (or 0), and j < BLOCK_M <= BLOCK_N
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
