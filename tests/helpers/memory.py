"""Peak memory of what torch allocates inside a block, on any device (a CPU too): PeakMemory."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    """Counts the storages that ops inside the `with` create (not views of their inputs, not in-place
    results), less those freed since: `peak` is the most bytes held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}   # storage address -> bytes
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if address in inputs or address in self.live:
                continue
            self.live[address] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, address)
        return out

    def _free(self, address: int) -> None:
        self.current -= self.live.pop(address, 0)
