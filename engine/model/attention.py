"""Attention of prefill chunks over the paged KV cache, with torch's SDPA (shared by both forward paths)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefills: list[tuple[int, int, int, torch.Tensor]], scale: float, out: torch.Tensor,
                      sliding_window: int | None = None) -> None:
    """Each prefill chunk's attention into its rows of out: [num_tokens, nh, hd]. q: [num_tokens, nh, hd];
    k, v: [num_tokens, nkv, hd] (this step's, already in the cache); caches: [blocks, block_size, nkv, hd].
    With a sliding window the query at position p attends the keys at positions (p - sliding_window, p]."""
    nh, nkv, hd = q.shape[1], k.shape[1], q.shape[2]
    for row, length, start, block_ids in prefills:
        qp = q[row:row + length].transpose(0, 1).unsqueeze(0)       # [1, nh, length, hd]
        end = start + length
        if start == 0:  # nothing before this chunk: its own tokens are all the keys
            kp = k[row:row + length].transpose(0, 1).unsqueeze(0)    # [1, nkv, length, hd]
            vp = v[row:row + length].transpose(0, 1).unsqueeze(0)
            first_key = 0
        else:  # earlier positions come from the cache: read them through the block table
            # the chunk's first query sees nothing before first_key, and no later query sees more:
            #   positions  0 ... first_key ... start ......... end
            #   keys read       [---------------------------)   (with a window; else from 0)
            first_key = 0 if sliding_window is None else max(0, start - sliding_window + 1)
            keys = slice(first_key, end)
            if first_key:   # the blocks before the one holding first_key are not read
                first_block = first_key // k_cache.shape[1]
                block_ids = block_ids[first_block:]
                keys = slice(first_key - first_block * k_cache.shape[1], end - first_block * k_cache.shape[1])
            kp = k_cache.index_select(0, block_ids).view(-1, nkv, hd)[keys].transpose(0, 1).unsqueeze(0)
            vp = v_cache.index_select(0, block_ids).view(-1, nkv, hd)[keys].transpose(0, 1).unsqueeze(0)
        if start == 0 and sliding_window is None:  # causal over its own tokens, SDPA's own mask
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=nh != nkv)
        else:
            query_pos = torch.arange(start, end, device=q.device).unsqueeze(1)
            key_pos = torch.arange(first_key, end, device=q.device).unsqueeze(0)
            mask = key_pos <= query_pos                          # [length, end - first_key]
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=nh != nkv)
        out[row:row + length] = o.squeeze(0).transpose(0, 1)
