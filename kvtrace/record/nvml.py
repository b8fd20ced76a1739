"""GPU samples from NVML at about 10 Hz, on a background thread (never the engine's).

The engine's CUDA ordinal is not an NVML index: CUDA numbers only the devices CUDA_VISIBLE_DEVICES
shows (and by default fastest first), NVML numbers every GPU by PCI bus. The device is found by its
UUID (what torch reports for the ordinal), else by its PCI bus id, else through CUDA_VISIBLE_DEVICES.
Each quantity is its own query: one the device does not support (PCIe throughput in many VMs,
utilisation under MIG) is left out, the others are still sampled. meta.json names the fields sampled.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# gpu_samples column -> how to read it from NVML (nvml module, device handle)
QUERIES: dict[str, Callable] = {
    "mem_used_bytes": lambda nvml, h: int(nvml.nvmlDeviceGetMemoryInfo(h).used),
    "util_pct": lambda nvml, h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
    "pcie_tx_bytes_s": lambda nvml, h: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024.0,
    "pcie_rx_bytes_s": lambda nvml, h: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024.0,
    "power_w": lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # mW -> W
}


class NvmlSampler:
    def __init__(self, device: torch.device | None, writer, *, clock: Callable[[], float], interval_s: float = 0.1) -> None:
        self.writer = writer
        self.clock = clock
        self.interval_s = interval_s
        self.enabled = False
        self.reason = "not a CUDA device"
        self.fields: list[str] = []   # the gpu_samples columns this device answers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if device is None or device.type != "cuda":   # None: the simulated engine's
            return
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install 'kvtrace[gpu]')"
            return
        try:
            pynvml.nvmlInit()
            import torch

            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle, how = nvml_handle(pynvml, index)
        except Exception as exc:  # no driver, no permission, no match: sampling is off, and says why
            self.reason = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml
        self.fields = [name for name, query in QUERIES.items() if _answers(query, pynvml, self._handle)]
        if not self.fields:
            self.reason = f"NVML answers none of {', '.join(QUERIES)} for this device"
            return
        self.enabled = True
        left_out = [name for name in QUERIES if name not in self.fields]
        self.reason = "sampling at %.0f Hz (device found by %s)%s" % (
            1 / interval_s, how, f"; not supported here: {', '.join(left_out)}" if left_out else "")

    def start(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="kvtrace-nvml", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def sample(self) -> dict | None:
        """One row: every field that answered this time (the others None); None if none did."""
        row: dict = dict.fromkeys(QUERIES)
        for name in self.fields:
            try:
                row[name] = QUERIES[name](self._nvml, self._handle)
            except Exception:
                pass
        if all(row[name] is None for name in self.fields):
            return None
        row["ts_s"] = self.clock()
        return row

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            row = self.sample()
            if row is not None:
                self.writer.add_gpu_sample(row)


def _answers(query: Callable, nvml, handle) -> bool:
    try:
        query(nvml, handle)
        return True
    except Exception:
        return False


def nvml_handle(nvml, cuda_index: int) -> tuple[object, str]:
    """The NVML handle of CUDA device `cuda_index` and how it was found: by UUID, by PCI bus id, or
    by the CUDA_VISIBLE_DEVICES entry. LookupError when none of them identifies it."""
    import torch

    props = torch.cuda.get_device_properties(cuda_index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        for candidate in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(candidate), "UUID"
            except Exception:
                pass
    if getattr(props, "pci_bus_id", None) is not None:
        bus_id = "%08x:%02x:%02x.0" % (getattr(props, "pci_domain_id", 0), props.pci_bus_id, props.pci_device_id)
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id), "PCI bus id"
        except Exception:
            pass
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if cuda_index >= len(visible):
            raise LookupError(f"CUDA device {cuda_index} is not among CUDA_VISIBLE_DEVICES={','.join(visible)}")
        entry = visible[cuda_index]
        if entry.isdigit():  # NVML numbers by PCI bus, as CUDA does with CUDA_DEVICE_ORDER=PCI_BUS_ID
            return nvml.nvmlDeviceGetHandleByIndex(int(entry)), "CUDA_VISIBLE_DEVICES index"
        return nvml.nvmlDeviceGetHandleByUUID(entry), "CUDA_VISIBLE_DEVICES UUID"
    if nvml.nvmlDeviceGetCount() == 1:
        return nvml.nvmlDeviceGetHandleByIndex(0), "the only GPU"
    raise LookupError(f"cannot tell which NVML device is CUDA device {cuda_index} (no UUID or PCI bus id)")
