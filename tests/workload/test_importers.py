"""Importers on small fixture files in each source format, malformed rows included."""
from __future__ import annotations

import io
import json
import sys
import types

import pytest
from typer.testing import CliRunner

import kvtrace.cli.workload  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from kvtrace.errors import KvtraceError
from kvtrace.workload import ImportOptions, import_trace, load_workload
from kvtrace.workload.importers import _json_array_items, parse_datetime

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
yesterday,10,10
2023-11-16 18:15:51.0000000,ten,10
2023-11-16 18:15:52.5,20
2023-11-16 18:15:53.0000000,0,10
2023-11-16 18:15:54.0000000,10,0
2023-11-16 18:16:46.6805900,2000,500
"""

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
130,GPT-4,x,276,693,API log
"""


def run(fmt: str, path, **options):
    result = import_trace(fmt, path, ImportOptions(**options))
    return list(result.requests), result


def fixture(tmp_path, text: str, name: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_parse_datetime_fractions_and_zones():
    base = parse_datetime("2023-11-16 18:15:46")
    assert parse_datetime("2023-11-16 18:15:46.6805900") - base == pytest.approx(0.68059, abs=1e-6)
    assert parse_datetime("2024-05-10 00:00:00.009930+00:00") - parse_datetime("2024-05-10 00:00:00") == pytest.approx(0.00993, abs=1e-6)
    assert parse_datetime("2024-05-10T02:00:00+02:00") == parse_datetime("2024-05-10 00:00:00Z")
    with pytest.raises(ValueError):
        parse_datetime("2023-13-16 18:15:46")


def test_azure_rows_arrivals_and_skips(tmp_path):
    requests, result = run("azure", fixture(tmp_path, AZURE, "azure.csv"))
    assert [(r.id, round(r.arrival_s, 6), r.prompt_tokens, r.max_tokens) for r in requests] == [
        ("1", 0.0, 374, 44), ("2", 4.314579, 396, 109), ("8", 60.0, 2000, 500)]
    assert all(r.ignore_eos and r.output_tokens == r.max_tokens for r in requests)  # the generated count
    assert dict(result.skipped) == {"bad timestamp": 1, "token count not an integer": 1, "wrong number of columns": 1,
                                    "zero prompt tokens": 1, "zero output tokens": 1}
    assert result.summary("azure.csv") == (
        "imported 3 requests from azure.csv; skipped 5: 1 bad timestamp, 1 token count not an integer, "
        "1 wrong number of columns, 1 zero prompt tokens, 1 zero output tokens")


def test_window_time_scale_scale_and_caps(tmp_path):
    path = fixture(tmp_path, AZURE, "azure.csv")
    requests, _ = run("azure", path, start_s=1.0, duration_s=30.0)
    assert [r.id for r in requests] == ["2"] and requests[0].arrival_s == 0.0
    requests, result = run("azure", path, time_scale=2.0, scale=0.5, max_prompt_tokens=500, max_output_tokens=100)
    assert [(round(r.arrival_s, 6), r.prompt_tokens, r.max_tokens) for r in requests] == [
        (0.0, 187, 22), (2.15729, 198, 54), (30.0, 500, 100)]
    assert (result.num_clipped_prompts, result.num_clipped_outputs) == (1, 1)
    requests, _ = run("azure", path, max_requests=2, backlog=True)
    assert [(r.id, r.arrival_s) for r in requests] == [("1", 0.0), ("2", 0.0)]


def test_sample_is_seeded(tmp_path):
    rows = "".join(f"2023-11-16 18:00:{i:02d}.0,{10 + i},5\n" for i in range(60))
    path = fixture(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows, "azure.csv")
    first = [r.id for r in run("azure", path, sample=0.5, seed=4)[0]]
    assert first == [r.id for r in run("azure", path, sample=0.5, seed=4)[0]]
    assert first != [r.id for r in run("azure", path, sample=0.5, seed=5)[0]]
    assert 15 < len(first) < 45


def test_burstgpt_counts_failures(tmp_path):
    requests, result = run("burstgpt", fixture(tmp_path, BURSTGPT, "burst.csv"))
    assert [(r.id, r.arrival_s, r.prompt_tokens, r.max_tokens) for r in requests] == [
        ("1", 0.0, 472, 18), ("3", 113.0, 417, 276)]
    assert dict(result.skipped) == {"failed (0 response tokens)": 1, "token count not an integer": 1}


def test_unreadable_files_are_errors(tmp_path):
    with pytest.raises(KvtraceError, match=r"is not a BurstGPT trace: its header lacks Timestamp, Request tokens, "
                                           r"Response tokens \(expected Timestamp,Request tokens,Response tokens\)"):
        run("burstgpt", fixture(tmp_path, AZURE, "wrong.csv"))
    path = fixture(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\nx,1,1\n", "bad.csv")
    with pytest.raises(KvtraceError) as info:
        run("azure", path)
    assert str(info.value) == f"{path}: no request to import (skipped 1: 1 bad timestamp)"
    with pytest.raises(KvtraceError, match="is empty"):
        run("azure", fixture(tmp_path, "", "empty.csv"))
    with pytest.raises(KvtraceError, match="trace file not found"):
        run("azure", tmp_path / "missing.csv")
    with pytest.raises(KvtraceError, match="unknown trace format 'csv'"):
        run("csv", path)


def test_mooncake_equal_hash_ids_give_equal_blocks(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]},
        {"timestamp": 2000, "input_length": 30, "output_length": 5},
        {"timestamp": 2500, "input_length": "many", "output_length": 5},
        {"timestamp": 3000, "input_length": 30, "output_length": 5, "hash_ids": "abc"},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + "{broken\n[1]\n"
    path = fixture(tmp_path, text, "mooncake.jsonl")
    requests, result = run("mooncake", path, vocab_size=1000)
    a, b, c = requests
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.5, 1.0)
    assert (len(a.prompt_token_ids), len(b.prompt_token_ids), len(c.prompt_token_ids)) == (1100, 700, 30)
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512]          # hash id 1
    assert a.prompt_token_ids[512:700] != b.prompt_token_ids[512:700]   # 2 vs 4
    assert max(max(r.prompt_token_ids) for r in requests) < 1000 and a.ignore_eos
    assert dict(result.skipped) == {"missing or non-numeric timestamp, input_length or output_length": 1,
                                    "hash_ids not a list of integers": 1, "not valid JSON": 1, "not a JSON object": 1}
    scaled, _ = run("mooncake", path, vocab_size=1000, scale=0.1)
    assert len(scaled[0].prompt_token_ids) == 110
    assert scaled[0].prompt_token_ids[:51] == scaled[1].prompt_token_ids[:51] != scaled[0].prompt_token_ids[51:102]


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hello there, how are you?"},
                                  {"from": "gpt", "value": "I am fine, thank you very much."}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "Hi"},
                                  {"from": "human", "value": "again"}, {"from": "gpt", "value": "Hello!"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "unprompted"}]},
    {"id": "d", "conversations": []},
    {"id": "e", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},
    "not a conversation",
    {"id": "a", "conversations": [{"from": "human", "value": "Same id"}, {"from": "gpt", "value": "ok"}]},
    {"id": "f", "conversations": [{"from": "human", "value": "This one is cut"}, {"from": "gpt", "value": "off"}]},
]


def truncated_sharegpt(tmp_path):
    text = json.dumps(SHAREGPT, indent=2)
    return fixture(tmp_path, text[:text.rindex("off")], "sharegpt.json")


def test_json_items_survive_small_chunks_and_truncation(tmp_path):
    text = json.dumps(SHAREGPT, indent=2)
    for chunk in (7, 64, 1 << 20):
        items = list(_json_array_items(io.StringIO(text), tmp_path, chunk_chars=chunk))
        assert items == SHAREGPT
        items = list(_json_array_items(io.StringIO(text[:text.rindex("off")]), tmp_path, chunk_chars=chunk))
        assert items == SHAREGPT[:-1] + ["cut off at the end of the file"]
    broken = text.replace('"id": "d"', '"id": d', 1)
    assert list(_json_array_items(io.StringIO(broken), tmp_path, chunk_chars=64))[-1] == (
        "invalid JSON (the rest of the file was ignored)")
    with pytest.raises(KvtraceError, match="is not a JSON list of conversations"):
        list(_json_array_items(io.StringIO('{"id": 1}'), tmp_path))


def test_sharegpt_estimated_lengths(tmp_path):
    path = truncated_sharegpt(tmp_path)
    requests, result = run("sharegpt", path, rate=1.0, seed=0)
    assert [(r.id, r.prompt_tokens, r.max_tokens) for r in requests] == [("a", 7, 8), ("b", 1, 2), ("a#7", 2, 1)]
    assert requests[0].arrival_s == 0.0 and requests[1].arrival_s < requests[2].arrival_s
    assert result.comments == ["lengths are estimated as characters / 4: no --model given to tokenise with"]
    assert dict(result.skipped) == {"no human turn with an answer": 2, "empty or non-text turn": 1,
                                    "not a conversation": 1, "cut off at the end of the file": 1}
    with pytest.raises(KvtraceError, match="sharegpt has no timestamps: give --rate"):
        run("sharegpt", path)


def test_sharegpt_with_a_tokenizer(tmp_path, monkeypatch):
    class WordTokenizer:
        def encode(self, text):
            return [100 + len(word) for word in text.split()]

    module = types.ModuleType("engine.model.tokenizer")
    module.load_tokenizer = lambda model: WordTokenizer() if model == "words" else None
    monkeypatch.setitem(sys.modules, "engine.model.tokenizer", module)
    path = truncated_sharegpt(tmp_path)
    requests, result = run("sharegpt", path, backlog=True, model="words", max_prompt_tokens=4)
    assert requests[0].prompt_token_ids == [105, 106, 103, 103] and requests[0].max_tokens == 7
    assert result.comments == [] and result.num_clipped_prompts == 1
    _, result = run("sharegpt", path, backlog=True, model="tiny")
    assert result.comments == ["lengths are estimated as characters / 4: model 'tiny' has no tokenizer"]


def test_cli_import_writes_atomically_and_reports(tmp_path):
    runner = CliRunner()
    out = tmp_path / "out.jsonl"
    path = fixture(tmp_path, AZURE, "azure.csv")
    result = runner.invoke(app, ["workload", "import", "azure", str(path), "--time-scale", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("imported 3 requests from") and "skipped 5" in result.stderr
    assert out.read_text().splitlines()[0] == f"# kvtrace workload import azure {path} --time-scale 2.0 --out {out}"
    assert [r.arrival_s for r in load_workload(out)] == [0.0, 2.15729, 30.0]
    path = fixture(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\nx,1,1\n", "bad.csv")
    result = runner.invoke(app, ["workload", "import", "azure", str(path), "-o", str(tmp_path / "no.jsonl")])
    assert result.exit_code == 2
    assert result.stderr == f"kvtrace: error: {path}: no request to import (skipped 1: 1 bad timestamp)\n"
    assert not (tmp_path / "no.jsonl").exists() and not list(tmp_path.glob(".no.jsonl*"))
    path = truncated_sharegpt(tmp_path)
    result = runner.invoke(app, ["workload", "import", "sharegpt", str(path), "--rate", "2", "-o", str(out)])
    assert result.exit_code == 0 and out.read_text().splitlines()[1].startswith("# lengths are estimated")
