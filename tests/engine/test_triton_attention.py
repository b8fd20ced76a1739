"""The Triton paged-attention kernels (engine/kernels/triton_attention.py) against a dense reference.

Without a GPU the kernels run under Triton's interpreter, which must be switched on before triton is
first imported: `test_kernels_under_the_interpreter` runs this file's cases in a fresh process with
TRITON_INTERPRET=1 (another test may already have imported triton in this one). On a GPU the cases
also run directly on CUDA, in fp32 and bf16.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
# kernel cases run where the kernels can (under the interpreter, or on a GPU); elsewhere conftest
# leaves them out of the run instead of skipping them: test_kernels_under_the_interpreter runs them
needs_kernels = pytest.mark.triton_kernels


def test_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("already interpreted")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "not under_the_interpreter"], env=env, capture_output=True, text=True,
                            cwd=Path(__file__).parents[2], timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def paged_cache(num_blocks: int, block_size: int, nkv: int, hd: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, nkv, hd, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, nkv, hd, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE), g


def scattered_tables(lens: list[int], block_size: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Each sequence's blocks, drawn without replacement from a shuffled pool (never contiguous runs),
    padded with 0 to the longest table."""
    order = torch.randperm(num_blocks, generator=g).tolist()
    widths = [-(-n // block_size) for n in lens]
    rows, used = [], 0
    for w in widths:
        rows.append(order[used:used + w] + [0] * (max(widths) - w))
        used += w
    return torch.tensor(rows, dtype=torch.int64)


def dense(q: torch.Tensor, k_cache, v_cache, table: list[int], num_keys: int, query_pos: list[int], scale: float,
          sliding_window: int | None = None):
    """Reference: gather the sequence's keys, attend in float64 with a causal mask by position (and
    the window (p - sliding_window, p] when given)."""
    bs = k_cache.shape[1]
    slots = [table[p // bs] * bs + p % bs for p in range(num_keys)]
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.reshape(-1, nkv, hd)[slots].double().cpu()            # [num_keys, nkv, hd]
    values = v_cache.reshape(-1, nkv, hd)[slots].double().cpu()
    group = q.shape[1] // nkv
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double().cpu(), keys) * scale
    mask = torch.arange(num_keys)[None, :] <= torch.tensor(query_pos)[:, None]
    if sliding_window is not None:
        mask &= torch.arange(num_keys)[None, :] > torch.tensor(query_pos)[:, None] - sliding_window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]

# head size, query heads, KV heads, block size, context lengths (ragged)
DECODE_CASES = [
    (64, 8, 2, 16, [1, 17, 70, 200]),     # GQA 4, splits with empty tails
    (128, 4, 4, 3, [5, 33, 64]),          # no grouping, a block size that is not a power of two
    (64, 6, 1, 1, [2, 9]),                # one KV head for all, one-token blocks
    (128, 16, 2, 32, [300]),              # GQA 8, one long sequence (many splits)
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,nh,nkv,block_size,lens", DECODE_CASES)
def test_decode_matches_dense(hd, nh, nkv, block_size, lens, dtype):
    from engine.kernels import triton_attention

    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache, g = paged_cache(num_blocks, block_size, nkv, hd, dtype, seed=hd + nh + block_size)
    tables = scattered_tables(lens, block_size, num_blocks, g)
    # q rows strided like the engine's (a slice of the fused q/k tensor)
    qk = torch.randn(len(lens), nh + nkv, hd, generator=g).to(dtype).to(DEVICE)
    q = qk[:, :nh]
    scale = hd ** -0.5
    for num_splits in sorted({1, triton_attention.decode_num_splits(len(lens), nkv, max(lens))}):
        out = torch.full((len(lens), nh, hd), float("nan"), dtype=dtype, device=DEVICE)
        triton_attention.decode_attention(q, k_cache, v_cache, tables.to(DEVICE),
                                          torch.tensor(lens, device=DEVICE), scale, out, num_splits)
        for i, n in enumerate(lens):
            ref = dense(q[i:i + 1], k_cache, v_cache, tables[i].tolist(), n, [n - 1], scale)
            err = (out[i:i + 1].double().cpu() - ref).abs().max().item()
            assert err < TOLERANCE[dtype], (num_splits, i, n, err)


# head size, query heads, KV heads, block size, chunks as (positions already cached, chunk tokens)
PREFILL_CASES = [
    (64, 8, 2, 16, [(0, 20), (32, 7), (5, 40)]),  # a whole prompt, a prefix hit of two blocks, a mid-block start
    (128, 4, 1, 3, [(0, 1), (12, 17)]),           # one-token chunk; later chunk over odd-sized blocks
    (64, 4, 4, 1, [(3, 5)]),
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,nh,nkv,block_size,chunks", PREFILL_CASES)
def test_prefill_chunks_match_dense(hd, nh, nkv, block_size, chunks, dtype):
    from engine.kernels import triton_attention

    ends = [start + n for start, n in chunks]
    num_blocks = sum(-(-e // block_size) for e in ends) + 2
    k_cache, v_cache, g = paged_cache(num_blocks, block_size, nkv, hd, dtype, seed=7 * hd + block_size)
    tables = scattered_tables(ends, block_size, num_blocks, g)
    num_tokens = sum(n for _, n in chunks)
    qk = torch.randn(num_tokens + 2, nh + nkv, hd, generator=g).to(dtype).to(DEVICE)
    q = qk[2:, :nh]                      # strided rows; the step's rows start after two decode rows
    rows = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    meta = torch.tensor([rows, [n for _, n in chunks], [s for s, _ in chunks]], device=DEVICE)
    out = torch.full((num_tokens, nh, hd), float("nan"), dtype=dtype, device=DEVICE)
    scale = hd ** -0.5
    triton_attention.prefill_attention(q, k_cache, v_cache, tables.to(DEVICE), meta, max(n for _, n in chunks),
                                       scale, out)
    for (start, n), row, table in zip(chunks, rows, tables.tolist()):
        ref = dense(q[row:row + n], k_cache, v_cache, table, start + n, list(range(start, start + n)), scale)
        err = (out[row:row + n].double().cpu() - ref).abs().max().item()
        assert err < TOLERANCE[dtype], (start, n, err)


# head size, query heads, KV heads, block size, context lengths, sliding window
WINDOWED_DECODE_CASES = [
    (64, 8, 2, 16, [1, 17, 70, 200], 20),   # windows starting mid-block, contexts inside the window, splits
    (128, 4, 4, 3, [5, 33, 64], 7),
    (64, 6, 1, 1, [2, 9], 1),                # a window of one: the query's own key only
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,nh,nkv,block_size,lens,window", WINDOWED_DECODE_CASES)
def test_windowed_decode_matches_dense(hd, nh, nkv, block_size, lens, window, dtype):
    from engine.kernels import triton_attention

    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache, g = paged_cache(num_blocks, block_size, nkv, hd, dtype, seed=hd + nh + window)
    tables = scattered_tables(lens, block_size, num_blocks, g)
    q = torch.randn(len(lens), nh + nkv, hd, generator=g).to(dtype).to(DEVICE)[:, :nh]
    scale = hd ** -0.5
    for num_splits in sorted({1, 4, triton_attention.decode_num_splits(len(lens), nkv, max(lens))}):
        out = torch.full((len(lens), nh, hd), float("nan"), dtype=dtype, device=DEVICE)
        triton_attention.decode_attention(q, k_cache, v_cache, tables.to(DEVICE), torch.tensor(lens, device=DEVICE),
                                          scale, out, num_splits, sliding_window=window)
        for i, n in enumerate(lens):
            ref = dense(q[i:i + 1], k_cache, v_cache, tables[i].tolist(), n, [n - 1], scale, window)
            err = (out[i:i + 1].double().cpu() - ref).abs().max().item()
            assert err < TOLERANCE[dtype], (num_splits, i, n, err)


# head size, query heads, KV heads, block size, chunks (positions cached, chunk tokens), sliding window
WINDOWED_PREFILL_CASES = [
    (64, 8, 2, 16, [(0, 70), (32, 7), (5, 40)], 5),   # windows far shorter than a tile of queries (32)
    (128, 4, 1, 3, [(0, 1), (12, 17), (40, 30)], 20),  # a window longer than a chunk, odd block sizes
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,nh,nkv,block_size,chunks,window", WINDOWED_PREFILL_CASES)
def test_windowed_prefill_chunks_match_dense(hd, nh, nkv, block_size, chunks, window, dtype):
    from engine.kernels import triton_attention

    ends = [start + n for start, n in chunks]
    num_blocks = sum(-(-e // block_size) for e in ends) + 2
    k_cache, v_cache, g = paged_cache(num_blocks, block_size, nkv, hd, dtype, seed=3 * hd + window)
    tables = scattered_tables(ends, block_size, num_blocks, g)
    num_tokens = sum(n for _, n in chunks)
    q = torch.randn(num_tokens, nh + nkv, hd, generator=g).to(dtype).to(DEVICE)[:, :nh]
    rows = [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    meta = torch.tensor([rows, [n for _, n in chunks], [s for s, _ in chunks]], device=DEVICE)
    out = torch.full((num_tokens, nh, hd), float("nan"), dtype=dtype, device=DEVICE)
    scale = hd ** -0.5
    triton_attention.prefill_attention(q, k_cache, v_cache, tables.to(DEVICE), meta, max(n for _, n in chunks),
                                       scale, out, sliding_window=window)
    for (start, n), row, table in zip(chunks, rows, tables.tolist()):
        ref = dense(q[row:row + n], k_cache, v_cache, table, start + n, list(range(start, start + n)), scale, window)
        err = (out[row:row + n].double().cpu() - ref).abs().max().item()
        assert err < TOLERANCE[dtype], (start, n, err)


def test_split_count_fills_the_gpu_and_stays_a_power_of_two():
    from engine.kernels.triton_attention import decode_num_splits

    assert decode_num_splits(1, 8) == 16          # 8 programs alone would leave most of a GPU idle
    assert decode_num_splits(64, 8) == 1          # 512 programs already
    assert decode_num_splits(4, 8, max_context_len=100) == 2   # no more splits than 64-token tiles
    assert all(bin(decode_num_splits(b, h)).count("1") == 1 for b in range(1, 70) for h in (1, 2, 8))


@pytest.mark.triton_interpreted  # the engine on CUDA is tests/engine/test_cuda.py's
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_engine_on_paged_inputs_matches_dense_reference(make_engine, tiny_loaded, monkeypatch, attention):
    """The whole engine on the runner's one-copy inputs (as on CUDA), attending with the Triton kernels
    (chunk tables, splits) or with the SDPA fallback over the same inputs: chunked prefill mixed with
    decodes, prefix-cache hits, block size 3, against the dense forward."""
    from tests.helpers.engine_runs import capture_logits, run_with_a_late_arrival
    from tests.helpers.reference_model import reference_forward

    monkeypatch.setenv("KVTRACE_CPU_KERNELS", "0")
    monkeypatch.setenv("KVTRACE_TRITON", "1" if attention == "triton" else "0")
    engine = make_engine(block_size=3, max_num_batched_tokens=11, enable_prefix_caching=True)
    assert engine.model.use_triton == (attention == "triton")
    engine.runner.paged_inputs = True
    seen = capture_logits(engine)
    shared = list(range(20, 29))
    prompts = [[5, 6], list(range(30, 47)), shared + [7, 8], shared + [9]]
    run_with_a_late_arrival(engine, prompts, max_tokens=4)
    assert sum(s.num_prefix_hit_tokens for s in engine.outputs.values()) == 9  # 3 full blocks shared
    worst = max((reference_forward(tiny_loaded.config, tiny_loaded.weights, tokens)[-1] - logits).abs().max().item()
                for tokens, logits in seen)
    assert len(seen) == 4 * len(prompts) and worst < 1e-4, worst


@pytest.mark.triton_interpreted
@pytest.mark.parametrize("shape", ["all", "mixed"])
def test_windowed_engine_on_paged_inputs_matches_dense_reference(make_engine, monkeypatch, shape):
    """Sliding windows (every layer; beside full layers) through the Triton kernels on the runner's paged
    inputs: chunked prefill, decodes, a prefix-cache hit past the window (tests/engine/test_sliding_window.py)."""
    from tests.engine.test_sliding_window import WINDOWED, run_windowed, windowed
    from tests.helpers.reference_model import reference_forward

    monkeypatch.setenv("KVTRACE_CPU_KERNELS", "0")
    loaded = windowed(*WINDOWED[shape])
    seen = run_windowed(make_engine, loaded, paged_inputs=True)
    worst = max((reference_forward(loaded.config, loaded.weights, tokens)[-1] - logits).abs().max().item()
                for tokens, logits in seen)
    assert worst < 1e-4, worst


@pytest.mark.triton_interpreted
def test_per_group_tables_through_the_kernels(monkeypatch):
    """Two KV-cache groups sharing one KV tensor, the windowed group's dropped blocks null (NaN in block 0),
    through the Triton kernels on the runner's paged inputs (tests/engine/test_hybrid_forward.py)."""
    from tests.engine.test_hybrid_forward import check_per_group_run

    monkeypatch.setenv("KVTRACE_CPU_KERNELS", "0")
    check_per_group_run(paged_inputs=True)
