"""kvtrace's engine schedules as vLLM V1 does, proven event for event (docs/scheduling.md).

Each workload is replayed as a backlog (every request queued before the first step) through
kvtrace's engine and through an unmodified vLLM recorded from inside (its CPU build, in the venv
scripts/vllm_env.sh builds), on SmolLM2-135M with the same pool, block size and limits. The traces
must be identical: every kv_events row (step, kind, request, sample, block ids, tokens, reason),
every steps row, the step each token was emitted in, and the greedy token ids.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtrace.trace import db
from tests.helpers.vllm_runs import EAGER, VLLM_MARKS, VLLM_PYTHON, kvtrace

pytestmark = VLLM_MARKS

COMMON = ["--model", "smollm2-135m", "--dtype", "float32", "--block-size", "32", "--backlog", "-q"]

COMPARED = {
    "kv_events": "SELECT step, kind, req_id, sample, blocks, num_tokens, reason, num_cached_tokens, "
                 "num_recomputed_tokens FROM kv_events ORDER BY seq",
    "steps": "SELECT step, prefill_tokens, decode_tokens, recompute_tokens, running, waiting, preemptions, "
             "free_blocks, used_blocks, cached_blocks, total_blocks FROM steps ORDER BY step",
    "token steps": "SELECT req_id, sample, idx, step FROM tokens ORDER BY req_id, sample, idx",
    "requests": "SELECT req_id, sample, n, prompt_tokens, output_tokens, finish_reason, preemptions, "
                "recomputed_tokens, prefix_hit_tokens FROM requests ORDER BY req_id, sample",
}


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


def workload(name: str) -> list[dict]:
    rng = random.Random(name)
    if name == "tight":        # random prompts in a pool that holds a third of them: preemption, eviction
        return [{"id": f"r{i}", "prompt_token_ids": ids(rng, rng.randint(20, 120)),
                 "max_tokens": rng.randint(16, 48)} for i in range(12)]
    if name == "burst":        # one system prompt, six users at once: shared from the first step
        system = ids(rng, 48)
        return [{"id": f"u{i}", "prompt_token_ids": system + ids(rng, rng.randint(5, 30)), "max_tokens": 12}
                for i in range(6)]
    if name == "chunks":       # long prompts in 32-token chunks that run out of blocks mid-prefill
        return [{"id": f"r{i}", "prompt_token_ids": ids(rng, rng.randint(150, 300)),
                 "max_tokens": rng.randint(8, 24)} for i in range(6)]
    if name == "n4":           # four samples each (vLLM samples n > 1 only with a temperature)
        return [{"id": f"r{i}", "prompt_token_ids": ids(rng, rng.randint(30, 70)), "max_tokens": rng.randint(10, 30),
                 "n": 4, "temperature": 1.0, "seed": 7} for i in range(4)]
    if name == "priorities":   # the priority policy picks its victims by (priority, arrival)
        return [{"id": f"r{i}", "prompt_token_ids": ids(rng, rng.randint(20, 100)), "max_tokens": rng.randint(16, 40),
                 "priority": rng.randint(0, 3)} for i in range(10)]
    if name == "boundaries":   # each ends with a full last block: cached as its last token is delivered
        return [{"id": f"b{i}", "prompt_token_ids": ids(rng, 21 + 32 * (i % 2)), "max_tokens": 44 - 32 * (i % 2)}
                for i in range(4)]
    if name == "eos":          # chat turns the instruct model ends with EOS (<|im_end|>) at its own length
        from engine.model.tokenizer import load_tokenizer
        from kvtrace.vllm.record import model_folder

        tokenizer = load_tokenizer(str(model_folder("smollm2-135m")))
        return [{"id": f"q{i}", "ignore_eos": False, "max_tokens": 40, "prompt_token_ids": tokenizer.encode(
                    f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")} for i, q in enumerate(QUESTIONS)]
    raise KeyError(name)


QUESTIONS = ["What is 2+2?", "Say hi.", "Name a color.", "What is the capital of France?", "Is water wet?",
             "Count to three.", "Give me one word.", "What day comes after Monday?"]


SETTINGS = {
    "tight": ["--num-gpu-blocks", "12", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
              "--max-model-len", "256"],
    "burst": ["--num-gpu-blocks", "30", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
              "--max-model-len", "128"],
    "chunks": ["--num-gpu-blocks", "14", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
               "--long-prefill-token-threshold", "32", "--max-model-len", "336"],
    "n4": ["--num-gpu-blocks", "11", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
           "--max-model-len", "128"],
    "boundaries": ["--num-gpu-blocks", "30", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                   "--max-model-len", "128"],
    "eos": ["--num-gpu-blocks", "6", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
            "--max-model-len", "96"],
    "priorities": ["--num-gpu-blocks", "12", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                   "--max-model-len", "160", "--preemption-policy", "priority"],
}

# what each workload must exercise for its comparison to mean anything: kinds with at least one row
EXERCISED = {
    "tight": {"preempt", "evict", "reprefill"},
    "burst": {"prefix_hit"},
    "chunks": {"preempt", "evict", "prefix_hit"},
    "n4": {"preempt", "prefix_hit"},
    "priorities": {"preempt", "evict"},
    "eos": {"preempt"},
    "boundaries": set(),
}


def rows(run: Path, sql: str) -> list[tuple]:
    return db.connect([run]).execute(sql).fetchall()


@pytest.mark.parametrize("name", [name for name in SETTINGS if name != "boundaries"])
def test_the_engine_makes_vllms_decisions(name, tmp_path):
    compare(name, tmp_path, [])


# async "tight" and "priorities" are left to the scheduler-level differential (tests/vllm_sched/), which
# compares AsyncScheduler's decisions with preemption and the priority policy on thousands of workloads;
# what only a real engine shows under async scheduling stays here: token ids with preemption (eos),
# chunked prefill with prefix hits through the capture (chunks), cached blocks at finish (boundaries)
@pytest.mark.parametrize("name", ["chunks", "eos", "boundaries"])
def test_async_scheduling_makes_vllms_decisions(name, tmp_path):
    """--async-scheduling against vLLM's AsyncScheduler and two-batch queue (kept on on this CPU)."""
    compare(name, tmp_path, ["--async-scheduling"])
    assert json.loads((tmp_path / "vllm" / "meta.json").read_text())["vllm"]["async_scheduling"] is True
    # the driver names the one class; it followed vLLM's own choice
    assert json.loads((tmp_path / "vllm" / "meta.json").read_text())["vllm"]["scheduler"] == "KvtraceAsyncScheduler"


def compare(name: str, tmp_path: Path, extra: list[str]) -> None:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": 0, "ignore_eos": True, **r}) + "\n" for r in workload(name)))
    runs = {engine: tmp_path / engine for engine in ("kvtrace", "vllm")}
    kvtrace("record", "-w", path, "-o", runs["kvtrace"], *COMMON, *SETTINGS[name], *extra)
    kvtrace("record", "--engine", "vllm", "--vllm-python", VLLM_PYTHON, "-w", path, "-o", runs["vllm"],
            *COMMON, *SETTINGS[name], *EAGER, *extra)
    for what, sql in COMPARED.items():
        ours, theirs = rows(runs["kvtrace"], sql), rows(runs["vllm"], sql)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        assert ours == theirs, (f"{name}: {what} differ from row {first}: kvtrace "
                                f"{ours[first:first + 3]} vs vLLM {theirs[first:first + 3]}")
    kinds = {k for (k,) in rows(runs["kvtrace"], "SELECT DISTINCT kind FROM kv_events")}
    assert EXERCISED[name] <= kinds, f"{name}: the workload did not exercise {EXERCISED[name] - kinds}"
    if name == "boundaries":   # the two short requests' blocks (two full each) stay cached once they finish
        assert rows(runs["kvtrace"], "SELECT max(cached_blocks) FROM steps")[0][0] == 4
    if name == "eos":
        reasons = [r for (r,) in rows(runs["kvtrace"], "SELECT finish_reason FROM requests")]
        assert "stop" in reasons and "length" in reasons, reasons
    tokens = "SELECT req_id, sample, idx, token_id FROM tokens ORDER BY req_id, sample, idx"
    if name != "n4":   # greedy: the same token ids (n4 samples, and the two samplers draw differently)
        assert rows(runs["kvtrace"], tokens) == rows(runs["vllm"], tokens)
    meta = json.loads((runs["kvtrace"] / "meta.json").read_text())
    assert meta["scheduling"] == {"follows": "vLLM 0.32.0 V1 scheduler and block pool", "departures": [],
                                  "async_scheduling": bool(extra)}
