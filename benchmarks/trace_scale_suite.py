"""Suite `trace-scale`: how fast the analyses run on a big synthetic trace (benchmarks/trace_scale.py).

Options after the suite name and `--` go to trace_scale.py as they are, e.g.
`python -m benchmarks trace-scale -- --events 1e7 --events 1e8 --baseline /path/to/old/checkout`.
Its output is kept in RESULTS.md.
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
            trace_scale.main()
    finally:
        sys.argv = argv
    section.parts.append("```\n" + tee.kept.getvalue().rstrip() + "\n```")
    section.write()
    return 0
