"""The workload format (load, save, prompt ids), the generator, and the `kvtrace workload` CLI."""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import kvtrace.cli.workload  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from kvtrace.errors import KvtraceError
from kvtrace.workload import (
    SynthConfig,
    WorkloadRequest,
    generate,
    load_workload,
    resolve_prompt_ids,
    save_workload,
    synthetic_ids,
    validate_lengths,
    workload_sha256,
)
from tests.helpers.properties import examples


def write(tmp_path, *lines: str, name: str = "w.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def error_of(path) -> str:
    with pytest.raises(KvtraceError) as info:
        load_workload(path)
    return str(info.value)


# ---- loading: defaults, order, comments ----

def test_defaults_and_resolution(tmp_path):
    path = write(tmp_path,
                 "# a comment",
                 '{"prompt_tokens": 10, "max_tokens": 5, "arrival_s": 0.5}',
                 "",
                 '{"id": 7, "prompt": "hello", "max_tokens": 3, "arrival_s": 0}',
                 '{"id": "x", "prompt_token_ids": [20, 21], "max_tokens": 1, "arrival_s": 2, "ignore_eos": true}')
    by_id = {r.id: r for r in load_workload(path)}
    assert by_id["2"] == WorkloadRequest(id="2", arrival_s=0.5, prompt_tokens=10, max_tokens=5,
                                         ignore_eos=True, line=2)
    assert by_id["7"].ignore_eos is False and by_id["7"].prompt == "hello" and by_id["7"].line == 4
    assert by_id["x"].ignore_eos is True and by_id["x"].prompt_token_ids == [20, 21]
    req = by_id["7"]
    assert (req.n, req.priority, req.temperature, req.top_p, req.seed, req.prefix_group) == (1, 0, 0.0, 1.0, None, None)


def test_sorted_by_arrival_stable(tmp_path):
    path = write(tmp_path, *(json.dumps({"id": i, "prompt_tokens": 1, "max_tokens": 1, "arrival_s": t})
                             for i, t in enumerate([3, 1, 2, 1, 0])))
    assert [r.id for r in load_workload(path)] == ["4", "1", "3", "2", "0"]


def test_every_field_round_trips(tmp_path):
    requests = [
        WorkloadRequest(id="a", arrival_s=0.25, prompt="Hi there", max_tokens=4, ignore_eos=True, n=2,
                        priority=-1, temperature=0.7, top_p=0.9, seed=42),
        WorkloadRequest(id="b", arrival_s=1.0, prompt_token_ids=[17, 18, 19], max_tokens=5, output_tokens=2),
        WorkloadRequest(id="c", arrival_s=1.5, prompt_tokens=30, max_tokens=8, ignore_eos=False,
                        prefix_group="sys", prefix_tokens=16),
    ]
    path = tmp_path / "out.jsonl"
    assert save_workload(requests, path, comments=["made by a test", "second line"]) == 3
    assert path.read_text().startswith("# made by a test\n# second line\n")
    loaded = load_workload(path)
    assert [r.to_json() for r in loaded] == [r.to_json() for r in requests]
    assert [r.line for r in loaded] == [3, 4, 5]


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.fixed_dictionaries({
    "arrival_s": st.floats(0, 1e4).map(lambda x: round(x, 6)),
    "prompt": st.one_of(st.none(), st.text(min_size=1, max_size=20)),
    "prompt_tokens": st.integers(1, 10_000),
    "max_tokens": st.integers(1, 4096),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 4),
    "priority": st.integers(-5, 5),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.one_of(st.none(), st.integers(0, 2**31)),
}), min_size=1, max_size=8))
def test_round_trip_property(tmp_path_factory, records):
    requests = []
    for i, record in enumerate(records):
        if record["prompt"] is not None:
            record = {**record, "prompt_tokens": None}
        requests.append(WorkloadRequest(id=f"r{i}", **record))
    buffer = io.StringIO()
    save_workload(requests, buffer)
    path = tmp_path_factory.mktemp("prop") / "w.jsonl"
    path.write_text(buffer.getvalue())
    loaded = load_workload(path)
    expected = sorted(requests, key=lambda r: r.arrival_s)
    assert [r.to_json() for r in loaded] == [r.to_json() for r in expected]


# ---- loading: every error, with its line ----

@pytest.mark.parametrize(("text", "message"), [
    ("not json", "not valid JSON (Expecting value at column 1)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"max_tokens": 1, "arrival_s": 0}', "needs a prompt: one of prompt, prompt_token_ids, prompt_tokens"),
    ('{"prompt": "a", "prompt_tokens": 3, "max_tokens": 1, "arrival_s": 0}',
     "give only one of prompt, prompt_token_ids, prompt_tokens (got prompt, prompt_tokens)"),
    ('{"prompt_tokens": 0, "max_tokens": 1, "arrival_s": 0}', "prompt_tokens must be >= 1, got 0"),
    ('{"prompt_tokens": 2, "max_tokens": 0, "arrival_s": 0}', "max_tokens must be >= 1, got 0"),
    ('{"prompt_tokens": 2, "arrival_s": 0}', "max_tokens is missing"),
    ('{"prompt_tokens": 2, "max_tokens": 1}', "arrival_s is missing"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": -0.5}', "arrival_s must be a finite number >= 0, got -0.5"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": "soon"}', 'arrival_s must be a number, got "soon"'),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": NaN}', "arrival_s must be a finite number >= 0, got nan"),
    ('{"prompt_tokens": 2.5, "max_tokens": 1, "arrival_s": 0}', "prompt_tokens must be an integer, got 2.5"),
    ('{"prompt_tokens": 2, "max_tokens": true, "arrival_s": 0}', "max_tokens must be an integer, got true"),
    ('{"prompt": "", "max_tokens": 1, "arrival_s": 0}', "prompt must not be empty"),
    ('{"prompt": 5, "max_tokens": 1, "arrival_s": 0}', "prompt must be a string, got 5"),
    ('{"prompt_token_ids": [], "max_tokens": 1, "arrival_s": 0}', "prompt_token_ids must not be empty"),
    ('{"prompt_token_ids": [3, -1], "max_tokens": 1, "arrival_s": 0}', "prompt_token_ids must be >= 0, got -1"),
    ('{"prompt_token_ids": [3, "a"], "max_tokens": 1, "arrival_s": 0}',
     'prompt_token_ids must be a list of integers, got [3, "a"]'),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "ignore_eos": 1}', "ignore_eos must be true or false, got 1"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "n": 0}', "n must be >= 1, got 0"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "priority": "high"}', 'priority must be an integer, got "high"'),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "temperature": -1}', "temperature must be >= 0, got -1"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "top_p": 0}', "top_p must be in (0, 1], got 0"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "top_p": 1.5}', "top_p must be in (0, 1], got 1.5"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "seed": "x"}', 'seed must be an integer, got "x"'),
    ('{"id": "", "prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0}', "id must not be empty"),
    ('{"id": [1], "prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0}', "id must be a string or an integer, got [1]"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "max_token": 3}',
     "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ('{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "colour": 3}', "unknown field 'colour'"),
    ('{"prompt_tokens": 8, "max_tokens": 1, "arrival_s": 0, "prefix_group": "s"}', "prefix_group and prefix_tokens go together"),
    ('{"prompt_tokens": 8, "max_tokens": 1, "arrival_s": 0, "prefix_group": "s", "prefix_tokens": 9}',
     "prefix_tokens 9 exceeds prompt_tokens 8 (prompt_tokens counts the whole prompt, prefix included)"),
    ('{"prompt_tokens": 8, "max_tokens": 1, "arrival_s": 0, "prefix_group": "s", "prefix_tokens": 0}',
     "prefix_tokens must be >= 1, got 0"),
    ('{"prompt": "x", "max_tokens": 1, "arrival_s": 0, "prefix_group": "s", "prefix_tokens": 1}',
     "prefix_group needs a prompt_tokens count (with prompt or prompt_token_ids, write the shared prefix into the prompt)"),
    ('{"prompt_tokens": 2, "max_tokens": 5, "arrival_s": 0, "output_tokens": 6}',
     "output_tokens 6 exceeds max_tokens 5 (max_tokens is the cap, output_tokens where the request stopped)"),
    ('{"prompt_tokens": 2, "max_tokens": 5, "arrival_s": 0, "output_tokens": 0}', "output_tokens must be >= 1, got 0"),
])
def test_each_error_names_line_and_field(tmp_path, text, message):
    path = write(tmp_path, "# header", text)
    assert error_of(path) == f"{path}: line 2: {message}"


def test_cross_line_errors(tmp_path):
    path = write(tmp_path,
                 '{"id": "a", "prompt_tokens": 8, "max_tokens": 1, "arrival_s": 0, "prefix_group": "s", "prefix_tokens": 4}',
                 '{"id": "a", "prompt_tokens": 8, "max_tokens": 1, "arrival_s": 0, "prefix_group": "s", "prefix_tokens": 5}')
    assert error_of(path) == (f"{path}: 1 bad line: line 2: id 'a' repeats line 1; "
                              "line 2: prefix_tokens 5 differs from 4 of group 's' (line 1)")


def test_many_errors_one_line_summary(tmp_path):
    good = '{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0}'
    bad = '{"prompt_tokens": 2, "max_tokens": 0, "arrival_s": 0}'
    path = write(tmp_path, good, bad, good, good, bad, "{")
    assert error_of(path) == (f"{path}: 3 bad lines: line 2: max_tokens must be >= 1, got 0; "
                              "line 5: max_tokens must be >= 1, got 0; "
                              "line 6: not valid JSON (Expecting property name enclosed in double quotes at column 2)")
    path = write(tmp_path, *[bad] * 13)
    message = error_of(path)
    assert message.startswith(f"{path}: 13 bad lines: line 1: max_tokens")
    assert message.endswith("line 10: max_tokens must be >= 1, got 0; and 3 more") and "\n" not in message


def test_every_problem_of_a_line_is_listed(tmp_path):
    # a line with several bad values, and one with an unknown field beside a bad value: each problem named
    path = write(tmp_path, '{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "temperature": -1, "top_p": 2}',
                 '{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0, "top_pp": 1, "n": 0}')
    assert error_of(path) == (f"{path}: 2 bad lines: line 1: temperature must be >= 0, got -1; "
                              "line 1: top_p must be in (0, 1], got 2; "
                              "line 2: unknown field 'top_pp' (did you mean 'top_p'?); line 2: n must be >= 1, got 0")


def test_missing_empty_and_undecodable_files(tmp_path):
    assert error_of(tmp_path / "nope.jsonl") == f"workload file not found: {tmp_path / 'nope.jsonl'}"
    path = write(tmp_path, "# only a comment", "")
    assert error_of(path) == f"{path}: no requests (the file is empty or holds only comments)"
    path.write_bytes(b'{"prompt": "\xff", "max_tokens": 1, "arrival_s": 0}\n')
    assert error_of(path) == f"{path}: line 1: not UTF-8 text"


def test_request_checks_itself():
    with pytest.raises(ValueError, match="request 'q': max_tokens must be >= 1, got 0"):
        WorkloadRequest(id="q", arrival_s=0, prompt_tokens=3, max_tokens=0)


# ---- prompt ids ----

class ListTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


class EncodingTokenizer:
    def encode(self, text):
        class Encoding:
            ids = [len(text)]
        return Encoding()


def test_resolve_text_ids_and_counts():
    text = WorkloadRequest(id="t", arrival_s=0, prompt="ab", max_tokens=1, line=3)
    assert resolve_prompt_ids(text, vocab_size=512, tokenizer=ListTokenizer()) == [97, 98]
    assert resolve_prompt_ids(text, vocab_size=512, tokenizer=EncodingTokenizer()) == [2]
    with pytest.raises(KvtraceError, match=r"^line 3 \(id t\): a text prompt needs the model's tokenizer"):
        resolve_prompt_ids(text, vocab_size=512)
    ids = WorkloadRequest(id="i", arrival_s=0, prompt_token_ids=[5, 511], max_tokens=1, line=4)
    assert resolve_prompt_ids(ids, vocab_size=512) == [5, 511]
    with pytest.raises(KvtraceError) as info:
        resolve_prompt_ids(ids, vocab_size=511)
    assert str(info.value) == "line 4 (id i): prompt_token_ids holds 511, outside the model's vocabulary [0, 511)"

    count = WorkloadRequest(id="c", arrival_s=0, prompt_tokens=200, max_tokens=1)
    first = resolve_prompt_ids(count, vocab_size=512, seed=1)
    assert first == resolve_prompt_ids(count, vocab_size=512, seed=1)
    assert len(first) == 200 and min(first) >= 17 and max(first) < 512
    assert first != resolve_prompt_ids(count, vocab_size=512, seed=2)
    other = WorkloadRequest(id="d", arrival_s=0, prompt_tokens=200, max_tokens=1)
    assert first != resolve_prompt_ids(other, vocab_size=512, seed=1)
    assert min(resolve_prompt_ids(count, vocab_size=40)) >= 10   # special range shrinks with tiny vocabularies


def test_prefix_group_shares_its_first_tokens():
    a = WorkloadRequest(id="a", arrival_s=0, prompt_tokens=40, max_tokens=1, prefix_group="g", prefix_tokens=32)
    b = WorkloadRequest(id="b", arrival_s=0, prompt_tokens=35, max_tokens=1, prefix_group="g", prefix_tokens=32)
    c = WorkloadRequest(id="c", arrival_s=0, prompt_tokens=40, max_tokens=1, prefix_group="h", prefix_tokens=32)
    ids = {r.id: resolve_prompt_ids(r, vocab_size=49152) for r in (a, b, c)}
    assert ids["a"][:32] == ids["b"][:32] == synthetic_ids("prefix:g", 32, vocab_size=49152)
    assert ids["a"][32:] != ids["b"][32:35] and ids["a"][:32] != ids["c"][:32]
    assert (len(ids["a"]), len(ids["b"])) == (40, 35)


def test_validate_lengths_lists_every_long_prompt():
    reqs = [WorkloadRequest(id=str(i), arrival_s=0, prompt_tokens=9, max_tokens=1, line=i) for i in (1, 2, 3)]
    validate_lengths(reqs, [9, 10, 10], max_model_len=11)
    with pytest.raises(KvtraceError) as info:
        validate_lengths(reqs, [9, 11, 12], max_model_len=11)
    assert str(info.value) == ("2 prompts leave no room for an output token within max_model_len 11: "
                               "line 2 (id 2): 11 tokens; line 3 (id 3): 12 tokens")


def test_sha256_and_atomic_save(tmp_path):
    path = write(tmp_path, '{"prompt_tokens": 2, "max_tokens": 1, "arrival_s": 0}')
    assert workload_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()

    def broken():
        yield WorkloadRequest(id="1", arrival_s=0, prompt_tokens=1, max_tokens=1)
        raise KvtraceError("source failed")

    with pytest.raises(KvtraceError):
        save_workload(broken(), path)
    assert [p.name for p in tmp_path.iterdir()] == ["w.jsonl"]   # old file intact, no temp left
    assert load_workload(path)[0].prompt_tokens == 2


# ---- generator ----

def gaps_cv(requests):
    gaps = np.diff([r.arrival_s for r in requests])
    return gaps.std() / gaps.mean()


def test_lognormal_lengths_and_poisson_arrivals():
    requests = generate(SynthConfig(num_requests=3000, rate=5.0, seed=7))
    prompts = [r.prompt_tokens for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert np.median(prompts) == pytest.approx(1000, rel=0.08)
    assert np.median(outputs) == pytest.approx(130, rel=0.08)
    assert max(outputs) <= 2048 and all(p + o <= 8192 for p, o in zip(prompts, outputs))
    assert np.std(np.log(outputs)) == pytest.approx(0.9, rel=0.1)
    assert gaps_cv(requests) == pytest.approx(1.0, rel=0.1)
    assert len(requests) / requests[-1].arrival_s == pytest.approx(5.0, rel=0.1)
    assert requests[0].arrival_s == 0.0 and all(r.ignore_eos for r in requests)


def test_bursty_arrivals_scale_and_determinism():
    cfg = SynthConfig(num_requests=4000, rate=2.0, cv=3.0, scale=0.1, seed=3)
    requests = generate(cfg)
    assert gaps_cv(requests) == pytest.approx(3.0, rel=0.2)
    assert np.median([r.prompt_tokens for r in requests]) == pytest.approx(100, rel=0.1)
    assert max(r.max_tokens for r in requests) <= 205
    assert [r.to_json() for r in generate(cfg)[:50]] == [r.to_json() for r in requests[:50]]


def test_fixed_lengths_backlog_duration_and_resampling():
    backlog = generate(SynthConfig(num_requests=5, backlog=True, prompt_len=64, output_len=8))
    assert [(r.arrival_s, r.prompt_tokens, r.max_tokens) for r in backlog] == [(0.0, 64, 8)] * 5
    timed = generate(SynthConfig(duration_s=20.0, rate=4.0, cv=0.0, prompt_len=10, output_len=2))
    assert len(timed) == 80 and timed[-1].arrival_s == pytest.approx(19.75)
    resampled = generate(SynthConfig(num_requests=200, lengths_from=[(100, 10), (300, 30)], scale=0.5))
    assert {(r.prompt_tokens, r.max_tokens) for r in resampled} == {(50, 5), (150, 15)}


def test_prefix_groups():
    requests = generate(SynthConfig(num_requests=100, prefix_groups=3, prefix_tokens=64, prompt_median=20, seed=1))
    assert {r.prefix_group for r in requests} == {"sys-0", "sys-1", "sys-2"}
    assert all(r.prefix_tokens == 64 and r.prompt_tokens > 64 for r in requests)


def test_multi_turn_prompts_extend_the_previous_turn():
    cfg = SynthConfig(num_requests=30, turns=3, prompt_median=40, output_median=10, think_time_s=5.0,
                      prefix_groups=2, prefix_tokens=16, vocab_size=512, seed=2)
    requests = generate(cfg)
    assert len(requests) == 30
    by_id = {r.id: r for r in requests}
    first, second = by_id["c1-t1"], by_id["c1-t2"]
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert len(second.prompt_token_ids) > len(first.prompt_token_ids) + first.max_tokens
    assert second.arrival_s > first.arrival_s and max(max(r.prompt_token_ids) for r in requests) < 512
    system_prompts = [synthetic_ids(f"prefix:sys-{g}", 16, vocab_size=512, seed=2) for g in (0, 1)]
    assert all(r.prompt_token_ids[:16] in system_prompts for r in requests)


def test_config_errors_name_the_option():
    with pytest.raises(ValueError, match="--cv must be >= 0"):
        SynthConfig(num_requests=1, cv=-1)
    with pytest.raises(ValueError, match="give --num-requests or --duration"):
        SynthConfig()
    with pytest.raises(ValueError, match="--prefix-groups and --prefix-tokens go together"):
        SynthConfig(num_requests=1, prefix_groups=2)


# ---- CLI ----

runner = CliRunner()


def test_cli_synth_then_check(tmp_path):
    out = tmp_path / "chat.jsonl"
    result = runner.invoke(app, ["workload", "synth", "--preset", "chat", "--scale", "0.2", "--seed", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().splitlines()[0] == f"# kvtrace workload synth --preset chat --scale 0.2 --seed 1 --out {out}"
    assert len(load_workload(out)) == 50
    result = runner.invoke(app, ["workload", "check", str(out)])
    assert result.exit_code == 0
    assert result.stdout.startswith(f"{out}: 50 requests, sha256 ")
    assert "inter-arrival CV" in result.stdout and "output tokens (max_tokens): median" in result.stdout


def test_cli_synth_to_stdout_and_bad_option():
    result = runner.invoke(app, ["workload", "synth", "--num-requests", "3", "--backlog", "--prompt-len", "5",
                                 "--output-len", "2"])
    assert result.exit_code == 0
    assert result.stdout.splitlines()[1] == '{"id": "1", "arrival_s": 0.0, "prompt_tokens": 5, "max_tokens": 2, "ignore_eos": true}'
    result = runner.invoke(app, ["workload", "synth", "--num-requests", "3", "--rate", "0"])
    assert result.exit_code == 2 and result.stderr == "kvtrace: error: --rate must be > 0, got 0.0\n"
    result = runner.invoke(app, ["workload", "synth", "--preset", "steady"])
    assert result.stderr.startswith("kvtrace: error: unknown preset 'steady'")


def test_cli_check_bad_file_is_one_line_and_exit_2(tmp_path):
    path = write(tmp_path, '{"prompt_tokens": 2, "max_tokens": 0, "arrival_s": 0}')
    result = runner.invoke(app, ["workload", "check", str(path)])
    assert result.exit_code == 2
    assert result.stderr == f"kvtrace: error: {path}: line 1: max_tokens must be >= 1, got 0\n"
    path = write(tmp_path, '{"prompt_tokens": 20, "max_tokens": 1, "arrival_s": 0}')
    result = runner.invoke(app, ["workload", "check", str(path), "--max-model-len", "16"])
    assert result.exit_code == 2
    assert result.stderr == ("kvtrace: error: 1 prompt leaves no room for an output token within max_model_len 16: "
                             "line 1 (id 1): 20 tokens\n")
