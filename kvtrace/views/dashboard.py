"""`kvtrace analyze`: one screen on what the KV cache did to a run's requests (Rich).

`collect(con)` runs the SQL library's analyses and gathers their rows per run: the figures. The
renderers only lay those figures out; every number on the screen is a value of some analysis
(`summary`, `thrash`, `thrash_servers`, `thrash_windows`, `latency`, `itl_cliff_summary`,
`most_preempted`, `pool_timeline`) or of the `runs` table. `--json` prints the figures themselves.
A run joined from several servers' captures (data-parallel ranks, a fleet's hosts) shows, under the
run's verdict, each server's, and a pool strip per server (each has its own pool).

    ┌ header: run, model, device, KV pool, preemption, workload, status
    ├ key figures                        ┐ two columns from 120 terminal columns on;
    ├ thrash verdict and its evidence    │ stacked below that
    ├ KV pool occupancy strip + preempts │
    ├ ITL percentiles │ tail causes      │
    └ most preempted requests            ┘
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from kvtrace.errors import KvtraceError
from kvtrace.trace import db

if TYPE_CHECKING:   # duckdb is imported where a connection is made: not by every command's start-up
    import duckdb

TWO_COLUMNS_WIDTH = 120          # terminal width from which the dashboard uses two columns
DEFAULT_BUCKETS = 60             # pool timeline intervals for --json and when the width is unknown
CAUSES = {"swap_wait": "swap wait", "preempted": "preempted", "reprefill": "re-prefill",
          "prefill_interference": "prefill interference", "other": "other"}
PERCENTILES = [("p50", "p50_ms"), ("p90", "p90_ms"), ("p99", "p99_ms"), ("p99.9", "p999_ms"), ("max", "max_ms")]
LEVELS = " ▁▂▃▄▅▆▇█"             # 1/8 steps of a character cell

# the analyses the dashboard shows; --param values go to those that declare them, except the
# params that the dashboard's own options set
ANALYSES = ("summary", "thrash", "thrash_servers", "thrash_windows", "latency", "itl_cliff_summary",
            "most_preempted", "noisy_neighbours", "pool_timeline", "kv_groups", "spec_decode", "tier_hits",
            "tier_transfers")
OPTION_PARAMS = {"buckets", "limit", "req_id", "top"}  # set by the commands themselves
RUN_COLUMNS = """run_id, status, error, model, dtype, device, device_type, preemption_mode, preemption_policy,
    enable_prefix_caching, block_size, num_gpu_blocks, num_cpu_blocks, bytes_per_block,
    json_extract(meta_json, '$.kv_pool.total_bytes')::BIGINT AS total_bytes,
    workload_path, workload_requests, replay_mode, time_scale"""


# --------------------------------------------------------------------------- the figures

def split_params(params: dict[str, str], analyses: tuple[str, ...] = ANALYSES) -> dict[str, dict[str, str]]:
    """`params` (--param NAME=VALUE) split among `analyses` by the params each declares; a param
    that none declares is an error."""
    declared = {info.name: {p.name for p in info.params} - OPTION_PARAMS
                for info in db.list_analyses() if info.name in analyses}
    unknown = sorted(set(params) - set().union(*declared.values()))
    if unknown:
        accepted = ", ".join(sorted(set().union(*declared.values())))
        raise KvtraceError(f"unknown param {', '.join(unknown)} (accepted: {accepted})")
    return {name: {k: v for k, v in params.items() if k in names} for name, names in declared.items()}


def collect(con: duckdb.DuckDBPyConnection, *, params: dict[str, str] | None = None,
            buckets: int = DEFAULT_BUCKETS, top: int = 5) -> dict:
    """Every figure the dashboard shows, per run in the order given: {"runs": [...], "params": ...}."""
    per = split_params(params or {})
    per["pool_timeline"]["buckets"] = str(buckets)
    per["most_preempted"]["limit"] = str(top)
    per["noisy_neighbours"]["limit"] = str(top)
    # several of the analyses below read each; the sequences' latencies (every token grouped by
    # sequence) feed both the histograms and the goodput, so they are kept first
    db.keep(con, "_sequence_latency", "_latency_hist", "_recompute", "_stall_spans")
    # summary, thrash and thrash_windows each judge every step; with the same params, once
    db.keep_calls(con, "_thrash_steps", "_thrash_windows", "_thrash_servers", "_thrash",
                  **db.analysis_params("thrash", **per["thrash"]))
    results = {name: db.records(db.run_analysis(con, name, **per[name])) for name in ANALYSES}
    runs = db.records(con.sql(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY ordinal").to_arrow_table())

    def of(name: str, run_id: str) -> list[dict]:
        return [{k: v for k, v in row.items() if k != "run_id"} for row in results[name] if row["run_id"] == run_id]

    figures = []
    for run in runs:
        rid = run["run_id"]
        figures.append({
            "run": run,
            "summary": (of("summary", rid) or [{}])[0],
            "thrash": (of("thrash", rid) or [{}])[0],
            "servers": of("thrash_servers", rid),   # one row per server, its verdict ('' for a run of one)
            "thrash_windows": of("thrash_windows", rid),
            "latency": {row.pop("metric"): row for row in of("latency", rid)},
            "itl_tail": of("itl_cliff_summary", rid),
            "most_preempted": of("most_preempted", rid),
            "noisy_neighbours": of("noisy_neighbours", rid),
            "pool_timeline": of("pool_timeline", rid),
            "kv_groups": of("kv_groups", rid),                  # one row a KV-cache group (one: a dense model)
            "spec_decode": (of("spec_decode", rid) or [{}])[0],   # drafting: a capture of a server that drafts
            "tiers": tier_rows(of("tier_hits", rid), of("tier_transfers", rid)),   # KV tiers (none: no tier)
        })
    used = {name: db.analysis_params(name, **per[name]) for name in ANALYSES}
    return {"runs": figures, "params": used}


def tier_rows(hits: list[dict], transfers: list[dict]) -> list[dict]:
    """A run's KV tiers, one dict each (tier_hits.sql's row with tier_transfers.sql's bytes and copies
    each way as stored_* and loaded_*); empty for a run without a tier."""
    tiers = {row["tier"]: dict(row) for row in hits}
    for row in transfers:
        side = "stored" if row["direction"] == "offload" else "loaded"
        tier = tiers.setdefault(row["tier"], {"tier": row["tier"]})
        tier.update({f"{side}_bytes": row["bytes"], f"{side}_copies": row["copies"], f"{side}_failed": row["failed"]})
    return list(tiers.values())


# --------------------------------------------------------------------------- formatting

def fmt_ms(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 1000:
        seconds = value / 1000
        if seconds >= 10_000:
            return fmt_num(seconds, "s")     # 620k s
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"
    return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def fmt_num(value: float | None, unit: str = "") -> str:
    """Three significant digits, with a unit; counts up to 9,999 in full, larger ones said shortly
    (12.4k, 121k, 75.0M, 1.20G) so that they fit the dashboard's labels."""
    if value is None:
        return "–"
    if abs(value) >= 10_000:
        text = _short(value)
    elif abs(value) >= 100 or value == int(value):
        text = f"{value:,.0f}"
    else:
        text = f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}".rstrip()


def _short(value: float) -> str:
    """|value| >= 10,000 in three significant digits and a suffix: 12.4k, 121k, 75.0M, 1.20G."""
    for suffix, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        scaled = abs(value) / scale
        digits = 2 if scaled < 10 else 1 if scaled < 100 else 0
        if round(scaled, digits) < 1000 or suffix == "T":
            text = f"{scaled:.{digits}f}"
            if float(text) >= (10 if digits == 2 else 100 if digits == 1 else 1000):
                text = f"{scaled:.{digits - 1}f}"      # 9.995k rounds to 10.0k, not 10.00k
            return ("-" if value < 0 else "") + text + suffix
    raise AssertionError("unreachable")


def fmt_share(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 100:.1f}%" if value < 0.1 else f"{value * 100:.0f}%"


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return fmt_num(value / scale, unit)
    return fmt_num(value, "B")


def fmt_seconds(value: float | None) -> str:
    return "–" if value is None else fmt_ms(value * 1000)


VERDICT_STYLE = {"none": "bold green", "occasional": "bold yellow", "sustained": "bold red"}


# --------------------------------------------------------------------------- one run

def header(run: dict, summary: dict, servers: list[dict] | None = None, groups: list[dict] | None = None) -> Text:
    """Two lines: the run, its status, length and replay, model and device; then the KV pool, the
    preemption mode and policy, and the workload; the KV-cache groups of a hybrid model (kv_groups.sql);
    and the servers of a run joined from several."""
    status_style = {"completed": "green", "running": "cyan"}.get(run["status"], "red")
    text = Text()
    text.append(f" {run['run_id']} ", "bold reverse")
    text.append("  ")
    text.append(run["status"] or "unknown", status_style)
    if run.get("error"):
        text.append(f" ({run['error']})", "red")
    text.append(f" · {fmt_seconds(summary.get('duration_s'))}{_replay(run)} · {run['model']} {run['dtype'] or ''}"
                f" on {run['device']} ({run['device_type']})")
    pool = f"KV pool {run['num_gpu_blocks']} blocks × {run['block_size']} tok"
    if run.get("total_bytes"):
        pool += f" ({fmt_bytes(run['total_bytes'])})"
    if run.get("num_cpu_blocks"):
        pool += f", host {run['num_cpu_blocks']}"
    if not run.get("enable_prefix_caching"):
        pool += ", no prefix cache"
    if len(servers or ()) > 1:
        pool += " each"
    text.append(f"\n{pool} · {run['preemption_mode']}/{run['preemption_policy']} · {_workload(run)}", "dim")
    if len(groups or ()) > 1 or any(g["kind"] != "full_attention" for g in groups or ()):
        text.append(f"\n{len(groups)} KV-cache groups: {', '.join(group_text(g) for g in groups)}", "dim")
    if len(servers or ()) > 1:
        text.append(f"\n{len(servers)} servers: {', '.join(s['server'] for s in servers)}", "dim")
    return text


GROUP_KINDS = {"full_attention": "full attention", "sliding_window": "sliding window", "chunked_local": "local chunks",
               "mamba": "Mamba state"}


def group_text(g: dict) -> str:
    """A KV-cache group in a few words: its kind, window, share of the blocks allocated, blocks dropped."""
    text = GROUP_KINDS.get(g["kind"], g["kind"])
    if g.get("window_tokens"):
        text += f" {fmt_num(g['window_tokens'], 'tok')}"
    text += f" ({fmt_share(g.get('alloc_share'))} of blocks"
    if g.get("window_freed_blocks"):
        text += f", {fmt_num(g['window_freed_blocks'])} dropped"
    return text + ")"


def _replay(run: dict) -> str:
    """How the workload was replayed, when not on the wall clock."""
    if run.get("replay_mode") == "time-scale":
        return f", ×{run['time_scale']:g} speed"
    if run.get("replay_mode") not in (None, "wallclock"):
        return f", {run['replay_mode']}"
    return ""


def _workload(run: dict) -> str:
    return f"{(run.get('workload_path') or '?').rsplit('/', 1)[-1]}: {fmt_num(run['workload_requests'])} req"


def key_figures(s: dict, t: dict, width: int, spec: dict | None = None, tiers: list[dict] = ()) -> Table:
    """The run's key figures from summary.sql (and thrash.sql's count of preempted sequences,
    spec_decode.sql's drafts and the KV tiers' figures where the run has them): label-value pairs, two
    pairs a row where they fit `width` whole, else one a row."""
    pairs = [
        ("throughput", f"{fmt_num(s.get('output_tok_s'), 'tok/s')} · {fmt_num(s.get('request_throughput'), 'req/s')}"),
        ("goodput", f"{fmt_num(s.get('goodput_req_s'), 'req/s')} ({fmt_share(s.get('good_share'))} in SLO)"),
    ]
    pairs += [_latency_pair(s, metric) for metric in ("ttft", "tpot", "itl", "e2el")]
    preemptions = fmt_num(s.get("preemptions"))
    if s.get("preemptions"):
        preemptions += f" ({fmt_num(t.get('preempted_sequences'))} seqs, {fmt_num(t.get('repreempted_sequences'))} again)"
    pairs.append(("preemptions", preemptions))
    swapped = bool(s.get("swap_out_bytes") or s.get("swap_in_bytes"))
    if s.get("recomputed_tokens") or not swapped:
        pairs.append(("recomputed", f"{fmt_num(s.get('recomputed_tokens'), 'tok')} "
                                    f"({fmt_share(s.get('recompute_share'))} of compute)"))
    if swapped:
        out_b, in_b = fmt_bytes(s.get("swap_out_bytes")), fmt_bytes(s.get("swap_in_bytes"))
        moved = f"{out_b} each way" if out_b == in_b else f"{out_b} out, {in_b} in"  # short: fits 80 columns
        pairs.append(("swapped", f"{moved} · {fmt_num(s.get('swap_gb_s'), 'GB/s')}"))
    if spec and (spec.get("draft_tokens") or spec.get("lookahead_preemptions")):   # speculative decoding: what
        # it drafted and threw away, and the preemptions its drafts and lookahead slots made
        by_lookahead = spec.get("lookahead_preemptions")
        pairs.append(("drafts", f"{fmt_num(spec['draft_tokens'], 'tok')} ({fmt_share(spec.get('acceptance'))} "
                                f"accepted, {fmt_num(spec.get('rolled_back_tokens'))} rolled back"
                                + (f", {by_lookahead} preempting)" if by_lookahead else ")")))
    pairs += [(f"tier {tier['tier']}", tier_text(tier)) for tier in tiers]
    # two pairs a row: the left pairs' widest label and value, the right pairs', and 3 spaces
    two = sum(max(len(pair[i]) for pair in pairs[side::2]) for side in (0, 1) for i in (0, 1)) + 3
    per_row = 2 if two <= width else 1
    grid = Table.grid(padding=(0, 1))
    for _ in range(per_row):
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(no_wrap=True)
    for i in range(0, len(pairs), per_row):
        cells = [cell for pair in pairs[i:i + per_row] for cell in pair]
        grid.add_row(*cells, *[""] * (2 * per_row - len(cells)))
    return grid


def tier_text(tier: dict) -> str:
    """A KV tier's figures in a line: its hit rate of what the device lacked, the positions it gave back,
    the bytes stored and loaded."""
    text = f"{fmt_share(tier.get('tier_hit_rate'))} hit · {fmt_num(tier.get('tier_hit_tokens'), 'tok')} back"
    return text + f" · {fmt_bytes(tier.get('stored_bytes'))} stored, {fmt_bytes(tier.get('loaded_bytes'))} loaded"


def _latency_pair(s: dict, metric: str) -> tuple[str, str]:
    name = {"e2el": "E2E"}.get(metric, metric.upper())
    return name, f"p50 {fmt_ms(s.get(f'{metric}_p50_ms')):>8}  p99 {fmt_ms(s.get(f'{metric}_p99_ms')):>8}"


def thrash_verdict(t: dict, server: str = "") -> Text:
    """thrash.sql's verdict and its evidence on one line (the preempted sequences are with the key
    figures, the share of steps with a full pool is on the pool strip); a server's (thrash_servers.sql)
    indented under its label."""
    verdict = t.get("verdict") or "none"
    text = Text(f"  {server} thrash " if server else "thrash ", "bold")
    text.append(verdict.upper(), VERDICT_STYLE.get(verdict, "bold"))
    if verdict == "none":
        return text.append(" · no preemption")
    evidence = [f"peak {fmt_num(t.get('peak_preempt_per_s'))} preempt/s"]
    windows = t.get("thrash_windows") or 0
    if windows:
        evidence.append(f"{windows} window{'s' if windows > 1 else ''} ({fmt_seconds(t.get('thrash_s'))})")
    if t.get("recompute_share"):
        evidence.append(f"{fmt_share(t['recompute_share'])} recomputed")
    if t.get("reloaded_tokens"):   # a KV tier gave preempted sequences their history back
        evidence.append(f"{fmt_num(t['reloaded_tokens'], 'tok')} reloaded")
    return text.append(" · " + " · ".join(evidence))


def server_strips(timeline: list[dict], servers: list[dict]) -> list[RenderableType]:
    """pool_timeline.sql's rows of a run of several servers: each server's label and its strip."""
    strips: list[RenderableType] = []
    for s in servers:
        strips += [Text(s["server"], "bold"), pool_strip([r for r in timeline if r["server"] == s["server"]])]
    return strips


def pool_strip(timeline: list[dict], label_width: int = 5) -> Group:
    """pool_timeline.sql's rows as two rows of eighth-blocks (16 levels) of the mean used fraction
    per interval (red where a step ran with a full pool), a row of preemption marks (▼: all by
    swap) and a time axis. Intervals in which no step ended are dotted."""
    top, bottom, marks = Text(), Text(), Text()
    for row in timeline:
        frac = row["mean_used_frac"]
        style = "red" if row["full_pool_steps"] else "cyan"
        if frac is None:
            top.append(" ")
            bottom.append("·", "dim")
        else:
            level = round(frac * 16)
            top.append(LEVELS[max(level - 8, 0)], style)
            bottom.append(LEVELS[min(level, 8)] if level else "▁", style if level else "dim")
        if row["preemptions"]:
            glyph = "▼" if row["swap_preemptions"] == row["preemptions"] else "▲"
            marks.append(glyph, "bold yellow")
        else:
            marks.append(" ")
    pad = " " * label_width
    axis = _axis(timeline)
    lines = [Text("100%".rjust(label_width - 1) + "▕") + top, Text("0%".rjust(label_width - 1) + "▕") + bottom,
             Text(pad) + marks, Text(pad) + axis]
    return Group(*lines)


def _axis(timeline: list[dict]) -> Text:
    """Times of a few interval starts (the last label: the end), placed under their columns."""
    width = len(timeline)
    if not width:
        return Text()
    end_s = timeline[-1]["end_s"]
    line = [" "] * width
    for pos in (0, width // 4, width // 2, width * 3 // 4):
        label = "╵" + _axis_label(timeline[pos]["start_s"], end_s)
        if pos + len(label) <= width and all(c == " " for c in line[max(pos - 1, 0):pos + len(label) + 1]):
            line[pos:pos + len(label)] = label
    label = _axis_label(end_s, end_s) + "╵"
    if all(c == " " for c in line[width - len(label) - 1:]):
        line[width - len(label):] = label
    return Text("".join(line), "dim")


def _axis_label(seconds: float, end_s: float) -> str:
    """A time on the axis, in ms when the whole run lasts under a second."""
    if end_s < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.1f}s" if end_s < 100 else f"{seconds:.0f}s"


def _log_bar(value: float | None, low: float, high: float, width: int) -> str:
    """A bar whose length is log(value) placed between log(low) and log(high), at least one cell."""
    if value is None or value <= 0 or low <= 0 or high <= low:
        return "▏" if value else ""
    share = (math.log(value) - math.log(low)) / (math.log(high) - math.log(low))
    eighths = max(1, round(min(max(share, 0.0), 1.0) * width * 8))
    return "█" * (eighths // 8) + (LEVELS[eighths % 8] if eighths % 8 else "")


def itl_ladder(itl: dict | None, bar_width: int) -> Table:
    """The ITL distribution as its percentiles, bars on a log scale."""
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="magenta", no_wrap=True)
    if not itl:
        table.add_row("ITL", "no gaps yet", "")
        return table
    low = itl["p50_ms"] / 2 if itl.get("p50_ms") else None
    for label, key in PERCENTILES:
        bar = _log_bar(itl.get(key), low or 0, itl.get("max_ms") or 0, bar_width)
        table.add_row(label, fmt_ms(itl.get(key)), bar)
    return table


def tail_causes(rows: list[dict], width: int) -> Table:
    """The cliffs (gaps above the run's threshold) and the share of tail time of each cause, in
    `width` columns: the bars get what the figures leave."""
    cells = [(CAUSES.get(row["cause"], row["cause"]), fmt_num(row["cliffs"]),
              fmt_ms(row["tail_ms"]) if row["cliffs"] else "", row)
             for row in sorted(rows, key=lambda r: -(r["tail_ms"] or 0))]
    used = sum(max((len(c[i]) for c in cells), default=0) for i in range(3)) + 3
    bar_width = max(width - used - 1, 0)
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="yellow", no_wrap=True)
    for cause, cliffs, tail_ms, row in cells:
        share = row["tail_share"] or 0
        bar = "█" * round(share * bar_width) if row["cliffs"] else ""
        table.add_row(cause, cliffs, tail_ms, bar)
    return table


def tail_title(rows: list[dict], width: int = 80) -> str:
    """The tail's title, ", by cause" left out where it would not fit `width` with a rule."""
    if not rows:
        return "ITL tail"
    cliffs = sum(r["cliffs"] for r in rows)
    title = f"ITL tail: {fmt_num(cliffs)} gap{'s' if cliffs != 1 else ''} > {fmt_ms(rows[0]['threshold_ms'])}"
    return title + ", by cause" if len(title) + len(", by cause") + 2 <= width else title


def most_preempted(rows: list[dict]) -> Table:
    """most_preempted.sql's rows; the swaps, recomputed and finish columns only where they say something."""
    swaps = any(r["swaps"] for r in rows)
    recomputed = any(r["recomputed_tokens"] for r in rows)
    finish = any(r["finish_reason"] not in ("stop", "length") for r in rows)
    columns = [("request", "left"), ("preempted", "right")] + [("swaps", "right")] * swaps + [
        ("stalled", "right"), ("of E2E", "right")] + [("recomputed", "right")] * recomputed + [
        ("E2E", "right")] + [("finish", "left")] * finish
    table = Table(box=None, padding=(0, 1), header_style="bold", show_edge=False, pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for row in rows:
        cells = [row["req_id"] + (f"/{row['sample']}" if row["sample"] else ""), f"{row['preemptions']}×"]
        cells += [str(row["swaps"])] * swaps
        cells += [fmt_ms(row["stall_ms"]), fmt_share(row["stall_share"])]
        cells += [fmt_num(row["recomputed_tokens"], "tok")] * recomputed
        cells += [fmt_ms(row["e2el_ms"])] + [row["finish_reason"] or "–"] * finish
        table.add_row(*cells)
    if not rows:
        table.add_row("none preempted", *[""] * (len(columns) - 1))
    return table


def noisy_neighbours(rows: list[dict]) -> Table:
    """noisy_neighbours.sql's rows: whose growth preempted others, and what it cost them."""
    recomputed = any(r["recomputed_tokens"] for r in rows)
    # short headers: the table shares the left column (about 60 wide at 120) with the key figures
    columns = [("request", "left"), ("preempts", "right"), ("victims", "right"), ("KV lost", "right")] + [
        ("recomputed", "right")] * recomputed + [("waited", "right")]
    table = Table(box=None, padding=(0, 1), header_style="bold", show_edge=False, pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for row in rows:
        cells = [row["req_id"] + (f"/{row['sample']}" if row["sample"] else ""), f"{row['preemptions']}×",
                 str(row["victims"]), fmt_num(row["positions_lost"], "tok")]
        cells += [fmt_num(row["recomputed_tokens"], "tok")] * recomputed
        cells += [fmt_ms(row["victims_wait_ms"])]
        table.add_row(*cells)
    return table


def noisy_title(rows: list[dict]) -> str:
    """The worst requester in a few words, for the most preempted table's title where there is no
    room for the noisy neighbours' own table (stacked: one run fits 80 x 24)."""
    top = rows[0]
    name = top["req_id"] + (f"/{top['sample']}" if top["sample"] else "")
    return (f"most preempted · noisiest: {name} preempted {top['preemptions']}× "
            f"({fmt_num(top['positions_lost'], 'tok')} of others' KV)")


def _title(text: str) -> Rule:
    return Rule(Text(text, "bold"), align="left", style="dim")


def _columns(width: int) -> tuple[int, int]:
    """Widths of the dashboard's left and right columns (the same one below 120 columns)."""
    if width < TWO_COLUMNS_WIDTH:
        return width, width
    return width // 2, width - width // 2 - 1


def strip_width(width: int) -> int:
    """Intervals of the pool timeline that fit the dashboard at `width` columns."""
    return max(_columns(width)[1] - 6, 10)


def default_top(width: int) -> int:
    """Most preempted requests listed: 3 where the dashboard is stacked (80 × 24 fits), else 5."""
    return 3 if width < TWO_COLUMNS_WIDTH else 5


def render_run(fig: dict, width: int, params: dict) -> RenderableType:
    """The dashboard of one run: stacked below 120 columns, in two columns from there."""
    left, right = _columns(width)
    full = params.get("pool_timeline", {}).get("full_pool_frac")
    full_steps = fmt_share(fig["thrash"].get("full_pool_step_share"))
    title = f"KV pool used · red: ≥{fmt_share(full)} full ({full_steps} of steps)"
    if fig["summary"].get("preemptions"):
        swap = fig["run"]["preemption_mode"] == "swap"
        legends = [" · ▼ swap preemption", " · ▼ swap"] if swap else [" · ▲ preemption", " · ▲ preempt"]
        for legend in legends:
            if len(title + legend) <= right - 4:
                title += legend
                break
    servers = fig.get("servers") or []
    several = len(servers) > 1
    pool = Group(_title(title), *(server_strips(fig["pool_timeline"], servers) if several
                                  else [pool_strip(fig["pool_timeline"])]))
    itl = fig["latency"].get("itl")
    itl_title = f"ITL: {fmt_num(itl['num_values'])} gaps (log scale)" if itl else "ITL"
    half = (right - 2) // 2
    if half >= 36:   # percentiles and causes side by side
        latency = Table.grid(padding=(0, 2))
        latency.add_column(width=half)
        latency.add_column(width=right - 2 - half)
        latency.add_row(_title(itl_title), _title(tail_title(fig["itl_tail"], right - 2 - half)))
        latency.add_row(itl_ladder(itl, half - 22), tail_causes(fig["itl_tail"], min(right - 2 - half, 48)))
    else:
        latency = Group(_title(itl_title), itl_ladder(itl, min(right - 20, 24)),
                        _title(tail_title(fig["itl_tail"], right)), tail_causes(fig["itl_tail"], min(right, 48)))
    figures = Group(key_figures(fig["summary"], fig["thrash"], left, fig.get("spec_decode"), fig.get("tiers") or ()),
                    thrash_verdict(fig["thrash"]),
                    *(thrash_verdict(s, s["server"]) for s in servers if several))
    noisy = fig.get("noisy_neighbours") or []
    if width < TWO_COLUMNS_WIDTH:
        title = noisy_title(noisy) if noisy else "most preempted"
        preempted = Group(_title(title if len(title) <= width - 4 else "most preempted"),
                          most_preempted(fig["most_preempted"]))
        return Group(header(fig["run"], fig["summary"], servers, fig.get("kv_groups")), figures, pool, latency,
                     preempted)
    preempted = Group(_title("most preempted"), most_preempted(fig["most_preempted"]))
    if noisy:   # beside the victims, their requesters (schema 3 records them)
        preempted = Group(preempted, _title("noisy neighbours: whose growth preempted others"),
                          noisy_neighbours(noisy))
    head = header(fig["run"], fig["summary"], servers, fig.get("kv_groups"))
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=left)
    grid.add_column(width=right)
    grid.add_row(Group(_title("key figures"), figures, preempted), Group(pool, latency))
    return Group(head, grid)


# --------------------------------------------------------------------------- several runs

def compare_table(figs: list[dict]) -> Table:
    """The key figures of several runs, one column per run."""
    table = Table(box=None, padding=(0, 1), header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("", no_wrap=True)
    for fig in figs:
        table.add_column(Text(fig["run"]["run_id"]), justify="right", no_wrap=True)

    def row(label: str, cell) -> None:
        table.add_row(Text(label, "bold"), *(cell(fig) for fig in figs))

    row("status", lambda f: f["run"]["status"] or "?")
    row("model", lambda f: f"{f['run']['model']} {f['run']['dtype'] or ''}".strip())
    row("device", lambda f: f["run"]["device"] or "?")
    row("workload", lambda f: _workload(f["run"]) + _replay(f["run"]))
    row("KV pool", lambda f: f"{f['run']['num_gpu_blocks']} × {f['run']['block_size']} tok"
                             + (f", host {f['run']['num_cpu_blocks']}" if f["run"].get("num_cpu_blocks") else ""))
    row("preemption", lambda f: f"{f['run']['preemption_mode']}/{f['run']['preemption_policy']}")
    row("duration", lambda f: fmt_seconds(f["summary"].get("duration_s")))
    row("output", lambda f: fmt_num(f["summary"].get("output_tok_s"), "tok/s"))
    row("requests", lambda f: fmt_num(f["summary"].get("request_throughput"), "req/s"))
    row("goodput", lambda f: f"{fmt_num(f['summary'].get('goodput_req_s'), 'req/s')} "
                             f"({fmt_share(f['summary'].get('good_share'))})")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        name = {"e2el": "E2E"}.get(metric, metric.upper())
        for q in ("p50", "p99"):
            row(f"{name} {q}", lambda f, k=f"{metric}_{q}_ms": fmt_ms(f["summary"].get(k)))
    row("preemptions", lambda f: fmt_num(f["summary"].get("preemptions")))
    row("recomputed", lambda f: f"{fmt_num(f['summary'].get('recomputed_tokens'), 'tok')} "
                                f"({fmt_share(f['summary'].get('recompute_share'))})")
    row("swapped out/in", lambda f: f"{fmt_bytes(f['summary'].get('swap_out_bytes'))} / "
                                    f"{fmt_bytes(f['summary'].get('swap_in_bytes'))}"
        if f["summary"].get("swap_out_bytes") or f["summary"].get("swap_in_bytes") else "none")
    row("swap rate", lambda f: fmt_num(f["summary"].get("swap_gb_s"), "GB/s"))
    if any(f.get("tiers") for f in figs):   # a run with a KV tier
        row("KV tier", lambda f: " · ".join(f"{t['tier']} {tier_text(t)}" for t in f["tiers"]) or "none")
    row("thrash", lambda f: Text((f["thrash"].get("verdict") or "?"),
                                 VERDICT_STYLE.get(f["thrash"].get("verdict"), "")))
    if any(len(f.get("servers") or ()) > 1 for f in figs):   # runs joined from several servers
        row("servers", lambda f: " ".join(f"{s['server'] or '1'} {s['verdict']}" for s in f.get("servers") or ()))
    row("peak preempt/s", lambda f: fmt_num(f["thrash"].get("peak_preempt_per_s")))
    row("useful tok/s", lambda f: fmt_num(f["thrash"].get("useful_tok_s")))
    row("ITL tail cause", lambda f: _top_cause(f["itl_tail"]))
    row("most preempted", lambda f: _worst(f["most_preempted"]))
    return table


def _top_cause(rows: list[dict]) -> str:
    with_cliffs = [r for r in rows if r["cliffs"]]
    if not with_cliffs:
        return "no cliffs"
    top = max(with_cliffs, key=lambda r: r["tail_ms"])
    return f"{CAUSES.get(top['cause'], top['cause'])} {fmt_share(top['tail_share'])}"


def _worst(rows: list[dict]) -> str:
    if not rows:
        return "–"
    row = rows[0]
    return f"{row['req_id']}: {row['preemptions']}×, {fmt_ms(row['stall_ms'])}"


def render_compare(figs: list[dict], width: int) -> RenderableType:
    """Several runs: their figures side by side (runs as columns), then each run's pool strip."""
    strips: list[RenderableType] = [_title("KV pool used (each run on its own clock) · ▲ preemption, ▼ by swap")]
    for fig in figs:
        servers = fig.get("servers") or []
        if len(servers) > 1:
            for s in servers:
                strips += [Text(f"{fig['run']['run_id']} · {s['server']}", "bold"),
                           pool_strip([r for r in fig["pool_timeline"] if r["server"] == s["server"]])]
        else:
            strips += [Text(fig["run"]["run_id"], "bold"), pool_strip(fig["pool_timeline"])]
    table = Group(_title(f"{len(figs)} runs"), compare_table(figs))
    if width < TWO_COLUMNS_WIDTH:
        return Group(table, *strips)
    left, right = _columns(width)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=left)
    grid.add_column(width=right)
    grid.add_row(table, Group(*strips))
    return grid


def render(data: dict, width: int) -> RenderableType:
    """`collect()`'s figures laid out for `width` columns: one run's dashboard, or a comparison."""
    figs = data["runs"]
    if len(figs) == 1:
        return render_run(figs[0], width, data["params"])
    return render_compare(figs, width)


def view(runs: list[str], params: dict[str, str], width: int, top: int | None = None,
         buckets: int | None = None) -> RenderableType:
    """The dashboard of `runs` laid out for `width` columns (`kvtrace analyze`)."""
    data = collect(db.connect(runs), params=params, buckets=buckets or strip_width(width),
                   top=top or default_top(width))
    return render(data, width)
