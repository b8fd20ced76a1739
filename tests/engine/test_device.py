"""`--device`: a CUDA ordinal is made explicit and checked before anything is built (no GPU needed:
torch.cuda's device queries are stubbed)."""
from __future__ import annotations

import pytest
import torch

from engine.executor.model_runner import resolve_device


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cuda_ordinal_is_explicit(two_gpus):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)   # the current device, by number
    assert resolve_device("cpu") == torch.device("cpu")


def test_missing_cuda_device_is_a_clear_error(two_gpus):
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_no_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:1: CUDA is not available"):
        resolve_device("cuda:1")


def test_host_swap_copies_merge_neighbouring_blocks():
    from engine.executor.model_runner import consecutive_runs

    assert consecutive_runs([4, 5, 6, 9, 3, 4]) == [(0, 4, 3), (3, 9, 1), (4, 3, 2)]
    assert consecutive_runs([]) == [] and consecutive_runs([7]) == [(0, 7, 1)]
