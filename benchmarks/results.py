"""Where a suite's results go. A run prints its report as it goes, appends it in full to the month's log
(benchmarks/log/YYYY-MM.md, newest last) and rewrites its own row of RESULTS.md's one table: the
latest headline figure with its date, commit and machine.

RESULTS.md has one table, one row per figure:

    | what | goal | latest figure | date (UTC) | commit | machine |
    |---|---|---|---|---|---|
    | `SUITE`: WHAT | GOAL | HEADLINE | [DATE](log/YYYY-MM.md#ANCHOR) | COMMIT | MACHINE; load START → END |

A suite's row is the one whose first cell opens with the suite's name in backticks. A run rewrites
that row's last four cells and nothing else: the first two (what the suite measures, its goal), the
other rows (figures no suite writes: the mutation check, the GPU's) and the prose around the table
stay as they were written. The date links to the run's full report in the log; the older runs are
only there. A suite without a row gets one at the end of the table.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.machine import (
    describe_machine,
    describe_software,
    git_revision,
    load_average,
    machine_cell,
)
from kvtrace.atomic import atomic_write

BENCHMARKS = Path(__file__).resolve().parent
RESULTS_MD = BENCHMARKS / "RESULTS.md"
LOG_DIR = BENCHMARKS / "log"
COLUMNS = ("what", "goal", "latest figure", "date (UTC)", "commit", "machine")
TABLE_HEADER = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def anchor(heading: str) -> str:
    """The fragment a Markdown renderer (GitHub's rule) gives a heading: lower case, every character
    but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)        # a link: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def headings(markdown: str) -> list[tuple[int, int, str]]:
    """(line index, level, anchor) of a page's headings in order; a heading's second namesake gets the
    anchor '-1', its third '-2' (GitHub's rule). Lines inside fenced code blocks are not headings."""
    found: list[tuple[int, int, str]] = []
    seen: dict[str, int] = {}
    fenced = False
    for i, line in enumerate(markdown.splitlines()):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"(#{1,6}) +(.*?)(?: +#+)? *$", line)
        if match:
            slug = anchor(match.group(2))
            found.append((i, len(match.group(1)), slug if slug not in seen else f"{slug}-{seen[slug]}"))
            seen[slug] = seen.get(slug, 0) + 1
    return found


def heading_anchors(markdown: str) -> list[str]:
    """The anchors of a page's headings, in order (`headings`)."""
    return [slug for _, _, slug in headings(markdown)]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One run of a suite, as its row of RESULTS.md shows it."""
    suite: str
    started: datetime         # UTC
    command: str              # `python -m benchmarks SUITE ...`, as typed
    commit: str               # short hash, '+changes' when the tree differed from it
    load_at_start: str        # 1-minute load averages
    load_at_end: str
    headline: str             # one line: the suite's figure and whether it met its goal
    log_link: str             # the run's report: the log file relative to RESULTS.md's folder, '#', its anchor
    machine: str = ""         # machine_cell(): the CPU and its cores

    @property
    def date(self) -> str:
        return f"{self.started:%Y-%m-%d %H:%M}"

    @property
    def load(self) -> str:
        return f"{self.load_at_start} → {self.load_at_end}"

    @property
    def log_heading(self) -> str:
        """The heading of the run's report in the log (without its '## ')."""
        return f"{self.date} UTC — {self.suite}"

    def cells(self) -> list[str]:
        """The row's last four cells: latest figure, date (linked to the run's report), commit, machine.
        A '|' inside a cell would end it: the figure is the only free text."""
        machine = f"{self.machine}; load {self.load}" if self.machine else f"load {self.load}"
        return [self.headline.replace("|", "/"), f"[{self.date}]({self.log_link})", self.commit, machine]


def split_row(line: str) -> list[str]:
    """A table line's cells, stripped ('\\|' inside a cell does not split it)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def join_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def suite_of(line: str) -> str | None:
    """The suite a table row belongs to: the name in backticks its first cell opens with, if any."""
    match = re.match(r"\|\s*`([^`]+)`", line)
    return match.group(1) if match else None


def table_span(lines: list[str]) -> tuple[int, int] | None:
    """(index of the header line, index past the table's last row), or None when the page has no table."""
    header = TABLE_HEADER.splitlines()[0]
    starts = [i for i, line in enumerate(lines) if line.strip() == header]
    if len(starts) > 1:
        raise ValueError(f"RESULTS.md has {len(starts)} results tables")
    if not starts:
        return None
    end = starts[0] + 2
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return starts[0], end


def row_of(page: str, suite: str) -> list[str] | None:
    """The cells of `suite`'s row, or None when the page has none."""
    lines = page.splitlines()
    span = table_span(lines)
    rows = [line for line in lines[span[0] + 2:span[1]] if suite_of(line) == suite] if span else []
    if len(rows) > 1:
        raise ValueError(f"RESULTS.md has {len(rows)} rows for suite {suite}")
    return split_row(rows[0]) if rows else None


def update_page(page: str, entry: Entry) -> str:
    """`page` with `entry.suite`'s row showing `entry`; the rest of the page is returned as it was. A
    page without the suite's row gets one at the end of its table (a page without the table, the table
    at its end). Applying the same entry twice gives the page of applying it once."""
    row_of(page, entry.suite)                       # refuses a page with two rows for the suite
    lines = page.splitlines()
    span = table_span(lines)
    if span is None:
        lines += ["", *TABLE_HEADER.splitlines()]
        span = (len(lines) - 2, len(lines))
    start, end = span
    for i in range(start + 2, end):
        if suite_of(lines[i]) == entry.suite:
            what, goal = (split_row(lines[i]) + ["", ""])[:2]
            lines[i] = join_row([what, goal, *entry.cells()])
            break
    else:
        lines.insert(end, join_row([f"`{entry.suite}`", "", *entry.cells()]))
    return "\n".join(lines) + "\n"


def log_path(log_dir: Path, started: datetime) -> Path:
    """The month's log: one file a month keeps each file readable and each run's diff an append."""
    return log_dir / f"{started:%Y-%m}.md"


class Section:
    """One run's report. The commit and the load average are taken when the suite starts; the load
    again when it ends."""

    def __init__(self, suite: str, peer_software: str = "") -> None:
        self.suite = suite
        self.started = datetime.now(timezone.utc)
        self.commit = git_revision()
        self.load_at_start = load_average()
        self.peer_software = peer_software
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        """A table or a paragraph; printed now and written with the section."""
        print("\n" + text + "\n", flush=True)
        self.parts.append(text)

    def write(self, headline: str, *, results_md: Path | None = None, log_dir: Path | None = None,
              argv: list[str] | None = None) -> None:
        """Append the report to the month's log and put `headline` (one line: the suite's figure,
        derived from what it measured, and its goal) on RESULTS.md."""
        results_md = results_md or RESULTS_MD
        log_dir = log_dir or LOG_DIR
        command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        load_at_end = load_average()
        log = log_path(log_dir, self.started)
        entry = Entry(self.suite, self.started, command, self.commit, self.load_at_start, load_at_end,
                      " ".join(headline.split()), "", machine_cell())
        # the anchor the report's heading will have once appended (a namesake above it adds '-N')
        fragment = heading_anchors((log.read_text() if log.exists() else "") + f"\n## {entry.log_heading}\n")[-1]
        relative = log.relative_to(results_md.parent).as_posix() if log.is_relative_to(results_md.parent) else str(log)
        entry = dataclasses.replace(entry, log_link=f"{relative}#{fragment}")
        software = describe_software(self.commit) + (f"; {self.peer_software}" if self.peer_software else "")
        head = [
            f"## {entry.log_heading}",
            "",
            f"- Command: `{command}`",
            f"- Headline: {entry.headline}",
            (f"- Machine: {describe_machine()}; 1-min load average {self.load_at_start} at the start, "
             f"{load_at_end} at the end (other workers share it)"),
            f"- Software: {software}",
            "",
        ]
        log_dir.mkdir(parents=True, exist_ok=True)
        if not log.exists():
            log.write_text(f"# Benchmark log, {self.started:%Y-%m}\n\nEvery `python -m benchmarks SUITE` run of the "
                           "month, appended in full, newest last. The latest figure of each suite is on "
                           "[../RESULTS.md](../RESULTS.md).\n\n")
        with log.open("a") as f:
            f.write("\n".join(head) + "\n" + "\n\n".join(self.parts) + "\n\n")
        page = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
        with atomic_write(results_md) as f:
            f.write(update_page(page, entry))
        print(f"appended to {log}; {results_md.name}: the row of {self.suite} updated")
