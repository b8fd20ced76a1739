"""Predicts how long a step takes from its composition: the simulated executor's clock.

A step's forward time, in milliseconds:

    step_ms + hypot(weights_ms, prefill_token_ms * P + decode_token_ms * D)
            + kv_token_ms * K + attention_pair_ms * A

    P  prompt / history tokens computed (prefill chunks)
    D  decode tokens (one per decoding sequence)
    K  KV positions the step's attention reads (every scheduled sequence's context, its new tokens included)
    A  query-key pairs of the prefill chunks (a chunk of n new tokens after s cached ones: n * (s + (n + 1) / 2))

The hypot (the square root of the sum of squares) is a soft roofline: a small batch waits for the
weights to stream from memory, a large one for the matrix units, and where the two are close neither
hides the other (Vidur's A100 / H100 layer timings, docs/simulation.md: a layer of 128-512 tokens takes
up to 40 % longer than the larger of the two). Swap copies add `swap_ms + bytes * swap_byte_ms` per direction and step; copy-on-write
moves a block twice through device memory. A built-in profile derives every coefficient from public
figures for a device (peak dense FLOP/s for the dtype, memory and host-link bandwidth) and the model's
shape, with efficiency factors; a calibrated profile (`kvtrace calibrate`) gives fitted coefficients
that replace the derived ones.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROFILE_DIR = Path(__file__).parent / "profiles"
COEFFICIENTS = ("step_ms", "weights_ms", "prefill_token_ms", "decode_token_ms", "kv_token_ms",
                "attention_pair_ms", "swap_ms", "swap_byte_ms", "copy_byte_ms")


@dataclass
class HardwareProfile:
    """A device in public figures, plus how much of them a serving engine gets."""

    name: str
    memory_bytes: int                       # device memory
    peak_flops: dict[str, float]            # dense matrix FLOP/s by dtype (no sparsity)
    memory_bytes_s: float                   # device memory bandwidth
    host_bytes_s: float                     # host link, one direction (PCIe, NVLink-C2C)
    flops_efficiency: float = 0.6           # share of peak the linear layers reach
    attention_efficiency: float = 0.35      # share of peak prefill attention reaches
    bandwidth_efficiency: float = 0.8       # share of memory bandwidth the weights' read reaches
    kv_bandwidth_efficiency: float | None = None  # share the attention kernel's KV reads reach (None: as the weights')
    host_efficiency: float = 0.8            # share of host-link bandwidth a swap reaches
    step_overhead_ms: float = 1.5           # scheduling, launches and sampling per step (host)
    layer_overhead_ms: float = 0.0          # device time per decoder layer that no token count changes
    coefficients: dict[str, float] = field(default_factory=dict)  # fitted: replace the derived ones
    source: str = ""                        # where the figures come from
    fitted_on: dict | None = None           # calibrated profiles: the runs, model and fit error

    def to_dict(self) -> dict:
        return asdict(self)


_TB = 1e12
# Efficiency factors fitted to Vidur's published operator timings (benchmarks/data/vidur/, one decoder layer
# of Llama-2/3 7B-70B in fp16 on one GPU; `python -m benchmarks sim-gpu-accuracy --fit`, docs/simulation.md):
# the fixed time per layer and the weights' read on layers of 1-64 tokens (the models' 7B and 70B layers set
# the two apart), the matrix units on layers of every token count, KV reads on decode attention of >= 32
# sequences, attention pairs on prefill chunks of > 128 tokens. Vidur measured attention on A100 only
# (in the tables that could be had): H100 and H200 take A100's attention shares; H200, a faster-memory H100,
# takes H100's. L40S has no measurement: it keeps the datasheet defaults.
_A100 = {"flops_efficiency": 0.66, "bandwidth_efficiency": 0.75, "kv_bandwidth_efficiency": 0.93,
         "attention_efficiency": 0.21, "layer_overhead_ms": 0.023}
_H100 = {"flops_efficiency": 0.59, "bandwidth_efficiency": 0.89, "kv_bandwidth_efficiency": 0.93,
         "attention_efficiency": 0.21, "layer_overhead_ms": 0.044}
# Public datasheet figures (dense tensor-core FLOP/s; fp32 runs as TF32 on the tensor cores).
PROFILES: dict[str, HardwareProfile] = {
    "h100-sxm": HardwareProfile(
        "h100-sxm", 80 * 10**9, {"bfloat16": 989.4 * _TB, "float16": 989.4 * _TB, "float32": 494.7 * _TB},
        3.35 * _TB, 64e9, **_H100,
        source="NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, PCIe Gen5 x16; efficiencies "
               "fitted to Vidur's H100 linear-layer timings (attention: A100's)"),
    "h200": HardwareProfile(
        "h200", 141 * 10**9, {"bfloat16": 989.4 * _TB, "float16": 989.4 * _TB, "float32": 494.7 * _TB},
        4.8 * _TB, 64e9, **_H100,
        source="NVIDIA H200 SXM datasheet: 989 TFLOP/s BF16 dense, 4.8 TB/s HBM3e, PCIe Gen5 x16; efficiencies "
               "H100's (not measured on H200)"),
    "a100-80gb": HardwareProfile(
        "a100-80gb", 80 * 10**9, {"bfloat16": 312 * _TB, "float16": 312 * _TB, "float32": 156 * _TB},
        2.039 * _TB, 32e9, **_A100,
        source="NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s BF16 dense, 2.039 TB/s HBM2e, PCIe Gen4 x16; "
               "efficiencies fitted to Vidur's A100 timings"),
    "l40s": HardwareProfile(
        "l40s", 48 * 10**9, {"bfloat16": 362.05 * _TB, "float16": 362.05 * _TB, "float32": 183 * _TB},
        0.864 * _TB, 32e9, source="NVIDIA L40S datasheet: 362 TFLOP/s BF16 dense, 864 GB/s GDDR6, PCIe Gen4 x16; "
                                  "efficiencies: the defaults (not measured)"),
}
CALIBRATED = ("cpu-here",)   # shipped fitted profiles, engine/sim/profiles/<name>.json


def load_profile(name_or_path: str) -> HardwareProfile:
    """A built-in name or a profile JSON file; ValueError naming the problem."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = PROFILE_DIR / f"{name_or_path}.json" if name_or_path in CALIBRATED else Path(name_or_path)
    if not path.is_file():
        names = ", ".join([*PROFILES, *CALIBRATED])
        raise ValueError(f"--hardware {name_or_path!r}: not a built-in profile ({names}) nor a profile JSON file")
    try:
        data = json.loads(path.read_text())
        coefficients = data.get("coefficients") or {}
        unknown = set(coefficients) - set(COEFFICIENTS)
        if unknown:
            raise ValueError(f"unknown coefficient(s) {', '.join(sorted(unknown))}")
        return HardwareProfile(**data)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"--hardware {path}: not a valid profile ({exc})") from None


def weight_params(mc: ModelConfig) -> tuple[int, int]:
    """(parameters of the layers and LM head that every token multiplies, all parameters)."""
    q = mc.hidden_size * mc.num_heads * mc.head_dim
    kv = 2 * mc.hidden_size * mc.num_kv_heads * mc.head_dim
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    per_layer = q + kv + q + mlp + 2 * mc.hidden_size
    head = mc.vocab_size * mc.hidden_size
    linear = mc.num_layers * per_layer + head
    return linear, linear + (0 if mc.tie_word_embeddings else head) + mc.hidden_size


class CostModel:
    def __init__(self, profile: HardwareProfile, mc: ModelConfig, dtype: str) -> None:
        self.profile = profile
        element = DTYPE_BYTES[dtype]
        linear_params, all_params = weight_params(mc)
        self.weight_bytes = all_params * element
        self.kv_bytes_per_token = mc.kv_values_per_token * element
        p = profile
        derived = {}
        if p.peak_flops and p.memory_bytes_s > 0 and p.host_bytes_s > 0:
            derived = self._derive(p, mc, dtype, linear_params)
        self.coefficients = {**derived, **p.coefficients}
        missing = [name for name in COEFFICIENTS if name not in self.coefficients]
        if missing:
            raise ValueError(f"--hardware {p.name}: no device figures to derive {', '.join(missing)} from, "
                             "and the profile does not give them")
        c = self.coefficients
        # unpacked once: forward_ms runs every simulated step
        self._step, self._weights = c["step_ms"], c["weights_ms"]
        self._prefill, self._decode = c["prefill_token_ms"], c["decode_token_ms"]
        self._kv, self._pair = c["kv_token_ms"], c["attention_pair_ms"]

    def _derive(self, p: HardwareProfile, mc: ModelConfig, dtype: str, linear_params: int) -> dict[str, float]:
        """Every coefficient from the device's public figures and the model's shape."""
        flops = p.peak_flops.get(dtype) or max(p.peak_flops.values())
        memory = p.memory_bytes_s * p.bandwidth_efficiency
        kv_memory = p.memory_bytes_s * (p.kv_bandwidth_efficiency or p.bandwidth_efficiency)
        token_ms = 2 * linear_params / (flops * p.flops_efficiency) * 1e3
        return {
            "step_ms": p.step_overhead_ms + mc.num_layers * p.layer_overhead_ms,
            "weights_ms": self.weight_bytes / memory * 1e3,
            "prefill_token_ms": token_ms,
            "decode_token_ms": token_ms,
            "kv_token_ms": self.kv_bytes_per_token / kv_memory * 1e3,
            "attention_pair_ms": 4 * mc.num_layers * mc.num_heads * mc.head_dim / (flops * p.attention_efficiency) * 1e3,
            "swap_ms": 0.01,
            "swap_byte_ms": 1e3 / (p.host_bytes_s * p.host_efficiency),
            "copy_byte_ms": 2e3 / memory,
        }

    def forward_ms(self, num_prefill: int, num_decode: int, num_kv: int, num_pairs: float) -> float:
        compute = self._prefill * num_prefill + self._decode * num_decode
        # exact where one term is 0: a calibrated profile (weights_ms 0) prices compute alone
        return self._step + math.hypot(self._weights, compute) + self._kv * num_kv + self._pair * num_pairs

    def decode_ms(self, num_decodes: int):
        """`forward_ms(0, num_decodes, num_kv, 0.0)` as a function of num_kv alone, its other terms
        worked out once (the steps of a leap differ only in their KV): the same floats."""
        fixed = self._step + math.hypot(self._weights, self._prefill * 0 + self._decode * num_decodes)
        kv, pairs = self._kv, self._pair * 0.0
        return lambda num_kv: fixed + kv * num_kv + pairs

    def swap_ms(self, num_bytes: int) -> float:
        return self.coefficients["swap_ms"] + num_bytes * self.coefficients["swap_byte_ms"]

    def copy_ms(self, num_bytes: int) -> float:
        return num_bytes * self.coefficients["copy_byte_ms"]

    def describe(self) -> dict:
        """What meta.json records: the profile, its coefficients and how they were obtained."""
        p = self.profile
        return {"profile": p.name, "source": p.source, "calibrated": bool(p.coefficients),
                "fitted_on": p.fitted_on, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "coefficients": {k: float(f"{v:.6g}") for k, v in self.coefficients.items()}}
