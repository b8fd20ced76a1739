"""The first lines of `kvtrace compare`: what changed between a baseline run and each other run.

    what changed: fix against thrash (max_num_seqs 64 → 8)
      thrash       SUSTAINED → none
      preemptions  212 → 0                     −100%
      recomputed   31% → 0.0% of compute       −31 points
      goodput      0.4 → 1.1 req/s             2.8× higher · 21% → 62% in SLO
      ITL p99      2.41 s → 48.0 ms            50× lower

The figures are summary.sql's columns; this module only says which way is better and how much
they moved. The settings line is the difference of the runs' engine configs (meta.json).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pyarrow as pa
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvtrace.views.dashboard import VERDICT_STYLE, fmt_ms, fmt_num, fmt_share, tier_text

if TYPE_CHECKING:   # duckdb is imported where a connection is made: not by every command's start-up
    import duckdb

VERDICT_ORDER = {"none": 0, "occasional": 1, "sustained": 2}
# (summary.sql column, label, True when a higher value is better)
FIGURES = [("preemptions", "preemptions", False), ("recompute_share", "recomputed", False),
           ("goodput_req_s", "goodput", True), ("itl_p99_ms", "ITL p99", False)]


def settings_changed(con: duckdb.DuckDBPyConnection) -> dict[str, dict[str, object]]:
    """Per run after the first: the engine settings (and replay) that differ from the first run's,
    as {name: [baseline value, value]}."""
    rows = con.sql("SELECT run_id, meta_json FROM runs ORDER BY ordinal").fetchall()

    def settings(meta_json: str) -> dict:
        meta = json.loads(meta_json)
        config = dict(meta.get("engine_config") or {})
        replay = meta.get("replay") or {}
        config.update({f"replay {k}": v for k, v in replay.items() if k in ("mode", "time_scale")})
        return config

    base = settings(rows[0][1])
    changed = {}
    for run_id, meta_json in rows[1:]:
        other = settings(meta_json)
        changed[run_id] = {k: [base.get(k), other.get(k)] for k in sorted(set(base) | set(other))
                           if base.get(k) != other.get(k)}
    return changed


def headline(summary: pa.Table, settings: dict[str, dict[str, object]],
             tiers: dict[str, list[dict]] | None = None) -> list[dict]:
    """Per run after the first: its settings changes and, per figure, the baseline's value, its
    value and whether it moved the better way (None when it did not move or a value is missing).
    `tiers`: each run's KV tiers (dashboard.tier_rows); where either run of a pair has one, the
    positions the tiers gave back (more is better: each one not computed again) and each side's tiers."""
    rows = summary.to_pylist()
    base = rows[0]
    tiers = tiers or {}
    result = []
    for row in rows[1:]:
        figures = {"thrash_verdict": {"base": base["thrash_verdict"], "value": row["thrash_verdict"],
                                      "better": _better(VERDICT_ORDER.get(base["thrash_verdict"]),
                                                        VERDICT_ORDER.get(row["thrash_verdict"]), False)}}
        for column, _, higher_better in FIGURES:
            figures[column] = {"base": base[column], "value": row[column],
                               "better": _better(base[column], row[column], higher_better)}
        figures["good_share"] = {"base": base["good_share"], "value": row["good_share"],
                                 "better": _better(base["good_share"], row["good_share"], True)}
        base_tiers, its_tiers = tiers.get(base["run_id"], []), tiers.get(row["run_id"], [])
        if base_tiers or its_tiers:   # a KV tier on either side
            back = [sum(t.get("tier_hit_tokens") or 0 for t in side) if side else None
                    for side in (base_tiers, its_tiers)]
            figures["tier_hit_tokens"] = {"base": back[0], "value": back[1], "better": _better(*back, True),
                                          "base_tiers": base_tiers, "tiers": its_tiers}
        result.append({"run_id": row["run_id"], "baseline": base["run_id"],
                       "settings": settings.get(row["run_id"], {}), "figures": figures})
    return result


def _better(base: float | None, value: float | None, higher_better: bool) -> bool | None:
    if base is None or value is None or base == value:
        return None
    return (value > base) == higher_better


# --------------------------------------------------------------------------- text

def _tiers(tiers: list[dict]) -> str:
    """A run's KV tiers in a line each's name and figures (dashboard.tier_text); none: '–'."""
    return "; ".join(f"{t['tier']} {tier_text(t)}" for t in tiers) or "–"


# the engine settings that are sizes in bytes (engine/config.py), said in GiB
BYTE_SETTINGS = frozenset(["offload_size", "kv_cache_memory", "swap_space"])


def _setting(value: object, name: str = "") -> str:
    if value is None:
        return "–"
    if name in BYTE_SETTINGS and isinstance(value, int) and value >= 2**20:
        return f"{value / 2**30:.3g} GiB"
    return str(value)


def _factor(base: float, value: float) -> str:
    """How much a figure moved: a factor from 2× on, else a percentage."""
    if value == base:
        return "unchanged"
    if base > 0 and value > 0 and max(base, value) / min(base, value) >= 2:
        ratio = max(base, value) / min(base, value)
        return f"{ratio:.1f}× {'higher' if value > base else 'lower'}" if ratio < 10 else \
            f"{ratio:.0f}× {'higher' if value > base else 'lower'}"
    if base:
        return f"{(value - base) / abs(base) * 100:+.0f}%".replace("-", "−")
    return ""


def _styled(text: str, better: bool | None) -> Text:
    return Text(text, "" if better is None else "green" if better else "red")


def render(changes: list[dict]) -> RenderableType:
    """The headline of each run against the baseline, a few lines each."""
    blocks: list[RenderableType] = []
    for change in changes:
        fig = change["figures"]
        title = Text("what changed: ", "bold").append(f"{change['run_id']} against {change['baseline']}")
        if change["settings"]:
            moves = ", ".join(f"{k} {_setting(a, k)} → {_setting(b, k)}" for k, (a, b) in change["settings"].items())
            title.append(f" ({moves})", "dim")
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        verdict = fig["thrash_verdict"]
        table.add_row("thrash", Text(f"{(verdict['base'] or '?').upper()} → ")
                      .append((verdict["value"] or "?").upper(), VERDICT_STYLE.get(verdict["value"], "")), "")
        p = fig["preemptions"]
        table.add_row("preemptions", f"{fmt_num(p['base'])} → {fmt_num(p['value'])}",
                      _styled(_factor(p["base"] or 0, p["value"] or 0), p["better"]))
        r = fig["recompute_share"]
        points = ((r["value"] or 0) - (r["base"] or 0)) * 100
        table.add_row("recomputed", f"{fmt_share(r['base'])} → {fmt_share(r['value'])} of compute",
                      _styled(f"{points:+.0f} points".replace("-", "−") if abs(points) >= 0.5 else "", r["better"]))
        g, s = fig["goodput_req_s"], fig["good_share"]
        table.add_row("goodput", f"{fmt_num(g['base'])} → {fmt_num(g['value'], 'req/s')}",
                      _styled(" · ".join(filter(None, [_factor(g["base"] or 0, g["value"] or 0),
                                                       f"{fmt_share(s['base'])} → {fmt_share(s['value'])} in SLO"])),
                              g["better"]))
        i = fig["itl_p99_ms"]
        table.add_row("ITL p99", f"{fmt_ms(i['base'])} → {fmt_ms(i['value'])}",
                      _styled(_factor(i["base"] or 0, i["value"] or 0) if i["base"] and i["value"] else "",
                              i["better"]))
        if "tier_hit_tokens" in fig:   # what the KV tiers held on each side
            t = fig["tier_hit_tokens"]
            table.add_row("KV tiers", f"{_tiers(t['base_tiers'])} → {_tiers(t['tiers'])}",
                          _styled(_factor(t["base"] or 0, t["value"] or 0), t["better"]))
        blocks += [title, table, Text()]
    return Group(*blocks)
