"""A sweep's answer: sweep_summary.sql's rows as a table, the best point by an objective, and one
sentence that names the knee where there is one (and says plainly when there is none).

The figures are the SQL library's; this module only picks among them and words the result.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.table import Table

from engine.config import parse_bytes
from kvtrace.errors import KvtraceError
from kvtrace.sweep.from_run import vllm_args
from kvtrace.sweep.runner import SWEEP_FILE, Sweep, load
from kvtrace.trace import db
from kvtrace.views.dashboard import VERDICT_STYLE, fmt_bytes, fmt_ms, fmt_num, fmt_share
from kvtrace.views.report import WIDTH, ReportChart

KNEE_DROP = 0.10        # the objective worsens by at least this past the best point: a knee
FLAT_SPREAD = 0.05      # every point within this of the best: the knob does not matter


@dataclass(frozen=True)
class Objective:
    column: str
    better: str         # max | min
    label: str
    unit: str


OBJECTIVES = {
    "goodput": Objective("goodput_req_s", "max", "goodput", "req/s"),
    "useful_tok_s": Objective("useful_tok_s", "max", "useful throughput", "tok/s"),
    "output_tok_s": Objective("output_tok_s", "max", "throughput", "tok/s"),
    "itl_p99": Objective("itl_p99_ms", "min", "ITL p99", "ms"),
    "itl_p50": Objective("itl_p50_ms", "min", "ITL p50", "ms"),
    "ttft_p99": Objective("ttft_p99_ms", "min", "TTFT p99", "ms"),
    "ttft_p50": Objective("ttft_p50_ms", "min", "TTFT p50", "ms"),
    "preemptions": Objective("preemptions", "min", "preemptions", ""),
    "recompute_share": Objective("recompute_share", "min", "recomputed share", ""),
}


def objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise KvtraceError(f"--objective {name}: not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def points_of(rows: list[dict], knobs: list[str]) -> list[dict]:
    """The completed points of a sweep, each with its settings as a dict in the grid's knob order
    (`knobs`; meta.json's keys come back sorted)."""
    out = []
    for row in rows:
        if row["sweep"] is None or row["status"] != "completed":
            continue
        settings = json.loads(row["settings"])
        out.append({**row, "settings": {k: settings[k] for k in knobs if k in settings}})
    return out


def _numeric(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        try:
            return float(parse_bytes(value))
        except ValueError:
            return None


def varying_knobs(points: list[dict]) -> list[str]:
    if not points:
        return []
    names = list(points[0]["settings"])
    return [n for n in names if len({p["settings"].get(n) for p in points}) > 1]


def axis_knob(points: list[dict]) -> str | None:
    """The knob a chart puts on its x axis: the first varying knob whose values are all numbers."""
    for name in varying_knobs(points):
        if all(_numeric(p["settings"][name]) is not None for p in points):
            return name
    return None


def best_point(points: list[dict], obj: Objective) -> dict | None:
    scored = [p for p in points if p[obj.column] is not None]
    if not scored:
        return None
    sign = 1 if obj.better == "max" else -1
    return max(scored, key=lambda p: (sign * p[obj.column], -p["point"]))


def _value(obj: Objective, value: float) -> str:
    if obj.column == "recompute_share":
        return fmt_share(value)
    if obj.unit == "ms":
        return fmt_ms(value)
    return fmt_num(value, obj.unit)


def _worse_by(obj: Objective, best: float, other: float) -> float:
    """How much worse `other` is than `best`, as a fraction of best (0 when not worse)."""
    if best == 0:
        return 0.0 if other == best else float("inf")
    change = (best - other) / abs(best) if obj.better == "max" else (other - best) / abs(best)
    return max(change, 0.0)


def recommend(points: list[dict], obj: Objective) -> str:
    """One sentence: the best point, and the knee above it or why there is none."""
    return recommendation(points, obj)[0]


def recommendation(points: list[dict], obj: Objective) -> tuple[str, dict | None]:
    """recommend's sentence, and the point it recommends (None where it finds nothing to choose: no
    figure, no knee, or the best at the grid's edge)."""
    best = best_point(points, obj)
    if best is None:
        return f"No completed point has a {obj.label} figure; nothing to recommend.", None
    axis = axis_knob(points)
    where = ", ".join(f"{k} {v}" for k, v in best["settings"].items() if k in varying_knobs(points)) \
        or "every point"
    head = f"{where} gives the {'highest' if obj.better == 'max' else 'lowest'} {obj.label} " \
           f"({_value(obj, best[obj.column])})"
    if axis is None:
        return head + "; no swept knob is numeric, so there is no knee to find.", best
    others = {k: v for k, v in best["settings"].items() if k != axis}
    line = sorted((p for p in points if all(p["settings"].get(k) == v for k, v in others.items())
                   and p[obj.column] is not None), key=lambda p: _numeric(p["settings"][axis]))
    fixed = [f"{k} {v}" for k, v in others.items() if k in varying_knobs(points)]
    context = f" (with {', '.join(fixed)})" if fixed else ""
    values = [p[obj.column] for p in line]
    spread = max(_worse_by(obj, best[obj.column], v) for v in values)
    low, high = line[0]["settings"][axis], line[-1]["settings"][axis]
    if obj.better == "max" and best[obj.column] <= 0:
        return (f"No point has any {obj.label}: it is 0 at every point{context}, so there is nothing to choose; "
                f"loosen the SLOs (--param ttft_ms=..., tpot_ms=...) or choose another --objective."), None
    if spread < FLAT_SPREAD:
        return (f"No knee: {obj.label} stays within {FLAT_SPREAD:.0%} of its best ({_value(obj, min(values))}–"
                f"{_value(obj, max(values))}) across {axis} {low}..{high}{context}; this knob does not matter "
                f"for this workload."), None
    above = line[line.index(best) + 1:]
    if not above:
        return (f"No knee within the grid: {obj.label} keeps improving up to {axis} {high}, the largest value "
                f"swept{context} ({_value(obj, best[obj.column])}); sweep higher values to find where it turns."), None
    last = above[-1]
    drop = _worse_by(obj, best[obj.column], last[obj.column])
    if drop < KNEE_DROP:
        return (head + f"; above it {obj.label} changes by less than {KNEE_DROP:.0%} up to {axis} {high}{context}: "
                       f"no knee, the plateau starts at {best['settings'][axis]}."), best
    before, after = best["preemptions"] or 0, last["preemptions"] or 0
    if after > before:
        rise = f"preemptions rise {after / before:.0f}x" if before else f"preemptions rise from 0 to {after:,}"
        rise += " and "
    else:
        rise = ""
    verb = "falls" if obj.better == "max" else "rises"
    return head + f"; above it {rise}{obj.label} {verb} {drop:.0%} by {axis} {high}{context}.", best


TIER_KNOB = "offload_size"   # kvtrace record --offload-size: a host KV tier (vLLM's --kv-offloading-size)


def tier_sizing(points: list[dict]) -> str | None:
    """Where the sweep varies the host KV tier's size: the operator's answer, in a sentence. The
    smallest size past the knee (the first that gets at least 90% of the cut in recomputed positions
    that the largest swept size makes) with vLLM's flag for it, what it saves against the smallest size
    swept (no tier, where 0 is swept): recomputed positions, TTFT p99 and ITL p99, and the preemptions
    where they change (a request that comes back sooner can preempt again; the other knobs as at that
    point). None where the sweep does not vary the tier's size."""
    if TIER_KNOB not in varying_knobs(points):
        return None
    line = sorted((p for p in points if p["recomputed_tokens"] is not None),
                  key=lambda p: _numeric(p["settings"][TIER_KNOB]) or 0.0)
    others = [k for k in varying_knobs(points) if k != TIER_KNOB]
    if others:   # one line of the grid: the other knobs as at the best point by recompute
        anchor = min(line, key=lambda p: p["recomputed_tokens"])
        line = [p for p in line if all(p["settings"].get(k) == anchor["settings"].get(k) for k in others)]
    if len(line) < 2:
        return None
    base, largest = line[0], line[-1]
    before = base["recomputed_tokens"]
    cut = before - min(p["recomputed_tokens"] for p in line)
    size = lambda p: p["settings"][TIER_KNOB]   # noqa: E731
    if cut <= 0:
        return (f"No host tier size swept ({size(base)}..{size(largest)}) recomputes fewer positions than "
                f"{size(base)} ({before:,}): the preemptions here lose nothing a tier keeps, or none happen.")
    knee = next(p for p in line if before - p["recomputed_tokens"] >= 0.9 * cut)
    saved = before - knee["recomputed_tokens"]

    def change(column: str) -> str:
        a, b = base[column], knee[column]
        return f"{fmt_ms(a)} → {fmt_ms(b)}" if a is not None and b is not None else "–"
    was, now = base.get("preemptions"), knee.get("preemptions")
    preempted = f", preemptions {was:,} → {now:,}" if was is not None and now is not None and was != now else ""
    rest = (f"; the largest, {size(largest)}, saves {cut - saved:,} more" if knee is not largest and cut > saved
            else "")
    return (f"A host KV tier of {size(knee)} (vLLM: {vllm_args({TIER_KNOB: size(knee)})}) is the smallest past the "
            f"knee in recomputed positions: against {size(base)} it cuts them from {before:,} to "
            f"{knee['recomputed_tokens']:,} "
            f"(−{saved / before:.0%}), TTFT p99 {change('ttft_p99_ms')}, ITL p99 {change('itl_p99_ms')}"
            f"{preempted}{rest}.")


# --------------------------------------------------------------------------- table and charts

def _plain_ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def table(points: list[dict], obj: Objective, title: str) -> Table:
    knobs = list(points[0]["settings"]) if points else []
    best = best_point(points, obj)
    t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("")
    for knob in knobs:
        t.add_column(knob, no_wrap=True, min_width=len(knob))
    for head in ("tok/s", "useful tok/s", "goodput req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms", "preempt", "recomp", "swap"):
        t.add_column(head, justify="right")
    t.add_column("thrash")
    for p in points:
        style = VERDICT_STYLE.get(p["thrash_verdict"] or "", "")
        t.add_row("★" if p is best else "", *(p["settings"][k] for k in knobs),
                  fmt_num(p["output_tok_s"]), fmt_num(p["useful_tok_s"]), fmt_num(p["goodput_req_s"]),
                  _plain_ms(p["ttft_p50_ms"]), _plain_ms(p["ttft_p99_ms"]),
                  _plain_ms(p["itl_p50_ms"]), _plain_ms(p["itl_p99_ms"]),
                  fmt_num(p["preemptions"]), fmt_share(p["recompute_share"]),
                  fmt_bytes(p["swap_bytes"]) if p["swap_bytes"] else "–",
                  f"[{style}]{p['thrash_verdict'] or '–'}[/]" if style else (p["thrash_verdict"] or "–"))
    return t


CHART_METRICS = [("goodput_req_s", "goodput (req/s)"), ("useful_tok_s", "useful throughput (tok/s)"),
                 ("output_tok_s", "throughput (tok/s)"), ("itl_p99_ms", "ITL p99 (ms)"),
                 ("ttft_p99_ms", "TTFT p99 (ms)"), ("preemptions", "preemptions"),
                 ("recompute_share", "recomputed share")]


def charts(points: list[dict], obj: Objective) -> list[ReportChart]:
    """Each metric against the swept numeric knob, a line per value of the other knobs, the best
    point of the objective marked on every chart."""
    import altair as alt   # here: it takes a second to import

    axis = axis_knob(points)
    if axis is None:
        raise KvtraceError("the sweep has no numeric knob with more than one value to chart against")
    others = [k for k in varying_knobs(points) if k != axis]
    best = best_point(points, obj)
    data = []
    for p in points:
        row = {"x": _numeric(p["settings"][axis]), "x_label": p["settings"][axis],
               "line": ", ".join(f"{k}={p['settings'][k]}" for k in others) or "all",
               "best": p is best, "run_id": p["run_id"]}
        row.update({column: p[column] for column, _ in CHART_METRICS})
        data.append(row)
    geometric = len({round(b["x"] / a["x"], 6) for a, b in zip(
        sorted(data, key=lambda r: r["x"]), sorted(data, key=lambda r: r["x"])[1:]) if a["x"] and a["x"] != b["x"]}) == 1
    scale = alt.Scale(type="log", base=2) if geometric and all(r["x"] > 0 for r in data) else alt.Scale(zero=False)
    out = []
    for column, title in CHART_METRICS:
        base = alt.Chart(alt.Data(values=data)).encode(
            alt.X("x:Q", title=axis, scale=scale), alt.Y(f"{column}:Q", title=title),
            alt.Color("line:N", title=", ".join(others) or None))
        lines = base.mark_line(point=True).encode(tooltip=["run_id:N", "x_label:N", alt.Tooltip(f"{column}:Q")])
        knee = base.transform_filter("datum.best").mark_point(shape="diamond", size=220, filled=False,
                                                                strokeWidth=2, color="black")
        rule = alt.Chart(alt.Data(values=[r for r in data if r["best"]])).mark_rule(
            strokeDash=[4, 4], color="#555").encode(alt.X("x:Q"))
        chart = (lines + knee + rule).properties(width=WIDTH, height=220)
        out.append(ReportChart(f"sweep-{column}", f"{title} against {axis}",
                               f"sweep_summary.sql's {column} at each point; the diamond and the dashed line mark "
                               f"the best point by {obj.label}.", chart))
    return out


# ---------------------------------------------------------------- a sweep folder's summary and report

def summary_rows(folder: Path, params: dict[str, str]) -> tuple[Sweep, list[dict]]:
    sweep = load(folder)
    runs = [sweep.run_dir(p) for p in sweep.points if (sweep.run_dir(p) / "meta.json").is_file()]
    if not runs:
        raise KvtraceError(f"{folder}: no point of the sweep has a run yet")
    con = db.connect(runs)
    rows = db.records(db.run_analysis(con, "sweep_summary", **params))
    return sweep, rows


def sweep_charts(folder: Path, objective_name: str, params: dict[str, str]) -> list:
    sweep, rows = summary_rows(folder, params)
    return charts(points_of(rows, list(sweep.spec.grid)), objective(objective_name))


def write_report(folder: Path, output: Path, objective_name: str, params: dict[str, str]) -> int:
    """`kvtrace report SWEEP`: the sweep's charts in one self-contained HTML page."""
    import html

    from kvtrace.views.report import PAGE, javascript_bundle

    obj = objective(objective_name)
    sweep, rows = summary_rows(folder, params)
    points = points_of(rows, list(sweep.spec.grid))
    items = charts(points, obj)
    sentence = recommend(points, obj)
    sizing = tier_sizing(points)
    if sizing:
        sentence += " " + sizing
    sections = "\n".join(
        f"<section id='{c.name}'><h2>{html.escape(c.title)}</h2><p class='note'>{html.escape(c.description)}</p>"
        f"<div class='chart' id='chart-{c.name}'></div></section>" for c in items)
    specs = json.dumps({c.name: c.chart.to_dict() for c in items}, separators=(",", ":"))
    grid = ", ".join(f"{k} = {', '.join(v)}" for k, v in sweep.spec.grid.items())
    head = (f"<div class='runs'><p><b>{html.escape(sentence)}</b></p><p class='note'>grid: {html.escape(grid)}; "
            f"{len(points)}/{len(sweep.points)} points completed; workload {html.escape(sweep.spec.workload)}</p></div>")
    output.write_text(PAGE.format(title=html.escape(f"kvtrace sweep: {sweep.spec.name}"), bundle=javascript_bundle(),
                                  runs_table=head, sections=sections, specs=specs.replace("</", "<\\/")))
    return len(items)


def is_sweep(path: str) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()
