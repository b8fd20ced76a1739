"""Shared fixtures: the tiny model's weights (loaded once) and an engine factory."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from engine.build import build_engine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_weights
from kvtrace.trace import db
from tests.helpers.tracegen import recompute_run, swap_run

# The SQL library under test is this checkout's analyses/ folder: an editable install made from
# another checkout (a git worktree beside it) maps `kvtrace.analyses` to that checkout's folder, and
# the tests would check its SQL instead. (Subprocesses that run `python -m kvtrace` still use the
# install's.)
CHECKOUT_ANALYSES = Path(__file__).resolve().parent.parent / "analyses"
if Path(str(db.analyses_dir())).resolve() != CHECKOUT_ANALYSES:
    db.analyses_dir = lambda: CHECKOUT_ANALYSES

# CI fails on unexpected skips (tests/helpers/strict_skips.py); pytester runs that plugin in a test of its own
pytest_plugins = ["tests.helpers.strict_skips", "pytester"]

# Hypothesis profiles. `ci` (chosen when CI=true): derandomised, the same examples every run, so a
# test catches a bug or not, never by luck. `thorough` (locally: --hypothesis-profile thorough):
# random, ten times the examples. Without either, Hypothesis's default (random, 100 examples).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("thorough", max_examples=1000)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_loaded():
    return load_weights("tiny", "dummy", dtype=torch.float32, seed=0)


@pytest.fixture
def make_engine(tiny_loaded):
    def make(tracer=None, loaded=None, **overrides) -> LLMEngine:
        # float32 everywhere: on CUDA `auto` would run tiny in bf16, and the CUDA tests were written for fp32
        settings = dict(model="tiny", load_format="dummy", dtype="float32", block_size=4, num_gpu_blocks=256,
                        watermark=0.0)
        settings.update(overrides)
        return build_engine(EngineConfig(**settings), tracer, loaded=loaded or tiny_loaded)
    return make


def pytest_collection_modifyitems(config, items):
    """CUDA-only tests skip cleanly on machines without a GPU. The Triton kernel cases run under the
    interpreter (TRITON_INTERPRET=1, in the subprocess that test_kernels_under_the_interpreter starts)
    or on a GPU; elsewhere they are left out of the run, not skipped, since that subprocess runs them."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    cuda = torch.cuda.is_available()
    left_out = [item for item in items
                if ("triton_kernels" in item.keywords and not (interpreted or cuda))
                or ("triton_interpreted" in item.keywords and not interpreted)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    if cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A folder holding the two hand-built golden runs (tests/helpers/tracegen.py)."""
    root = tmp_path_factory.mktemp("runs")
    recompute_run(root)
    swap_run(root)
    return root


