"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import KVCacheGroup, ModelConfig
from engine.kernels import cpu_kernels, host_memory, triton_attention
from engine.kernels.cpu_kernels import packed_numel
from engine.model.attention import prefill_attention
from engine.model.cpu_forward import forward_on_cpu_kernels
from engine.model.linear import Linear, pick_kernel


@dataclass
class AttentionMetadata:
    """How this step's tokens map onto the paged KV cache, for one KV-cache group: built once per step
    and group, used by every layer of the group (one group: every layer). The groups' metadata differ
    only in their slots and block tables.

    Tokens are laid out decodes first, then prefill chunks:
        [d0 d1 ... d(B-1) | p0 chunk tokens ... | p1 chunk tokens ... ]

    In a windowed group's tables the null block 0 stands where the window dropped a block: attention
    never reads those positions, and no path may read block 0 unmasked (it is never written; a
    gather that reads whole tables swaps it for a live block first).
    """

    slot_mapping: torch.Tensor            # [num_tokens] flat KV slot (block * block_size + offset)
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64 (padded with 0, the null block)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64: positions each decode attends, itself included
    # per prefill chunk: (first token row, num tokens, first position, block ids covering 0..end)
    prefills: list[tuple[int, int, int, torch.Tensor]]
    # for the Triton kernels (engine/kernels/triton_attention.py), built by the runner's paged-inputs path:
    prefill_chunks: torch.Tensor | None = None         # [3, num_prefills]: first row, num tokens, first position
    prefill_block_tables: torch.Tensor | None = None   # [num_prefills, max_blocks] int64 (padded with 0)
    max_prefill_len: int = 0
    decode_num_splits: int = 1                         # context splits per decode (split-K)


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


def linear_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of every linear layer LlamaModel builds: per layer the fused qkv, o, the fused
    gate_up and down, then the LM head."""
    per_layer = [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
                 (c.hidden_size, c.num_heads * c.head_dim),
                 (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return per_layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in three ops: rotate_half(x) * sin == [x2, x1] * [-sin1, sin1].

    x: [num_tokens, heads, head_dim]; cos, sin_signed: [num_tokens, 1, head_dim]
    """
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin_signed).addcmul_(x, cos)


class LlamaModel:
    """Norms and embeddings as plain tensors, projections as `Linear` (q/k/v and gate/up fused);
    forward over a flat batch of tokens. On a CPU with kvtrace's kernels the forward runs on them
    (engine/model/cpu_forward.py); elsewhere on torch ops, below.

    The KV cache is laid out as vLLM lays out its KV-cache groups (`kv_cache_groups`: the engine's,
    EngineConfig.kv_cache_groups; by default the model's own): one tensor per layer of a group, the
    j-th layer of every group writing tensor j (through its own group's block table, so the groups'
    blocks never overlap); one group: a tensor per layer."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, kv_cache_groups: tuple[KVCacheGroup, ...] | None = None) -> None:
        self.config = config
        self.kv_cache_groups = kv_cache_groups or config.kv_cache_groups
        self.device = device
        self.dtype = dtype
        c = config
        self.linear_kernel = pick_kernel(device, dtype)
        # kvtrace's paged decode attention comes with its linear kernel (same library, same conditions)
        self.cpu_kernels = cpu_kernels.load() if self.linear_kernel == "kvtrace" else None
        # paged attention in Triton on CUDA (the torch SDPA path below is the reference and fallback)
        self.use_triton = self.cpu_kernels is None and triton_attention.enabled(device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        arena, used = None, 0
        if self.cpu_kernels is not None:  # all packed weights in one buffer on huge pages (host_memory.py)
            arena = host_memory.empty(sum(packed_numel(n, k) for n, k in linear_shapes(c)))

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            nonlocal used
            if arena is None:
                return Linear(weight, bias, self.linear_kernel)
            size = packed_numel(*weight.shape)
            used += size
            return Linear(weight, bias, self.linear_kernel, packed_into=arena[used - size:used])

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = linear(self.embed if c.tie_word_embeddings else w("lm_head.weight"))
        # layer -> (its KV-cache group, its KV tensor: its place within the group)
        kv_places = {layer: (g, j) for g, group in enumerate(self.kv_cache_groups)
                     for j, layer in enumerate(group.layers)}
        self.num_kv_tensors = max(len(group.layers) for group in self.kv_cache_groups)
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
                "qkv": linear(qkv, qkv_bias),
                "o": linear(w(p + "self_attn.o_proj.weight")),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                "down": linear(w(p + "mlp.down_proj.weight")),
                "sliding_window": c.layer_windows[i],   # None: full attention
                "group": kv_places[i][0],               # its metadata: metas[group]
                "kv_tensor": kv_places[i][1],           # its KV tensor: kv_caches[kv_tensor]
            })
        # the (group, window) pairs of the layers: the SDPA decodes' gathers and masks, one per pair (a
        # group's layers share a window, unless the hybrid KV cache is off and one group holds them all)
        self.decode_kinds = list(dict.fromkeys((layer["group"], layer["sliding_window"]) for layer in self.layers))
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(positions, rope_inv_freq(c))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # [max_pos, head_dim]
        sin = emb.sin()
        half = c.head_dim // 2
        # sin with its first half negated, for apply_rope
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        assert arena is None or used == arena.numel(), "linear_shapes() and the layers built disagree"

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                kv_caches: list[torch.Tensor], logit_rows: torch.Tensor) -> torch.Tensor:
        """Compute this step's tokens, write their KV, return logits of `logit_rows`: [rows, vocab].
        metas: one per KV-cache group; kv_caches: one per layer of a group (num_kv_tensors)."""
        if self.cpu_kernels is not None:
            return forward_on_cpu_kernels(self, input_ids, positions, metas, kv_caches, logit_rows)
        x = self.embed[input_ids]                      # x: [num_tokens, hidden], the residual stream
        rope = self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)  # [num_tokens, 1, hd]
        decode_gathers = {}  # per (group, window), when SDPA runs the decodes: what it gathers, its mask
        if metas[0].num_decodes and not self.use_triton:
            block_size = kv_caches[0].shape[2]
            decode_gathers = {(group, window): self._decode_gather(metas[group], window, block_size)
                              for group, window in self.decode_kinds}
        pending = None  # the last MLP's output, added to x by the next norm
        for layer in self.layers:
            group = layer["group"]
            meta, kv_cache = metas[group], kv_caches[layer["kv_tensor"]]
            h = self._add_norm(x, pending, layer["input_norm"])
            qkv = layer["qkv"](h)   # [num_tokens, (nh + 2 * nkv) * hd]
            q, k, v = self._rope_and_cache(qkv, rope, kv_cache, meta.slot_mapping)
            window = layer["sliding_window"]
            attn = self._attention(q, k, v, kv_cache, meta, decode_gathers.get((group, window)), window)
            h = self._add_norm(x, layer["o"](attn), layer["post_norm"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            pending = layer["down"](F.silu(gate) * up)
        last = x[logit_rows]
        return self.lm_head(self._add_norm(last, pending[logit_rows], self.norm)).float()

    def _decode_gather(self, meta: AttentionMetadata, window: int | None,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What SDPA's decodes read, for one group's layers of `window`: every block of their tables,
        flattened, and the mask of the positions each decode attends. Null entries (padding, and the
        blocks a window dropped) become the row's own last block, which this step wrote: block 0 is never
        written, and whatever it held would pass through the mask (NaN * 0 is NaN)."""
        tables, lens = meta.decode_block_tables, meta.decode_context_lens[:, None]   # [nd, max_blocks], [nd, 1]
        own_block = tables.gather(1, (lens - 1) // block_size)                        # [nd, 1]
        tables = torch.where(tables == 0, own_block, tables)
        key_pos = torch.arange(tables.shape[1] * block_size, device=self.device)
        # a decode's query is at position len - 1: it attends (len - 1 - window, len - 1]
        mask = key_pos < lens if window is None else (key_pos < lens) & (key_pos >= lens - window)
        return tables.view(-1), mask[:, None, None, :]   # [nd * max_blocks], [nd, 1, 1, max_blocks * block_size]

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """x += residual (in place: x is the residual stream), then RMSNorm(x) * weight."""
        if residual is not None:
            x.add_(residual)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _rope_and_cache(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """RoPE on q and k, this step's K and V written to their cache slots; returns q, k, v:
        [num_tokens, nh | nkv | nkv, hd]."""
        c = self.config
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        num_tokens = qkv.shape[0]
        # RoPE on q and k together (one set of ops per layer, not two)
        qk = apply_rope(qkv[:, :(nh + nkv) * hd].view(num_tokens, nh + nkv, hd), *rope)
        k = qk[:, nh:]
        v = qkv[:, (nh + nkv) * hd:].view(num_tokens, nkv, hd)
        kv_cache[0].view(-1, nkv, hd).index_copy_(0, slot_mapping, k)  # [num_slots, nkv, hd]
        kv_cache[1].view(-1, nkv, hd).index_copy_(0, slot_mapping, v)
        return qk[:, :nh], k, v

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, decode_gather: tuple[torch.Tensor, torch.Tensor] | None,
                   sliding_window: int | None) -> torch.Tensor:
        # kv_cache: [2, num_blocks, block_size, nkv, hd]
        _, num_blocks, block_size, nkv, hd = kv_cache.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_tokens, nh, _ = q.shape
        nd = meta.num_decodes
        if self.use_triton:  # K and V read in place through the block tables
            out = torch.empty(num_tokens, nh, hd, dtype=q.dtype, device=q.device)
            if nd:
                triton_attention.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale, out[:nd],
                                                  meta.decode_num_splits, sliding_window)
            if meta.prefills:
                triton_attention.prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                                   meta.prefill_chunks, meta.max_prefill_len, self.scale, out,
                                                   sliding_window)
            return out.view(num_tokens, nh * hd)
        if nd:
            flat_tables, decode_mask = decode_gather  # [nd * max_blocks], no null block
            # index_select on whole blocks is the fast gather on CPU (advanced indexing is ~3x slower)
            keys = k_cache.index_select(0, flat_tables).view(nd, -1, nkv, hd).transpose(1, 2)  # [nd, nkv, L, hd]
            values = v_cache.index_select(0, flat_tables).view(nd, -1, nkv, hd).transpose(1, 2)
            # the query heads that share a KV head become that head's query rows: no K/V repeat
            # (query head h reads KV head h // group, as with enable_gqa)
            qd = q[:nd].view(nd, nkv, nh // nkv, hd)          # [nd, nkv, group, hd]
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=decode_mask, scale=self.scale)
            # o: [nd, nkv, group, hd] in whatever memory layout the SDPA backend chose (CUDA's
            # memory-efficient kernel returns it transposed): reshape/copy, never view
            if nd == num_tokens:  # decodes only: nothing to merge
                return o.reshape(nd, nh * hd)
            out = torch.empty(num_tokens, nh, hd, dtype=q.dtype, device=q.device)
            out[:nd].view(nd, nkv, nh // nkv, hd).copy_(o)
        else:
            out = torch.empty(num_tokens, nh, hd, dtype=q.dtype, device=q.device)
        prefill_attention(q, k, v, k_cache, v_cache, meta.prefills, self.scale, out, sliding_window)
        return out.view(num_tokens, nh * hd)

