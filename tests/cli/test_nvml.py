"""NVML sampling (kvtrace/record/nvml.py) against a fake pynvml: the right GPU for a CUDA ordinal, and a
field the device does not support leaves the others sampled."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from kvtrace.record.nvml import NvmlSampler


class NotSupported(Exception):
    pass


def fake_pynvml(gpus: list[dict]):
    """gpus: NVML's view, in NVML order; each {uuid, bus, mem, unsupported: set of query names}."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]

    def by(key, value):
        for gpu in gpus:
            if gpu[key] == value:
                return gpu
        raise NotSupported(f"no GPU with {key} {value}")

    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: by("uuid", uuid)
    nvml.nvmlDeviceGetHandleByPciBusId_v2 = lambda bus: by("bus", bus)

    def query(name, answer):
        def call(gpu, *args):
            if name in gpu.get("unsupported", ()):
                raise NotSupported(name)
            return answer(gpu, *args)
        return call

    nvml.nvmlDeviceGetMemoryInfo = query("memory", lambda g: SimpleNamespace(used=g["mem"]))
    nvml.nvmlDeviceGetUtilizationRates = query("util", lambda g: SimpleNamespace(gpu=50))
    nvml.nvmlDeviceGetPcieThroughput = query("pcie", lambda g, counter: 1000 + counter)
    nvml.nvmlDeviceGetPowerUsage = query("power", lambda g: 250_000)
    return nvml


GPUS = [{"uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", "bus": f"00000000:{0x10 + i:02x}:00.0",
         "mem": (i + 1) << 30} for i in range(4)]


@pytest.fixture
def cuda_sees(monkeypatch):
    """Pretend CUDA shows the given NVML GPUs (as CUDA_VISIBLE_DEVICES would), by ordinal."""
    def install(nvml_indices: list[int], *, uuid=True, pci=True, gpus=GPUS):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus))

        def props(ordinal):
            gpu = gpus[nvml_indices[ordinal]]
            bus = int(gpu["bus"].split(":")[1], 16)
            return SimpleNamespace(uuid=gpu["uuid"][4:] if uuid else None,
                                   pci_bus_id=bus if pci else None, pci_device_id=0, pci_domain_id=0)

        monkeypatch.setattr(torch.cuda, "get_device_properties", props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return install


def sampler(device: str) -> NvmlSampler:
    return NvmlSampler(torch.device(device), writer=None, clock=lambda: 1.5)


def test_cuda_ordinal_maps_to_its_gpu_by_uuid_not_by_index(cuda_sees):
    cuda_sees([2, 3])  # CUDA_VISIBLE_DEVICES=2,3: cuda:1 is NVML's GPU 3
    s = sampler("cuda:1")
    assert s.enabled and "UUID" in s.reason
    assert s.sample()["mem_used_bytes"] == 4 << 30


def test_pci_bus_id_when_there_is_no_uuid(cuda_sees):
    cuda_sees([3, 1], uuid=False)
    s = sampler("cuda:1")
    assert "PCI bus id" in s.reason and s.sample()["mem_used_bytes"] == 2 << 30


def test_cuda_visible_devices_when_nothing_else_identifies_it(cuda_sees, monkeypatch):
    cuda_sees([3, 1], uuid=False, pci=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert sampler("cuda:1").sample()["mem_used_bytes"] == 2 << 30
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    s = sampler("cuda:1")  # four GPUs, nothing to tell them apart: off, and says why
    assert not s.enabled and "cannot tell which NVML device" in s.reason


def test_an_unsupported_field_leaves_the_others_sampled(cuda_sees):
    gpus = [dict(GPUS[0], unsupported={"pcie"})]  # PCIe counters are often missing in a VM
    cuda_sees([0], gpus=gpus)
    s = sampler("cuda")
    assert s.enabled and s.fields == ["mem_used_bytes", "util_pct", "power_w"]
    assert "pcie_tx_bytes_s" in s.reason
    row = s.sample()
    assert row == {"ts_s": 1.5, "mem_used_bytes": 1 << 30, "util_pct": 50.0, "pcie_tx_bytes_s": None,
                   "pcie_rx_bytes_s": None, "power_w": 250.0}
    gpus[0]["unsupported"] = {"pcie", "util"}  # a field failing later (MIG reconfigured): still a row
    assert s.sample()["util_pct"] is None and s.sample()["mem_used_bytes"] == 1 << 30
    gpus[0]["unsupported"] = {"pcie", "util", "memory", "power"}
    assert s.sample() is None


def test_no_field_answered_means_sampling_is_off(cuda_sees):
    cuda_sees([0], gpus=[dict(GPUS[0], unsupported={"pcie", "util", "memory", "power"})])
    s = sampler("cuda")
    assert not s.enabled and s.fields == [] and "answers none" in s.reason
