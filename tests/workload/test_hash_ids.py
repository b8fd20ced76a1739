"""hash_ids in the workload format: a count prompt's prefix structure, block by block, with no token
content. Equal hashes give equal blocks (and prefix-cache hits in every engine); bad input is one
line naming the field."""
from __future__ import annotations

import json

import pytest

from kvtrace.errors import KvtraceError
from kvtrace.record.replay import prepare, replay
from kvtrace.workload import WorkloadRequest, load_workload, resolve_prompt_ids, save_workload, synthetic_ids
from tests.helpers.cli import one_line_error, write_workload
from tests.helpers.engine_runs import ListTracer


def ids(req: WorkloadRequest, seed: int = 0) -> list[int]:
    return resolve_prompt_ids(req, vocab_size=512, seed=seed)


def test_equal_hashes_give_equal_blocks_and_the_tail_is_the_requests_own():
    a = WorkloadRequest(id="a", arrival_s=0, prompt_tokens=10, hash_ids=[7, 8], hash_block_size=4, max_tokens=1)
    b = WorkloadRequest(id="b", arrival_s=0, prompt_tokens=9, hash_ids=[7, 9], hash_block_size=4, max_tokens=1)
    ia, ib = ids(a), ids(b)
    assert len(ia) == 10 and len(ib) == 9
    assert ia[:4] == ib[:4] and ia[4:8] != ib[4:8]
    # the tail beyond the listed blocks is the plain count prompt's ids of the request (its id and seed)
    assert ia[8:] == synthetic_ids("request:a", 2, vocab_size=512)
    # the same hash at another block size, or under another seed, is another block
    c = WorkloadRequest(id="c", arrival_s=0, prompt_tokens=10, hash_ids=[7], hash_block_size=5, max_tokens=1)
    assert ids(c)[:4] != ia[:4] and ids(a, seed=1)[:4] != ia[:4]
    # fewer ids than full blocks: the rest is the request's own; none at all is a plain count prompt
    d = WorkloadRequest(id="d", arrival_s=0, prompt_tokens=12, hash_ids=[], hash_block_size=4, max_tokens=1)
    assert ids(d) == ids(WorkloadRequest(id="d", arrival_s=0, prompt_tokens=12, max_tokens=1))


def test_hash_ids_are_saved_and_read_back(tmp_path):
    req = WorkloadRequest(id="r", arrival_s=0, prompt_tokens=9, hash_ids=[3, 2**63 + 5], hash_block_size=4,
                          max_tokens=2)
    path = tmp_path / "w.jsonl"
    save_workload([req], path)
    saved = json.loads(path.read_text())
    assert saved["hash_ids"] == [3, 2**63 + 5] and saved["hash_block_size"] == 4
    (back,) = load_workload(path)
    assert back == WorkloadRequest(**{**req.__dict__, "line": 1})


@pytest.mark.parametrize("row, message", [
    ({"prompt_tokens": 7, "hash_ids": [1, 2], "hash_block_size": 4},
     "line 1: hash_ids has 2 ids but prompt_tokens 7 holds only 1 full blocks of 4 tokens (one id per full block)"),
    ({"prompt_tokens": 8, "hash_ids": [1, "x"], "hash_block_size": 4},
     'line 1: hash_ids must be a list of integers, got [1, "x"]'),
    ({"prompt_tokens": 8, "hash_ids": 3, "hash_block_size": 4}, "line 1: hash_ids must be a list of integers, got 3"),
    ({"prompt_tokens": 8, "hash_ids": [1]},
     "line 1: hash_ids and hash_block_size go together (hash_block_size: the tokens each hash id stands for)"),
    ({"prompt_tokens": 8, "hash_ids": [1], "hash_block_size": 0}, "line 1: hash_block_size must be >= 1, got 0"),
    ({"prompt_token_ids": [20, 21, 22, 23], "hash_ids": [1], "hash_block_size": 4},
     "line 1: hash_ids needs a prompt_tokens count (the prompt's ids are synthesised from the hashes)"),
    ({"prompt_tokens": 8, "hash_ids": [1], "hash_block_size": 4, "prefix_group": "g", "prefix_tokens": 4},
     "line 1: give prefix_group or hash_ids, not both"),
])
def test_bad_hash_ids_are_one_line_errors(tmp_path, row, message):
    path = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "max_tokens": 2, **row}])
    assert one_line_error(["workload", "check", str(path)]) == f"kvtrace: error: {path}: {message}"
    assert one_line_error(["record", "--model", "tiny", "--engine", "sim", "-w", str(path),
                           "-o", str(tmp_path / "run"), "-q"]) == f"kvtrace: error: {path}: {message}"


@pytest.mark.parametrize("engine", ["real", "sim"])
def test_equal_hashes_hit_the_prefix_cache_in_both_engines(make_engine, engine):
    requests = [WorkloadRequest(id=name, arrival_s=float(i), prompt_tokens=11, hash_ids=hashes, hash_block_size=4,
                                max_tokens=2)
                for i, (name, hashes) in enumerate([("a", [1, 2]), ("b", [1, 2]), ("c", [1, 3]), ("d", [5, 2])])]
    tracer = ListTracer()
    eng = make_engine(num_gpu_blocks=32, tracer=tracer, **({"engine": "sim"} if engine == "sim" else {}))
    replay(eng, prepare(requests, eng, tokenizer=None, seed=0, time_scale=None, backlog=False, workload_name="w"))
    hits = {e.req_id: e.num_tokens for e in tracer.events if e.kind == "prefix_hit"}
    # b repeats a's two blocks, c its first; d's first block differs, so its second cannot hit (a chain)
    assert hits == {"b": 8, "c": 4}


def test_check_counts_the_blocks_hashes_share(tmp_path):
    rows = [{"arrival_s": 0, "prompt_tokens": 9, "hash_ids": [0, 1], "hash_block_size": 4, "max_tokens": 2},
            {"arrival_s": 1, "prompt_tokens": 8, "hash_ids": [0, 2], "hash_block_size": 4, "max_tokens": 2}]
    from typer.testing import CliRunner

    from kvtrace.cli.app import app
    result = CliRunner().invoke(app, ["workload", "check", str(write_workload(tmp_path / "w.jsonl", rows))])
    assert result.exit_code == 0, result.output
    assert "block hashes: 2 requests, 3 distinct blocks of 4 tokens, 1 repeat an earlier request's" in result.stdout
