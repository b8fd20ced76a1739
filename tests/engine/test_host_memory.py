"""Large host buffers land on 2 MiB pages where the kernel allows it (engine/kernels/host_memory.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import host_memory


def thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_buffers_are_plain_and_large_ones_aligned():
    small = host_memory.empty(1000)
    assert small.numel() == 1000 and small.dtype == torch.float32
    big = host_memory.empty(3 * host_memory.HUGE_PAGE // 4 + 5)
    assert big.numel() == 3 * host_memory.HUGE_PAGE // 4 + 5 and big.is_contiguous()
    assert big.data_ptr() % host_memory.HUGE_PAGE == 0
    big.fill_(1.5)
    assert float(big.sum()) == 1.5 * big.numel()


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason=f"transparent huge pages: {thp_mode()}")
def test_large_buffers_are_backed_by_huge_pages():
    buffer = host_memory.empty(8 * host_memory.HUGE_PAGE // 4).zero_()  # 8 huge pages, touched
    assert anon_huge_kib(buffer.data_ptr()) >= 2048  # the kernel may be short of free huge pages: ask for one


def test_pinned_swap_space_registers_exactly_its_bytes(monkeypatch):
    """Swap space is pinned to the byte: not through torch's caching host allocator, which rounds a
    request up to the next power of two (40 GiB of swap pinned 64 GiB). Registration is mocked here:
    the driver call needs a GPU."""
    import gc

    registered, unregistered = [], []
    monkeypatch.setattr(host_memory, "_host_register", lambda address, nbytes: registered.append((address, nbytes)))
    monkeypatch.setattr(host_memory, "_host_unregister", unregistered.append)
    numel = 5 * (1 << 20) + 3  # 20 MiB + 12 B of fp32: far from a power of two
    swap = host_memory.pinned_empty(numel).view(-1)[: numel]
    assert registered == [(swap.data_ptr(), numel * 4)]
    assert swap.numel() == numel
    del swap
    gc.collect()
    assert unregistered == [registered[0][0]]  # unregistered once the last view is gone, not before
