"""A real exporter (`kvtrace capture metrics`) scraped every second by a real Prometheus (Debian's, on
loopback), for the tests that read what an operator's Prometheus would."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import interruptible
from tests.helpers.vllm_runs import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")


def get(url: str) -> bytes | None:
    """The body at `url`, or None while nothing answers there."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()
    except OSError:
        return None


def wait(what: str, check, procs: tuple = (), timeout_s: float = 90.0):
    """`check()`'s first value that is not None; fails if one of `procs` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Scrape:
    exporter: subprocess.Popen
    exporter_port: int
    prometheus: subprocess.Popen
    api: str             # Prometheus's HTTP API: http://127.0.0.1:PORT/api/v1
    output: str = ""     # the exporter's, once it has stopped


@contextmanager
def exporter_scraped(capture: Path, tmp_path: Path) -> Iterator[Scrape]:
    """The exporter of `capture` (a 500 ms refresh, a 10 min window) and a Prometheus scraping it every
    second; at the end Prometheus is stopped and the exporter is sent Ctrl-C, its output in `.output`."""
    exporter_port, prometheus_port = free_port(), free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "kvtrace", "capture", "metrics", str(capture),
                                 "--port", str(exporter_port), "--refresh", "500ms", "--window", "10m"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: kvtrace\n    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n")
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scrape = Scrape(exporter, exporter_port, prometheus, f"http://127.0.0.1:{prometheus_port}/api/v1")
    try:
        yield scrape
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        exporter.send_signal(signal.SIGINT)   # Ctrl-C
        scrape.output, _ = exporter.communicate(timeout=30)
