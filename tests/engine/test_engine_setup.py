"""Setting the engine up (engine/build.py's build_engine and pool_geometry): how it is
called, which weights and device it takes, the device class a simulated engine's defaults follow, the
watermark's base, the KV tensor's size, how the device and host pools are sized from the memory
options, and the figures of the error for a device too small."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.build import NON_TORCH_RESERVE, build_engine, pool_geometry
from engine.config import PRESETS, EngineConfig, ModelConfig
from engine.model.loader import load_weights
from engine.sequence import SamplingParams
from tests.helpers.cli import one_line_error
from tests.helpers.engine_runs import ListTracer, admits, run_checked

PROMPTS = [[5, 6, 7, 8, 9]]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def tiny_config(**overrides) -> EngineConfig:
    settings = dict(model="tiny", load_format="dummy", block_size=4, num_gpu_blocks=32)
    settings.update(overrides)
    return EngineConfig(**settings)


# ---------------------------------------------------------------- how the engine is built

def test_the_engine_takes_its_tracer_by_keyword_as_the_benchmarks_pass_it(tiny_loaded):
    # benchmarks/kvtrace_runner.py and tracing_cost.py: build_engine(config, tracer=writer, loaded=loaded)
    tracer = ListTracer()
    engine = build_engine(tiny_config(), tracer=tracer, loaded=tiny_loaded)
    engine.add_request("r", PROMPTS[0], GREEDY)
    run_checked(engine)
    assert len(tracer.records) == GREEDY.max_tokens
    assert [e.kind for e in tracer.events][:1] == ["admit"]


def test_the_engine_loads_the_configured_weights_unless_it_is_given_some(tiny_loaded):
    # kvtrace record builds the engine from the config alone: it loads the weights itself (the tiny
    # fixture is the same dummy weights, seed 0)
    given_seed_0 = build_engine(tiny_config(seed=0), loaded=tiny_loaded).generate(PROMPTS, GREEDY)
    assert build_engine(tiny_config(seed=0)).generate(PROMPTS, GREEDY) == given_seed_0
    # weights handed in are the ones it runs, whatever the config's seed would load
    seed_1 = load_weights("tiny", "dummy", dtype=torch.float32, seed=1)
    from_seed_1 = build_engine(tiny_config(seed=0), loaded=seed_1).generate(PROMPTS, GREEDY)
    assert from_seed_1 == build_engine(tiny_config(seed=1)).generate(PROMPTS, GREEDY)
    assert from_seed_1 != given_seed_0   # (the two seeds' weights answer differently)


def test_the_real_engine_runs_on_the_device_it_is_given_and_the_simulated_one_on_none(tiny_loaded):
    # a simulated engine runs no model: --device is not looked at, even naming a GPU this machine lacks
    sim = build_engine(tiny_config(engine="sim", device="cuda"))
    assert sim.device == torch.device("cpu") and sim.model is None
    if torch.cuda.is_available():
        assert build_engine(tiny_config(device="cuda"), loaded=tiny_loaded).device.type == "cuda"
    else:
        with pytest.raises(ValueError, match="--device cuda: CUDA is not available on this machine"):
            build_engine(tiny_config(device="cuda"), loaded=tiny_loaded)


# ---------------------------------------------------------------- the simulated engine's device

def test_the_simulated_engine_sizes_its_pool_at_vllms_0_9_when_given_no_pool_option():
    sized = dict(model="llama-3-8b", engine="sim", hardware="h100-sxm", dtype="bfloat16", max_num_seqs=256,
                 max_num_batched_tokens=8192)
    default = build_engine(EngineConfig(**sized))
    assert default.config.gpu_memory_utilization == 0.9
    explicit = build_engine(EngineConfig(**sized, gpu_memory_utilization=0.9))
    # docs/simulation.md's figure for Llama-3-8B on an H100 at 0.9, 256 sequences, 8,192 tokens
    assert default.block_manager.num_blocks == explicit.block_manager.num_blocks == 25_698


def test_a_cpu_profile_gives_the_simulated_engine_vllms_cpu_batch_defaults(tmp_path):
    # vLLM's CPU defaults are 256 sequences and 4,096 tokens a step; a CUDA device below 70 GB gets 8,192.
    # A profile is a CPU when its name says so (cpu-here knows its 25 GB of memory) or it gives no memory.
    here = build_engine(tiny_config(engine="sim", hardware="cpu-here"))
    profile = json.loads((Path(__file__).parents[2] / "engine/sim/profiles/cpu-here.json").read_text())
    path = tmp_path / "nameless.json"
    path.write_text(json.dumps({**profile, "name": "nameless", "memory_bytes": 0}))
    nameless = build_engine(tiny_config(engine="sim", hardware=str(path)))
    for engine in (here, nameless):
        assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (256, 4096), engine.runner.cost_model.profile.name


# ---------------------------------------------------------------- the pools

def test_the_watermark_is_a_fraction_of_the_whole_pool_null_block_included(make_engine):
    # V1 counts its null block in the pool the watermark is a fraction of: 9 blocks + 1 at 0.1 keep 1 block
    # free, so B (24 tokens: 6 blocks) cannot take the 6 that A (12 tokens: 3 blocks) leaves while A runs.
    # 8 blocks + 1 at 0.1 keep none (0.9 blocks): B (20 tokens: 5 blocks) takes the last 5 at once.
    for num_gpu_blocks, b_tokens, b_admitted in ((9, 24, 4), (8, 20, 0)):
        tracer = ListTracer()
        engine = make_engine(tracer, num_gpu_blocks=num_gpu_blocks, watermark=0.1, enable_prefix_caching=False)
        engine.add_request("A", list(range(10, 22)), SamplingParams(max_tokens=4, ignore_eos=True))
        engine.add_request("B", list(range(50, 50 + b_tokens)), SamplingParams(max_tokens=1, ignore_eos=True))
        run_checked(engine)
        assert admits(tracer) == [(0, "A", 0), (b_admitted, "B", 0)], num_gpu_blocks


def test_the_kv_tensors_hold_exactly_the_pool_and_its_null_block(make_engine):
    # --kv-cache-memory of 11 blocks: 10 usable blocks and V1's null block, and not a byte more
    block_bytes = make_engine(num_gpu_blocks=1).geometry.bytes_per_block
    engine = make_engine(num_gpu_blocks=None, kv_cache_memory=11 * block_bytes)
    assert engine.block_manager.num_blocks == 10
    kv_bytes = sum(kv.numel() * kv.element_size() for kv in engine.runner.kv_caches)
    assert kv_bytes == 11 * block_bytes


# ---------------------------------------------------------------- a device too small

def one_wide_model(weights: int, activations: int) -> ModelConfig:
    """A model one unit wide whose fp32 weights and activations (one sequence of one token a step, plus
    the runtime's reserve) come to the given bytes: vocabulary and MLP widths solved for them."""
    mlp, rest = divmod(weights - activations + NON_TORCH_RESERVE, 4)
    vocab, rest2 = divmod(weights - 12 * mlp - 28, 4)
    assert rest == rest2 == 0 < vocab
    return ModelConfig(name="one-wide", vocab_size=vocab, hidden_size=1, intermediate_size=mlp, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=1, tie_word_embeddings=True)


@pytest.mark.parametrize("offset, figures", [(4, ("20.1", "30.01", "25.01")), (-4, ("20.0", "30.00", "25.00"))])
def test_the_error_for_a_device_too_small_rounds_its_gigabytes_exactly(offset, figures):
    # decimal GB (1e9 bytes), rounded to the digits shown: each figure is 4 bytes above or below a
    # rounding edge (20.05, 30.005 and 25.005 GB), the side it rounds to
    config = EngineConfig(model="tiny", block_size=1, gpu_memory_utilization=1.0, max_num_seqs=1,
                          max_num_batched_tokens=1)
    model = one_wide_model(30_005_000_000 + offset, 25_005_000_000 + offset)
    device, weights, activations = figures
    with pytest.raises(ValueError) as error:
        pool_geometry(config, model, 64, device_memory=20_050_000_000 + offset)
    assert str(error.value) == (f"--gpu-memory-utilization 1.0: {device} GB of the device leaves no KV block after "
                                f"{weights} GB of weights and {activations} GB of activations and runtime")


# ---------------------------------------------------------------- the pools' sizes

TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4   # K and V x 2 layers x 2 KV heads x 16 dims x fp32 x 4 positions


def test_gpu_memory_utilization_leaves_the_documented_block_counts():
    # docs/simulation.md: Llama-3-8B bf16 on an 80 GB H100 at 0.9, 256 sequences and 8,192 tokens a step:
    # 72.0 GB - 16.06 GB weights - 0.97 GB activations - 1 GiB = 53.9 GB of KV in 2 MiB blocks, one of
    # them V1's null block; vLLM's H100 defaults (1,024 sequences, 16,384 tokens) leave 25,110
    mc = PRESETS["llama-3-8b"]
    per_token = 4 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 2 * mc.intermediate_size
    for limits, (seqs, tokens, blocks) in (({"max_num_seqs": 256, "max_num_batched_tokens": 8192}, (256, 8192, 25_698)),
                                           ({}, (1024, 16_384, 25_110))):   # an H100's: a CUDA device's defaults
        engine = build_engine(EngineConfig(model="llama-3-8b", engine="sim", hardware="h100-sxm", dtype="bfloat16",
                                           gpu_memory_utilization=0.9, **limits))
        assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (seqs, tokens)
        d = engine.geometry.derivation
        # activations: every token's hidden states, q/k/v and MLP intermediates in bf16, fp32 logits a sequence
        assert d["activations"] == tokens * per_token * 2 + seqs * mc.vocab_size * 4
        assert d["non_torch"] == 1 << 30 and d["kv_bytes"] == 72 * 10**9 - d["weights"] - d["activations"] - (1 << 30)
        assert engine.geometry.num_gpu_blocks == d["num_gpu_blocks"] == blocks
        assert engine.block_manager.num_blocks == blocks


def test_gpu_memory_utilization_needs_room_for_one_block_besides_the_null_block():
    config = EngineConfig(model="tiny", block_size=4, gpu_memory_utilization=1.0, max_num_seqs=8,
                          max_num_batched_tokens=64)
    probe = pool_geometry(config, PRESETS["tiny"], 64, device_memory=1 << 40).derivation
    fixed = probe["weights"] + probe["activations"] + probe["non_torch"]
    assert pool_geometry(config, PRESETS["tiny"], 64, device_memory=fixed + 2 * TINY_BLOCK_BYTES).num_gpu_blocks == 1
    for short in (fixed + 2 * TINY_BLOCK_BYTES - 1, fixed - 1):   # one block (the null one), or less than nothing
        with pytest.raises(ValueError, match="--gpu-memory-utilization 1.0: .* leaves no KV block"):
            pool_geometry(config, PRESETS["tiny"], 64, device_memory=short)
    with pytest.raises(ValueError, match="needs a device whose memory is known"):
        pool_geometry(config, PRESETS["tiny"], 64, device_memory=None)


def test_a_device_too_small_for_the_weights_is_a_one_line_error_in_gigabytes(tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"arrival_s": 0, "prompt_tokens": 10, "max_tokens": 4}\n')
    # 0.2 x 80 GB cannot even hold Llama-3-8B's bf16 weights; activations at vLLM's H100 defaults + 1 GiB
    assert one_line_error(["record", "-w", str(workload), "--model", "llama-3-8b", "--engine", "sim",
                           "--hardware", "h100-sxm", "--gpu-memory-utilization", "0.2", "-o", str(tmp_path / "r")]) == (
        "kvtrace: error: --gpu-memory-utilization 0.2: 16.0 GB of the device leaves no KV block after "
        "16.06 GB of weights and 3.28 GB of activations and runtime")
    assert not (tmp_path / "r").exists()


def test_kv_cache_memory_is_cut_into_blocks_less_the_null_block(make_engine):
    assert make_engine(num_gpu_blocks=None, kv_cache_memory=11 * TINY_BLOCK_BYTES).block_manager.num_blocks == 10
    assert make_engine(num_gpu_blocks=None, kv_cache_memory=2 * TINY_BLOCK_BYTES).block_manager.num_blocks == 1
    with pytest.raises(ValueError, match=f"--kv-cache-memory {2 * TINY_BLOCK_BYTES - 1} B holds no usable KV block"):
        make_engine(num_gpu_blocks=None, kv_cache_memory=2 * TINY_BLOCK_BYTES - 1)


def test_the_simulated_engine_takes_the_pool_option_it_is_given():
    # vLLM's 0.9 only stands in when no pool option is given
    for option, blocks in (({"kv_cache_memory": 11 * TINY_BLOCK_BYTES}, 10), ({"num_gpu_blocks": 7}, 7)):
        engine = build_engine(EngineConfig(model="tiny", engine="sim", block_size=4, **option))
        assert engine.block_manager.num_blocks == blocks
        assert engine.config.gpu_memory_utilization is None and engine.geometry.derivation is None


def test_without_a_pool_option_every_sequence_fits_at_full_length_up_to_one_gib(make_engine):
    # 8 sequences of 30 positions: 8 blocks of 4 each, and the null block
    engine = make_engine(num_gpu_blocks=None, max_num_seqs=8, max_model_len=30)
    assert engine.block_manager.num_blocks == 8 * 8
    # Llama-3-8B at 8,192 positions would want 256 x 512 blocks of 2 MiB: capped at 1 GiB
    config = EngineConfig(model="llama-3-8b", engine="sim", dtype="bfloat16", num_gpu_blocks=None, max_num_seqs=256)
    assert pool_geometry(config, PRESETS["llama-3-8b"], 8192).num_gpu_blocks == (1 << 30) // (2 << 20) - 1


def test_the_host_pool_follows_num_cpu_blocks_then_swap_space_then_the_preemption_mode(make_engine):
    def host_blocks(**overrides) -> int:
        return make_engine(num_gpu_blocks=12, **overrides).block_manager.num_cpu_blocks

    assert host_blocks(num_cpu_blocks=5, swap_space=40 * TINY_BLOCK_BYTES, preemption_mode="swap") == 5
    assert host_blocks(swap_space=7 * TINY_BLOCK_BYTES + 1, preemption_mode="swap") == 7
    assert host_blocks(preemption_mode="swap") == 12     # vLLM V0: as many as the device pool
    assert host_blocks() == 0                           # recompute needs none
