"""The sim-speed suite's Vidur side (benchmarks/vidur.py): the workload in Vidur's trace format, the
profiles in the columns of Vidur's loaders, and (with Vidur's venv) one run on a tiny workload."""
from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from benchmarks.sim_speed import ONLY, SHAREGPT, wanted
from benchmarks.vidur import (
    CACHE_DIR,
    DRIVER,
    PROFILES,
    TRACE_COLUMNS,
    TRACE_DATE,
    VidurConfig,
    default_vidur_python,
    run_vidur,
    vidur_lengths,
    write_vidur_trace,
)
from kvtrace.workload.format import WorkloadRequest, load_workload


def read_trace(path) -> list[dict]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == TRACE_COLUMNS
        return list(reader)


def test_trace_keeps_arrivals_and_lengths_in_arrival_order(tmp_path):
    requests = [
        WorkloadRequest(id="a", arrival_s=0.25, prompt_tokens=100, max_tokens=7),            # ignores EOS: 7
        WorkloadRequest(id="b", arrival_s=0.0, prompt_token_ids=[20, 21, 22], max_tokens=50,
                        output_tokens=9, ignore_eos=False),                                   # stopped at 9
        WorkloadRequest(id="c", arrival_s=1.0 / 3.0, prompt_tokens=4096, max_tokens=2048, output_tokens=1),
        WorkloadRequest(id="d", arrival_s=0.25, prompt_tokens=1, max_tokens=3),              # ties keep order
    ]
    assert write_vidur_trace(requests, tmp_path / "t.csv") == 4
    rows = read_trace(tmp_path / "t.csv")
    assert [(r["Date"], float(r["Time"]), int(r["PromptTokenCount"]), int(r["CompletionTokenCount"])) for r in rows] == [
        (TRACE_DATE, 0.0, 3, 9), (TRACE_DATE, 0.25, 100, 7), (TRACE_DATE, 0.25, 1, 3), (TRACE_DATE, 1.0 / 3.0, 4096, 1)]


def test_trace_of_a_synthesised_workload(tmp_path):
    from typer.testing import CliRunner

    from kvtrace.cli import load
    workload = tmp_path / "w.jsonl"
    result = CliRunner().invoke(load("workload"), ["workload", "synth", "--num-requests", "40", "--rate", "2.5", "--seed", "7",
                                      "-o", str(workload)])
    assert result.exit_code == 0, result.output
    requests = load_workload(workload)
    write_vidur_trace(requests, tmp_path / "t.csv")
    rows = read_trace(tmp_path / "t.csv")
    assert [float(r["Time"]) for r in rows] == [round(req.arrival_s, 6) for req in requests]
    assert [int(r["PromptTokenCount"]) for r in rows] == [req.prompt_tokens for req in requests]
    assert [int(r["CompletionTokenCount"]) for r in rows] == [req.max_tokens for req in requests]


@pytest.mark.parametrize("request_, problem", [
    (WorkloadRequest(id="t", arrival_s=0, prompt="hello", max_tokens=4, ignore_eos=True), "text prompt"),
    (WorkloadRequest(id="n", arrival_s=0, prompt_tokens=8, max_tokens=4, n=2), "n = 2"),
    (WorkloadRequest(id="e", arrival_s=0, prompt_token_ids=[20, 21], max_tokens=4, ignore_eos=False), "EOS"),
])
def test_requests_vidur_cannot_take_are_refused(request_, problem):
    with pytest.raises(ValueError, match=problem):
        vidur_lengths(request_)


def test_profiles_in_the_columns_vidurs_loaders_filter_on(tmp_path):
    spec = importlib.util.spec_from_file_location("vidur_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)   # Vidur itself is imported only inside main()
    mlp_path, attention_path = driver.write_vidur_profiles({k: str(v) for k, v in PROFILES.items()}, str(tmp_path), 16)
    with open(mlp_path) as f:
        mlp = list(csv.DictReader(f))
    with open(PROFILES["mlp"]) as f:
        trimmed = list(csv.DictReader(f))
    assert len(mlp) == len(trimmed) == 456
    assert mlp[0]["num_tokens"] == "1" and mlp[0]["time_stats.mlp_up_proj.median"] == trimmed[0]["mlp_up_proj"]
    assert {(r["n_head"], r["n_kv_head"], r["n_embd"], r["n_expanded_embd"], r["use_gated_mlp"], r["vocab_size"],
             r["num_tensor_parallel_workers"]) for r in mlp} == {("32", "8", "4096", "14336", "True", "128256", "1")}
    with open(attention_path) as f:
        attention = list(csv.DictReader(f))
    assert len(attention) == 249
    prefill = [r for r in attention if r["is_prefill"] == "True"]
    decode = [r for r in attention if r["is_prefill"] == "False"]
    assert prefill and decode and len(prefill) + len(decode) == 249
    assert all(float(r["time_stats.attn_decode.median"]) == 0 < float(r["time_stats.attn_prefill.median"]) for r in prefill)
    assert all(float(r["time_stats.attn_prefill.median"]) == 0 < float(r["time_stats.attn_decode.median"]) for r in decode)
    assert {(r["block_size"], r["num_tensor_parallel_workers"], r["n_q_head"], r["n_kv_head"]) for r in attention} == {
        ("16", "1", "32", "8")}


def test_only_runs_one_scenario():
    class Args:
        only, skip_paged_kv, skip_hour, hour_sweep = "sharegpt", False, False, False
    names = (SHAREGPT, ONLY["paged-kv"], ONLY["hour"], "hour-sweep")
    assert [name for name in names if wanted(Args, name)] == [SHAREGPT]
    Args.only, Args.skip_hour = None, True
    assert [name for name in names if wanted(Args, name)] == [SHAREGPT, ONLY["paged-kv"]]
    Args.hour_sweep = True        # the sweep of the hour only when asked for (minutes)
    assert [name for name in names if wanted(Args, name)] == [SHAREGPT, ONLY["paged-kv"], "hour-sweep"]
    Args.only, Args.hour_sweep = "hour-sweep", False
    assert [name for name in names if wanted(Args, name)] == ["hour-sweep"]


@pytest.mark.external
def test_vidur_runs_a_tiny_workload(tmp_path):
    python = default_vidur_python()
    if python is None or not python.exists():
        pytest.skip("no Vidur 0.0.26 venv: `bash scripts/vidur_env.sh` builds it (1.3 GB from PyPI)")
    workload = tmp_path / "w.jsonl"
    lines = [{"id": "1", "arrival_s": 0.0, "prompt_tokens": 250, "max_tokens": 20},
             {"id": "2", "arrival_s": 0.05, "prompt_tokens": 1000, "max_tokens": 5},
             {"id": "3", "arrival_s": 0.5, "prompt_tokens": 30, "max_tokens": 12, "output_tokens": 8}]
    workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # the shared cache: a first run trains Vidur's forests (minutes), later ones load them
    run = run_vidur(python, workload, tmp_path / "work", VidurConfig(), cache_dir=CACHE_DIR)
    assert run.info["vidur_version"] == "0.0.26"
    assert run.info["requests"] == 3
    # each request is in one batch per output token (its prefill yields the first), none preempted
    assert run.info["sequence_steps"] == 20 + 5 + 8
    assert run.info["batches"] >= 20
    assert 0.5 < run.info["simulated_s"] < 5
    assert run.info["num_blocks"] > 0 and run.wall_s > 0
