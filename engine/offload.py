"""A host KV tier: blocks' KV kept in host memory after the device pool lets them go, so that a prefix
the device no longer holds is copied back instead of computed again (the words: docs/glossary.md).

It keeps the books of vLLM's native CPU offloading (v1/kv_offload/cpu/manager.py, CPUOffloadingManager,
with its LRU policy, cpu/policies/lru.py, of vLLM 0.31 to 0.34), one device block a chunk (vLLM's
default blocks_per_chunk), a chunk keyed by the prefix cache's hash of its block. A chunk is

    pending   stored, its copy not finished (ref_count -1): a lookup defers, nothing evicts it
    ready     its copy finished (ref_count 0): a lookup hits it, prepare_store may evict it
    pinned    being loaded into the device (ref_count > 0, one per load): not evicted

Recency is a rank, the lowest evicted first. vLLM 0.33 on (`ranks_by_request`): a request draws one
rank the first time it stores or touches a chunk, and every chunk it stores or touches takes (its rank,
-position): a request's chunks are evicted tail first, and a chunk keeps the highest rank any request
gave it. vLLM 0.31 and 0.32: a chunk takes a fresh rank when stored, in the order offered (its head
first, so evicted head first), and touching it changes nothing. Either way, when the request finishes,
its chunks take fresh ranks, tail first, so its prefix's head is the last of them evicted. A lookup
changes no rank.

Under 0.31's and 0.32's ranks every rank given is the newest, so the ranks' order is the order they were
given: the chunks dict keeps it (a chunk re-ranked moves to its end, as in vLLM's OrderedDict) and
eviction walks it from the front; no rank is written down. Under 0.33's a chunk can rank below chunks
ranked before it: each chunk's recency is kept, and a lazy heap keeps their order.

Which chunks exist and in which state is the scheduler's business (engine/scheduler.py); the copies
are the executor's. This file decides only what is kept and what is dropped.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import islice, repeat
from typing import NamedTuple

PENDING_STORE = -1   # a chunk's ref_count while its store is in flight


def recency(rank: int, position: int = 0) -> int:
    """A chunk's place in the eviction order as one int, the lowest evicted first: by rank, and within a
    rank the furthest position first ((rank, -position) compared; a position is below 2**32)."""
    return (rank << 32) - position


class Lookup(Enum):
    MISS = auto()      # not in the tier
    PENDING = auto()   # being stored: the caller waits (defers) rather than recomputes
    HIT = auto()       # ready to load


class StorePlan(NamedTuple):
    """What prepare_store decided: the offered keys the tier did not hold, now pending, each given a
    host slot (a tier without host slots: none); and the ready chunks evicted to make room for them,
    least recent first."""

    keys: list[int]
    slots: list[int]
    evicted: list[int]


@dataclass(slots=True, eq=False)
class TierCopy:
    """A copy between the device pool and the tier that the scheduler decided: a store of a sequence's
    freshly computed blocks (after the step's forward), or a load of the chunks it waits for (before).
    In flight until it finishes (the executor's copy, or the simulator's link time); its event (offload
    or load) is filed in the step it finishes in."""

    seq: object                 # the Sequence whose blocks move
    is_load: bool               # tier -> device; else device -> tier
    keys: list[int]             # the chunks' keys
    device_blocks: list[int]    # device block ids, one per key
    slots: list[int]            # host slots, one per key (none in the simulator: it copies nothing)
    event: object               # its KVEvent (offload or load), bytes and duration filled when it finishes
    done_s: float | None = None  # clock time it finishes (set when issued)
    flushed: bool = False       # finish with this step whatever its time (its sequence was preempted)
    before_forward: bool = False  # a finished sequence's store, from blocks freed: copied before anything writes them


@dataclass(slots=True)
class _Access:
    """The chunks one request has stored or touched (vLLM's _RequestCacheAccess): its rank, drawn the
    first time it needs one, and each key's position in its prefix."""

    rank: int | None = None
    positions: dict[int, int] = field(default_factory=dict)
    # whether each key was noted at a position past all noted before (as for most requests: its tail
    # first is then the noted order reversed), and the position past the furthest noted
    head_first: bool = True
    end: int = 0


class OffloadTier:
    """A host KV tier of `num_blocks` chunks of one device block each, evicting the least recent."""

    name = "cpu"      # kv_events.tier, meta.json's kv_tiers
    policy = "lru"

    def __init__(self, num_blocks: int, ranks_by_request: bool = True, host_slots: bool = True) -> None:
        self.num_blocks = num_blocks
        self.ranks_by_request = ranks_by_request      # vLLM 0.33's ranks; else 0.31's and 0.32's
        # whether chunks take places in a host buffer (the real engine copies into them); the simulator's
        # tier copies nothing, and which place a chunk takes decides nothing
        self.host_slots = host_slots
        # the chunks it holds: key (a block hash) -> its ref_count (PENDING_STORE, 0 ready, > 0 pinned by
        # that many loads); under 0.31's and 0.32's ranks in their order, the least recent first
        self.chunks: dict[int, int] = {}
        self.slots: dict[int, int] = {}                # key -> its place in the host buffer (host_slots)
        self.ranks: dict[int, int] = {}                # 0.33's ranks: key -> its recency, the lowest evicted first
        self.num_allocated = 0                         # slots handed out at least once: 0..num_allocated-1
        self.free_slots: list[int] = []                # slots given back, reused last given back first
        self.num_ready = 0                             # chunks with ref_count 0 (evictable)
        self.accesses: dict[object, _Access] = {}      # by request
        self._next_rank = 0
        # 0.33's ranks: (recency, key) of the ready chunks, least recent first: an entry whose chunk has since
        # left, been pinned or re-ranked is stale and skipped when popped (vLLM's lazy heap)
        self._evictable: list[tuple[int, int]] = []

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.chunks)

    @property
    def num_used_blocks(self) -> int:
        return len(self.chunks)

    # ---- the manager's calls ------------------------------------------------------------
    def lookup(self, key: int) -> Lookup:
        """Whether the tier holds the chunk, and whether it is ready; no rank changes."""
        ref_count = self.chunks.get(key)
        if ref_count is None:
            return Lookup.MISS
        return Lookup.PENDING if ref_count == PENDING_STORE else Lookup.HIT

    def prepare_store(self, request: object, keys: list[int], first_position: int) -> StorePlan | None:
        """Offer a request's chunks `keys` (at positions first_position, first_position + 1, ...): those
        the tier lacks become pending, room made by evicting ready chunks, least recent first, none of
        the offered ones. All or nothing: None (nothing stored, nothing evicted) when the ready chunks
        that could go are too few; the caller offers them again later."""
        chunks = self.chunks
        # vLLM records the access before it knows whether the store fits: a refused offer still ranks
        # the ready chunks it named (a pending one it leaves alone)
        if chunks.keys().isdisjoint(keys):   # the tier holds none of them (most offers): none to protect
            new = list(keys)
            self._touch(request, keys, first_position)
            protected: frozenset[int] | set[int] = frozenset()
        else:
            new = [key for key in keys if key not in chunks]
            self._touch(request, keys, first_position, skip_pending=True)
            if not new:
                return StorePlan([], [], [])
            protected = set(keys)
        num_to_evict = len(new) - self.num_free_blocks
        evicted: list[int] = []
        if num_to_evict > 0:
            if num_to_evict > self.num_ready:
                return None
            evicted = self._evict(num_to_evict, protected)
            if evicted is None:
                return None
        chunks.update(zip(new, repeat(PENDING_STORE)))   # (0.31's and 0.32's ranks: the newest, in the order offered)
        slots = []
        if self.host_slots:
            slots = self._allocate_slots(len(new))
            self.slots.update(zip(new, slots))
        if self.ranks_by_request:
            access = self.accesses[request]
            rank = self._rank_of(access)
            self.ranks.update([(key, recency(rank, access.positions[key])) for key in new])
        return StorePlan(new, slots, evicted)

    def complete_store(self, keys: list[int], success: bool = True) -> None:
        """A store's copy finished: its chunks become ready; failed, they leave the tier."""
        chunks = self.chunks
        if success:   # (every key pending: a store's chunks are pending from prepare_store until now)
            chunks.update(zip(keys, repeat(0)))   # (a value changed: the dict's order stays)
            self.num_ready += len(keys)
            if self.ranks_by_request:
                for key in keys:
                    heapq.heappush(self._evictable, (self.ranks[key], key))
            return
        for key in keys:
            if chunks.get(key) == PENDING_STORE:
                del chunks[key]
                if self.ranks_by_request:
                    del self.ranks[key]
                if self.host_slots:
                    self.free_slots.append(self.slots.pop(key))

    def prepare_load(self, request: object, keys: list[int], first_position: int) -> list[int]:
        """Pin ready chunks for a load into the device; returns their slots (host_slots; else none)."""
        chunks = self.chunks
        for key in keys:
            ref_count = chunks[key]
            assert ref_count >= 0, f"chunk {key} loaded before its store finished"
            if ref_count == 0:
                self.num_ready -= 1
            chunks[key] = ref_count + 1
        self._touch(request, keys, first_position)
        return [self.slots[key] for key in keys] if self.host_slots else []

    def complete_load(self, keys: list[int]) -> None:
        """A load's copy finished: its pins come off."""
        chunks = self.chunks
        for key in keys:
            ref_count = chunks[key] - 1
            assert ref_count >= 0, f"chunk {key} unpinned twice"
            chunks[key] = ref_count
            if ref_count == 0:
                self.num_ready += 1
                if self.ranks_by_request:
                    heapq.heappush(self._evictable, (self.ranks[key], key))

    def on_request_finished(self, request: object) -> None:
        """The request is done: every chunk it stored or touched that the tier still holds takes a fresh
        rank, its prefix's tail first (the head the most recent)."""
        access = self.accesses.pop(request, None)
        if access is None:
            return
        positions = access.positions
        if access.head_first:   # (as most requests are: no sort by position)
            tail_first = reversed(positions)
        else:
            tail_first = sorted(positions, key=positions.__getitem__, reverse=True)
        if self.ranks_by_request:
            for key in tail_first:
                if key in self.chunks:
                    self._next_rank += 1
                    self._rerank(key, recency(self._next_rank))
            return
        chunks = self.chunks   # every rank the newest: the chunks it holds to the dict's end, in this order
        held = [key for key in tail_first if key in chunks]
        chunks.update(zip(held, map(chunks.pop, held)))   # (each popped, then put back at the end, in turn)

    # ---- inside -------------------------------------------------------------------------
    def _touch(self, request: object, keys: list[int], first_position: int, skip_pending: bool = False) -> None:
        """Note the request's keys at their positions (but the pending chunks' if `skip_pending`); a chunk
        it touches for the first time that the tier holds is raised to (its rank, -position) if that is
        more recent (vLLM 0.33: on_request_access)."""
        access = self.accesses.get(request)
        if access is None:
            access = self.accesses[request] = _Access()
        positions, chunks = access.positions, self.chunks
        if not skip_pending and positions.keys().isdisjoint(keys):   # all seen for the first time (most calls)
            first_seen = zip(keys, range(first_position, first_position + len(keys)))
            if first_position < access.end:   # behind a position noted before: not head first
                access.head_first = False
            elif keys:
                access.end = first_position + len(keys)
            if not self.ranks_by_request:   # (a touch ranks nothing)
                positions.update(first_seen)
                return
            first_seen = list(first_seen)
        else:
            first_seen = [(key, position) for position, key in enumerate(keys, first_position)
                          if key not in positions and not (skip_pending and chunks.get(key) == PENDING_STORE)]
            if first_seen and first_seen[0][1] < access.end:
                access.head_first = False
            elif first_seen:
                access.end = first_seen[-1][1] + 1
        positions.update(first_seen)
        if not first_seen or not self.ranks_by_request:
            return
        rank = self._rank_of(access)
        for key, position in first_seen:
            mine = recency(rank, position)
            if key in self.ranks and self.ranks[key] < mine:
                self._rerank(key, mine)

    def _rerank(self, key: int, rank: int) -> None:
        """0.33's ranks: the chunk's new recency, on the heap if it is ready."""
        self.ranks[key] = rank
        if self.chunks[key] == 0:
            heapq.heappush(self._evictable, (rank, key))

    def _evict(self, n: int, protected: set[int]) -> list[int] | None:
        """Drop the n least recent ready chunks but the protected ones; None (nothing dropped) if fewer
        are there."""
        if not self.ranks_by_request:
            return self._evict_in_order(n, protected)
        heap, chunks, ranks = self._evictable, self.chunks, self.ranks
        pop = heapq.heappop
        chosen: list[tuple[int, int]] = []
        chosen_keys: set[int] = set()   # (a chunk may have two current entries: pinned, then ready again)
        kept: list[tuple[int, int]] = []
        while heap and len(chosen) < n:
            rank, key = entry = pop(heap)
            if chunks.get(key) != 0 or ranks[key] != rank or key in chosen_keys:
                continue   # stale
            if key in protected:
                kept.append(entry)
            else:
                chosen.append(entry)
                chosen_keys.add(key)
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            for entry in chosen:
                heapq.heappush(heap, entry)
            return None
        evicted = [key for _, key in chosen]
        self._drop(evicted)
        if len(heap) > 2 * max(64, self.num_ready):   # too many stale entries: rebuild
            self._evictable = [(ranks[k], k) for k, ref_count in chunks.items() if ref_count == 0]
            heapq.heapify(self._evictable)
        return evicted

    def _evict_in_order(self, n: int, protected: set[int]) -> list[int] | None:
        """_evict under 0.31's and 0.32's ranks: the first n ready chunks of the chunks dict, the protected
        ones passed over (vLLM's LRUCachePolicy.evict)."""
        chunks = self.chunks
        first = list(islice(chunks, n))
        # the first n, when all are ready and none protected (most calls)
        if len(first) == n and not any(map(chunks.__getitem__, first)) and protected.isdisjoint(first):
            self._drop(first)
            return first
        evicted = []
        num_left = n
        for key, ref_count in chunks.items():
            if not ref_count and key not in protected:
                evicted.append(key)
                num_left -= 1
                if not num_left:
                    break
        else:
            return None
        self._drop(evicted)
        return evicted

    def _drop(self, keys: list[int]) -> None:
        """Evicted: the ready chunks leave, their slots given back in this order."""
        deque(map(self.chunks.__delitem__, keys), maxlen=0)
        if self.ranks_by_request:
            deque(map(self.ranks.__delitem__, keys), maxlen=0)
        if self.host_slots:
            self.free_slots.extend(map(self.slots.pop, keys))
        self.num_ready -= len(keys)

    def _rank_of(self, access: _Access) -> int:
        if access.rank is None:
            self._next_rank += 1
            access.rank = self._next_rank
        return access.rank

    def _allocate_slots(self, n: int) -> list[int]:
        """Never-used slots first, then those given back, the last given back first (vLLM's chunk pool)."""
        num_fresh = min(n, self.num_blocks - self.num_allocated)
        slots = list(range(self.num_allocated, self.num_allocated + num_fresh))
        self.num_allocated += num_fresh
        slots += [self.free_slots.pop() for _ in range(n - num_fresh)]
        return slots

    # ---- integrity ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the books balance: every slot free xor held by one chunk, the ready count right."""
        assert len(self.chunks) <= self.num_blocks, "more chunks than the tier holds"
        held = list(self.slots.values())
        if self.host_slots:
            assert set(self.slots) == set(self.chunks), "a chunk without a slot, or a slot without a chunk"
        else:
            assert not held and not self.free_slots and not self.num_allocated, "host slots in a tier without them"
        assert len(set(held)) == len(held), "a host slot held by two chunks"
        assert not set(held) & set(self.free_slots), "a host slot both free and held"
        assert len(set(self.free_slots)) == len(self.free_slots), "a host slot twice on the free list"
        assert len(held) + len(self.free_slots) == self.num_allocated <= self.num_blocks, "host slots lost"
        if self.ranks_by_request:
            assert set(self.ranks) == set(self.chunks), "a chunk without a rank, or a rank without a chunk"
        assert self.num_ready == sum(1 for c in self.chunks.values() if c == 0), "ready count wrong"
        assert all(c >= PENDING_STORE for c in self.chunks.values()), "a chunk unpinned below zero"
        if not self.ranks_by_request:
            return
        current = {(rank, key) for rank, key in self._evictable
                   if self.chunks.get(key) == 0 and self.ranks[key] == rank}
        assert current == {(self.ranks[k], k) for k, c in self.chunks.items() if c == 0}, \
            "a ready chunk missing from the eviction heap"
