"""docs/incident.md's commands (scripts/incident.py's STEPS), run as the page runs them on a real
capture, here on the capture fixture: each succeeds, the request is found by the id its client sent,
times are the wall clock's, and the sweep needs no option copied from the run."""
from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "captures" / "bursts"


def test_the_incident_pages_commands_on_a_fixture_capture(tmp_path):
    incident = load_script("incident")
    capture = tmp_path / "capture"
    shutil.copytree(FIXTURE, capture)
    since, until = "2026-11-18T12:00:30Z", "2026-11-18T12:01:10Z"
    commands = incident.steps(capture, tmp_path, since, until, "kvt2", "12:00:40", "num_gpu_blocks=12,16,24")
    assert [c[0] for c in commands] == ["capture", "capture", "analyze", "explain", "explain", "calibrate", "sweep"]
    out = [incident.run_step(c, tmp_path) for c in commands[:2]]
    assert "1 server" in out[0] and "server 20261119T000008Z-24953" in out[0]
    assert "from 2026-11-18T12:00:30+00:00 to 2026-11-18T12:01:10+00:00" in out[1]
    assert incident.worst_moment(tmp_path / "runs" / "incident").count(":") == 2
    out += [incident.run_step(c, tmp_path) for c in commands[2:]]
    assert "thrash" in out[2].lower()
    assert out[3].startswith("kvt2-b46681fd in run incident") and "Z │" in out[3]      # wall-clock times
    assert "requests in flight at 12:00:40.000Z" in out[4]
    assert "fitted on" in out[5] and (tmp_path / "server.json").is_file()
    sweep = out[6]
    assert "sweep: from the run: --model smollm2-135m" in sweep and "--engine sim" in sweep
    assert "sweep: unfinished:" in sweep and "sweep: window:" in sweep
    last = sweep.splitlines()[-1]
    assert last.startswith(("No knee", "num_gpu_blocks")) and "TTFT p99" in last, last
    if not last.startswith("No "):
        assert "the best point as vLLM engine arguments: --num-gpu-blocks-override" in sweep
