"""What a replay takes from the workload (kvtrace/record/replay.py): arrivals on the replay clock,
counts that must be positive (checked when the file is read, before anything runs), what `kvtrace
record` refuses up front and how it says so, each request's own seed, the progress callback and the
counts it sees, a stop between steps, the memory a replay keeps, and the replay's summary in meta.json."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from kvtrace.record.replay import prepare, replay
from kvtrace.trace.db import connect
from tests.helpers.cli import one_line_error, record, write_workload
from tests.helpers.engine_runs import ListTracer


def test_time_scale_divides_the_arrival_times(tmp_path):
    workload = write_workload(tmp_path / "w.jsonl", [
        {"id": f"r{i}", "arrival_s": 0.4 * i, "prompt_tokens": 6, "max_tokens": 2} for i in range(4)])
    result, run = record(tmp_path, workload, "fast", "--block-size", "4", "--time-scale", "4")
    assert result.exit_code == 0, result.output
    con = connect([run])
    arrivals = con.sql("SELECT req_id, arrival_s FROM requests ORDER BY req_id").fetchall()
    assert arrivals == [("r0", 0.0), ("r1", pytest.approx(0.1)), ("r2", pytest.approx(0.2)),
                        ("r3", pytest.approx(0.3))]
    # nothing is scheduled before it arrives, and the last arrives at 0.3 s, not 1.2 s
    early = con.sql("SELECT count(*) FROM requests WHERE first_scheduled_s < arrival_s").fetchall()
    assert early == [(0,)]
    [(first_scheduled,)] = con.sql("SELECT max(first_scheduled_s) FROM requests").fetchall()
    assert 0.3 <= first_scheduled < 1.2
    meta = json.loads((run / "meta.json").read_text())
    assert meta["replay"] == {"mode": "time-scale", "time_scale": 4.0}


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -3), ("n", -1), ("prompt_tokens", -5), ("prefix_tokens", -2)])
def test_negative_counts_are_refused(tmp_path, field, value):
    row = {"id": "a", "arrival_s": 0, "prompt_tokens": 8, "max_tokens": 2}
    if field == "prefix_tokens":
        row["prefix_group"] = "g"
    row[field] = value
    path = write_workload(tmp_path / "w.jsonl", [{"id": "ok", "arrival_s": 0, "prompt_tokens": 4, "max_tokens": 2},
                                                 row])
    result = CliRunner().invoke(app, ["workload", "check", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"kvtrace: error: {path}: line 2: {field} must be >= 1, got {value}\n"
    assert result.stdout == ""



def test_requests_that_can_never_fit_are_listed_five_at_a_time_with_a_count(tmp_path):
    # 4 blocks of 4 positions: a prompt of 15 tokens and its first output token fit, one of 16 never does
    rows = [{"id": "fits", "arrival_s": 0, "prompt_tokens": 15, "max_tokens": 4}]
    rows += [{"id": f"big{i}", "arrival_s": 0, "prompt_tokens": 16 + i, "max_tokens": 4} for i in range(6)]
    workload = write_workload(tmp_path / "w.jsonl", rows)
    message = one_line_error(["record", "--model", "tiny", "-w", str(workload), "-o", str(tmp_path / "r"),
                              "--num-gpu-blocks", "4", "--block-size", "4"])
    listed = "; ".join(f"line {i + 2}: a prompt of {16 + i} tokens needs {blocks} blocks"
                       for i, blocks in enumerate([5, 5, 5, 5, 6]))   # the prompt and one token
    assert message == (f"kvtrace: error: {workload}: 6 request(s) can never fit the KV pool of 4 usable blocks "
                       f"of 4 tokens: {listed}; and 1 more")
    assert not (tmp_path / "r").exists()


def test_exactly_five_requests_that_never_fit_are_all_listed_with_no_and_more(tmp_path):
    rows = [{"id": f"big{i}", "arrival_s": 0, "prompt_tokens": 16, "max_tokens": 4} for i in range(5)]
    workload = write_workload(tmp_path / "w.jsonl", rows)
    message = one_line_error(["record", "--model", "tiny", "-w", str(workload), "-o", str(tmp_path / "r"),
                              "--num-gpu-blocks", "4", "--block-size", "4"])
    assert message.endswith("line 5: a prompt of 16 tokens needs 5 blocks") and message.count("line ") == 5


def test_the_run_summary_counts_what_the_trace_holds(tmp_path):
    # two samples of one request, a preemption in a pool of 5 blocks, and an idle gap before "c" (the
    # simulated clock jumps it)
    workload = write_workload(tmp_path / "w.jsonl", [
        {"id": "a", "arrival_s": 0, "prompt_tokens": 6, "max_tokens": 8, "n": 2},
        {"id": "b", "arrival_s": 0.01, "prompt_tokens": 9, "max_tokens": 6},
        {"id": "c", "arrival_s": 3, "prompt_tokens": 5, "max_tokens": 3}])
    result, run = record(tmp_path, workload, "r", "--engine", "sim", "--hardware", "l40s", "--num-gpu-blocks", "5",
                         "--block-size", "4")
    assert result.exit_code == 0, result.output
    summary = json.loads((run / "meta.json").read_text())["summary"]
    con = connect([run])
    [(steps, preemptions, end_s)] = con.sql("SELECT count(*), sum(preemptions), max(end_s) FROM steps").fetchall()
    [(tokens,)] = con.sql("SELECT count(*) FROM tokens").fetchall()
    assert summary["num_requests"] == summary["num_finished"] == 4
    assert (summary["num_steps"], summary["num_output_tokens"], summary["num_preemptions"]) == (steps, tokens, 1)
    assert preemptions == 1 and tokens == 2 * 8 + 6 + 3
    assert summary["duration_s"] == end_s and 3.0 < end_s < 3.1
    arrivals = con.sql("SELECT req_id, min(arrival_s), min(first_scheduled_s) FROM requests "
                       "GROUP BY req_id ORDER BY req_id").fetchall()
    assert arrivals[2] == ("c", 3.0, 3.0)    # scheduled the moment it arrives, not a step later


def test_a_never_fitting_request_names_the_reservation_that_made_it_so(tmp_path):
    workload = write_workload(tmp_path / "w.jsonl", [{"id": "a", "arrival_s": 0, "prompt_tokens": 6, "max_tokens": 20}])
    message = one_line_error(["record", "--model", "tiny", "-w", str(workload), "-o", str(tmp_path / "r"),
                              "--num-gpu-blocks", "4", "--block-size", "4", "--kv-reserve", "max-tokens"])
    assert message == (f"kvtrace: error: {workload}: 1 request(s) can never fit the KV pool of 4 usable blocks "
                       "of 4 tokens: line 1: a prompt of 6 tokens needs 7 blocks (--kv-reserve max-tokens)")


def replay_of(make_engine, rows: list[dict], **settings):
    """prepare() and replay() as `kvtrace record` calls them, on the tiny model (real engine)."""
    from kvtrace.workload import WorkloadRequest

    engine = make_engine(ListTracer(), **settings)
    requests = [WorkloadRequest(**{"id": f"r{i}", "arrival_s": 0.0, **row}, line=i + 1) for i, row in enumerate(rows)]
    items = prepare(requests, engine, tokenizer=None, seed=settings.get("seed", 0), time_scale=None, backlog=True,
                    workload_name="w.jsonl")
    return engine, items


def test_a_request_samples_with_its_own_seed_whatever_the_run_seed(make_engine):
    rows = [{"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 1.0, "seed": 7},
            {"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 1.0}]
    outputs = []
    for seed in (1, 2):
        engine, items = replay_of(make_engine, rows, seed=seed)
        assert [item.params.seed for item in items] == [7, seed]
        replay(engine, items)
        outputs.append({"r0": [], "r1": []})
        for r in engine.tracer.records:
            for req_id, token in zip(r.token_req_ids, r.token_ids):
                outputs[-1][req_id].append(token)
    assert outputs[0]["r0"] == outputs[1]["r0"] and outputs[0]["r1"] != outputs[1]["r1"]


def test_the_progress_callback_comes_every_quarter_second_then_at_the_end(make_engine, monkeypatch):
    rows = [{"prompt_tokens": 6, "max_tokens": 3}, {"prompt_tokens": 5, "max_tokens": 7, "n": 2}]
    import kvtrace.record.replay

    clock = [1000.0]           # the progress clock: each step takes 1/8 s, and nothing else takes time
    monkeypatch.setattr(kvtrace.record.replay.time, "monotonic", lambda: clock[0])
    runs = []
    for every in (0.0, None):
        seen = []
        engine, items = replay_of(make_engine, rows)
        advance = engine.advance   # the replay's step

        def timed_step(until_s):
            clock[0] += 0.125
            return advance(until_s)

        engine.advance = timed_step
        progress = {} if every is None else {"progress_every_s": every}
        stats = replay(engine, items, on_progress=lambda s: seen.append((s.num_steps, s.num_finished)), **progress)
        runs.append([steps for steps, _ in seen])
        assert seen[-1] == (stats.num_steps, 3)
    assert stats.num_requests == 3 and stats.num_output_tokens == 3 + 2 * 7 and stats.num_steps == 7
    assert runs[0] == [1, 2, 3, 4, 5, 6, 7, 7]      # every 0 s: after each step, then the end
    assert runs[1] == [1, 3, 5, 7, 7]               # by default every 0.25 s (2 steps), then the end


def test_the_progress_callback_sees_the_counts_of_the_run_so_far(make_engine):
    # every 0 s: after each step the callback gets the finished samples and the preemptions so far,
    # not only the steps (A, 2 tokens, finishes in step 1; B, 5 tokens, in step 4)
    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 2}, {"prompt_tokens": 5, "max_tokens": 5}])
    seen = []
    replay(engine, items, on_progress=lambda s: seen.append((s.num_steps, s.num_finished)), progress_every_s=0.0)
    assert seen == [(1, 0), (2, 1), (3, 1), (4, 1), (5, 2), (5, 2)]


def test_a_replay_keeps_no_finished_samples_in_memory(make_engine):
    # a long replay must stay flat in memory: the trace keeps what matters, the engine's outputs nothing
    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 2, "n": 2}, {"prompt_tokens": 5, "max_tokens": 3}])
    stats = replay(engine, items)
    assert stats.num_finished == 3 and engine.outputs == {}


def test_a_backlog_arrives_all_at_once_at_zero(make_engine):
    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 2, "arrival_s": 0.5},
                                            {"prompt_tokens": 5, "max_tokens": 2, "arrival_s": 2.0}])
    replay(engine, items)
    assert [(s.req_id, s.arrival_s) for r in engine.tracer.records for s in r.finished] == [("r0", 0.0), ("r1", 0.0)]
    assert engine.tracer.records[0].num_prefill_tokens == 6 + 5


def test_a_stop_raised_between_steps_ends_the_replay_there(make_engine):
    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 20}])
    calls = []

    def stop():
        calls.append(len(engine.tracer.records))
        if len(calls) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replay(engine, items, stop=stop)
    assert calls == [0, 1, 2, 3] and engine.step_counter == 3


def test_a_replay_keeps_no_finished_sequences_in_memory(make_engine):
    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 3}] * 3)
    replay(engine, items)
    assert engine.outputs == {} and engine.num_finished_seqs == 3


def test_a_replay_hands_each_prompt_to_the_engine_and_keeps_none(make_engine):
    # the first sample's token_ids is the prepared list itself (no copy of a long prompt), the other
    # samples' are copies, and the items let go of their prompts
    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 3, "n": 2, "ignore_eos": True},
                                            {"prompt_tokens": 5, "max_tokens": 2, "ignore_eos": True}])
    prompts = [item.prompt_token_ids for item in items]
    originals = [list(p) for p in prompts]
    replay(engine, items)
    assert [item.prompt_token_ids for item in items] == [None, None]
    assert [len(p) for p in prompts] == [6 + 3, 5 + 2]   # the outputs were appended to the handed lists
    assert [p[:len(o)] for p, o in zip(prompts, originals)] == originals


def test_prepare_refuses_a_prompt_with_no_room_for_an_output_token(make_engine):
    # before the run, with the workload's name: not a request rejected at its arrival
    from kvtrace.errors import KvtraceError
    from kvtrace.workload import WorkloadRequest

    engine = make_engine(ListTracer(), max_model_len=16)
    requests = [WorkloadRequest(id="a", arrival_s=0.0, prompt_tokens=8, max_tokens=4, line=1),
                WorkloadRequest(id="b", arrival_s=0.0, prompt_tokens=16, max_tokens=4, line=2)]
    with pytest.raises(KvtraceError) as info:
        prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=False, workload_name="w.jsonl")
    assert str(info.value) == ("1 prompt leaves no room for an output token within max_model_len 16: "
                               "line 2 (id b): 16 tokens")


def test_prepare_orders_requests_given_out_of_order_by_arrival(make_engine):
    # a caller's requests need not come sorted (load_workload sorts a file's): the replay admits by arrival
    from kvtrace.workload import WorkloadRequest

    engine = make_engine(ListTracer())
    requests = [WorkloadRequest(id=name, arrival_s=t, prompt_tokens=4, max_tokens=2) for name, t in
                (("late", 0.5), ("early", 0.0), ("middle", 0.2))]
    items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=2.0, backlog=False, workload_name="w")
    assert [(item.req.id, item.arrival_s) for item in items] == [("early", 0.0), ("middle", 0.1), ("late", 0.25)]


def test_the_replay_tunes_the_collector_for_its_run_and_restores_it(make_engine):
    # what exists when the replay starts is frozen out of the collector's view, which runs less often;
    # the caller's settings come back afterwards
    import gc

    engine, items = replay_of(make_engine, [{"prompt_tokens": 6, "max_tokens": 3}])
    before = gc.get_threshold(), gc.get_freeze_count()
    during = []
    replay(engine, items, on_progress=lambda s: during.append((gc.get_threshold(), gc.get_freeze_count())),
           progress_every_s=0.0)
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    *steps, end = during   # after each step, then once the replay is over
    assert steps and all(threshold == (200_000, 20, 100) and frozen > before[1] for threshold, frozen in steps)
    assert end == before


@pytest.mark.parametrize("seed", [1, 2])
def test_a_simulated_replays_leaps_end_at_the_next_arrival(make_engine, seed):
    """The simulated replay runs decode-only steps at once (the fast path's leaps), each
    ending at the next arrival: the same steps, events and times as the general pass stepping one by
    one, with most steps in them."""
    import random

    from kvtrace.workload import WorkloadRequest
    from tests.engine.test_fast_path import timed
    from tests.engine.test_simulation import decisions

    rng = random.Random(seed)
    arrival = 0.0
    rows = []
    for i in range(40):
        arrival += rng.expovariate(40.0)
        rows.append({"id": f"r{i}", "arrival_s": round(arrival, 4), "prompt_tokens": rng.randint(4, 30),
                     "max_tokens": rng.randint(20, 90)})

    def run(leaps: bool):
        engine = make_engine(ListTracer(), engine="sim", hardware="a100-80gb", num_gpu_blocks=400,
                             sim_fast_path=leaps)
        requests = [WorkloadRequest(**row, line=i + 1) for i, row in enumerate(rows)]
        items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=False, workload_name="w")
        stats = replay(engine, items)
        return engine.tracer, stats, engine.fast_path.num_leap_steps if leaps else 0

    stepped, stepped_stats, _ = run(False)
    leaped, stats, in_leaps = run(True)
    assert decisions(leaped) == decisions(stepped)
    assert timed(leaped) == timed(stepped)
    assert (stats.num_steps, stats.num_output_tokens) == (stepped_stats.num_steps, stepped_stats.num_output_tokens)
    assert in_leaps >= stats.num_steps // 2, f"{in_leaps} of {stats.num_steps} steps in leaps"


def test_an_async_replay_hands_its_last_steps_record_to_the_trace(make_engine):
    # with async scheduling the last step's output is never processed (vLLM leaves it in its batch
    # queue): the replay's end must still record that step, or the trace ends a step short
    engine, items = replay_of(make_engine, [{"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 6},
                                            {"prompt_token_ids": [9, 8, 7], "max_tokens": 4}], async_scheduling=True)
    stats = replay(engine, items)
    steps = [r.step for r in engine.tracer.records]
    assert steps == list(range(len(steps))) and len(steps) == stats.num_steps
