"""What the capture's parts hand one another: a request's state between steps, a KV event, a step's
row, and a step scheduled whose output is not processed yet.

The wraps of vLLM's methods (wraps.py) and the per-step accounting (accounting.py) make KV events
and steps rows; the column building (columns.py) turns them into the sink's columns once per step,
and the self-check (self_check.py) replays the events. A `KvEvent`'s fields are named as the
kv_events columns they become (sink.py's COLUMNS); the columns a vLLM capture fills with one value
(sample, bytes, duration_ms, src_blocks) are the column building's.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import sub
from typing import Any, NamedTuple


class RequestState:
    """What the capture keeps of one request between steps."""

    __slots__ = ["ever", "recomputed", "prefix_hits", "preemptions", "first_scheduled",
                 "reprefill_target", "reprefill_cached", "reprefill_recomputed", "tier_hits"]

    def __init__(self) -> None:
        self.ever = 0                 # most KV positions it ever had computed (kept up to date while watched)
        self.recomputed = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.first_scheduled: float | None = None
        self.reprefill_target = 0     # while re-prefilling after a preemption: the positions to get back
        self.reprefill_cached = 0
        self.reprefill_recomputed = 0
        self.tier_hits = 0            # a KV connector's tier: positions loaded instead of computed


class KvEvent(NamedTuple):
    """One kv_events row before its step, sequence number and time are known (a tuple: events are made
    in the block pool's wrappers, many a step, and built into columns in bulk). Those the wrappers make
    (`block_event`, `copy_event`) are plain tuples of these fields, read by index (KIND, REQ_ID, ...)."""

    kind: str
    req_id: str                         # vLLM's request id; "" for a block no request is known for
    blocks: tuple[int, ...] | list[int] | None   # a tuple where the wraps make it (leaves the GC's care)
    num_tokens: int
    reason: str | None
    num_cached_tokens: int = 0          # a re-prefill's positions served from the prefix cache
    num_recomputed_tokens: int = 0      # and those computed again
    requester_req_id: str | None = None   # a preemption's cause: the request it served
    victim_reason: str | None = None      # and why vLLM chose this victim
    # a model of several KV-cache groups (hybrid attention): the group of an alloc's, a free's or an
    # evict's blocks, and for an event whose blocks are of every group (a prefix hit, a preemption)
    # how many of them each group has, in group order; None for a model of one group
    kv_group: int | None = None
    kv_group_blocks: list[int] | None = None
    # a KV tier's event (schema 6: a KV connector's, connector.py): the tier, a lookup's positions the tier
    # holds, the bytes a copy moved, and a tier_evict's count of the tier's blocks (it names no device block)
    tier: str | None = None
    tier_tokens: int | None = None
    bytes: int = 0
    num_tier_blocks: int | None = None


# where an event's fields lie in its tuple, for those read on the engine's thread (a wrapper's event is a
# plain tuple: no attribute names)
KIND, REQ_ID, BLOCKS, REASON, BYTES = map(KvEvent._fields.index, ("kind", "req_id", "blocks", "reason", "bytes"))


def block_event(kind: str, req_id: str, blocks: tuple[int, ...], reason: str | None,
                kv_group: int | None) -> tuple:
    """An alloc's, a free's or an evict's event, made for every block-pool call (a step with two groups and
    draft tokens makes hundreds): KvEvent's fields in order, as a plain tuple. A step's events wait a step
    for the sink's builder, through the next scheduling's collections: a plain tuple of strings, integers
    and a tuple of integers leaves the cyclic GC's care at its first, where a KvEvent (a tuple's subclass)
    would be promoted to the oldest generation, bringing on full collections of the server's heap."""
    return (kind, req_id, blocks, 0, reason, 0, 0, None, None, kv_group, None, None, None, 0, None)


def copy_event(kind: str, req_id: str, blocks: list[int], num_tokens: int, reason: str | None, tier: str,
               num_bytes: int) -> tuple:
    """A tier copy's event (an offload, a load), made for every block-size tokens a request stores: a plain
    tuple, as block_event's."""
    return (kind, req_id, tuple(blocks), num_tokens, reason, 0, 0, None, None, None, None, tier, None, num_bytes,
            None)


class StepRow(NamedTuple):
    """A steps row as its scheduling leaves it; its end and device time come with its output."""

    step: int
    start_s: float
    schedule_end_s: float               # when schedule() returned: the device time runs from here
    running: int
    waiting: int
    prefill_tokens: int
    decode_tokens: int
    recompute_tokens: int
    preemptions: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    kv_tokens: int
    admission_stop: str
    draft_tokens: int                   # speculative decoding: draft positions scheduled (of decode_tokens)


class AcceptedDrafts:
    """What a speculative step's output accepted, as the engine's thread keeps it for the sink's builder:
    each request's sampled tokens counted before vLLM's update cuts a stopped request's short
    (`req_ids` and `num_sampled`, in the output's order: copies, as vLLM reuses its lists; tuples, which
    a collection walks once and then leaves alone: accounting.py's `Attribution`) and the requests that
    had already finished (`gone`: async, scheduled again while their last tokens were in flight, their
    output stale). The counts are the builder's (`counts`, once per step)."""

    __slots__ = ("req_ids", "num_sampled", "gone", "accepted")

    def __init__(self, req_ids: tuple[str, ...], num_sampled: tuple[int, ...], gone: frozenset[str]) -> None:
        self.req_ids, self.num_sampled, self.gone = req_ids, num_sampled, gone
        self.accepted: list[int | None] | None = None

    def counts(self, spec: list[str]) -> list[int | None]:
        """Of each request's drafts (`spec`: the step's requests with drafts, in its order), how many its
        output accepted: its sampled tokens less the one sampled after them, as vLLM counts them before
        it rolls back the rest; None for a request without tokens in the output (a prefill chunk) or gone."""
        if self.accepted is None:
            sampled = dict(zip(self.req_ids, self.num_sampled))
            counts = list(map(sub, map(sampled.get, spec, repeat(0)), repeat(1)))
            if -1 in counts or self.gone:
                counts = [n if n >= 0 and rid not in self.gone else None for rid, n in zip(spec, counts)]
            self.accepted = counts
        return self.accepted

    def total(self) -> int:
        """The step's accepted drafts (after `counts`)."""
        return sum(filter(None, self.accepted))


@dataclass(slots=True)
class ScheduledStep:
    """A step scheduled and waiting for its output (async: the next step is scheduled first): what its
    scheduling did belongs to it, however late its output is processed."""

    row: StepRow
    events: list[KvEvent]
    finishing: list                     # (Request, RequestState) of the requests freed
    output: Any                         # its SchedulerOutput, held so that its id is not reused while it waits
    num_drafts: list[int] | None = None  # speculative decoding: each request's drafts, in its scheduled_spec_decode_tokens
    attribution: Any = None             # its running loop's allocs, not yet given their requests (accounting.py)

    def resolve(self) -> None:
        """Its running loop's allocs given their requests now (accounting.py's Attribution)."""
        if self.attribution is not None:
            self.attribution.resolve(self.events)
            self.attribution = None
