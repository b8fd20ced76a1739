"""The data-parallel ranks of one real `vllm serve` (vLLM's CPU build, `--data-parallel-size 2`): vLLM runs
an engine core, and so a scheduler, per rank, and kvtrace's capture in each writes a server of its own into
the one capture folder.

One server start (SmolLM2-135M, the tight pool of test_vllm_live.py per rank, about a minute and a half
on two busy cores), then a burst of streaming completions that vLLM spreads over its ranks. Checked:
`capture ls` lists two servers, ranks 0 and 1 of one vLLM instance on this host; `capture run` joins them
into one run whose requests, steps and events carry their rank; each rank's preemptions are vLLM's own
counter of that engine; each rank's figures in the joined run are its run alone (tests/helpers/servers.py);
`kvtrace analyze` shows each rank; and the exporter (`capture metrics`) serves each rank's preemptions, vLLM's
counter of that engine, and each rank's figures as on a folder of that rank alone.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest

from kvtrace.trace import db
from kvtrace.vllm.importer import read_chunks
from kvtrace.vllm.record import capture_path, model_folder
from tests.helpers.capture_figures import ranks_figures
from tests.helpers.servers import assert_each_server_alone
from tests.helpers.vllm_runs import VLLM_MARKS, VLLM_PYTHON, kvtrace, start_vllm_server

pytestmark = VLLM_MARKS
SERVE = ["--dtype", "float32", "--block-size", "32", "--num-gpu-blocks-override", "6", "--max-model-len", "128",
         "--max-num-seqs", "8", "--gpu-memory-utilization", "0.3", "--enforce-eager", "--data-parallel-size", "2"]
CLS = "kvtrace.vllm.capture.scheduler.KvtraceCaptureScheduler"
NUM = 16
# each rank's analyses whose rows are its own (requests, steps): on the joined run and on the rank's run alone
PER_RANK = [("pool", {}, {}), ("step_costs", {}, {}), ("preemptions", {}, {}), ("wait_causes", {}, {}),
            ("request_story", {}, {}), ("recompute_by_request", {}, {}), ("thrash_windows", {}, {})]


def _complete(port: int, model: str, i: int, errors: list) -> None:
    body = json.dumps({"model": model, "prompt": f"Request {i}: " + "the quick brown fox jumps " * 8,
                       "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "X-Request-Id": f"burst-{i}"})
    try:
        urllib.request.urlopen(request, timeout=600).read()
    except OSError as exc:
        errors.append(f"burst-{i}: {exc!r}")


def _preemptions_per_engine(port: int) -> dict[str, float]:
    """vLLM's own preemption counter of each engine (its `engine` label: the data-parallel rank)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'vllm:num_preemptions(?:_total)?\{.*engine="(\d+)".*\} (\S+)$', line)
        if m:
            counts[m[1]] = counts.get(m[1], 0.0) + float(m[2])
    return counts


def test_a_data_parallel_servers_ranks_are_the_servers_of_one_run(tmp_path):
    capture, model = tmp_path / "capture", str(model_folder("smollm2-135m"))
    env = {**os.environ, "KVTRACE_CAPTURE_DIR": str(capture), "PYTHONPATH": str(capture_path())}
    proc, port = start_vllm_server(VLLM_PYTHON, model, ["--scheduler-cls", CLS, *SERVE], env, tmp_path / "vllm.log",
                                   cwd=tmp_path)
    try:
        errors: list[str] = []
        threads = [threading.Thread(target=_complete, args=(port, model, i, errors)) for i in range(NUM)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert not errors, errors
        deadline = time.monotonic() + 120   # every request's finished row in the closed chunks
        while len(read_chunks(capture)["requests"]["req_id"]) < NUM:
            assert time.monotonic() < deadline, "the capture did not write every request's row"
            time.sleep(0.5)
        vllm_counts = _preemptions_per_engine(port)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)

    listed = json.loads(kvtrace("capture", "ls", capture, "--json").stdout)["servers"]
    assert sorted(s["data_parallel_rank"] for s in listed) == [0, 1]
    assert {s["host"] for s in listed} == {socket.gethostname()}
    instance = {s["vllm_instance_id"] for s in listed}   # one `vllm serve`: its ranks share vLLM's instance id
    assert len(instance) == 1 and None not in instance
    assert len({s["pid"] for s in listed}) == 2          # an engine core each
    lines = kvtrace("capture", "ls", capture).stdout
    assert "rank 0  host" in lines and "rank 1  host" in lines and "joins the 2 servers" in lines

    # one window for every run below, starting before any arrival: each run's clock starts with it
    window = ["--since", str(min(s["first"] for s in listed) - 60), "--until", str(max(s["last"] for s in listed) + 60)]
    joined = tmp_path / "joined"
    kvtrace("capture", "run", capture, "-o", joined, *window)
    con = db.connect([joined])
    per_rank = dict(con.execute("SELECT server, count(*) FROM requests GROUP BY 1").fetchall())
    assert set(per_rank) == {"dp0", "dp1"} and sum(per_rank.values()) == NUM   # vLLM spread the burst
    ids = [r[0] for r in con.execute("SELECT req_id FROM requests").fetchall()]
    assert sorted(re.search(r"burst-(\d+)", i)[1] for i in ids) == sorted(str(i) for i in range(NUM))
    assert all(i.startswith(("dp0/", "dp1/")) for i in ids)
    # each rank's preemptions are vLLM's own count of that engine
    captured = dict(con.execute("SELECT server, count(*) FILTER (WHERE kind = 'preempt') FROM kv_events "
                                "GROUP BY 1").fetchall())
    assert {f"dp{engine}": count for engine, count in vllm_counts.items()} == {k: float(v) for k, v in captured.items()}
    assert sum(captured.values()) > 0, "the tight pool preempted nowhere: nothing to tell the ranks' pools apart"

    for rank in (0, 1):
        alone = tmp_path / f"dp{rank}"
        kvtrace("capture", "run", capture, "-o", alone, "--rank", str(rank), *window)
        assert_each_server_alone(con, db.connect([alone]), f"dp{rank}", PER_RANK)
    out = kvtrace("analyze", joined).stdout
    assert "2 servers: dp0, dp1" in out and re.search(r"dp0 thrash \w+", out) and re.search(r"dp1 thrash \w+", out)

    # the exporter tells the ranks apart: each rank's preemptions vLLM's own count of that engine, and its
    # figures those of the exporter on a folder of that rank alone
    both, alone = ranks_figures(capture, {s["data_parallel_rank"]: s["server_id"] for s in listed}, tmp_path)
    assert {server: sum(v for (name, _), v in f.items() if name == "kvtrace_preemptions_total")
            for server, f in both.items()} == {f"dp{engine}": count for engine, count in vllm_counts.items()}
    for rank in (0, 1):
        assert both[f"dp{rank}"] == pytest.approx(alone[f"dp{rank}"], rel=1e-12), rank
