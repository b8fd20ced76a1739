"""The engine on the real SmolLM2-135M-Instruct weights."""
from __future__ import annotations

import pytest
import torch

from engine.build import build_engine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_weights
from engine.model.tokenizer import load_tokenizer
from engine.sequence import SamplingParams
from tests.helpers.engine_runs import run_checked

pytestmark = pytest.mark.slow  # the real weights: `pytest -m "not slow"` leaves these out


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_weights("smollm2-135m", dtype=torch.float32), load_tokenizer("smollm2-135m")
    except (FileNotFoundError, ValueError) as exc:  # pragma: no cover - setup.sh installs it
        pytest.skip(f"SmolLM2 weights not installed: {exc}")


def engine_for(smollm2, **overrides) -> LLMEngine:
    settings = dict(model="smollm2-135m", block_size=16, num_gpu_blocks=256, watermark=0.0)
    settings.update(overrides)
    return build_engine(EngineConfig(**settings), loaded=smollm2[0])


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def test_greedy_chat_answer_is_sensible(smollm2):
    tokenizer = smollm2[1]
    engine = engine_for(smollm2)
    seq = engine.add_request("q", chat_ids(tokenizer, "What is the capital of France?"), SamplingParams(max_tokens=30))
    run_checked(engine)
    answer = tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:])
    assert "Paris" in answer, answer
    assert seq.finish_reason == "stop" and seq.token_ids[-1] == tokenizer.eos_token_id


def test_batched_equals_alone_and_survives_preemption(smollm2):
    tokenizer = smollm2[1]
    prompts = [chat_ids(tokenizer, q) for q in (
        "Name three colours.", "Write a haiku about the sea.", "What is 12 times 12?")]
    prompts.append(list(range(1000, 1100)))  # a long, meaningless prompt: several blocks
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = []
    for p in prompts:
        engine = engine_for(smollm2)
        alone.append(engine.generate([p], params)[0])
    batched = engine_for(smollm2, max_num_batched_tokens=48).generate(prompts, params)
    assert batched == alone
    # 16 blocks of 8 hold any one request, not the three short ones as they grow: preemption (without
    # the prefix cache, which would let the chat prompts share their template's blocks)
    for mode in ("recompute", "swap"):
        engine = engine_for(smollm2, block_size=8, num_gpu_blocks=16, preemption_mode=mode,
                            max_num_batched_tokens=256, enable_prefix_caching=False)
        seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        run_checked(engine)
        assert sum(s.num_preemptions for s in seqs) > 0, mode
        assert [s.token_ids[s.num_prompt_tokens:] for s in seqs] == alone, mode


def test_prompt_text_never_reaches_the_trace(smollm2, tmp_path):
    import json

    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    import kvtrace.cli.commands  # noqa: F401
    from kvtrace.cli.app import app

    secret = "Quartzwhistle the zebra keeps her diary under the violet staircase"
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "s", "arrival_s": 0, "prompt": secret, "max_tokens": 3}) + "\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["record", "--model", "smollm2-135m", "-w", str(workload), "-o", str(out), "-q",
                                      "--num-gpu-blocks", "16"])
    assert result.exit_code == 0, result.output
    files = list(out.rglob("*"))
    assert any(f.suffix == ".parquet" for f in files)
    for f in files:
        if f.suffix == ".parquet":
            for column in pq.read_table(f).to_pylist():
                assert not any(isinstance(v, str) and ("Quartz" in v or "zebra" in v) for v in column.values())
        elif f.is_file():
            text = f.read_text(errors="replace")
            assert "Quartz" not in text and "zebra" not in text


def test_drafting_by_ngram_keeps_the_greedy_answers(smollm2):
    """SmolLM2 drafting 4 tokens a step by n-gram (the real engine verifies them in the same forward):
    the greedy answers, stopped at EOS, equal those without drafting, in a pool tight enough to preempt;
    asked to repeat text, the model accepts many of its drafts."""
    tokenizer = smollm2[1]
    questions = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
                 "Count from one to twenty in words, separated by commas.",
                 "What is the capital of France?",
                 "Write the alphabet, each letter followed by a comma."]

    def answers(**drafting):
        engine = engine_for(smollm2, num_gpu_blocks=10, max_num_seqs=4, **drafting)
        for i, question in enumerate(questions):
            engine.add_request(f"q{i}", chat_ids(tokenizer, question), SamplingParams(max_tokens=80))
        run_checked(engine)
        return engine, {key: seq.token_ids for key, seq in engine.outputs.items()}

    _, expected = answers()
    engine, drafted = answers(speculative_method="ngram", num_speculative_tokens=4)
    assert drafted == expected
    accepted = sum(s.num_accepted_tokens for s in engine.outputs.values())
    assert accepted > sum(s.num_draft_tokens for s in engine.outputs.values()) / 4 and engine.num_preemptions > 0


def test_a_host_kv_tier_loads_instead_of_recomputing_and_keeps_the_greedy_answers(smollm2):
    """SmolLM2 with a host KV tier (--offload-size): in a pool tight enough to preempt, resumed requests
    load the prompt blocks the device lost from the tier's host buffer (real copies) instead of computing
    them again, and every greedy answer is the one without a tier."""
    tokenizer = smollm2[1]
    questions = ["Name three colours and say why you like each one.", "Write a haiku about the sea.",
                 "What is 12 times 12? Explain step by step.", "Describe a cat in two sentences."]

    def answers(**tier):
        engine = engine_for(smollm2, block_size=8, num_gpu_blocks=24, max_num_seqs=4, **tier)
        for i, question in enumerate(questions):
            engine.add_request(f"q{i}", chat_ids(tokenizer, question), SamplingParams(max_tokens=48, ignore_eos=True))
        run_checked(engine)
        return engine, {key: seq.token_ids for key, seq in engine.outputs.items()}

    plain, expected = answers()
    tiered, answered = answers(offload_size="64MiB")
    assert answered == expected
    assert plain.num_preemptions > 0
    seqs = tiered.outputs.values()
    loaded = sum(s.num_tier_hit_tokens for s in seqs)
    recomputed = {name: sum(s.num_recomputed_tokens for s in e.outputs.values())
                  for name, e in (("plain", plain), ("tier", tiered))}
    assert loaded > 0 and recomputed["tier"] < recomputed["plain"], (loaded, recomputed)
