"""Runs a scheduled step on a device: KV copies (swap, copy-on-write), the forward pass, sampling.

On CUDA, swap copies use pinned host memory and a side stream; the compute stream waits on an
event before it reads restored blocks or overwrites released ones. Durations come from CUDA
events that the engine resolves later, never with a synchronisation of their own.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from engine import host_memory
from engine.model import AttentionMetadata, LlamaModel
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass
class StepTiming:
    """Device timings of one step, resolved when `ready()`."""

    forward: tuple | float | None = None                 # (start, end) CUDA events, or ms
    swap_out: tuple | float | None = None
    swap_in: tuple | float | None = None

    def ready(self) -> bool:
        return all(not isinstance(t, tuple) or t[1].query() for t in (self.forward, self.swap_out, self.swap_in))

    @staticmethod
    def ms(t: tuple | float | None) -> float | None:
        if isinstance(t, tuple):
            return t[0].elapsed_time(t[1])
        return t


@dataclass
class StepResult:
    sample_seqs: list[Sequence] = field(default_factory=list)  # sequences whose last token got logits
    logits: torch.Tensor | None = None                           # [len(sample_seqs), vocab]
    timing: StepTiming = field(default_factory=StepTiming)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks `block_ids` of every layer, block-major like the host swap space (the batched
    swap-out's device side; plain tensor indexing, so it is tested on CPU as well).

    kv_caches[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]
    returns:          [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]
    """
    return torch.stack([kv[:, block_ids] for kv in kv_caches]).permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, staged: torch.Tensor) -> None:
    """Write block-major `staged` ([n, layers, 2, bs, nkv, hd]) into blocks `block_ids` of every layer
    (the batched swap-in's device side): staged[i] goes to block block_ids[i]."""
    for layer, kv in enumerate(kv_caches):
        kv[:, block_ids] = staged[:, layer].transpose(0, 1)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_cpu_blocks: int) -> None:
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.block_size = block_size
        c = model.config
        self.is_cuda = self.device.type == "cuda"
        # one preallocated KV tensor per layer, indexed by physical block
        layer_shape = (2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        if self.device.type == "cpu":  # one buffer on huge pages (engine/host_memory.py), a view per layer
            pool = host_memory.empty(c.num_layers * math.prod(layer_shape), dtype=self.dtype).zero_()
            self.kv_caches = list(pool.view(c.num_layers, *layer_shape).unbind(0))
        else:
            self.kv_caches = [torch.zeros(layer_shape, device=self.device, dtype=self.dtype)
                              for _ in range(c.num_layers)]
        # host swap space, block-major so one block is one contiguous copy
        self.host_cache = torch.zeros(num_cpu_blocks, c.num_layers, 2, block_size, c.num_kv_heads,
                                      c.head_dim, dtype=self.dtype, pin_memory=self.is_cuda)
        self.swap_stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None

    # ---- KV copies ----------------------------------------------------------------------
    def _event_pair(self) -> tuple:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def swap_out(self, mapping: list[tuple[int, int]]) -> tuple | float:
        if not self.is_cuda:
            # one copy per block and layer: on CPU this beats index_put on these strided views ~15x
            t0 = time.perf_counter()
            for (d, h) in mapping:
                host_block = self.host_cache[h]                      # [layers, 2, bs, nkv, hd]
                for layer, kv in enumerate(self.kv_caches):
                    host_block[layer].copy_(kv[:, d])
            return (time.perf_counter() - t0) * 1000
        dev_ids = torch.tensor([d for d, _ in mapping], device=self.device)
        host_ids = [h for _, h in mapping]
        start, end = self._event_pair()
        self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written before copying
        with torch.cuda.stream(self.swap_stream):
            start.record()
            staged = gather_blocks(self.kv_caches, dev_ids)
            for i, h in enumerate(host_ids):
                self.host_cache[h].copy_(staged[i], non_blocking=True)
            end.record()
            staged.record_stream(self.swap_stream)
        # the released device blocks may be reused by this step's forward: wait for the copy
        torch.cuda.current_stream(self.device).wait_event(end)
        return start, end

    def swap_in(self, mapping: list[tuple[int, int]]) -> tuple | float:
        if not self.is_cuda:
            t0 = time.perf_counter()
            for (h, d) in mapping:
                host_block = self.host_cache[h]
                for layer, kv in enumerate(self.kv_caches):
                    kv[:, d].copy_(host_block[layer])
            return (time.perf_counter() - t0) * 1000
        host_ids = [h for h, _ in mapping]
        dev_ids = torch.tensor([d for _, d in mapping], device=self.device)
        start, end = self._event_pair()
        self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))  # new blocks no longer in use
        with torch.cuda.stream(self.swap_stream):
            start.record()
            staged = torch.empty((len(host_ids), *self.host_cache.shape[1:]), device=self.device, dtype=self.dtype)
            for i, h in enumerate(host_ids):
                staged[i].copy_(self.host_cache[h], non_blocking=True)
            scatter_blocks(self.kv_caches, dev_ids, staged)
            end.record()
            staged.record_stream(self.swap_stream)
        torch.cuda.current_stream(self.device).wait_event(end)  # restored before the forward reads it
        return start, end

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks on the device, in every layer."""
        for kv in self.kv_caches:
            for src, dst in copies:
                kv[:, dst].copy_(kv[:, src])

    # ---- the step -----------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        result = StepResult()
        if out.swap_out:
            result.timing.swap_out = self.swap_out(out.swap_out)
        if out.swap_in:
            result.timing.swap_in = self.swap_in(out.swap_in)
        if out.copies:
            self.copy_blocks(out.copies)
        if not out.seqs:
            return result
        meta, input_ids, positions, logit_rows, result.sample_seqs = self._prepare(out, result)
        if self.is_cuda:
            start, end = self._event_pair()
            start.record()
            result.logits = self.model.forward(input_ids, positions, meta, self.kv_caches, logit_rows)
            end.record()
            result.timing.forward = (start, end)
        else:
            t0 = time.perf_counter()
            result.logits = self.model.forward(input_ids, positions, meta, self.kv_caches, logit_rows)
            result.timing.forward = (time.perf_counter() - t0) * 1000
        return result

    def _prepare(self, out: SchedulerOutput, result: StepResult):
        """Flatten the batch: decodes first, then prefill chunks (see AttentionMetadata)."""
        bs = self.block_size
        decodes: list[Sequence] = []
        prefills: list[tuple[Sequence, int]] = []
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            if not seq.is_prefilling:
                decodes.append(seq)
            else:
                prefills.append((seq, num_new))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_seqs: list[Sequence] = []
        logit_rows: list[int] = []
        for row, seq in enumerate(decodes):
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            sample_seqs.append(seq)
            logit_rows.append(row)
        prefill_meta = []
        for seq, num_new in prefills:
            row = len(input_ids)
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            block_ids = torch.tensor(table[:-(-end // bs)], device=self.device) if start else None
            prefill_meta.append((row, num_new, start, block_ids))
            if end == seq.num_tokens:
                sample_seqs.append(seq)
                logit_rows.append(row + num_new - 1)
        result.num_decode_tokens = len(decodes)
        result.num_prefill_tokens = len(input_ids) - len(decodes)
        decode_tables = decode_lens = None
        if decodes:
            max_blocks = max(len(s.block_table) for s in decodes)
            decode_tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in decodes],
                                         device=self.device)
            decode_lens = torch.tensor([s.num_computed_tokens + 1 for s in decodes], device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decodes=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefill_meta,
        )
        return (meta, torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                torch.tensor(logit_rows, dtype=torch.long, device=self.device), sample_seqs)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row: greedy rows by one argmax, the others from their own seeded generator."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            continue
        probs = torch.softmax(logits[row].float().cpu() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens
