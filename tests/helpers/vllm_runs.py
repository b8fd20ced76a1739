"""vLLM in tests: capture chunks built by hand (the importer's input, no vLLM needed), and the
command line run against vLLM's CPU build (KVTRACE_VLLM_PYTHON)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.sink import COLUMNS
from kvtrace.vllm.importer import Item

ITEMS = {0: Item(0, "chat-a", 1, 0, 0.0, 40, 8, None), 3: Item(3, "chat-b", 2, 1, 0.5, 60, 16, 4)}


def chunk(rows: dict[str, list[dict]]) -> dict:
    """Columns of the capture's tables from rows (missing columns None)."""
    return {table: {c: [row.get(c) for row in rows.get(table, [])] for c in cols} for table, cols in COLUMNS.items()
            if rows.get(table)}


def write_capture(folder, chunks: list[dict], server: str = "20261201T030000Z-77") -> None:
    """A capture folder of `chunks` (each `{table: {column: values}}`) as one server wrote them."""
    (folder / "chunks").mkdir(parents=True)
    for part, rows in enumerate(chunks):
        steps = rows.get("steps") or {"start_s": [0.0], "end_s": [0.0]}
        name = (f"{server}_{part:06d}_{min(steps['start_s']):.3f}_{max(steps['end_s']):.3f}_"
                f"{len(rows.get('arrivals', {}).get('req_id', ()))}{chunk_format.SUFFIX}")
        (folder / "chunks" / name).write_bytes(chunk_format.encode(rows))


VLLM_PYTHON = os.environ.get("KVTRACE_VLLM_PYTHON", "")
# the marks of a module that starts vLLM: `vllm`, and a skip that says why where there is no vLLM environment
VLLM_MARKS = [pytest.mark.vllm]
if not VLLM_PYTHON:
    VLLM_MARKS.append(pytest.mark.skip(
        reason=os.environ.get("KVTRACE_VLLM_UNAVAILABLE") or "no vLLM environment: run scripts/vllm_env.sh and set "
                                                            "KVTRACE_VLLM_PYTHON"))


EAGER = ["--vllm-arg", "enforce_eager=true"]     # no torch.compile: start-up in seconds, same scheduling


def kvtrace(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_preemptions(port: int) -> float:
    """vLLM's own engine-wide preemption counter, from the Prometheus endpoint of the server on `port`."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions") and not line.startswith("#"))


def start_vllm_server(python: str, model: str, args: list[str], env: dict, log, cwd=None,
                      timeout_s: float = 900) -> tuple[subprocess.Popen, int]:
    """`vllm serve` (its OpenAI API server) on a free loopback port, in a session of its own, its output in `log`;
    returns once it answers /v1/models (fails with the log's tail if it dies or does not start in time)."""
    import time
    import urllib.request
    port = free_port()
    proc = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), *args],
        env={**env, "VLLM_USE_AOT_COMPILE": "0"}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, port
        except OSError:
            assert proc.poll() is None, open(log).read()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(1)


def bursts_workload(path, num: int, gap_s: float, seed: int) -> None:
    """Two bursts of num/2 requests gap_s apart (10 ms between a burst's arrivals), prompts of 20-200 tokens
    and 32-96 new tokens drawn with `seed`: the tight pool's traffic of the capture's live tests."""
    import json
    import random
    rng, half = random.Random(seed), num // 2
    path.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": (0 if i < half else gap_s) + 0.01 * (i % half),
                                        "prompt_tokens": rng.randint(20, 200), "max_tokens": rng.randint(32, 96)})
                            + "\n" for i in range(num)))


def capture_driver_config(python: str, workload, scratch, capture, record_token_ids: bool):
    """The config of kvtrace's capture driver (`python -m kvtrace.vllm.capture.driver CONFIG` in the vLLM venv)
    replaying `workload` into the tight pool (16 blocks of 32 tokens, prefix caching, newest preempted first) with
    the capture writing to `capture`; returns the config's path (results.json beside it)."""
    import json

    from rich.console import Console

    from kvtrace.vllm.record import VllmOptions, VllmRecording
    opts = VllmOptions(model="smollm2-135m", dtype="float32", seed=0, block_size=32, num_gpu_blocks=16,
                       kv_cache_memory=None, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=None,
                       enable_prefix_caching=True, preemption_policy="newest", vllm_python=python)
    recording = VllmRecording(opts, workload, scratch / "unused", max_requests=None, time_scale=None, backlog=False,
                              record_token_ids=record_token_ids, command="", console=Console(quiet=True))
    requests = scratch / "requests.jsonl"
    requests.write_text("".join(json.dumps(item) + "\n" for item in recording.items))
    config = {"model": str(recording.folder), "engine_args": {**recording.engine_args, "enforce_eager": True},
              "capture": True, "capture_dir": str(capture), "requests": str(requests),
              "results": str(scratch / "results.json")}
    (scratch / "config.json").write_text(json.dumps(config))
    return scratch / "config.json"
