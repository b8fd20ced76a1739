"""Physical KV blocks: free list, reference counts, prefix cache, copy-on-write, host swap space.

Capacity checks come in pairs with their action (`can_allocate`/`allocate`,
`can_append_slot`/`append_slot`, `can_swap_out`/`swap_out`, `can_swap_in`/`swap_in`).
Every change is appended to `events` as a KVEvent; the engine takes them once per step.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from engine import events as ev
from engine.events import KVEvent
from engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None            # set once the block is full and cached
        self.token_ids: tuple[int, ...] | None = None


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block: its tokens chained onto its predecessor's hash."""
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int,
                 enable_prefix_caching: bool, watermark_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))   # free, no reusable KV
        self.cached_free_ids: OrderedDict[int, None] = OrderedDict()  # free, reusable KV, LRU first
        self.hash_to_block_id: dict[int, int] = {}
        self.free_cpu_block_ids: deque[int] = deque(range(num_cpu_blocks))
        self.shared_fill: dict[int, int] = {}   # block id -> KV positions in it, while ref_count > 1
        self.events: list[KVEvent] = []

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_free_ids)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_hold(self, seq: Sequence) -> int:
        """Blocks the sequence holds once admitted: its known tokens, or its whole reservation (--kv-reserve)."""
        num_tokens = seq.num_tokens
        return self.blocks_for(num_tokens if num_tokens > seq.num_reserved_tokens else seq.num_reserved_tokens)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether a sequence of this many KV positions fits an otherwise empty pool."""
        return self.blocks_for(num_tokens) <= self.num_blocks - self.watermark_blocks

    def num_kv_positions(self, running: list[Sequence]) -> int:
        """KV positions stored in device blocks, a shared position counted once."""
        held = sum(seq.num_computed_tokens for seq in running)
        return held - sum((self.blocks[b].ref_count - 1) * fill for b, fill in self.shared_fill.items())

    def take_events(self) -> list[KVEvent]:
        taken, self.events = self.events, []
        return taken

    # ---- single blocks ------------------------------------------------------------------
    def _allocate_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_ids.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            del self.hash_to_block_id[block.hash]
            block.hash = None
            block.token_ids = None
            self.events.append(KVEvent(ev.EVICT, "", blocks=[block_id]))
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"allocating block {block_id} with ref_count {block.ref_count}"
        block.ref_count = 1
        return block_id

    def _release_block(self, block_id: int) -> bool:
        """Drop one reference; return True when the block became free."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"releasing free block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 1:
            self.shared_fill.pop(block_id, None)
        if block.ref_count:
            return False
        if block.hash is not None:
            self.cached_free_ids[block_id] = None
        else:
            self.free_block_ids.append(block_id)
        return True

    def _take_cached(self, block_id: int) -> None:
        """Add a reference to a block found in the prefix cache."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free_ids[block_id]
        block.ref_count += 1
        if block.ref_count == 2:
            self.shared_fill[block_id] = self.block_size  # cached blocks are full

    # ---- prefix cache -------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest full-block prefix of the sequence's tokens.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._token_block_hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def _token_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of the sequence's first `num_blocks` full blocks of tokens. Tokens are only
        appended, so each is computed once per sequence, however often a waiting sequence is matched."""
        hashes = seq.token_block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        token_hashes = self._token_block_hashes(seq, num_full)
        while len(hashes) < num_full:
            i = len(hashes)
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = token_hashes[i]
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block_id:
                block.hash = h
                block.token_ids = chunk
                self.hash_to_block_id[h] = block.block_id

    # ---- admission ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, cached_ids: list[int]) -> bool:
        """Enough free blocks (above the watermark) for all of the sequence's known tokens."""
        num_new = self.blocks_to_hold(seq) - len(cached_ids)
        num_cached_free = sum(1 for b in cached_ids if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - num_cached_free - num_new >= self.watermark_blocks

    def allocate(self, seq: Sequence, cached_ids: list[int], reason: str) -> None:
        assert not seq.block_table, f"{seq} already holds blocks"
        for block_id in cached_ids:
            self._take_cached(block_id)
        num_cached_tokens = len(cached_ids) * self.block_size
        if cached_ids:
            self.events.append(KVEvent(ev.PREFIX_HIT, seq.req_id, seq.sample, blocks=list(cached_ids),
                                       num_tokens=num_cached_tokens, reason=reason))
        new_ids = [self._allocate_block() for _ in range(self.blocks_to_hold(seq) - len(cached_ids))]
        if new_ids:
            self.events.append(KVEvent(ev.ALLOC, seq.req_id, seq.sample, blocks=new_ids, reason="prefill"))
        seq.block_table = list(cached_ids) + new_ids
        seq.block_hashes = [self.blocks[b].hash for b in cached_ids]
        seq.num_computed_tokens = num_cached_tokens
        seq.num_cached_tokens = num_cached_tokens

    # ---- decode -------------------------------------------------------------------------
    def _slot_needs(self, seq: Sequence) -> tuple[bool, bool]:
        """(needs a new block, needs copy-on-write) to write KV for the next position."""
        pos = seq.num_computed_tokens
        index = pos // self.block_size
        if index == len(seq.block_table):
            return True, False
        return False, self.blocks[seq.block_table[index]].ref_count > 1

    def can_append_slot(self, seq: Sequence) -> bool:
        new_block, cow = self._slot_needs(seq)
        return not (new_block or cow) or self.num_free_blocks >= 1

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the next position writable; return a (src, dst) block copy if copy-on-write was needed."""
        new_block, cow = self._slot_needs(seq)
        if new_block:
            block_id = self._allocate_block()
            seq.block_table.append(block_id)
            self.events.append(KVEvent(ev.ALLOC, seq.req_id, seq.sample, blocks=[block_id], reason="decode"))
            return None
        if cow:
            index = seq.num_computed_tokens // self.block_size
            src = seq.block_table[index]
            dst = self._allocate_block()
            self._release_block(src)  # still referenced by the other sharers
            seq.block_table[index] = dst
            num_tokens = seq.num_computed_tokens - index * self.block_size
            self.events.append(KVEvent(ev.ALLOC, seq.req_id, seq.sample, blocks=[dst], reason="cow"))
            self.events.append(KVEvent(ev.COW, seq.req_id, seq.sample, blocks=[dst], src_blocks=[src],
                                       num_tokens=num_tokens))
            return src, dst
        return None

    # ---- release ------------------------------------------------------------------------
    def _release_table(self, seq: Sequence, reason: str) -> None:
        """Drop the sequence's device references (tail first, so prefixes stay cached longest)."""
        freed = [b for b in reversed(seq.block_table) if self._release_block(b)]
        if freed:
            self.events.append(KVEvent(ev.FREE, seq.req_id, seq.sample, blocks=freed, reason=reason))
        seq.block_table = []
        seq.block_hashes = []

    def free(self, seq: Sequence, reason: str) -> None:
        """Release the sequence's device blocks; its KV is gone."""
        self._release_table(seq, reason)
        seq.num_computed_tokens = 0

    def free_host(self, seq: Sequence) -> None:
        """Give back the host blocks of a swapped sequence."""
        self.free_cpu_block_ids.extend(seq.host_block_table)
        seq.host_block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (n > 1 sampling)."""
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
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.free_cpu_block_ids) >= len(seq.block_table)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give the sequence host blocks; release its device blocks. Returns (device, host) copies.

        The device blocks are free in the books at once; the executor performs these copies
        before anything else runs in the step, so nobody overwrites them first.
        """
        mapping = [(b, self.free_cpu_block_ids.popleft()) for b in seq.block_table]
        seq.host_block_table = [h for _, h in mapping]
        self._release_table(seq, "preempt")  # num_computed_tokens stays: the KV lives on the host
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        # the swapped positions, plus a block for the pending token if the last one is full
        num_needed = max(len(seq.host_block_table), self.blocks_for(seq.num_computed_tokens + 1))
        return self.num_free_blocks - num_needed >= self.watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give the sequence new device blocks for its host blocks. Returns (host, device) copies."""
        new_ids = [self._allocate_block() for _ in seq.host_block_table]
        self.events.append(KVEvent(ev.ALLOC, seq.req_id, seq.sample, blocks=list(new_ids), reason="swap_in"))
        mapping = list(zip(seq.host_block_table, new_ids))
        self.free_host(seq)
        seq.block_table = new_ids
        seq.block_hashes = []
        return mapping

    # ---- integrity ----------------------------------------------------------------------
    def check_integrity(self, seqs: list[Sequence]) -> None:
        """Assert the books balance: every block free xor referenced, counts match the tables."""
        refs = [0] * self.num_blocks
        host_used: set[int] = set()
        for seq in seqs:
            for b in seq.block_table:
                refs[b] += 1
            for h in seq.host_block_table:
                assert h not in host_used, f"host block {h} held twice"
                host_used.add(h)
        free = set(self.free_block_ids)
        cached = set(self.cached_free_ids)
        assert len(free) == len(self.free_block_ids), "duplicate id in the free list"
        assert not free & cached, f"blocks both free and cached-free: {free & cached}"
        for block in self.blocks:
            b = block.block_id
            assert block.ref_count == refs[b], f"block {b}: ref_count {block.ref_count} but {refs[b]} table entries"
            is_free = b in free or b in cached
            assert is_free != (block.ref_count > 0), f"block {b}: free={is_free} ref_count={block.ref_count}"
            if b in cached:
                assert block.hash is not None, f"cached-free block {b} has no hash"
            if block.hash is not None:
                assert self.hash_to_block_id.get(block.hash) == b, f"block {b}: hash not indexed"
        assert set(self.shared_fill) == {b for b, r in enumerate(refs) if r > 1}, "shared-block index out of date"
        for h, b in self.hash_to_block_id.items():
            assert self.blocks[b].hash == h, f"hash index points to block {b} with another hash"
        assert len(free) + len(cached) + sum(1 for r in refs if r) == self.num_blocks, "blocks lost"
        host_free = set(self.free_cpu_block_ids)
        assert len(host_free) == len(self.free_cpu_block_ids), "duplicate id in the host free list"
        assert not host_free & host_used, "host block both free and used"
        assert len(host_free) + len(host_used) == self.num_cpu_blocks, "host blocks lost"
