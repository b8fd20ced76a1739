"""Shared fixtures: the tiny model's weights (loaded once) and an engine factory."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from typer.testing import CliRunner

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_weights
from kvtrace.trace import db
from tests.tracegen import recompute_run, swap_run

# The SQL library under test is this checkout's analyses/ folder: an editable install made from
# another checkout (a git worktree beside it) maps `kvtrace.analyses` to that checkout's folder, and
# the tests would check its SQL instead. (Subprocesses that run `python -m kvtrace` still use the
# install's.)
CHECKOUT_ANALYSES = Path(__file__).resolve().parent.parent / "analyses"
if Path(str(db.analyses_dir())).resolve() != CHECKOUT_ANALYSES:
    db.analyses_dir = lambda: CHECKOUT_ANALYSES

# CI fails on unexpected skips (tests/strict_skips.py); pytester runs that plugin in a test of its own
pytest_plugins = ["tests.strict_skips", "pytester"]

# Hypothesis profiles. `ci` (chosen when CI=true): derandomised, the same examples every run, so a
# test catches a bug or not, never by luck. `thorough` (locally: --hypothesis-profile thorough):
# random, ten times the examples. Without either, Hypothesis's default (random, 100 examples).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("thorough", max_examples=1000)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


def examples(n: int) -> int:
    """A property test's example count: `n`, scaled by the loaded profile (x10 under `thorough`)."""
    return n * max(settings.default.max_examples // 100, 1)


@pytest.fixture(scope="session")
def tiny_loaded():
    return load_weights("tiny", "dummy", dtype=torch.float32, seed=0)


@pytest.fixture
def make_engine(tiny_loaded):
    def make(tracer=None, loaded=None, **overrides) -> LLMEngine:
        settings = dict(model="tiny", load_format="dummy", block_size=4, num_gpu_blocks=256, watermark=0.0)
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings), tracer, loaded=loaded or tiny_loaded)
    return make


def run_checked(engine: LLMEngine) -> None:
    """Step to completion, checking block accounting after every step."""
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    engine.flush()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    assert len(engine.block_manager.free_cpu_block_ids) == engine.block_manager.num_cpu_blocks, "host blocks leaked"


def probe_schedule(engine: LLMEngine, measure) -> list:
    """Call `measure(engine, out)` right after each scheduling decision (where the steps table's pool
    columns are read); return the list its results are appended to."""
    values = []
    schedule = engine.scheduler.schedule

    def probed():
        out = schedule()
        values.append(measure(engine, out))
        return out

    engine.scheduler.schedule = probed
    return values


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
    """A folder holding the two hand-built golden runs (tests/tracegen.py)."""
    root = tmp_path_factory.mktemp("runs")
    recompute_run(root)
    swap_run(root)
    return root


def one_line_error(args: list[str]) -> str:
    """Run the CLI; assert it failed with exit 2 and one `kvtrace: error:` line; return that line."""
    import kvtrace.cli  # noqa: F401  (registers every command)
    from kvtrace.cli.app import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), result.stderr
    return lines[0]

