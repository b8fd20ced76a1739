"""A run with a KV tier (schema 6) told: `kvtrace explain` of a preempted request (how much of its
history came back from the tier, in how long, and how much was recomputed: preemptions.sql,
request_verdict.sql), and the dashboard's tier figures, its comparison row and its thrash line's
reloads (tier_hits.sql, tier_transfers.sql, thrash.sql).

The run, written through the TraceWriter by hand (blocks of 4 positions, one step each 0.1 s):

    step 0  r7 and v admitted (prompts 12 and 8); v's blocks 3, 4 offloaded to cpu
    step 1  r7 grows into block 9: v is preempted for it (12 positions lost)
    step 2  v looked up at its resume: 8 positions in cpu; loaded in 3.1 ms
    step 3  v re-prefilled: the 8 loaded, 4 recomputed; v's last tokens; both finish
"""
from __future__ import annotations

import json

from engine import events as ev
from engine.events import KVEvent, RequestStats, StepRecord
from kvtrace.record.recorder import TraceWriter
from kvtrace.views import dashboard, explain
from tests.analysis.step_records import step_record


def _step(step: int, events: list[KVEvent], tokens: list[tuple[str, int]] = (), finished=(),
          preemptions: int = 0) -> StepRecord:
    return step_record(step, events, tokens=tokens, finished=finished, num_preemptions=preemptions)


def _finished(req_id: str, prompt: int, output: int, preemptions: int, recomputed: int, loaded: int) -> RequestStats:
    return RequestStats(req_id=req_id, sample=0, n=1, priority=0, arrival_s=0.0, prompt_tokens=prompt,
                        max_tokens=output, output_tokens=output, first_scheduled_s=0.0, first_token_s=0.05,
                        finish_s=0.35, finish_reason="length", preemptions=preemptions, swaps=0,
                        recomputed_tokens=recomputed, prefix_hit_tokens=0, tier_hit_tokens=loaded)


def tiered_preemption(root, name: str = "tiered-preemption"):
    run = root / name
    writer = TraceWriter(run, run.name)
    for record in (
        _step(0, [KVEvent(ev.ADMIT, "r7", num_tokens=12, reason="new"), KVEvent(ev.ADMIT, "v", num_tokens=8, reason="new"),
                  KVEvent(ev.ALLOC, "r7", blocks=[0, 1, 2], reason="prefill"),
                  KVEvent(ev.ALLOC, "v", blocks=[3, 4], reason="prefill"),
                  KVEvent(ev.OFFLOAD, "v", blocks=[3, 4], num_tokens=8, bytes=2000, duration_ms=0.5, tier="cpu")],
              tokens=[("r7", 0), ("v", 0)]),
        _step(1, [KVEvent(ev.PREEMPT, "v", blocks=[3, 4, 5], num_tokens=12, reason="recompute",
                          requester_req_id="r7", requester_sample=0, victim_reason="newest"),
                  KVEvent(ev.ALLOC, "r7", blocks=[9], reason="decode")], tokens=[("r7", 1)], preemptions=1),
        _step(2, [KVEvent(ev.LOOKUP, "v", num_tokens=12, num_cached_tokens=0, tier_tokens=8, tier="cpu",
                          reason="resume-recompute"),
                  KVEvent(ev.ADMIT, "v", num_tokens=12, reason="resume-recompute"),
                  KVEvent(ev.ALLOC, "v", blocks=[3, 4, 5], reason="prefill"),
                  KVEvent(ev.LOAD, "v", blocks=[3, 4], num_tokens=8, bytes=2000, duration_ms=3.1, tier="cpu")],
              tokens=[("r7", 2)]),
        _step(3, [KVEvent(ev.REPREFILL, "v", num_tokens=12, num_cached_tokens=0, num_recomputed_tokens=4, tier_tokens=8),
                  KVEvent(ev.FINISH, "r7", num_tokens=4, reason="length"), KVEvent(ev.FINISH, "v", num_tokens=4,
                                                                                reason="length")],
              tokens=[("r7", 3), ("v", 1), ("v", 2), ("v", 3)],
              finished=[_finished("r7", 12, 4, 0, 0, 0), _finished("v", 8, 4, 1, 4, 8)]),
    ):
        writer.on_step(record)
    writer.close()
    (run / "meta.json").write_text(json.dumps({"run_id": run.name, "schema_version": 6}))
    return run


def test_a_preempted_requests_history_back_from_the_tier_is_told_beside_what_was_recomputed(tmp_path):
    ex = explain.Explainer.open(str(tiered_preemption(tmp_path)))
    (p,) = ex.rows("preemptions", req_id="v", sample=0)
    assert (p["step"], p["requester_req_id"], p["positions_lost"]) == (1, "r7", 12)
    assert (p["tier_tokens"], p["tier_load_ms"], p["tier"], p["recomputed_tokens"]) == (8, 3.1, "cpu", 4)
    data = explain.story(ex, "v")
    assert (data["figures"]["tier_tokens"], data["figures"]["tier_load_ms"], data["figures"]["tier"]) == (8, 3.1, "cpu")
    assert "by r7" in data["verdict"], data["verdict"]
    assert "8 positions came back from host memory in 3.10 ms, 4 recomputed" in data["verdict"], data["verdict"]
    assert "tokens recomputed" not in data["verdict"]   # told once, as what the tier did not give back
    text = _render(explain.render_story(data))
    assert "from tier" in text and "8 (3.10 ms)" in text


def test_a_request_never_preempted_has_nothing_from_a_tier(tmp_path):
    ex = explain.Explainer.open(str(tiered_preemption(tmp_path)))
    assert ex.rows("preemptions", req_id="r7", sample=0) == []
    figures = explain.story(ex, "r7")["figures"]
    assert (figures["tier_tokens"], figures["tier_load_ms"], figures["tier"]) == (0, None, None)


def _render(renderable, width: int = 200) -> str:
    import io

    from rich.console import Console
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_dashboard_shows_the_tier_and_the_thrash_it_absorbed(tmp_path):
    run = str(tiered_preemption(tmp_path))
    data = dashboard.collect(dashboard.db.connect([run]))
    (fig,) = data["runs"]
    (tier,) = fig["tiers"]
    assert (tier["tier"], tier["tier_hit_tokens"], tier["stored_bytes"], tier["loaded_bytes"]) == ("cpu", 8, 2000, 2000)
    assert fig["thrash"]["reloaded_tokens"] == 8
    text = _render(dashboard.render(data, 120))
    assert "tier cpu    67% hit · 8 tok back · 2 kB stored, 2 kB loaded" in text, text
    assert dashboard.thrash_verdict(fig["thrash"]).plain.endswith("20% recomputed · 8 tok reloaded")
    again = str(tiered_preemption(tmp_path, "again"))
    compare = _render(dashboard.compare_table(dashboard.collect(dashboard.db.connect([run, again]))["runs"]), 300)
    assert "KV tier" in compare and "cpu 67% hit" in compare, compare
