"""kvtrace's CPU kernels against torch, on the shapes that break kernels: partial panels and row
tiles, head sizes that are not a multiple of the vector width, GQA groups, contexts that end
inside a block, scattered block tables, and both ways of splitting work across threads."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("out_features, in_features", [(32, 16), (45, 40), (97, 129), (576, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    got = kernels.linear(x, kernels.pack_weight(weight), out_features, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_linear_row_does_not_depend_on_the_batch():
    """A sequence gets bit-identical activations alone or batched with others."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(100, 70, generator=gen)
    x = torch.randn(11, 70, generator=gen)
    packed = kernels.pack_weight(weight)
    batched = kernels.linear(x, packed, 100)
    for i in range(11):
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 100)[0], batched[i])


def reference_decode_attention(q, k_cache, v_cache, tables, lens, scale):
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    rows = []
    for s in range(q.shape[0]):
        slots = [int(tables[s][t // block_size]) * block_size + t % block_size for t in range(int(lens[s]))]
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        rows.append(F.scaled_dot_product_attention(q[s].unsqueeze(1), keys, values, scale=scale).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("num_seqs", [1, 2, 9])  # few sequences: a task per KV head; many: per sequence
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (6, 6, 24), (8, 1, 40)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_decode_attention_matches_torch(num_seqs, num_heads, num_kv_heads, head_dim, block_size):
    rng = random.Random(num_seqs * 100 + head_dim + block_size)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    lens = [rng.choice([1, block_size, block_size + 1, rng.randint(1, 3 * block_size + 5)]) for _ in range(num_seqs)]
    max_blocks = max(-(-n // block_size) for n in lens)
    ids = list(range(num_blocks))
    tables = []
    for n in lens:
        rng.shuffle(ids)
        used = ids[:-(-n // block_size)]
        tables.append(used + [0] * (max_blocks - len(used)))
    tables, lens = torch.tensor(tables), torch.tensor(lens)
    # query rows strided as in the engine: q is the first num_heads heads of a [seqs, heads + kv, dim] row
    q = torch.randn(num_seqs, num_heads + num_kv_heads, head_dim, generator=gen)[:, :num_heads]
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    want = reference_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_long_context_softmax_is_stable():
    """Large scores (no overflow) and thousands of positions (no drift in the normaliser)."""
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(40, 128, 2, 64, generator=gen) * 8
    v_cache = torch.randn(40, 128, 2, 64, generator=gen)
    tables = torch.arange(40).flip(0).view(1, 40)
    lens = torch.tensor([5000])
    q = torch.randn(1, 4, 64, generator=gen) * 8
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference_decode_attention(q, k_cache, v_cache, tables, lens, 0.125),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 40), (40, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_adds_the_residual_in_place(rows, dim, with_residual):
    gen = torch.Generator().manual_seed(rows + dim)
    x, weight = torch.randn(rows, dim, generator=gen), torch.randn(dim, generator=gen)
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    stream = x + residual if with_residual else x.clone()
    got = kernels.rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(x, stream)  # the residual stream is updated
    torch.testing.assert_close(got, F.rms_norm(stream, (dim,), weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, inter", [(1, 16), (3, 40), (20, 1536)])
def test_silu_mul_matches_torch(rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 6
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -1e4])  # saturated both ways, zero
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (2, 1, 40), (3, 3, 8)])
def test_rope_and_cache_matches_torch(num_heads, num_kv_heads, head_dim):
    from engine.model.llama import apply_rope

    rows, num_slots, max_pos = 7, 30, 100
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    cos, sin_signed = torch.randn(max_pos, head_dim, generator=gen), torch.randn(max_pos, head_dim, generator=gen)
    positions = torch.tensor([0, 99, 5, 6, 7, 50, 1])
    slots = torch.tensor([29, 0, 3, 4, 5, 17, 11])
    k_slots, v_slots = torch.zeros(num_slots, num_kv_heads, head_dim), torch.zeros(num_slots, num_kv_heads, head_dim)
    qk = kernels.rope_and_cache(qkv, positions, cos, sin_signed, num_heads, num_kv_heads, slots, k_slots, v_slots)
    rotated = num_heads + num_kv_heads
    want = apply_rope(qkv[:, :rotated * head_dim].view(rows, rotated, head_dim), cos[positions].unsqueeze(1),
                      sin_signed[positions].unsqueeze(1))
    torch.testing.assert_close(qk, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_slots[slots], want[:, num_heads:])
    torch.testing.assert_close(v_slots[slots], qkv[:, rotated * head_dim:].view(rows, num_kv_heads, head_dim))
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


def test_a_failed_build_leaves_the_torch_path_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(tmp_path))  # no cached build to fall back on
    monkeypatch.setenv("CC", "false")                       # a "compiler" that always fails
    monkeypatch.setattr(cpu_kernels, "_reason", None)
    assert cpu_kernels._load.__wrapped__() is None
    assert cpu_kernels._reason.startswith("could not build or load cpu_kernels.c: false exited with status 1")
    assert not list((tmp_path / "kernels").iterdir())  # no half-built library left behind


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("KVTRACE_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    assert cpu_kernels.unavailable_reason() == "turned off by KVTRACE_CPU_KERNELS=0"


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    packed = kernels.pack_weight(torch.randn(40, 16))
    with pytest.raises(AssertionError):
        kernels.linear(torch.randn(2, 24), packed, 40)  # 24 inputs against a weight of 16
    k_cache = v_cache = torch.zeros(4, 4, 1, 16)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="no positions"):
        kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[1]]), torch.tensor([0]), 0.25)
    with pytest.raises(AssertionError, match="longer than its block table"):
        kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[1]]), torch.tensor([5]), 0.25)
    with pytest.raises(AssertionError, match="past the KV cache"):
        kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[4]]), torch.tensor([2]), 0.25)


def test_the_forward_does_not_depend_on_torch_defaults(make_engine):
    """The kernel path hands raw pointers to fp32 kernels: a changed default dtype must change nothing."""
    from engine.sequence import SamplingParams

    prompts = [[5, 9, 11, 3, 200], [7] * 13]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = make_engine().generate(prompts, params)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        engine = make_engine()
        assert engine.model.linear_kernel == "kvtrace"
        assert engine.generate(prompts, params) == want
    finally:
        torch.set_default_dtype(previous)
