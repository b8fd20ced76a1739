"""A model of several KV-cache groups (sliding windows beside full attention) in kvtrace's block manager,
as vLLM's hybrid KV cache keeps it: vLLM's grouping of the layers, a table per group over one pool, a
window's blocks dropped mid-request, the books balanced after every step, and the events that say so.
(Step for step against vLLM's own hybrid scheduler: tests/vllm_sched/test_sched_differential.py.)"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine import events as ev
from engine.build import build_engine
from engine.config import (
    FULL_ATTENTION,
    PRESETS,
    SLIDING_ATTENTION,
    EngineConfig,
    KVCacheGroup,
)
from engine.model.loader import LoadedModel
from engine.sequence import SamplingParams
from tests.helpers.engine_runs import ListTracer, run_checked

F, S = FULL_ATTENTION, SLIDING_ATTENTION


@pytest.mark.parametrize("layer_types, groups", [
    ((F, F), [(None, (0, 1))]),
    ((S, S), [(8, (0, 1))]),                                          # Mistral: one windowed group
    ((F, S), [(None, (0,)), (8, (1,))]),
    ((S, F, S, F), [(8, (0, 2)), (None, (1, 3))]),                    # alternating (Ministral, gpt-oss)
    ((S, S, S, S, S, F), [(8, (i,)) for i in range(5)] + [(None, (5,))]),  # Gemma 3's 5:1
    ((S, S, S, S, F, F, F), [(8, (0, 1, 2, 3)), (None, (4, 5, 6))]),  # 4 < 1.5 x 3: one group of each, padded
    ((S, S, S, F, F), [(8, (0, 2)), (8, (1,)), (None, (3, 4))]),     # 3 = 1.5 x 2: windowed groups of 2, padded
    ((S, S, S, S, F, F), [(8, (0, 2)), (8, (1, 3)), (None, (4, 5))]),  # 4 = 2 x 2: two windowed groups
])
def test_layers_are_grouped_as_vllm_groups_them(layer_types, groups):
    config = replace(PRESETS["tiny"], num_layers=len(layer_types), layer_types=layer_types, sliding_window=8)
    assert [(g.window, g.layers) for g in config.kv_cache_groups] == groups
    assert config.layers_per_kv_cache_group == max(len(layers) for _, layers in groups)
    assert EngineConfig(disable_hybrid_kv_cache_manager=True).kv_cache_groups(config) == \
        (KVCacheGroup(None, tuple(range(len(layer_types)))),)


def hybrid_engine(layer_types, window: int, tracer=None, **kw):
    model = replace(PRESETS["tiny"], num_layers=len(layer_types), layer_types=layer_types, sliding_window=window)
    config = EngineConfig(model="tiny", engine="sim", enable_prefix_caching=False, **kw)
    return build_engine(config, tracer, loaded=LoadedModel(model, {}, "a tiny hybrid model"))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layer_types", [(S, S), (F, S), (S, F, S, F)], ids=["mistral", "full-sliding", "alternating"])
def test_windows_drop_blocks_and_the_books_balance_after_every_step(layer_types, asynchronous):
    """A pool too small for the requests at once (preemptions), long prompts in chunks, long outputs: after
    every step each group's table covers the sequence's positions, no windowed group holds a block wholly
    behind the window of its processed positions, and every block is free at the end (run_checked)."""
    tracer = ListTracer()
    # a request holds at most 12 blocks of a windowed group (its admission cap), 16 of a full one
    num_gpu_blocks = 14 if FULL_ATTENTION not in layer_types else 40
    engine = hybrid_engine(layer_types, window=12, tracer=tracer, block_size=4, num_gpu_blocks=num_gpu_blocks,
                           max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=asynchronous)
    bm = engine.block_manager
    rng = random.Random(7)
    for i in range(12):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(5, 60))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(10, 40), ignore_eos=True))

    drop = bm.drop_out_of_window
    num_checked = 0

    def drop_and_check(seq, num_processed):
        """Right after the drop (before the sequence grows): no windowed group keeps a block wholly
        behind the window of its processed positions, nor one of positions still in flight."""
        nonlocal num_checked
        assert num_processed == seq.num_computed_tokens - (seq.num_in_flight_tokens if asynchronous else 0)
        drop(seq, num_processed)
        for table, window in zip(seq.tables(), bm.windows):
            if window is not None:
                behind = max(0, num_processed - window + 1) // bm.block_size
                assert not any(table[:behind]) and all(table[behind:]), (seq, num_processed, table)
                num_checked += 1
    bm.drop_out_of_window = drop_and_check
    run_checked(engine)
    assert num_checked
    events = tracer.events
    dropped = [e for e in events if e.kind == ev.FREE and e.reason == ev.FreeReason.WINDOW]
    windowed = {g for g, w in enumerate(bm.windows) if w is not None}
    assert dropped and {e.kv_group for e in dropped} == windowed
    assert any(e.kind == ev.PREEMPT for e in events)
    # every alloc and free names its group; a preempt lists every group's blocks, counted group by group
    assert all(e.kv_group in range(len(bm.windows)) for e in events if e.kind in (ev.ALLOC, ev.FREE))
    for e in (e for e in events if e.kind == ev.PREEMPT):
        assert len(e.kv_group_blocks) == len(bm.windows) and sum(e.kv_group_blocks) == len(e.blocks)
    # what each group was given, it gave back (a block freed once per time it was given)
    for group in range(len(bm.windows)):
        given = sum(len(e.blocks) for e in events if e.kind == ev.ALLOC and e.kv_group == group)
        freed = sum(len(e.blocks) for e in events if e.kind == ev.FREE and e.kv_group == group)
        assert given == freed, (group, given, freed)


def test_a_windowed_group_holds_its_window_and_the_full_group_everything():
    """One long request alone: at its end the full group holds a block per 4 positions, the windowed
    group no more than the window's blocks (and a block it is filling)."""
    engine = hybrid_engine((F, S), window=8, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16)
    seq = engine.add_request("r", list(range(3, 43)), SamplingParams(max_tokens=20, ignore_eos=True))
    while seq.num_output_tokens < 19:
        engine.step()
    full, windowed = seq.tables()
    assert len(full) == len(windowed) == -(-seq.num_computed_tokens // 4)
    assert 0 not in full
    live = [b for b in windowed if b]
    assert windowed[:len(windowed) - len(live)] == [0] * (len(windowed) - len(live))
    assert len(live) <= 8 // 4 + 1, windowed
    assert engine.block_manager.num_used_blocks == len(full) + len(live)


@pytest.mark.parametrize("option", [dict(preemption_mode="swap"), dict(n_mode="cow"), dict(kv_reserve="max-tokens")],
                         ids=["swap", "cow", "kv-reserve"])
def test_what_the_block_manager_does_not_model_with_windows_is_refused(option):
    model = replace(PRESETS["tiny"], layer_types=(F, S), sliding_window=8)
    config = EngineConfig(model="tiny", engine="sim", **{"enable_prefix_caching": False, **option})
    with pytest.raises(ValueError, match="sliding-window layers.*--disable-hybrid-kv-cache-manager"):
        build_engine(config, loaded=LoadedModel(model, {}, "test"))
    # vLLM's --disable-hybrid-kv-cache-manager: one table of full attention's, which these all work with
    engine = build_engine(replace(config, disable_hybrid_kv_cache_manager=True), loaded=LoadedModel(model, {}, "test"))
    assert not engine.block_manager.hybrid


def test_the_simulator_costs_a_windowed_layer_at_most_its_window_of_keys():
    """The simulated step time of a windowed model: a window longer than every context costs as full
    attention does; a short one makes long-context steps cheaper, by the windowed layers' share."""
    def step_ms(layer_types, window):
        tracer = ListTracer()
        engine = hybrid_engine(layer_types, window, tracer=tracer, block_size=16, num_gpu_blocks=400)
        engine.add_request("long", [3 + i % 500 for i in range(1500)], SamplingParams(max_tokens=40, ignore_eos=True))
        run_checked(engine)
        return [r.end_s - r.start_s for r in tracer.records]
    dense = step_ms((F, F), None)
    assert step_ms((S, S), 4096) == dense and step_ms((F, S), 4096) == dense
    mistral, half = step_ms((S, S), 64), step_ms((F, S), 64)
    assert len(mistral) == len(half) == len(dense)
    assert all(m < h < d for m, h, d in zip(mistral, half, dense))
