"""The guard step of scripts/vllm_release_check.sh: kvtrace's capture started on one vLLM's own
`Scheduler` and `AsyncScheduler` (a scheduler-only venv's Python), with the version check set aside
(KVTRACE_VLLM_ANY_VERSION=1) so that everything else the guard checks (the classes, methods and
parameters the capture wraps or reads, the KV cache's groups) is checked on that release. Prints the
first refusal, or that none came, and whether guard.SUPPORTED names the release; exit 0 when the
capture started and captured a small workload on both schedulers.

    python -m tests.vllm_sched.release_guard VLLM_PYTHON
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from kvtrace.vllm.capture.guard import SUPPORTED, version_tuple
from kvtrace.vllm.record import model_folder
from tests.vllm_sched.differential import VllmScheduler

WORKLOAD = {"config": {"block_size": 4, "num_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 16,
                       "max_model_len": 16, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                       "enable_prefix_caching": True},
            "requests": [{"id": "r00", "prompt": [1, 2, 3], "max_tokens": 4, "arrival_step": 0},
                         {"id": "r01", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3, "arrival_step": 1}],
            # strict: a refusal raises (as `kvtrace record --engine vllm` does) instead of stepping aside
            "env": {"KVTRACE_VLLM_ANY_VERSION": "1", "KVTRACE_CAPTURE_STRICT": "1"}}


def main(python: str) -> int:
    vllm = VllmScheduler(python, str(model_folder("smollm2-135m")), capture=True)
    refused = []
    try:
        for asynchronous in (False, True):
            name = "AsyncScheduler" if asynchronous else "Scheduler"
            with tempfile.TemporaryDirectory(prefix="kvtrace-release-guard-") as folder:
                capture = Path(folder) / "capture"
                workload = {**WORKLOAD, "config": {**WORKLOAD["config"], "async": asynchronous},
                            "capture_dir": str(capture)}
                try:
                    vllm.answer(workload)
                except RuntimeError as exc:
                    error = capture / "error.json"
                    said = json.loads(error.read_text())["error"] if error.exists() else str(exc).splitlines()[0]
                    refused.append(f"guard: vLLM {vllm.version}'s {name}: {said}")
                    continue
                done = json.loads((capture / "done.json").read_text())
                if done.get("writer_error") or done.get("self_check_errors"):
                    refused.append(f"guard: vLLM {vllm.version}'s {name} started, but the capture failed: "
                                   f"writer {done.get('writer_error')}, self-check {done.get('self_check_errors')}")
                    continue
                print(f"guard: vLLM {vllm.version}'s {name}: the capture starts and captures "
                      f"(every name it wraps or reads is there)")
    finally:
        vllm.close()
    for line in refused:
        print(line)
    listed = version_tuple(vllm.version) in SUPPORTED
    print(f"guard: {vllm.version} is {'' if listed else 'not '}in guard.SUPPORTED"
          + ("" if listed else " (the capture refuses it until it is added there)"))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
