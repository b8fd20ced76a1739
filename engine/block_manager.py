"""Physical KV blocks: free list, reference counts, prefix cache, copy-on-write, host swap space,
and the tables of a model of several KV-cache groups (sliding windows beside full attention).

Capacity checks come in pairs with their action (`can_allocate`/`allocate`, `can_grow`/`grow`,
`can_swap_out`/`swap_out`, `can_swap_in`/`swap_in`).
Every change is appended to `events` as a KVEvent; the engine takes them once per step. The words
(null block, prefix hit, swap group, watermark) are docs/glossary.md's.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from operator import attrgetter

from engine import events as ev
from engine.events import AllocReason, FreeReason, KVEvent
from engine.sequence import Sequence

_computed = attrgetter("num_computed_tokens")


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None            # set once the block is full and cached
        self.token_ids: tuple[int, ...] | None = None


class FreeQueue:
    """The free queue's two parts (BlockManager) seen as one queue, front first: its length, its
    blocks in reuse order, membership."""

    __slots__ = ("uncached", "cached")

    def __init__(self, bm: BlockManager) -> None:
        self.uncached, self.cached = bm.free_uncached, bm.free_cached

    def __len__(self) -> int:
        return len(self.uncached) + len(self.cached)

    def __iter__(self):
        yield from reversed(self.uncached)
        yield from self.cached

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.cached or block_id in self.uncached


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block: its tokens chained onto its predecessor's hash."""
    return hash((prev_hash, token_ids))


class BlockManager:
    """The device pool as vLLM V1's block pool keeps it (vLLM 0.32.0, v1/core/block_pool.py).

    Block 0 is V1's null block, never handed out: `num_blocks` blocks, ids 1..num_blocks, are usable.
    Free blocks wait in one queue in reuse order: a freed block that holds no cached prefix goes to
    the front (reused first, most recently freed first), a freed cached block to the back (the LRU
    order of eviction). Taking a cached block off the front evicts it from the prefix cache.

    The queue is kept in its two parts. Every uncached free block is ahead of every cached one: only
    an uncached block is put at the front, and a cached block keeps its hash while it waits (it loses
    it when taken). So `free_uncached` is a stack whose end is the queue's front (a step's blocks are
    taken and given back by slices), and `free_cached` holds the rest in LRU order (a prefix hit takes
    one out of the middle). `free_queue` is the whole queue, front first.
    """

    hybrid = False   # several KV-cache groups, or a window: HybridBlockManager

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int,
                 enable_prefix_caching: bool, watermark_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.blocks = list(map(Block, range(num_blocks + 1)))             # [0] is the null block
        self.free_uncached: list[int] = list(range(num_blocks, 0, -1))   # the front: its end (block 1 first)
        self.free_cached: OrderedDict[int, None] = OrderedDict()         # free blocks holding a cached prefix
        # cached full blocks by hash: the block a lookup finds, and later blocks with the same hash
        # (two sequences that computed the same block both keep it cached, as V1 does)
        self.hash_to_block_id: dict[int, int] = {}
        self.duplicates: dict[int, list[int]] = {}
        self.free_cpu_block_ids: deque[int] = deque(range(num_cpu_blocks))
        self.host_refs: dict[int, int] = {}     # host block id -> holders, while more than one
        self.shared_fill: dict[int, int] = {}   # block id -> KV positions in it, while ref_count > 1
        self.events: list[KVEvent] = []
        self.evicted: list[int] = []   # blocks evicted since the last alloc event, which takes them
        self.windows: tuple[int | None, ...] = (None,)   # one KV-cache group of full attention (HybridBlockManager)
        # an EAGLE, EAGLE-3 or MTP drafter (vLLM's use_eagle), whose KV at a block's last position depends
        # on the token after the block. Up to vLLM 0.32 a prefix hit gives back its last block
        # (`drop_last_hit_block`); 0.33 on hash each block with the `hash_lookahead` tokens after it
        # instead, so a block is cached and found only once they are delivered (Scheduler.follow)
        self.eagle_drafter = False
        self.drop_last_hit_block = False
        self.hash_lookahead = 0

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self.free_cached)

    @property
    def free_queue(self) -> FreeQueue:
        """The free blocks in reuse order, front first: a view of the two parts."""
        return FreeQueue(self)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks a whole sequence of this many KV positions counts at admission."""
        return self.blocks_for(num_tokens)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether a sequence of this many KV positions fits an otherwise empty pool."""
        return self.blocks_to_hold(num_tokens) <= self.num_blocks

    def num_kv_positions(self, running: list[Sequence], held: int | None = None) -> int:
        """KV positions stored in device blocks, a shared position counted once. `held`: the running
        sequences' computed positions, when the caller has their sum already."""
        if held is None:
            held = sum(map(_computed, running))
        return held - sum((self.blocks[b].ref_count - 1) * fill for b, fill in self.shared_fill.items())

    def take_events(self) -> list[KVEvent]:
        assert not self.evicted, f"blocks {self.evicted} evicted without an alloc event to carry them"
        taken, self.events = self.events, []
        return taken

    def _alloc_event(self, seq: Sequence, block_ids: list[int], reason: str, group: int | None = None) -> None:
        """The alloc event of blocks just taken (for KV-cache group `group` of a hybrid model), with the
        evictions taking them made."""
        evicted = self.evicted
        if evicted:
            self.evicted = []
        self.events.append(KVEvent(ev.ALLOC, seq.req_id, seq.sample, blocks=block_ids, reason=reason,
                                   evicted=evicted or None, kv_group=group))

    # ---- single blocks ------------------------------------------------------------------
    def _allocate_blocks(self, n: int) -> list[int]:
        """Take n blocks off the front of the free queue, evicting the cached ones."""
        stack = self.free_uncached
        blocks = self.blocks
        k = n if n <= len(stack) else len(stack)
        if k:
            ids = stack[-k:]
            del stack[-k:]
            ids.reverse()
            for block_id in ids:
                blocks[block_id].ref_count = 1
        else:
            ids = []
        if k < n:
            ids += [self._evict_one() for _ in range(n - k)]
        return ids

    def _evict_one(self) -> int:
        """Take the least recently used cached free block (no uncached one is left): out of the prefix
        cache, its eviction kept for the alloc event that follows."""
        block_id, _ = self.free_cached.popitem(last=False)
        block = self.blocks[block_id]
        self._uncache(block)
        self.evicted.append(block_id)
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        h = block.hash
        block_id = block.block_id
        if not self.duplicates:   # then each cached hash is one block's: this one's
            del self.hash_to_block_id[h]
        elif self.hash_to_block_id[h] == block_id:
            later = self.duplicates.get(h)
            if later:
                self.hash_to_block_id[h] = later.pop(0)
                if not later:
                    del self.duplicates[h]
            else:
                del self.hash_to_block_id[h]
        else:
            later = self.duplicates[h]
            later.remove(block_id)
            if not later:
                del self.duplicates[h]
        block.hash = None
        block.token_ids = None

    def _release_blocks(self, block_ids) -> list[int]:
        """Drop one reference from each block, in eviction order (the first is evicted first);
        return the blocks that became free. Uncached ones go to the front of the free queue, in
        that order; cached ones to the back."""
        blocks = self.blocks
        shared = self.shared_fill
        if not shared and not self.enable_prefix_caching:
            # every block held has one reference (shared_fill indexes those with more) and none is cached:
            # each becomes free and goes to the front
            first = list(block_ids)
            for block in map(blocks.__getitem__, first):
                assert block.ref_count == 1, f"releasing free block {block.block_id}"
                block.ref_count = 0
            self.free_uncached += reversed(first)   # first[0] at the front
            return first
        first, last = [], []
        for block_id in block_ids:
            block = blocks[block_id]
            ref_count = block.ref_count - 1
            assert ref_count >= 0, f"releasing free block {block_id}"
            block.ref_count = ref_count
            if not ref_count:
                (first if block.hash is None else last).append(block_id)
            elif ref_count == 1 and shared:
                shared.pop(block_id, None)
        if first:
            self.free_uncached += reversed(first)   # first[0] at the front
        if last:
            cached = self.free_cached
            for block_id in last:
                cached[block_id] = None
            return first + last
        return first

    def _touch(self, block_ids: list[int]) -> None:
        """Add a reference to blocks found in the prefix cache."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]   # a block the cache finds holds a prefix
            block.ref_count += 1
            if block.ref_count == 2:
                self.shared_fill[block_id] = self.block_size  # cached blocks are full

    # ---- prefix cache -------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest full-block prefix of the sequence's tokens.

        At least one token is always left to compute: its logits give the next token. With an EAGLE-style
        drafter (`drop_last_hit_block`) the hit's last block is left to compute too.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        num_blocks = self.num_hashed_blocks(seq, (seq.num_tokens - 1) // self.block_size)
        # the memo may hold one block more (cached when the step computing it was scheduled)
        for i, h in enumerate(self._token_block_hashes(seq, num_blocks)[:num_blocks]):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._hashed_tokens(seq, i):
                break
            hits.append(block_id)
        if self.drop_last_hit_block and hits:   # recomputed for the drafter's hidden states (vLLM's eagle drop)
            hits.pop()
        return hits

    def num_hit_tokens(self, cached_ids: list[int]) -> int:
        """The positions a match_prefix hit serves."""
        return len(cached_ids) * self.block_size

    def token_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the sequence's first `num_blocks` full blocks of tokens (at least; the
        host KV tier's keys)."""
        return self._token_block_hashes(seq, num_blocks)

    def _token_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of the sequence's first `num_blocks` full blocks of tokens, each with the
        `hash_lookahead` tokens after it (fewer blocks where those are not there yet). Tokens are only
        appended, so each is computed once per sequence, however often a waiting sequence is matched."""
        hashes = seq.token_block_hashes
        if self.hash_lookahead:
            num_blocks = min(num_blocks, (len(seq.token_ids) - self.hash_lookahead) // self.block_size)
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, self._hashed_tokens(seq, i)))
        return hashes

    def _hashed_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        """The tokens block i of the sequence is hashed and cached by: its own, and the `hash_lookahead`
        after it."""
        bs = self.block_size
        return tuple(seq.token_ids[i * bs:(i + 1) * bs + self.hash_lookahead])

    def num_hashed_blocks(self, seq: Sequence, num_blocks: int) -> int:
        """`num_blocks`, or fewer with lookahead block hashes: a block is hashed (so cached and found)
        once the `hash_lookahead` tokens after it are delivered (vLLM's request.block_hashes, extended
        as output tokens arrive)."""
        if not self.hash_lookahead:
            return num_blocks
        num_delivered = len(seq.token_ids) - seq.num_undelivered
        return min(num_blocks, max(0, num_delivered - self.hash_lookahead) // self.block_size)

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that the sequence's first `num_tokens` positions fill in the prefix
        cache. V1 does it when it schedules them, so a sequence scheduled later in the same step can
        hit them (their KV is written in the same forward, before any attention reads it)."""
        if not self.enable_prefix_caching:
            return
        num_hashed = len(seq.block_hashes)
        num_full = self.num_hashed_blocks(seq, min(num_tokens // self.block_size, len(seq.block_table)))
        if num_hashed >= num_full:
            return
        token_hashes = self._token_block_hashes(seq, num_full)
        for i in range(num_hashed, num_full):
            self._cache_block(seq, i, token_hashes[i])

    def _cache_block(self, seq: Sequence, i: int, h: int) -> None:
        """Block i of the sequence, full and hashed `h`: its hash noted, and the block registered in
        the prefix cache unless it already holds a cached prefix (a hit)."""
        seq.block_hashes.append(h)
        block = self.blocks[seq.block_table[i]]
        if block.hash is None:
            self._index(block, h, self._hashed_tokens(seq, i))

    def _index(self, block: Block, key: int, token_ids: tuple[int, ...]) -> None:
        """Put a full block in the prefix cache under `key`: the block a lookup finds, or after the
        block already found under it (a duplicate)."""
        block.hash = key
        block.token_ids = token_ids
        if key in self.hash_to_block_id:
            self.duplicates.setdefault(key, []).append(block.block_id)
        else:
            self.hash_to_block_id[key] = block.block_id

    def uncache_from(self, seq: Sequence, num_blocks: int) -> None:
        """Take the sequence's blocks from index `num_blocks` on out of the prefix cache: they were
        cached when scheduled, and the sequence leaves the step before their KV is written."""
        for block_id in seq.block_table[num_blocks:len(seq.block_hashes)]:
            block = self.blocks[block_id]
            if block.hash is not None and block.ref_count == 1:
                self._uncache(block)
        del seq.block_hashes[num_blocks:]

    # ---- admission ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, cached_ids: list[int], watermark: bool, num_slots: int = 0) -> bool:
        """Whether the whole sequence fits the free blocks (V1 admits a request only if its whole
        prompt fits, though it allocates the first chunk only), above the watermark if `watermark`;
        and its first `num_slots` positions (its first chunk, and with speculative decoding the lookahead
        slots past it). A cached block that is free counts as taken: admission takes it off the free queue."""
        num_tokens = max(seq.num_tokens, seq.num_reserved_tokens, num_slots)
        num_evictable = sum(1 for b in cached_ids if self.blocks[b].ref_count == 0)
        num_needed = self.blocks_for(num_tokens) - len(cached_ids) + num_evictable
        return num_needed + (self.watermark_blocks if watermark else 0) <= self.num_free_blocks

    def can_load(self, seq: Sequence, cached_ids: list[int], num_tokens: int, watermark: bool,
                 num_reserved: int) -> bool:
        """Whether blocks for a load's first `num_tokens` positions (the device's hit and the tier's) fit
        the free blocks less `num_reserved` (vLLM's second check for a load, after can_allocate's
        check of the whole sequence against the free blocks alone)."""
        num_evictable = sum(1 for b in cached_ids if self.blocks[b].ref_count == 0)
        num_needed = self.blocks_for(num_tokens) - len(cached_ids) + num_evictable
        return num_needed + (self.watermark_blocks if watermark else 0) <= self.num_free_blocks - num_reserved

    def allocate(self, seq: Sequence, cached_ids: list[int], num_new_tokens: int, reason: str,
                 num_lookahead: int = 0, delay_cache: bool = False) -> None:
        """Admit: map the cached prefix, allocate blocks for this step's `num_new_tokens` and
        `num_lookahead` slots past them (speculative decoding) or the whole reservation (--kv-reserve),
        cache the full blocks this step computes of the sequence's tokens (a draft is not cached).
        `delay_cache`: the new blocks are filled by a load from the host KV tier, cached once it is done
        (vLLM's delay_cache_blocks)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        self._touch(cached_ids)
        num_cached_tokens = len(cached_ids) * self.block_size
        if cached_ids:
            self.events.append(KVEvent(ev.PREFIX_HIT, seq.req_id, seq.sample, blocks=list(cached_ids),
                                       num_tokens=num_cached_tokens, reason=reason))
        num_tokens = num_cached_tokens + num_new_tokens + num_lookahead
        if seq.num_reserved_tokens > num_tokens:
            num_tokens = seq.num_reserved_tokens
        new_ids = self._allocate_blocks(self.blocks_for(num_tokens) - len(cached_ids))
        if new_ids:
            self._alloc_event(seq, new_ids, AllocReason.PREFILL)
        seq.block_table = list(cached_ids) + new_ids
        seq.block_hashes = [self.blocks[b].hash for b in cached_ids]
        seq.num_computed_tokens = num_cached_tokens
        if not delay_cache:
            self.cache_full_blocks(seq, min(num_cached_tokens + num_new_tokens, seq.num_tokens))

    # ---- running sequences ----------------------------------------------------------------
    def _needs_cow(self, seq: Sequence) -> bool:
        """Whether the block the next position is written to is shared (n > 1 forked by copy-on-write)."""
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether free blocks can hold the sequence's next `num_new_tokens` positions."""
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if num_needed <= 0:
            return not self.shared_fill or not self._needs_cow(seq) or self.num_free_blocks >= 1
        return num_needed + (1 if self.shared_fill and self._needs_cow(seq) else 0) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> tuple[int, int] | None:
        """Give the sequence blocks for its next `num_new_tokens` positions and `num_lookahead` slots
        past them (speculative decoding) and cache the full blocks they complete; return a (src, dst)
        block copy if its next block was shared (copy-on-write)."""
        copy = None
        if self.shared_fill and self._needs_cow(seq):
            index = seq.num_computed_tokens // self.block_size
            src = seq.block_table[index]
            dst = self._allocate_blocks(1)[0]
            self._release_blocks((src,))  # still referenced by the other sharers
            seq.block_table[index] = dst
            num_tokens = seq.num_computed_tokens - index * self.block_size
            self._alloc_event(seq, [dst], AllocReason.COW)
            self.events.append(KVEvent(ev.COW, seq.req_id, seq.sample, blocks=[dst], src_blocks=[src],
                                       num_tokens=num_tokens))
            copy = (src, dst)
        num_tokens = seq.num_computed_tokens + num_new_tokens
        num_needed = -(-(num_tokens + num_lookahead) // self.block_size) - len(seq.block_table)   # blocks_for
        if num_needed > 0:
            new_ids = self._allocate_blocks(num_needed)
            seq.block_table += new_ids
            reason = AllocReason.PREFILL if seq.is_prefilling else AllocReason.DECODE
            self._alloc_event(seq, new_ids, reason)
        if self.enable_prefix_caching:   # never past the delivered tokens (V1's request.num_tokens)
            num_delivered = len(seq.token_ids) - seq.num_undelivered
            num_cacheable = num_tokens if num_tokens < num_delivered else num_delivered
            num_hashed = len(seq.block_hashes)
            # most steps complete no block: skip the call (cache_full_blocks would return at once)
            if num_hashed < num_cacheable // self.block_size and num_hashed < len(seq.block_table):
                self.cache_full_blocks(seq, num_cacheable)
        return copy

    # ---- release ------------------------------------------------------------------------
    def _release_table(self, seq: Sequence, reason: str) -> None:
        """Drop the sequence's device references, tail first (V1's order: a prefix's tail is evicted
        before its head)."""
        freed = self._release_blocks(reversed(seq.block_table))
        if freed:
            self.events.append(KVEvent(ev.FREE, seq.req_id, seq.sample, blocks=freed, reason=reason))
        seq.block_table = []
        seq.block_hashes = []

    def free(self, seq: Sequence, reason: str) -> None:
        """Release the sequence's device blocks; its KV is gone."""
        self._release_table(seq, reason)
        seq.num_computed_tokens = 0

    def free_host(self, seq: Sequence) -> None:
        """Give back the host blocks of a swapped sequence (a shared one when its last holder does)."""
        refs = self.host_refs
        for h in seq.host_block_table:
            if h in refs:
                refs[h] -= 1
                if refs[h] == 1:
                    del refs[h]
            else:
                self.free_cpu_block_ids.append(h)
        seq.host_block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (n > 1 forked by copy-on-write)."""
        for i, block_id in enumerate(parent.block_table):
            block = self.blocks[block_id]
            block.ref_count += 1
            if block.ref_count == 2:
                # a block reserved ahead (--kv-reserve) holds no position yet
                self.shared_fill[block_id] = max(0, min(self.block_size, parent.num_computed_tokens - i * self.block_size))
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    # ---- swap ---------------------------------------------------------------------------
    # A request's samples forked by copy-on-write (--n-mode cow) are swapped as one group, as vLLM V0
    # swapped a sequence group: a block they share is copied once, to one host block they share.
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len(self.free_cpu_block_ids) >= len({b for s in seqs for b in s.block_table})

    def swap_out(self, seqs: list[Sequence]) -> list[list[tuple[int, int]]]:
        """Give the sequences host blocks, a shared block one shared host block; release their device
        blocks. Returns each sequence's (device, host) copies, a shared block's with its first holder.

        The device blocks are free in the books at once; the executor performs these copies
        before anything else runs in the step, so nobody overwrites them first.
        """
        host_of: dict[int, int] = {}
        copies = []
        for seq in seqs:
            mine = []
            for b in seq.block_table:
                if b not in host_of:
                    host_of[b] = self.free_cpu_block_ids.popleft()
                    mine.append((b, host_of[b]))
                else:
                    h = host_of[b]
                    self.host_refs[h] = self.host_refs.get(h, 1) + 1
            seq.host_block_table = [host_of[b] for b in seq.block_table]
            copies.append(mine)
        for seq in seqs:
            self._release_table(seq, FreeReason.PREEMPT)  # num_computed_tokens stays: the KV lives on the host
        return copies

    def num_swap_in_blocks(self, seqs: list[Sequence], new_tokens: list[int]) -> int:
        """Device blocks that swapping the sequences in and growing them by `new_tokens` takes: their
        distinct host blocks, new blocks past them, and a copy for each write to a still-shared block."""
        holders: dict[int, int] = {}
        for seq in seqs:
            for h in seq.host_block_table:
                holders[h] = holders.get(h, 0) + 1
        num_needed = len(holders)
        for seq, num_new in zip(seqs, new_tokens):
            table = seq.host_block_table
            num_needed += max(0, self.blocks_for(seq.num_computed_tokens + num_new) - len(table))
            index = seq.num_computed_tokens // self.block_size
            if index < len(table) and holders[table[index]] > 1:  # copy-on-write, as grow will
                holders[table[index]] -= 1
                num_needed += 1
        return num_needed

    def can_swap_in(self, seqs: list[Sequence], new_tokens: list[int]) -> bool:
        """Room above the watermark for the swapped blocks and this step's new positions."""
        return self.num_free_blocks - self.num_swap_in_blocks(seqs, new_tokens) >= self.watermark_blocks

    def swap_in(self, seqs: list[Sequence]) -> list[list[tuple[int, int]]]:
        """Give the sequences device blocks for their host blocks, a shared host block one shared
        device block. Returns each sequence's (host, device) copies, a shared block's with its first holder."""
        device_of: dict[int, int] = {}
        copies = []
        bs = self.block_size
        for seq in seqs:
            mine = []
            for h in seq.host_block_table:
                if h not in device_of:
                    device_of[h] = self._allocate_blocks(1)[0]
                    mine.append((h, device_of[h]))
                else:
                    block_id = device_of[h]
                    self.blocks[block_id].ref_count += 1
            if mine:
                self._alloc_event(seq, [d for _, d in mine], AllocReason.SWAP_IN)
            seq.block_table = [device_of[h] for h in seq.host_block_table]
            seq.block_hashes = []
            copies.append(mine)
        for seq in seqs:
            for i, block_id in enumerate(seq.block_table):
                if self.blocks[block_id].ref_count > 1:
                    fill = max(0, min(bs, seq.num_computed_tokens - i * bs))
                    self.shared_fill[block_id] = max(self.shared_fill.get(block_id, 0), fill)
            self.free_host(seq)
        return copies

    def blocks_held(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        """The device blocks the sequence holds (a preempt event's), group by group, and how many each
        group has (None for a model of one group of full attention)."""
        return list(seq.block_table), None

    # ---- integrity ----------------------------------------------------------------------
    def check_integrity(self, seqs: list[Sequence]) -> None:
        """Assert the books balance: every block free xor referenced, counts match the tables."""
        refs = [0] * len(self.blocks)
        host_holders: dict[int, int] = {}
        for seq in seqs:
            assert len(seq.group_tables) == (len(self.windows) - 1 if seq.block_table else 0), \
                f"{seq}: {len(seq.group_tables) + 1} tables for {len(self.windows)} KV-cache groups"
            for table, window in zip(seq.tables(), self.windows):
                nulls = table.count(0)
                assert not nulls or (window is not None and not any(table[:nulls])), \
                    f"the null block is in use: {seq}'s table {table}, other than where a window dropped blocks"
                for b in table[nulls:]:
                    refs[b] += 1
            for h in seq.host_block_table:
                host_holders[h] = host_holders.get(h, 0) + 1
        for h, n in host_holders.items():
            assert n == self.host_refs.get(h, 1), f"host block {h} held {n} times, counted {self.host_refs.get(h, 1)}"
        assert all(h in host_holders for h in self.host_refs), "a shared host block nobody holds"
        host_used = set(host_holders)
        assert refs[0] == 0 and self.blocks[0].ref_count == 0, "the null block is in use"
        queue = list(self.free_queue)
        free = set(queue)
        assert 0 not in free, "the null block is in the free queue"
        beyond = [b for b in queue if not 0 < b <= self.num_blocks]
        assert not beyond, f"blocks {beyond} in the free queue are beyond the pool"
        assert len(free) == len(queue), "a block twice in the free queue"
        for block in self.blocks[1:]:
            b = block.block_id
            assert block.ref_count == refs[b], f"block {b}: ref_count {block.ref_count} but {refs[b]} table entries"
            is_free = b in free
            assert is_free != (block.ref_count > 0), f"block {b}: free={is_free} ref_count={block.ref_count}"
            if block.hash is not None:
                h = block.hash
                assert self.hash_to_block_id.get(h) == b or b in self.duplicates.get(h, ()), f"block {b}: hash not indexed"
        assert all(self.blocks[b].hash is None for b in self.free_uncached), "a cached block in the uncached part"
        assert all(self.blocks[b].hash is not None for b in self.free_cached), "an uncached block in the cached part"
        assert set(self.shared_fill) == {b for b, r in enumerate(refs) if r > 1}, "shared-block index out of date"
        for h, b in self.hash_to_block_id.items():
            assert self.blocks[b].hash == h, f"hash index points to block {b} with another hash"
        for h, later in self.duplicates.items():
            assert later and h in self.hash_to_block_id, "duplicate without a primary"
            for b in later:
                assert self.blocks[b].hash == h, f"duplicate index points to block {b} with another hash"
        assert len(free) + sum(1 for r in refs if r) == self.num_blocks, "blocks lost"
        host_free = set(self.free_cpu_block_ids)
        assert len(host_free) == len(self.free_cpu_block_ids), "duplicate id in the host free list"
        assert not host_free & host_used, "host block both free and used"
        assert len(host_free) + len(host_used) == self.num_cpu_blocks, "host blocks lost"


class HybridBlockManager(BlockManager):
    """The pool of a model of several KV-cache groups, or of sliding windows (`windows`: each group's
    window, None for full attention; EngineConfig.kv_cache_groups), as vLLM's hybrid coordinator keeps it
    (v1/core/kv_cache_coordinator.py, single_type_kv_cache_manager.py; without swap or forks, which
    engine/build.py refuses here). A sequence holds one table per group over the one pool, group 0's in
    `block_table`, the others' in `group_tables`. Every group is given blocks for every position, group
    by group. A windowed group's blocks wholly before the window of the next position to compute are
    freed before the sequence grows (`drop_out_of_window`, which the scheduler calls), the null block (0)
    standing where they were. A whole request's admission counts a windowed group's blocks up to vLLM's
    cap: the window less one position, the tokens of the steps in flight, one block more for a window
    that starts mid-block (SlidingWindowSpec.max_admission_blocks_per_request).

    With prefix caching, each group caches its own blocks under the block's hash and the group
    (vLLM's BlockHashWithGroupId), a block a window dropped before it was cached never; and a prefix
    hit is the longest prefix that every group can serve (`match_prefix`)."""

    hybrid = True

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int, windows: tuple[int | None, ...],
                 max_in_flight_tokens: int, max_model_len: int, enable_prefix_caching: bool = False) -> None:
        super().__init__(num_blocks, block_size, 0, enable_prefix_caching, watermark_blocks)
        self.windows = tuple(windows)
        limit = lambda n: min(n, max_model_len) if max_model_len else n   # noqa: E731
        self.admission_caps = tuple(None if w is None else self.blocks_for(limit(w - 1 + max_in_flight_tokens)) + 1
                                    for w in self.windows)
        # a windowed group's hit needs the blocks of its window's last `window - 1` positions; a window of one
        # position needs none, and vLLM caches none of its blocks (reachable_block_mask), so it never hits
        self.hit_blocks = tuple(None if w is None else self.blocks_for(w - 1) for w in self.windows)
        self.caches = tuple(n is None or n > 0 for n in self.hit_blocks)
        # the groups that hit together (vLLM's coordinator: groups of one spec), full attention first
        specs: dict[int | None, list[int]] = {}
        for group, window in enumerate(self.windows):
            specs.setdefault(window, []).append(group)
        self.spec_groups = sorted(specs.items(), key=lambda spec: spec[0] is not None)
        # one kind of window beside full attention: one pass finds the hit (vLLM's simple hybrid)
        self.one_pass = len(self.spec_groups) == 2 and self.spec_groups[0][0] is None

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks a whole request of `num_tokens` positions counts at admission, every group's: a
        windowed group's no more than its cap (vLLM: get_num_blocks_to_allocate with the admission cap)."""
        need = self.blocks_for(num_tokens)
        return sum(need if cap is None or need < cap else cap for cap in self.admission_caps)

    def num_kv_positions(self, running: list[Sequence], held: int | None = None) -> int:
        """KV positions stored, every group's (a block holds one group's), less those windows dropped, a
        shared position counted once."""
        bs = self.block_size
        held = sum(s.num_computed_tokens - table.count(0) * bs for s in running for table in s.tables())
        return held - sum((self.blocks[b].ref_count - 1) * fill for b, fill in self.shared_fill.items())

    # ---- prefix cache -------------------------------------------------------------------
    def _key(self, block_hash: int, group: int) -> int:
        """A block's key in the prefix cache: its hash and its group's (vLLM: make_block_hash_with_group_id)."""
        return hash((block_hash, group))

    def match_prefix(self, seq: Sequence) -> list[list[int]]:
        """Each group's table of the longest cached prefix that every group serves, in whole blocks, at
        least one token left to compute (vLLM's hybrid coordinator, find_longest_cache_hit). Full
        attention's hit runs from the first block to the first miss. A window's is the latest run of
        cached blocks long enough for its window (its last `window - 1` positions) that ends within the
        hit so far, the null block before it; or, with no such run, the cached blocks from the first
        on. Each kind of group cuts the hit to what it serves, until none cuts it further (one pass for
        full attention beside one kind of window)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.windows]
        bs = self.block_size
        num_blocks = (seq.num_tokens - 1) // bs
        hashes = self._token_block_hashes(seq, num_blocks)
        hits: list[list[int]] = [[] for _ in self.windows]
        full_length = None
        length = num_blocks
        while True:
            current = length
            for window, groups in self.spec_groups:
                if window is None:
                    if full_length is None:
                        full_length = self._full_hit(seq, hashes, current, groups, hits)
                    current = min(current, full_length)
                else:
                    current = self._window_hit(seq, hashes, current, groups, hits, self.hit_blocks[groups[0]])
            if current >= length or self.one_pass:
                length = min(current, length)
                break
            length = current
        return [table[:length] for table in hits]

    def _cached(self, seq: Sequence, hashes: list[int], i: int, groups: list[int]) -> list[int] | None:
        """The cached blocks holding the sequence's block i in each of `groups`, or None unless all do."""
        found = []
        tokens = None
        for group in groups:
            block_id = self.hash_to_block_id.get(self._key(hashes[i], group))
            if block_id is None:
                return None
            if tokens is None:
                tokens = self._hashed_tokens(seq, i)
            if self.blocks[block_id].token_ids != tokens:
                return None
            found.append(block_id)
        return found

    def _full_hit(self, seq: Sequence, hashes: list[int], limit: int, groups: list[int], hits: list[list[int]]) -> int:
        """Full attention's hit, in blocks: the first `limit` at most, up to the first that a group misses."""
        n = 0
        while n < limit:
            found = self._cached(seq, hashes, n, groups)
            if found is None:
                break
            for group, block_id in zip(groups, found):
                hits[group].append(block_id)
            n += 1
        return n

    def _window_hit(self, seq: Sequence, hashes: list[int], limit: int, groups: list[int], hits: list[list[int]],
                    needed: int) -> int:
        """A window's hit within the first `limit` blocks, in blocks: searched from the last, it ends with
        the first run of `needed` cached blocks found (those before it are nulls), else it is the run
        that starts at block 0 (vLLM: SlidingWindowManager.find_longest_cache_hit)."""
        tables = [[0] * limit for _ in groups]
        run = 0
        length = None
        for i in range(limit - 1, -1, -1):
            found = self._cached(seq, hashes, i, groups)
            if found is None:
                run = 0
                continue
            for table, block_id in zip(tables, found):
                table[i] = block_id
            run += 1
            if run >= needed:
                length = i + run
                break
        if length is None:
            length = run
        for group, table in zip(groups, tables):
            hits[group] = table[:length]
        return length

    def num_hit_tokens(self, cached: list[list[int]]) -> int:
        return len(cached[0]) * self.block_size if cached else 0

    def _cache_block(self, seq: Sequence, i: int, h: int) -> None:
        """Block i of the sequence, full and hashed `h`: its hash noted, and each group's block registered
        under the hash and the group, in a group that caches, unless a window has dropped it (vLLM skips
        the null block) or it already holds a cached prefix (a hit)."""
        seq.block_hashes.append(h)
        tokens = None
        for group, table in enumerate(seq.tables()):
            block = self.blocks[table[i]]
            if not table[i] or not self.caches[group] or block.hash is not None:
                continue
            if tokens is None:
                tokens = self._hashed_tokens(seq, i)
            self._index(block, self._key(h, group), tokens)

    def uncache_from(self, seq: Sequence, num_blocks: int) -> None:
        """Take the sequence's blocks from index `num_blocks` on out of the prefix cache, every group's."""
        num_hashed = len(seq.block_hashes)
        for table in seq.tables():
            for block_id in table[num_blocks:num_hashed]:
                block = self.blocks[block_id]
                if block_id and block.hash is not None and block.ref_count == 1:
                    self._uncache(block)
        del seq.block_hashes[num_blocks:]

    # ---- admission ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, cached: list[list[int]], watermark: bool, num_slots: int = 0) -> bool:
        """Whether the whole sequence fits the free blocks, a windowed group's counted up to its cap, and
        its first `num_slots` positions (its first chunk) too, beyond each group's hit. A cached block that
        is free counts as taken: admission takes it off the free queue (vLLM: get_num_blocks_to_allocate,
        with the admission cap and without)."""
        num_tokens = seq.num_tokens if seq.num_tokens > seq.num_reserved_tokens else seq.num_reserved_tokens
        num_hit = len(cached[0]) if cached else 0
        num_evictable = sum(1 for table in cached for b in table if b and not self.blocks[b].ref_count)
        need = self.blocks_for(num_tokens)
        whole = sum(max((need if cap is None or need < cap else cap) - num_hit, 0) for cap in self.admission_caps)
        first = max(self.blocks_for(num_slots) - num_hit, 0) * len(self.windows)
        free = self.num_free_blocks - (self.watermark_blocks if watermark else 0)
        return max(whole, first) + num_evictable <= free

    def allocate(self, seq: Sequence, cached: list[list[int]], num_new_tokens: int, reason: str,
                 num_lookahead: int = 0) -> None:
        """Admit: map each group's cached prefix (the null block where a window dropped it), give every
        group blocks for the first `num_new_tokens` positions past it, and cache the full blocks this
        step computes."""
        assert not seq.block_table, f"{seq} already holds blocks"
        tables = [list(table) for table in cached] if cached else [[] for _ in self.windows]
        num_hit = len(tables[0])
        num_cached_tokens = num_hit * self.block_size
        if num_hit:
            held = [[b for b in table if b] for table in tables]
            for table in held:   # vLLM touches them group by group
                self._touch(table)
            self.events.append(KVEvent(ev.PREFIX_HIT, seq.req_id, seq.sample, blocks=[b for t in held for b in t],
                                       num_tokens=num_cached_tokens, reason=reason,
                                       kv_group_blocks=[len(t) for t in held]))
        num_blocks = self.blocks_for(num_cached_tokens + num_new_tokens)
        for group, table in enumerate(tables):
            new_ids = self._allocate_blocks(num_blocks - num_hit)
            if new_ids:
                self._alloc_event(seq, new_ids, AllocReason.PREFILL, group)
            table += new_ids   # the table grows; the event's list stays as it was
        seq.block_table, seq.group_tables = tables[0], tables[1:]
        seq.block_hashes = list(seq.token_block_hashes[:num_hit])
        seq.num_computed_tokens = num_cached_tokens
        self.cache_full_blocks(seq, min(num_cached_tokens + num_new_tokens, seq.num_tokens))

    def drop_out_of_window(self, seq: Sequence, num_processed: int) -> None:
        """Free, in each windowed group, the sequence's blocks wholly before the window of position
        `num_processed` (the next to compute, less any still in flight), tail first, the null block
        taking their place (vLLM: remove_skipped_blocks, at the start of every allocate_slots)."""
        bs = self.block_size
        for group, (table, window) in enumerate(zip(seq.tables(), self.windows)):
            if window is None or num_processed < window:
                continue
            last = min((num_processed - window + 1) // bs, len(table))
            dropped = []
            for i in range(last - 1, -1, -1):
                if not table[i]:
                    break   # dropped by an earlier step, as every block before it
                dropped.append(table[i])
                table[i] = 0
            if dropped:   # the event names every block dropped, one another sequence still holds too
                self._release_blocks(dropped)
                self.events.append(KVEvent(ev.FREE, seq.req_id, seq.sample, blocks=dropped,
                                           reason=FreeReason.WINDOW, kv_group=group))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether free blocks hold every group's blocks for the sequence's next `num_new_tokens`
        positions (a dropped block still counts as a table entry)."""
        num_blocks = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return sum(num_blocks - len(table) for table in seq.tables() if len(table) < num_blocks) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> None:
        """Give every group's table blocks for the sequence's next `num_new_tokens` positions (no
        lookahead beside windows: kvtrace does not model speculative decoding there), and cache the full
        blocks they complete."""
        num_blocks = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        reason = AllocReason.PREFILL if seq.is_prefilling else AllocReason.DECODE
        for group, table in enumerate(seq.tables()):
            if len(table) < num_blocks:
                new_ids = self._allocate_blocks(num_blocks - len(table))
                table += new_ids
                self._alloc_event(seq, new_ids, reason, group)
        if self.enable_prefix_caching:   # never past the delivered tokens (V1's request.num_tokens)
            num_tokens = seq.num_computed_tokens + num_new_tokens
            num_delivered = len(seq.token_ids) - seq.num_undelivered
            self.cache_full_blocks(seq, num_tokens if num_tokens < num_delivered else num_delivered)

    def _release_table(self, seq: Sequence, reason: str) -> None:
        """Each group's blocks released tail first, group by group (vLLM's coordinator frees each
        manager's in turn), those a window dropped aside."""
        for group, table in enumerate(seq.tables()):
            freed = self._release_blocks(reversed(table[table.count(0):]))
            if freed:
                self.events.append(KVEvent(ev.FREE, seq.req_id, seq.sample, blocks=freed, reason=reason, kv_group=group))
        seq.block_table, seq.group_tables = [], []
        seq.block_hashes = []

    def blocks_held(self, seq: Sequence) -> tuple[list[int], list[int] | None]:
        tables = [table[table.count(0):] for table in seq.tables()]
        return [b for table in tables for b in table], [len(table) for table in tables]
