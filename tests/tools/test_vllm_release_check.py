"""scripts/vllm_release_check.sh: its input. What it checks on a release is the vLLM tests' own
(tests/vllm_sched, tests/vllm/test_capture_on_vllm.py); its run on 0.34.0 is in docs/vllm.md."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_release_check.sh"


@pytest.mark.parametrize("given", [[], ["latest"], ["0.34"], ["0.34.0; rm -rf /"]],
                         ids=["none", "a-word", "two-parts", "a-command"])
def test_a_release_that_is_not_a_version_is_one_line_and_exit_2(given, tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), *given], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KVTRACE_RELEASE_CHECK_LOGS": str(tmp_path / "logs")})
    assert done.returncode == 2, done
    assert done.stdout == "" and done.stderr.count("\n") == 1 and done.stderr.startswith("error: give a vLLM release")
    assert not (tmp_path / "logs").exists()   # nothing built, nothing written
