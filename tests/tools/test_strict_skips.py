"""CI fails on a skip other than `cuda` and `external` (tests/helpers/strict_skips.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DEMO = """
import pytest

def test_runs():
    pass

@pytest.mark.cuda
def test_needs_a_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.external
def test_needs_an_outside_tool():
    pytest.skip("no trace_processor binary")
"""
HIDDEN = """
@pytest.mark.skipif(True, reason="no chromium binary")
def test_hidden_area():
    pass
"""


@pytest.mark.parametrize("env, hidden, code", [
    ({"CI": "true"}, False, 0),
    ({"CI": "true"}, True, 1),
    ({}, True, 0),
])
def test_unexpected_skips_fail_ci(pytester, monkeypatch, env, hidden, code):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KVTRACE_STRICT_SKIPS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pytester.makeini("[pytest]\nmarkers =\n    cuda: gpu\n    external: outside tool\n")
    pytester.makepyfile(test_demo=DEMO + (HIDDEN if hidden else ""))
    result = pytester.runpytest_subprocess("-p", "tests.helpers.strict_skips", "-p", "no:cacheprovider")
    assert result.ret == code, result.stdout.str()
    out = result.stdout.str()
    if hidden:
        assert "test_demo.py::test_hidden_area: no chromium binary" in out
        assert ("unexpected skips: the run FAILS" in out) == bool(env)
    if env:  # the allowed skips are listed with their reasons
        assert "test_demo.py::test_needs_an_outside_tool: no trace_processor binary" in out
