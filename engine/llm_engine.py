"""The engine loop: add requests, step, hand each step's events to the tracer."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from itertools import repeat
from operator import add, attrgetter
from typing import TYPE_CHECKING

from engine import events as ev
from engine.block_manager import BlockManager
from engine.cohort import DecodeCohort
from engine.config import (SWAP_SPACE_DEFAULT, EngineConfig, KVReserve, ModelConfig, NMode, PreemptionMode,
                           device_defaults, resolve_batch_limits)
from engine.events import AdmissionStop, DecodeWindow, FinishReason, KVEvent, NullTracer, Occupancy, RequestStats, StepRecord, Tracer
from engine.executor import Executor, StepResult
from engine.executor.cost_model import CostModel, load_profile, weight_params
from engine.executor.sim_executor import SimExecutor
from engine.model.loader import checkpoint_dtype, load_config
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SamplingParams, Sequence, SequenceStatus, is_plain_decode

if TYPE_CHECKING:
    import torch

# The simulated engine runs no model: torch and the model's modules are imported only by the real one.
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}   # the dtypes EngineConfig accepts
DEFAULT_KV_CACHE_MEMORY = 1 << 30   # 1 GiB when neither --num-gpu-blocks nor --kv-cache-memory is given
MAX_STEPS_WITHOUT_PROGRESS = 10_000
# decode_window: the shortest stretch worth dissolving a decode cohort for, and a step longer for every
# so many running sequences (dissolving and forming it again is work per sequence)
MIN_WINDOW_OVER_COHORT = 2
SEQUENCES_PER_WINDOW_STEP = 16
NON_TORCH_RESERVE = 1 << 30         # --gpu-memory-utilization: CUDA context, graphs, workspaces (an estimate)


_num_computed = attrgetter("num_computed_tokens")
_req_id = attrgetter("req_id")
_sample_index = attrgetter("sample")
_cohort_token = attrgetter("cohort_token")


class LivelockError(RuntimeError):
    """The engine kept stepping without emitting a token."""


@dataclass
class PoolGeometry:
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    derivation: dict | None = None   # how --gpu-memory-utilization sized the pool


def activation_reserve(config: EngineConfig, mc: ModelConfig, element: int) -> int:
    """Peak activation memory of a full step (what vLLM's profiling run measures), estimated from shapes:
    the largest batch's hidden states, q/k/v and MLP intermediates, and fp32 logits of every sequence."""
    per_token = 4 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 2 * mc.intermediate_size
    return config.max_num_batched_tokens * per_token * element + config.max_num_seqs * mc.vocab_size * 4


def forward_peak(config: EngineConfig, mc: ModelConfig, element: int) -> int:
    """Peak memory of the real engine's own forward over a full step (engine/model/llama.py), counted
    tensor by tensor: per token, at the MLP, the residual stream, the last layer's MLP output (bound
    until the next replaces it), the norm's output and the new MLP output (4 x hidden), with gate_up,
    silu(gate) and their product (4 x intermediate); at attention the same residual tensors with qkv,
    RoPE's output and temporaries, the attention output and o_proj's; then the logits of every
    sequence in the dtype and their fp32 copy."""
    h, d = mc.hidden_size, mc.head_dim
    mlp = 4 * h + 4 * mc.intermediate_size
    attention = 4 * h + (mc.num_heads + 2 * mc.num_kv_heads) * d + 3 * (mc.num_heads + mc.num_kv_heads) * d \
        + mc.num_heads * d
    logits = config.max_num_seqs * mc.vocab_size * (element + 4)
    return config.max_num_batched_tokens * max(mlp, attention) * element + logits


def pool_geometry(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  device_memory: int | None = None, device_type: str = "cpu") -> PoolGeometry:
    """Size the device and host pools from the config; ValueError when no block fits. On CUDA the
    activation reserve is the real forward's peak and swap mode's host pool defaults to vLLM V0's
    4 GiB; elsewhere (CPU, --engine sim: vLLM's profile) they are the shape estimate and the device
    pool's size."""
    cuda = config.engine == "real" and device_type == "cuda"
    dtype = device_defaults(config, device_type).dtype   # a config not resolved by LLMEngine: its auto
    element = ELEMENT_BYTES[dtype]
    bytes_per_block = model_config.kv_values_per_token * config.block_size * element
    derivation = None
    if config.num_gpu_blocks is not None:
        num_gpu_blocks = config.num_gpu_blocks
    elif config.gpu_memory_utilization is not None:
        if device_memory is None:
            raise ValueError("--gpu-memory-utilization needs a device whose memory is known: CUDA, or --engine sim")
        util = config.gpu_memory_utilization
        weights = weight_params(model_config)[1] * element
        activations = (forward_peak if cuda else activation_reserve)(config, model_config, element)
        if cuda and config.preemption_mode == PreemptionMode.SWAP:   # the swaps' staging buffer
            from engine.executor.model_runner import swap_staging_reserve

            activations += swap_staging_reserve(bytes_per_block, model_config.num_layers)
        memory = int(device_memory * util) - weights - activations - NON_TORCH_RESERVE
        num_gpu_blocks = max(max(memory, 0) // bytes_per_block - 1, 0)  # V1's null block is one of them
        derivation = {
            "formula": "(device_memory * gpu_memory_utilization - weights - activations - non_torch) // bytes_per_block",
            "device_memory": device_memory, "gpu_memory_utilization": util, "weights": weights,
            "activations": activations, "non_torch": NON_TORCH_RESERVE, "kv_bytes": memory,
            "bytes_per_block": bytes_per_block, "num_gpu_blocks": num_gpu_blocks,
        }
        if num_gpu_blocks < 1:
            raise ValueError(f"--gpu-memory-utilization {util}: {device_memory * util / 1e9:.1f} GB of the device "
                             f"leaves no KV block after {weights / 1e9:.2f} GB of weights and "
                             f"{(activations + NON_TORCH_RESERVE) / 1e9:.2f} GB of activations and runtime")
    else:
        memory = config.kv_cache_memory
        if memory is None:  # enough for every sequence at full length (and the null block), at most 1 GiB
            memory = min(DEFAULT_KV_CACHE_MEMORY,
                         (config.max_num_seqs * -(-max_model_len // config.block_size) + 1) * bytes_per_block)
        num_gpu_blocks = memory // bytes_per_block - 1  # V1's null block is one of them
        if num_gpu_blocks < 1:
            raise ValueError(f"--kv-cache-memory {memory} B holds no usable KV block of {bytes_per_block} B "
                             f"({config.block_size} tokens of {model_config.name}) besides the null block")
    if config.num_cpu_blocks is not None:
        num_cpu_blocks = config.num_cpu_blocks
    elif config.swap_space is not None:
        num_cpu_blocks = config.swap_space // bytes_per_block
    else:
        # on CUDA not the device pool's size: that pinned ~108 GiB on a 128 GiB host beside the weights
        swap = config.preemption_mode == PreemptionMode.SWAP
        num_cpu_blocks = (SWAP_SPACE_DEFAULT // bytes_per_block if cuda else num_gpu_blocks) if swap else 0
    return PoolGeometry(num_gpu_blocks, num_cpu_blocks, config.block_size, bytes_per_block, derivation)


def in_batch_order(seqs: list[Sequence], out: SchedulerOutput, start: int = 0) -> list[Sequence]:
    """The sequences in the order the step scheduled them, which is the order V1 frees those that
    finish (update_from_output walks the scheduled requests); samples forked this step (--n-mode cow)
    come last. The executor's sampling order differs: decodes first, then prefill chunks. `start`: the
    sequences are among out.seqs[start:]."""
    if len(seqs) < 2:   # most steps finish none or one: no per-step work over the batch
        return seqs
    position = {id(seq): i for i, seq in enumerate(out.seqs[start:] if start else out.seqs)}
    return sorted(seqs, key=lambda seq: position.get(id(seq), len(position)))


@dataclass
class _InFlight:
    """A step scheduled and run whose output is not processed yet (async scheduling)."""
    step: int
    start_s: float
    out: SchedulerOutput
    result: StepResult
    events: list[KVEvent]
    num_sched_events: int
    occupancy: Occupancy
    num_recompute: int
    sampled: list[tuple[Sequence, int]]
    finished: list[Sequence]   # rejected while it was scheduled


class LLMEngine:
    def __init__(self, config: EngineConfig, tracer: Tracer | None = None, *, loaded=None) -> None:
        self.config = config
        # which executor runs the steps is decided here, once: the loop only calls the Executor protocol
        self.simulated = config.engine == "sim"   # no model: a cost model predicts each step (virtual time)
        if self.simulated:
            self._device = None   # the CPU's, made when asked for (`device`): nothing runs on it
            config = self.config = device_defaults(config, "sim")
            self.model_config, self.model_source = (loaded.config, loaded.source) if loaded else load_config(config.model)
            self.cost_model = CostModel(load_profile(config.hardware or "h100-sxm"), self.model_config, config.dtype)
            profile = self.cost_model.profile
            device_memory = profile.memory_bytes or None
            device_type = "cpu" if not profile.memory_bytes or "cpu" in profile.name else "cuda"
            device_name = profile.name
        else:
            import torch

            from engine.executor.model_runner import resolve_device
            from engine.model.loader import load_weights

            self._device = resolve_device(config.device)
            cuda = self._device.type == "cuda"
            config = self.config = device_defaults(config, self.device.type, checkpoint_dtype(config.model),
                                                   bf16_supported=cuda and torch.cuda.is_bf16_supported())
            dtype = getattr(torch, config.dtype)
            if loaded is None:
                loaded = load_weights(config.model, config.load_format, dtype=dtype, seed=config.seed)
            self.model_config, self.model_source = loaded.config, loaded.source
            device_type = self.device.type
            device_memory = torch.cuda.get_device_properties(self.device).total_memory if device_type == "cuda" else None
            device_name = torch.cuda.get_device_name(self.device) if device_type == "cuda" else ""
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        config = self.config = resolve_batch_limits(config, self.max_model_len, device_type, device_memory, device_name)
        self.stop_token_ids = frozenset(mc.stop_token_ids)
        self.geometry = pool_geometry(config, mc, self.max_model_len, device_memory, device_type)
        g = self.geometry
        # V1 sizes the watermark on the whole pool, its null block included
        self.block_manager = BlockManager(g.num_gpu_blocks, g.block_size, g.num_cpu_blocks,
                                          config.enable_prefix_caching, int(config.watermark * (g.num_gpu_blocks + 1)))
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   preemption_mode=config.preemption_mode,
                                   preemption_policy=config.preemption_policy,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   swap_groups=config.n_mode == NMode.COW, max_model_len=self.max_model_len)
        self.scheduler.follow(config.follow_vllm)
        self.runner: Executor
        if self.simulated:
            self.model = None
            self.runner = SimExecutor(self.cost_model, g.bytes_per_block)
            if not config.async_scheduling and config.n_mode == NMode.INDEPENDENT:   # engine/cohort.py says why
                self.scheduler.cohort = self.runner.cohort = DecodeCohort(self.block_manager)
        else:
            from engine.executor.model_runner import ModelRunner
            from engine.model.llama import LlamaModel

            self.model = LlamaModel(mc, loaded.weights, self.device, dtype)
            # block ids run 1..num_gpu_blocks: the KV tensor has a slot for the null block 0 too
            self.runner = ModelRunner(self.model, g.num_gpu_blocks + 1, g.block_size, g.num_cpu_blocks)
        self.clock = self.runner.clock
        self.tracer: Tracer = tracer or NullTracer()
        self.time_origin = self.clock()
        self.step_counter = 0
        self._event_seq = 0
        self._num_requests = 0
        self._steps_without_progress = 0
        self._pending_finished: list[Sequence] = []
        self._in_flight: _InFlight | None = None   # async scheduling: the step whose output is pending
        self._pending_records: deque[tuple[StepRecord, StepResult, SchedulerOutput]] = deque()
        # every sequence by (req_id, sample), which also catches a request id used twice; a long replay
        # turns this off to keep memory flat (its workload's ids are checked unique when it is read)
        self.keep_outputs = True
        self.outputs: dict[tuple[str, int], Sequence] = {}
        self.num_finished_seqs = 0
        self.num_preemptions = 0

    @property
    def device(self) -> torch.device:
        """Where the model runs. The simulated engine runs none and answers the CPU, importing
        torch only if asked (its replay never asks)."""
        if self._device is None:
            import torch

            self._device = torch.device("cpu")
        return self._device

    # ---- requests -----------------------------------------------------------------------
    def now(self) -> float:
        return self.clock() - self.time_origin

    def start_clock(self) -> None:
        """Time starts now (a replay's t = 0)."""
        self.time_origin = self.clock()

    def idle_until(self, t: float) -> None:
        """Nothing to run before `t`: sleep a little (real), or jump there (simulated)."""
        self.runner.idle_until(t + self.time_origin)

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, arrival_s: float | None = None, priority: int = 0, prepared: bool = False) -> Sequence:
        """Queue a request; returns its first sequence (n > 1: the others are queued beside it, or with
        --n-mode cow forked from it when its prompt is done). `prepared`: the prompt comes from a
        replay's prepare, which checked every id against the vocabulary before the run, and its list
        is handed over: the pass that checks the ids is left out, and the first sequence keeps the list
        as its token_ids instead of a copy (the outputs are appended to it)."""
        params = params or SamplingParams()
        if not prompt_token_ids:
            raise ValueError(f"request {req_id}: empty prompt")
        if not prepared:
            vocab = self.model_config.vocab_size
            if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:   # then find the first one
                bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
                raise ValueError(f"request {req_id}: token id {bad} outside the vocabulary (0..{vocab - 1})")
        if (str(req_id), 0) in self.outputs:
            raise ValueError(f"request id {req_id!r} used twice")
        arrival = self.now() if arrival_s is None else arrival_s
        reserved = self.reserved_tokens(len(prompt_token_ids), params.max_tokens)
        # n > 1: V1 queues n independent sequences that share the prompt through the prefix cache;
        # --n-mode cow queues one and forks the others when its prompt is done
        num_seqs = params.n if self.config.n_mode == NMode.INDEPENDENT else 1
        seqs = []
        for index in range(num_seqs):
            seq = Sequence(str(req_id), index, prompt_token_ids, params, arrival, priority, self._num_requests,
                           keep_list=prepared and index == 0)
            seq.num_reserved_tokens = reserved
            seq.stop_num_tokens = min(seq.stop_num_tokens, self.max_model_len)
            if self.keep_outputs:
                self.outputs[(seq.req_id, index)] = seq
            seqs.append(seq)
        seqs[0].num_pending_forks = params.n - num_seqs
        self._num_requests += 1
        for seq in seqs:
            if len(prompt_token_ids) + 1 > self.max_model_len:
                seq.finish_reason = FinishReason.REJECTED
                self._pending_finished.append(seq)
                seq.status = SequenceStatus.FINISHED
            else:
                self.scheduler.add(seq)
        return seqs[0]

    def reserved_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """--kv-reserve: positions a request holds from admission, as a pre-paging server did (0: on demand)."""
        if self.config.kv_reserve == KVReserve.NONE:
            return 0
        if self.config.kv_reserve == KVReserve.MAX_MODEL_LEN:
            return self.max_model_len
        return min(num_prompt_tokens + max_tokens, self.max_model_len)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_finished)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, int]]:
        """Run one step; return the (sequence, token id) pairs it emitted (with async scheduling, those
        of the step before)."""
        if self.config.async_scheduling:
            return self._step_async()
        return self._step(pairs=True)[0]

    def step_count(self) -> int:
        """Run one step; return how many tokens it emitted: `step` without making its pairs, which a
        simulated decode cohort's step would make for every running sequence (a replay counts them)."""
        if self.config.async_scheduling:
            return len(self._step_async())
        return self._step(pairs=False)[1]

    def _step(self, pairs: bool) -> tuple[list[tuple[Sequence, int]], int]:
        """The synchronous step: its (sequence, token id) pairs (none made for a cohort's decodes unless
        `pairs`) and how many tokens it emitted."""
        start_s = self.now()
        out = self.scheduler.schedule()
        sched_events = self.block_manager.take_events()
        occupancy = self._occupancy(out)
        result = self.runner.execute(out)
        emitted: list[tuple[Sequence, int]] = []
        num_emitted = 0
        num_recompute = 0
        stopped: list[Sequence] = []   # in the batch's order
        tokens = None
        if out.seqs:
            num_decodes = out.num_decodes
            num_recompute = self._account(out, start_s, num_decodes)
            if out.cohort:   # the decodes are the cohort's: their counts advance lazily (engine/cohort.py)
                rest = self._sample(result, num_decodes, skip=num_decodes)
                stopped = self.scheduler.cohort.advance()
                for seq in stopped:
                    self._check_stop(seq, seq.token_ids[-1])
                    assert seq.finish_reason, f"{seq} at its stop length without a reason to stop"
                if pairs:
                    decoded = out.seqs[:num_decodes]
                    emitted = list(zip(decoded, map(_cohort_token, decoded))) + rest
                num_emitted = num_decodes + len(rest)
            else:
                sampled = self._sample(result, num_decodes)
                if num_decodes:   # the running pass's decodes: accounted, extended and checked in one loop
                    self._advance_decodes(sampled[:num_decodes])
                    rest = sampled[num_decodes:]
                else:
                    rest = sampled
                emitted = sampled
                num_emitted = len(sampled)
            for seq, token in rest:
                seq.token_ids.append(token)
            self._deliver(rest, self.now())
            if out.cohort:
                tokens = self._cohort_tokens(rest)
        finished = self._pending_finished + out.rejected
        self._pending_finished = []
        # --n-mode cow, rejected before forking: every sample finishes
        finished += [s for seq in finished if seq.num_pending_forks for s in self._unforked_samples(seq)]
        if out.cohort:   # the cohort's stops first: they lead the batch
            done = stopped + in_batch_order([seq for seq, _ in rest if seq.finish_reason], out, num_decodes)
        else:
            done = in_batch_order([seq for seq, _ in emitted if seq.finish_reason], out)
        for seq in done:
            finished.append(seq)
            self.scheduler.finish(seq)
        for seq in out.rejected:
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free_host(seq)  # a swapped sequence that outgrew the pool
        self.num_finished_seqs += len(finished)
        self.num_preemptions += out.num_preemptions
        end_s = self.now()
        self._record(step=self.step_counter, start_s=start_s, end_s=end_s, out=out, result=result,
                     kv_events=sched_events + self.block_manager.take_events(), num_sched_events=len(sched_events),
                     occupancy=occupancy, num_recompute=num_recompute, emitted=emitted, finished=finished,
                     tokens=tokens)
        self.step_counter += 1
        self._check_progress(bool(num_emitted or finished))
        return emitted, num_emitted

    def _cohort_tokens(self, rest: list[tuple[Sequence, int]]) -> tuple:
        """The trace's token columns of a cohort step (`_record`'s), its tokens delivered: a decode's
        index is its cohort_idx plus the clock, so the decodes are not visited one by one."""
        cohort = self.scheduler.cohort   # its members are the decodes, in their order
        req_ids, samples = cohort.member_req_ids[:], cohort.member_samples[:]
        idx = list(map(add, cohort.member_idx, repeat(cohort.clock, cohort.num_members)))
        if rest:
            rest_seqs = [seq for seq, _ in rest]
            req_ids += map(_req_id, rest_seqs)
            samples += map(_sample_index, rest_seqs)
            idx += [len(seq.token_ids) - seq.num_prompt_tokens - 1 for seq in rest_seqs]
        return req_ids, samples, idx, [None] * len(idx)   # the simulator's placeholders are recorded as null

    def decode_window(self, until_s: float, max_steps: int = 256) -> tuple[int, int]:
        """Run the steps of a stretch where the simulated engine only decodes: every running sequence
        decodes one token a step, nothing waits or is swapped, and nobody finishes, preempts, copies a
        block or arrives (`until_s`: the next arrival on the replay clock; the stretch ends at the step
        that would start at or after it). Returns (steps, tokens); (0, 0) when the next step is not
        such a step, which `step` then runs.

        Each step is the one `step` would run, decided as the scheduler's fast path decides it
        (Scheduler._grow_decodes): the same block allocations, evictions and prefix-cache entries in
        the same order, the same predicted times, the same step records, events and tokens. What the
        stretch makes cheap is the per-sequence work: the sequences' tokens are known (placeholders)
        and their block boundaries are computed once, so a step touches only the sequences that take
        or complete a block, and each sequence's counts are advanced once at the end."""
        sched, bm = self.scheduler, self.block_manager
        running = sched.running
        if (not self.simulated or self.config.async_scheduling or not sched.decode_fast_path or not running
                or sched.waiting or sched.swapped or self._pending_finished or self._in_flight is not None
                or self._pending_records or len(running) > sched.max_num_batched_tokens):
            return 0, 0
        cohort = sched.cohort
        if cohort is not None and cohort.num_members:
            # the stretch reads and advances every sequence's counts: the cohort is dissolved for it,
            # and formed again after it, which a stretch of a few steps does not repay
            num_kv = self._kv_positions(running) + len(running)
            step_s = self.runner.cost.forward_ms(0, len(running), num_kv, 0.0) / 1000
            shortest = MIN_WINDOW_OVER_COHORT + len(running) // SEQUENCES_PER_WINDOW_STEP
            if min(cohort.steps_to_next_stop(), (until_s - self.now()) / step_s) < shortest:
                return 0, 0
            cohort.dissolve(running)
        num_running = len(running)
        tokens = self.runner.sample(None, running, None)
        bs = bm.block_size
        shared = bm.shared_fill
        stop_token_ids = self.stop_token_ids
        horizon = max_steps
        for seq, token in zip(running, tokens):   # the fast path's conditions, and the first stop
            computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids)
            if not is_plain_decode(seq) or token in stop_token_ids:
                return 0, 0
            if shared and not shared.keys().isdisjoint(seq.block_table[computed // bs:]):
                return 0, 0   # a write ahead copies a shared block first (forks share even blocks reserved ahead)
            # after step j it holds num_tokens + j + 1 tokens: the stretch ends before the step it stops at
            horizon = min(horizon, seq.stop_num_tokens - num_tokens - 1)
        if horizon < 2:
            return 0, 0
        # the steps at which each sequence takes a block (allocs) or completes one (prefix cache), in
        # the batch's order within a step (a running sequence's hashes are up to date: every grow
        # caches what its step completes, a swap-in's included)
        caching = bm.enable_prefix_caching
        touched: dict[int, list[Sequence]] = {}
        allocs = [0] * horizon
        for seq in running:
            computed = seq.num_computed_tokens
            first = len(seq.block_table) * bs - computed
            steps = set(range(first, horizon, bs))
            for j in steps:
                allocs[j] += 1
            if caching:
                steps.update(range((-1 - computed) % bs, horizon, bs))
            for j in steps:
                touched.setdefault(j, []).append(seq)
        # the blocks run short at the first step whose allocations the free blocks no longer cover
        num_free = bm.num_free_blocks
        for j, n in enumerate(allocs):
            num_free -= n
            if num_free < 0:
                horizon = j
                break
        if horizon < 1:
            return 0, 0
        for seq, token in zip(running, tokens):   # their tokens, ahead (a block's hash reads them)
            seq.token_ids.extend([token] * horizon)
        req_ids = [seq.req_id for seq in running]
        samples = [seq.sample for seq in running]
        first_idx = [len(seq.token_ids) - horizon - seq.num_prompt_tokens for seq in running]
        held = sum(map(_num_computed, running))
        num_kv = bm.num_kv_positions(running) + num_running   # of the first step; then num_running more a step
        num_total = bm.num_blocks
        event_seq = self._event_seq
        first_step = self.step_counter
        # the steps' times first (the clock is the executor's; nothing below moves it), then their block
        # work and records, as the window's columns (events.DecodeWindow)
        starts, ends, forward = self.runner.decode_clock(num_running, held, horizon, until_s, self.time_origin)
        free: list[int] = []
        cached: list[int] = []
        allocs: list[tuple] = []   # the steps' events, all decodes' allocs, as rows (DecodeWindow.allocs)
        alloc_steps: list[int] = []
        free_now, cached_now = bm.num_free_blocks, bm.num_cached_free_blocks   # change only as sequences grow
        k = len(starts)
        for j in range(k):
            grow = touched.get(j)
            if grow is not None:
                num_allocs = len(allocs)
                for seq in grow:   # Scheduler._grow_decodes's action, at this step's length
                    bm.grow_decode(seq, seq.num_computed_tokens + j + 1, allocs)
                if len(allocs) > num_allocs:
                    alloc_steps += [j] * (len(allocs) - num_allocs)
                free_now, cached_now = bm.num_free_blocks, bm.num_cached_free_blocks
            free.append(free_now)
            cached.append(cached_now)
        assert not bm.events and not bm.evicted, "a decode window's step made an event other than a decode's alloc"
        self.step_counter = first_step + k
        window = DecodeWindow(
            first_step=first_step, start_s=starts, end_s=ends, device_ms=forward, num_free_blocks=free,
            num_cached_blocks=cached, num_running=num_running, num_total_blocks=num_total, first_kv_tokens=num_kv,
            first_event_seq=event_seq, allocs=allocs, alloc_steps=alloc_steps, token_req_ids=req_ids,
            token_samples=samples, first_token_idx=first_idx)
        # each alloc's evictions take the seq numbers before its own (events.with_evictions)
        event_seq += len(allocs) + sum(len(evicted) for *_, evicted in allocs if evicted)
        on_window = getattr(self.tracer, "on_decode_window", None)
        if on_window is not None:
            on_window(window)
        else:
            for record in window.records():
                self.tracer.on_step(record)
        self._event_seq = event_seq
        for seq in running:   # k steps of _account and _advance_decodes; the tokens of steps not run go
            seq.num_computed_tokens = seq.num_ever_computed = seq.num_computed_tokens + k
            del seq.token_ids[len(seq.token_ids) - horizon + k:]
        self._steps_without_progress = 0
        return k, k * num_running

    def _step_async(self) -> list[tuple[Sequence, int]]:
        """vLLM V1's async scheduling (its engine core's batch queue of two): this step is scheduled
        while the previous one's output is still in flight, then that output is processed, then this
        step runs. A sequence's in-flight token counts as its next input (Sequence.num_undelivered),
        a sequence whose last token is in flight is not scheduled again, one that stops on its
        in-flight token (EOS) has been scheduled once more for nothing, and finished sequences free
        their blocks a step later. The previous step's record (its tokens, finishes and frees) is
        completed when its output is processed.
        """
        start_s = self.now()
        out = self.scheduler.schedule()
        bm, sched = self.block_manager, self.scheduler
        occupancy = self._occupancy(out)
        events = bm.take_events()
        num_sched_events = len(events)
        for seq in out.rejected:
            seq.status = SequenceStatus.FINISHED
        finished_now = self._pending_finished + out.rejected
        self._pending_finished = []
        prev = self._in_flight
        emitted: list[tuple[Sequence, int]] = []
        stopped: list[Sequence] = []
        end_s = start_s
        if prev is not None:   # the previous step's output: deliver, check stops
            end_s = self.now()
            self._deliver(prev.sampled, end_s)
            emitted = prev.sampled
            stopped = in_batch_order([seq for seq, _ in emitted if seq.finish_reason], prev.out)
        result = self.runner.execute(out)   # before the frees: a just-stopped sequence may still run
        num_recompute = self._account(out, start_s) if out.seqs else 0
        events += bm.take_events()
        if prev is not None:
            sampling = {id(s) for s in result.sample_seqs}
            # V1 caches what the delivered tokens complete, less this step's input, for every sequence
            # running before the delivery: one that stops on it too (its last block), before it is freed
            for seq, _ in emitted:
                if seq.status == SequenceStatus.RUNNING:
                    bm.cache_full_blocks(seq, seq.num_computed_tokens - (id(seq) in sampling))
            for seq in stopped:
                sched.finish(seq)
            self._record(step=prev.step, start_s=prev.start_s, end_s=end_s, out=prev.out, result=prev.result,
                         kv_events=prev.events + bm.take_events(), num_sched_events=prev.num_sched_events,
                         occupancy=prev.occupancy, num_recompute=prev.num_recompute, emitted=emitted,
                         finished=prev.finished + stopped)
            self.num_finished_seqs += len(stopped)
        sampled = [(seq, token) for seq, token in (self._sample(result, out.num_decodes) if result.sample_seqs else [])
                   if seq.status == SequenceStatus.RUNNING]
        for seq, token in sampled:   # in flight: the next step's input, delivered after it is scheduled
            seq.token_ids.append(token)
            seq.num_undelivered += 1
        self.num_finished_seqs += len(finished_now)
        self.num_preemptions += out.num_preemptions
        self._in_flight = _InFlight(step=self.step_counter, start_s=start_s, out=out, result=result, events=events,
                                    num_sched_events=num_sched_events, occupancy=occupancy,
                                    num_recompute=num_recompute, sampled=sampled, finished=finished_now)
        self.step_counter += 1
        self._check_progress(bool(emitted or stopped or finished_now))
        return emitted

    def _occupancy(self, out: SchedulerOutput) -> Occupancy:
        """The pool right after scheduling: queues, blocks, and the KV positions the used blocks hold
        once this step's tokens are written."""
        bm, sched = self.block_manager, self.scheduler
        return Occupancy(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_swapped=len(sched.swapped),
            num_free_blocks=bm.num_free_blocks, num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_free_blocks,
            num_kv_tokens=self._kv_positions(sched.running) + sum(out.num_new_tokens))

    def _kv_positions(self, running: list[Sequence]) -> int:
        """KV positions held by the running sequences, lags included (BlockManager.num_kv_positions: a
        decode cohort's members counted from its sums)."""
        cohort = self.scheduler.cohort
        if cohort is None:
            return self.block_manager.num_kv_positions(running)
        return self.block_manager.num_kv_positions(running, held=cohort.positions(running))

    def _check_progress(self, progressed: bool) -> None:
        if progressed or not self.has_unfinished():
            self._steps_without_progress = 0
            return
        self._steps_without_progress += 1
        if self._steps_without_progress > MAX_STEPS_WITHOUT_PROGRESS:
            raise LivelockError(f"no token emitted in {MAX_STEPS_WITHOUT_PROGRESS} steps with "
                                f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting, "
                                f"{len(self.scheduler.swapped)} swapped")

    def _account(self, out: SchedulerOutput, start_s: float, skip: int = 0) -> int:
        """Advance computed positions; count positions computed for the second time. The first `skip`
        sequences are left to _advance_decodes."""
        num_recompute = 0
        seqs, new_tokens = (out.seqs[skip:], out.num_new_tokens[skip:]) if skip else (out.seqs, out.num_new_tokens)
        for seq, num_new in zip(seqs, new_tokens):
            start = seq.num_computed_tokens
            end = start + num_new
            ever = seq.num_ever_computed
            recomputed = 0
            if ever > start:   # positions start..min(end, ever) had KV before
                recomputed = (end if end < ever else ever) - start
                num_recompute += recomputed
                seq.num_recomputed_tokens += recomputed
            if end > ever:
                seq.num_ever_computed = end
            seq.num_computed_tokens = end
            if seq.reprefill_target:
                seq.reprefill_recomputed += recomputed
                if end >= seq.reprefill_target:
                    self.scheduler.record_reprefill(seq, None)
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = start_s
        return num_recompute

    def _sample(self, result: StepResult, num_decodes: int = 0, skip: int = 0) -> list[tuple[Sequence, int]]:
        """A token for every sequence whose last token was computed; fork n > 1 samples. The first
        `num_decodes` decoded in the running pass's fast path: they forked long ago. The first `skip`
        are left out (a decode cohort's: engine/cohort.py)."""
        seqs = result.sample_seqs[skip:]
        rows = list(range(skip, skip + len(seqs)))
        for i in range(max(num_decodes - skip, 0), len(seqs)):   # a running pass's decodes have forked already
            parent = seqs[i]
            if parent.num_pending_forks:
                for child in self._fork(parent):
                    seqs.append(child)
                    rows.append(rows[i])
        return list(zip(seqs, self.runner.sample(result, seqs, rows)))

    def _advance_decodes(self, decoded: list[tuple[Sequence, int]]) -> None:
        """The running pass's fast-path decodes (SchedulerOutput.num_decodes) after their step: one
        position computed each (_account), the token appended and delivered (_deliver: each had a token
        delivered before, so its first token's time is set and it is not protected; none is in flight)."""
        stop_token_ids = self.stop_token_ids
        for seq, token in decoded:
            # a decode's position never had KV: a sequence that lost its KV re-prefilled every token,
            # the last one new, before it decodes again (the general pass's accounting, in
            # tests/engine/test_decode_fast_path.py, agrees)
            seq.num_computed_tokens = seq.num_ever_computed = seq.num_computed_tokens + 1
            token_ids = seq.token_ids
            token_ids.append(token)
            if len(token_ids) >= seq.stop_num_tokens or token in stop_token_ids:
                self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        """Whether the sequence stops on the token it was just given (the last of its token_ids)."""
        params = seq.params
        num_tokens = len(seq.token_ids)
        num_output_tokens = num_tokens - seq.num_prompt_tokens
        if not params.ignore_eos and token in self.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif num_output_tokens == params.output_tokens:  # where the recorded request stopped
            seq.finish_reason = FinishReason.STOP
        elif num_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH

    def _deliver(self, sampled: list[tuple[Sequence, int]], now: float) -> None:
        """Process sampled tokens (already the last of their sequences' token_ids): first-token time,
        stop checks. Every sampled token is emitted."""
        stop_token_ids = self.stop_token_ids
        for seq, token in sampled:
            if seq.num_undelivered:
                seq.num_undelivered -= 1
            seq.protected = False
            if seq.first_token_s is None:
                seq.first_token_s = now
            if len(seq.token_ids) >= seq.stop_num_tokens or token in stop_token_ids:
                self._check_stop(seq, token)

    def _unforked_samples(self, parent: Sequence) -> list[Sequence]:
        """The samples a rejected parent never forked, finished like it (a requests row each)."""
        samples = []
        for sample_index in range(1, parent.num_pending_forks + 1):
            seq = Sequence(parent.req_id, sample_index, parent.token_ids, parent.params, parent.arrival_s,
                           parent.priority, parent.arrival_order)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = parent.finish_reason
            if self.keep_outputs:
                self.outputs[(seq.req_id, sample_index)] = seq
            samples.append(seq)
        parent.num_pending_forks = 0
        return samples

    def _fork(self, parent: Sequence) -> list[Sequence]:
        children = []
        for sample_index in range(1, parent.num_pending_forks + 1):
            child = Sequence(parent.req_id, sample_index, parent.token_ids, parent.params, parent.arrival_s,
                             parent.priority, parent.arrival_order)
            self.block_manager.fork(parent, child)
            child.num_ever_computed = parent.num_ever_computed
            child.num_reserved_tokens = parent.num_reserved_tokens
            child.stop_num_tokens = parent.stop_num_tokens
            child.first_scheduled_s = parent.first_scheduled_s
            child.num_prefix_hit_tokens = parent.num_prefix_hit_tokens
            self.scheduler.adopt(child)
            if self.keep_outputs:
                self.outputs[(child.req_id, sample_index)] = child
            children.append(child)
        parent.num_pending_forks = 0
        return children

    # ---- tracing ------------------------------------------------------------------------
    def _record(self, *, step: int, start_s: float, end_s: float, out: SchedulerOutput, result: StepResult,
                kv_events: list[KVEvent], num_sched_events: int, occupancy: Occupancy, num_recompute: int,
                emitted: list[tuple[Sequence, int]], finished: list[Sequence], tokens: tuple | None = None) -> None:
        """Hand the step's record on (once its device timings resolve). The first `num_sched_events`
        events were decided while scheduling (stamped at the step's start), the rest after the forward."""
        for seq in finished:
            kv_events.append(KVEvent(ev.FINISH, seq.req_id, seq.sample, num_tokens=seq.num_output_tokens,
                                     reason=seq.finish_reason))
        for e in kv_events[:num_sched_events]:  # decided while scheduling
            e.step = step
            e.ts_s = start_s
        for e in kv_events[num_sched_events:]:  # after the forward: re-prefill done, finish
            e.step = step
            e.ts_s = end_s
        pool = occupancy  # after scheduling
        if tokens is None:   # the emitted tokens' columns (decode_window gives them made)
            seqs, ids = zip(*emitted) if emitted else ((), ())
            tokens = (list(map(_req_id, seqs)), list(map(_sample_index, seqs)),
                      [len(s.token_ids) - s.num_prompt_tokens - 1 for s in seqs],   # num_output_tokens - 1
                      list(ids) if self.runner.emits_token_ids else [None] * len(seqs))
        record = StepRecord(
            step=step, start_s=start_s, end_s=end_s, device_ms=None,
            num_running=pool.num_running, num_waiting=pool.num_waiting, num_swapped=pool.num_swapped,
            num_prefill_tokens=result.num_prefill_tokens, num_decode_tokens=result.num_decode_tokens,
            num_recompute_tokens=num_recompute, num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks, num_cached_blocks=pool.num_cached_blocks,
            num_total_blocks=self.block_manager.num_blocks, num_kv_tokens=pool.num_kv_tokens,
            num_preemptions=out.num_preemptions, admission_stop=out.admission_stop, events=kv_events,
            token_req_ids=tokens[0], token_samples=tokens[1], token_idx=tokens[2], token_ids=tokens[3],
            finished=[self._stats(s, end_s) for s in finished],
        )
        self._pending_records.append((record, result, out))
        self._flush_records(wait=False)

    def _flush_records(self, wait: bool) -> None:
        """Hand over records whose device timings have resolved (all of them when `wait`)."""
        if wait and self.runner.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)
        while self._pending_records and (wait or self._pending_records[0][1].timing.ready()):
            record, result, out = self._pending_records.popleft()
            t = result.timing
            record.device_ms = t.ms(t.forward)
            swap_out_ms, swap_in_ms = t.ms(t.swap_out), t.ms(t.swap_in)
            for events, total_ms in ((out.swap_out_events, swap_out_ms), (out.swap_in_events, swap_in_ms)):
                if not events:
                    continue
                num_blocks = sum(len(e.blocks) for e in events)
                for e in events:  # one copy per direction per step: share its time by blocks
                    e.bytes = len(e.blocks) * self.geometry.bytes_per_block
                    e.duration_ms = total_ms * len(e.blocks) / num_blocks if total_ms is not None and num_blocks else None
            seq = self._event_seq
            for e in record.events:
                if e.evicted:   # its evictions come first (events.with_evictions)
                    seq += len(e.evicted)
                e.seq = seq
                seq += 1
            self._event_seq = seq
            self.tracer.on_step(record)

    def flush(self) -> None:
        """Hand every pending step record to the tracer (end of run). With async scheduling, the last
        step's output is never processed (vLLM's engine leaves it in its batch queue once every request
        has finished): it is recorded without tokens, and tokens still in flight (an interrupted run)
        are taken back."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            for seq, _ in prev.sampled:
                if seq.num_undelivered:
                    seq.token_ids.pop()
                    seq.num_undelivered -= 1
            self._record(step=prev.step, start_s=prev.start_s, end_s=prev.start_s, out=prev.out, result=prev.result,
                         kv_events=prev.events + self.block_manager.take_events(),
                         num_sched_events=prev.num_sched_events, occupancy=prev.occupancy,
                         num_recompute=prev.num_recompute, emitted=[], finished=prev.finished)
        self._flush_records(wait=True)

    def _stats(self, seq: Sequence, finish_s: float) -> RequestStats:
        return RequestStats(
            req_id=seq.req_id, sample=seq.sample, n=seq.params.n, priority=seq.priority,
            arrival_s=seq.arrival_s, prompt_tokens=seq.num_prompt_tokens, max_tokens=seq.params.max_tokens,
            output_tokens=seq.num_output_tokens, first_scheduled_s=seq.first_scheduled_s,
            first_token_s=seq.first_token_s, finish_s=finish_s, finish_reason=seq.finish_reason or FinishReason.ABORTED,
            preemptions=seq.num_preemptions, swaps=seq.num_swaps, recomputed_tokens=seq.num_recomputed_tokens,
            prefix_hit_tokens=seq.num_prefix_hit_tokens,
        )

    def abort_all(self) -> list[RequestStats]:
        """Stats of every unfinished sequence, marked aborted (the run is being interrupted)."""
        now = self.now()
        stats = []
        if self.scheduler.cohort is not None:
            self.scheduler.cohort.dissolve(self.scheduler.running)
        for seq in self.scheduler.all_seqs():
            seq.finish_reason = FinishReason.ABORTED
            stats.append(self._stats(seq, now))
        return stats

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.all_seqs())
        cohort = self.scheduler.cohort
        for seq in self.scheduler.running:
            computed = seq.num_computed_tokens if cohort is None else cohort.num_computed(seq)
            assert len(seq.block_table) * self.block_manager.block_size >= computed, \
                f"{seq}: computed positions beyond its blocks"
        for seq in self.scheduler.waiting:
            assert not seq.block_table, f"waiting {seq} holds blocks"
        if cohort is not None:   # its sums over the members, kept as they join, settle and leave
            members = self.scheduler.running[:cohort.num_members]
            assert all(seq.cohort_mark >= 0 for seq in members), "a cohort member without its mark"
            assert cohort.sum_marks == sum(seq.cohort_mark for seq in members), "the cohort's sum of marks is off"
            assert cohort.computed_base == sum(seq.num_computed_tokens - seq.cohort_mark for seq in members), \
                "the cohort's sum of positions is off"
            assert cohort.members == members and cohort.member_idx == [seq.cohort_idx for seq in members] \
                and cohort.member_req_ids == [seq.req_id for seq in members] \
                and cohort.member_samples == [seq.sample for seq in members], "the cohort's member columns are off"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Convenience: run prompts to completion, return each request's sample-0 output ids."""
        seqs = [self.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished():
            self.step()
        self.flush()
        return [s.token_ids[s.num_prompt_tokens:] for s in seqs]
