"""Linear layers with their weight prepared once for the fastest kernel this device has.

On CPU in fp32, in order of preference:
- kvtrace's own kernel (engine/kernels/cpu_kernels.py) on weights packed into column panels: it reads the
  weights at close to memory bandwidth at decode batch sizes (1.3-1.6x oneDNN's rate at 1-8 rows
  here, `python -m benchmarks kernels`) and matches oneDNN's FLOP rate on prefill batches;
- oneDNN's linear on weights reordered into its blocked layout (what vLLM's CPU backend does),
  about 2x faster than F.linear (MKL) at decode batch sizes;
- F.linear.
Elsewhere, F.linear. `KVTRACE_CPU_KERNELS=0` and `KVTRACE_ONEDNN=0` turn the first two off. Each
kernel computes the same products and sums in its own order: results differ in the last bits.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels

# oneDNN picks its blocked weight layout for this many rows; any row count runs on it
_ONEDNN_BATCH_HINT = 32


def pick_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """'kvtrace', 'onednn' or 'torch'."""
    if device.type != "cpu" or dtype != torch.float32:
        return "torch"
    if cpu_kernels.load() is not None:
        return "kvtrace"
    if os.environ.get("KVTRACE_ONEDNN", "1") != "0" and _onednn_linear_works():
        return "onednn"
    return "torch"


@functools.cache
def _onednn_linear_works() -> bool:
    """The oneDNN ops are private torch API: check once that they exist here and agree with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
        x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, weight), atol=1e-4, rtol=1e-4))
    except (RuntimeError, AttributeError, TypeError):
        return False


class Linear:
    """y = x W^T (+ b), W: [out_features, in_features] as checkpoints store it."""

    __slots__ = ("kernel", "weight", "bias", "out_features", "in_features", "weight_ptr", "bias_ptr", "_kernels")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str,
                 packed_into: torch.Tensor | None = None) -> None:
        """`packed_into`: for the kvtrace kernel, where to put the packed weight (a slice of a bigger
        buffer, see engine/kernels/host_memory.py); else a buffer of its own."""
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._kernels = cpu_kernels.load() if kernel == "kvtrace" else None
        if kernel == "kvtrace":
            self.weight = self._kernels.pack_weight(weight, packed_into)
        elif kernel == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
        else:
            self.weight = weight
        # for callers that hand raw pointers to kvtrace's kernels (engine/model/cpu_forward.py)
        self.weight_ptr = self.weight.data_ptr() if kernel == "kvtrace" else None
        self.bias_ptr = None if bias is None or kernel != "kvtrace" else bias.data_ptr()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weight proper (not of any padding the packed layout adds)."""
        return self.out_features * self.in_features * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:
            return self._kernels.linear(x, self.weight, self.out_features, self.bias)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
