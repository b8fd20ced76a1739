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
NO_AVX512 = """
def test_needs_avx512():
    pytest.skip("kvtrace kernels unavailable here (this CPU has no AVX-512)")
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


@pytest.mark.parametrize("has_avx512, code", [(False, 0), (True, 1)])
def test_a_missing_avx512_may_skip_only_where_the_cpu_lacks_it(pytester, monkeypatch, has_avx512, code):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("KVTRACE_STRICT_SKIPS", raising=False)
    pytester.makeconftest(f"import tests.helpers.strict_skips as s\ns.cpu_has_avx512 = lambda: {has_avx512}\n"
                          "pytest_plugins = ['tests.helpers.strict_skips']\n")
    pytester.makepyfile(test_demo="import pytest\n" + NO_AVX512)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == code, result.stdout.str()
