"""A peer engine's driver running in its own venv: one JSON line in per workload, one JSON line out."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from benchmarks.kvtrace_runner import cache_dir
from benchmarks.run_result import RunResult
from benchmarks.workload import Request

PEERS = Path(__file__).resolve().parent / "peers"


class PeerError(RuntimeError):
    """The driver died or answered something that is not a result."""


def venv_python(name: str) -> Path:
    """/work/venvs/<name>/bin/python, or $KVTRACE_BENCH_VENVS/<name>/bin/python."""
    root = Path(os.environ.get("KVTRACE_BENCH_VENVS", "/work/venvs"))
    return root / name / "bin" / "python"


class PeerProcess:
    """Starts the driver (start-up is not timed), then runs workloads on it until closed."""

    def __init__(self, name: str, driver: str, config: dict, env: dict[str, str] | None = None) -> None:
        python = venv_python(name)
        if not python.exists():
            raise PeerError(f"{python} not found: set up the {name} venv as benchmarks/README.md says")
        logs = cache_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{name}-driver.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([str(python), str(PEERS / driver), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env={**os.environ, **(env or {})})
        self.info = self._read("ready")

    def _read(self, event: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-15:])
            raise PeerError(f"the driver exited with {self.proc.returncode}; its log {self.log_path} ends:\n{tail}")
        data = json.loads(line)
        if data.get("event") != event:
            raise PeerError(f"expected a {event!r} line from the driver, got {line[:200]!r}")
        return data

    def run(self, requests: list[Request], **extra) -> dict:
        self.proc.stdin.write(json.dumps({"requests": [r.to_json() for r in requests], **extra}) + "\n")
        self.proc.stdin.flush()
        return self._read("result")

    def run_result(self, requests: list[Request], **extra) -> RunResult:
        return RunResult.from_json(self.run(requests, **extra))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
