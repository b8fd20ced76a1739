"""Attention of prefill chunks over the paged KV cache, with torch's SDPA (shared by both forward paths)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefills: list[tuple[int, int, int, torch.Tensor]], scale: float, out: torch.Tensor) -> None:
    """Each prefill chunk's attention into its rows of out: [num_tokens, nh, hd]. q: [num_tokens, nh, hd];
    k, v: [num_tokens, nkv, hd] (this step's, already in the cache); caches: [blocks, block_size, nkv, hd]."""
    nh, nkv, hd = q.shape[1], k.shape[1], q.shape[2]
    for row, length, start, block_ids in prefills:
        qp = q[row:row + length].transpose(0, 1).unsqueeze(0)       # [1, nh, length, hd]
        if start == 0:  # nothing before this chunk: attend to its own tokens, causally
            kp = k[row:row + length].transpose(0, 1).unsqueeze(0)    # [1, nkv, length, hd]
            vp = v[row:row + length].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=nh != nkv)
        else:  # earlier positions come from the cache: read them through the block table
            end = start + length
            kp = k_cache.index_select(0, block_ids).view(-1, nkv, hd)[:end].transpose(0, 1).unsqueeze(0)
            vp = v_cache.index_select(0, block_ids).view(-1, nkv, hd)[:end].transpose(0, 1).unsqueeze(0)
            query_pos = torch.arange(start, end, device=q.device).unsqueeze(1)
            mask = torch.arange(end, device=q.device).unsqueeze(0) <= query_pos  # [length, end]
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=nh != nkv)
        out[row:row + length] = o.squeeze(0).transpose(0, 1)
