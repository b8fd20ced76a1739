"""Sliding-window attention: which layers a Hugging Face config windows, and the engine's attention
within each layer's window on every path it has (torch, kvtrace's CPU kernels, Triton on CUDA), against
a dense reference and against transformers' greedy tokens on the same weights.

A windowed layer's query at position p attends the keys at (p - window, p]: transformers' and vLLM's edge.
The Triton kernels' windowed cases (interpreted, or on a GPU) are in test_triton_attention.py.
"""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from engine.build import build_engine
from engine.config import EngineConfig, ModelConfig
from engine.kernels import cpu_kernels
from engine.model.loader import LoadedModel, dummy_weights, weight_shapes
from engine.sequence import SamplingParams
from tests.helpers.engine_runs import capture_logits, run_with_a_late_arrival
from tests.helpers.reference_model import reference_forward
from tests.helpers.vllm_runs import VLLM_MARKS, VLLM_PYTHON

S, F = "sliding_attention", "full_attention"
BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("cfg,windows", [
    ({"model_type": "llama", "sliding_window": 8, "layer_types": [S] * 4}, [None] * 4),   # Llama has no window
    ({"model_type": "mistral", "sliding_window": 8}, [8] * 4),
    ({"model_type": "mistral"}, [4096] * 4),                                # MistralConfig's default
    ({"model_type": "mistral", "sliding_window": None}, [None] * 4),        # Mistral v0.2 and later
    ({"model_type": "mistral", "sliding_window": 8, "layer_types": [F, S, F, S]}, [8] * 4),  # ignored there
    ({"model_type": "ministral", "sliding_window": 8, "layer_types": [F, S, F, S]}, [None, 8, None, 8]),
    ({"model_type": "ministral", "sliding_window": 8}, [8] * 4),
    ({"model_type": "qwen2", "sliding_window": 8, "max_window_layers": 1}, [None] * 4),  # no use_sliding_window
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     [None, 8, 8, 8]),                                                      # the layers from max_window_layers on
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}, [None] * 4),  # 28 by default
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
      "layer_types": [S, F, F, S]}, [8, None, None, 8]),                    # layer_types wins
])
def test_windows_of_hugging_face_configs(cfg, windows):
    assert ModelConfig.from_hf_config("m", {**BASE, **cfg}).layer_windows == tuple(windows)


def test_a_window_on_an_unknown_model_type_or_mismatched_layers_is_refused():
    with pytest.raises(ValueError, match="does not know which of its layers"):
        ModelConfig.from_hf_config("m", {**BASE, "model_type": "gemma3_text", "sliding_window": 8})
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        ModelConfig.from_hf_config("m", {**BASE, "model_type": "ministral", "sliding_window": 8,
                                         "layer_types": [S, F, S]})
    with pytest.raises(ValueError, match="at least 1"):
        ModelConfig.from_hf_config("m", {**BASE, "model_type": "mistral", "sliding_window": 0})


@pytest.mark.parametrize("attention_bias,layer_types,model_type", [
    (False, (), "mistral"), (False, (F, S, F, S), "ministral"), (True, (S, S, F, F), "qwen2")])
def test_exported_config_reads_back_with_the_same_windows(attention_bias, layer_types, model_type):
    config = ModelConfig(name="m", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                         num_kv_heads=2, sliding_window=8, layer_types=layer_types, attention_bias=attention_bias)
    hf = config.to_hf_config()
    assert hf["model_type"] == model_type
    assert ModelConfig.from_hf_config("m", hf).layer_windows == config.layer_windows


# --- the engine against the dense reference ---------------------------------------------------------

def windowed(layer_types: tuple[str, ...], window: int) -> LoadedModel:
    config = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_layers=len(layer_types), num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                         sliding_window=window, layer_types=layer_types)
    return LoadedModel(config, dummy_weights(config, seed=5), "dummy")   # name tiny: std 0.1, wide logit margins


# every layer windowed (5: starts mid-block with blocks of 4); windows beside full layers
WINDOWED = {"all": ((S, S), 5), "mixed": ((S, F, S), 6)}


def run_windowed(make_engine, loaded: LoadedModel, paged_inputs: bool = False, per_group: bool = False,
                 **settings) -> list:
    """Chunked prefill mixed with decodes, then a prefix-cache hit of 3 blocks whose chunk starts past the
    window; prompts of 1 to 23 tokens, 8 generated. Returns each sampled row with its tokens.
    `paged_inputs`: the runner's one-copy inputs, as on CUDA (the Triton kernels' under the interpreter).
    Every layer's KV in one table of full attention's (--disable-hybrid-kv-cache-manager), the window the
    attention's alone; or `per_group`, a table per KV-cache group, where a windowed group's hit holds only
    the window's last block, the null block before it (the tests against transformers below and
    test_hybrid_forward.py drop blocks mid-request too)."""
    engine = make_engine(loaded=loaded, block_size=4, max_num_batched_tokens=13, enable_prefix_caching=True,
                         disable_hybrid_kv_cache_manager=not per_group, **settings)
    if paged_inputs:
        assert engine.model.use_triton
        engine.runner.paged_inputs = True
    seen = capture_logits(engine)
    rng = random.Random(9)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 4, 9, 23)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]
    hits = []
    allocate = engine.block_manager.allocate
    engine.block_manager.allocate = lambda seq, cached, *args, **kw: (hits.append(cached), allocate(seq, cached, *args, **kw))
    run_with_a_late_arrival(engine, prompts, max_tokens=8)
    assert sum(s.num_prefix_hit_tokens for s in engine.outputs.values()) == 12
    if per_group:   # a windowed group's hit: null blocks, then the blocks of the window's last 4 or 5 positions
        bm = engine.block_manager
        hit = [tables for tables in hits if tables[0]]
        assert len(hit) == 1 and [t.count(0) for t in hit[0]] == [3 - bm.blocks_for(w - 1) if w else 0 for w in bm.windows]
    assert len(seen) == 8 * len(prompts)
    return seen


@pytest.mark.parametrize("per_group", [False, True], ids=["one-table", "table-per-group"])
@pytest.mark.parametrize("shape", list(WINDOWED))
def test_windowed_engine_matches_the_dense_reference(make_engine, kernel, shape, per_group):
    loaded = windowed(*WINDOWED[shape])
    seen = run_windowed(make_engine, loaded, per_group=per_group)
    worst = max((reference_forward(loaded.config, loaded.weights, tokens)[-1] - logits).abs().max().item()
                for tokens, logits in seen)
    assert worst < 1e-4, worst
    # the window matters here: without it the reference gives other logits
    full = dataclasses.replace(loaded.config, sliding_window=None, layer_types=())
    assert max((reference_forward(full, loaded.weights, tokens)[-1] - logits).abs().max().item()
               for tokens, logits in seen) > 1e-2


@pytest.mark.parametrize("shape", list(WINDOWED))
def test_cpu_kernels_equal_the_plain_path(make_engine, monkeypatch, shape):
    """kvtrace's CPU kernels (decode attention within the window, in C) against the plain torch path,
    row by row over the same steps: chunked prefill, decodes, a prefix-cache hit past the window."""
    if cpu_kernels.load() is None:
        pytest.skip(cpu_kernels.unavailable_reason())
    loaded = windowed(*WINDOWED[shape])
    on_kernels = run_windowed(make_engine, loaded)
    monkeypatch.setenv("KVTRACE_CPU_KERNELS", "0")
    monkeypatch.setenv("KVTRACE_ONEDNN", "0")
    plain = run_windowed(make_engine, loaded)
    assert [tokens for tokens, _ in on_kernels] == [tokens for tokens, _ in plain]
    worst = max((a - b).abs().max().item() for (_, a), (_, b) in zip(on_kernels, plain))
    assert worst < 1e-4, worst


@pytest.mark.cuda
@pytest.mark.parametrize("shape", list(WINDOWED))
def test_windowed_engine_on_cuda_matches_the_dense_reference(make_engine, monkeypatch, shape):
    """The Triton kernels within each layer's window (eager and CUDA-graph decodes), in fp32 with full-precision
    matmuls, against the dense reference on CPU."""
    monkeypatch.setenv("KVTRACE_TF32", "0")
    loaded = windowed(*WINDOWED[shape])
    seen = run_windowed(make_engine, loaded, device="cuda")
    worst = max((reference_forward(loaded.config, loaded.weights, tokens)[-1] - logits.cpu()).abs().max().item()
                for tokens, logits in seen)
    assert worst < 1e-3, worst


# --- the engine against transformers ------------------------------------------------------------------

# (a) Mistral: a window on every layer; (b) Qwen2: windowed layers from max_window_layers on, beside the
# full first one; (c) Ministral: windowed and full layers alternating (layer_types)
HF_CONFIGS = {
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_hidden_layers": 2,
                "sliding_window": 16},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3,
              "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
    "ministral": {"model_type": "ministral", "architectures": ["MinistralForCausalLM"], "num_hidden_layers": 3,
                  "sliding_window": 20, "layer_types": [S, F, S]},
}
HF_WINDOWS = {"mistral": (16, 16), "qwen2": (None, 24, 24), "ministral": (20, None, 20)}


def hf_folder(folder: Path, kind: str, seed: int) -> Path:
    """A Hugging Face folder of a tiny config of `kind` with random weights (biases too, for Qwen2)."""
    from safetensors.torch import save_file

    cfg = {**BASE, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float32", **HF_CONFIGS[kind]}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_hf_config(kind, cfg)
    generator = torch.Generator().manual_seed(seed)
    weights = {name: (torch.ones(shape) if name.endswith("norm.weight") else
                      torch.empty(shape).normal_(0.0, 0.1, generator=generator))
               for name, shape in weight_shapes(config).items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def kvtrace_greedy(folder: Path, prompts: list[list[int]], max_tokens: int, tracer=None,
                   **settings) -> list[list[int]]:
    settings = {"block_size": 8, "num_gpu_blocks": 128, "max_num_batched_tokens": 48, "enable_prefix_caching": False,
                **settings}
    engine = build_engine(EngineConfig(model=str(folder), dtype="float32", **settings), tracer)
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def transformers_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return json.loads(subprocess.run(
        [VLLM_PYTHON, str(Path(__file__).parents[1] / "helpers" / "transformers_greedy.py")],
        input=json.dumps([{"model": str(folder), "prompts": prompts, "max_tokens": max_tokens}]),
        capture_output=True, text=True, check=True, timeout=600).stdout)[0]


# transformers is in vLLM's environment, not kvtrace's: these run with the vLLM tests (marked vllm)
@pytest.mark.parametrize("kind", [pytest.param(kind, marks=VLLM_MARKS) for kind in HF_CONFIGS])
def test_greedy_tokens_equal_transformers(tmp_path, kind):
    """Prompts of 60 to 100 tokens, 24 generated, windows of 16 to 24: kvtrace's engine (prefills in
    chunks of 48, a table per KV-cache group, the windows dropping blocks) and transformers, the same
    weights and config.json, give the same greedy tokens."""
    folder = hf_folder(tmp_path / kind, kind, seed=len(kind))
    assert ModelConfig.from_hf_config(kind, json.loads((folder / "config.json").read_text())).layer_windows \
        == HF_WINDOWS[kind]
    rng = random.Random(len(kind))
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (60, 77, 100)]
    ours = kvtrace_greedy(folder, prompts, 24)
    assert ours == transformers_greedy(folder, prompts, 24)


# pools of blocks of 8 that run short although the windows drop blocks, in steps of 16 tokens: the
# Mistral-style model's one group (every layer windowed: nulls in block_table) and the Ministral-style
# model's three (two windowed groups beside the full one, a table each)
TIGHT_POOLS = {"mistral": 10, "ministral": 36}


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=VLLM_MARKS) for kind in TIGHT_POOLS])
def test_greedy_tokens_equal_transformers_when_windows_drop_blocks_and_requests_are_preempted(tmp_path, kind):
    """Six prompts of 45 to 100 tokens, 24 generated, on a pool so small that requests are preempted (by
    recompute) and resumed while their windows drop blocks mid-request (freed and handed out again):
    kvtrace's engine keeps a table per KV-cache group, and its greedy tokens are transformers'."""
    from tests.helpers.engine_runs import ListTracer

    folder = hf_folder(tmp_path / kind, kind, seed=len(kind))
    rng = random.Random(len(kind))
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (60, 77, 100, 45, 90, 70)]
    tracer = ListTracer()
    ours = kvtrace_greedy(folder, prompts, 24, tracer, num_gpu_blocks=TIGHT_POOLS[kind], max_num_batched_tokens=16,
                          enable_prefix_caching=False, max_model_len=128)
    happened = {(e.kind, e.reason) for e in tracer.events}
    assert {("free", "window"), ("preempt", "recompute"), ("admit", "resume-recompute")} <= happened, happened
    assert ("finish", "rejected") not in happened
    assert ours == transformers_greedy(folder, prompts, 24)


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=VLLM_MARKS) for kind in TIGHT_POOLS])
def test_greedy_tokens_equal_transformers_with_prefix_hits_past_the_window(tmp_path, kind):
    """Prefix caching beside sliding windows (vLLM's default for such a model): six prompts on two shared
    prefixes of 56 tokens, on a pool that preempts. A later request's hit, and a resumed one's, is longer
    than the windows, so a windowed group's table starts with null blocks and holds the window's last
    blocks only, which the hit found cached from the right; the greedy tokens are transformers'."""
    from tests.helpers.engine_runs import ListTracer

    folder = hf_folder(tmp_path / kind, kind, seed=len(kind))
    rng = random.Random(len(kind) + 1)
    shared = [[rng.randrange(3, 512) for _ in range(56)] for _ in range(2)]
    prompts = [shared[i % 2] + [rng.randrange(3, 512) for _ in range(n)] for i, n in enumerate((4, 21, 9, 30, 1, 13))]
    tracer = ListTracer()
    ours = kvtrace_greedy(folder, prompts, 24, tracer, num_gpu_blocks=TIGHT_POOLS[kind], max_num_batched_tokens=16,
                          enable_prefix_caching=True, max_model_len=128)
    windows = HF_WINDOWS[kind]
    hits = [e for e in tracer.events if e.kind == "prefix_hit"]
    assert any(e.num_tokens > max(w for w in windows if w) for e in hits), [e.num_tokens for e in hits]
    # a hit past a window holds fewer blocks in its windowed groups than in full attention's (or than it spans)
    assert any(min(e.kv_group_blocks) < e.num_tokens // 8 for e in hits), [(e.num_tokens, e.kv_group_blocks) for e in hits]
    happened = {(e.kind, e.reason) for e in tracer.events}
    assert {("free", "window"), ("preempt", "recompute")} <= happened, happened
    assert ours == transformers_greedy(folder, prompts, 24)
