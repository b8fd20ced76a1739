"""`kvtrace explore`, driven headless with Textual's pilot (keys in, the screen's text out) on the
tiny fixture runs and on the four-block story, and once in a real terminal (tmux, at 80 × 24)."""
from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrace.trace import db
from kvtrace.views.dashboard import fmt_ms
from kvtrace.views.explore import Explorer
from tests.helpers.cli import record, write_workload
from tests.helpers.tui import drive

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "fixtures" / "runs"
RECOMPUTE = RUNS / "tiny-recompute"


def first_row(screen: str) -> str:
    """The requests table's first row (the line under its header)."""
    lines = screen.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["request", "TTFT"])
    return lines[header + 1]


def first_request(screen: str) -> str:
    return first_row(screen).split()[0]


def summary(run: Path) -> list[dict]:
    return db.records(db.run_analysis(db.connect([run]), "request_summary"))


def test_the_overview_shows_the_key_figures_and_sorts_the_requests():
    rows = summary(RECOMPUTE)
    worst = {column: max(rows, key=lambda r: (r[column], r["req_id"]))["req_id"]
             for column in ("ttft_ms", "e2el_ms", "preemptions", "recomputed_tokens")}
    screens = drive(Explorer([str(RECOMPUTE)]), ["t", "e", "r", "r", "p"])
    first = screens[0]
    # the dashboard's key figures (summary.sql, thrash.sql), as `kvtrace analyze` shows them
    assert " tiny-recompute " in first and "preemptions 22 (15 seqs, 7 again)" in first
    assert "thrash SUSTAINED" in first and "recomputed 329 tok" in first
    assert "20 requests by preemptions, highest first" in first
    assert "t TTFT" in first and "q quit" in first    # the footer's keys
    by_ttft, by_e2e, by_recomputed, fewest_recomputed, by_preemptions = screens[1:]
    assert "by TTFT, highest first" in by_ttft
    assert first_request(by_e2e) == worst["e2el_ms"]
    assert first_request(by_recomputed) == worst["recomputed_tokens"]
    # the same key again: the other way round
    assert "by recomputed tokens, lowest first" in fewest_recomputed
    assert first_request(fewest_recomputed) in {r["req_id"] for r in rows if r["recomputed_tokens"] == 0}
    assert first_request(by_preemptions) in {r["req_id"] for r in rows if r["preemptions"] == 2}
    assert max(r["preemptions"] for r in rows) == 2
    assert fmt_ms(max(r["e2el_ms"] for r in rows)) in first_row(by_e2e)


def test_a_request_its_timeline_a_step_and_back():
    rows = {r["req_id"]: r for r in summary(RECOMPUTE)}
    seen = {}

    def check(app):
        seen["screens"] = [type(s).__name__ for s in app.screen_stack]

    # by E2E the first is the request that finished last; open it, go down to its preemption
    # (waiting, prefill, decode, preempted), open that step, the next one, back twice
    screens = drive(Explorer([str(RECOMPUTE)]), [
        "e", "enter", ("down", "down", "down"), "enter", "right_square_bracket", "escape", "escape"], check=check)
    req = first_request(screens[1])
    story, step, next_step, back, overview = screens[2], screens[4], screens[5], screens[6], screens[7]
    row = rows[req]
    assert f" {req} " in story and f"TTFT {fmt_ms(row['ttft_ms'])}" in story and f"E2E {fmt_ms(row['e2el_ms'])}" in story
    lines = story.splitlines()
    state = next(line for line in lines if line.startswith("state "))
    pool = next(line for line in lines if line.startswith("pool "))
    # 80 columns: the timeline fills them, waiting first, decoding last, its preemption in between
    assert len(state.rstrip()) <= 80 and state.split("▕")[1].startswith("·") and state.rstrip().endswith("█")
    assert "░" in state and len(pool.split("▕")[1].rstrip()) > 50
    assert "▼" in next(line for line in lines if line.startswith("preempt "))
    # a trace before schema 3 (the fixtures): no requester to name, the waits' causes unknown
    preempted = next(line for line in lines if line.split()[:1] == ["preempted"])
    assert "preempted: " in preempted and " lost" in preempted
    assert "verdict: " in story and "unknown" in next(line for line in lines if line.split()[:1] == ["waiting"])
    preempt = db.connect([RECOMPUTE]).execute(
        "SELECT step FROM kv_events WHERE kind = 'preempt' AND req_id = ? ORDER BY seq", [req]).fetchall()[0][0]
    assert f" step {preempt} " in step and f" step {preempt + 1} " in next_step
    assert next(line for line in step.splitlines() if line.split()[:2] == [req, "preempted"])
    assert "preempt:recompute" in step
    assert f" {req} " in back and "state " in back
    assert "by E2E, highest first" in overview
    assert seen["screens"][1:] == ["OverviewScreen"]


def test_several_runs_pick_one_first():
    seen = {}

    def check(app):
        seen["top"] = type(app.screen).__name__

    screens = drive(Explorer([str(RUNS)]), ["down", "enter"], check=check)
    assert "2 runs: pick one" in screens[0] and "tiny-recompute" in screens[0] and "tiny-swap" in screens[0]
    assert " tiny-swap " in screens[2] and "swapped" in screens[2]
    assert seen["top"] == "OverviewScreen"


def test_escape_on_the_only_runs_overview_stays_and_q_quits():
    app = Explorer([str(RECOMPUTE)])
    seen = []

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("enter", "escape", "escape")
            seen.append(type(app.screen).__name__)
            await pilot.press("q")
            await pilot.pause()

    asyncio.run(run())
    assert seen == ["OverviewScreen"] and app.return_code == 0


def test_the_four_block_story(tmp_path):
    """Two requests, four blocks of 4: B is preempted when A needs a block; its story says so,
    with the 8 positions it lost, and the step view shows the preemption among what ran."""
    workload = write_workload(tmp_path / "four.jsonl", [
        {"id": "A", "arrival_s": 0, "prompt_token_ids": [11, 12, 13, 14, 15, 16, 17], "max_tokens": 6,
         "ignore_eos": True},
        {"id": "B", "arrival_s": 0, "prompt_token_ids": [21, 22, 23, 24, 25, 26, 27], "max_tokens": 4,
         "ignore_eos": True}])
    result, run = record(tmp_path, workload, "four", "--block-size", "4", "--num-gpu-blocks", "4", "--watermark",
                         "0", "--no-enable-prefix-caching", "--backlog", "--num-cpu-blocks", "4")
    assert result.exit_code == 0, result.output
    # sorted by preemptions B comes first: open it, go to its preemption, open that step
    # then back, and g on the preemption: A's story
    screens = drive(Explorer([str(run)]), ["enter", ("down", "down", "down"), "enter", "escape", "g"])
    assert first_request(screens[0]) == "B"
    story, step, requester = screens[1], screens[3], screens[5]
    assert " B " in story and "preempted 1×, 8 tok recomputed" in story
    preempt = next(line for line in story.splitlines() if line.split()[:1] == ["preempted"])
    assert "for A (newest), 8 lost" in preempt
    # the verdict, as kvtrace explain words it
    assert "verdict: " in story and "by A's growth" in story and "8 KV positions lost" in story
    b = next(line for line in step.splitlines() if line.split()[:2] == ["B", "preempted"])
    assert "preempt:recompute" in b and "preempted B for A (newest)" in step
    assert next(line for line in step.splitlines() if line.split()[:2] == ["A", "decode"])
    assert " A " in requester and "preempted 0×" in requester


def test_errors_are_one_line(tmp_path):
    from tests.helpers.cli import one_line_error

    assert "no such run folder" in one_line_error(["explore", str(tmp_path / "nothing")])


def test_explore_in_a_real_terminal(tmp_path):
    """tmux runs `python -m kvtrace explore RUN` at 80 × 24: the pane shows the key figures and the
    requests, `q` quits and the command exits 0."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (Debian package tmux; scripts/test.sh installs it)")
    session = f"kvtrace-explore-{os.getpid()}"
    status = tmp_path / "status"
    command = (f"cd {shlex.quote(str(ROOT))} && {shlex.quote(sys.executable)} -m kvtrace explore "
               f"{shlex.quote(str(RECOMPUTE))}; echo $? > {shlex.quote(str(status))}")
    env = {**os.environ, "TERM": "xterm-256color"}
    subprocess.run(["tmux", "-L", session, "new-session", "-d", "-s", session, "-x", "80", "-y", "24",
                    "sh", "-c", command], check=True, env=env, timeout=30)
    try:
        pane = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ("q quit" in pane and "20 requests by" in pane):
            time.sleep(0.5)
            pane = subprocess.run(["tmux", "-L", session, "capture-pane", "-p", "-t", session],
                                  capture_output=True, text=True, timeout=30).stdout
        lines = pane.splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), pane
        assert "tiny-recompute" in pane and "preemptions 22 (15 seqs, 7 again)" in pane, pane
        assert "20 requests by preemptions" in pane and "q quit" in pane, pane
        subprocess.run(["tmux", "-L", session, "send-keys", "-t", session, "q"], check=True, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not status.exists():
            time.sleep(0.2)
        assert status.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "-L", session, "kill-server"], capture_output=True, timeout=30)


def test_a_swapped_request_keeps_its_positions():
    screens = drive(Explorer([str(RUNS / "tiny-swap")]), ["enter"])
    story = screens[1]
    preempted = next(line for line in story.splitlines() if line.split()[:1] == ["swapped"])
    assert "preempted: " in preempted and " swapped out" in preempted and " lost" not in preempted
    assert "░ swapped" in story    # the legend: the states it went through
