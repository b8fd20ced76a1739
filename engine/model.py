"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache."""
from __future__ import annotations

import functools
import math
import os
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


# oneDNN picks its blocked weight layout for this many rows; any row count runs on it
_ONEDNN_BATCH_HINT = 32


def use_onednn_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """On CPU in fp32, oneDNN's linear on weights reordered once into its blocked layout is about 2x
    faster than F.linear (MKL) at decode batch sizes and ~15 % faster for prefill (what vLLM's CPU
    backend does too). The same products and sums in another order: results differ in the last bits."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get("KVTRACE_ONEDNN", "1") == "0":
        return False
    return _onednn_linear_works()


@functools.cache
def _onednn_linear_works() -> bool:
    """The oneDNN ops are private torch API: check once that they exist here and agree with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
        x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, weight), atol=1e-4, rtol=1e-4))
    except (RuntimeError, AttributeError, TypeError):
        return False


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in three ops: rotate_half(x) * sin == [x2, x1] * [-sin1, sin1].

    x: [num_tokens, heads, head_dim]; cos, sin_signed: [num_tokens, 1, head_dim]
    """
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin_signed).addcmul_(x, cos)


class LlamaModel:
    """Weights as plain tensors (q/k/v and gate/up fused); forward over a flat batch of tokens."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        c = config
        self.onednn = use_onednn_linear(device, dtype)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def linear_weight(weight: torch.Tensor) -> torch.Tensor:
            """[out, in], as `linear` wants it: reordered for oneDNN once here, or as it is."""
            return torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT) if self.onednn else weight

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = linear_weight(self.embed if c.tie_word_embeddings else w("lm_head.weight"))
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
                "qkv": linear_weight(qkv),
                "qkv_bias": qkv_bias,
                "o": linear_weight(w(p + "self_attn.o_proj.weight")),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": linear_weight(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                "down": linear_weight(w(p + "mlp.down_proj.weight")),
            })
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(positions, rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # [max_pos, head_dim]
        sin = emb.sin()
        half = c.head_dim // 2
        # sin with its first half negated, for apply_rope
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], logit_rows: torch.Tensor) -> torch.Tensor:
        """Compute this step's tokens, write their KV, return logits of `logit_rows`: [rows, vocab]."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        num_tokens = input_ids.shape[0]
        x = self.embed[input_ids]                      # x: [num_tokens, hidden]
        cos = self.cos[positions].unsqueeze(1)         # [num_tokens, 1, head_dim]
        sin_signed = self.sin_signed[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = rms_norm(x, layer["input_norm"], c.rms_norm_eps)
            qkv = self.linear(h, layer["qkv"], layer["qkv_bias"])   # [num_tokens, (nh + 2 * nkv) * hd]
            # RoPE on q and k together (one set of ops per layer, not two)
            qk = apply_rope(qkv[:, :(nh + nkv) * hd].view(num_tokens, nh + nkv, hd), cos, sin_signed)
            q, k = qk[:, :nh], qk[:, nh:]                            # [num_tokens, nh | nkv, hd]
            v = qkv[:, (nh + nkv) * hd:].view(num_tokens, nkv, hd)
            attn = self._attention(q, k, v, kv_cache, meta)  # [num_tokens, nh * hd]
            x = x + self.linear(attn, layer["o"])
            h = rms_norm(x, layer["post_norm"], c.rms_norm_eps)
            gate, up = self.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + self.linear(F.silu(gate) * up, layer["down"])
        h = rms_norm(x[logit_rows], self.norm, c.rms_norm_eps)
        return self.linear(h, self.lm_head).float()

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        # kv_cache: [2, num_blocks, block_size, nkv, hd]
        _, num_blocks, block_size, nkv, hd = kv_cache.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, nkv, hd).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, nkv, hd).index_copy_(0, meta.slot_mapping, v)
        num_tokens, nh, _ = q.shape
        nd = meta.num_decodes
        if nd:
            flat_tables = meta.decode_block_tables.view(-1)  # [nd * max_blocks]
            # index_select on whole blocks is the fast gather on CPU (advanced indexing is ~3x slower)
            keys = k_cache.index_select(0, flat_tables).view(nd, -1, nkv, hd).transpose(1, 2)  # [nd, nkv, L, hd]
            values = v_cache.index_select(0, flat_tables).view(nd, -1, nkv, hd).transpose(1, 2)
            # the query heads that share a KV head become that head's query rows: no K/V repeat
            # (query head h reads KV head h // group, as with enable_gqa)
            qd = q[:nd].view(nd, nkv, nh // nkv, hd)          # [nd, nkv, group, hd]
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
            if nd == num_tokens:  # decodes only: nothing to merge
                return o.view(nd, nh * hd)
            out = torch.empty(num_tokens, nh, hd, dtype=q.dtype, device=q.device)
            out[:nd] = o.view(nd, nh, hd)
        else:
            out = torch.empty(num_tokens, nh, hd, dtype=q.dtype, device=q.device)
        for row, length, start, block_ids in meta.prefills:
            qp = q[row:row + length].transpose(0, 1).unsqueeze(0)       # [1, nh, length, hd]
            if start == 0:  # nothing before this chunk: attend to its own tokens, causally
                kp = k[row:row + length].transpose(0, 1).unsqueeze(0)    # [1, nkv, length, hd]
                vp = v[row:row + length].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                   enable_gqa=nh != nkv)
            else:  # earlier positions come from the cache: read them through the block table
                end = start + length
                kp = k_cache.index_select(0, block_ids).view(-1, nkv, hd)[:end].transpose(0, 1).unsqueeze(0)
                vp = v_cache.index_select(0, block_ids).view(-1, nkv, hd)[:end].transpose(0, 1).unsqueeze(0)
                query_pos = torch.arange(start, end, device=q.device).unsqueeze(1)
                mask = torch.arange(end, device=q.device).unsqueeze(0) <= query_pos  # [length, end]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=nh != nkv)
            out[row:row + length] = o.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, nh * hd)
