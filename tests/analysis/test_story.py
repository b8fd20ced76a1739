"""The README's story, replayed: the example workload thrashes on the main command's pool, and the
documented fix (three times the pool) removes it, with every figure `kvtrace compare` leads with
moving the right way. docs/postmortem.md is written by the same code (scripts/postmortem.py).

The tiny model computes in well under a millisecond a step, smollm2-135m in tens: replayed on the
wall clock, the tiny model would never be loaded enough to thrash, and on a busy machine its
timings are noise. So the replays run under the script's modelled clock (smollm2-135m's steps on
2 CPU cores); everything else is real: the tiny model's forward, the scheduler, the block manager,
the trace, the analyses and compare.
"""
from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script

pytestmark = pytest.mark.long  # replays the README's story on the tiny model (minutes)


def load_postmortem():
    return load_script("postmortem")


def test_the_example_thrashes_and_the_fix_removes_it(tmp_path):
    postmortem = load_postmortem()
    # raises StoryBroken if a claim fails
    story = postmortem.tell("tiny", "dummy", tmp_path / "docs", tmp_path / "runs", modelled=True)

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
    assert "under a modelled clock" in doc
    assert "{" not in doc.replace("```sql", "").split("## The SQL")[0], "a placeholder left unfilled"
    for chart in postmortem.CHARTS:
        assert (tmp_path / "docs" / "postmortem" / f"{chart}.png").stat().st_size > 10_000
        assert f"postmortem/{chart}.png" in doc
