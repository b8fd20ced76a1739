"""Decode steps replayed from CUDA graphs captured at fixed batch sizes (as vLLM does).

A decode step of a small model is a few hundred short kernels; launched one by one from Python, the
launches, not the GPU, set the pace. At start-up the runner captures the decode forward once per
batch size in CAPTURE_SIZES (largest first, sharing one memory pool); a decode-only step then pads
its batch to the next captured size, copies its rows (engine/executor/batch.py) into the graph's
static buffers and replays.

Static inputs, each a view of a buffer allocated once (G: the model's KV-cache groups, each with its
own slots and block tables, every layer reading its group's, as in an eager step):
    vectors [3 + G, max_batch]          rows: input_ids, positions, context lengths, each group's slots
    tables  [G, max_batch, max_blocks]  block tables; a step fills each group's first `width` columns
Padding rows write their K and V to a scratch block that the block manager never hands out (the KV
cache has one block more than the pool) and attend to that one position. The Triton decode kernel's
grid depends only on the batch size, so one graph serves every context length; it reads only each
decode's window, never the null blocks a window dropped from a table. Step timing still comes from
CUDA events recorded around the replay.
"""
from __future__ import annotations

import torch

from engine.executor.batch import FlatBatch
from engine.executor.step_inputs import StepInputs
from engine.kernels import triton_attention
from engine.model.llama import AttentionMetadata, LlamaModel

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], scratch_block: int,
                 max_blocks_per_seq: int, step_inputs: StepInputs) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0].shape[2]
        self.scratch_block = scratch_block
        self.pad_slot = scratch_block * self.block_size
        self.step_inputs = step_inputs
        self.max_batch = CAPTURE_SIZES[-1]
        self.num_groups = len(model.kv_cache_groups)
        device = model.device
        self.vectors = torch.zeros(3 + self.num_groups, self.max_batch, dtype=torch.int64, device=device)
        self.vectors[2].fill_(1)
        self.vectors[3:].fill_(self.pad_slot)
        self.tables = torch.full((self.num_groups, self.max_batch, max_blocks_per_seq), scratch_block,
                                 dtype=torch.int64, device=device)
        self.logit_rows = torch.arange(self.max_batch, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(CAPTURE_SIZES):
            self.graphs[size] = self._capture(size, pool)

    def _inputs(self, size: int) -> tuple:
        num_splits = triton_attention.decode_num_splits(size, self.model.config.num_kv_heads)
        metas = [AttentionMetadata(
            slot_mapping=self.vectors[3 + group, :size], num_decodes=size,
            decode_block_tables=self.tables[group, :size], decode_context_lens=self.vectors[2, :size], prefills=[],
            decode_num_splits=num_splits)
            for group in range(self.num_groups)]
        return self.vectors[0, :size], self.vectors[1, :size], metas, self.kv_caches, self.logit_rows[:size]

    def _capture(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = self._inputs(size)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self.model.forward(*inputs)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.forward(*inputs)
        return graph, logits

    def run(self, batch: FlatBatch) -> torch.Tensor | None:
        """Logits [num_decodes, vocab] of a decode-only batch, or None when it is larger than any graph."""
        seqs = batch.decodes
        num_seqs = len(seqs)
        if num_seqs > self.max_batch:
            return None
        size = next(s for s in CAPTURE_SIZES if s >= num_seqs)
        tables = [batch.decode_tables(group) for group in range(self.num_groups)]
        widths = [max(len(t) for t in group_tables) for group_tables in tables]
        pad = size - num_seqs
        num_vectors = 3 + self.num_groups
        # [input_ids | positions | context lengths | each group's slots], each `size` long, then each
        # group's tables, size x its width
        buf = self.step_inputs.host(num_vectors * size + size * sum(widths))
        positions = batch.positions
        buf[:size] = batch.input_ids + [0] * pad
        buf[size:2 * size] = positions + [0] * pad
        buf[2 * size:3 * size] = [p + 1 for p in positions] + [1] * pad
        for group, slots in enumerate(batch.slots):
            buf[(3 + group) * size:(4 + group) * size] = slots + [self.pad_slot] * pad
        at = num_vectors * size
        for group_tables, width in zip(tables, widths):
            for table in group_tables:
                buf[at:at + len(table)] = table
                buf[at + len(table):at + width] = 0
                at += width
            buf[at:at + pad * width] = self.scratch_block
            at += pad * width
        dev = self.step_inputs.send(len(buf))
        self.vectors[:, :size].copy_(dev[:num_vectors * size].view(num_vectors, size))
        at = num_vectors * size
        for group, width in enumerate(widths):
            self.tables[group, :size, :width].copy_(dev[at:at + size * width].view(size, width))
            at += size * width
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:num_seqs]
