"""scripts/gpu_check.sh returns everything in at most 8 files (what the lent GPU machine sends back
from $OUT), an archive holding each step's log however far it got; and fetch_gpu_wheels.sh carries
only pinned wheels of what the machine's image lacks. Here, without a GPU, the CUDA steps fail fast."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["env", "install", "pytest", "swap", "record", "analyze", "calibrate", "roofline", "tracing", "syncs"]


def test_the_gpu_check_leaves_at_most_8_files_and_every_steps_log(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]   # no GPU: steps fail
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["SUMMARY.txt", "results.tgz"] and len(files) <= 8
    summary = (out / "SUMMARY.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary[:len(STEPS)]] == STEPS
    assert all(re.fullmatch(r"\S+ exit=\d+ seconds=\d+", line) for line in summary[:len(STEPS)])
    assert summary[-1].startswith("gpu_check: FAILED steps:")
    with tarfile.open(out / "results.tgz") as archive:
        names = {Path(n).name for n in archive.getnames()}
        assert {f"{step}.txt" for step in STEPS} | {"SUMMARY.txt"} <= names
        assert "site" not in names
        env_log = archive.extractfile("./env.txt").read().decode()
    assert "CUDA" in env_log or "cuda" in env_log or "Error" in env_log
    # the scratch folder is gone: nothing outside $OUT is left behind either
    assert not list(tmp_path.glob("gpu-check.*"))


def test_the_gpu_check_keeps_to_six_minutes_with_room_for_a_rerun():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    limits = [int(n) for n in re.findall(r"^step \S+ (\d+) ", script, flags=re.MULTILINE)]
    assert len(limits) == len(STEPS) and sum(limits) <= 360 - 15   # archiving after each step: a few seconds
    timeout = int(re.search(r"timeout_s=(\d+)", script).group(1))
    assert sum(limits) < timeout and 2 * timeout + 2 * 60 <= 15 * 60   # two runs and two starts in 15 minutes


def test_the_wheels_carried_are_pinned_and_none_the_image_has():
    script = (ROOT / "scripts" / "fetch_gpu_wheels.sh").read_text()
    block = re.search(r"WHEELS=\((.*?)\n\)", script, flags=re.DOTALL).group(1)
    wheels = [w for line in block.splitlines() for w in line.split("#")[0].split()]
    assert wheels and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", w) for w in wheels), wheels
    names = {w.split("==")[0].lower() for w in wheels}
    in_the_image = {"pytest", "pluggy", "iniconfig", "hypothesis", "sortedcontainers", "attrs", "packaging",
                    "numpy", "safetensors", "tokenizers", "narwhals", "torch", "triton", "pyarrow", "rich", "typer"}
    assert not names & in_the_image
