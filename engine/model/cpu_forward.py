"""The forward pass on kvtrace's CPU kernels (engine/kernels/csrc/cpu_kernels.c), for LlamaModel on CPU in fp32.

The same computation as LlamaModel's torch path, layer by layer, but each step's buffers are
allocated once and reused by every layer, and every kernel is one ctypes call on pointers worked out
before the layer loop: a decode step then costs ~10 calls per layer and almost no Python, instead
of ~30 torch ops and their dispatch. Prefill chunks still attend through torch's SDPA.

    x     [T, hidden]        the residual stream (embeddings, then += each sublayer's output)
    h     [T, hidden]        RMSNorm(x), input of qkv and of gate_up
    qkv   [T, (nh + 2 nkv) hd]
    qk    [T, nh + nkv, hd]  q and k after RoPE (k and v also written to the cache)
    attn  [T, nh hd]
    o, down [T, hidden]      sublayer outputs, added to x by the next norm
    gate_up [T, 2 inter] -> act [T, inter]

Each layer writes and reads its KV tensor (kv_caches[layer["kv_tensor"]]) through its KV-cache group's
slots and block tables (metas[layer["group"]]), as in LlamaModel.forward.
"""
from __future__ import annotations

import torch

from engine.kernels.cpu_kernels import check_attention
from engine.model.attention import prefill_attention


def forward_on_cpu_kernels(model, input_ids: torch.Tensor, positions: torch.Tensor, metas: list,
                           kv_caches: list[torch.Tensor], logit_rows: torch.Tensor) -> torch.Tensor:
    """LlamaModel.forward's contract: this step's KV written, logits of `logit_rows` returned."""
    c = model.config
    lib = model.cpu_kernels.lib
    linear, rms_norm, silu_mul = lib.kvt_linear, lib.kvt_rms_norm, lib.kvt_silu_mul
    rope_and_cache, decode_attention = lib.kvt_rope_and_cache, lib.kvt_paged_decode_attention
    nh, nkv, hd, hidden, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
    eps = c.rms_norm_eps
    num_tokens = input_ids.shape[0]
    qkv_width = (nh + 2 * nkv) * hd

    # the kernels read and write fp32 through raw pointers: nothing here may take torch's defaults
    assert kv_caches[0].dtype == torch.float32 and kv_caches[0].is_contiguous(), "KV cache must be contiguous fp32"
    assert positions.dtype == torch.int64 and all(meta.slot_mapping.dtype == torch.int64 for meta in metas)
    x = model.embed[input_ids]
    fp32 = dict(dtype=torch.float32, device="cpu")
    h, o, down = (torch.empty(num_tokens, hidden, **fp32) for _ in range(3))
    qkv = torch.empty(num_tokens, qkv_width, **fp32)
    qk = torch.empty(num_tokens, nh + nkv, hd, **fp32)
    attn = torch.empty(num_tokens, nh * hd, **fp32)
    gate_up, act = torch.empty(num_tokens, 2 * inter, **fp32), torch.empty(num_tokens, inter, **fp32)
    x_p, h_p, o_p, down_p = x.data_ptr(), h.data_ptr(), o.data_ptr(), down.data_ptr()
    qkv_p, qk_p, attn_p, gate_up_p, act_p = qkv.data_ptr(), qk.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), \
        act.data_ptr()
    positions_p = positions.data_ptr()
    slots_p = [meta.slot_mapping.data_ptr() for meta in metas]   # per KV-cache group
    cos_p, sin_p = model.cos.data_ptr(), model.sin_signed.data_ptr()
    _, num_blocks, block_size, _, _ = kv_caches[0].shape
    v_offset = num_blocks * block_size * nkv * hd * 4  # bytes from a layer's K half to its V half
    nd, prefills = metas[0].num_decodes, metas[0].prefills
    if nd:  # the kernel reads each decode's window only: never the null blocks it dropped, nor padding
        lens, tables = metas[0].decode_context_lens, [meta.decode_block_tables for meta in metas]
        assert lens.dtype == torch.int64 and all(t.dtype == torch.int64 and t.is_contiguous() for t in tables)
        lens_p = lens.data_ptr()
        tables_p = [(t.data_ptr(), t.shape[1]) for t in tables]   # per group: its tables, their width
    residual_p = None  # the first layer's norm has nothing to add
    for layer in model.layers:
        group = layer["group"]
        kv_cache = kv_caches[layer["kv_tensor"]]
        k_p = kv_cache.data_ptr()
        v_p = k_p + v_offset
        qkv_l, o_l, gate_up_l, down_l = layer["qkv"], layer["o"], layer["gate_up"], layer["down"]
        rms_norm(x_p, residual_p, layer["input_norm"].data_ptr(), eps, num_tokens, hidden, h_p)
        linear(h_p, num_tokens, hidden, qkv_l.weight_ptr, qkv_width, qkv_l.bias_ptr, qkv_p)
        rope_and_cache(qkv_p, num_tokens, positions_p, cos_p, sin_p, nh, nkv, hd, slots_p[group], k_p, v_p, qk_p)
        if nd:
            check_attention(decode_attention(qk_p, (nh + nkv) * hd, k_p, v_p, *tables_p[group], lens_p, nd, nh,
                                             nkv, hd, block_size, layer["sliding_window"] or 0, model.scale, attn_p))
        if prefills:
            v = qkv[:, (nh + nkv) * hd:].view(num_tokens, nkv, hd)
            prefill_attention(qk[:, :nh], qk[:, nh:], v, kv_cache[0], kv_cache[1], metas[group].prefills,
                              model.scale, attn.view(num_tokens, nh, hd), layer["sliding_window"])
        linear(attn_p, num_tokens, nh * hd, o_l.weight_ptr, hidden, o_l.bias_ptr, o_p)
        rms_norm(x_p, o_p, layer["post_norm"].data_ptr(), eps, num_tokens, hidden, h_p)
        linear(h_p, num_tokens, hidden, gate_up_l.weight_ptr, 2 * inter, gate_up_l.bias_ptr, gate_up_p)
        silu_mul(gate_up_p, num_tokens, inter, act_p)
        linear(act_p, num_tokens, inter, down_l.weight_ptr, hidden, down_l.bias_ptr, down_p)
        residual_p = down_p
    last = x[logit_rows]
    return model.lm_head(model.cpu_kernels.rms_norm(last, down[logit_rows], model.norm, eps))
