"""The workload format (kvtrace/workload/format.py) at its edges: the valid ranges' ends, errors that
name a request or a line, cut long values and list at most ten problems, a save and load of every
field, and synthetic prompts that stay the same from version to version."""
from __future__ import annotations

import json

import pytest

from kvtrace.errors import KvtraceError
from kvtrace.workload import (
    WorkloadRequest,
    load_workload,
    resolve_prompt_ids,
    save_workload,
    synthetic_ids,
    validate_lengths,
)


def error_of(call) -> str:
    with pytest.raises(KvtraceError) as info:
        call()
    return str(info.value)


def test_a_request_made_in_code_is_named_by_its_id_not_a_line():
    # requests from a generator or a program have no file line: errors name them by id
    req = WorkloadRequest(id="gen-3", arrival_s=0, prompt_token_ids=[1, 700, 800], max_tokens=1)
    assert req.line == 0
    assert error_of(lambda: resolve_prompt_ids(req, vocab_size=512)) == (
        "request 'gen-3': prompt_token_ids holds 700, outside the model's vocabulary [0, 512)")
    assert error_of(lambda: validate_lengths([req], [11], max_model_len=11)) == (
        "1 prompt leaves no room for an output token within max_model_len 11: request 'gen-3': 11 tokens")


class _WideTokenizer:
    """A tokenizer of a bigger vocabulary than the model's (the wrong one for it)."""

    def encode(self, text: str) -> list[int]:
        return [5, 600 + len(text), 7]


def test_a_prompt_the_tokenizer_encodes_outside_the_vocabulary_is_refused_before_the_run():
    # the replay hands prepared ids to the engine unchecked (add_request(prepared=True)): prepare refuses them
    req = WorkloadRequest(id="t", arrival_s=0, prompt="hi", max_tokens=1)
    assert error_of(lambda: resolve_prompt_ids(req, vocab_size=512, tokenizer=_WideTokenizer())) == (
        "request 't': the tokenizer encodes the prompt to id 602, outside the model's vocabulary [0, 512)")
    assert resolve_prompt_ids(req, vocab_size=603, tokenizer=_WideTokenizer()) == [5, 602, 7]
    synthesised = WorkloadRequest(id="s", arrival_s=0, prompt_tokens=2000, max_tokens=1)
    assert max(resolve_prompt_ids(synthesised, vocab_size=64)) < 64


def test_a_long_bad_value_is_cut_to_40_characters_in_the_error(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": "' + "x" * 100 + '"}\n')
    shown = '"' + "x" * 39
    assert error_of(lambda: load_workload(path)) == f"{path}: line 1: arrival_s must be a number, got {shown}"


def test_every_seed_gives_its_own_prompts():
    # seeds are taken modulo 2**64: -1 is 2**64 - 1, and differs from 2**63 - 1
    ids = {seed: synthetic_ids("request:a", 8, vocab_size=49152, seed=seed) for seed in (-1, 2**64 - 1, 2**63 - 1, 0)}
    assert ids[-1] == ids[2**64 - 1]
    assert len({tuple(ids[s]) for s in (-1, 2**63 - 1, 0)}) == 3


def write(tmp_path, *lines: str):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_edges_of_the_valid_ranges_load(tmp_path):
    # token id 0 is a token; a prefix may be the whole prompt; a request may stop at its cap
    path = write(tmp_path,
                 '{"id": "at-cap", "prompt_tokens": 2, "max_tokens": 5, "output_tokens": 5, "arrival_s": 1}',
                 '{"id": "zero", "prompt_token_ids": [0, 5], "max_tokens": 1, "arrival_s": 0}',
                 '{"id": "all-prefix", "prompt_tokens": 8, "prefix_group": "g", "prefix_tokens": 8, "max_tokens": 1, '
                 '"arrival_s": 0}')
    zero, all_prefix, at_cap = load_workload(path)
    assert (at_cap.max_tokens, at_cap.output_tokens) == (5, 5)
    assert resolve_prompt_ids(zero, vocab_size=512) == [0, 5]
    ids = resolve_prompt_ids(all_prefix, vocab_size=512)
    assert ids == synthetic_ids("prefix:g", 8, vocab_size=512) and len(ids) == 8


def test_an_undecodable_line_does_not_hide_the_lines_after_it(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"prompt": "\xff", "max_tokens": 1, "arrival_s": 0}\n'
                     b'{"prompt_tokens": 2, "max_tokens": 0, "arrival_s": 0}\n')
    assert error_of(lambda: load_workload(path)) == (
        f"{path}: 2 bad lines: line 1: not UTF-8 text; line 2: max_tokens must be >= 1, got 0")


def test_exactly_ten_problems_are_all_listed_with_no_and_more(tmp_path):
    path = write(tmp_path, *['{"prompt_tokens": 2, "max_tokens": 0, "arrival_s": 0}'] * 10)
    message = error_of(lambda: load_workload(path))
    assert message.startswith(f"{path}: 10 bad lines: line 1: max_tokens must be >= 1, got 0")
    assert message.endswith("line 10: max_tokens must be >= 1, got 0") and "more" not in message


def test_every_non_default_field_is_saved_and_read_back(tmp_path):
    req = WorkloadRequest(id="r", arrival_s=1.234567, prompt_tokens=8, max_tokens=4, n=2, priority=3, temperature=0.7,
                          top_p=0.9, seed=11, prefix_group="g", prefix_tokens=4)
    path = tmp_path / "w.jsonl"
    save_workload([req], path)
    saved = json.loads(path.read_text())
    assert {k: saved[k] for k in ("n", "priority", "temperature", "top_p", "seed", "prefix_group", "prefix_tokens")} == {
        "n": 2, "priority": 3, "temperature": 0.7, "top_p": 0.9, "seed": 11, "prefix_group": "g", "prefix_tokens": 4}
    (back,) = load_workload(path)
    assert back == WorkloadRequest(**{**req.__dict__, "line": 1})
    # arrival times are written to the microsecond
    save_workload([WorkloadRequest(id="t", arrival_s=0.12345678, prompt_tokens=1, max_tokens=1)], path)
    assert json.loads(path.read_text())["arrival_s"] == 0.123457


def test_more_than_ten_long_prompts_are_counted(tmp_path):
    reqs = [WorkloadRequest(id=str(i), arrival_s=0, prompt_tokens=9, max_tokens=1, line=i) for i in range(1, 13)]
    message = error_of(lambda: validate_lengths(reqs, [20] * 12, max_model_len=11))
    assert message.startswith("12 prompts leave no room") and message.endswith("line 10 (id 10): 20 tokens; and 2 more")


def test_exactly_ten_long_prompts_are_all_listed_with_no_and_more():
    reqs = [WorkloadRequest(id=str(i), arrival_s=0, prompt_tokens=9, max_tokens=1, line=i) for i in range(1, 11)]
    message = error_of(lambda: validate_lengths(reqs, [20] * 10, max_model_len=11))
    assert message.endswith("line 10 (id 10): 20 tokens") and "more" not in message


def test_synthetic_prompts_are_the_same_in_every_version():
    # a workload of counts replays the same prompts as the run recorded from it months ago: the ids
    # are pinned (a change to how they are drawn breaks every recorded workload's reproducibility)
    assert synthetic_ids("request:a", 6, vocab_size=49152, seed=0) == [41405, 38029, 40883, 30172, 23887, 12118]
    assert synthetic_ids("request:a", 6, vocab_size=49152, seed=-1) == [20733, 1857, 15685, 6867, 42733, 13717]


def test_a_tiny_vocabulary_keeps_three_quarters_of_its_ids():
    # ids below min(17, vocab // 4) are avoided (special tokens); a 40-token vocabulary draws from 10..39
    ids = synthetic_ids("request:k", 2000, vocab_size=40)
    assert (min(ids), max(ids)) == (10, 39)


def test_a_request_made_in_code_reports_its_first_problem():
    with pytest.raises(ValueError, match=r"request 'q': max_tokens must be >= 1, got 0$"):
        WorkloadRequest(id="q", arrival_s=0, prompt_tokens=3, max_tokens=0, n=0)


def test_numbers_read_as_integers_are_floats_where_the_format_says_so(tmp_path):
    (req,) = load_workload(write(tmp_path, '{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 2, "temperature": 1, '
                                           '"top_p": 1}'))
    assert [type(v) for v in (req.arrival_s, req.temperature, req.top_p)] == [float, float, float]
