"""The capture's rows written into the sink's columns (sink.py's COLUMNS and ARRIVALS), on the sink's
builder thread: the recorder hands a step's rows over as what vLLM made (its outputs, the KV events,
the step's row) and `build` writes them (the engine's thread takes no part in it, sink.py).

Once per step, not once per event or token: a step's KV events (rows.py's KvEvent) become the
kv_events columns field by field, and a step's outputs the tokens columns in a few C-level passes
(no Python per request but two list comprehensions; a speculative step's tokens a row per request). The columns a vLLM capture fills with
one value (a request's sample and n, an event's bytes and duration, swaps) are filled here.
Times are raw monotonic seconds (the importer rebases them).
"""
from __future__ import annotations

import hashlib
import time
from itertools import chain, compress, repeat
from operator import add, attrgetter
from typing import TYPE_CHECKING

from kvtrace.vllm.capture.chunk_format import Lists
from kvtrace.vllm.capture.rows import (
    BYTES,
    KIND,
    AcceptedDrafts,
    KvEvent,
    RequestState,
    StepRow,
)
from kvtrace.vllm.capture.sink import Sink

if TYPE_CHECKING:
    from kvtrace.vllm.capture.accounting import Attribution


_request_id, _new_token_ids = attrgetter("request_id"), attrgetter("new_token_ids")


def salted(salt: bytes, block_hashes) -> list[int]:
    """vLLM's block hashes as 63-bit integers keyed by this capture's salt."""
    return [int.from_bytes(hashlib.blake2b(bytes(h), key=salt, digest_size=8).digest(), "big") >> 1
            for h in block_hashes]


class Columns:
    """Writes rows into the sink's columns; numbers the events and each request's tokens. Every method but
    `request_row` runs on the sink's builder thread, through `build`."""

    def __init__(self, sink: Sink, *, token_ids: bool, salt: bytes, wall_minus_monotonic: float,
                 total_blocks: int, tiered: bool = False) -> None:
        """`tiered`: a KV connector is configured (a tier behind the pool): the tier columns (schema 6) are
        filled, else null."""
        self.sink = sink
        self.tiered = tiered
        self.token_ids = token_ids
        self.salt = salt
        self.wall_minus_monotonic = wall_minus_monotonic
        self.total_blocks = total_blocks
        self.emitted: dict[str, int] = {}                  # tokens delivered per request so far (tokens.idx)
        self.first_token: dict[str, float] = {}            # when each request's first token was delivered
        self.seq = 0                                       # the next event's number

    @staticmethod
    def build(rows: list[tuple]) -> None:
        """What the recorder handed over for a step (sink.py's `add`): (method of these, its arguments...) each."""
        for method, *args in rows:
            method(*args)

    def arrival(self, request_id: str, arrival_s: float, prompt_tokens: int, max_tokens: int, priority: int,
                block_hashes: list) -> None:
        """A request the scheduler has just taken (as it was then: `arrival_row`): its arrival row (the
        capture's own table), so that a window of live traffic knows every request in flight, finished or not."""
        a = self.sink.columns["arrivals"]
        for name, value in (("req_id", request_id), ("arrival_s", arrival_s),
                            ("prompt_tokens", prompt_tokens), ("max_tokens", max_tokens), ("priority", priority),
                            ("block_hashes", tuple(salted(self.salt, block_hashes)))):
            a[name].append(value)

    def arrival_row(self, request) -> tuple:
        """`arrival`'s call for a request the scheduler has just taken, its fields as they are now (its block
        hashes grow as it generates)."""
        arrival = request.arrival_time - self.wall_minus_monotonic if request.arrival_time else time.monotonic()
        return (self.arrival, request.request_id, arrival, request.num_prompt_tokens, request.max_tokens,
                request.priority, list(getattr(request, "block_hashes", ()) or ()))

    def tokens(self, outs: list, step: int, now: float) -> None:
        """The tokens rows of one step's outputs (vLLM's EngineCoreOutput, one per request), and the time of
        the first token of a request whose first is among them. A row
        stands for `num_tokens` of a request's tokens from `idx` on: one in a decode step, and a
        speculative step's several in one row unless their ids are kept (the reader expands the row,
        importer.read_chunk), so that a step costs a pass over its requests, not its tokens. (Read here,
        on the builder's thread: reading a thousand outputs' ids and counts on the engine's thread, so
        as to let their token lists go sooner, cost it 0.35 ms a step at 1,024 running, more than the
        collector's time those lists cost.)"""
        t = self.sink.columns["tokens"]
        emitted = self.emitted
        req_ids = list(map(_request_id, outs))
        new_token_ids = list(map(_new_token_ids, outs)) if self.token_ids else None   # (kept: their ids)
        starts = list(map(emitted.get, req_ids, repeat(0)))   # the index of each one's first token here
        lens = list(map(len, new_token_ids if self.token_ids else map(_new_token_ids, outs)))
        m = len(req_ids)
        if lens.count(1) == m:   # a decode step, one token each: a row per request
            ends = map(add, starts, repeat(1))
            t["req_id"].extend(req_ids)
            t["idx"].extend(starts)
            t["num_tokens"].extend(repeat(1, m))
            t["token_id"].extend(chain.from_iterable(new_token_ids) if self.token_ids else repeat(None, m))
        elif not self.token_ids:   # several tokens an output (speculative decoding), or none (a prefill chunk):
            ends = map(add, starts, lens)   # a row per request with any, for its run of tokens
            if 0 in lens:
                t["req_id"].extend(compress(req_ids, lens))
                t["idx"].extend(compress(starts, lens))
                counts = list(filter(None, lens))
                m = len(counts)
            else:   # (a speculative step of decoding requests only: every one has tokens)
                t["req_id"].extend(req_ids)
                t["idx"].extend(starts)
                counts = lens
            t["num_tokens"].extend(counts)
            t["token_id"].extend(repeat(None, m))
        else:   # a token's id a row
            ends = list(map(add, starts, lens))
            m = sum(lens)
            t["req_id"].extend(chain.from_iterable(map(repeat, req_ids, lens)))   # a request's id once a token
            t["idx"].extend(chain.from_iterable(map(range, starts, ends)))
            t["num_tokens"].extend(repeat(1, m))
            t["token_id"].extend(chain.from_iterable(new_token_ids))
        emitted.update(zip(req_ids, ends))   # in bulk: no Python per request but the lists above
        if 0 in starts:
            for rid, start, k in zip(req_ids, starts, lens):
                if k and not start:
                    self.first_token.setdefault(rid, now)
        t["sample"].extend(repeat(0, m))
        t["step"].extend(repeat(step, m))
        t["ts_s"].extend(repeat(now, m))

    def step(self, row: StepRow, end: float, device_ms: float | None, accepted: int | AcceptedDrafts | None,
             events: list[KvEvent]) -> None:
        """A steps row: `end` when its output was processed (its scheduling's end if it never was);
        `accepted`: of its draft tokens, those its output accepted (its AcceptedDrafts, counted by its
        spec_decode rows; None: never processed); `events`: the KV events filed with it (a tier's copies
        that finished in it: its bytes each way)."""
        if isinstance(accepted, AcceptedDrafts):
            accepted = accepted.total()
        s = self.sink.columns["steps"]
        if self.tiered:
            moved = {"offload": 0, "load": 0}
            for e in events:   # (by index: the wraps' events are plain tuples, rows.py; None: a running loop's)
                if e is not None and e[BYTES] and e[KIND] in moved:
                    moved[e[KIND]] += e[BYTES]
            s["offload_bytes"].append(moved["offload"])
            s["load_bytes"].append(moved["load"])
        else:
            s["offload_bytes"].append(None)
            s["load_bytes"].append(None)
        s["tier_transfer_ms"].append(None)   # the connector does not say how long a copy took
        for name, value in (("step", row.step), ("start_s", row.start_s), ("end_s", end),
                            ("device_ms", device_ms), ("running", row.running),
                            ("waiting", row.waiting), ("swapped", 0), ("prefill_tokens", row.prefill_tokens),
                            ("decode_tokens", row.decode_tokens), ("recompute_tokens", row.recompute_tokens),
                            ("preemptions", row.preemptions), ("free_blocks", row.free_blocks),
                            ("used_blocks", row.used_blocks), ("cached_blocks", row.cached_blocks),
                            ("total_blocks", self.total_blocks), ("kv_tokens", row.kv_tokens),
                            ("admission_stop", row.admission_stop), ("draft_tokens", row.draft_tokens),
                            ("accepted_tokens", accepted)):
            s[name].append(value)

    def request_row(self, request, st: RequestState, finish_reason: str, finish_s: float) -> tuple:
        """`request`'s call for a finished request (on the engine's thread: its fields and state as they are now)."""
        arrival = request.arrival_time - self.wall_minus_monotonic if request.arrival_time else None
        return (self.request, request.request_id, request.priority, arrival, request.num_prompt_tokens,
                request.max_tokens, request.num_output_tokens, st.first_scheduled, finish_s, finish_reason,
                st.preemptions, st.recomputed, st.prefix_hits, st.tier_hits)

    def request(self, rid: str, priority: int, arrival: float | None, prompt_tokens: int, max_tokens: int,
                output_tokens: int, first_scheduled: float | None, finish_s: float, finish_reason: str,
                preemptions: int, recomputed: int, prefix_hits: int, tier_hits: int) -> None:
        """A finished request's row (`request_row`); its token count and first token are forgotten."""
        q = self.sink.columns["requests"]
        for name, value in (("req_id", rid), ("sample", 0), ("n", 1), ("priority", priority),
                            ("arrival_s", arrival), ("prompt_tokens", prompt_tokens),
                            ("max_tokens", max_tokens), ("output_tokens", output_tokens),
                            ("first_scheduled_s", first_scheduled), ("first_token_s", self.first_token.pop(rid, None)),
                            ("finish_s", finish_s), ("finish_reason", finish_reason), ("preemptions", preemptions),
                            ("swaps", 0), ("recomputed_tokens", recomputed),
                            ("prefix_hit_tokens", prefix_hits),
                            # its drafts' totals are the reader's, from the spec_decode rows (importer.DraftTotals)
                            ("draft_tokens", None), ("accepted_tokens", None),
                            ("tier_hit_tokens", tier_hits if self.tiered else None)):
            q[name].append(value)
        self.emitted.pop(rid, None)

    def spec_decode(self, spec: list[str], num_drafts: list[int], drafts: AcceptedDrafts | None, step: int,
                    now: float, lookahead: int) -> None:
        """A speculative step's rows: per request with drafts scheduled (`spec`, the keys of the SchedulerOutput's
        scheduled_spec_decode_tokens) how many (`num_drafts`, in `spec`'s order, counted when it was
        scheduled), how many its output accepted (`drafts`' counts; None: the step's output was never
        processed) and the lookahead slots its allocation
        reserved."""
        d = self.sink.columns["spec_decode"]
        accepted = drafts.counts(spec) if drafts is not None else None
        m = len(num_drafts)
        if 0 in num_drafts:   # only those with drafts
            rids = list(compress(spec, num_drafts))
            if accepted is not None:
                accepted = list(compress(accepted, num_drafts))
            num_drafts = list(filter(None, num_drafts))
            m = len(num_drafts)
        else:
            rids = spec
        d["step"].extend(repeat(step, m))
        d["ts_s"].extend(repeat(now, m))
        d["req_id"].extend(rids)
        d["sample"].extend(repeat(0, m))
        d["draft_tokens"].extend(num_drafts)
        d["accepted_tokens"].extend(repeat(None, m) if accepted is None else accepted)
        d["lookahead_slots"].extend(repeat(lookahead, m))

    def kv_events(self, events: list[KvEvent], step: int, now: float, attribution: Attribution | None = None) -> None:
        """A step's events, numbered on from the last, stamped with its step and time. `attribution`: its
        running loop's, whose events are None in `events` until made here (accounting.py)."""
        k = self.sink.columns["kv_events"]
        m = len(events)
        # the events' fields as columns
        (kinds, req_ids, blocks, num_tokens, reasons, cached, recomputed, requesters,
         victim_reasons, groups, group_blocks, tiers, tier_tokens, num_bytes, tier_blocks) = (
            zip(*events) if attribution is None else attribution.columns(events))
        k["seq"].extend(range(self.seq, self.seq + m))
        self.seq += m
        k["step"].extend(repeat(step, m))
        k["ts_s"].extend(repeat(now, m))
        k["kind"].extend(kinds)
        k["req_id"].extend(req_ids)
        k["sample"].extend(repeat(0, m))
        # flat, one run a step (chunk_format.Lists): a tuple of ids an event, buffered for as long as the
        # chunk is, would be hundreds of objects a step for the cyclic GC's young collections to count
        k["blocks"].append(Lists(blocks))
        k["num_blocks"].extend([len(b) if b else n or 0 for b, n in zip(blocks, tier_blocks)])
        k["num_tokens"].extend(num_tokens)
        k["bytes"].extend(num_bytes)
        k["duration_ms"].extend(repeat(None, m))
        k["reason"].extend(reasons)
        k["num_cached_tokens"].extend(cached)
        k["num_recomputed_tokens"].extend(recomputed)
        k["src_blocks"].extend(repeat(None, m))
        if "preempt" in kinds:   # only a preemption has a cause
            k["requester_req_id"].extend(requesters)
            k["requester_sample"].extend([0 if r else None for r in requesters])
            k["victim_reason"].extend(victim_reasons)
        else:
            k["requester_req_id"].extend(repeat(None, m))
            k["requester_sample"].extend(repeat(None, m))
            k["victim_reason"].extend(repeat(None, m))
        k["kv_group"].extend(groups)
        k["kv_group_blocks"].extend(group_blocks)
        k["tier"].extend(tiers)
        k["tier_tokens"].extend(tier_tokens)
