"""The executor and model over several KV-cache groups (vLLM's hybrid layout): a block table per group,
each layer writing and reading through its own group's, the null block 0 where a window dropped a block.
(The block manager that keeps such tables: test_hybrid_block_manager.py.)

The runner here is driven with hand-made tables, not the block manager: a Ministral-style model of
two layers (layer 0 windowed, 8 positions; layer 1 full), blocks of 4 positions, so two groups whose
layers share one KV tensor. The windowed group's blocks wholly before its window turn into 0 and are
freed; a freed block is handed out again at once (to the full group) after garbage is written into
it, and block 0 holds NaN. Its logits must equal the one-table run's (the same model with every layer
in one group of full attention's, nothing dropped) and the dense reference's.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import KVCacheGroup, ModelConfig
from engine.executor.model_runner import ModelRunner
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, dummy_weights
from engine.scheduler import SchedulerOutput
from engine.sequence import SamplingParams, Sequence
from tests.helpers.reference_model import reference_forward

S, F = "sliding_attention", "full_attention"
WINDOW, BLOCK_SIZE, NUM_BLOCKS = 8, 4, 40


def ministral() -> LoadedModel:
    config = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=512, sliding_window=WINDOW,
                         layer_types=(S, F))
    assert config.kv_cache_groups == (KVCacheGroup(WINDOW, (0,)), KVCacheGroup(None, (1,)))
    return LoadedModel(config, dummy_weights(config, seed=5), "dummy")


def run_on_tables(loaded: LoadedModel, grouped: bool, paged_inputs: bool = False) -> tuple[list, list]:
    """Two prompts (22 and 9 tokens): A's prompt in two chunks (the second starts past the window) beside
    B's prompt and then its decodes, then 6 steps decoding both (tables of different lengths in one
    batch). `grouped`: the model's own two groups, the windowed one dropping its blocks; else one group
    of both layers. Returns each sampled row (its tokens, its logits) and the tables of every step."""
    groups = None if grouped else (KVCacheGroup(None, (0, 1)),)
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, groups)
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=0)
    assert len(runner.kv_caches) == 1 + (not grouped)   # grouped: both layers share the one tensor
    runner.paged_inputs = paged_inputs
    for kv in runner.kv_caches:
        kv[:, 0] = float("nan")   # the null block: never written, never read unmasked
    garbage = torch.Generator().manual_seed(3)
    free = list(range(1, NUM_BLOCKS))
    rng = random.Random(7)
    a = Sequence("A", 0, [rng.randrange(3, 512) for _ in range(22)], SamplingParams(), 0.0, 0, 0)
    b = Sequence("B", 0, [rng.randrange(3, 512) for _ in range(9)], SamplingParams(), 0.0, 0, 1)
    for seq in (a, b):
        seq.group_tables = [[] for _ in model.kv_cache_groups[1:]]

    def drop_before_window(seq: Sequence) -> None:
        """The windowed group's blocks wholly before the first key this step's first query sees."""
        first_key = seq.num_computed_tokens - WINDOW + 1
        for i in range(max(first_key, 0) // BLOCK_SIZE):
            if seq.block_table[i]:
                free.insert(0, seq.block_table[i])   # handed out again first
                for kv in runner.kv_caches:   # a freed block is somebody else's at once
                    kv[:, seq.block_table[i]] = torch.randn(kv[:, 0].shape, generator=garbage) * 100
                seq.block_table[i] = 0

    seen, tables = [], []
    steps = [[(a, 12), (b, 9)], [(b, 1), (a, 10)]] + [[(a, 1), (b, 1)]] * 6
    for step in steps:
        for seq, num_new in step:
            if grouped:
                drop_before_window(seq)
            for table in reversed(seq.tables()):   # the full group first: it gets what the window freed
                while len(table) * BLOCK_SIZE < seq.num_computed_tokens + num_new:
                    table.append(free.pop(0))
            tables.append([list(t) for t in seq.tables()])
        result = runner.execute(SchedulerOutput(seqs=[s for s, _ in step], num_new_tokens=[n for _, n in step]))
        tokens = runner.sample(result, result.sample_seqs, list(range(len(result.sample_seqs))))
        for seq, num_new in step:
            seq.num_computed_tokens += num_new
        for seq, token, logits in zip(result.sample_seqs, tokens, result.logits):
            seen.append((list(seq.token_ids), logits))
            seq.token_ids.append(token)
    assert a.num_tokens == 22 + 7 and b.num_tokens == 9 + 8
    assert len(seen) == 1 + 2 + 2 * 6   # B after its prompt, both in step 2, both in each decode step
    return seen, tables


def check_per_group_run(paged_inputs: bool) -> None:
    """The per-group run, with NaN in block 0 and garbage in every freed block, equals the one-table run
    and the dense reference (also run through the Triton kernels: test_triton_attention.py)."""
    loaded = ministral()
    grouped, tables = run_on_tables(loaded, grouped=True, paged_inputs=paged_inputs)
    one_table, _ = run_on_tables(loaded, grouped=False, paged_inputs=paged_inputs)
    # the case is what it says: the window dropped blocks (nulls in the windowed table) while the full
    # table kept them, a block the window freed served the full group, and the groups' live ids differ
    assert any(0 in window_table and 0 not in full_table for window_table, full_table in tables)
    freed = {block for window_table, _ in tables for block in window_table[:2] if block}
    assert freed & {block for _, full_table in tables for block in full_table[3:]}
    assert all(not set(window_table) & set(full_table) - {0} for window_table, full_table in tables)
    assert [tokens for tokens, _ in grouped] == [tokens for tokens, _ in one_table]
    worst = max((g - o).abs().max().item() for (_, g), (_, o) in zip(grouped, one_table))
    assert worst < 1e-5, worst
    worst = max((reference_forward(loaded.config, loaded.weights, tokens)[-1] - logits).abs().max().item()
                for tokens, logits in grouped)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("inputs", ["tensors", "paged"])
def test_each_layer_reads_its_own_groups_table_and_never_the_null_block(kernel, inputs):
    """Per kernel path (kvtrace's C decode kernel; SDPA after oneDNN's or torch's linears) and per way the
    runner builds its inputs (a tensor per list; the one-copy buffer CUDA uses)."""
    check_per_group_run(paged_inputs=inputs == "paged")


def test_a_block_holds_the_largest_groups_layers():
    """The pool's tensors number the layers of a group, not of the model, and a block's bytes follow:
    4 full layers beside 2 windowed ones make three groups of two (vLLM's split), so 2 tensors."""
    from engine.build import pool_geometry
    from engine.config import EngineConfig

    config = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=512, sliding_window=WINDOW,
                         layer_types=(F, S, F, F, S, F))
    assert [g.layers for g in config.kv_cache_groups] == [(0, 3), (2, 5), (1, 4)]
    model = LlamaModel(config, dummy_weights(config, seed=5), torch.device("cpu"), torch.float32)
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=0)
    assert [(layer["group"], layer["kv_tensor"]) for layer in model.layers] == [(0, 0), (2, 0), (1, 0), (0, 1),
                                                                                (2, 1), (1, 1)]
    engine_config = EngineConfig(model="tiny", dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS - 1,
                                 enable_prefix_caching=False)
    bytes_per_block = pool_geometry(engine_config, config, 512).bytes_per_block
    assert bytes_per_block == 2 * 2 * 2 * 16 * BLOCK_SIZE * 4   # layers x K,V x kv heads x head dim x positions x fp32
    assert sum(kv.numel() * kv.element_size() for kv in runner.kv_caches) == NUM_BLOCKS * bytes_per_block
    # with the hybrid KV cache off, one group of every layer: a tensor per layer, as before groups
    one_group = EngineConfig(model="tiny", dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS - 1,
                             disable_hybrid_kv_cache_manager=True)
    assert pool_geometry(one_group, config, 512).bytes_per_block == 3 * bytes_per_block
