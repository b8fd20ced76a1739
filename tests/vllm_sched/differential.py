"""The scheduler-level differential's harness: vLLM's side in a long-lived driver process (its import
costs seconds, a workload milliseconds), kvtrace's side in process, and the first differing step.

    python -m tests.vllm_sched.differential VLLM_PYTHON [NUM_WORKLOADS] [--async] [--random] [--show=N]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

DRIVER = Path(__file__).with_name("vllm_driver.py")


class VllmScheduler:
    """vllm_driver.py in a vLLM venv's Python: workloads in, their steps out, in order. With `capture`
    the driver builds kvtrace's capture scheduler class: this process's kvtrace package (a checkout's, or
    the mutation check's scratch copy) through a link in a folder of this driver's own, so that no other
    vLLM run on the machine is sent to it. With `socket` (a `vllm_driver.py --serve` driver that someone
    else started, e.g. scripts/mutation.py) a session there instead: its capture is this
    process's kvtrace/vllm/capture package, loaded from that folder's files."""

    def __init__(self, python: str, model_folder: str, wait: bool = True, env: dict | None = None, *,
                 capture: bool = False, socket: str | None = None) -> None:
        self.python, self.proc, self.link = python, None, None
        self.version = ""
        if socket is not None:
            import socket as sockets

            self.conn = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            self.conn.connect(socket)
            self.stdin, self.stdout = self.conn.makefile("w"), self.conn.makefile("r")
            self.stdin.write(json.dumps({"capture_package": str(capture_package())} if capture else {}) + "\n")
            self.stdin.flush()
            self.wait_ready()
            return
        args, env = [python, str(DRIVER), model_folder], {**os.environ, **env} if env else None
        if capture:
            import tempfile

            args.append("--capture")
            env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONPATH"}
            self.link = Path(tempfile.mkdtemp(prefix="kvtrace-capture-on-vllm-"))
            (self.link / "kvtrace").symlink_to(capture_package().parents[1])
            env["PYTHONPATH"] = str(self.link)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1, env=env)
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        ready = self.stdout.readline()
        if not ready:
            raise RuntimeError(f"{self.python} {DRIVER.name}: exited before it was ready (rc {self.exit_code()})")
        self.version = json.loads(ready)["vllm_version"]

    def submit(self, workloads: list[dict]) -> threading.Thread:
        """Send the workloads (from a thread: a long batch would fill the pipes both ways)."""
        def send() -> None:
            self.stdin.write("".join(json.dumps(w) + "\n" for w in workloads))
            self.stdin.flush()
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        return sender

    def receive(self) -> list[dict]:
        return self.receive_answer()["steps"]

    def receive_answer(self) -> dict:
        """The driver's whole answer to the next workload: the steps, and with `capture` the capture's folder."""
        line = self.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM {self.version}'s driver exited (rc {self.exit_code()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM {self.version}'s scheduler failed: {answer['error']}\n{answer['traceback']}")
        return answer

    def run(self, workload: dict) -> list[dict]:
        return self.answer(workload)["steps"]

    def answer(self, workload: dict) -> dict:
        self.submit([workload]).join()
        return self.receive_answer()

    def exit_code(self) -> int | str:
        return self.proc.wait() if self.proc is not None else "? (a session: the connection closed)"

    def close(self) -> None:
        self.stdin.close()
        if self.proc is None:
            self.stdout.close()
            self.conn.close()
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:   # a loaded machine: vLLM's interpreter exit can be slow
            self.proc.kill()
            self.proc.wait()
        if self.link is not None:
            import shutil
            shutil.rmtree(self.link, ignore_errors=True)


def capture_package() -> Path:
    """The capture's folder (kvtrace/vllm/capture) of the kvtrace package this process imports (never
    imported here: it imports vLLM)."""
    import kvtrace

    return Path(kvtrace.__file__).resolve().parent / "vllm" / "capture"


class VllmSchedulers:
    """Several drivers of one vLLM venv, so that a batch of workloads runs on every core while
    kvtrace's side of the same batch runs here."""

    def __init__(self, python: str, model_folder: str, num_drivers: int | None = None) -> None:
        num_drivers = num_drivers or max(1, min(4, (os.cpu_count() or 2) - 1))
        self.drivers = [VllmScheduler(python, model_folder, wait=False) for _ in range(num_drivers)]
        for driver in self.drivers:   # they import vLLM side by side
            driver.wait_ready()
        self.version = self.drivers[0].version

    def run(self, workload: dict) -> list[dict]:
        return self.drivers[0].run(workload)

    def compare(self, workloads: list[dict], kvtrace_run, memo: dict | None = None) -> list[tuple[list[dict], list[dict]]]:
        """(kvtrace's steps, vLLM's steps) of each workload; `kvtrace_run(workload)` gives kvtrace's.
        `memo` keeps each pair by workload: Hypothesis shrinks a failing batch one workload at a time."""
        if memo is not None:
            keys = [json.dumps(w, sort_keys=True) for w in workloads]
            todo = list({k: w for k, w in zip(keys, workloads) if k not in memo}.items())
            memo.update(zip([k for k, _ in todo], self.compare([w for _, w in todo], kvtrace_run)))
            return [memo[k] for k in keys]
        shares = [workloads[i::len(self.drivers)] for i in range(len(self.drivers))]
        senders = [d.submit(share) for d, share in zip(self.drivers, shares) if share]
        mine = [kvtrace_run(w) for w in workloads]
        for sender in senders:
            sender.join()
        theirs = [None] * len(workloads)
        for i, (driver, share) in enumerate(zip(self.drivers, shares)):
            for j in range(len(share)):
                theirs[i + j * len(self.drivers)] = driver.receive()
        return list(zip(mine, theirs))

    def close(self) -> None:
        for driver in self.drivers:
            driver.close()


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
    import time

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvtrace.vllm.record import model_folder
    from tests.vllm_sched import kvtrace_side
    from tests.vllm_sched.workloads import BATCH, workloads

    python, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 200
    asynchronous = "--async" in sys.argv
    vllm = VllmSchedulers(python, str(model_folder("smollm2-135m")))
    found = []
    start = time.monotonic()

    @settings(max_examples=max(1, count // BATCH), deadline=None, database=None,
              derandomize="--random" not in sys.argv, suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(st.lists(workloads(asynchronous), min_size=BATCH, max_size=BATCH))
    def check(batch):
        pairs = vllm.compare(batch, lambda w: kvtrace_side.run(w, vllm_version=vllm.version))
        for w, (mine, theirs) in zip(batch, pairs):
            diff = first_difference(mine, theirs)
            if diff:
                found.append((w, diff))

    check()
    print(f"{max(1, count // BATCH) * BATCH} workloads in {time.monotonic() - start:.1f}s "
          f"({len(vllm.drivers)} vLLM drivers), {len(found)} differ")
    shown = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--show=")), 3))
    found.sort(key=lambda f: len(json.dumps(f[0])))
    for w, diff in found[:shown]:
        print(json.dumps(w))
        print(diff)
    vllm.close()
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
