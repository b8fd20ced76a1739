"""The paged model computes the same logits as a plain dense forward."""
from __future__ import annotations

import random

import pytest
import torch

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import capture_logits, run_with_a_late_arrival
from tests.helpers.reference_model import reference_forward


def test_paged_logits_equal_dense_reference(make_engine, tiny_loaded, kernel):
    # small blocks, a small token budget (chunked prefill mixed with decodes), prefix-cache hits
    engine = make_engine(block_size=4, max_num_batched_tokens=13, enable_prefix_caching=True)
    assert engine.model.linear_kernel == kernel
    seen = capture_logits(engine)
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(9)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 4, 5, 17)]
    prompts += [shared + [7, 8], shared + [9]]
    run_with_a_late_arrival(engine, prompts, max_tokens=6)   # the last: the shared prefix's 2 full blocks cached
    assert len(seen) == 6 * len(prompts)
    worst = 0.0
    for tokens, logits in seen:
        ref = reference_forward(tiny_loaded.config, tiny_loaded.weights, tokens)[-1]
        worst = max(worst, (ref - logits).abs().max().item())
    assert worst < 1e-4, worst
    hits = sum(s.num_prefix_hit_tokens for s in engine.outputs.values())
    assert hits == 8  # the second shared-prefix request mapped 2 full blocks


def test_batched_equals_one_at_a_time(make_engine, kernel):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [make_engine().generate([p], params)[0] for p in prompts]
    batched = make_engine(max_num_batched_tokens=24, max_num_seqs=6).generate(prompts, params)
    assert batched == alone


# the other families' geometry, scaled down: head size, query heads per KV head, q/k/v biases and
# Llama 3 rope scaling as the real models have them, so each kernel path meets them
FAMILY_SHAPES = {
    "qwen2.5-0.5b": dict(num_heads=7, num_kv_heads=1, hidden_size=112, intermediate_size=160),
    "llama-3.2-1b": dict(num_heads=8, num_kv_heads=2, hidden_size=128, intermediate_size=192),
    "llama-3-8b": dict(num_heads=8, num_kv_heads=2, hidden_size=256, intermediate_size=320),
    "mistral-7b": dict(num_heads=4, num_kv_heads=1, hidden_size=256, intermediate_size=96),
}


@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_other_families_match_the_dense_reference(make_engine, kernel, family):
    import dataclasses

    from engine.config import PRESETS
    from engine.model.loader import LoadedModel, dummy_weights

    config = dataclasses.replace(PRESETS[family], num_layers=2, vocab_size=300, **FAMILY_SHAPES[family])
    loaded = LoadedModel(config, dummy_weights(config, seed=3), "dummy")
    engine = make_engine(loaded=loaded, block_size=4, max_num_batched_tokens=16)
    seen = capture_logits(engine)
    rng = random.Random(4)
    for i, n in enumerate((3, 9, 14)):
        engine.add_request(str(i), [rng.randrange(3, 300) for _ in range(n)], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    worst = max((reference_forward(config, loaded.weights, tokens)[-1] - logits).abs().max().item()
                for tokens, logits in seen)
    assert worst < 1e-4, worst


def test_decode_attention_accepts_a_transposed_sdpa_output(make_engine, monkeypatch):
    """CUDA's memory-efficient SDPA kernel returns [B, H, L, D] laid out as [B, L, H, D]; the torch
    path must not `.view` it. Reproduced on CPU by handing back that layout, same values."""
    monkeypatch.setenv("KVTRACE_CPU_KERNELS", "0")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14] * 9]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    # a small token budget mixes decodes with prefill chunks; the large one runs decode-only steps
    expected = [make_engine(max_num_batched_tokens=budget).generate(prompts, params) for budget in (7, 64)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    layouts = []

    def transposed_sdpa(*args, **kwargs):
        o = sdpa(*args, **kwargs)
        o = o.transpose(1, 2).contiguous().transpose(1, 2)  # same shape and values, transposed strides
        layouts.append(o.is_contiguous())
        return o

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed_sdpa)
    got = [make_engine(max_num_batched_tokens=budget).generate(prompts, params) for budget in (7, 64)]
    assert got == expected
    assert layouts and not any(layouts)
