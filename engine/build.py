"""Making an engine: the executor its config asks for (the model on a device, or the simulator's cost
model), the KV pool sized for that device, and the engine loop around them.

    build_engine(config)  ->  LLMEngine(config resolved, model shape, pool, executor)
                              + the simulator's fast path (engine/sim/), when it simulates with it on

The simulated engine imports no torch and loads no weights: only the model's shape (config.json or
a built-in preset) and a hardware profile.
"""
from __future__ import annotations

from engine.config import (
    SWAP_SPACE_DEFAULT,
    EngineConfig,
    KVReserve,
    ModelConfig,
    NMode,
    PoolGeometry,
    PreemptionMode,
    device_defaults,
    resolve_batch_limits,
)
from engine.events import Tracer
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, checkpoint_dtype, load_config
from engine.sim.cost_model import CostModel, load_profile, weight_params

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}   # the dtypes EngineConfig accepts
DEFAULT_KV_CACHE_MEMORY = 1 << 30   # 1 GiB when neither --num-gpu-blocks nor --kv-cache-memory is given
NON_TORCH_RESERVE = 1 << 30         # --gpu-memory-utilization: CUDA context, graphs, workspaces (an estimate)


def build_engine(config: EngineConfig, tracer: Tracer | None = None, *, loaded: LoadedModel | None = None) -> LLMEngine:
    """The engine `config` describes: `engine="real"` runs the model (its weights loaded, or `loaded`),
    `engine="sim"` predicts each step's time (its shape read, or `loaded`'s). ValueError on a config
    this device or model cannot hold."""
    if config.engine == "sim":
        return _simulated(config, tracer, loaded)
    return _real(config, tracer, loaded)


def _simulated(config: EngineConfig, tracer: Tracer | None, loaded: LoadedModel | None) -> LLMEngine:
    from engine.sim.executor import SimExecutor
    from engine.sim.fast_path import DecodeFastPath

    config = device_defaults(config, "sim")
    model_config, model_source = (loaded.config, loaded.source) if loaded else load_config(config.model)
    cost_model = CostModel(load_profile(config.hardware or "h100-sxm"), model_config, config.dtype)
    profile = cost_model.profile
    device_memory = profile.memory_bytes or None
    device_type = "cpu" if not profile.memory_bytes or "cpu" in profile.name else "cuda"
    check_kv_cache_groups(config, model_config)
    config, max_model_len, geometry = _size(config, model_config, device_type, device_memory, profile.name)
    engine = LLMEngine(config, model_config, geometry, SimExecutor(cost_model, geometry.bytes_per_block, model_config.layer_windows),
                       max_model_len=max_model_len, tracer=tracer, model_source=model_source)
    # async scheduling keeps a token in flight, which no step of the fast path has (engine/sim/fast_path.py);
    # nor does it keep a table per KV-cache group, drop a window's blocks, or draft (speculative decoding);
    # with a host KV tier it takes only leaps, where the tier has nothing to do (fast_path.py)
    if (config.sim_fast_path and not config.async_scheduling and not engine.block_manager.hybrid
            and config.speculative_method is None):
        engine.fast_path = DecodeFastPath(engine)
    return engine


def check_kv_cache_groups(config: EngineConfig, model_config: ModelConfig) -> None:
    """ValueError for what kvtrace does not model with sliding-window layers (several KV-cache groups,
    or a window on every layer): vLLM V0's swap and copy-on-write forks, --kv-reserve, a host KV tier,
    speculative decoding."""
    if not config.hybrid_kv_cache(model_config):
        return
    if config.offloads:
        raise ValueError(f"model {model_config.name} has sliding-window layers: kvtrace's host KV tier "
                         f"(--offload-size) is not modelled beside them yet")
    if config.speculative_method is not None:
        raise ValueError(f"model {model_config.name} has sliding-window layers: kvtrace's engine does not model "
                         f"speculative decoding beside them yet (pass --disable-hybrid-kv-cache-manager to keep "
                         f"every layer's KV as full attention's)")
    refused = [what for what, on in [("--preemption-mode swap", config.preemption_mode == PreemptionMode.SWAP),
                                     ("--n-mode cow", config.n_mode == NMode.COW),
                                     (f"--kv-reserve {config.kv_reserve}", config.kv_reserve != KVReserve.NONE)] if on]
    if refused:
        raise ValueError(f"model {model_config.name} has sliding-window layers: kvtrace's engine keeps their KV as "
                         f"vLLM's hybrid KV cache does, but not yet with {refused[0]}; or pass "
                         f"--disable-hybrid-kv-cache-manager (every layer's KV kept as full attention's)")


def _real(config: EngineConfig, tracer: Tracer | None, loaded: LoadedModel | None) -> LLMEngine:
    import torch

    from engine.executor.model_runner import ModelRunner, resolve_device
    from engine.model.llama import LlamaModel
    from engine.model.loader import load_weights

    device = resolve_device(config.device)
    cuda = device.type == "cuda"
    config = device_defaults(config, device.type, checkpoint_dtype(config.model),
                             bf16_supported=cuda and torch.cuda.is_bf16_supported())
    dtype = getattr(torch, config.dtype)
    if loaded is None:
        loaded = load_weights(config.model, config.load_format, dtype=dtype, seed=config.seed)
    device_memory = torch.cuda.get_device_properties(device).total_memory if cuda else None
    device_name = torch.cuda.get_device_name(device) if cuda else ""
    check_kv_cache_groups(config, loaded.config)
    config, max_model_len, geometry = _size(config, loaded.config, device.type, device_memory, device_name)
    if geometry.num_offload_blocks:
        check_host_memory(geometry.num_offload_blocks * geometry.bytes_per_block, "--offload-size's host KV tier")
    model = LlamaModel(loaded.config, loaded.weights, device, dtype, config.kv_cache_groups(loaded.config))
    # block ids run 1..num_gpu_blocks: the KV tensor has a slot for the null block 0 too
    runner = ModelRunner(model, geometry.num_gpu_blocks + 1, geometry.block_size, geometry.num_cpu_blocks,
                         geometry.num_offload_blocks)
    return LLMEngine(config, loaded.config, geometry, runner, max_model_len=max_model_len, tracer=tracer,
                     model_source=loaded.source, device=device, model=model)


def _size(config: EngineConfig, mc: ModelConfig, device_type: str, device_memory: int | None,
          device_name: str) -> tuple[EngineConfig, int, PoolGeometry]:
    """The config with its batch limits resolved, the max model length, and the KV pool's size."""
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    config = resolve_batch_limits(config, max_model_len, device_type, device_memory, device_name)
    return config, max_model_len, pool_geometry(config, mc, max_model_len, device_memory, device_type)


def activation_reserve(config: EngineConfig, mc: ModelConfig, element: int) -> int:
    """Peak activation memory of a full step (what vLLM's profiling run measures), estimated from shapes:
    the largest batch's hidden states, q/k/v and MLP intermediates, and fp32 logits of every sequence."""
    per_token = 4 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 2 * mc.intermediate_size
    return config.max_num_batched_tokens * per_token * element + config.max_num_seqs * mc.vocab_size * 4


def forward_peak(config: EngineConfig, mc: ModelConfig, element: int) -> int:
    """Peak memory of the real engine's own forward over a full step (engine/model/llama.py), counted
    tensor by tensor: per token, at the MLP, the residual stream, the last layer's MLP output (bound
    until the next replaces it), the norm's output and the new MLP output (4 x hidden), with gate_up,
    silu(gate) and their product (4 x intermediate); at attention the same residual tensors with qkv,
    RoPE's output and temporaries, the attention output and o_proj's; then the logits of every
    sequence in the dtype and their fp32 copy."""
    h, d = mc.hidden_size, mc.head_dim
    mlp = 4 * h + 4 * mc.intermediate_size
    attention = 4 * h + (mc.num_heads + 2 * mc.num_kv_heads) * d + 3 * (mc.num_heads + mc.num_kv_heads) * d \
        + mc.num_heads * d
    logits = config.max_num_seqs * mc.vocab_size * (element + 4)
    return config.max_num_batched_tokens * max(mlp, attention) * element + logits


def pool_geometry(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  device_memory: int | None = None, device_type: str = "cpu") -> PoolGeometry:
    """Size the device and host pools from the config; ValueError when no block fits. On CUDA the
    activation reserve is the real forward's peak and swap mode's host pool defaults to vLLM V0's
    4 GiB; elsewhere (CPU, --engine sim: vLLM's profile) they are the shape estimate and the device
    pool's size."""
    cuda = config.engine == "real" and device_type == "cuda"
    dtype = device_defaults(config, device_type).dtype   # a config not resolved by LLMEngine: its auto
    element = ELEMENT_BYTES[dtype]
    # a block holds KV for the largest KV-cache group's layers (every layer with one group; with several,
    # a block is in one group's table at a time: ModelRunner's tensors), as vLLM's pages
    mc = model_config
    layers_per_block = max(len(group.layers) for group in config.kv_cache_groups(mc))
    bytes_per_block = layers_per_block * 2 * mc.num_kv_heads * mc.head_dim * config.block_size * element
    derivation = None
    if config.num_gpu_blocks is not None:
        num_gpu_blocks = config.num_gpu_blocks
    elif config.gpu_memory_utilization is not None:
        if device_memory is None:
            raise ValueError("--gpu-memory-utilization needs a device whose memory is known: CUDA, or --engine sim")
        util = config.gpu_memory_utilization
        weights = weight_params(model_config)[1] * element
        activations = (forward_peak if cuda else activation_reserve)(config, model_config, element)
        if cuda and (config.preemption_mode == PreemptionMode.SWAP or config.offloads):   # the copies' staging buffer
            from engine.executor.model_runner import swap_staging_reserve

            activations += swap_staging_reserve(bytes_per_block, layers_per_block)
        memory = int(device_memory * util) - weights - activations - NON_TORCH_RESERVE
        num_gpu_blocks = max(max(memory, 0) // bytes_per_block - 1, 0)  # V1's null block is one of them
        derivation = {
            "formula": "(device_memory * gpu_memory_utilization - weights - activations - non_torch) // bytes_per_block",
            "device_memory": device_memory, "gpu_memory_utilization": util, "weights": weights,
            "activations": activations, "non_torch": NON_TORCH_RESERVE, "kv_bytes": memory,
            "bytes_per_block": bytes_per_block, "num_gpu_blocks": num_gpu_blocks,
        }
        if num_gpu_blocks < 1:
            raise ValueError(f"--gpu-memory-utilization {util}: {device_memory * util / 1e9:.1f} GB of the device "
                             f"leaves no KV block after {weights / 1e9:.2f} GB of weights and "
                             f"{(activations + NON_TORCH_RESERVE) / 1e9:.2f} GB of activations and runtime")
    else:
        memory = config.kv_cache_memory
        if memory is None:  # enough for every sequence at full length (and the null block), at most 1 GiB
            memory = min(DEFAULT_KV_CACHE_MEMORY,
                         (config.max_num_seqs * -(-max_model_len // config.block_size) + 1) * bytes_per_block)
        num_gpu_blocks = memory // bytes_per_block - 1  # V1's null block is one of them
        if num_gpu_blocks < 1:
            raise ValueError(f"--kv-cache-memory {memory} B holds no usable KV block of {bytes_per_block} B "
                             f"({config.block_size} tokens of {model_config.name}) besides the null block")
    if config.num_cpu_blocks is not None:
        num_cpu_blocks = config.num_cpu_blocks
    elif config.swap_space is not None:
        num_cpu_blocks = config.swap_space // bytes_per_block
    else:
        # on CUDA not the device pool's size: that pinned ~108 GiB on a 128 GiB host beside the weights
        swap = config.preemption_mode == PreemptionMode.SWAP
        num_cpu_blocks = (SWAP_SPACE_DEFAULT // bytes_per_block if cuda else num_gpu_blocks) if swap else 0
    return PoolGeometry(num_gpu_blocks, num_cpu_blocks, config.block_size, bytes_per_block, derivation,
                        num_offload_blocks(config, bytes_per_block))


HOST_PAGE_BYTES = 4096   # vLLM pads each offloaded chunk to whole host pages (mmap.PAGESIZE)


def num_offload_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """The host KV tier's size in blocks (one block a chunk, vLLM's default blocks_per_chunk): the count
    given, or --offload-size bytes over a block padded to whole 4 KiB pages, as vLLM's CPUOffloadingSpec
    sizes its chunks (kv_offload/cpu/spec.py)."""
    if config.num_offload_blocks is not None:
        return config.num_offload_blocks
    if not config.offload_size:
        return 0
    chunk_bytes = -(-bytes_per_block // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    if config.offload_size < chunk_bytes:   # a tier asked for, none given: said, not left out silently
        raise ValueError(f"--offload-size of {config.offload_size:,} bytes holds no KV block: one takes "
                         f"{chunk_bytes:,} bytes of host memory here ({chunk_bytes / 2**20:g} MiB); a plain "
                         f"number is bytes, not vLLM's GiB (8GiB, say), and 0 is no tier")
    return config.offload_size // chunk_bytes


def check_host_memory(num_bytes: int, what: str) -> None:
    """ValueError when the real engine would hold more host memory than the machine has."""
    import os

    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > host_bytes:
        raise ValueError(f"{what} of {num_bytes / 2**30:.1f} GiB is larger than this host's memory "
                         f"({host_bytes / 2**30:.1f} GiB)")

