"""What the engine picks on a CUDA device when not told, computed from given memory figures without one:
the dtype and the KV pool as vLLM picks them, TF32 for fp32, swap mode's host pool, the activation
reserve against the forward's real peak, and the ceiling on --gpu-memory-utilization."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.build import pool_geometry
from engine.config import MAX_GPU_MEMORY_UTILIZATION, PRESETS, EngineConfig, device_defaults, resolve_batch_limits
from engine.executor.model_runner import swap_staging_reserve, tf32_matmuls
from engine.model.loader import checkpoint_dtype

GiB = 1 << 30
H200_MEMORY = 150_754_820_096   # torch.cuda.get_device_properties(...).total_memory of an H200 (143,771 MiB)
LLAMA = PRESETS["llama-3-8b"]


def on_h200(**settings):
    """Llama-3-8B's config on an H200 as LLMEngine resolves it, and its pool geometry."""
    config = device_defaults(EngineConfig(model="llama-3-8b", device="cuda", **settings), "cuda",
                             checkpoint_dtype("llama-3-8b"))
    config = resolve_batch_limits(config, LLAMA.max_position_embeddings, "cuda", H200_MEMORY, "NVIDIA H200")
    return config, pool_geometry(config, LLAMA, LLAMA.max_position_embeddings, H200_MEMORY, "cuda")


def test_auto_dtype_on_cuda_is_the_checkpoints_and_float32_on_cpu(tmp_path):
    cuda = EngineConfig(device="cuda")
    assert cuda.dtype == "auto"
    assert device_defaults(cuda, "cuda", "bfloat16").dtype == "bfloat16"
    assert device_defaults(cuda, "cuda", "float16").dtype == "float16"
    # an fp32 (or unknown: GGUF, tiny) checkpoint runs in bf16, as vLLM's auto does; fp16 without bf16
    assert device_defaults(cuda, "cuda", "float32").dtype == "bfloat16"
    assert device_defaults(cuda, "cuda", None, bf16_supported=False).dtype == "float16"
    assert device_defaults(EngineConfig(), "cpu", "bfloat16").dtype == "float32"
    assert device_defaults(EngineConfig(engine="sim"), "sim").dtype == "float32"
    assert device_defaults(EngineConfig(device="cuda", dtype="float32"), "cuda", "bfloat16").dtype == "float32"
    # the checkpoint's dtype: the built-in shapes' published checkpoints, an HF folder's config.json
    assert checkpoint_dtype("llama-3-8b") == checkpoint_dtype("smollm2-135m") == "bfloat16"
    assert checkpoint_dtype("tiny") is None
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(str(folder)) == "float16"


def test_fp32_matmuls_run_as_tf32_on_cuda_only(monkeypatch):
    assert tf32_matmuls("cuda", torch.float32)
    assert not tf32_matmuls("cuda", torch.bfloat16) and not tf32_matmuls("cpu", torch.float32)
    monkeypatch.setenv("KVTRACE_TF32", "0")
    assert not tf32_matmuls("cuda", torch.float32)


def test_the_kv_pool_on_cuda_is_0_9_of_the_device_not_1_gib():
    config, g = on_h200()
    assert config.dtype == "bfloat16" and config.gpu_memory_utilization == 0.9
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 16_384)
    d = g.derivation
    assert g.bytes_per_block == 2 << 20   # 16 positions x 32 layers x K and V x 8 heads x 128 x bf16
    assert d["kv_bytes"] == int(H200_MEMORY * 0.9) - d["weights"] - d["activations"] - d["non_torch"]
    assert g.num_gpu_blocks == d["kv_bytes"] // g.bytes_per_block - 1
    # the old default, 1 GiB in fp32, held 255 blocks (4,080 tokens): now a full batch of long prompts fits
    assert g.num_gpu_blocks * 16 > 16 * LLAMA.max_position_embeddings * 4
    # a pool option given keeps its meaning
    assert on_h200(kv_cache_memory="1GiB")[1].num_gpu_blocks == 511


def test_swap_mode_on_cuda_pins_vllms_4_gib_not_the_device_pools_size():
    _, g = on_h200(preemption_mode="swap")
    assert g.num_cpu_blocks == 4 * GiB // g.bytes_per_block == 2048
    _, given = on_h200(preemption_mode="swap", swap_space="8GiB")
    assert given.num_cpu_blocks == 4096
    assert on_h200()[1].num_cpu_blocks == 0   # recompute needs none


def test_the_activation_reserve_on_cuda_covers_the_forwards_peak():
    # the review measured about 2.6 GiB at 16,384 tokens of Llama-3-8B in bf16; the shape estimate
    # vLLM's profile stands for (what --engine sim keeps) counted 1.56 GiB of it
    _, g = on_h200()
    assert g.derivation["activations"] >= 2.6 * GiB


def test_gpu_memory_utilization_above_the_estimates_margin_is_refused_on_cuda():
    assert MAX_GPU_MEMORY_UTILIZATION == 0.95
    EngineConfig(device="cuda", gpu_memory_utilization=0.95)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=r"--gpu-memory-utilization 1.0 is above 0.95: the activation reserve"):
            EngineConfig(device=device, gpu_memory_utilization=1.0)
    # no real device memory at stake: the simulator and the CPU keep (0, 1]
    EngineConfig(engine="sim", gpu_memory_utilization=1.0)
    EngineConfig(gpu_memory_utilization=1.0)


def test_swap_mode_on_cuda_reserves_the_staging_buffer_and_nothing_else_does():
    # the swaps' device buffer (and a layer's gathered blocks beside it) comes out of the KV pool on
    # CUDA in swap mode only: recompute mode has no swaps, and the simulator and the CPU stage nothing
    _, recompute = on_h200()
    _, swap = on_h200(preemption_mode="swap")
    staging = swap_staging_reserve(swap.bytes_per_block, LLAMA.num_layers)
    assert staging >= swap.bytes_per_block
    assert swap.derivation["activations"] - recompute.derivation["activations"] == staging
    assert swap.num_gpu_blocks < recompute.num_gpu_blocks
    for mode in ("recompute", "swap"):
        config = EngineConfig(model="llama-3-8b", engine="sim", gpu_memory_utilization=0.9, preemption_mode=mode,
                              max_num_seqs=256, max_num_batched_tokens=8192)
        sim = pool_geometry(config, LLAMA, LLAMA.max_position_embeddings, H200_MEMORY, "sim")
        baseline = pool_geometry(dataclasses.replace(config, preemption_mode="recompute"), LLAMA,
                                 LLAMA.max_position_embeddings, H200_MEMORY, "sim")
        assert sim.derivation["activations"] == baseline.derivation["activations"]
        assert sim.num_gpu_blocks == baseline.num_gpu_blocks


def cuda_activations(model, **settings) -> int:
    config = EngineConfig(model="llama-3-8b", engine="real", device="cuda", dtype="bfloat16",
                          gpu_memory_utilization=0.9, max_num_seqs=256, max_num_batched_tokens=8192)
    config = dataclasses.replace(config, **settings)
    return pool_geometry(config, model, 8192, H200_MEMORY, "cuda").derivation["activations"]


def test_the_cuda_reserve_counts_every_sequences_logits_in_the_dtype_and_in_fp32():
    # a sequence more adds its row of logits twice: bf16 (2 bytes) from lm_head, fp32 (4) for sampling
    assert cuda_activations(LLAMA, max_num_seqs=257) - cuda_activations(LLAMA) == LLAMA.vocab_size * (2 + 4)
    assert (cuda_activations(LLAMA, max_num_seqs=257, dtype="float32") - cuda_activations(LLAMA, dtype="float32")
            == LLAMA.vocab_size * (4 + 4))


def test_the_cuda_reserve_takes_the_larger_of_the_mlps_and_the_attentions_tensors_per_token():
    # per token of the step (bf16): at the MLP the residual stream, the last MLP output, the norm's
    # output and the new one (4 x hidden) with gate_up, silu and their product (4 x intermediate); at
    # attention the same 4 x hidden, qkv, RoPE's output and its temporaries (3 x (q + k heads)), the
    # attention output. Llama's MLP is the larger; a model with a narrow MLP is sized by its attention
    h, d = LLAMA.hidden_size, LLAMA.head_dim
    per_token = cuda_activations(LLAMA, max_num_batched_tokens=8193) - cuda_activations(LLAMA)
    assert per_token == (4 * h + 4 * LLAMA.intermediate_size) * 2
    narrow = dataclasses.replace(LLAMA, name="narrow-mlp", intermediate_size=h // 2)
    qkv = (LLAMA.num_heads + 2 * LLAMA.num_kv_heads) * d
    rope = 3 * (LLAMA.num_heads + LLAMA.num_kv_heads) * d
    attention = 4 * h + qkv + rope + LLAMA.num_heads * d
    assert 4 * h + 4 * narrow.intermediate_size < attention
    assert cuda_activations(narrow, max_num_batched_tokens=8193) - cuda_activations(narrow) == attention * 2


@pytest.mark.parametrize("bf16, dtype", [(True, "bfloat16"), (False, "float16")])
def test_the_engine_loads_the_weights_in_fp16_on_a_gpu_without_bf16(monkeypatch, bf16, dtype):
    # what build_engine asks of the device when it resolves auto (a T4 or V100 has no bf16), up to the
    # weights' loading, where the dtype it chose is seen and the engine stops (no GPU here)
    import engine.executor.model_runner as model_runner
    import engine.model.loader as loader
    from engine.build import build_engine

    class Loaded(Exception):
        pass

    def load_weights(model, load_format, dtype, seed):
        raise Loaded(dtype)

    monkeypatch.setattr(model_runner, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(loader, "load_weights", load_weights)
    with pytest.raises(Loaded) as loaded:
        build_engine(EngineConfig(model="tiny", device="cuda"))
    assert loaded.value.args[0] == getattr(torch, dtype)
