"""The vLLM capture's importer and CLI checks, without vLLM: capture chunks built by hand."""
from __future__ import annotations

import pytest

from kvtrace.trace import db
from kvtrace.trace.schema import OPTIONAL_TABLES, TABLES, TIER_ONLY
from kvtrace.vllm.capture.sink import COLUMNS
from kvtrace.vllm.importer import convert, map_ids
from tests.helpers.cli import one_line_error
from tests.helpers.vllm_runs import ITEMS, chunk, write_capture


def test_the_capture_writes_kvtraces_columns():
    """The capture (which cannot import pyarrow) keeps its own column lists: they must be the trace's,
    less run_id and the token predecessors, which the importer adds. The KV tiers' columns (schema 6) it
    writes all of a table's or none (the importer writes those it lacks as null)."""
    added = {"run_id", "prev_step", "prev_ts_s"}
    schemas = {**TABLES, "spec_decode": OPTIONAL_TABLES["spec_decode"]}   # a speculative server's drafts
    for table, columns in COLUMNS.items():
        tiers = set(TIER_ONLY.get(table, ()))
        left_out = added | (tiers if not tiers & set(columns) else set())
        assert list(columns) == [c for c in schemas[table].names if c not in left_out], table
    assert set(COLUMNS) == set(schemas) - {"gpu_samples"}


def test_vllm_request_ids_map_back_to_the_workloads():
    ids = map_ids(["kvt0-1a2b3c4d", "1_kvt3-deadbeef", "0_kvt3-deadbeef", "cmpl-kvt0-0-0f0f0f0f",
                   "1_cmpl-kvt3-0-ab12ab12", "kvt9-00000000", "someone-else", ""], ITEMS)
    assert ids["kvt0-1a2b3c4d"] == ("chat-a", 0)
    assert ids["1_kvt3-deadbeef"] == ("chat-b", 1) and ids["0_kvt3-deadbeef"] == ("chat-b", 0)
    assert ids["cmpl-kvt0-0-0f0f0f0f"] == ("chat-a", 0)          # the OpenAI server's id
    assert ids["1_cmpl-kvt3-0-ab12ab12"] == ("chat-b", 1)
    assert ids["kvt9-00000000"] == ("kvt9-00000000", 0)          # no such workload request: kept as it is
    assert ids["someone-else"] == ("someone-else", 0)            # another client's request on the server
    assert "" not in ids


def _request(raw: str, finish: float, reason: str, out: int, **extra) -> dict:
    row = {"req_id": raw, "sample": 0, "n": 1, "priority": 0, "arrival_s": 100.0, "prompt_tokens": 40,
           "max_tokens": 8, "output_tokens": out, "first_scheduled_s": 100.1, "first_token_s": 100.2,
           "finish_s": finish, "finish_reason": reason, "preemptions": 0, "swaps": 0, "recomputed_tokens": 0,
           "prefix_hit_tokens": 0}
    return {**row, **extra}


def test_a_capture_becomes_a_run_rebased_mapped_and_windowed(tmp_path):
    capture = tmp_path / "capture"
    old = chunk({"requests": [_request("kvt0-00000000", 50.0, "length", 8)],      # an earlier replay on the server
                  "steps": [{"step": 0, "start_s": 49.0, "end_s": 49.1, "total_blocks": 16}]})
    new = chunk({
        "requests": [_request("kvt0-1a2b3c4d", 103.0, "length", 8),
                     _request("0_kvt3-deadbeef", 104.0, "length", 4, max_tokens=4),
                     _request("1_kvt3-deadbeef", 104.5, "length", 4, max_tokens=4)],
        "steps": [{"step": 7, "start_s": 100.1, "end_s": 100.2, "device_ms": 80.0, "running": 1, "waiting": 0,
                   "swapped": 0, "prefill_tokens": 40, "decode_tokens": 0, "recompute_tokens": 0, "preemptions": 0,
                   "free_blocks": 14, "used_blocks": 2, "cached_blocks": 0, "total_blocks": 16, "kv_tokens": 40}],
        "kv_events": [{"seq": 0, "step": 7, "ts_s": 100.2, "kind": "alloc", "req_id": "kvt0-1a2b3c4d", "sample": 0,
                       "blocks": [1, 2], "num_blocks": 2, "num_tokens": 0, "bytes": 0, "reason": "prefill",
                       "num_cached_tokens": 0, "num_recomputed_tokens": 0}],
        "tokens": [{"req_id": "1_kvt3-deadbeef", "sample": 0, "idx": 0, "token_id": 5, "step": 7, "ts_s": 100.2}]})
    write_capture(capture, [old, new])
    run = tmp_path / "run"
    rows = convert(capture, run, "run", list(ITEMS.values()), origin=100.0, interrupted=False, window=(99.5, 200.0))
    assert rows["requests"] == 3 and rows["steps"] == 1      # the earlier replay's rows are left out
    (run / "meta.json").write_text('{"run_id": "run", "schema_version": 1}')
    con = db.connect([run])
    got = con.execute("SELECT req_id, sample, n, finish_reason, finish_s FROM requests ORDER BY req_id, sample").fetchall()
    # n from the workload; chat-b stopped at its recorded output_tokens (4 < max_tokens 16): `stop`
    assert got == [("chat-a", 0, 1, "length", pytest.approx(3.0)), ("chat-b", 0, 2, "stop", pytest.approx(4.0)),
                   ("chat-b", 1, 2, "stop", pytest.approx(4.5))]
    assert con.execute("SELECT req_id, sample, ts_s FROM tokens").fetchall() == [("chat-b", 1, pytest.approx(0.2))]
    assert con.execute("SELECT start_s FROM steps").fetchone()[0] == pytest.approx(0.1)


def test_a_preemptions_requester_maps_back_and_an_older_capture_reads_without_causes(tmp_path):
    capture = tmp_path / "capture"
    preempt = {"seq": 0, "step": 3, "ts_s": 100.2, "kind": "preempt", "req_id": "1_kvt3-deadbeef", "sample": 0,
               "blocks": [1], "num_blocks": 1, "num_tokens": 40, "bytes": 0, "reason": "recompute",
               "num_cached_tokens": 0, "num_recomputed_tokens": 0, "requester_req_id": "kvt0-1a2b3c4d",
               "requester_sample": 0, "victim_reason": "newest"}
    step = {"step": 3, "start_s": 100.1, "end_s": 100.2, "total_blocks": 16, "admission_stop": "preemption"}
    new = chunk({"kv_events": [preempt], "steps": [step]})
    # a chunk of a capture from before schema 3: no cause columns at all
    old = chunk({"kv_events": [{**preempt, "seq": 1, "step": 4}], "steps": [{**step, "step": 4}]})
    for table in old.values():
        for column in ("requester_req_id", "requester_sample", "victim_reason", "admission_stop"):
            table.pop(column, None)
    write_capture(capture, [new, old])
    run = tmp_path / "run"
    convert(capture, run, "run", list(ITEMS.values()), origin=100.0, interrupted=False)
    (run / "meta.json").write_text('{"run_id": "run", "schema_version": 3}')
    con = db.connect([run])
    assert con.execute("SELECT step, req_id, sample, requester_req_id, requester_sample, victim_reason FROM kv_events "
                       "ORDER BY seq").fetchall() == [(3, "chat-b", 1, "chat-a", 0, "newest"),
                                                       (4, "chat-b", 1, None, None, None)]
    assert con.execute("SELECT step, admission_stop FROM steps ORDER BY step").fetchall() == [
        (3, "preemption"), (4, None)]


def test_an_interrupted_capture_accounts_for_every_sample(tmp_path):
    capture = tmp_path / "capture"
    write_capture(capture, [chunk({
        "requests": [_request("kvt0-1a2b3c4d", 103.0, "length", 8)],
        "steps": [{"step": 0, "start_s": 100.1, "end_s": 103.5, "total_blocks": 16}],
        "tokens": [{"req_id": "1_kvt3-deadbeef", "sample": 0, "idx": i, "token_id": 5, "step": 0, "ts_s": 101.0 + i}
                   for i in range(2)]})])
    run = tmp_path / "run"
    convert(capture, run, "run", list(ITEMS.values()), origin=100.0, interrupted=True)
    (run / "meta.json").write_text('{"run_id": "run", "schema_version": 1}')
    con = db.connect([run])
    rows = con.execute("SELECT req_id, sample, finish_reason, output_tokens, first_token_s FROM requests "
                       "ORDER BY req_id, sample").fetchall()
    assert rows == [("chat-a", 0, "length", 8, pytest.approx(0.2 + 100.0 - 100.0)),
                    ("chat-b", 0, "aborted", 0, None), ("chat-b", 1, "aborted", 2, pytest.approx(1.0))]


@pytest.mark.parametrize("args, message", [
    (["--preemption-mode", "swap"], "vLLM V1 preempts by recompute only"),
    (["--preemption-policy", "fewest-computed"], "vLLM has no fewest-computed policy"),
    (["--kv-reserve", "max-tokens"], "--kv-reserve is for kvtrace's engines"),
    (["--num-cpu-blocks", "8"], "no swap space"),
    (["--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python: not an executable file"),
    (["--vllm-arg", "novalue", "--vllm-python", "/bin/sh"], "--vllm-arg 'novalue': expected KEY=VALUE"),
])
def test_what_vllm_cannot_do_is_refused_in_one_line(tmp_path, args, message):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": "a", "arrival_s": 0, "prompt_tokens": 8, "max_tokens": 4}\n')
    line = one_line_error(["record", "--engine", "vllm", "--model", "tiny", "-w", str(workload),
                           "-o", str(tmp_path / "run"), *args])
    assert message in line
    assert not (tmp_path / "run").exists()


def test_endpoint_options_are_checked(tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": "a", "arrival_s": 0, "prompt_tokens": 8, "max_tokens": 4}\n')
    assert "--endpoint needs --capture-dir" in one_line_error(
        ["record", "--endpoint", "http://127.0.0.1:9", "-w", str(workload)])
    assert "no capture.json" in one_line_error(
        ["record", "--endpoint", "http://127.0.0.1:9", "--capture-dir", str(tmp_path / "nothing"), "--model", "tiny",
         "-w", str(workload), "-o", str(tmp_path / "run")])
