"""Where a suite's results go. A run prints its report as it goes, appends it in full to the month's log
(benchmarks/log/YYYY-MM.md, newest last) and rewrites its own section of RESULTS.md: the latest
headline figure with its command, date, commit and load, and a table of the last few.

Each suite's section of RESULTS.md is the text between `<!-- suite:NAME -->` and
`<!-- /suite:NAME -->`; a run rewrites that block and nothing else, so the page's prose (each suite's
goal, the introduction) stays as it was written. The block it writes:

    <!-- suite:NAME -->
    Latest: **HEADLINE**

    `COMMAND` · DATE UTC · commit COMMIT · load START → END · full report: [log/YYYY-MM.md](log/YYYY-MM.md)

    | date (UTC) | commit | figure | load |      the last HISTORY runs, newest first
    |---|---|---|---|
    | DATE | COMMIT | HEADLINE | START → END |
    <!-- /suite:NAME -->
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.machine import (
    describe_machine,
    describe_software,
    git_revision,
    load_average,
)
from kvtrace.atomic import atomic_write

BENCHMARKS = Path(__file__).resolve().parent
RESULTS_MD = BENCHMARKS / "RESULTS.md"
LOG_DIR = BENCHMARKS / "log"
HISTORY = 3          # runs kept in each suite's table on RESULTS.md (older ones: the log)
TABLE_HEADER = "| date (UTC) | commit | figure | load |\n|---|---|---|---|"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Entry:
    """One run of a suite, as its section of RESULTS.md shows it."""
    suite: str
    started: datetime         # UTC
    command: str              # `python -m benchmarks SUITE ...`, as typed
    commit: str               # short hash, '+changes' when the tree differed from it
    load_at_start: str        # 1-minute load averages
    load_at_end: str
    headline: str             # one line: the suite's figure and whether it met its goal
    log_link: str             # the log file, relative to RESULTS.md's folder

    @property
    def date(self) -> str:
        return f"{self.started:%Y-%m-%d %H:%M}"

    @property
    def load(self) -> str:
        return f"{self.load_at_start} → {self.load_at_end}"

    def table_row(self) -> str:
        # a '|' inside a cell would end it: the figure is the only free text
        return f"| {self.date} | {self.commit} | {self.headline.replace('|', '/')} | {self.load} |"


def _markers(suite: str) -> tuple[str, str]:
    return f"<!-- suite:{suite} -->", f"<!-- /suite:{suite} -->"


def section_block(page: str, suite: str) -> str | None:
    """The text between `suite`'s markers (without them), or None when the page has no such section."""
    begin, end = _markers(suite)
    found = re.findall(re.escape(begin) + r"\n(.*?)" + re.escape(end), page, flags=re.DOTALL)
    if len(found) > 1:
        raise ValueError(f"RESULTS.md has {len(found)} sections marked {begin}")
    return found[0] if found else None


def table_rows(block: str) -> list[str]:
    """The history table's rows in a section, as written (header and separator left out)."""
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return rows[2:] if rows[:1] == [TABLE_HEADER.splitlines()[0]] else rows


def render_block(entry: Entry, rows: list[str]) -> str:
    return (f"Latest: **{entry.headline}**\n\n"
            f"`{entry.command}` · {entry.date} UTC · commit {entry.commit} · load {entry.load} · "
            f"full report: [{entry.log_link}]({entry.log_link})\n\n"
            + TABLE_HEADER + "\n" + "\n".join(rows) + "\n")


def update_page(page: str, entry: Entry, history: int = HISTORY) -> str:
    """`page` with `entry.suite`'s section rewritten to show `entry` first and at most `history` runs in
    its table; the rest of the page is returned as it was. A page without the suite's section gets one
    at its end. Applying the same entry twice gives the page of applying it once."""
    begin, end = _markers(entry.suite)
    block = section_block(page, entry.suite)
    new_row = entry.table_row()
    if block is None:
        old_rows: list[str] = []
        page = page.rstrip("\n") + f"\n\n## {entry.suite}\n\n{begin}\n{end}\n"
    else:
        old_rows = [row for row in table_rows(block) if row != new_row]
    rows = [new_row] + old_rows[:history - 1]
    whole = f"{begin}\n{block if block is not None else ''}{end}"
    return page.replace(whole, f"{begin}\n{render_block(entry, rows)}{end}", 1)


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
                      " ".join(headline.split()), log.relative_to(results_md.parent).as_posix()
                      if log.is_relative_to(results_md.parent) else str(log))
        software = describe_software(self.commit) + (f"; {self.peer_software}" if self.peer_software else "")
        head = [
            f"## {entry.date} UTC — {self.suite}",
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
        print(f"appended to {log}; {results_md.name}: section {self.suite} updated")
