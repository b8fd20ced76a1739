"""`kvtrace record`: the trace tells the story, survives kills, refuses bad input."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from tests.helpers.cli import record, sql, write_workload

PROMPT_A = [11, 12, 13, 14, 15, 16, 17]
PROMPT_B = [21, 22, 23, 24, 25, 26, 27]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_four_block_scenario_recorded(tmp_path, mode):
    workload = write_workload(tmp_path / "four.jsonl", [
        {"id": "A", "arrival_s": 0, "prompt_token_ids": PROMPT_A, "max_tokens": 6, "ignore_eos": True},
        {"id": "B", "arrival_s": 0, "prompt_token_ids": PROMPT_B, "max_tokens": 4, "ignore_eos": True},
    ])
    result, run = record(tmp_path, workload, mode, "--block-size", "4", "--num-gpu-blocks", "4", "--watermark", "0",
                         "--no-enable-prefix-caching", "--backlog", "--preemption-mode", mode, "--num-cpu-blocks", "4")
    assert result.exit_code == 0, result.output
    story = sql(run, "SELECT step, kind, req_id, blocks, reason FROM kv_events "
                     "WHERE kind IN ('preempt', 'swap_out', 'swap_in', 'reprefill', 'finish') ORDER BY seq")
    if mode == "recompute":
        assert story == [(2, "preempt", "B", [3, 4], "recompute"), (5, "finish", "A", None, "length"),
                         (6, "reprefill", "B", None, None), (7, "finish", "B", None, "length")]
        assert sql(run, "SELECT num_tokens, num_recomputed_tokens FROM kv_events WHERE kind = 'reprefill'") == [(9, 8)]
    else:
        assert story == [(2, "preempt", "B", [3, 4], "swap"), (2, "swap_out", "B", [3, 4], None),
                         (5, "finish", "A", None, "length"), (6, "swap_in", "B", [4, 2], None),
                         (7, "finish", "B", None, "length")]
        per_block = json.loads((run / "meta.json").read_text())["kv_pool"]["bytes_per_block"]
        assert sql(run, "SELECT kind, bytes FROM kv_events WHERE kind LIKE 'swap%' ORDER BY seq") == [
            ("swap_out", 2 * per_block), ("swap_in", 2 * per_block)]
    assert sql(run, "SELECT req_id, list(step ORDER BY idx) FROM tokens GROUP BY req_id ORDER BY req_id") == [
        ("A", [0, 1, 2, 3, 4, 5]), ("B", [0, 1, 6, 7])]
    # the pool after scheduling: B's last decode holds 3 blocks of the 4 (1..4: 0 is V1's null block)
    assert sql(run, "SELECT free_blocks, used_blocks FROM steps ORDER BY step DESC LIMIT 1") == [(1, 3)]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["kv_pool"]["num_gpu_blocks"] == 4


def test_tight_pool_replays_match_unconstrained_from_traces(tmp_path):
    rows = [{"id": f"r{i}", "arrival_s": i * 0.002, "prompt_tokens": 8 + (i * 7) % 40, "max_tokens": 10 + (i * 5) % 30}
            for i in range(16)]
    workload = write_workload(tmp_path / "w.jsonl", rows)
    common = ["--block-size", "4", "--time-scale", "1"]
    runs = {}
    for name, extra in {"free": ["--num-gpu-blocks", "1000"],
                        "recompute": ["--num-gpu-blocks", "24", "--preemption-mode", "recompute"],
                        "swap": ["--num-gpu-blocks", "24", "--preemption-mode", "swap", "--num-cpu-blocks", "12"]}.items():
        result, runs[name] = record(tmp_path, workload, name, *common, *extra)
        assert result.exit_code == 0, result.output
    con = duckdb.connect()
    tokens = {name: f"read_parquet('{run}/tokens/*.parquet')" for name, run in runs.items()}
    for name in ("recompute", "swap"):
        preempted = sql(runs[name], "SELECT sum(preemptions) FROM requests")[0][0]
        assert preempted > 0, f"{name}: the pool was not tight enough to preempt"
        diff = con.sql(f"""
            SELECT count(*) FROM (
                SELECT req_id, list(token_id ORDER BY idx) AS ids FROM {tokens['free']} GROUP BY req_id) a
            FULL JOIN (
                SELECT req_id, list(token_id ORDER BY idx) AS ids FROM {tokens[name]} GROUP BY req_id) b
            USING (req_id) WHERE a.ids IS DISTINCT FROM b.ids""").fetchall()[0][0]
        assert diff == 0
        # one fact, three witnesses, and the fact is not "nothing happened"
        counts = sql(runs[name], """SELECT (SELECT sum(recomputed_tokens) FROM requests),
                                           (SELECT sum(recompute_tokens) FROM steps),
                                           (SELECT sum(num_recomputed_tokens) FROM kv_events)""")[0]
        assert counts[0] == counts[1] == counts[2]
        preemptions = sql(runs[name], """SELECT (SELECT sum(preemptions) FROM requests),
                                                (SELECT sum(preemptions) FROM steps),
                                                (SELECT count(*) FROM kv_events WHERE kind = 'preempt')""")[0]
        assert preemptions[0] == preemptions[1] == preemptions[2] > 0
        if name == "recompute":
            assert counts[0] > 0
        else:  # swap: nothing recomputed unless a swap found the host full
            fallbacks = sql(runs[name], "SELECT count(*) FROM kv_events WHERE reason = 'swap-full-fallback'")[0][0]
            assert (counts[0] > 0) == (fallbacks > 0)
            swaps = sql(runs[name], """SELECT (SELECT sum(swaps) FROM requests),
                                              (SELECT count(*) FROM kv_events WHERE kind = 'swap_out'),
                                              (SELECT count(*) FROM kv_events WHERE kind = 'preempt' AND reason = 'swap')""")[0]
            assert swaps[0] == swaps[1] == swaps[2] > 0


def slow_workload(tmp_path: Path) -> Path:
    # long generations arriving faster than they finish: some are always running when the signal comes
    rows = [{"id": f"r{i}", "arrival_s": i * 0.1, "prompt_tokens": 30, "max_tokens": 1500} for i in range(80)]
    return write_workload(tmp_path / "slow.jsonl", rows)


def start_recording(tmp_path: Path, workload: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtrace", "record", "--model", "tiny", "-w", str(workload),
                             "-o", str(out), "-q", "--block-size", "4", "--num-gpu-blocks", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2])


def wait_for_chunks(out: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not list(out.glob("tokens/part-*.parquet")):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no chunk written"
        time.sleep(0.1)


def test_sigkill_leaves_a_readable_trace(tmp_path):
    out = tmp_path / "killed"
    proc = start_recording(tmp_path, slow_workload(tmp_path), out)
    wait_for_chunks(out, proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sql(out, "SELECT count(*) FROM tokens")[0][0] > 0
    assert sql(out, "SELECT count(*) FROM steps")[0][0] > 0
    assert json.loads((out / "meta.json").read_text())["status"] == "running"  # not mistaken for complete


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_closes_the_trace(tmp_path, sig):
    out = tmp_path / "interrupted"
    proc = start_recording(tmp_path, slow_workload(tmp_path), out)
    wait_for_chunks(out, proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 130
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "interrupted"
    assert not list(out.glob("*/.*tmp"))
    reasons = dict(sql(out, "SELECT finish_reason, count(*) FROM requests GROUP BY 1"))
    assert reasons.get("aborted", 0) > 0
    # every delivered token of a finished or aborted sequence is in the trace
    assert sql(out, "SELECT sum(output_tokens) FROM requests")[0][0] == sql(out, "SELECT count(*) FROM tokens")[0][0]
    # the summary counts what ran up to the interruption, as the trace holds it
    summary = meta["summary"]
    assert summary["num_steps"] == sql(out, "SELECT count(*) FROM steps")[0][0] > 0
    assert summary["num_output_tokens"] == sql(out, "SELECT count(*) FROM tokens")[0][0]
    assert summary["num_finished"] == sql(out, "SELECT count(*) FILTER (finish_reason != 'aborted') FROM requests")[0][0]


@pytest.mark.parametrize("args, rows, message", [
    ([], ["{not json"], "line 1"),
    (["--num-gpu-blocks", "0"], None, "--num-gpu-blocks"),
    (["--num-gpu-blocks", "2", "--block-size", "4"], None, "can never fit"),
    (["--model", "no-such-model"], None, "no-such-model"),
    (["--preemption-mode", "drop"], None, "--preemption-mode"),
])
def test_bad_input_is_one_line_exit_2_and_no_run_folder(tmp_path, args, rows, message):
    rows = rows or [json.dumps({"arrival_s": 0, "prompt_tokens": 12, "max_tokens": 4})]
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "-w", str(workload), "-o", str(out), "-q", *args])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_missing_workload(tmp_path):
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "-w", str(tmp_path / "nope.jsonl"), "-q"])
    assert result.exit_code == 2 and "nope.jsonl" in result.stderr


def test_no_token_ids(tmp_path):
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 5, "max_tokens": 3}])
    result, run = record(tmp_path, workload, "run", "--no-token-ids")
    assert result.exit_code == 0, result.output
    assert sql(run, "SELECT count(*), count(token_id) FROM tokens") == [(3, 0)]


@pytest.mark.parametrize("switches, args, kernels, note", [
    ({"KVTRACE_CPU_KERNELS": "0"}, [], ("onednn", "torch"), "turned off by KVTRACE_CPU_KERNELS=0"),
    ({}, ["--dtype", "bfloat16"], ("torch",), "fp32 only: this bfloat16 model runs on torch ops"),
])
def test_meta_says_which_kernels_ran_and_why(tmp_path, monkeypatch, switches, args, kernels, note):
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 6, "max_tokens": 2}])
    result, run = record(tmp_path, workload, "run", *args)
    assert result.exit_code == 0, result.output
    device = json.loads((run / "meta.json").read_text())["device"]
    assert device["kernels"] in kernels and note in device["kernels_note"]


def test_a_failure_while_closing_the_trace_marks_the_run_failed(tmp_path, monkeypatch):
    """Not left saying "running" (which `analyze --follow` would wait on forever)."""
    from kvtrace.record.recorder import TraceWriter

    close = TraceWriter.close

    def failing_close(self):
        close(self)
        raise OSError("disk full")

    monkeypatch.setattr(TraceWriter, "close", failing_close)
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 6, "max_tokens": 2}])
    result, run = record(tmp_path, workload, "run")
    assert result.exit_code != 0
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "failed" and "closing the trace: OSError: disk full" in meta["error"]
