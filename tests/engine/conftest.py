"""Fixtures of the engine's tests."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.model.linear import pick_kernel

# each kernel path the engine can take on CPU, chosen through the switches users have
KERNEL_SWITCHES = {"kvtrace": {}, "onednn": {"KVTRACE_CPU_KERNELS": "0"},
                   "torch": {"KVTRACE_CPU_KERNELS": "0", "KVTRACE_ONEDNN": "0"}}


@pytest.fixture(params=list(KERNEL_SWITCHES))
def kernel(request, monkeypatch):
    """Each CPU kernel path in turn (skipped where this machine has no such kernels)."""
    for name, value in KERNEL_SWITCHES[request.param].items():
        monkeypatch.setenv(name, value)
    if pick_kernel(torch.device("cpu"), torch.float32) != request.param:
        pytest.skip(f"{request.param} kernels unavailable here ({cpu_kernels.unavailable_reason()})")
    return request.param
