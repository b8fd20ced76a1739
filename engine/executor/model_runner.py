"""Runs a scheduled step on a device: KV copies (swap, copy-on-write), the forward pass, sampling.

On CUDA, swap copies and the host KV tier's use pinned host memory and a side stream; the compute
stream waits on an event before it reads restored blocks or overwrites released ones. Durations come from CUDA
events that the engine resolves later, never with a synchronisation of their own.

On CUDA nothing in `execute` waits for the device: its integers travel in one non-blocking copy
(step_inputs.py), decode-only batches replay a CUDA graph (cuda_graphs.py), and greedy sampling is
an argmax on the device. The host waits at one documented point per step, the end: `sample()`
reading the tokens (the non-greedy rows read their logits there, in one copy), and at the end of a run, the
engine's flush.
"""
from __future__ import annotations

import itertools
import math
import os
import time

import torch

from engine.executor import StepResult, StepTiming
from engine.executor.batch import FlatBatch, flatten
from engine.executor.cuda_graphs import DecodeGraphs
from engine.executor.step_inputs import StepInputs
from engine.kernels import host_memory, triton_attention
from engine.model.llama import AttentionMetadata, LlamaModel
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

SWAP_STAGING_BYTES = 256 << 20   # the device buffer that swaps pass through on CUDA (staging_blocks)


def resolve_device(name: str) -> torch.device:
    """`--device` as a torch.device, a CUDA one with its ordinal made explicit ('cuda' is the current
    device); ValueError when this machine has no such device."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def tf32_matmuls(device_type: str, dtype: torch.dtype) -> bool:
    """Run fp32 matmuls as TF32 on the tensor cores? On CUDA yes, as vLLM does with fp32 models (fp32
    without it runs on the CUDA cores, several times slower); `KVTRACE_TF32=0` keeps full fp32 (what a
    comparison with an fp32 reference wants). The attention kernels keep full-precision dots either way."""
    return device_type == "cuda" and dtype == torch.float32 and os.environ.get("KVTRACE_TF32", "1") != "0"


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The blocks `block_ids` of every KV tensor (one per layer of a KV-cache group: a tensor shared by
    several groups is copied once), block-major like the host swap space, written into `out` (the
    batched swap-out's device side; plain tensor indexing, so it is tested on CPU as well). One tensor
    at a time: beside `out` it holds one tensor's blocks at most (stacking every tensor and then making
    a permuted copy of the stack held twice the swapped bytes).

    kv_caches[i]: [2, num_blocks, block_size, num_kv_heads, head_dim]
    out:          [len(block_ids), len(kv_caches), 2, block_size, num_kv_heads, head_dim]
    """
    for i, kv in enumerate(kv_caches):
        out[:, i] = kv[:, block_ids].transpose(0, 1)   # kv[:, block_ids]: [2, n, bs, nkv, hd]
    return out


def staging_blocks(block_bytes: int, num_cpu_blocks: int | None = None) -> int:
    """Blocks of the device buffer that swaps pass through on CUDA: SWAP_STAGING_BYTES' worth (at least
    one), no more than the host pool holds; a larger swap goes through it in parts."""
    blocks = max(1, SWAP_STAGING_BYTES // block_bytes)
    return blocks if num_cpu_blocks is None else min(blocks, num_cpu_blocks)


def swap_staging_reserve(block_bytes: int, num_kv_tensors: int) -> int:
    """Device memory a swap holds on CUDA (build.pool_geometry reserves it): the staging buffer
    and one KV tensor's blocks that gather_blocks holds beside it."""
    staged = staging_blocks(block_bytes) * block_bytes
    return staged + -(-staged // num_kv_tensors)


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, staged: torch.Tensor) -> None:
    """Write block-major `staged` ([n, len(kv_caches), 2, bs, nkv, hd]) into blocks `block_ids` of every
    KV tensor (the batched swap-in's device side): staged[i] goes to block block_ids[i]."""
    for i, kv in enumerate(kv_caches):
        kv[:, block_ids] = staged[:, i].transpose(0, 1)


class ModelRunner:
    """The Executor of the real engine: the model's forward on its KV tensors, then sampling."""

    emits_token_ids = True

    # the host's clock and sleep, each one place that a modelled clock can stand in for (scripts/postmortem.py)
    @staticmethod
    def clock() -> float:
        return time.perf_counter()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_cpu_blocks: int,
                 num_offload_blocks: int = 0) -> None:
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.block_size = block_size
        c = model.config
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            # the engine's device becomes the current one: Triton launches on the current device, and
            # CUDA events record on the current device's stream (on cuda:1 they timed an idle cuda:0)
            self.device = resolve_device(str(self.device))
            torch.cuda.set_device(self.device)
            # torch's switch is per process: set it both ways, so that each engine gets its own choice
            torch.backends.cuda.matmul.allow_tf32 = tf32_matmuls(self.device.type, self.dtype)
        # CUDA (and Triton's interpreter) take a step's integers in one copy (step_inputs.py); the CPU
        # kernels keep their own path
        self.paged_inputs = self.is_cuda or model.use_triton
        self.step_inputs, self.swap_out_ids, self.swap_in_ids = (StepInputs(self.device) for _ in range(3))
        self.num_groups = len(model.kv_cache_groups)
        # preallocated KV tensors indexed by physical block, as vLLM lays out its KV-cache groups: one per
        # layer of a group, the j-th layer of every group in tensor j (a block belongs to one group's
        # table at a time), so a block holds KV for the largest group's layers (one group: a tensor per
        # layer). On CUDA one block more, the scratch block that padded rows of a CUDA graph write to
        # (never in the block manager's pool)
        num_kv_tensors = model.num_kv_tensors
        layer_shape = (2, num_blocks + self.is_cuda, block_size, c.num_kv_heads, c.head_dim)
        if self.device.type == "cpu":  # one buffer on huge pages (engine/kernels/host_memory.py), a view per tensor
            pool = host_memory.empty(num_kv_tensors * math.prod(layer_shape), dtype=self.dtype).zero_()
            self.kv_caches = list(pool.view(num_kv_tensors, *layer_shape).unbind(0))
        else:
            self.kv_caches = [torch.zeros(layer_shape, device=self.device, dtype=self.dtype)
                              for _ in range(num_kv_tensors)]
        # host swap space, block-major so one block is one contiguous copy
        host_shape = (num_cpu_blocks, num_kv_tensors, 2, block_size, c.num_kv_heads, c.head_dim)
        if self.is_cuda:  # exactly these bytes pinned (not rounded up to a power of two: host_memory.py)
            self.host_cache = host_memory.pinned_empty(math.prod(host_shape), self.dtype).view(host_shape)
        else:
            self.host_cache = torch.zeros(host_shape, dtype=self.dtype)
        # the host KV tier's buffer (engine/offload.py), block-major as the swap space (pinned on CUDA)
        tier_shape = (num_offload_blocks, *host_shape[1:])
        self.tier_cache = None
        if num_offload_blocks and self.is_cuda:
            self.tier_cache = host_memory.pinned_empty(math.prod(tier_shape), self.dtype).view(tier_shape)
        elif num_offload_blocks:
            self.tier_cache = torch.zeros(tier_shape, dtype=self.dtype)
        self.tier_ids = StepInputs(self.device) if num_offload_blocks else None
        self.swap_stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        # swaps and the tier's copies (never both in one engine) go through one preallocated device
        # buffer, in parts when larger: its size is fixed and reserved (build.pool_geometry), and the
        # swap stream orders one part's reuse after the last
        self.staging = None
        if self.is_cuda and (num_cpu_blocks or num_offload_blocks):
            block_bytes = math.prod(host_shape[1:]) * self.kv_caches[0].element_size()
            self.staging = torch.empty((staging_blocks(block_bytes, num_cpu_blocks or num_offload_blocks),
                                        *host_shape[1:]), device=self.device, dtype=self.dtype)
        # decode-only steps from CUDA graphs (cuda_graphs.py); KVTRACE_CUDA_GRAPHS=0 launches eagerly
        self.decode_graphs = None
        if self.is_cuda and model.use_triton and os.environ.get("KVTRACE_CUDA_GRAPHS", "1") != "0":
            max_blocks_per_seq = min(num_blocks, -(-c.max_position_embeddings // block_size))
            self.decode_graphs = DecodeGraphs(model, self.kv_caches, num_blocks, max_blocks_per_seq,
                                              self.step_inputs)

    def idle_until(self, t: float) -> None:
        """Nothing to run before clock time `t`: sleep towards it, at most 50 ms (arrivals may come sooner)."""
        self.sleep(min(max(t - self.clock(), 0.0), 0.05))

    # ---- KV copies ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device's queued work, so that every step's CUDA events resolve (the end of a run)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _event_pair(self) -> tuple:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _device_ids(self, inputs: StepInputs, ids: list[int]) -> torch.Tensor:
        inputs.host(len(ids))[:] = ids
        return inputs.send(len(ids))

    def swap_out(self, mapping: list[tuple[int, int]]) -> tuple | float:
        if not self.is_cuda:
            # one copy per block and KV tensor: on CPU this beats index_put on these strided views ~15x
            t0 = time.perf_counter()
            for (d, h) in mapping:
                host_block = self.host_cache[h]                      # [kv tensors, 2, bs, nkv, hd]
                for i, kv in enumerate(self.kv_caches):
                    host_block[i].copy_(kv[:, d])
            return (time.perf_counter() - t0) * 1000
        dev_ids = self._device_ids(self.swap_out_ids, [d for d, _ in mapping])
        host_ids = [h for _, h in mapping]
        start, end = self._event_pair()
        self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written before copying
        with torch.cuda.stream(self.swap_stream):
            start.record(self.swap_stream)
            for first, part in self._staged_parts(len(host_ids)):
                staged = gather_blocks(self.kv_caches, dev_ids[first:first + part], self.staging[:part])
                # one DMA per run of neighbouring host blocks
                for i, h, n in consecutive_runs(host_ids[first:first + part]):
                    self.host_cache[h:h + n].copy_(staged[i:i + n], non_blocking=True)
            end.record(self.swap_stream)
        # the released device blocks may be reused by this step's forward: wait for the copy
        torch.cuda.current_stream(self.device).wait_event(end)
        return start, end

    def swap_in(self, mapping: list[tuple[int, int]]) -> tuple | float:
        if not self.is_cuda:
            t0 = time.perf_counter()
            for (h, d) in mapping:
                host_block = self.host_cache[h]
                for i, kv in enumerate(self.kv_caches):
                    kv[:, d].copy_(host_block[i])
            return (time.perf_counter() - t0) * 1000
        host_ids = [h for h, _ in mapping]
        dev_ids = self._device_ids(self.swap_in_ids, [d for _, d in mapping])
        start, end = self._event_pair()
        self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))  # new blocks no longer in use
        with torch.cuda.stream(self.swap_stream):
            start.record(self.swap_stream)
            for first, part in self._staged_parts(len(host_ids)):
                staged = self.staging[:part]
                for i, h, n in consecutive_runs(host_ids[first:first + part]):
                    staged[i:i + n].copy_(self.host_cache[h:h + n], non_blocking=True)
                scatter_blocks(self.kv_caches, dev_ids[first:first + part], staged)
            end.record(self.swap_stream)
        torch.cuda.current_stream(self.device).wait_event(end)  # restored before the forward reads it
        return start, end

    def _staged_parts(self, num_blocks: int) -> list[tuple[int, int]]:
        """(first, count) of each part of a swap of num_blocks that fits the staging buffer."""
        cap = self.staging.shape[0]
        return [(first, min(cap, num_blocks - first)) for first in range(0, num_blocks, cap)]

    def tier_copy(self, copies: list, timing: StepTiming) -> None:
        """The host KV tier's copies (TierCopy, all one way), each timed into its event's duration_ms: a
        store device -> host slot, a load back. On CUDA they run on the swap stream as swaps do, timed
        by CUDA events (also listed in `timing`, which resolves them), and the compute stream waits for
        them: a load's blocks are read, a store's blocks written again, only after the copy."""
        if self.is_cuda:
            self._tier_copy_on_cuda(copies, timing)
            return
        for copy in copies:
            t0 = time.perf_counter()
            for i, kv in enumerate(self.kv_caches):
                for block, slot in zip(copy.device_blocks, copy.slots):
                    if copy.is_load:
                        kv[:, block].copy_(self.tier_cache[slot, i])
                    else:
                        self.tier_cache[slot, i].copy_(kv[:, block])
            copy.event.duration_ms = (time.perf_counter() - t0) * 1000

    def _tier_copy_on_cuda(self, copies: list, timing: StepTiming) -> None:
        # every copy's device blocks in one send (the ids' device buffer is reused by the next send,
        # which the compute stream orders after these copies)
        dev_ids = self._device_ids(self.tier_ids, [b for copy in copies for b in copy.device_blocks])
        current = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(current)   # a store's KV written, a load's blocks no longer read
        first = 0
        with torch.cuda.stream(self.swap_stream):
            for copy in copies:
                start, end = self._event_pair()
                start.record(self.swap_stream)
                for offset, part in self._staged_parts(len(copy.slots)):
                    ids = dev_ids[first + offset:first + offset + part]
                    slots = copy.slots[offset:offset + part]
                    if copy.is_load:
                        staged = self.staging[:part]
                        for i, h, n in consecutive_runs(slots):   # one DMA per run of neighbouring slots
                            staged[i:i + n].copy_(self.tier_cache[h:h + n], non_blocking=True)
                        scatter_blocks(self.kv_caches, ids, staged)
                    else:
                        staged = gather_blocks(self.kv_caches, ids, self.staging[:part])
                        for i, h, n in consecutive_runs(slots):
                            self.tier_cache[h:h + n].copy_(staged[i:i + n], non_blocking=True)
                end.record(self.swap_stream)
                copy.event.duration_ms = (start, end)
                timing.tier.append((start, end))
                first += len(copy.slots)
        current.wait_event(end)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks on the device, in every KV tensor."""
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
        early = [copy for copy in out.tier_copies if copy.before_forward]
        if early:   # finished sequences' stores: their freed blocks, before a load or the forward reuses them
            self.tier_copy(early, result.timing)
        loads = [copy for copy in out.tier_copies if copy.is_load]
        stores = [copy for copy in out.tier_copies if not copy.is_load and not copy.before_forward]
        if loads:   # into blocks nothing reads before this forward
            self.tier_copy(loads, result.timing)
        if not out.seqs:
            if stores:
                self.tier_copy(stores, result.timing)
            return result
        batch = flatten(out, self.block_size, self.num_groups)
        result.sample_seqs = batch.sample_seqs
        result.verify = batch.verify
        result.num_decode_tokens, result.num_prefill_tokens = batch.num_decodes, batch.num_prefill_tokens
        if self.is_cuda:
            self._execute_on_cuda(batch, result)
            if stores:   # after the forward on the compute stream, which the swap stream waits for
                self.tier_copy(stores, result.timing)
            return result
        to_tensors = self._paged_tensors if self.paged_inputs else self._tensors
        metas, input_ids, positions, logit_rows = to_tensors(batch)
        t0 = time.perf_counter()
        result.logits = self.model.forward(input_ids, positions, metas, self.kv_caches, logit_rows)
        result.timing.forward = (time.perf_counter() - t0) * 1000
        if stores:   # the blocks this forward wrote, before anyone reuses them
            self.tier_copy(stores, result.timing)
        return result

    def _execute_on_cuda(self, batch: FlatBatch, result: StepResult) -> StepResult:
        """The forward between two CUDA events, from a graph when the batch is decode-only and small
        enough. Nothing here waits for the device: the host first reads it when sampling."""
        stream = torch.cuda.current_stream(self.device)
        start, end = self._event_pair()
        if self.decode_graphs is not None and not batch.chunk_rows:
            start.record(stream)
            result.logits = self.decode_graphs.run(batch)
        if result.logits is None:  # prefill chunks in the batch, or more decodes than any graph
            metas, input_ids, positions, logit_rows = self._paged_tensors(batch)
            start.record(stream)
            result.logits = self.model.forward(input_ids, positions, metas, self.kv_caches, logit_rows)
        end.record(stream)
        result.timing.forward = (start, end)
        return result

    def _tensors(self, batch: FlatBatch) -> tuple[list[AttentionMetadata], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's metadata (one per KV-cache group), input ids, positions and logit rows, one tensor
        per list (the CPU kernels' and torch's path on CPU)."""
        device = self.device
        nd = batch.num_decodes
        decode_lens = torch.tensor([p + 1 for p in batch.positions[:nd]], device=device) if nd else None
        metas = []
        for group in range(self.num_groups):
            decode_tables = None
            if nd:
                tables = batch.decode_tables(group)
                max_blocks = max(len(t) for t in tables)
                decode_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], device=device)
            prefills = [(row, n, start, torch.tensor(table, device=device) if start else None)
                        for row, n, start, table in zip(batch.chunk_rows, batch.chunk_lens, batch.chunk_starts,
                                                        batch.prefill_tables[group])]
            metas.append(AttentionMetadata(
                slot_mapping=torch.tensor(batch.slots[group], device=device),
                num_decodes=nd,
                decode_block_tables=decode_tables,
                decode_context_lens=decode_lens,
                prefills=prefills,
            ))
        return (metas, torch.tensor(batch.input_ids, device=device), torch.tensor(batch.positions, device=device),
                torch.tensor(batch.logit_rows, dtype=torch.long, device=device))

    def _paged_tensors(self, batch: FlatBatch) -> tuple[list[AttentionMetadata], torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
        """`_tensors`'s result, every integer sent in one copy (step_inputs.py), plus the prefill chunks'
        block tables for the Triton kernel. Layout of the one int64 buffer, each part starting on a
        16-byte boundary (`_aligned`): the rows' parts, then each KV-cache group's own
            [input_ids T | positions T | logit_rows R | decode lens D | chunks 3 x P' |
             group 0: slots T | decode tables D x wd | prefill tables P x wp | group 1: ... ]
        (P': P rounded up to even). Triton specialises a pointer on its 16-byte alignment: parts that
        start wherever the previous one ended would compile the kernels again for each new mix of
        offsets (1.4-3.6 s each, mid-run).
        """
        positions, chunk_lens = batch.positions, batch.chunk_lens
        nt, nr, nd, npf = len(batch.input_ids), len(batch.logit_rows), batch.num_decodes, len(chunk_lens)
        decode_tables = [batch.decode_tables(group) for group in range(self.num_groups)]
        groups = [(batch.slots[group], tables, max((len(t) for t in tables), default=0), batch.prefill_tables[group],
                   max((len(t) for t in batch.prefill_tables[group]), default=0))
                  for group, tables in enumerate(decode_tables)]   # slots, decode tables, wd, prefill tables, wp
        chunk_width = _aligned(npf)   # each of the three chunk rows aligned too
        lengths = [nt, nt, nr, nd, 3 * chunk_width]
        for _, _, wd, _, wp in groups:
            lengths += [nt, nd * wd, npf * wp]
        starts = list(itertools.accumulate((_aligned(n) for n in lengths), initial=0))
        size = starts[-1]
        buf = self.step_inputs.host(size)
        for at, values in zip(starts, (batch.input_ids, positions, batch.logit_rows, [p + 1 for p in positions[:nd]])):
            buf[at:at + len(values)] = values
        for i, values in enumerate((batch.chunk_rows, chunk_lens, batch.chunk_starts)):
            at = starts[4] + i * chunk_width
            buf[at:at + npf] = values
        for group, (slots, dtables, wd, ptables, wp) in enumerate(groups):
            first = 5 + 3 * group
            buf[starts[first]:starts[first] + nt] = slots
            for at, rows, width in ((starts[first + 1], dtables, wd), (starts[first + 2], ptables, wp)):
                for table in rows:
                    buf[at:at + len(table)] = table
                    buf[at + len(table):at + width] = 0
                    at += width
        dev = self.step_inputs.send(size)
        views = [dev[at:at + n] for at, n in zip(starts, lengths)]
        input_t, positions_t, rows_t, lens_t, chunks_t = views[:5]
        chunks_t = chunks_t.view(3, chunk_width)[:, :npf]
        decode_num_splits = triton_attention.decode_num_splits(nd, self.model.config.num_kv_heads,
                                                               max(positions[:nd]) + 1) if nd else 1
        metas = []
        for group, (_, _, wd, ptables, wp) in enumerate(groups):
            slots_t, dtables_t, ptables_t = views[5 + 3 * group:8 + 3 * group]
            ptables_t = ptables_t.view(npf, wp)
            metas.append(AttentionMetadata(
                slot_mapping=slots_t,
                num_decodes=nd,
                decode_block_tables=dtables_t.view(nd, wd) if nd else None,
                decode_context_lens=lens_t if nd else None,
                prefills=[(row, n, start, ptables_t[i, :len(ptables[i])] if start else None)
                          for i, (row, n, start) in enumerate(zip(batch.chunk_rows, chunk_lens, batch.chunk_starts))],
                prefill_chunks=chunks_t if npf else None,
                prefill_block_tables=ptables_t if npf else None,
                max_prefill_len=max(chunk_lens, default=0),
                decode_num_splits=decode_num_splits,
            ))
        return metas, input_t, positions_t, rows_t

    def sample(self, result: StepResult, seqs: list[Sequence], rows: list[int]) -> list[int]:
        """Tokens of `seqs` from their logit rows (the module's sample(), below)."""
        logits = result.logits if len(rows) == len(result.logits) else result.logits[rows]
        return sample(logits, seqs)

    def draft_predictions(self, result: StepResult) -> dict[int, list[int]]:
        """Speculative decoding: each verifying sequence's greedy token at each of its drafts' rows (the
        token after that draft), by id(sequence)."""
        if not result.verify:
            return {}
        first = result.verify[0][1]
        tokens = result.logits[first:].argmax(dim=-1).tolist()
        return {id(seq): tokens[at - first:at - first + n] for seq, at, n in result.verify}


def _aligned(n: int) -> int:
    """n int64 values rounded up to a whole number of 16-byte units."""
    return n + (n & 1)


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids: [4, 5, 6, 9] -> [(0, 4, 3), (3, 9, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block, 1))
    return runs


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row: greedy rows by one argmax, the others from their own seeded generator. The
    host reads the device twice at most, however many rows sample: the argmax tokens, and the
    non-greedy rows' logits in one copy."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    if not rows:
        return tokens
    host_logits = (logits if len(rows) == len(seqs) else logits[rows]).float().cpu()   # [len(rows), vocab]
    for row, row_logits in zip(rows, host_logits):
        seq = seqs[row]
        params = seq.params
        probs = torch.softmax(row_logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    return tokens
