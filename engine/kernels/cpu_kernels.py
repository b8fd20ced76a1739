"""kvtrace's own CPU kernels (engine/kernels/csrc/cpu_kernels.c): built once per machine, loaded with ctypes.

The library is compiled with the system C compiler (`$CC`, else `gcc`, else `cc`) and `-march=native` into
the cache folder, named by a hash of the source, the flags and this CPU, so a changed source or
another machine gets its own build. Without a compiler, without AVX-512, if the build or the
self-check fails, or with `KVTRACE_CPU_KERNELS=0`, `load()` returns None and the model keeps its
torch path; `unavailable_reason()` says why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import cache_root

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

PANEL = 32  # output columns per packed panel (NR in the C source)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_reason: str | None = None


class CpuKernels:
    """Typed wrappers over the library's functions; tensors must be contiguous fp32 on the CPU."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.kvt_packed_numel.restype = _i64
        lib.kvt_packed_numel.argtypes = [_i64, _i64]
        lib.kvt_pack_weight.argtypes = [_ptr, _ptr, _i64, _i64]
        lib.kvt_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        lib.kvt_paged_decode_attention.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64,
                                                   _i64, _i64, _i64, _f32, _ptr]
        lib.kvt_rms_norm.argtypes = [_ptr, _ptr, _ptr, _f32, _i64, _i64, _ptr]
        lib.kvt_silu_mul.argtypes = [_ptr, _i64, _i64, _ptr]
        lib.kvt_rope_and_cache.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr]

    def pack_weight(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] -> the panel layout `linear` reads (flat, zero-padded to whole panels), written
        into `out` (packed_numel(out, in) contiguous fp32 elements) when given."""
        weight = weight.contiguous()
        n, k = weight.shape
        if out is None:
            out = torch.empty(packed_numel(n, k), dtype=torch.float32, device="cpu")
        assert out.is_contiguous() and out.dtype == torch.float32 and out.numel() == packed_numel(n, k)
        self.lib.kvt_pack_weight(weight.data_ptr(), out.data_ptr(), n, k)
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] -> [rows, out_features]"""
        if not x.is_contiguous():
            x = x.contiguous()
        rows, k = x.shape
        assert x.dtype == torch.float32 and packed.numel() == packed_numel(out_features, k), \
            "x must be fp32 with as many columns as the packed weight has inputs"
        y = torch.empty(rows, out_features, dtype=torch.float32, device="cpu")
        self.lib.kvt_linear(x.data_ptr(), rows, k, packed.data_ptr(), out_features,
                            None if bias is None else bias.data_ptr(), y.data_ptr())
        return y

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """x: [rows, dim], contiguous, becomes x + residual in place (when given); returns
        RMSNorm(x) * weight as a new [rows, dim]."""
        assert x.is_contiguous() and x.dtype == torch.float32 and weight.shape == x.shape[1:]
        assert residual is None or (residual.is_contiguous() and residual.shape == x.shape)
        rows, dim = x.shape
        out = torch.empty_like(x)
        self.lib.kvt_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              eps, rows, dim, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, up) -> [rows, inter] = silu(gate) * up"""
        assert gate_up.is_contiguous() and gate_up.dtype == torch.float32
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=torch.float32, device="cpu")
        self.lib.kvt_silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin_signed: torch.Tensor, num_heads: int, num_kv_heads: int, slots: torch.Tensor,
                       k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        """qkv: [rows, (heads + 2 * kv_heads) * head_dim]; cos, sin_signed: [max_positions, head_dim];
        k_slots, v_slots: [num_slots, kv_heads, head_dim] receive each row's rotated k and its v at
        `slots`; returns the rotated q and k: [rows, heads + kv_heads, head_dim]."""
        rows, head_dim = qkv.shape[0], cos.shape[1]
        assert qkv.is_contiguous() and qkv.dtype == torch.float32
        assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        assert positions.dtype == torch.int64 and slots.dtype == torch.int64
        assert 0 <= int(positions.min()) and int(positions.max()) < cos.shape[0], "position past the RoPE table"
        assert 0 <= int(slots.min()) and int(slots.max()) < k_slots.shape[0], "slot past the KV cache"
        assert k_slots.is_contiguous() and v_slots.is_contiguous() and k_slots.shape == v_slots.shape
        qk = torch.empty(rows, num_heads + num_kv_heads, head_dim, dtype=torch.float32, device="cpu")
        self.lib.kvt_rope_and_cache(qkv.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                                    num_heads, num_kv_heads, head_dim, slots.data_ptr(), k_slots.data_ptr(),
                                    v_slots.data_ptr(), qk.data_ptr())
        return qk

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
        """q: [seqs, heads, head_dim] (rows may be strided); caches: [blocks, block_size, kv_heads, head_dim];
        block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64 -> [seqs, heads * head_dim].
        With a sliding window each query attends only the last `sliding_window` of its positions."""
        num_seqs, num_heads, head_dim = q.shape
        assert q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim, \
            "each query row must be [heads, head_dim], contiguous fp32"
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        assert block_tables.dtype == torch.int64 and block_tables.is_contiguous() and block_tables.shape[0] == num_seqs
        assert context_lens.dtype == torch.int64 and context_lens.is_contiguous() and context_lens.shape == (num_seqs,)
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        assert int(context_lens.max()) <= block_tables.shape[1] * block_size, "context longer than its block table"
        assert 0 <= int(block_tables.min()) and int(block_tables.max()) < num_blocks, "block id past the KV cache"
        out = torch.empty(num_seqs, num_heads * head_dim, dtype=torch.float32, device="cpu")
        check_attention(self.lib.kvt_paged_decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
            sliding_window or 0, scale, out.data_ptr()))
        return out


def packed_numel(out_features: int, in_features: int) -> int:
    """Elements of a packed [out, in] weight: whole panels of PANEL output columns."""
    return -(-out_features // PANEL) * PANEL * in_features


def check_attention(status: int) -> None:
    """Turn kvt_paged_decode_attention's status into an exception."""
    if status == 2:
        raise ValueError("paged decode attention: a sequence with no positions to attend to")
    if status:
        raise MemoryError("paged decode attention could not allocate its scratch buffers")


def unavailable_reason() -> str | None:
    """Why `load()` returns None (None if it does not)."""
    if os.environ.get("KVTRACE_CPU_KERNELS", "1") == "0":
        return "turned off by KVTRACE_CPU_KERNELS=0"
    _load()
    return _reason


def load() -> CpuKernels | None:
    """The kernels, built on first use; None where they cannot be had (see `unavailable_reason`)."""
    if os.environ.get("KVTRACE_CPU_KERNELS", "1") == "0":
        return None
    return _load()


@functools.cache
def _load() -> CpuKernels | None:
    global _reason
    if platform.machine() not in ("x86_64", "AMD64"):
        _reason = f"no kernels for {platform.machine()}"
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = str(exc).strip().splitlines()
        _reason = f"could not build or load {SOURCE.name}: {detail[0] if detail else type(exc).__name__}"
        return None
    if not lib.kvt_supported():
        _reason = "this CPU has no AVX-512"
        return None
    kernels = CpuKernels(lib)
    problem = _self_check(kernels)
    if problem:
        _reason = f"self-check failed: {problem}"
        return None
    return kernels


def _compiler() -> str:
    # gcc's -fopenmp links libgomp, which resolves to the copy torch has loaded; clang's would bring
    # a second OpenMP runtime, so a plain `cc` is only the last resort
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler (set CC, or install gcc)")


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    """Compile into the cache unless this source, these flags and this CPU already have a build there
    (looked up first: a machine with a cached build needs no compiler)."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    root = cache_root() / "kernels"
    target = root / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    cc = _compiler()
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            first_error = next((line for line in done.stderr.splitlines() if "error" in line), "")
            raise RuntimeError(f"{cc} exited with status {done.returncode}; {first_error}".rstrip("; "))
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _self_check(kernels: CpuKernels) -> str | None:
    """Compare with torch on shapes that exercise partial panels and partial row tiles."""
    if kernels.lib.kvt_packed_numel(45, 40) != packed_numel(45, 40):
        return f"the library's panel width is not PANEL = {PANEL}"
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(45, 40, generator=gen), torch.randn(45, generator=gen)
    x = torch.randn(11, 40, generator=gen)
    got = kernels.linear(x, kernels.pack_weight(weight), 45, bias)
    if not torch.allclose(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4):
        return "linear disagrees with torch"
    block_size, num_kv_heads, head_dim = 4, 2, 8
    k_cache = torch.randn(6, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(6, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.tensor([[5, 1, 3], [2, 0, 0]])
    lens = torch.tensor([10, 3])
    q = torch.randn(2, 4, head_dim, generator=gen)
    for window in (None, 5):   # a window that starts mid-block
        got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, window)
        for s in range(2):
            first = max(0, int(lens[s]) - window) if window else 0
            slots = [int(tables[s, t // block_size]) * block_size + t % block_size for t in range(first, int(lens[s]))]
            keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
            values = v_cache.view(-1, num_kv_heads, head_dim)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
            want = F.scaled_dot_product_attention(q[s].unsqueeze(1), keys, values, scale=0.3).reshape(-1)
            if not torch.allclose(got[s], want, atol=1e-5, rtol=1e-4):
                return f"paged decode attention (sliding window {window}) disagrees with torch"
    return None
