"""Why was this request slow: a request's story (`kvtrace explain`), gathered from the SQL library.

Every figure comes from an analysis (request_story, wait_causes, preemptions, itl_cliffs,
worst_requests, request_verdict, whose lookahead_preemptions are lookahead_preemptions.sql's; see
analyses/); this module selects the request's rows, groups them and words a verdict. `story()` and
`worst()` return plain dicts, the `--json` output (its shape is documented in docs/explain.md);
`render_story()` and `render_worst()` lay them out for the terminal.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from kvtrace.errors import KvtraceError
from kvtrace.trace import db
from kvtrace.views.dashboard import fmt_ms
from kvtrace.vllm.live import parse_time, utc_text

if TYPE_CHECKING:   # duckdb is imported where a connection is made: not by every command's start-up
    import duckdb

WORST_BY = ("ttft", "e2e", "itl", "preemptions")

# a wait's cause in words ("waited 2.1 s for free blocks")
CAUSE_WORDS = {
    "seats": "for a seat (max_num_seqs)",
    "budget": "for the token budget",
    "blocks": "for free blocks",
    "watermark": "under the free-block watermark",
    "preemption": "behind a preemption",
    "nothing-waiting": "for the next step",
    "other": "for vLLM (a reason of its own)",
    "unknown": "(cause not recorded: trace before schema 3)",
    "idle": "for the engine to start a step",
}
PHASE_WORDS = {
    "waiting": "queued",
    "prefill": "prefill",
    "decode": "decode",
    "preempted": "preempted, waiting to resume",
    "swapped": "swapped out, waiting to resume",
    "reprefill": "re-prefill",
    "finished": "finished",
}
WAIT_WORDS = {"waiting": "queued", "preempted": "waited to resume", "swapped": "waited swapped out"}
# a wait or gap shorter than this share of the request's end-to-end time is left out of the verdict
NOTABLE_SHARE = 0.05
MAX_NAMED = 3        # requesters named in a verdict; the rest are counted


def parse_request(text: str, known: set[str]) -> tuple[str, int]:
    """The request `text` names, as (req_id, sample): REQ_ID or REQ_ID:SAMPLE (an id that itself holds a
    colon is taken whole when the run has it); else, in a capture of live traffic, the client's
    X-Request-Id (vLLM's OpenAI server names the request `cmpl-<X-Request-Id>-<prompt>-<suffix>`, or
    `chatcmpl-<X-Request-Id>-<suffix>`; in a run of several servers after its server's `<label>/`, and
    `dp1/abc` names the one of server dp1); else a unique prefix of an id. KvtraceError when nothing or
    more than one request matches (the same X-Request-Id sent to two servers), naming them."""
    if text in known:
        return text, 0
    base, sep, sample = text.rpartition(":")
    if not (sep and sample.isdigit()):
        base, sample = text, "0"
    if base in known:
        return base, int(sample)
    server, slash, rest = base.rpartition("/")
    forms = [(r"(?:[^/]+/)?", base)] + [(rf"{re.escape(server)}/", rest)] * bool(slash and server)
    given = [re.compile(rf"^{label}(?:(?:chat)?cmpl-)?{re.escape(xid)}(?:-\d+)?(?:-[0-9A-Za-z]+)?$")
             for label, xid in forms]
    matches = (sorted(k for k in known if any(g.match(k) for g in given))
               or sorted(k for k in known if k.startswith(base)))
    if len(matches) == 1:
        return matches[0], int(sample)
    if matches:
        raise KvtraceError(f"{text!r} names {len(matches)} requests ({', '.join(matches[:5])}"
                           f"{', …' if len(matches) > 5 else ''}): give more of the id")
    ids = sorted(known)
    hint = f" (it has {len(ids)}: {', '.join(ids[:5])}{', …' if len(ids) > 5 else ''})" if ids else ""
    raise KvtraceError(f"no request {text!r}: neither an id, an X-Request-Id nor the start of an id of the run{hint}")


@dataclass
class Explainer:
    """One run's connection, and what every story of the run shares (its ITL cliffs, its clock)."""

    con: duckdb.DuckDBPyConnection
    run_id: str
    # a capture of live traffic: (Unix seconds, run seconds) of its window's start, which put the run's
    # times on the wall clock
    wall: tuple[float, float] | None = None
    until: float | None = None   # a capture's: the window's end, Unix seconds

    @classmethod
    def open(cls, run: str) -> Explainer:
        con = db.connect([run])
        run_ids = [row[0] for row in con.execute("SELECT run_id FROM runs ORDER BY ordinal").fetchall()]
        if len(run_ids) != 1:
            raise KvtraceError(f"{run}: explain takes one run, this holds {len(run_ids)} "
                               f"({', '.join(run_ids[:5])}{', …' if len(run_ids) > 5 else ''}); name one")
        window = (db.read_meta(db.find_runs([run])[0]).get("capture") or {}).get("window") or {}
        wall = ((float(window["since_unix"]), float(window["start_s"]))
                if window.get("since_unix") is not None and window.get("start_s") is not None else None)
        return cls(con, run_ids[0], wall, window.get("until_unix"))

    def wall_time(self, t: float | None) -> float | None:
        """A time on the run's clock as Unix seconds (a capture's run only)."""
        return None if t is None or self.wall is None else self.wall[0] + (t - self.wall[1])

    def run_time(self, text: str) -> float:
        """`--at`: a time on the run's clock. A capture's run takes the wall clock (an ISO time, Unix
        seconds, or a time of day such as 02:14 or 02:14:30, UTC, on the window's day); any run takes
        seconds on its own clock as `+12.5` (or `12.5s`)."""
        m = re.fullmatch(r"\s*\+?(\d+(?:\.\d+)?)s?\s*", text)
        if m and (self.wall is None or text.strip().startswith("+") or text.strip().endswith("s")):
            return float(m[1])
        if self.wall is None:
            raise KvtraceError(f"--at {text!r}: this run has no wall clock (it is no capture of live traffic); "
                               "give seconds on the run's clock, such as +12.5")
        since = self.wall[0]
        day = re.fullmatch(r"\s*(\d{1,2}):(\d{2})(?::(\d{2}(?:\.\d+)?))?Z?\s*", text)
        if day:
            h, mi, sec = int(day[1]), int(day[2]), float(day[3] or 0)
            if h > 23 or mi > 59 or sec >= 60:
                raise KvtraceError(f"--at {text!r}: not a time of day (HH:MM or HH:MM:SS)")
            midnight = datetime.fromtimestamp(since, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
            candidates = [midnight.timestamp() + d * 86400 + h * 3600 + mi * 60 + sec for d in (0, 1)]
            unix = min(candidates, key=lambda c: 0 if c >= since else since - c)
        else:
            unix = parse_time(text, "--at")
        if self.until is not None and not since - self.wall[1] <= unix <= self.until:
            raise KvtraceError(f"--at {text!r} ({utc_text(unix)}) is outside the run, which covers "
                               f"{utc_text(since - self.wall[1])} to {utc_text(self.until)}")
        return self.wall[1] + (unix - since)

    def rows(self, analysis: str, **params: object) -> list[dict]:
        return [r for r in db.records(db.run_analysis(self.con, analysis, **params)) if r["run_id"] == self.run_id]

    @functools.cached_property
    def gaps(self) -> list[dict]:
        """The run's inter-token gaps above its p99 ITL (itl_cliffs with the p99 as the threshold)."""
        return self.rows("itl_cliffs", threshold_ms=0, median_multiple=0)

    @functools.cached_property
    def itl_p99_ms(self) -> float | None:
        """The run's p99 ITL (latency.sql), the threshold of the gaps (itl_cliffs computes it alike)."""
        return next((r["p99_ms"] for r in self.rows("latency") if r["metric"] == "itl"), None)

    def request_ids(self) -> set[str]:
        return {row[0] for row in self.con.execute(
            "SELECT DISTINCT req_id FROM requests WHERE run_id = ?", [self.run_id]).fetchall()}

    def server_of(self, req_id: str, sample: int) -> str:
        """The server a sequence ran on: its label in a run of several servers, else ''."""
        rows = self.con.execute("SELECT server FROM requests WHERE run_id = ? AND req_id = ? AND sample = ?",
                                [self.run_id, req_id, sample]).fetchall()
        return rows[0][0] if rows else ""


def in_flight(ex: Explainer, at_s: float) -> dict:
    """The sequences in flight at `at_s` (run clock): arrived by then and not finished before, each with
    its figures (worst_requests') and its story's verdict, the slowest end to end first."""
    rows = ex.rows("worst_requests", by="e2e", limit=2**31 - 1, at_s=at_s)
    return {"run_id": ex.run_id, "at_s": at_s, "at": _clock(ex, at_s), "requests": _told(ex, rows)}


def _told(ex: Explainer, rows: list[dict]) -> list[dict]:
    """worst_requests' rows, each with its story's verdict."""
    return [{**_drop_ids(r, keep=("req_id", "sample")), "verdict": story(ex, r["req_id"], r["sample"], request=r)["verdict"]}
            for r in rows]


def _clock(ex: Explainer, t: float | None) -> str | None:
    """A run time as the reader knows it: the wall clock for a capture, run seconds otherwise."""
    if t is None:
        return None
    unix = ex.wall_time(t)
    if unix is None:
        return f"{t:.3f} s"
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%H:%M:%S.%f")[:-3] + "Z"


def story(ex: Explainer, req_id: str, sample: int = 0, *, request: dict | None = None) -> dict:
    """The story of one sequence (one sample of a request): its phases, its waits with their causes,
    its preemptions with their requesters, its gaps above the run's p99 ITL, and a verdict."""
    if request is None:
        found = [r for r in ex.rows("worst_requests", by="e2e", limit=2**31 - 1)
                 if r["req_id"] == req_id and r["sample"] == sample]
        if not found:
            ids = sorted(ex.request_ids())
            hint = f" (it has {len(ids)}: {', '.join(ids[:5])}{', …' if len(ids) > 5 else ''})" if ids else ""
            raise KvtraceError(f"run {ex.run_id} has no request {req_id!r} with sample {sample}{hint}")
        request = found[0]
    request = {k: v for k, v in request.items() if k not in ("run_id", "req_id", "sample", "rank")}
    phases = [_drop_ids(r) for r in ex.rows("request_story", req_id=req_id, sample=sample)]
    waits: list[dict] = []
    for row in ex.rows("wait_causes", req_id=req_id, sample=sample):
        if not waits or (waits[-1]["state"], waits[-1]["start_s"]) != (row["state"], row["start_s"]):
            waits.append({"state": row["state"], "start_s": row["start_s"], "end_s": row["end_s"],
                          "wait_ms": row["wait_ms"], "causes": []})
        waits[-1]["causes"].append({"cause": row["cause"], "cause_ms": row["cause_ms"], "share": row["share"]})
    preemptions = [_drop_ids(r) for r in ex.rows("preemptions", req_id=req_id, sample=sample)]
    gaps = [_drop_ids(r) for r in ex.gaps if r["req_id"] == req_id and r["sample"] == sample]
    causes_recorded = bool(ex.con.execute(
        "SELECT coalesce(schema_version, 0) >= 3 FROM runs WHERE run_id = ?", [ex.run_id]).fetchone()[0])
    for row in (*phases, *waits):   # on the clock the reader knows: the wall clock for a capture
        row["start"] = _clock(ex, row["start_s"])
    data = {
        "run_id": ex.run_id, "req_id": req_id, "sample": sample, "server": ex.server_of(req_id, sample),
        "causes_recorded": causes_recorded,
        "clock": "wall (UTC)" if ex.wall is not None else "run seconds",
        "request": request, "phases": phases, "waits": waits, "preemptions": preemptions,
        "itl_p99_ms": ex.itl_p99_ms, "gaps": gaps,
        "figures": _drop_ids(ex.rows("request_verdict", req_id=req_id, sample=sample)[0]),
    }
    data["verdict"] = verdict(data)
    return data


def worst(ex: Explainer, n: int, by: str = "e2e") -> dict:
    """The n worst sequences of the run by `by`, each with its figures and its story's verdict."""
    if by not in WORST_BY:
        raise KvtraceError(f"--by must be one of {', '.join(WORST_BY)}, got {by!r}")
    if n < 1:
        raise KvtraceError(f"--worst must be >= 1, got {n}")
    return {"run_id": ex.run_id, "by": by, "requests": _told(ex, ex.rows("worst_requests", by=by, limit=n))}


def _drop_ids(row: dict, keep: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in row.items() if k not in ("run_id", "req_id", "sample") or k in keep}


# --------------------------------------------------------------------------- the verdict

def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def _who(req_id: str | None, sample: int | None, data: dict) -> str:
    if req_id is None:
        return "an unrecorded requester"
    if req_id == data["req_id"] and sample == data["sample"]:
        return "its own growth"
    return f"{req_id}'s growth" if not sample else f"{req_id}:{sample}'s growth"


# the verdict's waits: (WAIT_WORDS key, request_verdict's column prefix)
VERDICT_WAITS = (("waiting", "queued"), ("preempted", "resume_wait"), ("swapped", "swapped_wait"))


def _wait_part(figures: dict, state: str, prefix: str, e2e: float) -> str | None:
    """"queued 2.1 s, mostly for free blocks (77%)": the waits in `state`, if notable."""
    total = figures[f"{prefix}_ms"] or 0
    if total <= 0 or total <= NOTABLE_SHARE * e2e:
        return None
    text = f"{WAIT_WORDS[state]} {fmt_ms(total)}"
    cause, share = figures[f"{prefix}_cause"], figures[f"{prefix}_cause_share"]
    if cause is not None and share is not None:
        text += f", {'mostly ' if share < 0.995 else ''}{CAUSE_WORDS.get(cause, cause)}"
        if share < 0.995:
            text += f" ({share * 100:.0f}%)"
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _lookahead_part(figures: dict, data: dict) -> str | None:
    """"preempted at step 40 by r7, whose 3 draft tokens and 3 lookahead slots needed a block its verified
    token did not": the preemptions that speculative decoding caused (request_verdict's lookahead_preemptions,
    from lookahead_preemptions.sql), the first MAX_NAMED named, the rest counted."""
    caused = figures.get("lookahead_preemptions") or []
    if not caused:
        return None
    named = []
    for p in caused[:MAX_NAMED]:
        drafts, slots = p["draft_tokens"], p["lookahead_slots"] or 0
        what = [("drafts" if drafts is None else _count(drafts, "draft token")) if drafts != 0 else None,
                _count(slots, "lookahead slot") if slots else None]
        what = " and ".join(w for w in what if w)
        if (p["requester_req_id"], p["requester_sample"]) == (data["req_id"], data["sample"]):
            named.append(f"at step {p['step']} by itself: its {what} needed a block its verified token did not")
        else:
            who = p["requester_req_id"] + (f":{p['requester_sample']}" if p["requester_sample"] else "")
            named.append(f"at step {p['step']} by {who}, whose {what} needed a block its verified token did not")
    text = "preempted " + ", and ".join(named)
    if len(caused) > MAX_NAMED:
        text += f", and {_times(len(caused) - MAX_NAMED)} more for drafts and lookahead slots"
    return text


def tier_words(tier: str | None) -> str:
    """A KV tier's name as a sentence says it: `cpu` (vLLM's native offloading, kvtrace's host tier) is
    host memory; any other (a connector's) by its name."""
    return "host memory" if tier in (None, "cpu") else tier


def verdict(data: dict) -> str:
    """The story in a sentence: the notable waits and their main cause, the preemptions by
    requester (those that a requester's drafts and lookahead slots caused, by step), the recomputed
    work, the gaps above p99. The figures are request_verdict's
    (data["figures"]); this only words them."""
    figures = data["figures"]
    e2e = figures["e2el_ms"] or 0
    parts = [_wait_part(figures, *VERDICT_WAITS[0], e2e)]
    if figures["preemptions"]:
        requesters = figures["requesters"]
        named = requesters[:MAX_NAMED]
        many = len(requesters) > 1
        whom = ", ".join(f"{_times(r['preemptions'])} by {_who(r['req_id'], r['sample'], data)}" if many
                         else _who(r["req_id"], r["sample"], data) for r in named)
        if len(requesters) > MAX_NAMED:
            rest = sum(r["preemptions"] for r in requesters[MAX_NAMED:])
            whom += f", {_times(rest)} by {len(requesters) - MAX_NAMED} others"
        text = f"preempted {_times(figures['preemptions'])}" + (f": {whom}" if many else f" by {whom}")
        if figures["victim_reasons"]:
            text += f" (chosen as {' / '.join(figures['victim_reasons'])})"
        text += f", {figures['positions_lost']} KV positions lost"
        parts.append(text)
        parts.append(_lookahead_part(figures, data))
        parts += [_wait_part(figures, state, prefix, e2e) for state, prefix in VERDICT_WAITS[1:]]
        recomputed, cached = figures["recomputed_tokens"], figures["cached_tokens"]
        loaded = figures.get("tier_tokens") or 0   # brought back from a KV tier instead (schema 6)
        if loaded:
            ms = figures["tier_load_ms"]
            text = (f"{loaded} positions came back from {tier_words(figures['tier'])}"
                    + (f" in {fmt_ms(ms)}" if ms is not None else "") + f", {recomputed} recomputed")
            if cached:
                text += f" ({cached} back from the prefix cache)"
            parts.append(text)
        elif recomputed or cached:
            ms = figures["recompute_ms_est"]
            text = f"{recomputed} tokens recomputed" + (f", ~{fmt_ms(ms)}" if ms else "")
            if cached:
                text += f" ({cached} back from the prefix cache)"
            parts.append(text)
    if figures["gaps"]:
        count = figures["gaps"]
        parts.append(f"{count} gap{'s' if count > 1 else ''} above the run's p99 ITL "
                     f"(longest {fmt_ms(figures['longest_gap_ms'])}, "
                     f"{figures['longest_gap_cause'].replace('_', ' ')})")
    if figures.get("draft_tokens"):   # speculative decoding: what its drafts gave, and what was thrown away
        drafts, accepted = figures["draft_tokens"], figures["accepted_tokens"] or 0
        parts.append(f"{drafts} draft tokens, {accepted} accepted ({accepted / drafts:.0%}), "
                     f"{drafts - accepted} positions rolled back")
    parts = [p for p in parts if p]
    if not parts:
        ttft = figures["ttft_ms"]
        return (f"nothing held it back: first token after {fmt_ms(ttft)}, {fmt_ms(e2e)} end to end"
                if ttft is not None else f"{data['request'].get('finish_reason') or 'unfinished'} without a token")
    return "; ".join(parts)


# --------------------------------------------------------------------------- the terminal

def _table(*columns: tuple[str, str]) -> Table:
    table = Table(show_edge=False, header_style="bold", pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    return table


def render_story(data: dict) -> RenderableType:
    r = data["request"]
    name = data["req_id"] if not data["sample"] else f"{data['req_id']}:{data['sample']}"
    head = Text.assemble(
        (name, "bold"), f" in run {data['run_id']}" + (f" on server {data['server']}" if data.get("server") else "")
        + f": {r.get('finish_reason') or 'unfinished'}, ",
        f"{fmt_ms(r.get('e2el_ms'))} end to end, first token after {fmt_ms(r.get('ttft_ms'))}, "
        f"{r.get('output_tokens')} tokens")
    parts: list[RenderableType] = [head, Text.assemble(("verdict: ", "bold"), data["verdict"]), Text("")]

    phases = _table(("#", "right"), ("phase", "left"), ("start", "right"), ("duration", "right"),
                    ("steps", "right"), ("", "left"))
    for p in data["phases"]:
        note = f"preemption {p['preemption_no']}" if p["preemption_no"] else p["finish_reason"] or ""
        duration = "" if p["phase"] == "finished" else fmt_ms(p["duration_ms"])
        steps = "" if p["phase"] == "finished" else (
            f"{p['num_steps']} from {p['first_step']}" if p["num_steps"] else "0")
        phases.add_row(str(p["phase_no"]), PHASE_WORDS.get(p["phase"], p["phase"]), p.get("start") or f"{p['start_s']:.3f} s",
                       duration, steps, note)
    parts += [Text("Phases", style="bold"), phases, Text("")]

    if data["waits"]:
        waits = _table(("wait", "left"), ("start", "right"), ("duration", "right"), ("causes, by share of time", "left"))
        for w in data["waits"]:
            causes = " · ".join(f"{c['cause']} {c['share'] * 100:.0f}%" for c in w["causes"] if c["share"] is not None)
            waits.add_row(WAIT_WORDS[w["state"]], w.get("start") or f"{w['start_s']:.3f} s", fmt_ms(w["wait_ms"]), causes)
        parts += [Text("Waits", style="bold"), waits, Text("")]
        if not data["causes_recorded"]:
            parts += [Text("(this trace predates schema 3: the causes were not recorded)", style="dim"), Text("")]

    if data["preemptions"]:
        tiered = any(p.get("tier_tokens") for p in data["preemptions"])   # a KV tier gave some back
        pre = _table(("#", "right"), ("step", "right"), ("by", "left"), ("chosen as", "left"), ("mode", "left"),
                     ("lost", "right"), ("resumed after", "right"), ("cached", "right"),
                     *((("from tier", "right"),) if tiered else ()), ("recomputed", "right"))
        for p in data["preemptions"]:
            by = p["requester_req_id"] if p["requester_req_id"] is not None else "–"
            if p["requester_sample"]:
                by += f":{p['requester_sample']}"
            if p["self_preempted"]:
                by += " (itself)"
            recomputed = f"{p['recomputed_tokens']}" + (f" (~{fmt_ms(p['recompute_ms_est'])})"
                                                        if p["recompute_ms_est"] else "")
            loaded = ((f"{p['tier_tokens']}" + (f" ({fmt_ms(p['tier_load_ms'])})" if p["tier_load_ms"] is not None
                                                 else ""),) if tiered else ())
            pre.add_row(str(p["preemption_no"]), str(p["step"]), by, p["victim_reason"] or "–", p["reason"],
                        f"{p['positions_lost']}", fmt_ms(p["wait_ms"]), str(p["cached_tokens"]), *loaded, recomputed)
        title = ("Preemptions (lost: KV positions; cached, from tier and recomputed: on resume)" if tiered
                 else "Preemptions (lost: KV positions; cached and recomputed: on resume)")
        parts += [Text(title, style="bold"), pre, Text("")]

    if data["gaps"]:
        gaps = _table(("token", "right"), ("gap", "right"), ("cause", "left"), ("steps", "right"))
        for g in data["gaps"]:
            gaps.add_row(str(g["idx"]), fmt_ms(g["gap_ms"]), g["cause"], f"{g['prev_step']}–{g['step']}")
        parts += [Text(f"Gaps above the run's p99 ITL ({fmt_ms(data['itl_p99_ms'])})", style="bold"), gaps]
    return Group(*parts)


def render_worst(data: dict) -> RenderableType:
    """One line of figures per request, its verdict below it (readable at 80 columns)."""
    return _render_requests(f"The {len(data['requests'])} worst requests of run {data['run_id']} by {data['by']}",
                            data["requests"], ranked=True)


def render_in_flight(data: dict) -> RenderableType:
    """The requests in flight at a time, as render_worst lays them out."""
    return _render_requests(f"{len(data['requests'])} requests in flight at {data['at']} in run {data['run_id']}",
                            data["requests"], ranked=False)


def _render_requests(title: str, requests: list[dict], ranked: bool) -> RenderableType:
    lines: list[RenderableType] = [Text(title, style="bold")]
    for r in requests:
        name = r["req_id"] if not r["sample"] else f"{r['req_id']}:{r['sample']}"
        preempted = f"{r['preemptions']} preemption{'s' if r['preemptions'] != 1 else ''}"
        lines.append(Text.assemble(
            (f"{r['rank']:>2}. " if ranked else "  ", "bold"), (name, "bold"),
            f"  e2e {fmt_ms(r['e2el_ms'])} · ttft {fmt_ms(r['ttft_ms'])} · max itl {fmt_ms(r['max_itl_ms'])}"
            f" · {preempted}"))
        lines.append(Padding(Text(r["verdict"]), (0, 0, 0, 4)))
    return Group(*lines)
