"""What the engine tells an observer, and the protocol an observer implements.

The engine appends events to a buffer while it schedules and runs a step, and hands the whole
step to its tracer once (`Tracer.on_step`). On CUDA a step's record is handed over a few steps
later, when its CUDA events have resolved, so that timing never forces a synchronisation.
Publishing is the tracer's job; the default tracer does nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

# kv event kinds (see docs/trace-format.md)
ALLOC = "alloc"            # blocks given to a sequence
FREE = "free"              # blocks whose reference count fell to zero
PREEMPT = "preempt"        # a sequence lost its place; reason = recompute | swap | swap-full-fallback;
                           # requester_* = the sequence that needed the blocks, victim_reason = why this one
SWAP_OUT = "swap_out"      # blocks copied device -> host (blocks = device ids, src_blocks = host ids)
SWAP_IN = "swap_in"        # blocks copied host -> device (blocks = new device ids, src_blocks = host ids)
REPREFILL = "reprefill"    # a resumed sequence finished re-prefilling its history (reason=interrupted if preempted first)
COW = "cow"                # copy-on-write (src_blocks -> blocks)
PREFIX_HIT = "prefix_hit"  # blocks served from the prefix cache
EVICT = "evict"            # a cached free block reclaimed for new use
ADMIT = "admit"            # a sequence was scheduled from waiting (reason = new | resume-recompute | resume-swap)
FINISH = "finish"          # a sequence finished (reason = stop | length | rejected | capacity | aborted)
# KV tiers (schema 6): a tier (host memory, storage) behind the device pool; `tier` names it
OFFLOAD = "offload"        # device blocks stored to a tier (blocks = device ids; reason = failed if the store failed)
LOAD = "load"              # blocks loaded from a tier into the device for req_id (reason = failed: recomputed instead)
TIER_EVICT = "tier_evict"  # blocks a tier dropped to make room (num_blocks of the tier's, no device block)
LOOKUP = "lookup"          # a prefix looked up at admission: found on the device (num_cached_tokens), in the
                           # tier (tier_tokens), the rest to compute; reason = new | resume-recompute


# The reasons an event carries, by kind. The values are the trace's (analyses/ reads them); the
# vLLM capture (kvtrace/vllm/capture/, which cannot import the engine) writes the same strings.
class AdmitReason(StrEnum):     # admit, and the prefix_hit of that admission
    NEW = "new"                           # first admission
    RESUME_RECOMPUTE = "resume-recompute"  # preempted by recompute: its KV is computed again
    RESUME_SWAP = "resume-swap"           # preempted by swap: its KV is copied back from the host


class AllocReason(StrEnum):
    PREFILL = "prefill"    # blocks for prompt (or re-prefilled history) positions
    DECODE = "decode"      # a block for the next generated token
    COW = "cow"            # the private copy of a shared block (copy-on-write)
    SWAP_IN = "swap_in"    # device blocks for KV coming back from the host


class FreeReason(StrEnum):
    PREEMPT = "preempt"    # a victim gives up its device blocks (by recompute: its KV is gone; by swap: copied out)
    FINISH = "finish"      # a finished sequence releases its blocks
    WINDOW = "window"      # mid-request: blocks wholly out of a sliding window (a chunked local attention's chunk)
    STATE = "state"        # the vLLM capture only: a Mamba layer's state blocks it no longer needs


class PreemptReason(StrEnum):
    RECOMPUTE = "recompute"                     # KV dropped, computed again on resume
    SWAP = "swap"                               # KV copied to host memory
    SWAP_FULL_FALLBACK = "swap-full-fallback"   # swap mode, but the host was full: recompute


class VictimReason(StrEnum):   # preempt: why the policy chose this victim
    NEWEST = "newest"                    # admitted last among the candidates (newest, newest-sparing)
    LOWEST_PRIORITY = "lowest-priority"  # the least urgent: largest priority value, then latest arrival
    FEWEST_COMPUTED = "fewest-computed"  # the candidate with the least computed KV (fewest-computed)
    ONLY_CANDIDATE = "only-candidate"    # every other running sequence was spared: the requester yields
    SWAP_GROUP = "swap-group"            # a sample of the victim's request, swapped out with it


class AdmissionStop(StrEnum):  # the steps row's admission_stop: why admission stopped this step
    NOTHING_WAITING = "nothing-waiting"  # every waiting (and swapped) sequence was admitted, or none waited
    SEATS = "seats"                      # max_num_seqs sequences running
    BUDGET = "budget"                    # the step's token budget (max_num_batched_tokens) spent
    BLOCKS = "blocks"                    # too few free blocks for the next one's whole prompt (or swap-in)
    WATERMARK = "watermark"              # it would fit, but not above the free-block watermark
    PREEMPTION = "preemption"            # a preemption earlier in the step: V1 admits nothing then
    OTHER = "other"                      # vLLM held it back for a reason of its own (captures); a KV tier's copies


class FinishReason(StrEnum):   # also the requests table's finish_reason
    STOP = "stop"          # a stop token, or the recorded request's own output length
    LENGTH = "length"      # max_tokens, or the max model length
    REJECTED = "rejected"  # can never fit the pool (or the max model length): never ran
    CAPACITY = "capacity"  # outgrew the whole pool after it ran
    ABORTED = "aborted"    # unfinished when the run was interrupted
    ERROR = "error"        # ended by the server on an error (vLLM: a failed KV load under policy "fail")


REPREFILL_INTERRUPTED = "interrupted"   # reprefill: preempted again before its history was computed


class TransferReason(StrEnum):   # offload and load: null for a copy that succeeded
    FAILED = "failed"    # the copy failed: a store leaves the tier without the blocks; a load's positions are
                         # computed instead


@dataclass(slots=True)
class KVEvent:
    """One KV-cache event. Which fields matter depends on `kind`."""

    kind: str
    req_id: str
    sample: int = 0
    blocks: list[int] | None = None       # physical device block ids concerned
    num_tokens: int = 0                   # token positions concerned (re-prefilled, cached, moved)
    bytes: int = 0                        # bytes copied (swap, cow)
    duration_ms: float | None = None      # copy duration (swap), filled when measured
    reason: str | None = None
    num_cached_tokens: int = 0            # reprefill: positions served from the prefix cache
    num_recomputed_tokens: int = 0        # reprefill: positions computed again (had KV before)
    src_blocks: list[int] | None = None   # swap: host block ids; cow: source device blocks
    requester_req_id: str | None = None   # preempt: the sequence whose allocation could not be served
    requester_sample: int | None = None
    victim_reason: str | None = None      # preempt: a VictimReason
    # alloc: the blocks among `blocks` that were taken from the prefix cache (cached and free), in the
    # order they were evicted. Each is an `evict` of its own in the trace, right before this event
    # (`with_evictions`): one object here instead of one an evicted block keeps a long replay cheap.
    evicted: list[int] | None = None
    # a model of several KV-cache groups: an alloc's or free's group; a preempt's blocks are every
    # group's, group by group, kv_group_blocks of them in each (None in a run of one group)
    kv_group: int | None = None
    kv_group_blocks: list[int] | None = None
    # KV tiers: the tier an offload, load, tier_evict or lookup concerns; a lookup's positions found in
    # it (beyond the device's hit); a tier_evict's count of tier blocks, which have no device id (the
    # trace's num_blocks, len(blocks) for every other event)
    tier: str | None = None
    tier_tokens: int | None = None
    num_tier_blocks: int | None = None
    step: int = 0
    ts_s: float = 0.0
    seq: int = 0                          # global order within the run, set when handed over


def with_evictions(events: list[KVEvent]) -> list[KVEvent]:
    """The events as the trace has them: each block an `alloc` evicted as an `evict` event of its own
    right before it (same step and time, the seq numbers in between)."""
    out = []
    for e in events:
        if e.evicted:
            first = e.seq - len(e.evicted)
            out += [KVEvent(EVICT, "", blocks=[b], step=e.step, ts_s=e.ts_s, seq=first + i)
                    for i, b in enumerate(e.evicted)]
        out.append(e)
    return out


@dataclass(slots=True)
class RequestStats:
    """Summary of one finished sequence (one sample of a request)."""

    req_id: str
    sample: int
    n: int
    priority: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    first_scheduled_s: float | None
    first_token_s: float | None
    finish_s: float
    finish_reason: str
    preemptions: int
    swaps: int
    recomputed_tokens: int
    prefix_hit_tokens: int
    draft_tokens: int | None = None      # speculative decoding: draft positions verified for it
    accepted_tokens: int | None = None   # and of them those accepted
    tier_hit_tokens: int | None = None   # KV tiers: positions loaded from a tier instead of computed (None: no tier)


@dataclass(frozen=True, slots=True)
class Occupancy:
    """The KV pool and the queues right after a step is scheduled (taken once per step; the steps
    row's columns of the same names)."""

    num_running: int        # sequences scheduled to run (running after this step's preemptions)
    num_waiting: int        # new, or preempted by recompute and waiting to be admitted again
    num_swapped: int        # preempted by swap, their KV in host memory
    num_free_blocks: int    # device blocks on the free queue (cached ones included)
    num_used_blocks: int    # device blocks some sequence holds
    num_cached_blocks: int  # free blocks still holding reusable prefix-cache KV
    num_kv_tokens: int      # KV positions the used blocks hold once this step's tokens are written


@dataclass(slots=True)
class StepRecord:
    """Everything that happened in one engine step."""

    step: int
    start_s: float                  # host clock, seconds since the engine's time origin
    end_s: float
    device_ms: float | None         # forward time on the device (CUDA events; host clock on CPU)
    num_running: int
    num_waiting: int
    num_swapped: int
    num_prefill_tokens: int         # prompt / history tokens computed this step
    num_decode_tokens: int
    num_recompute_tokens: int       # of the prefill tokens, those that had KV before (wasted work)
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int          # free blocks still holding reusable prefix-cache KV
    num_total_blocks: int
    num_kv_tokens: int              # KV positions stored in used blocks (a shared one counted once)
    num_preemptions: int
    admission_stop: str | None = None   # an AdmissionStop: why no further sequence was admitted
    events: list[KVEvent] = field(default_factory=list)
    # emitted tokens, as parallel lists (cheap to build, cheap to turn into columns)
    token_req_ids: list[str] = field(default_factory=list)
    token_samples: list[int] = field(default_factory=list)
    token_idx: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finished: list[RequestStats] = field(default_factory=list)
    # speculative decoding (None: the run does not draft): draft positions verified, of them accepted,
    # and per drafting sequence (request, sample, drafts, accepted, lookahead slots reserved)
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    drafts: list[tuple[str, int, int, int, int]] | None = None
    # KV tiers (None: the run has no tier): bytes stored to a tier and loaded from one this step (its
    # offload and load events'), and the time those copies took where measured
    offload_bytes: int | None = None
    load_bytes: int | None = None
    tier_transfer_ms: float | None = None


class Tracer(Protocol):
    """Takes each step's record."""

    def on_step(self, record: StepRecord) -> None: ...


class NullTracer:
    """The default: observes nothing, costs nothing."""

    def on_step(self, record: StepRecord) -> None:
        pass
