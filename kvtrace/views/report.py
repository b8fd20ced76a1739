"""`kvtrace report`: the SQL library's answers as Altair charts, in one self-contained HTML file
(the Vega, Vega-Lite and vega-embed scripts inlined once, so it opens offline) or one PNG / SVG
file per chart (rendered by vl-convert).

Every chart draws rows of an analysis as they come (only the columns it uses); the little
reshaping there is, is Vega-Lite's own (filtering the intervals that had preemptions, folding the
swap directions into one column). Sizes stay small on long runs because the analyses downsample:
pool_timeline.sql cuts each run into `buckets` intervals and latency_cdf.sql keeps `points` levels
of each CDF plus its tail, so the page is about 1 MB of scripts plus a few hundred kB of data.
"""
from __future__ import annotations

import functools
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrace.trace import db
from kvtrace.views.dashboard import fmt_bytes, fmt_num, fmt_seconds, fmt_share, split_params

if TYPE_CHECKING:   # altair is imported by the functions that draw (it takes a second), duckdb by db.connect
    import altair as alt
    import duckdb

TIMELINE_BUCKETS = 150          # intervals of pool_timeline.sql per run for the occupancy chart
RATE_BUCKETS_DIVISOR = 5        # recompute and swap rates: a fifth as many (wider) intervals
NBSP = "\u00a0"
GANTT_REQUESTS = 8              # most preempted requests per run in the Gantt chart
WIDTH = 860
STATES = ["waiting", "prefill", "decode", "preempted", "swapped", "reprefill"]
STATE_COLORS = ["#c7c7c7", "#6baed6", "#74c476", "#de2d26", "#fd8d3c", "#9e9ac8"]
CAUSES = ["swap_wait", "preempted", "reprefill", "prefill_interference", "other"]
CAUSE_COLORS = ["#fd8d3c", "#de2d26", "#9e9ac8", "#6baed6", "#bdbdbd"]


@dataclass
class ReportChart:
    name: str              # file name with --format png / svg, and the HTML section's id
    title: str
    description: str       # what it shows and which analysis it comes from
    chart: alt.TopLevelMixin


def _rows(con: duckdb.DuckDBPyConnection, name: str, **params: object) -> list[dict]:
    return db.records(db.run_analysis(con, name, **params))


def _pick(rows: list[dict], *columns: str) -> alt.Data:
    """The columns a chart draws of an analysis's rows, as inline data."""
    import altair as alt

    return alt.Data(values=[{c: row[c] for c in columns} for row in rows])


def _run_scale(run_ids: list[str]) -> alt.Scale:
    import altair as alt

    return alt.Scale(domain=run_ids, scheme="category10")


# --------------------------------------------------------------------------- the charts

def pool_occupancy(timeline: list[dict], windows: list[dict], run_ids: list[str]) -> alt.TopLevelMixin:
    import altair as alt

    color = alt.Color("run_id:N", title="run", scale=_run_scale(run_ids))
    time = alt.X("start_s:Q", title="time (s)")
    marks = alt.Shape("mark:N", title=None, scale=alt.Scale(domain=["preemption", "swap copy"],
                                                           range=["triangle-down", "diamond"]))
    base = alt.Chart()
    # an interval in which no step ended holds the pool as the last step left it: the step line
    # runs on from the last interval with a step
    stepped = base.transform_filter("isValid(datum.mean_used_frac)")
    used = stepped.mark_line(interpolate="step-after").encode(
        time, alt.Y("mean_used_frac:Q", title="KV pool used", scale=alt.Scale(domain=[0, 1.13]),
                    axis=alt.Axis(format="%", values=[0, 0.25, 0.5, 0.75, 1])),
        color, tooltip=["run_id:N", "start_s:Q", "end_s:Q", "steps:Q", alt.Tooltip("mean_used_frac:Q", format=".1%"),
                        alt.Tooltip("max_used_frac:Q", format=".1%"), "full_pool_steps:Q"])
    peak = stepped.mark_line(interpolate="step-after", opacity=0.35, strokeWidth=1).encode(
        time, alt.Y("max_used_frac:Q"), color)
    preempts = base.transform_filter("datum.preemptions > 0").transform_calculate(
        y="1.05", mark="'preemption'").mark_point(filled=True, size=50).encode(
        time, alt.Y("y:Q"), color, marks,
        tooltip=["run_id:N", "start_s:Q", "preemptions:Q", "swap_preemptions:Q"])
    swaps = base.transform_filter("datum.swap_out_bytes + datum.swap_in_bytes > 0").transform_calculate(
        y="1.1", mark="'swap copy'").mark_point(filled=True, size=30).encode(
        time, alt.Y("y:Q"), color, marks,
        tooltip=["run_id:N", "start_s:Q", alt.Tooltip("swap_out_bytes:Q", format=".3s"),
                 alt.Tooltip("swap_in_bytes:Q", format=".3s")])
    layers = [used, peak, preempts, swaps]
    if windows:
        layers.insert(0, alt.Chart(_pick(windows, "run_id", "start_s", "end_s", "peak_preempt_per_s")).mark_rect(
            opacity=0.08).encode(alt.X("start_s:Q"), alt.X2("end_s:Q"), color,
                                 tooltip=["run_id:N", "start_s:Q", "end_s:Q", "peak_preempt_per_s:Q"]))
    data = _pick(timeline, "run_id", "start_s", "end_s", "steps", "mean_used_frac", "max_used_frac",
                 "full_pool_steps", "preemptions", "swap_preemptions", "swap_out_bytes", "swap_in_bytes")
    return alt.layer(*layers, data=data).properties(width=WIDTH, height=240)


def request_gantt(states: list[dict], run_ids: list[str], arrows: list[dict] | None = None) -> alt.TopLevelMixin:
    """The states of the chosen sequences as bars; `arrows` (preemptions.sql's rows whose victim and
    requester are both shown) as lines from the requester's row to the victim's at the preemption's
    time, a dot at the victim's end."""
    import altair as alt

    label = "datum.sample > 0 ? datum.req_id + '/' + datum.sample : datum.req_id"
    # one table of rows with the same columns: a state's (kind state) or a preemption's (kind arrow)
    empty_state = {"rank": None, "state": None, "start_s": None, "end_s": None, "duration_ms": None}
    values = [{**row, "kind": "state", "ts_s": None, "requester_req_id": None, "requester_sample": None,
               "victim_reason": None} for row in states] + [
        {**empty_state, "kind": "arrow", "run_id": a["run_id"], "req_id": a["req_id"], "sample": a["sample"],
         "ts_s": a["ts_s"], "requester_req_id": a["requester_req_id"], "requester_sample": a["requester_sample"],
         "victim_reason": a["victim_reason"]} for a in arrows or []]
    y = alt.Y("request:N", title="request", sort=alt.EncodingSortField("rank", order="ascending"))
    bars = alt.Chart().transform_filter("datum.kind == 'state'").mark_bar(height={"band": 0.8}).encode(
        alt.X("start_s:Q", title="time (s)"), alt.X2("end_s:Q"), y,
        alt.Color("state:N", scale=alt.Scale(domain=STATES, range=STATE_COLORS), title="state"),
        tooltip=["run_id:N", "request:N", "state:N", "start_s:Q", "end_s:Q",
                 alt.Tooltip("duration_ms:Q", format=".1f")],
    ).transform_calculate(request=label)
    layers = [bars]
    if arrows:
        arrow = alt.Chart().transform_filter("datum.kind == 'arrow'").transform_calculate(
            request=label,
            requester="datum.requester_sample > 0 ? datum.requester_req_id + '/' + datum.requester_sample "
                      ": datum.requester_req_id")
        tooltip = ["run_id:N", alt.Tooltip("requester:N", title="requester"), alt.Tooltip("request:N", title="victim"),
                   "victim_reason:N", "ts_s:Q"]
        layers += [arrow.mark_rule(color="black", strokeWidth=1.5).encode(
                       alt.X("ts_s:Q"), alt.Y("requester:N"), alt.Y2("request:N"), tooltip=tooltip),
                   arrow.mark_point(color="black", filled=True, size=30, opacity=1).encode(
                       alt.X("ts_s:Q"), alt.Y("request:N"), tooltip=tooltip)]
    chart = alt.layer(*layers, data=alt.Data(values=values))
    if len(run_ids) > 1:
        return chart.properties(width=WIDTH - 60, height=alt.Step(16)).facet(
            row=alt.Row("run_id:N", title=None, sort=run_ids)).resolve_scale(y="independent")
    return chart.properties(width=WIDTH, height=alt.Step(18))


def itl_cdf(cdf: list[dict], tail: list[dict], run_ids: list[str]) -> alt.TopLevelMixin:
    import altair as alt

    color = alt.Color("run_id:N", title="run", scale=_run_scale(run_ids))
    lines = alt.Chart(alt.Data(values=cdf)).mark_line(interpolate="step-after").encode(
        alt.X("value_ms:Q", title="inter-token latency (ms, log)", scale=alt.Scale(type="log")),
        alt.Y("cdf:Q", title="share of gaps ≤ x", axis=alt.Axis(format="%")), color,
        tooltip=["run_id:N", alt.Tooltip("value_ms:Q", format=".2f"), alt.Tooltip("cdf:Q", format=".3f")])
    threshold = alt.Chart(alt.Data(values=tail)).transform_aggregate(
        threshold_ms="max(threshold_ms)", groupby=["run_id"]).mark_rule(strokeDash=[4, 3]).encode(
        alt.X("threshold_ms:Q"), color, tooltip=["run_id:N", alt.Tooltip("threshold_ms:Q", format=".1f")])
    causes = alt.Chart(alt.Data(values=tail)).transform_filter("datum.cliffs > 0").mark_bar().encode(
        alt.X("tail_ms:Q", title="time in cliffs (ms)", stack="zero"),
        alt.Y("run_id:N", title=None, sort=run_ids),
        alt.Color("cause:N", scale=alt.Scale(domain=CAUSES, range=CAUSE_COLORS), title="cliff cause"),
        alt.Order("cause_order:Q"),
        tooltip=["run_id:N", "cause:N", "cliffs:Q", alt.Tooltip("tail_ms:Q", format=".1f"),
                 alt.Tooltip("tail_share:Q", format=".1%"), alt.Tooltip("max_gap_ms:Q", format=".1f")],
    ).transform_calculate(cause_order=f"indexof({json.dumps(CAUSES)}, datum.cause)")
    return alt.hconcat(
        alt.layer(lines, threshold).properties(width=520, height=260, title="ITL CDF (dashed: cliff threshold)"),
        causes.properties(width=240, height=alt.Step(28), title="ITL cliffs by cause"),
    ).resolve_scale(color="independent")


def latency_distributions(cdf: list[dict], run_ids: list[str]) -> alt.TopLevelMixin:
    import altair as alt

    color = alt.Color("run_id:N", title="run", scale=_run_scale(run_ids))
    panels = []
    for metric, title in (("ttft", "time to first token (ms)"), ("e2el", "end-to-end latency (ms)")):
        panels.append(alt.Chart(alt.Data(values=cdf)).transform_filter(f"datum.metric == '{metric}'").mark_line(
            interpolate="step-after").encode(
            alt.X("value_ms:Q", title=title), alt.Y("cdf:Q", title="share of requests ≤ x",
                                                     axis=alt.Axis(format="%")),
            color, tooltip=["run_id:N", alt.Tooltip("value_ms:Q", format=".1f"), alt.Tooltip("cdf:Q", format=".3f")],
        ).properties(width=400, height=220))
    return alt.hconcat(*panels)


def recompute_swap(timeline: list[dict], run_ids: list[str]) -> alt.TopLevelMixin:
    """Recomputed tokens/s over time and, when some run swapped, swap bytes/s out (up) and in (down)."""
    import altair as alt

    color = alt.Color("run_id:N", title="run", scale=_run_scale(run_ids))
    time = alt.X("start_s:Q", title="time (s)")
    base = alt.Chart(_pick(timeline, "run_id", "start_s", "recomputed_tokens", "processed_tokens",
                           "recomputed_tok_s", "swap_out_bytes_s", "swap_in_bytes_s"))
    recompute = base.mark_area(interpolate="step-after", opacity=0.45).encode(
        time, alt.Y("recomputed_tok_s:Q", title="recomputed tokens/s", stack=None), color,
        tooltip=["run_id:N", "start_s:Q", "recomputed_tokens:Q", "processed_tokens:Q"],
    ).properties(width=WIDTH, height=160, title="recompute waste")
    # swap-out drawn above the axis, swap-in mirrored below it
    swap = base.transform_fold(
        ["swap_out_bytes_s", "swap_in_bytes_s"], as_=["direction", "bytes_s"]
    ).transform_calculate(
        signed_bytes_s="datum.direction == 'swap_in_bytes_s' ? -datum.bytes_s : datum.bytes_s",
    ).mark_area(interpolate="step-after", opacity=0.45).encode(
        time, alt.Y("signed_bytes_s:Q", title="bytes/s (out ↑, in ↓)", axis=alt.Axis(format="~s"), stack=None),
        color, alt.Detail("direction:N"),
        tooltip=["run_id:N", "start_s:Q", "direction:N", alt.Tooltip("bytes_s:Q", format=".3s")],
    ).properties(width=WIDTH, height=180, title="swap traffic: out of the device (up), back in (down)")
    if not any(row["swap_out_bytes_s"] or row["swap_in_bytes_s"] for row in timeline):
        return recompute
    if not any(row["recomputed_tok_s"] for row in timeline):
        return swap
    return alt.vconcat(recompute, swap)


def gantt_arrows(con: duckdb.DuckDBPyConnection, states: list[dict], requests: int) -> tuple[list[dict], list[dict]]:
    """The preemptions of the Gantt's sequences by another sequence whose requester is shown (schema
    3 records it), and the states of the requesters not shown yet (request_story.sql; up to
    `requests` of each run, the most frequent first), ranked after the victims."""
    shown = {(r["run_id"], r["req_id"], r["sample"]) for r in states}
    preemptions = [p for p in _rows(con, "preemptions") if (p["run_id"], p["req_id"], p["sample"]) in shown
                   and p["requester_req_id"] is not None and not p["self_preempted"]]
    counts: dict[tuple, int] = {}
    for p in preemptions:
        key = (p["run_id"], p["requester_req_id"], p["requester_sample"])
        if key not in shown:
            counts[key] = counts.get(key, 0) + 1
    added: list[dict] = []
    per_run: dict[str, int] = {}
    for (run_id, req_id, sample), _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if per_run.get(run_id, 0) >= requests:
            continue
        per_run[run_id] = per_run.get(run_id, 0) + 1
        rank = requests + per_run[run_id]
        added += [{**row, "rank": rank} for row in _rows(con, "request_story", req_id=req_id, sample=sample)
                  if row["run_id"] == run_id and row["phase"] != "finished"]
        shown.add((run_id, req_id, sample))
    arrows = [p for p in preemptions if (p["run_id"], p["requester_req_id"], p["requester_sample"]) in shown]
    states_added = [{"run_id": r["run_id"], "req_id": r["req_id"], "sample": r["sample"], "rank": r["rank"],
                     "state": r["phase"], "start_s": r["start_s"], "end_s": r["end_s"],
                     "duration_ms": r["duration_ms"]} for r in added]
    return arrows, states_added


ANALYSES = ("pool_timeline", "thrash_windows", "request_timeline", "latency_cdf",
            "itl_cliff_summary", "summary")


def per_server(rows: list[dict], run_ids: list[str]) -> tuple[list[dict], list[str]]:
    """Rows of a server's pool (pool_timeline's, thrash_windows') as the charts' series: in a run joined from
    several servers, `<run> <server>` in place of the run id; and the series in the runs' order."""
    servers: dict[str, list[str]] = {run: [] for run in run_ids}
    for r in rows:
        if r.get("server") and r["server"] not in servers[r["run_id"]]:
            servers[r["run_id"]].append(r["server"])
    relabelled = [{**r, "run_id": f"{r['run_id']} {r['server']}"} if r.get("server") else r for r in rows]
    return relabelled, [name for run in run_ids for name in ([f"{run} {s}" for s in servers[run]] or [run])]


def build(con: duckdb.DuckDBPyConnection, *, params: dict[str, str] | None = None,
          buckets: int = TIMELINE_BUCKETS, requests: int = GANTT_REQUESTS) -> list[ReportChart]:
    """Every chart of the report, from the analyses run on `con`'s runs (`params`: --param values,
    for the analyses that declare them)."""
    per = split_params(params or {}, ANALYSES)

    def rows(name: str, **options: object) -> list[dict]:
        return _rows(con, name, **per[name], **options)

    run_ids = [row[0] for row in con.sql("SELECT run_id FROM runs ORDER BY ordinal").fetchall()]
    db.keep(con, "_latency_hist", "_recompute", "_sequence_spans", "_stall_spans")   # several of the analyses below read each
    # a run joined from several servers has a pool per server: each is a series of the pool charts
    timeline, series = per_server(rows("pool_timeline", buckets=buckets), run_ids)
    rates, _ = per_server(rows("pool_timeline", buckets=max(buckets // RATE_BUCKETS_DIVISOR, 1)), run_ids)
    windows, _ = per_server(rows("thrash_windows"), run_ids)
    states = rows("request_timeline", top=requests)  # each run's own most preempted, ranked in that run
    arrows, requesters = gantt_arrows(con, states, requests)     # and the requests that preempted them
    states += requesters
    cdf = rows("latency_cdf")
    tail = rows("itl_cliff_summary")
    itl = [row for row in cdf if row["metric"] == "itl"]
    latency = [row for row in cdf if row["metric"] in ("ttft", "e2el")]
    return [
        ReportChart("pool_occupancy", "KV pool occupancy",
                    f"Mean share of the device KV pool in use in each of {buckets} intervals per run (faint: the "
                    "interval's fullest step); marks above: intervals with preemptions or swap copies; shaded: "
                    "thrash windows. From pool_timeline.sql and thrash_windows.sql.",
                    pool_occupancy(timeline, windows, series)),
        ReportChart("request_gantt", "Most preempted requests",
                    f"What the {requests} most preempted requests of each run went through, state by state. "
                    "Black lines: a preemption, from the request whose growth needed the blocks to its victim (dot). "
                    "From most_preempted.sql, request_timeline.sql and preemptions.sql.",
                    request_gantt(states, run_ids, arrows)),
        ReportChart("itl_cdf", "Inter-token latency and its tail",
                    "Cumulative distribution of every gap between consecutive tokens (log scale), and the time "
                    "spent in gaps above each run's cliff threshold by cause. From latency_cdf.sql and "
                    "itl_cliff_summary.sql.", itl_cdf(itl, tail, run_ids)),
        ReportChart("latency_distributions", "Time to first token and end-to-end latency",
                    "Cumulative distributions over sequences. From latency_cdf.sql.",
                    latency_distributions(latency, run_ids)),
        ReportChart("recompute_swap", "Recompute waste and swap traffic over time",
                    "Token positions computed a second time after recompute preemption, and KV bytes swapped "
                    f"out and in, per second, over {max(buckets // RATE_BUCKETS_DIVISOR, 1)} intervals per run. "
                    "From pool_timeline.sql.",
                    recompute_swap(rates, series)),
    ]


# --------------------------------------------------------------------------- output

def _vl_convert():
    """vl-convert, imported when a report is rendered: `kvtrace analyze` imports this module too, and
    runs where vl-convert (a 30 MB wheel) is not installed, such as the offline GPU check."""
    import vl_convert

    return vl_convert


def vega_lite_version() -> str | None:
    """The Vega-Lite version Altair writes specs for, as vl-convert names it (None: its latest)."""
    import altair as alt

    vlc = _vl_convert()
    wanted = ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])
    return wanted if wanted in vlc.get_vegalite_versions() else None


@functools.lru_cache(maxsize=1)
def javascript_bundle() -> str:
    """vega-embed, Vega-Lite and Vega in one script that defines window.vegaEmbed (about 900 kB)."""
    return _vl_convert().javascript_bundle(vl_version=vega_lite_version()).replace("</script", "<\\/script")


def write_images(charts: list[ReportChart], folder: Path, fmt: str) -> list[Path]:
    """One file per chart, `<name>.<fmt>`, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    vlc = _vl_convert()
    written = []
    for item in charts:
        spec = item.chart.to_dict()
        path = folder / f"{item.name}.{fmt}"
        if fmt == "svg":
            path.write_text(vlc.vegalite_to_svg(spec, vl_version=vega_lite_version()))
        else:
            path.write_bytes(vlc.vegalite_to_png(spec, vl_version=vega_lite_version(), scale=2))
        written.append(path)
    return written


def _runs_table(con: duckdb.DuckDBPyConnection, params: dict[str, str]) -> str:
    """The runs, what they ran on and their key figures (summary.sql), as an HTML table."""
    runs = db.records(con.sql(
        "SELECT run_id, status, model, dtype, device, preemption_mode, preemption_policy, num_gpu_blocks, "
        "block_size, num_cpu_blocks, workload_path, workload_requests FROM runs ORDER BY ordinal"
    ).to_arrow_table())
    summary = {row["run_id"]: row for row in _rows(con, "summary", **split_params(params, ("summary",))["summary"])}
    head = ["run", "status", "model on device", "KV pool", "preemption", "workload", "duration", "output",
            "preemptions", "recomputed", "swapped", "thrash"]
    body = []
    for run in runs:
        s = summary.get(run["run_id"], {})
        pool = f"{run['num_gpu_blocks']} × {run['block_size']} tok" + (
            f", host {run['num_cpu_blocks']}" if run["num_cpu_blocks"] else "")
        swapped = fmt_bytes((s.get("swap_out_bytes") or 0) + (s.get("swap_in_bytes") or 0)) \
            if s.get("swap_out_bytes") or s.get("swap_in_bytes") else "–"
        cells = [run["run_id"], run["status"], f"{run['model']} {run['dtype'] or ''} on {run['device']}", pool,
                 f"{run['preemption_mode']}/{run['preemption_policy']}",
                 f"{(run['workload_path'] or '?').rsplit('/', 1)[-1]} ({run['workload_requests']} req)",
                 fmt_seconds(s.get("duration_s")), fmt_num(s.get("output_tok_s"), "tok/s"),
                 fmt_num(s.get("preemptions")),
                 f"{fmt_num(s.get('recomputed_tokens'), 'tok')} ({fmt_share(s.get('recompute_share'))})",
                 swapped, s.get("thrash_verdict") or "–"]
        # figures keep their units on their line; names may wrap
        wrap = {2, 5}
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c) if i in wrap else str(c).replace(' ', NBSP))}</td>"
                                     for i, c in enumerate(cells)) + "</tr>")
    return ("<div class='runs'><table class='runs'><thead><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>"
            + "".join(body) + "</tbody></table></div>")


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 2em auto;
       max-width: 1240px; padding: 0 1em; }}
h1 {{ font-size: 1.5em; margin-bottom: 0.2em; }}
h2 {{ font-size: 1.15em; margin: 1.8em 0 0.2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }}
p.note {{ color: #555; margin: 0.2em 0 0.8em; font-size: 0.9em; }}
table.runs {{ border-collapse: collapse; font-size: 0.78em; }}
table.runs th, table.runs td {{ padding: 0.25em 0.5em; border-bottom: 1px solid #eee; text-align: left;
                               vertical-align: top; }}
div.runs {{ overflow-x: auto; }}
table.runs td:first-child {{ white-space: nowrap; font-weight: 600; }}
.chart-error {{ color: #b00; font-family: monospace; }}
</style>
<script>
// script errors are recorded in the root element's data-errors attribute (the browser test reads it)
window.addEventListener("error", function (e) {{
  var root = document.documentElement;
  root.dataset.errors = (root.dataset.errors || "") + (e.message || "error") + "\\n";
}});
</script>
<script>{bundle}</script>
</head>
<body>
<h1>{title}</h1>
<p class="note">What did the KV cache do to the requests? Every figure comes from kvtrace's SQL library
(analyses/*.sql); hover a chart for values.</p>
{runs_table}
{sections}
<script>
var specs = {specs};
Object.keys(specs).forEach(function (name) {{
  var el = document.getElementById("chart-" + name);
  vegaEmbed(el, specs[name], {{renderer: "svg", actions: false}}).then(function () {{
    el.dataset.rendered = "true";
  }}).catch(function (err) {{
    var root = document.documentElement;
    root.dataset.errors = (root.dataset.errors || "") + name + ": " + err + "\\n";
    el.innerHTML = "<p class='chart-error'>chart failed: " + String(err).replace(/</g, "&lt;") + "</p>";
  }});
}});
</script>
</body>
</html>
"""


def to_html(charts: list[ReportChart], con: duckdb.DuckDBPyConnection, params: dict[str, str] | None = None) -> str:
    """The report as one HTML page that needs no network: the scripts are inlined."""
    run_ids = [row[0] for row in con.sql("SELECT run_id FROM runs ORDER BY ordinal").fetchall()]
    sections = "\n".join(
        f"<section id='{item.name}'><h2>{html.escape(item.title)}</h2>"
        f"<p class='note'>{html.escape(item.description)}</p><div class='chart' id='chart-{item.name}'></div></section>"
        for item in charts)
    specs = json.dumps({item.name: item.chart.to_dict() for item in charts}, separators=(",", ":"))
    return PAGE.format(title=html.escape(f"kvtrace report: {', '.join(run_ids)}"), bundle=javascript_bundle(),
                       runs_table=_runs_table(con, params or {}), sections=sections, specs=specs.replace("</", "<\\/"))
