"""One request as the explorer shows it (Rich, no Textual): its story's phases as table rows
(kvtrace explain's story, kvtrace/views/explain.py), and its timeline against the pool's occupancy
with the legend of its states (request_pool.sql's rows). They lay out figures; they compute none.
At 80 columns the timeline is 70 intervals wide:

    state ▕·····▒▒▒████░░░░░▓▓█████████       waiting · prefill ▒ decode █ ...
    pool  ▕▅▆▇██▇▆▅▅▆▇██▇▆▅▄▃▃▄▅▆▇▇▆▅▄▃▂
    preempt ▼          ▲ ▲                    ▼ its own, ▲ another's
          ╵+0ms         ╵+35ms        +70ms╵
"""
from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvtrace.views.dashboard import LEVELS, fmt_ms, fmt_num

# state -> (glyph, style) on the timeline's state row
STATE_GLYPHS = {
    "waiting": ("·", "dim"),
    "prefill": ("▒", "cyan"),
    "decode": ("█", "green"),
    "preempted": ("░", "red"),
    "swapped": ("░", "magenta"),
    "reprefill": ("▓", "yellow"),
    "finished": (" ", ""),
}
LABEL_WIDTH = 8
MIN_CAUSE_SHARE = 0.01     # a wait's causes below this share of it are left out of its row
FULL_POOL_FRAC = 0.95      # pool_timeline.sql's default: a pool this full is drawn red


def legend(states: set[str] | None = None) -> Text:
    """The glyph of each state (those in `states`, all by default) on one line."""
    text = Text()
    for state, (glyph, style) in STATE_GLYPHS.items():
        if state == "finished" or (states is not None and state not in states):
            continue
        if text:
            text.append("  ")
        text.append(glyph, style)
        text.append(f" {state}")
    return text


def timeline(rows: list[dict]) -> Group:
    """request_pool.sql's rows as four lines: the sequence's state per interval, the pool's
    occupancy (eighth-blocks, red where full), the preemptions (▼ its own, ▲ another's) and a time
    axis from the sequence's arrival."""
    state, pool, marks = Text(), Text(), Text()
    for row in rows:
        glyph, style = STATE_GLYPHS.get(row["state"], ("?", ""))
        state.append(glyph, style)
        frac = row["used_frac"]
        if frac is None:
            pool.append(" ")
        else:
            pool.append(LEVELS[max(round(frac * 8), 1)], "red" if frac >= FULL_POOL_FRAC else "cyan")
        if row["own_preemptions"]:
            marks.append("▼", "bold red")
        elif row["preemptions"]:
            marks.append("▲", "yellow")
        else:
            marks.append(" ")

    def label(text: str) -> Text:
        return Text(text.ljust(LABEL_WIDTH - 1) + "▕", "bold")

    return Group(label("state") + state, label("pool") + pool, Text("preempt".ljust(LABEL_WIDTH), "bold") + marks,
                 Text(" " * LABEL_WIDTH) + axis(rows))


def axis(rows: list[dict]) -> Text:
    """The start, middle and end of the sequence's life, as times since its arrival."""
    width = len(rows)
    if not width:
        return Text()
    start, end = rows[0]["start_s"], rows[-1]["end_s"]
    line = [" "] * width
    first = "╵+0"
    line[:len(first)] = first
    last = "+" + fmt_ms((end - start) * 1000).replace(" ", "") + "╵"
    if len(last) + len(first) + 1 <= width:
        line[width - len(last):] = last
    middle = "╵+" + fmt_ms((end - start) * 500).replace(" ", "")
    pos = width // 2
    if all(c == " " for c in line[pos - 1:pos + len(middle) + 1]):
        line[pos:pos + len(middle)] = middle
    return Text("".join(line), "dim")


def seq_name(req_id: str, sample: int | None) -> str:
    """A sequence as the dashboard names it: the request, /sample for samples after the first."""
    return req_id + (f"/{sample}" if sample else "")


def causes(wait: dict | None, top: int = 3) -> str:
    """A wait's causes by share of its time: "blocks 89% · preemption 11%"."""
    if wait is None:
        return ""
    shown = [c for c in wait["causes"] if c["share"] is not None and c["share"] >= MIN_CAUSE_SHARE][:top]
    return " · ".join(f"{c['cause']} {c['share'] * 100:.0f}%" for c in shown)


def phase_rows(story: dict) -> list[dict]:
    """The story's phases as the request screen's rows: phase, start (from the arrival), duration,
    its first step, what it was in words (a wait: its causes; a preemption: its requester, the policy's
    reason and the positions lost; a re-prefill: what was computed again) and where Enter and g
    go (`step`, `requester`: (req_id, sample) or None)."""
    arrival = story["phases"][0]["start_s"] if story["phases"] else 0.0
    waits = {(w["state"], w["start_s"]): w for w in story["waits"]}
    preemptions = {p["preemption_no"]: p for p in story["preemptions"]}
    rows, last_preemption = [], None
    for phase in story["phases"]:
        state, note, requester = phase["phase"], "", None
        wait = waits.get((state, phase["start_s"]))
        if state == "waiting":
            note = causes(wait)
        elif state in ("preempted", "swapped"):
            p = last_preemption = preemptions.get(phase["preemption_no"])
            if p is not None:
                kept = "swapped out" if p["reason"] == "swap" else "lost"
                what = f"{fmt_num(p['positions_lost'])} {kept}"
                if p["requester_req_id"] is None:      # a trace before schema 3
                    note = f"preempted: {what}"
                else:
                    requester = (p["requester_req_id"], p["requester_sample"] or 0)
                    who = "itself" if p["self_preempted"] else seq_name(*requester)
                    note = f"for {who} ({p['victim_reason'] or '?'}), {what}"
                top = causes(wait, top=1)
                note += f" · {top}" if top else ""
        elif state == "reprefill" and last_preemption is not None:
            note = (f"{fmt_num(last_preemption['recomputed_tokens'])} recomputed, "
                    f"{fmt_num(last_preemption['cached_tokens'])} from the cache")
        elif state == "finished":
            note = phase["finish_reason"] or ""
        rows.append({"phase": state, "from": "+" + fmt_ms((phase["start_s"] - arrival) * 1000),
                     "for": "" if state == "finished" else fmt_ms(phase["duration_ms"]),
                     "steps": "" if phase["first_step"] is None else str(phase["first_step"]),
                     "note": note, "step": phase["first_step"], "start_s": phase["start_s"],
                     "requester": requester})
    return rows
