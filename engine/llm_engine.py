"""The engine loop: add requests; each step schedules, runs, processes the output and records it.

    step():  out = scheduler.schedule()        which sequences compute how many tokens, with blocks
             result = executor.execute(out)    KV copies, then the forward (or its predicted time)
             account, sample, deliver          positions computed, tokens appended, stops checked
             finish, record                    blocks freed, the step handed to the tracer

The loop holds an Executor (engine/executor/) and never asks which: the model on a device, or the
simulator's cost model (engine/sim/). engine/build.py makes an engine from its config. What this file
writes is the general pass (docs/glossary.md), which the simulator's fast path is held to.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, Protocol

from engine import events as ev
from engine.block_manager import BlockManager, HybridBlockManager
from engine.config import EAGLE_METHODS, EngineConfig, KVReserve, ModelConfig, NMode, PoolGeometry
from engine.events import FinishReason, KVEvent, NullTracer, Occupancy, RequestStats, StepRecord, Tracer
from engine.executor import Executor, StepResult
from engine.offload import OffloadTier
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SamplingParams, Sequence, SequenceStatus
from engine.spec_decode import Acceptance, GeometricAcceptance, propose_ngram

if TYPE_CHECKING:
    import torch

MAX_STEPS_WITHOUT_PROGRESS = 10_000

_req_id = attrgetter("req_id")
_sample_index = attrgetter("sample")


class LivelockError(RuntimeError):
    """The engine kept stepping without emitting a token."""


class TokenColumns(NamedTuple):
    """A step's emitted tokens as the trace's columns, one entry per token."""

    req_ids: list[str]
    samples: list[int]
    idx: list[int]                  # the token's index among its sequence's output tokens
    token_ids: list[int | None]     # None where the executor's ids are placeholders (simulated)


class FastPath(Protocol):
    """A second implementation of the loop's decisions, for the steps it can make cheaper: the
    simulator's (engine/sim/fast_path.py). The loop holds one only when it simulates with it on."""

    def advance(self, until_s: float) -> tuple[int, int] | None:
        """Run steps, as many as it can before `until_s`: (steps, tokens); None leaves the next step
        to the general pass."""
        ...

    def settle(self) -> None:
        """Write out whatever it keeps behind: every sequence is then as the general pass expects."""
        ...

    def check_integrity(self) -> None:
        ...


def in_batch_order(seqs: list[Sequence], batch: list[Sequence]) -> list[Sequence]:
    """The sequences in the order of `batch` (the step's scheduled sequences), which is the order V1
    frees those that finish (update_from_output walks the scheduled requests); samples forked this
    step (--n-mode cow) come last. The executor's sampling order differs: decodes first, then
    prefill chunks."""
    if len(seqs) < 2:   # most steps finish none or one: no per-step work over the batch
        return seqs
    position = {id(seq): i for i, seq in enumerate(batch)}
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
    # speculative decoding: (sequence, drafts, accepted, lookahead slots) of each drafting sequence,
    # accepted already decided (the model ran), applied when the output is processed
    drafts: list[tuple[Sequence, int, int, int]] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, geometry: PoolGeometry, executor: Executor,
                 *, max_model_len: int, tracer: Tracer | None = None, model_source: str = "",
                 device: torch.device | None = None, model=None) -> None:
        """`config` resolved (engine/build.py fills in what depends on the device); `geometry` the
        KV pool's size; `executor` runs the steps. `model_source`, `device` and `model` describe the
        real engine's model (the simulated engine has none)."""
        self.config = config
        self.model_config = model_config
        self.geometry = geometry
        self.max_model_len = max_model_len
        self.model_source = model_source
        self._device = device
        self.model = model            # the LlamaModel (None: simulated)
        self.stop_token_ids = frozenset(model_config.stop_token_ids)
        g = geometry
        watermark = int(config.watermark * (g.num_gpu_blocks + 1))   # V1 sizes it on the whole pool, null block included
        if not config.hybrid_kv_cache(model_config):
            self.block_manager = BlockManager(g.num_gpu_blocks, g.block_size, g.num_cpu_blocks,
                                              config.enable_prefix_caching, watermark)
        else:   # a table per KV-cache group, windows dropping blocks mid-request; the steps that may be in
            # flight at once (vLLM's max_concurrent_batches) bound a window's admission
            in_flight = config.max_num_batched_tokens * (2 if config.async_scheduling else 1)
            self.block_manager = HybridBlockManager(g.num_gpu_blocks, g.block_size, watermark,
                                                    tuple(group.window for group in config.kv_cache_groups(model_config)),
                                                    in_flight, max_model_len, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   preemption_mode=config.preemption_mode,
                                   preemption_policy=config.preemption_policy,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   swap_groups=config.n_mode == NMode.COW, max_model_len=max_model_len,
                                   num_spec_tokens=config.num_speculative_tokens,
                                   num_lookahead_tokens=config.num_lookahead_tokens, draft_slots=config.draft_slots)
        self.block_manager.eagle_drafter = config.speculative_method in EAGLE_METHODS
        self.scheduler.follow(config.follow_vllm)
        if g.num_offload_blocks:   # a host KV tier (engine/offload.py)
            self.scheduler.add_tier(OffloadTier(g.num_offload_blocks, host_slots=not self.simulated))
        # the simulator's host link, one per direction (loads, stores): the clock time it is free from
        self._link_free_s = {True: 0.0, False: 0.0}
        # speculative decoding (the simulator's): how many of a step's drafts are accepted
        self.drafting = config.speculative_method is not None
        self.acceptance: Acceptance = GeometricAcceptance(config.spec_acceptance_rate, config.seed)
        self.scheduler.drafts_at_schedule = self.drafting and config.async_scheduling
        self.runner = executor
        self.fast_path: FastPath | None = None   # set by engine/build.py when the simulator's is on
        self.clock = self.runner.clock
        self.tracer: Tracer = tracer or NullTracer()
        self.time_origin = self.clock()
        self.next_arrival_s = math.inf   # during advance(): the replay's next arrival, on the engine's clock
        self.step_counter = 0
        self._event_seq = 0   # the seq number of the next event handed to the tracer
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
        """Where the model runs. The simulated engine runs none and answers the CPU, importing torch only
        if asked (its replay never asks)."""
        if self._device is None:
            import torch

            self._device = torch.device("cpu")
        return self._device

    @property
    def simulated(self) -> bool:
        """No model runs: a cost model predicts each step, in virtual time."""
        return self.config.engine == "sim"

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
    def advance(self, until_s: float = math.inf) -> tuple[int, int]:
        """What a replay calls: run the next step and return (steps, tokens emitted). The simulator's
        fast path may run several steps at once, up to the one that would start at `until_s`
        (the next arrival)."""
        if self.fast_path is not None:
            ran = self.fast_path.advance(until_s)
            if ran is not None:
                return ran
        self.next_arrival_s = until_s   # a step that only waits for a tier copy wakes for it too
        try:
            return 1, len(self.step())
        finally:
            self.next_arrival_s = math.inf

    def step(self) -> list[tuple[Sequence, int]]:
        """Run one step; return the (sequence, token id) pairs it emitted (with async scheduling, those
        of the step before)."""
        if self.fast_path is not None:
            self.fast_path.settle()   # the general pass reads every sequence's counts
        if self.config.async_scheduling:
            return self._step_async()
        start_s = self.now()
        out = self.scheduler.schedule()
        sched_events = self.block_manager.take_events()
        occupancy = self._occupancy(out)
        result = self.runner.execute(out)
        num_recompute = self._account(out.seqs, out.num_new_tokens, start_s)
        tier = self._finish_copies(out, start_s + self.time_origin) if self.scheduler.connector is not None else None
        sampled = self._sample(result)
        drafts = None
        if self.drafting:   # each sequence's accepted drafts are tokens too; the rejected roll back
            sampled, drafts = self._verify_drafts(out, sampled, result)
        for seq, token in sampled:
            seq.token_ids.append(token)
        self._deliver(sampled, self.now())
        if self.drafting and self.scheduler.caches_on_delivery:   # the accepted tokens' blocks (vLLM 0.33)
            # in batch order, as update_from_output walks them (which of two equal blocks a hit finds)
            for seq in in_batch_order(list(dict.fromkeys([seq for seq, _ in sampled])), out.seqs):
                # (a stopped one's accepted positions may pass its tokens, cut at the stop: hashed blocks only)
                self.block_manager.cache_full_blocks(seq, min(seq.num_computed_tokens, len(seq.token_ids)))
        stopped = [seq for seq, _ in sampled if seq.finish_reason]
        if self.drafting:   # a sequence's several tokens name it once
            stopped = list(dict.fromkeys(stopped))
        finished = self._finish(out, in_batch_order(stopped, out.seqs))
        if self.drafting:
            self._propose_drafts(out)
        self._record(step=self.step_counter, start_s=start_s, end_s=self.now(), out=out, result=result,
                     kv_events=sched_events + self.block_manager.take_events(), num_sched_events=len(sched_events),
                     occupancy=occupancy, num_recompute=num_recompute, tokens=self._token_columns(sampled),
                     finished=finished, drafts=drafts, tier=tier)
        self.step_counter += 1
        self._check_progress(bool(sampled or finished))
        return sampled

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
            if bm.hybrid:   # its positions are processed: a window may drop their blocks from now on
                for seq in prev.out.seqs:
                    seq.num_in_flight_tokens = 0
            emitted = prev.sampled
            if prev.drafts:   # the accepted drafts are tokens too, the rejected rolled back
                emitted = self._resolve_drafts(prev.drafts, prev.sampled)
            self._deliver(emitted, end_s)
            stopped = in_batch_order(list(dict.fromkeys([seq for seq, _ in emitted if seq.finish_reason])), prev.out.seqs)
        result = self.runner.execute(out)   # before the frees: a just-stopped sequence may still run
        num_recompute = self._account(out.seqs, out.num_new_tokens, start_s)
        if bm.hybrid:
            for seq, num_new in zip(out.seqs, out.num_new_tokens):
                seq.num_in_flight_tokens = num_new
        events += bm.take_events()
        if prev is not None:
            sampling = {id(s) for s in result.sample_seqs}
            # V1 caches what the delivered tokens complete, less this step's input, for every sequence
            # running before the delivery: one that stops on it too (its last block), before it is freed;
            # in batch order, as update_from_output walks them
            for seq in in_batch_order(list(dict.fromkeys([seq for seq, _ in emitted])), prev.out.seqs):
                if seq.status == SequenceStatus.RUNNING:
                    bm.cache_full_blocks(seq, seq.num_computed_tokens - (id(seq) in sampling) - seq.num_draft_placeholders)
            for seq in stopped:
                sched.finish(seq)
            self._record(step=prev.step, start_s=prev.start_s, end_s=end_s, out=prev.out, result=prev.result,
                         kv_events=prev.events + bm.take_events(), num_sched_events=prev.num_sched_events,
                         occupancy=prev.occupancy, num_recompute=prev.num_recompute,
                         tokens=self._token_columns(emitted), finished=prev.finished + stopped,
                         drafts=[(s.req_id, s.sample, n, a, la) for s, n, a, la in prev.drafts]
                         if prev.drafts is not None else None)
            self.num_finished_seqs += len(stopped)
        sampled = [(seq, token) for seq, token in self._sample(result) if seq.status == SequenceStatus.RUNNING]
        drafts = None
        if self.drafting:   # the model has verified this step's drafts: how many it accepted is known
            num_drafts = {id(seq): n for seq, n in zip(out.seqs, out.num_drafts) if n}
            # (every sequence that ran them, one stopped on the output just processed too: it still ran)
            drafts = [(seq, num_drafts[id(seq)], self.acceptance(seq, self.step_counter, num_drafts[id(seq)]),
                       sched.lookahead(seq.num_computed_tokens, 0)) for seq in result.sample_seqs if id(seq) in num_drafts]
        for seq, token in sampled:   # in flight: the next step's input, delivered after it is scheduled
            seq.token_ids.append(token)
            seq.num_undelivered += 1
        self.num_finished_seqs += len(finished_now)
        self.num_preemptions += out.num_preemptions
        self._in_flight = _InFlight(step=self.step_counter, start_s=start_s, out=out, result=result, events=events,
                                    num_sched_events=num_sched_events, occupancy=occupancy,
                                    num_recompute=num_recompute, sampled=sampled, finished=finished_now,
                                    drafts=drafts)
        self.step_counter += 1
        self._check_progress(bool(emitted or stopped or finished_now))
        return emitted

    # ---- the step's parts ---------------------------------------------------------------
    def _finish_copies(self, out: SchedulerOutput, start_clock: float) -> tuple[int, int, float]:
        """The host KV tier's copies: those issued this step timed, those finished by the end of it
        completed, their events filed with this step. The real engine copied them in the step; in the
        simulator a copy takes its bytes over the host link (the executor's estimate), one copy at a
        time each way, loads from the step's start (before the forward), stores from its end. A step
        that ran nothing waits for the next copy to finish. Returns the finished copies' bytes stored,
        bytes loaded and milliseconds."""
        connector, bm = self.scheduler.connector, self.block_manager
        if not out.tier_copies and not connector.copies_in_flight:   # most steps
            return 0, 0, 0.0
        now = self.clock()
        for copy in out.tier_copies:
            copy.event.bytes = len(copy.device_blocks) * self.geometry.bytes_per_block
            if not self.simulated:
                copy.done_s = now
                continue
            issued = start_clock if copy.is_load or copy.before_forward else now
            link_free = self._link_free_s[copy.is_load]
            copy.done_s = (issued if issued > link_free else link_free) + copy.event.duration_ms / 1000
            self._link_free_s[copy.is_load] = copy.done_s
        in_flight = connector.copies_in_flight
        if not out.seqs and in_flight and not any(c.flushed or c.done_s <= now for c in in_flight):
            # nothing ran: wait for the first copy to finish, or for the next arrival if it comes first
            # (the replay adds it and the next step may admit it while the copies go on)
            wake = min(c.done_s for c in in_flight)
            arrival = self.next_arrival_s + self.time_origin
            self.runner.idle_until(arrival if now < arrival < wake else wake)
            now = self.clock()
        stored = loaded = 0
        total_ms = 0.0
        for copy in [c for c in in_flight if c.flushed or c.done_s <= now]:
            connector.complete_copy(copy)
            bm.events.append(copy.event)
            if copy.is_load:
                loaded += copy.event.bytes
            else:
                stored += copy.event.bytes
            if isinstance(copy.event.duration_ms, tuple):   # CUDA events: _flush_records times the copies
                total_ms = None
            elif total_ms is not None:
                total_ms += copy.event.duration_ms or 0.0
        return stored, loaded, total_ms

    def _occupancy(self, out: SchedulerOutput, held: int | None = None) -> Occupancy:
        """The pool right after scheduling: queues, blocks, and the KV positions the used blocks hold
        once this step's tokens are written. `held`: the running sequences' computed positions, when
        the caller has their sum."""
        bm, sched = self.block_manager, self.scheduler
        return Occupancy(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.loading),
            num_swapped=len(sched.swapped),
            num_free_blocks=bm.num_free_blocks, num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_free_blocks,
            num_kv_tokens=bm.num_kv_positions(sched.running, held) + sum(out.num_new_tokens))

    def _account(self, seqs: list[Sequence], new_tokens: list[int], start_s: float) -> int:
        """Advance the sequences' computed positions by their scheduled tokens; count the positions
        computed for the second time (they had KV before: recompute)."""
        num_recompute = 0
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

    def _verify_drafts(self, out: SchedulerOutput, sampled: list[tuple[Sequence, int]], result: StepResult
                       ) -> tuple[list[tuple[Sequence, int]], list[tuple[str, int, int, int, int]]]:
        """Speculative decoding: each sampling sequence's drafts verified, the rejected positions rolled
        back (V1's update_from_output), the accepted ones emitted with its sampled token, as many as
        its stop leaves room for. The real engine accepts a draft while it is the model's own greedy
        token (the tokens emitted are the model's); the simulator's acceptance model says how many.
        Returns the step's tokens, and (request, sample, drafts, accepted, lookahead slots) per
        drafting sequence."""
        num_drafts = {id(seq): n for seq, n in zip(out.seqs, out.num_drafts) if n}
        if not num_drafts:
            return sampled, []
        predicted = self.runner.draft_predictions(result) if self.runner.emits_token_ids else None
        tokens, drafts = [], []
        for seq, token in sampled:
            n = num_drafts.get(id(seq))
            if not n:
                tokens.append((seq, token))
                continue
            if predicted is None:
                accepted = self.acceptance(seq, self.step_counter, n)
                chain = [token] * (1 + accepted)
            else:   # the model's token after its last token, then after each draft
                chain = [token, *predicted[id(seq)]]
                proposals = seq.draft_token_ids[:n]
                accepted = 0
                while accepted < len(proposals) and proposals[accepted] == chain[accepted]:
                    accepted += 1
                chain = chain[:accepted + 1]
                if not seq.params.ignore_eos:   # cut after a stop token
                    for i, t in enumerate(chain):
                        if t in self.stop_token_ids:
                            chain = chain[:i + 1]
                            break
            drafts.append((seq.req_id, seq.sample, n, accepted, self.scheduler.lookahead(seq.num_computed_tokens, 0)))
            seq.num_computed_tokens -= n - accepted
            seq.num_ever_computed = seq.num_computed_tokens   # a rejected position never held KV to lose
            seq.num_draft_tokens += n
            seq.num_accepted_tokens += accepted
            num_tokens = max(1, min(len(chain), seq.stop_num_tokens - len(seq.token_ids)))   # cut at the stop
            if num_tokens < 1 + accepted:   # its computed positions cover its tokens but the last (vLLM 0.33)
                seq.num_computed_tokens -= 1 + accepted - num_tokens
            tokens += [(seq, t) for t in chain[:num_tokens]]
        return tokens, drafts

    def _resolve_drafts(self, drafts: list[tuple[Sequence, int, int, int]], sampled: list[tuple[Sequence, int]]
                        ) -> list[tuple[Sequence, int]]:
        """Async scheduling: a processed output's drafts (accepted when the model ran): the rejected
        positions rolled back unless the sequence was preempted since (V1: computed and placeholders
        zeroed then), the accepted ones appended after its sampled token, cut at its stop. Returns the
        output's tokens."""
        resolved = {id(seq): (n, accepted) for seq, n, accepted, _ in drafts}
        tokens = []
        for seq, token in sampled:
            tokens.append((seq, token))
            if id(seq) not in resolved:
                continue
            n, accepted = resolved[id(seq)]
            seq.num_draft_tokens += n
            seq.num_accepted_tokens += accepted
            kept = min(accepted, seq.stop_num_tokens - len(seq.token_ids))
            if seq.num_computed_tokens > 0:   # not preempted since it was scheduled
                seq.num_computed_tokens -= n - accepted + accepted - max(kept, 0)   # rejected; cut at the stop
                seq.num_draft_placeholders -= n
                seq.num_ever_computed = min(seq.num_ever_computed, seq.num_computed_tokens)
            for _ in range(max(kept, 0)):
                seq.token_ids.append(token)
                tokens.append((seq, token))
        return tokens

    def _propose_drafts(self, out: SchedulerOutput) -> None:
        """Speculative decoding: the drafter's proposals for the next step, k for each sequence of this
        step still running, none for one whose step was a prefill chunk (V1's update_draft_token_ids);
        a running sequence left out of the step keeps what it had."""
        k = self.config.num_speculative_tokens
        real = self.runner.emits_token_ids   # the real engine proposes by n-gram, for greedy sequences
        for seq in out.seqs:
            if seq.status != SequenceStatus.RUNNING:
                continue
            if not real:
                seq.num_drafts = 0 if seq.is_prefill_chunk else k
                continue
            seq.draft_token_ids = [] if seq.is_prefill_chunk or not seq.params.greedy else propose_ngram(seq.token_ids, k)
            seq.num_drafts = len(seq.draft_token_ids)

    def _sample(self, result: StepResult) -> list[tuple[Sequence, int]]:
        """A token for every sequence whose last token was computed; n > 1 samples forked (--n-mode
        cow) when their parent's prompt is done, each sampling from its parent's row."""
        if not result.sample_seqs:
            return []
        seqs = list(result.sample_seqs)
        rows = list(range(len(seqs)))
        for i in range(len(seqs)):
            parent = seqs[i]
            if parent.num_pending_forks:
                for child in self._fork(parent):
                    seqs.append(child)
                    rows.append(rows[i])
        return list(zip(seqs, self.runner.sample(result, seqs, rows)))

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

    def _finish(self, out: SchedulerOutput, stopped: list[Sequence]) -> list[Sequence]:
        """The step's finished sequences, their blocks freed: those rejected since the last step (at
        add_request, by the scheduler), the samples a rejected parent never forked, and `stopped`, in
        the order their blocks are freed."""
        finished = self._pending_finished + out.rejected
        self._pending_finished = []
        # --n-mode cow, rejected before forking: every sample finishes
        finished += [s for seq in finished if seq.num_pending_forks for s in self._unforked_samples(seq)]
        for seq in stopped:
            finished.append(seq)
            self.scheduler.finish(seq)
        for seq in out.rejected:
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free_host(seq)  # a swapped sequence that outgrew the pool
        self.num_finished_seqs += len(finished)
        self.num_preemptions += out.num_preemptions
        return finished

    def _unforked_samples(self, parent: Sequence) -> list[Sequence]:
        """The samples a rejected parent never forked, finished like it (a requests row each)."""
        samples = [self._sample_of(parent, index) for index in range(1, parent.num_pending_forks + 1)]
        for seq in samples:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = parent.finish_reason
        parent.num_pending_forks = 0
        return samples

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's other samples (--n-mode cow), sharing its blocks, join the running batch."""
        children = [self._sample_of(parent, index) for index in range(1, parent.num_pending_forks + 1)]
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_ever_computed = parent.num_ever_computed
            child.num_reserved_tokens = parent.num_reserved_tokens
            child.stop_num_tokens = parent.stop_num_tokens
            child.first_scheduled_s = parent.first_scheduled_s
            child.num_prefix_hit_tokens = parent.num_prefix_hit_tokens
            self.scheduler.adopt(child)
        parent.num_pending_forks = 0
        return children

    def _sample_of(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index` of the parent's request, its prompt and output so far the parent's."""
        seq = Sequence(parent.req_id, index, parent.token_ids, parent.params, parent.arrival_s, parent.priority,
                       parent.arrival_order)
        if self.keep_outputs:
            self.outputs[(seq.req_id, index)] = seq
        return seq

    def _check_progress(self, progressed: bool) -> None:
        if progressed or not self.has_unfinished():
            self._steps_without_progress = 0
            return
        self._steps_without_progress += 1
        if self._steps_without_progress > MAX_STEPS_WITHOUT_PROGRESS:
            raise LivelockError(f"no token emitted in {MAX_STEPS_WITHOUT_PROGRESS} steps with "
                                f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting, "
                                f"{len(self.scheduler.swapped)} swapped")

    # ---- tracing ------------------------------------------------------------------------
    def _token_columns(self, emitted: list[tuple[Sequence, int]]) -> TokenColumns:
        seqs, ids = zip(*emitted) if emitted else ((), ())
        idx = [len(s.token_ids) - s.num_prompt_tokens - 1 for s in seqs]   # num_output_tokens - 1
        if self.drafting:   # a sequence's several tokens, its last output's index the last
            later: dict[int, int] = {}
            for i in range(len(seqs) - 1, -1, -1):
                n = later.get(id(seqs[i]), 0)
                idx[i] -= n
                later[id(seqs[i])] = n + 1
        return TokenColumns(list(map(_req_id, seqs)), list(map(_sample_index, seqs)), idx,
                            list(ids) if self.runner.emits_token_ids else [None] * len(seqs))

    def _record(self, *, step: int, start_s: float, end_s: float, out: SchedulerOutput, result: StepResult,
                kv_events: list[KVEvent], num_sched_events: int, occupancy: Occupancy, num_recompute: int,
                tokens: TokenColumns, finished: list[Sequence],
                drafts: list[tuple[str, int, int, int, int]] | None = None,
                tier: tuple[int, int, float] | None = None) -> None:
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
        record = StepRecord(
            step=step, start_s=start_s, end_s=end_s, device_ms=None,
            num_running=pool.num_running, num_waiting=pool.num_waiting, num_swapped=pool.num_swapped,
            num_prefill_tokens=result.num_prefill_tokens, num_decode_tokens=result.num_decode_tokens,
            num_recompute_tokens=num_recompute, num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks, num_cached_blocks=pool.num_cached_blocks,
            num_total_blocks=self.block_manager.num_blocks, num_kv_tokens=pool.num_kv_tokens,
            num_preemptions=out.num_preemptions, admission_stop=out.admission_stop, events=kv_events,
            token_req_ids=tokens.req_ids, token_samples=tokens.samples, token_idx=tokens.idx,
            token_ids=tokens.token_ids, finished=[self._stats(s, end_s) for s in finished],
        )
        if drafts is not None:   # speculative decoding: the step's drafts and what was accepted
            record.drafts = drafts
            record.num_draft_tokens = sum(d[2] for d in drafts)
            record.num_accepted_tokens = sum(d[3] for d in drafts)
        if tier is not None:   # the host KV tier's copies that finished in this step
            record.offload_bytes, record.load_bytes, record.tier_transfer_ms = tier
        self._pending_records.append((record, result, out))
        self._flush_records(wait=False)

    def _flush_records(self, wait: bool) -> None:
        """Hand over records whose device timings have resolved (all of them when `wait`)."""
        if wait:
            self.runner.synchronize()
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
            if record.tier_transfer_ms is None and record.offload_bytes is not None:
                # the host KV tier's copies on CUDA, timed by their events
                copies = [e for e in record.events if isinstance(e.duration_ms, tuple)]
                for e in copies:
                    e.duration_ms = t.ms(e.duration_ms)
                record.tier_transfer_ms = sum([e.duration_ms for e in copies])
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
                         num_recompute=prev.num_recompute, tokens=self._token_columns([]), finished=prev.finished)
        self._flush_records(wait=True)

    def _stats(self, seq: Sequence, finish_s: float) -> RequestStats:
        return RequestStats(
            req_id=seq.req_id, sample=seq.sample, n=seq.params.n, priority=seq.priority,
            arrival_s=seq.arrival_s, prompt_tokens=seq.num_prompt_tokens, max_tokens=seq.params.max_tokens,
            output_tokens=seq.num_output_tokens, first_scheduled_s=seq.first_scheduled_s,
            first_token_s=seq.first_token_s, finish_s=finish_s, finish_reason=seq.finish_reason or FinishReason.ABORTED,
            preemptions=seq.num_preemptions, swaps=seq.num_swaps, recomputed_tokens=seq.num_recomputed_tokens,
            prefix_hit_tokens=seq.num_prefix_hit_tokens,
            draft_tokens=seq.num_draft_tokens if self.drafting else None,
            accepted_tokens=seq.num_accepted_tokens if self.drafting else None,
            tier_hit_tokens=seq.num_tier_hit_tokens if self.scheduler.tier is not None else None,
        )

    def abort_all(self) -> list[RequestStats]:
        """Stats of every unfinished sequence, marked aborted (the run is being interrupted)."""
        if self.fast_path is not None:
            self.fast_path.settle()
        now = self.now()
        stats = []
        for seq in self.scheduler.all_seqs():
            seq.finish_reason = FinishReason.ABORTED
            stats.append(self._stats(seq, now))
        return stats

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the books balance: the block manager's, the queues', the fast path's if any."""
        self.block_manager.check_integrity(self.scheduler.all_seqs())
        for seq in self.scheduler.running:
            assert all(len(table) * self.block_manager.block_size >= seq.num_computed_tokens for table in seq.tables()), \
                f"{seq}: computed positions beyond its blocks"
        for seq in self.scheduler.waiting:
            assert not seq.block_table, f"waiting {seq} holds blocks"
        if self.scheduler.connector is not None:
            self.scheduler.connector.check_integrity(self.scheduler.loading, self.scheduler.running)
        if self.fast_path is not None:
            self.fast_path.check_integrity()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Convenience: run prompts to completion, return each request's sample-0 output ids."""
        seqs = [self.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished():
            self.step()
        self.flush()
        return [s.token_ids[s.num_prompt_tokens:] for s in seqs]
