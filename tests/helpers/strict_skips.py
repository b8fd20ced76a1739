"""A pytest plugin: under CI=true (or KVTRACE_STRICT_SKIPS=1) the run fails on an unexpected skip.

A skip can hide a whole area (no C compiler: the kernels; no weights: the real-model tests; no
Chromium: the browser test; no huge pages) while CI stays green. Only tests marked `cuda` (no GPU
on CI) or `external` (they need a tool that scripts/setup.sh cannot install; their reasons are
printed) may skip there, `vllm` where scripts/test.sh could not build vLLM's environment
(KVTRACE_VLLM_UNAVAILABLE says why), and a test of kvtrace's CPU kernels that skips because "this
CPU has no AVX-512", when /proc/cpuinfo agrees (hardware, like a GPU: CI's machine may lack it). KVTRACE_STRICT_SKIPS=0 turns it off under CI=true too (the
mutation check does: a skipped test cannot kill a mutant, and the machine may lack what it needs).
Loaded by tests/conftest.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ALLOWED_SKIP_MARKERS = ("cuda", "external")
# the vLLM-capture tests may skip only where scripts/test.sh could not build vLLM's environment
if os.environ.get("KVTRACE_VLLM_UNAVAILABLE"):
    ALLOWED_SKIP_MARKERS += ("vllm",)
NO_AVX512 = "this CPU has no AVX-512"  # engine/kernels/cpu_kernels.py's reason
STRICT_SKIPS = (os.environ.get("CI") == "true" or os.environ.get("KVTRACE_STRICT_SKIPS") == "1") \
    and os.environ.get("KVTRACE_STRICT_SKIPS") != "0"
_skips: dict[str, list[tuple[str, str]]] = {"allowed": [], "unexpected": []}


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def cpu_has_avx512() -> bool:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512f" in flags.split()


def pytest_runtest_logreport(report):
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    allowed = any(marker in report.keywords for marker in ALLOWED_SKIP_MARKERS) \
        or (NO_AVX512 in _skip_reason(report) and not cpu_has_avx512())
    _skips["allowed" if allowed else "unexpected"].append((report.nodeid, _skip_reason(report)))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if STRICT_SKIPS and _skips["unexpected"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if STRICT_SKIPS and _skips["allowed"]:
        terminalreporter.section("skips allowed in CI (cuda / external / no AVX-512 here)")
        for node, why in _skips["allowed"]:
            terminalreporter.line(f"{node}: {why}")
    if _skips["unexpected"]:
        title = "unexpected skips: the run FAILS" if STRICT_SKIPS else "skips (CI=true would fail on these)"
        terminalreporter.section(title, red=STRICT_SKIPS)
        for node, why in _skips["unexpected"]:
            terminalreporter.line(f"{node}: {why}")
