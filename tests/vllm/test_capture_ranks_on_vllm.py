"""Two data-parallel ranks' captures in one folder, from vLLM's own scheduler classes (no model, in each vLLM
venv the differential gets: tests/vllm_sched/vllm_driver.py --capture, as test_capture_on_vllm.py drives it).

Two drivers, two processes as two ranks' engine cores are, build kvtrace's capture scheduler from a fresh
vLLM config each; the second's says data-parallel rank 1, the way vLLM's own config reads it without a
deployment (VLLM_DP_RANK, ParallelConfig's fallback). Both step a tight pool at once into one capture folder,
with the same request ids. Checked: `capture ls` lists two servers, ranks 0 and 1; `capture run` joins them,
each step and preemption of its rank, each rank's steps and victims those vLLM decided, each rank's requests
those of its run alone; the exporter (`capture metrics`) serves each rank's steps and preemptions, vLLM's,
and each rank's figures as on a folder of that rank alone. test_vllm_data_parallel.py runs a real `vllm serve
--data-parallel-size 2` (and compares every figure of each rank with its run alone, which the driver's made-up arrival times do not allow).
"""
from __future__ import annotations

import json

import pytest

from kvtrace.trace import db
from tests.helpers.capture_figures import ranks_figures
from tests.helpers.vllm_runs import VLLM_MARKS, kvtrace
from tests.vllm_sched.differential import VllmScheduler
from tests.vllm_sched.test_sched_differential import PYTHONS, venv_name

pytestmark = VLLM_MARKS
CONFIG = {"block_size": 4, "num_blocks": 8, "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 24,
          "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False, "enable_prefix_caching": True}


def _workload(num: int, seed: int) -> dict:
    """`num` requests r00… (the same ids on both ranks) of 6–10 prompt tokens and 8 new ones, arriving over the
    first steps: more than 8 blocks of 4 tokens hold, so the pool preempts."""
    return {"config": CONFIG, "requests": [
        {"id": f"r{i:02d}", "prompt": [seed * 100 + i * 10 + k for k in range(6 + (i + seed) % 5)], "max_tokens": 8,
         "arrival_step": i // 2} for i in range(num)]}


WORKLOADS = [_workload(6, 1), _workload(5, 2)]   # rank 0's, rank 1's


@pytest.fixture(params=PYTHONS or ["none"], ids=venv_name)
def python(request):
    return request.param


def test_two_ranks_captures_in_one_folder_are_one_run(python, tmp_path):
    from kvtrace.vllm.record import model_folder

    capture = tmp_path / "capture"
    drivers = [VllmScheduler(python, str(model_folder("smollm2-135m")), wait=False, capture=True,
                             env={"KVTRACE_SCHED_FRESH_CONFIGS": "1", "VLLM_DP_RANK": str(rank)}) for rank in (0, 1)]
    try:
        for driver in drivers:
            driver.wait_ready()
        senders = [d.submit([{**w, "capture_dir": str(capture)}]) for d, w in zip(drivers, WORKLOADS)]
        for sender in senders:
            sender.join()
        answers = [d.receive_answer() for d in drivers]   # both ranks step at once
    finally:
        for driver in drivers:
            driver.close()
    for answer in answers:
        assert "error" not in answer and answer["capture_started"], answer.get("error")
    decided = {f"dp{rank}": sum(len(s["preempted"]) for s in a["steps"]) for rank, a in enumerate(answers)}
    assert decided["dp0"] > 0 and decided["dp1"] > 0   # the tight pool preempted on each rank

    listed = json.loads(kvtrace("capture", "ls", capture, "--json").stdout)["servers"]
    assert sorted(s["data_parallel_rank"] for s in listed) == [0, 1]
    assert "rank 0  host" in (lines := kvtrace("capture", "ls", capture).stdout) and "rank 1  host" in lines
    joined = tmp_path / "joined"
    kvtrace("capture", "run", capture, "-o", joined)
    con = db.connect([joined])
    # every step and preemption of each rank is its own: vLLM's schedule() calls and victims, rank by rank
    assert dict(con.execute("SELECT server, count(*) FROM steps GROUP BY 1").fetchall()) == {
        f"dp{rank}": len(a["steps"]) for rank, a in enumerate(answers)}
    assert dict(con.execute("SELECT server, count(*) FILTER (WHERE kind = 'preempt') FROM kv_events "
                            "GROUP BY 1").fetchall()) == decided
    victims = {f"dp{rank}": sorted(f"dp{rank}/{rid}" for s in a["steps"] for rid in s["preempted"])
               for rank, a in enumerate(answers)}
    assert {server: sorted(ids) for server, ids in con.execute(
        "SELECT server, list(req_id) FROM kv_events WHERE kind = 'preempt' GROUP BY 1").fetchall()} == victims
    # and each rank's requests those of its run alone (the driver's arrival times are step numbers, not
    # the wall clock a server's are: the runs' clocks differ, their rows are compared without times)
    for rank in (0, 1):
        alone = tmp_path / f"dp{rank}"
        kvtrace("capture", "run", capture, "-o", alone, "--rank", str(rank))
        ids = con.execute("SELECT req_id, output_tokens, preemptions FROM requests WHERE server = ? ORDER BY 1",
                          [f"dp{rank}"]).fetchall()
        own = db.connect([alone]).execute("SELECT 'dp' || ? || '/' || req_id, output_tokens, preemptions FROM requests "
                                          "ORDER BY 1", [str(rank)]).fetchall()
        assert ids == own and len(ids) >= len(WORKLOADS[rank]["requests"]) - 1
    # the exporter tells the ranks apart: each rank's steps and preemptions vLLM's, and its figures those of the
    # exporter on a folder of that rank alone
    both, alone = ranks_figures(capture, {s["data_parallel_rank"]: s["server_id"] for s in listed}, tmp_path)
    assert {server: f["kvtrace_steps_total", frozenset()] for server, f in both.items()} == {
        f"dp{rank}": len(a["steps"]) for rank, a in enumerate(answers)}
    assert {server: sum(v for (name, _), v in f.items() if name == "kvtrace_preemptions_total")
            for server, f in both.items()} == decided
    for rank in (0, 1):
        assert both[f"dp{rank}"] == pytest.approx(alone[f"dp{rank}"], rel=1e-12), rank
