"""The host KV tier's books (engine/offload.py), its size in the config, and --offload-size on the CLI."""
from __future__ import annotations

import random

import pytest

from engine.build import num_offload_blocks
from engine.config import EngineConfig
from engine.offload import Lookup, OffloadTier, StorePlan
from tests.helpers.cli import one_line_error, write_workload


def stored(tier: OffloadTier, request: object, keys: list[int], first: int = 0) -> StorePlan:
    plan = tier.prepare_store(request, keys, first)
    assert plan is not None
    tier.complete_store(plan.keys)
    tier.check_integrity()
    return plan


@pytest.mark.parametrize("ranks_by_request", [True, False])
def test_a_finished_request_loses_its_tail_first(ranks_by_request):
    """vLLM's run (the memo's §3): A's 4 chunks, A finished, then 4 new chunks into 6: A's tail goes
    (vLLM 0.33's ranks and 0.32's alike)."""
    tier = OffloadTier(6, ranks_by_request=ranks_by_request)
    stored(tier, "A", [1, 2, 3, 4])
    tier.on_request_finished("A")
    plan = stored(tier, "B", [11, 12, 13, 14])
    assert plan.evicted == [4, 3]
    assert plan.slots == [4, 5, 2, 3]   # two fresh slots, then the evicted ones (4 gave back 3, then 3 gave 2), the last first
    assert sorted(tier.chunks) == [1, 2, 11, 12, 13, 14]


def test_a_running_request_ranks_its_chunks_tail_first_and_above_older_requests():
    tier = OffloadTier(4)
    stored(tier, "A", [1, 2])
    stored(tier, "B", [21, 22])
    # A's two, then B's: each request's tail before its head, the older request first
    plan = stored(tier, "C", [31, 32, 33])
    assert plan.evicted == [2, 1, 22]


def test_touching_a_chunk_lifts_it_to_the_request_rank_and_a_lookup_does_not():
    tier = OffloadTier(3)
    stored(tier, "A", [1])
    stored(tier, "B", [2])
    assert tier.lookup(1) is Lookup.HIT      # no rank change
    plan = tier.prepare_store("C", [1, 3], 0)  # C names 1 again (ready, kept) and stores 3: room for it
    assert plan == StorePlan([3], [2], [])
    tier.complete_store([3])
    plan = stored(tier, "D", [4])
    assert plan.evicted == [2]                # B's chunk, not the one C touched


def test_a_store_is_all_or_nothing_and_pending_or_pinned_chunks_stay():
    tier = OffloadTier(3)
    pending = tier.prepare_store("A", [1, 2], 0)        # never completed: pending
    assert tier.lookup(1) is Lookup.PENDING
    stored(tier, "B", [3])
    tier.prepare_load("C", [3], 0)                      # pinned
    before = (dict(tier.ranks), list(tier.free_slots))
    assert tier.prepare_store("D", [4], 0) is None
    assert (tier.ranks, tier.free_slots) == before and 4 not in tier.chunks
    tier.complete_load([3])
    assert tier.prepare_store("D", [4, 5], 0) is None   # two to evict, one ready
    assert tier.prepare_store("D", [4], 0).evicted == [3]
    tier.complete_store(pending.keys, success=False)    # a failed store leaves the tier
    assert tier.lookup(1) is Lookup.MISS and tier.num_free_blocks == 2
    tier.check_integrity()


@pytest.mark.parametrize("ranks_by_request", [True, False])
def test_offered_chunks_are_never_evicted_for_their_own_store(ranks_by_request):
    tier = OffloadTier(2, ranks_by_request)
    stored(tier, "A", [1, 2])
    # 1 is ready and offered again beside a new one: only 2 may go
    assert tier.prepare_store("B", [1, 3], 0).evicted == [2]
    tier.complete_store([3])
    assert tier.prepare_store("C", [1, 3, 4], 0) is None   # all three offered: nothing else to evict


def test_vllm_032_ranks_evict_in_the_order_given_passing_over_pending_pinned_and_offered_chunks():
    """0.31's and 0.32's ranks: a chunk ranks when stored, head first, and again (tail first) when its
    request finishes; touching it changes nothing."""
    tier = OffloadTier(6, ranks_by_request=False)
    stored(tier, "A", [1, 2])
    stored(tier, "B", [3, 4])
    tier.on_request_finished("A")              # order now 3, 4, 2, 1
    tier.prepare_store("C", [4], 0)            # B's 4 touched: no rank change
    tier.prepare_load("D", [3], 0)             # pinned
    pending = tier.prepare_store("E", [5], 0)  # pending: order 3, 4, 2, 1, 5
    tier.check_integrity()
    # 6 offered beside 2: 3 pinned, 2 offered, so 4 then 1 go (6 takes the one free slot, 7 one freed)
    plan = tier.prepare_store("F", [2, 6, 7, 8], 0)
    assert plan.evicted == [4, 1]
    assert tier.prepare_store("G", [2, 9], 0) is None   # 3 pinned, 5 and F's pending, 2 offered: none to go
    tier.complete_load([3])
    tier.complete_store(pending.keys)
    tier.complete_store(plan.keys)
    assert tier.prepare_store("G", [9, 10], 0).evicted == [3, 2]   # 2 ranked when A finished, before 5
    tier.check_integrity()


@pytest.mark.parametrize("ranks_by_request", [True, False])
def test_a_chunk_offered_while_pending_is_not_the_offering_requests(ranks_by_request):
    """B offers A's chunk 1 while A's store of it is in flight: vLLM records no access to it, so B's
    finish re-ranks only B's own chunk 2, and 1 (ranked before 2) goes first."""
    tier = OffloadTier(2, ranks_by_request=ranks_by_request)
    first = tier.prepare_store("A", [1], 0)
    second = tier.prepare_store("B", [1, 2], 0)
    assert second.keys == [2]
    tier.complete_store(first.keys)
    tier.complete_store(second.keys)
    tier.on_request_finished("B")
    assert tier.prepare_store("C", [3], 0).evicted == [1]
    tier.check_integrity()


@pytest.mark.parametrize("ranks_by_request", [True, False])
def test_a_request_noting_its_tail_before_its_head_still_loses_its_tail_first(ranks_by_request):
    """A loads B's chunks 3 and 4 (positions 3, 4), then stores 1 and 2: finished, its tail goes first."""
    tier = OffloadTier(4, ranks_by_request)
    stored(tier, "B", [3, 4], 3)
    tier.prepare_load("A", [3, 4], 3)
    tier.complete_load([3, 4])
    stored(tier, "A", [1, 2], 1)
    tier.on_request_finished("A")
    assert tier.prepare_store("C", [9], 0).evicted == [4]
    tier.check_integrity()


@pytest.mark.parametrize("ranks_by_request", [True, False])
def test_a_request_filling_its_head_after_its_tail_still_loses_its_tail_first(ranks_by_request):
    """A stores 12 and 13 (positions 2, 3), then offers 10 to 12 (positions 0 to 2), of which the tier
    holds 12: the head is noted behind the tail in a call that names a chunk already noted. Finished,
    its tail goes first."""
    tier = OffloadTier(4, ranks_by_request)
    stored(tier, "A", [12, 13], 2)
    assert stored(tier, "A", [10, 11, 12], 0).keys == [10, 11]
    tier.on_request_finished("A")
    assert tier.prepare_store("C", [9], 0).evicted == [13]
    tier.check_integrity()


@pytest.mark.parametrize("ranks_by_request", [True, False])
def test_a_tier_without_host_slots_decides_as_one_with_them(ranks_by_request):
    """The simulator's tier hands out no host slots: the same stores, refusals, evictions and loads."""
    rng = random.Random(3)
    tiers = [OffloadTier(5, ranks_by_request), OffloadTier(5, ranks_by_request, host_slots=False)]
    pending: list[list[int]] = []
    for _ in range(300):
        request, first = rng.randrange(6), rng.randrange(4)
        keys = [10 * request + position for position in range(first, first + rng.randint(1, 3))]
        action = rng.random()
        if action < 0.5:
            plans = [tier.prepare_store(request, keys, first) for tier in tiers]
            assert [plan and (plan.keys, plan.evicted) for plan in plans] == [plans[0] and (plans[0].keys, plans[0].evicted)] * 2
            assert not plans[1] or not plans[1].slots
            if plans[0]:
                pending.append(plans[0].keys)
        elif action < 0.75 and pending:
            done, success = pending.pop(rng.randrange(len(pending))), rng.random() < 0.9
            for tier in tiers:
                tier.complete_store(done, success)
        elif action < 0.85:
            ready = [key for key in keys if tiers[0].lookup(key) is Lookup.HIT]
            for tier in tiers:
                tier.prepare_load(request, ready, first)
                tier.complete_load(ready)
        else:
            for tier in tiers:
                tier.on_request_finished(request)
        assert tiers[0].chunks == tiers[1].chunks and tiers[0].num_free_blocks == tiers[1].num_free_blocks
        for tier in tiers:
            tier.check_integrity()


def test_sizes_and_bad_sizes():
    bytes_per_block = 5000   # two 4 KiB pages each
    assert num_offload_blocks(EngineConfig(offload_size="80KiB"), bytes_per_block) == 10
    assert num_offload_blocks(EngineConfig(offload_size=0), bytes_per_block) == 0
    assert num_offload_blocks(EngineConfig(num_offload_blocks=3, offload_size="1GiB"), bytes_per_block) == 3
    assert not EngineConfig(offload_size="0").offloads
    with pytest.raises(ValueError, match="holds no KV block: one takes 8,192 bytes"):   # asked for, none given
        num_offload_blocks(EngineConfig(offload_size="8000"), bytes_per_block)
    for bad, message in [({"offload_size": "-1"}, "cannot read"), ({"offload_size": -5}, ">= 0"),
                         ({"offload_size": "lots"}, "cannot read"),
                         ({"offload_size": "1GiB", "preemption_mode": "swap"}, "--preemption-mode swap")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)


@pytest.mark.parametrize("args, message", [
    (["--offload-size", "-3GiB"], "cannot read"),
    (["--offload-size", "many"], "cannot read"),
    (["--offload-size", "8"], "holds no KV block"),   # vLLM's GiB, read as bytes
    (["--offload-size", "1GiB", "--async-scheduling"], "--async-scheduling"),
    (["--offload-size", "1GiB", "--engine", "vllm"], "--kv-offloading-size"),
])
def test_bad_offload_sizes_are_one_line_exit_2(tmp_path, args, message):
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 12, "max_tokens": 4}])
    line = one_line_error(["record", "--model", "tiny", "-w", str(workload), "-o", str(tmp_path / "run"), "-q",
                           *args])
    assert message in line


def test_the_real_engine_refuses_a_tier_larger_than_the_host(monkeypatch):
    from engine import build

    with pytest.raises(ValueError, match="larger than this host's memory"):
        build.check_host_memory(1 << 60, "--offload-size's host KV tier")
