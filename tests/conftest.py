"""Shared fixtures: the tiny model's weights (loaded once) and an engine factory."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_weights


@pytest.fixture(scope="session")
def tiny_loaded():
    return load_weights("tiny", "dummy", dtype=torch.float32, seed=0)


@pytest.fixture
def make_engine(tiny_loaded):
    def make(tracer=None, **overrides) -> LLMEngine:
        settings = dict(model="tiny", load_format="dummy", block_size=4, num_gpu_blocks=256, watermark=0.0)
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings), tracer, loaded=tiny_loaded)
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


def pytest_collection_modifyitems(config, items):
    """CUDA-only tests skip cleanly on machines without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
