"""Replay the README's story and write docs/postmortem.md from what the runs actually show.

    python scripts/postmortem.py            # smollm2-135m, real weights, on the CPU: the published doc

Two replays of traces/examples/assistant.jsonl: the README's main command (a KV pool of 80 blocks,
which thrashes) and the fix (the same workload with three times the pool). Then the dashboard of
the first, `kvtrace compare` of the two, the SQL a user runs next, and the report's charts as PNG,
all written under --out (docs/postmortem.md and docs/postmortem/*.png by default).

The story is checked before anything is written, so that the document cannot go stale silently:
the first run must thrash (sustained verdict, its ITL tail led by preemption or re-prefill) and
the fix must remove it (no or occasional preemption, fewer preemptions, less recompute, more
goodput, a lower ITL p99). A failed check exits 1 and names the figure.

--modelled-clock replaces the host clock of the engine and the replay with a model of
smollm2-135m's steps on 2 CPU cores (fitted to recorded runs: 18 ms a step, 1.6 ms per decoding
sequence, 0.8 ms per prefill token), so that a faster model (the tiny one, in tests/analysis/test_story.py)
or a busy machine replays the same shape of load; the forward, scheduler, block manager, trace
and analyses stay real. The document says which clock it was written with.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

import kvtrace.cli.commands  # noqa: E402,F401  (registers every command)
from kvtrace.cli.app import app  # noqa: E402  (the story's recordings run in this process: --modelled-clock)
from kvtrace.trace import db  # noqa: E402
from kvtrace.views import dashboard, explain, headline  # noqa: E402
from kvtrace.views.table import rich_table  # noqa: E402

WORKLOAD = "traces/examples/assistant.jsonl"
THRASH_SETTINGS = ["--num-gpu-blocks", "80"]      # the README's main command
FIX_SETTINGS = ["--num-gpu-blocks", "240"]        # "Using it": give the cache more memory
WIDTH = 120                                       # the dashboard's two-column layout
CHARTS = ("pool_occupancy", "request_gantt", "itl_cdf")

# The SQL a user runs next: (question, query). Each runs on both runs; its output goes in the doc.
QUERIES = [
    ("Which requests were hurt, and how much?", """\
SELECT run_id, preemptions, count(*) AS requests,
       round(median(first_token_s - arrival_s), 2) AS ttft_p50_s,
       round(median((finish_s - first_token_s) / nullif(output_tokens - 1, 0)) * 1000) AS tpot_p50_ms,
       round(median(finish_s - arrival_s), 1) AS e2e_p50_s,
       sum(recomputed_tokens) AS recomputed_tokens
FROM requests
GROUP BY ALL ORDER BY run_id, preemptions"""),
    ("When did the pool fill, and when did the thrash start?", """\
SELECT run_id,
       round(min(end_s) FILTER (WHERE used_blocks >= 0.95 * total_blocks), 2) AS first_full_s,
       round(avg((used_blocks >= 0.95 * total_blocks)::INT), 2) AS full_step_share,
       round(min(end_s) FILTER (WHERE preemptions > 0), 2) AS first_preempt_s,
       max(waiting) AS max_waiting, max(running) AS max_running
FROM steps GROUP BY run_id ORDER BY run_id"""),
    ("What did the re-prefills cost?", """\
SELECT run_id, reprefills, recomputed_tokens, reprefill_cached_tokens,
       round(recompute_share_of_processed, 3) AS share_of_compute,
       round(recompute_device_ms / 1000, 2) AS recompute_s,
       round(recompute_device_share, 3) AS share_of_device_time
FROM _recompute ORDER BY run_id"""),
]


STEP_MS, DECODE_MS, PREFILL_MS = 18.0, 1.6, 0.8     # the modelled clock: smollm2-135m on 2 cores


@contextlib.contextmanager
def modelled_clock() -> Iterator[None]:
    """While inside: the engine's and the replay's clock advance by each step's modelled time (and
    by the replay's idle sleeps), not by the host's."""
    import engine.executor.model_runner
    import engine.llm_engine
    import kvtrace.record.replay

    now = [0.0]
    # the modelled clock stands in for perf_counter and sleep; the progress display keeps the host's monotonic
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
                                  monotonic=time.monotonic)
    runner = engine.executor.model_runner.ModelRunner
    saved = vars(runner)["clock"], vars(runner)["sleep"], kvtrace.record.replay.time, runner.execute
    execute = runner.execute

    def timed_execute(self, out):
        result = execute(self, out)
        if out.seqs:
            ms = STEP_MS + DECODE_MS * result.num_decode_tokens + PREFILL_MS * result.num_prefill_tokens
            now[0] += ms / 1000
            result.timing.forward = ms
        return result

    runner.clock, runner.sleep = staticmethod(clock.perf_counter), staticmethod(clock.sleep)
    kvtrace.record.replay.time = clock
    runner.execute = timed_execute
    try:
        yield
    finally:
        runner.clock, runner.sleep, kvtrace.record.replay.time, runner.execute = saved


class StoryBroken(Exception):
    """A figure of the story no longer holds."""


def kvtrace(args: list[str]) -> None:
    """Run a kvtrace command in this process (so that modelled_clock() reaches its replay)."""
    try:
        typer.main.get_command(app).main(args=args, prog_name="kvtrace", standalone_mode=False)
    except SystemExit as exc:  # a user error: the CLI printed its one line
        if exc.code:
            raise StoryBroken(f"kvtrace {' '.join(args)} failed (exit {exc.code})") from None


def record(model: str, load_format: str, run: Path, settings: list[str]) -> None:
    kvtrace(["record", "--model", model, "--load-format", load_format, "-w", str(ROOT / WORKLOAD),
             "-o", str(run), "-q", *settings])


def text_of(renderable, width: int = WIDTH) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()).strip("\n")


def check(thrash: dict, fix: dict, change: dict) -> list[str]:
    """The story's claims; returns them as sentences, raises StoryBroken naming the first that fails."""
    tail = {row["cause"]: row for row in thrash["itl_tail"]}
    top_cause = max(tail.values(), key=lambda row: row["tail_ms"] or 0)["cause"]
    figures = change["figures"]
    claims = [
        (thrash["thrash"]["verdict"] == "sustained", f"the main run thrashes: {thrash['thrash']['verdict']}"),
        (top_cause in ("preempted", "reprefill"), f"its ITL tail is led by preemption: {top_cause}"),
        (fix["thrash"]["verdict"] in ("none", "occasional"), f"the fix ends the thrash: {fix['thrash']['verdict']}"),
    ]
    for name in ("preemptions", "recompute_share", "goodput_req_s", "itl_p99_ms"):
        f = figures[name]
        claims.append((f["better"] is True, f"{name} better with the fix: {f['base']} -> {f['value']}"))
    for ok, claim in claims:
        if not ok:
            raise StoryBroken(claim)
    return [claim for _, claim in claims]


def tell(model: str, load_format: str, out: Path, runs: Path, *, modelled: bool = False) -> dict:
    """Record both runs, check the story, write the document; return the figures checked."""
    if runs.exists():
        shutil.rmtree(runs)
    thrash_run, fix_run = runs / "thrash", runs / "more-kv"
    with modelled_clock() if modelled else contextlib.nullcontext():
        record(model, load_format, thrash_run, THRASH_SETTINGS)
        record(model, load_format, fix_run, FIX_SETTINGS)
    params: dict[str, str] = {}  # the analyses' defaults, as `kvtrace analyze` uses them

    con = db.connect([thrash_run, fix_run])
    data = dashboard.collect(con, params=params, buckets=dashboard.strip_width(WIDTH),
                             top=dashboard.default_top(WIDTH))
    thrash, fix = data["runs"]
    summary = db.run_analysis(con, "summary", **dashboard.split_params(params, ("summary",))["summary"])
    (change,) = headline.headline(summary, headline.settings_changed(con))
    claims = check(thrash, fix, change)
    story = explain.story(explain.Explainer.open(str(thrash_run)), thrash["most_preempted"][0]["req_id"],
                          thrash["most_preempted"][0]["sample"])
    if not story["preemptions"] or any(p["requester_req_id"] is None for p in story["preemptions"]):
        raise StoryBroken(f"the most preempted request's story names no requester: {story['preemptions']}")
    claims.append(f"the most preempted request, {story['req_id']}, is explained: {story['verdict']}")

    images = out / "postmortem"
    images.mkdir(parents=True, exist_ok=True)
    from kvtrace.views import report  # altair and vl-convert load only here
    charts = [c for c in report.build(con, params=params) if c.name in CHARTS]
    report.write_images(charts, images, "png")
    answers = [(question, query, text_of(_table(con.sql(query).to_arrow_table()), 160))
               for question, query in QUERIES]
    document = DOC.format(
        workload=WORKLOAD,
        provenance=PROVENANCE_MODELLED.format(model=model) if modelled else PROVENANCE_REAL.format(model=model),
        command=_command(thrash_run, model, load_format, THRASH_SETTINGS),
        fix_command=_command(fix_run, model, load_format, FIX_SETTINGS),
        dashboard=text_of(dashboard.view([thrash_run], params, WIDTH)),
        compare=text_of(headline.render([change])),
        explained=text_of(explain.render_story(story), 100),
        answers="\n".join(ANSWER.format(question=q, query=query, result=result) for q, query, result in answers),
        charts="\n".join(f"![{c.title}](postmortem/{c.name}.png)\n\n{c.description}\n" for c in charts),
        **_figures(thrash, fix),
    )
    (out / "postmortem.md").write_text(document)
    return {"thrash": thrash, "fix": fix, "change": change, "claims": claims}


def _table(result):
    return rich_table(result, 0)


def _command(run: Path, model: str, load_format: str, settings: list[str]) -> str:
    words = ["kvtrace record --model", model] + (["--load-format", load_format] if load_format != "auto" else [])
    words += ["-w", WORKLOAD, *settings]
    return " ".join(words + ["-o", f"traces/runs/{run.name}"])


def _figures(thrash: dict, fix: dict) -> dict:
    s, f, t = thrash["summary"], fix["summary"], thrash["thrash"]
    worst = thrash["most_preempted"][0] if thrash["most_preempted"] else {}
    return {
        "preemptions": dashboard.fmt_num(s["preemptions"]), "sequences": t["preempted_sequences"],
        "again": t["repreempted_sequences"], "share": dashboard.fmt_share(s["recompute_share"]),
        "windows": t["thrash_windows"], "thrash_s": dashboard.fmt_seconds(t["thrash_s"]),
        "duration": dashboard.fmt_seconds(s["duration_s"]),
        "good": dashboard.fmt_share(s["good_share"]), "fix_good": dashboard.fmt_share(f["good_share"]),
        "itl_p99": dashboard.fmt_ms(s["itl_p99_ms"]), "fix_itl_p99": dashboard.fmt_ms(f["itl_p99_ms"]),
        "worst": worst.get("req_id", "–"), "worst_times": worst.get("preemptions", 0),
        "worst_stall": dashboard.fmt_share(worst.get("stall_share")),
        "fix_verdict": fix["thrash"]["verdict"], "fix_preemptions": dashboard.fmt_num(f["preemptions"]),
    }


ANSWER = """### {question}

```sql
{query}
```

```
{result}
```
"""

PROVENANCE_REAL = """The outputs below are those of two replays on {model}, on the host clock."""
PROVENANCE_MODELLED = """The outputs below are those of two replays on {model} under a modelled clock
(`--modelled-clock`: smollm2-135m's step times on 2 CPU cores, 18 ms a step + 1.6 ms per decoding
sequence + 0.8 ms per prefill token); on a quiet 2-core machine, `python scripts/postmortem.py`
replays smollm2-135m itself on the host clock and rewrites this page."""

DOC = """# Postmortem: a replay that thrashed, and the fix

<!-- Written by scripts/postmortem.py; do not edit by hand. tests/analysis/test_story.py runs the same
     script on the tiny model, so a change that breaks the story fails the tests. -->

{provenance}

This is the story of the README's first command, told with what kvtrace recorded. The workload,
`{workload}`, is one assistant's traffic: every request opens with the same system prompt
(160 tokens), user messages are short, requests arrive in bursts (inter-arrival CV 4), and the
answers have a long tail (median 42 tokens, a few run to the 410-token cap). The KV pool is 80
blocks of 16 tokens: it holds the longest request, but not a burst of them.

## What happened

```bash
{command}
kvtrace analyze traces/runs/thrash
```

```
{dashboard}
```

Read it from the verdict down:

- **thrash SUSTAINED**: {preemptions} preemptions of {sequences} sequences ({again} of them more
  than once), in {windows} thrash window(s) that add up to {thrash_s} of a {duration} run. The pool strip
  is red (full) through the bursts, and the ▲ marks are preemptions.
- **{share} of compute recomputed**: a preempted request lost its KV, and when blocks came back it
  re-prefilled its prompt and every token it had already produced. The engine stayed busy; part of
  what it did was the same work twice.
- **the ITL tail is preemption**: the longest gaps between tokens are the streams that froze while
  their request waited to be readmitted, then re-prefilled. Only {good} of the requests met the
  SLOs (TTFT ≤ 2 s, TPOT ≤ 100 ms); ITL p99 was {itl_p99}.
- **most preempted**: request {worst} was preempted {worst_times} times and spent {worst_stall} of
  its life stalled. Newest-first preemption is deliberate: the oldest requests finish, the newest
  pay.

## Why was request {worst} slow?

The dashboard names the most preempted request; `kvtrace explain` tells its story: its phases, why
each wait lasted (the step's reason for admitting nothing more), who needed the blocks each time it
was preempted, and what it cost (see [explain.md](explain.md)).

```bash
kvtrace explain traces/runs/thrash {worst}
```

```
{explained}
```

The requesters are the other side of the story: the dashboard's *noisy neighbours* ranks the
requests whose growth preempted the most others (`kvtrace sql traces/runs/thrash --analysis
noisy_neighbours`).

## The SQL you run next

Each query below is plain SQL over the trace (`kvtrace sql traces/runs/thrash traces/runs/more-kv
"..."`); `_recompute` is the SQL library's helper behind `recompute.sql`. The results are both
runs', the fix's included.

{answers}
## The fix

The usual remedies for sustained preemption, bluntest first: cap concurrency (`--max-num-seqs`),
keep a free-block watermark (`--watermark`), give the cache more memory. The first two decide *who
waits*: they admit fewer requests, so the wait moves from the preempted streams to the queue, and
it shows as TTFT instead; try them and `kvtrace compare` the runs. The queries above say the pool
itself is too small for these bursts (full at the first one, requests queued behind it), so the
fix here is memory: three times the blocks (on a GPU: a larger `--kv-cache-memory` or
`gpu_memory_utilization`, or a smaller KV dtype).

```bash
{fix_command}
kvtrace compare traces/runs/thrash traces/runs/more-kv
```

```
{compare}
```

With the pool sized for the bursts the verdict is {fix_verdict} ({fix_preemptions} preemptions),
{fix_good} of requests meet the SLOs, and ITL p99 falls from {itl_p99} to {fix_itl_p99}.

## The charts

`kvtrace report traces/runs/thrash traces/runs/more-kv --format png` draws these (both runs
overlaid; the HTML report has them all):

{charts}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--modelled-clock", action="store_true",
                        help="time the replays by a model of smollm2-135m's steps on 2 cores, not the host clock")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where postmortem.md and its images go")
    parser.add_argument("--runs", type=Path, default=ROOT / "traces/runs/postmortem", help="the two run folders")
    args = parser.parse_args(argv)
    try:
        result = tell(args.model, args.load_format, args.out, args.runs, modelled=args.modelled_clock)
    except StoryBroken as exc:
        print(f"postmortem: the story no longer holds: {exc}", file=sys.stderr)
        return 1
    for claim in result["claims"]:
        print(f"ok: {claim}")
    print(f"wrote {args.out / 'postmortem.md'} and {args.out / 'postmortem'}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
