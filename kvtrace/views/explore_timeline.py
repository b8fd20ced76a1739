"""The explorer's text pictures (Rich, no Textual): one request's timeline against the pool's
occupancy, and the legend of its states. They lay out rows of request_pool.sql; they compute
nothing. At 80 columns the timeline is 60 intervals wide:

    state ▕·····▒▒▒████░░░░░▓▓█████████       waiting · prefill ▒ decode █ ...
    pool  ▕▅▆▇██▇▆▅▅▆▇██▇▆▅▄▃▃▄▅▆▇▇▆▅▄▃▂
    preempt ▼          ▲ ▲                    ▼ its own, ▲ another's
          ╵+0ms         ╵+35ms        +70ms╵
"""
from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvtrace.views.dashboard import LEVELS, fmt_ms

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
