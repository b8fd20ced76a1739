"""The scheduler-level differential's harness: vLLM's side in a long-lived driver process (its import
costs seconds, a workload milliseconds), kvtrace's side in process, and the first differing step.

    python -m tests.vllm_sched.differential VLLM_PYTHON [NUM_WORKLOADS] [--async]   # a quick random run
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).with_name("vllm_driver.py")


class VllmScheduler:
    """vllm_driver.py in a vLLM venv's Python: one workload in, its steps out. With `capture` the
    driver builds kvtrace's capture scheduler class (this worktree's kvtrace package on its path)."""

    def __init__(self, python: str, model_folder: str, *, capture: bool = False) -> None:
        args, env = [python, str(DRIVER), model_folder], None
        if capture:
            from kvtrace.vllm.record import capture_path

            args.append("--capture")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env["PYTHONPATH"] = str(capture_path())
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1, env=env)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"{python} {DRIVER.name}: exited before it was ready (rc {self.proc.wait()})")
        self.version = json.loads(ready)["vllm_version"]

    def run(self, workload: dict) -> list[dict]:
        return self.answer(workload)["steps"]

    def answer(self, workload: dict) -> dict:
        """The driver's whole answer: the steps, and with `capture` the capture's folder."""
        self.proc.stdin.write(json.dumps(workload) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM {self.version}'s driver exited (rc {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM {self.version}'s scheduler failed: {answer['error']}\n{answer['traceback']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:   # a loaded machine: vLLM's interpreter exit can be slow
            self.proc.kill()
            self.proc.wait()


def first_difference(kvtrace_steps: list[dict], vllm_steps: list[dict]) -> str | None:
    """None when the records agree; else the first differing step on each side, field by field."""
    for i, (mine, theirs) in enumerate(zip(kvtrace_steps, vllm_steps)):
        if mine != theirs:
            fields = [k for k in theirs if mine.get(k) != theirs.get(k)] + [k for k in mine if k not in theirs]
            lines = [f"step record {i} (step {theirs['step']}) differs in {', '.join(fields)}:"]
            for k in fields:
                lines.append(f"  {k}:\n    kvtrace {json.dumps(mine.get(k))}\n    vLLM    {json.dumps(theirs.get(k))}")
            if i:
                lines.append(f"  the step before (equal): {json.dumps(vllm_steps[i - 1])}")
            return "\n".join(lines)
    if len(kvtrace_steps) != len(vllm_steps):
        return (f"kvtrace took {len(kvtrace_steps)} steps, vLLM {len(vllm_steps)}; the first extra: "
                f"{json.dumps((kvtrace_steps + vllm_steps)[min(len(kvtrace_steps), len(vllm_steps))])}")
    return None


def main() -> int:
    import random
    import time

    from hypothesis import HealthCheck, given, settings

    from kvtrace.vllm.record import model_folder
    from tests.vllm_sched import kvtrace_side
    from tests.vllm_sched.workloads import workloads

    python, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 200
    asynchronous = "--async" in sys.argv
    vllm = VllmScheduler(python, str(model_folder("smollm2-135m")))
    found = []
    start = time.monotonic()

    @settings(max_examples=count, deadline=None, database=None, derandomize="--random" not in sys.argv, suppress_health_check=list(HealthCheck),
              phases=["generate"])
    @given(workloads(asynchronous))
    def check(w):
        diff = first_difference(kvtrace_side.run(w), vllm.run(w))
        if diff:
            found.append((w, diff))

    check()
    print(f"{count} workloads in {time.monotonic() - start:.1f}s, {len(found)} differ")
    shown = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--show=")), 3))
    found.sort(key=lambda f: len(json.dumps(f[0])))
    for w, diff in found[:shown]:
        print(json.dumps(w))
        print(diff)
    vllm.close()
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
