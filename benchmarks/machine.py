"""What a result was measured on: the machine, its load, and the software versions."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

import kvtrace
from kvtrace.record.run import cpu_name

REPO = Path(__file__).resolve().parent.parent


def memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024**2
    return float("nan")


def load_average() -> str:
    """The 1-minute load average: other processes on a shared machine make timings noisy."""
    return f"{os.getloadavg()[0]:.1f}"


def git_revision() -> str:
    """Short commit, with '+changes' when a tracked file differs from it (but the results that the
    suites themselves write: RESULTS.md and log/)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks/RESULTS.md",
                                ":(exclude)benchmarks/log"], cwd=REPO).returncode
        return rev + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def describe_machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, {memory_gib():.1f} GiB memory, {platform.system()}"


def has_avx512() -> bool:
    """Whether the CPU has AVX-512, without which kvtrace's CPU kernels are off (engine/kernels/cpu_kernels.py)."""
    try:
        return any(line.startswith("flags") and " avx512f" in line
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def machine_cell() -> str:
    """The machine in a few words, for RESULTS.md's table: the CPU, whether it has AVX-512 (the
    CPU changes between sessions of a cloud VM, and the kernels with it), the cores."""
    return f"{cpu_name()}{' with AVX-512' if has_avx512() else ''}, {os.cpu_count()} cores"


def describe_software(revision: str | None = None) -> str:
    """Versions, and the commit (`revision`, else git_revision() now)."""
    return (f"Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), kvtrace {kvtrace.__version__} (git {revision or git_revision()})")
