"""Suite `trace-scale`: how fast the analyses run on a big synthetic trace (benchmarks/trace_scale.py).

Options after the suite name and `--` go to trace_scale.py as they are, e.g.
`python -m benchmarks trace-scale -- --events 1e7 --events 1e8 --baseline /path/to/old/checkout`.
Its output goes to the month's log in full; RESULTS.md gets the headline (`headline`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import sys

from benchmarks.results import Section


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("options", nargs=argparse.REMAINDER, help="passed to benchmarks/trace_scale.py")


class _Tee(io.TextIOBase):
    """Print as it comes and keep a copy."""

    def __init__(self, out) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.out.write(text)
        self.out.flush()
        return self.kept.write(text)


def headline(measured: list) -> str:
    """On the largest run: the dashboard's time, the slowest command and the highest peak RSS of the
    current code (trace_scale.main's results; a stopped or failed command is named as such)."""
    if not measured:
        return "no command measured"
    events = max(num_events for num_events, _, _ in measured)
    largest = [(label, result) for num_events, label, result in measured if num_events == events]
    failed = [label for label, result in largest if result.stopped or result.error]
    done = [(label, result) for label, result in largest if not (result.stopped or result.error)]
    parts = []
    dashboard = [result for label, result in done if label.startswith("analyze")]
    if dashboard:
        parts.append(f"`analyze` {dashboard[0].wall_s:.1f} s")
    if done:
        label, slowest = max(done, key=lambda item: item[1].wall_s)
        parts.append(f"slowest `{label}` {slowest.wall_s:.1f} s (cpu {slowest.cpu_s:.1f} s)")
        parts.append(f"peak RSS ≤ {max(result.peak_rss for _, result in done) / 2**30:.2f} GiB")
    if failed:
        parts.append("stopped or failed: " + ", ".join(f"`{label}`" for label in failed))
    return f"{events / 1e6:.1f} M events, {len(largest)} commands: " + "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("benchmarks.trace_scale") is None:
        print("trace-scale: benchmarks/trace_scale.py is missing (it is written separately); nothing to run")
        return 1
    from benchmarks import trace_scale

    section = Section("trace-scale")
    tee = _Tee(sys.stdout)
    argv = sys.argv
    options = args.options[1:] if args.options[:1] == ["--"] else args.options
    sys.argv = ["benchmarks/trace_scale.py", *options]
    try:
        with contextlib.redirect_stdout(tee):
            measured = trace_scale.main()
    finally:
        sys.argv = argv
    section.parts.append("```\n" + tee.kept.getvalue().rstrip() + "\n```")
    section.write(headline(measured))
    return 0
