"""A plain decode, as the fast path sees it: which sequences make one, and what it does to their blocks.

Most steps of a long simulated replay decode one token for every running sequence. Such a decode
needs a block every block_size positions and completes one (cached for the prefix cache) every
block_size positions; otherwise it changes nothing in the pool. `grow_decode` is what
`BlockManager.grow(seq, 1)` does for it, without the checks that cannot apply (no shared block is
written, one position at a time); the fast path's tests compare the two (tests/engine/test_fast_path.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.events import AllocReason
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.sim.leap import LeapAllocs


def is_plain_decode(seq: Sequence) -> bool:
    """Whether the running sequence's next step is a plain decode: one position to compute, its last
    token delivered (not in flight) and an output token (not the prompt's last), nothing to re-prefill."""
    num_tokens = len(seq.token_ids)
    return (num_tokens - seq.num_computed_tokens == 1 and num_tokens != seq.num_prompt_tokens
            and not seq.num_undelivered and not seq.reprefill_target)


def take_block(bm: BlockManager) -> int:
    """One block off the front of the free queue (`BlockManager._allocate_blocks(1)[0]` without its
    slices and list); a cached one is evicted, its eviction kept for the alloc event."""
    if bm.free_uncached:
        block_id = bm.free_uncached.pop()
        bm.blocks[block_id].ref_count = 1
        return block_id
    return bm._evict_one()


def grow_decode(bm: BlockManager, seq: Sequence, num_tokens: int, allocs: LeapAllocs | None = None) -> bool:
    """`bm.grow(seq, 1)` for a decode at `num_tokens` positions whose write copies no shared block: a
    block when the position starts one, the prefix-cache entry of the block it completes. `allocs`: a
    leap's, which takes the alloc event as a row rather than as a KVEvent. Returns whether it took a block."""
    table = seq.block_table
    bs = bm.block_size
    took = num_tokens > len(table) * bs
    if took:
        block_id = take_block(bm)
        table.append(block_id)
        if allocs is None:
            bm._alloc_event(seq, [block_id], AllocReason.DECODE)
        else:
            evicted = bm.evicted
            if evicted:
                bm.evicted = []
            allocs.add(seq, block_id, evicted or None)
    if bm.enable_prefix_caching:
        i = len(seq.block_hashes)
        if i < num_tokens // bs and i < len(table):
            if i + 1 < num_tokens // bs:
                bm.cache_full_blocks(seq, num_tokens)
            else:   # the decode completes one block, block i: cache_full_blocks' loop, once
                bm._cache_block(seq, i, bm._token_block_hashes(seq, i + 1)[i])
    return took
