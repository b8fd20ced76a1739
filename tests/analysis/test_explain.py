"""`kvtrace explain` on runs recorded here, through the engine and through the simulator: the causes
in the trace (schema 3), the SQL that reads them, the story and the verdict.

The four-block story of tests/engine/test_preemption.py: A and B fill the 4-block pool; at step 2 A
needs a block and B is preempted (8 positions recomputed). Then three queues, each bound by one
thing: seats (--max-num-seqs 2), the token budget (--max-num-batched-tokens 16, long prompts), and
the pool (a prompt that does not fit beside the one running).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.trace import db
from kvtrace.views import explain
from tests.helpers.cli import one_line_error, write_workload
from tests.helpers.cli import record as record_cli

pytestmark = pytest.mark.long  # records runs through the engine and the simulator

ENGINES = {"real": (), "sim": ("--engine", "sim", "--hardware", "l40s")}
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "runs"


def request(req_id: str, num_prompt: int, max_tokens: int, first: int = 11) -> dict:
    return {"id": req_id, "arrival_s": 0, "prompt_token_ids": list(range(first, first + num_prompt)),
            "max_tokens": max_tokens, "ignore_eos": True}


SCENARIOS = {
    # name: (requests, record options)
    # A runs on to fill the pool (7 + 9 tokens, 15 positions: 4 blocks), so that B waits for blocks
    # through six of A's steps: more than the one step of its preemption, however the host's step
    # times vary (with 6 tokens, three steps against one, a slow first batch-of-one step tipped it)
    "four-block": ([request("A", 7, 9, 11), request("B", 7, 4, 21)],
                   ("--block-size", "4", "--num-gpu-blocks", "4", "--watermark", "0", "--no-enable-prefix-caching")),
    "seats": ([request(r, 8, 4, 11 + 10 * i) for i, r in enumerate("ABCD")],
              ("--block-size", "4", "--num-gpu-blocks", "64", "--max-num-seqs", "2")),
    "budget": ([request("A", 40, 2, 11), request("B", 40, 2, 111)],
               ("--block-size", "4", "--num-gpu-blocks", "64", "--max-num-batched-tokens", "16")),
    "blocks": ([request("A", 16, 6, 11), request("B", 12, 2, 111)],
               ("--block-size", "4", "--num-gpu-blocks", "6", "--watermark", "0", "--no-enable-prefix-caching")),
    "one-slow": ([request("A", 8, 2, 11), request("B", 8, 40, 21), request("C", 8, 2, 31)],
                 ("--block-size", "4", "--num-gpu-blocks", "64")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("explain")
    recorded = {}
    for name, (rows, options) in SCENARIOS.items():
        workload = write_workload(root / f"{name}.jsonl", rows)
        for engine, engine_options in ENGINES.items():
            if name == "one-slow" and engine == "sim":
                continue
            result, out = record_cli(root, workload, f"{name}-{engine}", "--backlog", *options, *engine_options)
            assert result.exit_code == 0, result.output
            recorded[name, engine] = out
    return recorded


def explained(run: Path, *args: str) -> dict:
    result = CliRunner().invoke(app, ["explain", str(run), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def main_cause(story: dict, state: str) -> str:
    """The cause with the most time over the story's waits in `state`."""
    totals: dict[str, float] = {}
    for wait in story["waits"]:
        if wait["state"] == state:
            for c in wait["causes"]:
                totals[c["cause"]] = totals.get(c["cause"], 0) + c["cause_ms"]
    return max(totals, key=totals.get)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_four_block_preemption_names_its_requester_step_and_cost(runs, engine):
    story = explained(runs["four-block", engine], "B")
    assert story["causes_recorded"] and story["req_id"] == "B"
    [p] = story["preemptions"]
    assert (p["requester_req_id"], p["requester_sample"], p["victim_reason"], p["self_preempted"]) == (
        "A", 0, "newest", False)
    assert (p["step"], p["reason"], p["positions_lost"], p["cached_tokens"], p["recomputed_tokens"]) == (
        2, "recompute", 8, 0, 8)
    assert p["recompute_ms_est"] > 0 and p["wait_ms"] > 0
    # waiting to resume: the step of the preemption admits nothing, then A holds the blocks
    [wait] = [w for w in story["waits"] if w["state"] == "preempted"]
    assert {c["cause"] for c in wait["causes"]} == {"preemption", "blocks"}
    assert main_cause(story, "preempted") == "blocks"
    assert sum(c["share"] for c in wait["causes"]) == pytest.approx(1)
    phases = [ph["phase"] for ph in story["phases"]]
    assert phases == ["waiting", "prefill", "decode", "preempted", "reprefill", "decode", "finished"][
        (phases[0] != "waiting"):]
    assert next(ph for ph in story["phases"] if ph["phase"] == "preempted")["preemption_no"] == 1
    assert "A's growth" in story["verdict"] and "8 tokens recomputed" in story["verdict"]
    assert "for free blocks" in story["verdict"]
    # A was never preempted; its story says so
    assert explained(runs["four-block", engine], "A")["preemptions"] == []


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("scenario, req_id, cause", [
    ("seats", "C", "seats"), ("seats", "D", "seats"), ("budget", "B", "budget"), ("blocks", "B", "blocks")])
def test_a_queue_bound_by_one_thing_is_put_down_to_it(runs, engine, scenario, req_id, cause):
    story = explained(runs[scenario, engine], req_id)
    assert story["preemptions"] == []
    assert main_cause(story, "waiting") == cause
    waited = sum(w["wait_ms"] for w in story["waits"])
    assert waited > 0
    share = sum(c["cause_ms"] for w in story["waits"] for c in w["causes"] if c["cause"] == cause) / waited
    assert share > 0.9, story["waits"]
    assert story["verdict"].startswith(f"queued {explain.fmt_ms(waited)}")
    assert explain.CAUSE_WORDS[cause] in story["verdict"]


@pytest.mark.parametrize("scenario", ["four-block", "seats", "budget", "blocks"])
def test_the_simulator_gives_the_engines_causes(runs, scenario):
    """The same scheduler decides in both: the same admission stops step by step, the same requesters."""
    def causes(run: Path):
        con = db.connect([run])
        return (con.sql("SELECT step, admission_stop FROM steps ORDER BY step").fetchall(),
                con.sql("SELECT step, req_id, requester_req_id, victim_reason FROM kv_events "
                        "WHERE kind = 'preempt' ORDER BY seq").fetchall())
    real, sim = causes(runs[scenario, "real"]), causes(runs[scenario, "sim"])
    assert real == sim
    assert {stop for _, stop in real[0]} >= {"nothing-waiting"} and None not in {stop for _, stop in real[0]}


def test_the_sql_gives_the_storys_numbers(runs):
    run = runs["four-block", "real"]
    con = db.connect([run])
    story = explained(run, "B")
    rows = db.records(db.run_analysis(con, "preemptions", req_id="B"))
    assert [{k: v for k, v in r.items() if k not in ("run_id", "req_id", "sample")} for r in rows] == story["preemptions"]
    noisy = db.records(db.run_analysis(con, "noisy_neighbours"))
    assert [(r["req_id"], r["rank"], r["preemptions"], r["victims"], r["positions_lost"], r["recomputed_tokens"])
            for r in noisy] == [("A", 1, 1, 1, 8, 8)]
    phases = db.run_analysis(con, "request_story", req_id="B").num_rows
    assert phases == len(story["phases"])
    # the verdict's figures are request_verdict's, and its totals those of the rows above
    [figures] = db.records(db.run_analysis(con, "request_verdict", req_id="B"))
    assert {k: v for k, v in figures.items() if k not in ("run_id", "req_id", "sample")} == story["figures"]
    assert figures["requesters"] == [{"req_id": "A", "sample": 0, "preemptions": 1}]
    assert figures["resume_wait_ms"] == pytest.approx(
        sum(w["wait_ms"] for w in story["waits"] if w["state"] == "preempted"))
    assert (figures["positions_lost"], figures["recomputed_tokens"], figures["resume_wait_cause"]) == (8, 8, "blocks")


def test_worst_lists_the_obviously_slow_request_first(runs):
    data = explained(runs["one-slow", "real"], "--worst", "3")
    assert data["requests"][0]["req_id"] == "B" and data["by"] == "e2e"
    assert [r["rank"] for r in data["requests"]] == [1, 2, 3]
    assert all(r["verdict"] for r in data["requests"])
    by_preemptions = explained(runs["four-block", "real"], "--worst", "1", "--by", "preemptions")
    assert [(r["req_id"], r["preemptions"]) for r in by_preemptions["requests"]] == [("B", 1)]
    assert "A's growth" in by_preemptions["requests"][0]["verdict"]


def test_the_terminal_story_and_the_dashboard_name_the_requester(runs):
    run = runs["four-block", "real"]
    result = CliRunner().invoke(app, ["explain", str(run), "B"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "preempted, waiting to resume" in result.stdout and "Preemptions" in result.stdout
    assert "A's growth" in " ".join(result.stdout.split())
    wide = CliRunner().invoke(app, ["analyze", str(run)], env={"COLUMNS": "160"})
    assert "noisy neighbours" in wide.stdout and "most preempted" in wide.stdout
    narrow = CliRunner().invoke(app, ["analyze", str(run)], env={"COLUMNS": "80"})
    assert "noisiest: A preempted 1×" in narrow.stdout and len(narrow.stdout.splitlines()) <= 24


def test_a_run_before_schema_3_still_explains_with_the_causes_unknown():
    run = FIXTURES / "tiny-recompute"
    top = explained(run, "--worst", "1", "--by", "preemptions")["requests"][0]
    story = explained(run, top["req_id"])
    assert not story["causes_recorded"]
    assert story["preemptions"] and all(p["requester_req_id"] is None for p in story["preemptions"])
    assert {c["cause"] for w in story["waits"] for c in w["causes"]} <= {"unknown", "idle"}
    assert "an unrecorded requester" in story["verdict"]


def test_explain_refuses_what_it_cannot_answer(runs):
    run = str(runs["four-block", "real"])
    assert "no request 'Q'" in one_line_error(["explain", run, "Q"])
    assert "--worst N or --at TIME" in one_line_error(["explain", run])
    assert "--worst N or --at TIME" in one_line_error(["explain", run, "B", "--worst", "2"])
    assert "no wall clock" in one_line_error(["explain", run, "--at", "02:14"])
    assert "--worst must be >= 1" in one_line_error(["explain", run, "--worst", "0"])
    assert "explain takes one run" in one_line_error(["explain", str(FIXTURES), "--worst", "1"])
    # REQ_ID:SAMPLE
    assert explained(Path(run), "B:0")["sample"] == 0


def _stamped_at_step_end(run: Path, out: Path) -> Path:
    """A copy of a run whose admit and preempt events carry their step's end time, as a vLLM capture
    stamps every event of a step (kvtrace/vllm/capture: at the end of update_from_output)."""
    import shutil

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    shutil.copytree(run, out)
    steps = pq.read_table(out / "steps").select(["step", "end_s"]).to_pydict()
    end_of = dict(zip(steps["step"], steps["end_s"]))
    moved = 0
    for path in (out / "kv_events").glob("*.parquet"):
        events = pq.read_table(path)
        kinds, stamped = events["kind"].to_pylist(), events["ts_s"].to_pylist()
        ts = [end_of[step] if kind in ("admit", "preempt") else t
              for kind, step, t in zip(kinds, events["step"].to_pylist(), stamped)]
        events = events.set_column(events.schema.get_field_index("ts_s"), "ts_s", pa.array(ts, pa.float64()))
        moved += pc.sum(pc.not_equal(events["ts_s"], pa.array(stamped))).as_py()
        pq.write_table(events, path)
    assert moved > 0
    return out


@pytest.mark.parametrize("scenario, req_id", [("four-block", "B"), ("blocks", "B"), ("seats", "D")])
def test_events_stamped_at_their_steps_end_tell_the_same_story(runs, tmp_path, scenario, req_id):
    """A vLLM capture stamps a step's events when the step ends: a request admitted in a step is still in
    prefill for that step (not queued until its first token), and a victim stalls from the step's start."""
    run = runs[scenario, "real"]
    story = explained(run, req_id)
    late = explained(_stamped_at_step_end(run, tmp_path / "late"), req_id)
    assert [p["phase"] for p in late["phases"]] == [p["phase"] for p in story["phases"]]
    steps = {row[0]: row[1:] for row in db.connect([run]).sql("SELECT step, start_s, end_s FROM steps").fetchall()}
    for ph, orig in zip(late["phases"], story["phases"]):
        assert ph["first_step"] == orig["first_step"], (ph, orig)
        if ph["phase"] in ("prefill", "preempted", "reprefill"):
            # marked at the start of the step that decided it; the engine stamped it a little later
            assert ph["start_s"] == steps[ph["first_step"]][0]
            assert 0 <= orig["start_s"] - ph["start_s"] < steps[ph["first_step"]][1] - steps[ph["first_step"]][0]
    assert late["verdict"].split(",")[0].split()[0] == story["verdict"].split(",")[0].split()[0]
    assert [w["state"] for w in late["waits"]] == [w["state"] for w in story["waits"]]
    assert main_cause(late, late["waits"][0]["state"]) == main_cause(story, story["waits"][0]["state"])
    assert [p["step"] for p in late["preemptions"]] == [p["step"] for p in story["preemptions"]]
    for s in (story, late):   # a preemption's wait is its phase of waiting to resume, by either stamp
        waits = [ph["duration_ms"] for ph in s["phases"] if ph["phase"] in ("preempted", "swapped")]
        assert [p["wait_ms"] for p in s["preemptions"]] == pytest.approx(waits)


def test_a_request_is_found_by_its_x_request_id_or_a_unique_start():
    """vLLM's OpenAI server names the request sent with X-Request-Id abc `cmpl-abc-0-<suffix>` (chat:
    `chatcmpl-abc-<suffix>`); kvtrace record's driver `kvt3-<suffix>`."""
    known = {"cmpl-abc-0-1f2e3d4c", "cmpl-abc-def-0-99aa", "chatcmpl-xyz-77ab", "cmpl-abcd-0-5555",
             "kvt2-b4668", "kvt23-a539", "cmpl-two-0-aa", "cmpl-two-1-aa"}
    parse = explain.parse_request
    assert parse("abc", known) == ("cmpl-abc-0-1f2e3d4c", 0)       # not abc-def's, not abcd's
    assert parse("abc-def", known) == ("cmpl-abc-def-0-99aa", 0)
    assert parse("xyz:1", known) == ("chatcmpl-xyz-77ab", 1)
    assert parse("kvt2", known) == ("kvt2-b4668", 0)
    assert parse("cmpl-abcd", known) == ("cmpl-abcd-0-5555", 0)    # a unique start of an id
    assert parse("kvt23-a539", known) == ("kvt23-a539", 0)
    with pytest.raises(explain.KvtraceError, match="'two' names 2 requests .*give more of the id"):
        parse("two", known)
    with pytest.raises(explain.KvtraceError, match="no request 'nope'"):
        parse("nope", known)


def test_a_captures_explain_finds_requests_by_id_and_time_on_the_wall_clock(tmp_path):
    """The capture fixture (tests/fixtures/captures/bursts) as a run: its request kvt2 found by the
    id its client sent, its times on the wall clock, and --at listing the requests in flight then,
    as the requests table says."""
    run = tmp_path / "bursts"
    capture = Path(__file__).resolve().parents[1] / "fixtures" / "captures" / "bursts"
    assert CliRunner().invoke(app, ["capture", "run", str(capture), "-o", str(run)]).exit_code == 0
    story = json.loads(CliRunner().invoke(app, ["explain", str(run), "kvt2", "--json"]).stdout)
    assert story["req_id"] == "kvt2-b46681fd" and story["clock"] == "wall (UTC)"
    meta = json.loads((run / "meta.json").read_text())["capture"]["window"]
    first = story["phases"][0]
    wall = meta["since_unix"] + first["start_s"] - meta["start_s"]
    from datetime import datetime, timezone
    assert first["start"] == datetime.fromtimestamp(wall, timezone.utc).strftime("%H:%M:%S.%f")[:-3] + "Z"
    decoding = story["phases"][2]["start"]   # as explain printed it, 12:00:15.979Z
    out = CliRunner().invoke(app, ["explain", str(run), "--at", decoding])
    assert out.exit_code == 0 and "requests in flight at " + decoding in out.stdout, out.output
    at = json.loads(CliRunner().invoke(app, ["explain", str(run), "--at", decoding, "--json"]).stdout)
    con = db.connect([run])
    expected = {r for (r,) in con.execute(
        "SELECT req_id FROM requests WHERE arrival_s <= ? AND (finish_s IS NULL OR finish_s >= ?)",
        [at["at_s"], at["at_s"]]).fetchall()}
    assert {r["req_id"] for r in at["requests"]} == expected and "kvt2-b46681fd" in expected
    assert "is outside the run" in one_line_error(["explain", str(run), "--at", "2026-11-18T13:00:00Z"])
