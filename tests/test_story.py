"""The README's story, replayed: the example workload thrashes on the main command's pool, and the
documented fix (three times the pool) removes it, with every figure `kvtrace compare` leads with
moving the right way. docs/postmortem.md is written by the same code (scripts/postmortem.py).

The tiny model computes in well under a millisecond a step, smollm2-135m in tens: replayed on the
wall clock, the tiny model would never be loaded enough to thrash, and on a busy machine its
timings are noise. So the engine's clock here is a model of smollm2-135m's steps on 2 CPU cores
(fitted to recorded runs: 18 ms a step, 1.6 ms per decoding sequence, 0.8 ms per prefill token);
everything else is real: the tiny model's forward, the scheduler, the block manager, the trace,
the analyses and compare.
"""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

import engine.llm_engine
import engine.model_runner
import kvtrace.replay

ROOT = Path(__file__).resolve().parent.parent
STEP_MS, DECODE_MS, PREFILL_MS = 18.0, 1.6, 0.8


def load_postmortem():
    spec = importlib.util.spec_from_file_location("postmortem", ROOT / "scripts" / "postmortem.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def modelled_clock(monkeypatch):
    """The engine's and the replay's clock advance by the modelled time of each step (and by the
    replay's idle sleeps), not by the host's."""
    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(engine.llm_engine, "time", clock)
    monkeypatch.setattr(kvtrace.replay, "time", clock)
    execute = engine.model_runner.ModelRunner.execute

    def timed_execute(self, out):
        result = execute(self, out)
        if out.seqs:
            ms = STEP_MS + DECODE_MS * result.num_decode_tokens + PREFILL_MS * result.num_prefill_tokens
            now[0] += ms / 1000
            result.timing.forward = ms
        return result

    monkeypatch.setattr(engine.model_runner.ModelRunner, "execute", timed_execute)
    return now


def test_the_example_thrashes_and_the_fix_removes_it(modelled_clock, tmp_path):
    postmortem = load_postmortem()
    story = postmortem.tell("tiny", "dummy", tmp_path / "docs", tmp_path / "runs")  # raises if a claim fails

    thrash, fix, change = story["thrash"], story["fix"], story["change"]
    assert thrash["thrash"]["verdict"] == "sustained"
    assert thrash["summary"]["preemptions"] >= 30 and thrash["summary"]["recompute_share"] >= 0.15
    top_cause = max(thrash["itl_tail"], key=lambda row: row["tail_ms"])["cause"]
    assert top_cause in ("preempted", "reprefill")
    assert thrash["most_preempted"][0]["preemptions"] >= 3, "a most-preempted table worth reading"
    assert fix["thrash"]["verdict"] in ("none", "occasional")

    # every figure compare leads with, in the direction the README says
    f = change["figures"]
    assert change["settings"] == {"num_gpu_blocks": [80, 240]}
    assert f["preemptions"]["value"] < f["preemptions"]["base"]
    assert f["recompute_share"]["value"] < f["recompute_share"]["base"]
    assert f["goodput_req_s"]["value"] > 1.5 * f["goodput_req_s"]["base"]
    assert f["good_share"]["value"] > f["good_share"]["base"]
    assert f["itl_p99_ms"]["value"] < f["itl_p99_ms"]["base"]
    assert all(figure["better"] for figure in f.values()), f

    doc = (tmp_path / "docs" / "postmortem.md").read_text()
    assert "thrash SUSTAINED" in doc and "what changed: more-kv against thrash" in doc
    assert "{" not in doc.replace("```sql", "").split("## The SQL")[0], "a placeholder left unfilled"
    for chart in postmortem.CHARTS:
        assert (tmp_path / "docs" / "postmortem" / f"{chart}.png").stat().st_size > 10_000
        assert f"postmortem/{chart}.png" in doc
