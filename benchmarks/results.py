"""Print a suite's table and append it, dated, with machine, software and command, to RESULTS.md."""
from __future__ import annotations

import shlex
import sys
from datetime import datetime
from pathlib import Path

from benchmarks.machine import describe_machine, describe_software, load_average

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class Section:
    """One dated section of RESULTS.md; the load average is taken when the suite starts and ends."""

    def __init__(self, suite: str, peer_software: str = "") -> None:
        self.suite = suite
        self.started = datetime.now()
        self.load_at_start = load_average()
        self.peer_software = peer_software
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        """A table or a paragraph; printed now and written with the section."""
        print("\n" + text + "\n", flush=True)
        self.parts.append(text)

    def write(self) -> None:
        command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        software = describe_software() + (f"; {self.peer_software}" if self.peer_software else "")
        head = [
            f"## {self.started:%Y-%m-%d %H:%M} — {self.suite}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {describe_machine()}; 1-min load average {self.load_at_start} at the start, "
            f"{load_average()} at the end (other workers share it)",
            f"- Software: {software}",
            "",
        ]
        text = "\n".join(head) + "\n" + "\n\n".join(self.parts) + "\n\n"
        if not RESULTS_MD.exists():
            RESULTS_MD.write_text("# Benchmark results\n\nAppended by `python -m benchmarks <suite>`, newest last. "
                                  "See README.md for what each suite measures.\n\n")
        with RESULTS_MD.open("a") as f:
            f.write(text)
        print(f"appended to {RESULTS_MD}")
