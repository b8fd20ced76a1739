"""Speculative decoding in kvtrace's simulator: drafts scheduled with each decode, lookahead slots
reserved past them, rejected drafts rolled back, accepted ones emitted (engine/scheduler.py,
engine/llm_engine.py, engine/spec_decode.py). The decisions are compared with vLLM's scheduler in
tests/vllm_sched/test_sched_differential.py; here: the books after every step, what a request gets,
the trace's drafts, the acceptance model, and the refusals."""
from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from engine.build import build_engine
from engine.config import SPEC_METHODS, EngineConfig
from engine.sequence import SamplingParams
from engine.spec_decode import GeometricAcceptance, mean_accepted
from kvtrace.cli.app import app
from tests.helpers.cli import record, sql, write_workload


def engine(method: str | None, k: int = 3, num_blocks: int = 40, **kwargs):
    cfg = EngineConfig(model="tiny", engine="sim", block_size=4, num_gpu_blocks=num_blocks, max_num_seqs=6,
                       max_num_batched_tokens=64, speculative_method=method,
                       num_speculative_tokens=k if method else 0, **kwargs)
    return build_engine(cfg)


def add_requests(e, num: int = 10, seed: int = 1) -> dict[str, int]:
    rng = random.Random(seed)
    lengths = {}
    for i in range(num):
        max_tokens = rng.randrange(1, 40)
        e.add_request(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))],
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        lengths[f"r{i}"] = max_tokens
    return lengths


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", sorted(SPEC_METHODS))
def test_drafting_keeps_the_books_and_every_requests_length(method, asynchronous):
    """After every step: the pool's books balance (check_integrity); a decoding sequence's computed
    positions never pass its tokens (rejected drafts rolled back); a sequence whose step verified drafts
    holds the blocks of its lookahead slots (none for n-gram). Every request gets its max_tokens, with
    preemptions, as it does without drafting."""
    e = engine(method, num_blocks=30, async_scheduling=asynchronous)
    lengths = add_requests(e)
    k, lookahead = 3, SPEC_METHODS[method][0]
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
        e.check_integrity()
        for seq in e.scheduler.running:
            # (async: its step in flight counted as computed, drafts too, until its output is processed)
            in_flight = seq.num_undelivered + seq.num_draft_placeholders
            assert seq.num_computed_tokens <= seq.num_tokens - 1 + in_flight or seq.is_prefill_chunk, seq
            if seq.num_drafts and lookahead and seq.num_computed_tokens == seq.num_tokens - 1 and not in_flight:
                # blocks for its next token, its k drafts and k lookahead slots were reserved last step
                # (or the max model length stopped them); at least its token and the lookahead stand
                assert len(seq.block_table) * 4 >= min(seq.num_computed_tokens + k, e.max_model_len), seq
        assert steps < 5000
    assert {req: seq.num_output_tokens for (req, _), seq in e.outputs.items()} == lengths
    assert e.num_preemptions > 0, "the pool is meant to be tight enough to preempt"
    drafts = sum(s.num_draft_tokens for s in e.outputs.values())
    accepted = sum(s.num_accepted_tokens for s in e.outputs.values())
    assert 0 < accepted < drafts
    e.flush()
    without = engine(None, num_blocks=30, async_scheduling=asynchronous)
    add_requests(without)
    while without.has_unfinished():
        without.step()
    assert steps < without.step_counter   # accepted drafts are tokens: fewer steps


def test_no_lookahead_slot_for_ngram_and_k_for_eagle():
    """A lone decoding request's blocks after a step: n-gram reserves nothing past its drafts, EAGLE k
    slots (vLLM's num_lookahead_tokens), a draft model k and one input slot of the budget a step."""
    held = {}
    for method in ("ngram", "eagle"):
        e = engine(method, k=3, num_blocks=100)
        e.acceptance = lambda seq, step, n: 0   # every draft rejected: one token a step
        e.add_request("r", list(range(1, 9)), SamplingParams(max_tokens=20, ignore_eos=True))   # 2 blocks
        e.step()   # the prompt; then each step verifies 3 drafts
        e.step()
        seq = e.outputs[("r", 0)]
        # 9 tokens, 8 computed + 1 + 3 drafts = 12 positions scheduled; eagle + 3 lookahead = 15
        held[method] = len(seq.block_table)
    assert held == {"ngram": 3, "eagle": 4}


@pytest.mark.parametrize("follow", ["0.32.0", "0.33.0", "0.34.0"])
@pytest.mark.parametrize("method", [None, *sorted(SPEC_METHODS)])
def test_an_eagle_style_drafter_gives_back_a_prefix_hits_last_block(method, follow):
    """An EAGLE-style drafter (EAGLE, EAGLE-3, MTP: vLLM's use_eagle) needs the KV of a hit's last position
    computed with the token after it. vLLM 0.31 and 0.32 recompute a hit's last block (the coordinator's
    drop_eagle_block): a second request on the first's 5 full blocks hits 4 of them. 0.33 on hash each
    block with the token after it (lookahead block hashes): the same request hits all 5, one whose token
    after them differs hits 4. N-gram, suffix and draft-model drafters, and no drafter, hit all 5 both
    times."""
    e = engine(method, num_blocks=100, follow_vllm=follow)
    prompt = list(range(1, 22))   # 21 tokens: 5 full blocks of 4 and one more token
    hits = []
    for rid, tokens in [("a", prompt), ("b", prompt), ("c", prompt[:20] + [99, 100])]:
        e.add_request(rid, tokens, SamplingParams(max_tokens=2, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        hits.append(e.outputs[(rid, 0)].num_prefix_hit_tokens)
    eagle = method in ("eagle", "eagle3", "mtp")
    lookahead = eagle and follow != "0.32.0"
    assert hits[1:] == ([20, 16] if lookahead else [16, 16] if eagle else [20, 20]), (method, hits)


def test_the_drafting_slot_counts_against_the_budget():
    """A draft model costs each scheduled request one input slot more (vLLM's max_num_new_slots_for_drafting):
    a step's budget of 8 holds two decodes of 1 + 2 drafts with it, and a third without."""
    scheduled = {}
    for method in ("eagle", "draft_model"):
        cfg = EngineConfig(model="tiny", engine="sim", block_size=4, num_gpu_blocks=100, max_num_seqs=6,
                           max_num_batched_tokens=9, speculative_method=method, num_speculative_tokens=2)
        e = build_engine(cfg)
        for i in range(3):
            e.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=10, ignore_eos=True))
        e.step()   # prompts (3 x 2 tokens), then every request decodes with 2 drafts
        out = e.scheduler.schedule()
        scheduled[method] = list(out.num_new_tokens)
    assert scheduled["eagle"] == [3, 3, 3] and scheduled["draft_model"] == [3, 3], scheduled


def test_the_acceptance_model_accepts_rate_to_the_power_of_j():
    model = GeometricAcceptance(0.6, seed=7)
    counts = [model(None, step, 4) for step in range(40_000)]
    for j in range(5):
        expected = 0.6 ** j * (0.4 if j < 4 else 1)
        assert abs(counts.count(j) / len(counts) - expected) < 0.01, (j, counts.count(j) / len(counts), expected)
    assert abs(sum(counts) / len(counts) - mean_accepted(0.6, 4)) < 0.02
    assert GeometricAcceptance(0.0)(None, 0, 4) == 0 and GeometricAcceptance(1.0)(None, 0, 4) == 4


def test_a_drafting_run_writes_its_drafts_in_the_trace(tmp_path):
    """The trace of a run that drafts: spec_decode's rows add up to the steps' and the requests' draft
    columns; every request's tokens are numbered 0..n-1 (a step emits several of one request); the
    accepted drafts are the tokens beyond one a step. A run that does not draft leaves them null."""
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": i * 0.01, "prompt_tokens": 20 + i, "max_tokens": 30}
                                                    for i in range(8)])
    result, out = record(tmp_path, workload, "drafting", "--engine", "sim", "--num-gpu-blocks", "40", "--block-size", "4",
                         "--speculative-method", "eagle", "--num-speculative-tokens", "3", "--spec-acceptance-rate", "0.5")
    assert result.exit_code == 0, result.output
    drafts, accepted, rows = sql(out, "SELECT sum(draft_tokens), sum(accepted_tokens), count(*) FROM spec_decode")[0]
    assert rows > 0 and 0 < accepted < drafts
    assert sql(out, "SELECT sum(draft_tokens), sum(accepted_tokens) FROM steps")[0] == (drafts, accepted)
    assert sql(out, "SELECT sum(draft_tokens), sum(accepted_tokens) FROM requests")[0] == (drafts, accepted)
    assert sql(out, "SELECT count(*) FROM spec_decode WHERE lookahead_slots != 3")[0][0] == 0
    gaps = sql(out, """SELECT count(*) FROM (SELECT req_id, sample, count(*) AS n, min(idx) AS lo, max(idx) AS hi,
                                                   count(DISTINCT idx) AS d FROM tokens GROUP BY ALL)
                       WHERE lo != 0 OR hi != n - 1 OR d != n""")[0][0]
    assert gaps == 0
    # each step's tokens of a request: 1 + its accepted drafts (every request runs its course: no stop cuts)
    extra = sql(out, """SELECT sum(n - 1) FROM (SELECT step, req_id, count(*) AS n FROM tokens GROUP BY ALL)""")[0][0]
    cut = sql(out, "SELECT count(*) FROM requests")[0][0]   # a request's last step may cut its accepted drafts
    assert accepted - 3 * cut <= extra <= accepted
    result, plain = record(tmp_path, workload, "plain", "--engine", "sim", "--num-gpu-blocks", "40", "--block-size", "4")
    assert result.exit_code == 0, result.output
    assert sql(plain, "SELECT count(draft_tokens) FROM steps")[0][0] == 0
    assert not (plain / "spec_decode").exists()


@pytest.mark.parametrize("args, message", [
    (["--speculative-method", "medusa", "--num-speculative-tokens", "2"], "--speculative-method must be one of"),
    (["--speculative-method", "eagle"], "--num-speculative-tokens must be at least 1"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative-method"),
    (["--speculative-method", "eagle", "--num-speculative-tokens", "2", "--spec-acceptance-rate", "1.5"],
     "--spec-acceptance-rate must be in [0, 1]"),
    (["--speculative-method", "eagle", "--num-speculative-tokens", "2", "--engine", "real"], "needs a drafter the real engine"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "2", "--engine", "real", "--async-scheduling"],
     "is for --engine sim"),
])
def test_bad_drafting_options_are_one_line_exit_2(tmp_path, args, message):
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 12, "max_tokens": 4}])
    out = tmp_path / "run"
    engine_args = [] if "--engine" in args else ["--engine", "sim"]
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "-w", str(workload), "-o", str(out), "-q",
                                      *engine_args, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_drafting_beside_sliding_windows_is_refused():
    from dataclasses import replace

    from engine.config import FULL_ATTENTION, PRESETS, SLIDING_ATTENTION
    from engine.model.loader import LoadedModel

    config = replace(PRESETS["tiny"], num_layers=2, layer_types=(FULL_ATTENTION, SLIDING_ATTENTION), sliding_window=32)
    cfg = EngineConfig(model="tiny", engine="sim", block_size=4, num_gpu_blocks=50, enable_prefix_caching=False,
                       speculative_method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative decoding beside them"):
        build_engine(cfg, loaded=LoadedModel(config, {}, "a tiny hybrid model"))


def test_the_fast_path_steps_aside_when_drafting():
    assert engine("eagle").fast_path is None and engine(None).fast_path is not None
    assert json.dumps(EngineConfig(engine="sim", speculative_method="mtp", num_speculative_tokens=1).to_dict())


@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_the_preemptions_lookahead_caused_are_named_from_the_trace(tmp_path, monkeypatch, method):
    """lookahead_preemptions.sql on a drafting run of the simulator (a tight pool, 4 drafts a step) against
    the engine's own state at each preemption: the requester's verified token fitted the blocks it held
    (caused by lookahead) or did not. Every preemption whose requester was decoding is named, and named
    right. With EAGLE's lookahead slots the verified token always fits (the last step reserved past it);
    with n-gram's none, a step that accepted every draft leaves its next token a block to find."""
    from engine.scheduler import Scheduler
    from kvtrace.trace import db

    truth: dict[tuple[str, int, int], bool] = {}   # (victim, sample, its k-th preemption) -> verified token fitted
    preempt = Scheduler._preempt

    def noted(self, seqs, out, requester=None, reasons=None):
        for seq in seqs:
            if requester is not None and requester.num_output_tokens and not requester.reprefill_target:
                free = len(requester.block_table) * self.bm.block_size - requester.num_computed_tokens
                truth[(seq.req_id, seq.sample, seq.num_preemptions + 1)] = free >= 1
        return preempt(self, seqs, out, requester, reasons)
    monkeypatch.setattr(Scheduler, "_preempt", noted)
    workload = write_workload(tmp_path / "w.jsonl", [{"arrival_s": i * 0.002, "prompt_tokens": 20 + 7 * i,
                                                     "max_tokens": 60} for i in range(12)])
    result, out = record(tmp_path, workload, "tight", "--engine", "sim", "--num-gpu-blocks", "36", "--block-size", "4",
                         "--speculative-method", method, "--num-speculative-tokens", "4")
    assert result.exit_code == 0, result.output
    rows = db.records(db.run_analysis(db.connect([out]), "lookahead_preemptions"))
    named = {}
    for row in sorted(rows, key=lambda r: r["seq"]):
        k = sum(1 for key in named if key[:2] == (row["req_id"], row["sample"])) + 1
        named[(row["req_id"], row["sample"], k)] = row["caused_by_lookahead"]
    decoding = {key: fitted for key, fitted in truth.items() if key in named}
    assert decoding and all(named[key] is not None for key in decoding), (named, truth)
    assert {key: named[key] for key in decoding} == decoding
    assert any(decoding.values()) and (method == "eagle" or not all(decoding.values())), decoding


def test_propose_ngram_takes_what_followed_the_longest_recent_match():
    from engine.spec_decode import propose_ngram

    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]   # the latest "1 2 3" came before 7
    assert propose_ngram([4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert propose_ngram([1, 2, 3, 4], 3) == []   # no earlier occurrence of any suffix
    assert propose_ngram([8, 8], 4) == [8]        # the 1-gram "8": what followed it


@pytest.mark.parametrize("policy", ["newest", "priority"])
def test_the_real_engine_drafts_by_ngram_and_its_greedy_tokens_are_unchanged(make_engine, policy):
    """The real engine (the tiny model, dummy weights) drafting 3 tokens a step by n-gram, verified by the
    model in the same forward: every greedy request's tokens equal those of a run without drafting, in a
    pool tight enough to preempt; some drafts are accepted (a dummy model's greedy output repeats itself),
    some rejected; the books balance after every step."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randrange(3, 30))] * 2 for _ in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(**drafting):
        e = make_engine(num_gpu_blocks=40, max_num_seqs=6, preemption_policy=policy, **drafting)
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, params, priority=i % 3)
        while e.has_unfinished():
            e.step()
            e.check_integrity()
        return e, {key: seq.token_ids for key, seq in e.outputs.items()}

    plain, expected = run()
    drafting, tokens = run(speculative_method="ngram", num_speculative_tokens=3)
    assert tokens == expected
    drafts = sum(s.num_draft_tokens for s in drafting.outputs.values())
    accepted = sum(s.num_accepted_tokens for s in drafting.outputs.values())
    assert 0 < accepted < drafts, (accepted, drafts)
    assert drafting.num_preemptions > 0 and drafting.step_counter < plain.step_counter
