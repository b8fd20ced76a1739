"""GPU samples from NVML at about 10 Hz, on a background thread (never the engine's)."""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class NvmlSampler:
    def __init__(self, device: torch.device, writer, *, clock: Callable[[], float], interval_s: float = 0.1) -> None:
        self.writer = writer
        self.clock = clock
        self.interval_s = interval_s
        self.enabled = False
        self.reason = "not a CUDA device"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install 'kvtrace[gpu]')"
            return
        try:
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # no driver, no permission: sampling is silently off
            self.reason = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml
        self.enabled = True
        self.reason = "sampling at %.0f Hz" % (1 / interval_s)

    def start(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="kvtrace-nvml", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        nvml, handle = self._nvml, self._handle
        while not self._stop.wait(self.interval_s):
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                tx = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES)  # KB/s
                rx = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
                power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # mW -> W
            except Exception:
                continue
            self.writer.add_gpu_sample({
                "ts_s": self.clock(), "mem_used_bytes": int(memory.used), "util_pct": float(util.gpu),
                "pcie_tx_bytes_s": tx * 1024.0, "pcie_rx_bytes_s": rx * 1024.0, "power_w": power,
            })
