"""Decode steps replayed from CUDA graphs captured at fixed batch sizes (as vLLM does).

A decode step of a small model is a few hundred short kernels; launched one by one from Python, the
launches, not the GPU, set the pace. At start-up the runner captures the decode forward once per
batch size in CAPTURE_SIZES (largest first, sharing one memory pool); a decode-only step then pads
its batch to the next captured size, copies its rows (engine/executor/batch.py) into the graph's
static buffers and replays.

Static inputs, each a view of a buffer allocated once:
    vectors [4, max_batch]       rows: input_ids, positions, slots, context lengths
    tables  [max_batch, max_blocks] block tables; a step fills its first `width` columns
Padding rows write their K and V to a scratch block that the block manager never hands out (the KV
cache has one block more than the pool) and attend to that one position. The Triton decode kernel's
grid depends only on the batch size, so one graph serves every context length. Step timing still
comes from CUDA events recorded around the replay.
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
        device = model.device
        self.vectors = torch.zeros(4, self.max_batch, dtype=torch.int64, device=device)
        self.vectors[2].fill_(self.pad_slot)
        self.vectors[3].fill_(1)
        self.tables = torch.full((self.max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int64,
                                 device=device)
        self.logit_rows = torch.arange(self.max_batch, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(CAPTURE_SIZES):
            self.graphs[size] = self._capture(size, pool)

    def _inputs(self, size: int) -> tuple:
        meta = AttentionMetadata(
            slot_mapping=self.vectors[2, :size], num_decodes=size, decode_block_tables=self.tables[:size],
            decode_context_lens=self.vectors[3, :size], prefills=[],
            decode_num_splits=triton_attention.decode_num_splits(size, self.model.config.num_kv_heads))
        return self.vectors[0, :size], self.vectors[1, :size], meta, self.kv_caches, self.logit_rows[:size]

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
        width = max(len(s.block_table) for s in seqs)
        pad = size - num_seqs
        # [input_ids | positions | slots | context lengths], each `size` long, then tables size x width
        buf = self.step_inputs.host(4 * size + size * width)
        positions = batch.positions
        buf[:size] = batch.input_ids + [0] * pad
        buf[size:2 * size] = positions + [0] * pad
        buf[2 * size:3 * size] = batch.slots + [self.pad_slot] * pad
        buf[3 * size:4 * size] = [p + 1 for p in positions] + [1] * pad
        at = 4 * size
        for s in seqs:
            buf[at:at + len(s.block_table)] = s.block_table
            buf[at + len(s.block_table):at + width] = 0
            at += width
        buf[at:] = self.scratch_block
        dev = self.step_inputs.send(len(buf))
        self.vectors[:, :size].copy_(dev[:4 * size].view(4, size))
        self.tables[:size, :width].copy_(dev[4 * size:].view(size, width))
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:num_seqs]
