"""A step's integer inputs (token ids, positions, slots, block tables...) on their way to the device.

On CUDA a `torch.tensor(list, device="cuda")` is a copy from pageable memory: the host waits for it,
and the stream can overlap nothing with it. Here every step writes its integers into one
preallocated host buffer (pinned on CUDA) and sends them with a single non-blocking copy into a
preallocated device buffer; the tensors the step uses are views of that buffer. Two host buffers
alternate, so a step never writes into memory that the previous step's copy may still be reading;
the older one's copy finished long ago (the end of the step between them read tokens from the
device), which `_reuse` checks without waiting unless it must.
"""
from __future__ import annotations

import numpy as np
import torch


class StepInputs:
    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._turn = 0
        self._host: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.is_cuda) for _ in range(2)]
        self._device = torch.empty(capacity, dtype=torch.int64, device=self.device) if self.is_cuda else None

    def host(self, n: int) -> np.ndarray:
        """The next host buffer's first n int64 values, to fill and then `send(n)`."""
        self._turn ^= 1
        self._reuse(self._turn)
        if n > self.capacity:
            self._reuse(self._turn ^ 1)
            self._allocate(max(n, 2 * self.capacity))
        return self._host[self._turn].numpy()[:n]

    def send(self, n: int) -> torch.Tensor:
        """The n values just written, as a device tensor (valid until the next `send` on CUDA)."""
        host = self._host[self._turn][:n]
        if not self.is_cuda:
            return host.clone()
        dev = self._device[:n]
        dev.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copied[self._turn] = event
        return dev

    def _reuse(self, turn: int) -> None:
        event = self._copied[turn]
        if event is not None and not event.query():
            event.synchronize()  # only when no step end came between two copies (not seen in practice)
        self._copied[turn] = None
