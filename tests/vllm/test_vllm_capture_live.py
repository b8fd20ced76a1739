"""`kvtrace capture metrics` following a capture folder while vLLM (its CPU build) writes it.

The exporter polls while kvtrace's capture driver replays two bursts into the tight pool of
docs/vllm.md; its counters only grow, and once vLLM is done they are the SQL library's on the
capture converted (tests/helpers/capture_figures.py), as on the committed fixture
(tests/cli/test_capture_live.py, where a real Prometheus server scrapes them).
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from kvtrace.vllm.metrics import Exporter
from kvtrace.vllm.record import capture_path
from tests.helpers.capture_figures import (
    COUNTERS,
    assert_figures,
    scraped,
    sql_figures,
    sql_verdict,
)
from tests.helpers.vllm_runs import (
    VLLM_MARKS,
    VLLM_PYTHON,
    bursts_workload,
    capture_driver_config,
)

pytestmark = VLLM_MARKS


def test_the_exporter_follows_a_capture_that_vllm_is_writing(tmp_path):
    workload = tmp_path / "bursts.jsonl"
    bursts_workload(workload, 16, 4.0, seed=1)
    capture = tmp_path / "capture"
    config = capture_driver_config(VLLM_PYTHON, workload, tmp_path, capture, record_token_ids=False)

    exporter = Exporter(capture, window_s=5.0)
    snapshots, stop = [], threading.Event()

    def follow() -> None:
        while not stop.is_set():
            if exporter.poll():
                snapshots.append({k: v for k, v in scraped(exporter).items() if k[0] in COUNTERS})
            time.sleep(0.5)

    follower = threading.Thread(target=follow)
    follower.start()
    try:
        proc = subprocess.run([VLLM_PYTHON, "-m", "kvtrace.vllm.capture.driver", str(config)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(capture_path())})
    finally:
        stop.set()
        follower.join()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exporter.poll()   # what was written since the last poll
    results = json.loads((tmp_path / "results.json").read_text())
    expected = sql_figures(capture, tmp_path)
    got = scraped(exporter)
    assert_figures(got, {k: v for k, v in expected.items() if k[0] != "kvtrace_thrash_verdict"})
    verdict = sql_verdict(capture, tmp_path, 5.0)   # the exporter's window, not the whole capture
    assert {k[1] for k, v in got.items() if k[0] == "kvtrace_thrash_verdict" and v == 1} == {
        frozenset({("verdict", verdict)})}
    assert expected["kvtrace_preemptions_total", frozenset({("reason", "recompute")})] == results["num_preemptions"]
    assert len(snapshots) > 2   # it followed the folder as it grew, not only at the end
    for before, after in zip(snapshots, snapshots[1:]):
        assert all(after[key] >= value for key, value in before.items())
    exporter.close()
