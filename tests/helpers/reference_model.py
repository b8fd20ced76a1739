"""Ground truth: a plain dense Llama forward (no paging, no KV cache) to test the paged engine against.

Every step recomputes the whole sequence with causal attention (within its sliding window on a
windowed layer: keys (p - window, p] for the query at p), in fp32, written to be read.
"""
from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama 3's rope scaling when the config has it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq.float()
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    # long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def reference_forward(config: ModelConfig, weights: dict[str, torch.Tensor], input_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] for every position of `input_ids`."""
    w = {name: t.float() for name, t in weights.items()}
    num_tokens, d = len(input_ids), config.head_dim
    h, kv = config.num_heads, config.num_kv_heads

    positions = torch.arange(num_tokens, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(config))         # [T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None]  # [T, 1, d]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()

    x = w["model.embed_tokens.weight"][torch.tensor(input_ids)]     # [T, hidden]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."

        def linear(name: str, inp: torch.Tensor) -> torch.Tensor:
            out = inp @ w[p + name + ".weight"].T
            bias = w.get(p + name + ".bias")
            return out if bias is None else out + bias

        a = rms_norm(x, w[p + "input_layernorm.weight"], config.rms_norm_eps)
        q = linear("self_attn.q_proj", a).view(num_tokens, h, d)   # [T, h, d]
        k = linear("self_attn.k_proj", a).view(num_tokens, kv, d)  # [T, kv, d]
        v = linear("self_attn.v_proj", a).view(num_tokens, kv, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(h // kv, dim=1)                     # [T, h, d]: query head j reads kv head j // (h/kv)
        v = v.repeat_interleave(h // kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [h, T, T]
        window = config.layer_windows[i]
        visible = causal if window is None else causal.triu(-(window - 1))   # key > query - window
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).reshape(num_tokens, h * d)
        x = x + linear("self_attn.o_proj", attn)

        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate, up = linear("mlp.gate_proj", m), linear("mlp.up_proj", m)
        x = x + linear("mlp.down_proj", torch.nn.functional.silu(gate) * up)

    x = rms_norm(x, w["model.norm.weight"], config.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T                                               # [T, vocab]


def greedy_generate(config: ModelConfig, weights: dict[str, torch.Tensor], prompt_ids: list[int],
                    max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding by recomputing the full sequence each step; returns only the new ids."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = int(reference_forward(config, weights, ids)[-1].argmax())
            ids.append(next_id)
            if next_id == eos_token_id:
                break
    return ids[len(prompt_ids):]
