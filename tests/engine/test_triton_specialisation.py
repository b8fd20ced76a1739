"""The eager Triton launches compile once per model: every argument that Triton specialises on (a
pointer's 16-byte alignment, an integer's divisibility by 16 or equality to 1) has the same key in
every step, whatever the batch. Otherwise a kernel recompiles mid-run (1.4-3.6 s a variant on an
H200), inside the step times. Checked with Triton's own specialisation function on the arguments
the runner passes, the kernels themselves replaced by recorders (no GPU, no interpreter needed)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from engine.sequence import SamplingParams  # noqa: E402
from tests.helpers.engine_runs import run_checked  # noqa: E402


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` records, by its
    constexprs (a designed, bounded set of variants: NUM_SPLITS is a power of two up to 16), the key
    Triton would compile under for the other arguments, honouring the kernel's do_not_specialize, and
    writes zeros to its output."""

    def __init__(self, kernel) -> None:
        self.params = [p for p in kernel.params if not p.is_constexpr]
        self.keys: dict[tuple, set[tuple]] = {}

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            assert len(args) == len(self.params)
            self.keys.setdefault(tuple(sorted(constexprs.items())), set()).add(tuple(
                (p.name, native_specialize_impl(BaseBackend, a, False, not p.do_not_specialize,
                                                not p.do_not_specialize_on_alignment))
                for p, a in zip(self.params, args)))
            args[[p.name for p in self.params].index("out_ptr")].zero_()
        return launch


def test_every_eager_launch_has_the_same_specialisation_key(make_engine, monkeypatch):
    from engine.kernels import triton_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # the runner takes the Triton path on CPU tensors
    recorders = {name: Recorder(getattr(triton_kernels, name))
                 for name in ("decode_kernel", "merge_splits_kernel", "prefill_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(triton_kernels, name, recorder)
    # bf16: torch's ops, not kvtrace's fp32 CPU kernels; a small token budget mixes decodes with chunks
    engine = make_engine(dtype="bfloat16", max_num_batched_tokens=40, enable_prefix_caching=False)
    assert engine.model.use_triton and engine.runner.paged_inputs
    rng = random.Random(5)
    for i in range(24):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 70))]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True))
        if i % 3 == 0:
            engine.step()   # staggered: batches of every mix of decodes and chunks, tables of many widths
    run_checked(engine)
    for name, recorder in recorders.items():
        assert recorder.keys, f"{name} never launched"
        for constexprs, keys in recorder.keys.items():
            assert len(keys) == 1, (name, constexprs, _differing(keys))


def _differing(keys: set[tuple]) -> dict:
    """Each argument whose key differs between launches, with the keys seen."""
    columns = list(zip(*keys))
    return {column[0][0]: sorted({str(k[1]) for k in column}) for column in columns if len(set(column)) > 1}
