"""What the engine picks on a CUDA device when not told, computed from given memory figures without one:
the dtype and the KV pool as vLLM picks them, TF32 for fp32, swap mode's host pool, the activation
reserve against the forward's real peak, and the ceiling on --gpu-memory-utilization."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import MAX_GPU_MEMORY_UTILIZATION, PRESETS, EngineConfig, device_defaults, resolve_batch_limits
from engine.executor.model_runner import tf32_matmuls
from engine.llm_engine import pool_geometry
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
