"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig


@dataclass
class AttentionMetadata:
    """How this step's tokens map onto the paged KV cache; built once per step, used by every layer.

    Tokens are laid out decodes first, then prefill chunks:
        [d0 d1 ... d(B-1) | p0 chunk tokens ... | p1 chunk tokens ... ]
    """

    slot_mapping: torch.Tensor            # [num_tokens] flat KV slot (block * block_size + offset)
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] (padded with 0)
    decode_mask: torch.Tensor | None      # [num_decodes, 1, 1, max_blocks * block_size] True = attend
    # per prefill chunk: (first token row, num tokens, first position, block ids covering 0..end)
    prefills: list[tuple[int, int, int, torch.Tensor]]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights as plain tensors (q/k/v and gate/up fused); forward over a flat batch of tokens."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        c = config

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                             w(p + "self_attn.v_proj.weight")])
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                      w(p + "self_attn.v_proj.bias")])
            self.layers.append({
                "input_norm": w(p + "input_layernorm.weight"),
                "qkv": qkv,
                "qkv_bias": qkv_bias,
                "o": w(p + "self_attn.o_proj.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down": w(p + "mlp.down_proj.weight"),
            })
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(positions, rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # [max_pos, head_dim]
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(c.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], logit_rows: torch.Tensor) -> torch.Tensor:
        """Compute this step's tokens, write their KV, return logits of `logit_rows`: [rows, vocab]."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        num_tokens = input_ids.shape[0]
        x = self.embed[input_ids]                      # x: [num_tokens, hidden]
        cos = self.cos[positions].unsqueeze(1)         # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = rms_norm(x, layer["input_norm"], c.rms_norm_eps)
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(num_tokens, nh, hd)
            k = k.view(num_tokens, nkv, hd)
            v = v.view(num_tokens, nkv, hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = self._attention(q, k, v, kv_cache, meta)  # [num_tokens, nh * hd]
            x = x + F.linear(attn, layer["o"])
            h = rms_norm(x, layer["post_norm"], c.rms_norm_eps)
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        h = rms_norm(x[logit_rows], self.norm, c.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        # kv_cache: [2, num_blocks, block_size, nkv, hd]
        _, num_blocks, block_size, nkv, hd = kv_cache.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, nkv, hd).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, nkv, hd).index_copy_(0, meta.slot_mapping, v)
        num_tokens, nh, _ = q.shape
        out = torch.empty(num_tokens, nh, hd, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            tables = meta.decode_block_tables               # [nd, max_blocks]
            keys = k_cache[tables].view(nd, -1, nkv, hd).transpose(1, 2)    # [nd, nkv, L, hd]
            values = v_cache[tables].view(nd, -1, nkv, hd).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)                          # [nd, nh, 1, hd]
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=meta.decode_mask,
                                               scale=self.scale, enable_gqa=nh != nkv)
            out[:nd] = o.squeeze(2)
        for row, length, start, block_ids in meta.prefills:
            qp = q[row:row + length].transpose(0, 1).unsqueeze(0)       # [1, nh, length, hd]
            if start == 0:  # nothing before this chunk: attend to its own tokens, causally
                kp = k[row:row + length].transpose(0, 1).unsqueeze(0)    # [1, nkv, length, hd]
                vp = v[row:row + length].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                   enable_gqa=nh != nkv)
            else:  # earlier positions come from the cache: read them through the block table
                end = start + length
                kp = k_cache[block_ids].view(-1, nkv, hd)[:end].transpose(0, 1).unsqueeze(0)
                vp = v_cache[block_ids].view(-1, nkv, hd)[:end].transpose(0, 1).unsqueeze(0)
                query_pos = torch.arange(start, end, device=q.device).unsqueeze(1)
                mask = torch.arange(end, device=q.device).unsqueeze(0) <= query_pos  # [length, end]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=nh != nkv)
            out[row:row + length] = o.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, nh * hd)
