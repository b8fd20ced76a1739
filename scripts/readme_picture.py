"""Draw the README's picture: the dashboard of the README's main command, as SVG.

    python scripts/readme_picture.py                   # replay the main command, draw its dashboard
    python scripts/readme_picture.py --modelled-clock  # the same under a model of a quiet 2-core machine
    python scripts/readme_picture.py --run RUN         # draw a run already recorded

The main command is read from README.md itself (the code line that runs `kvtrace record ... &&
kvtrace analyze ...`), so the picture is of the command the README tells a user to run. Its
`kvtrace record` runs as written but for `-o`: the run goes to traces/runs/readme-picture and
traces/runs/latest stays as it was. The dashboard, `kvtrace analyze` of that run at 120 columns
(its two-column layout), is exported by Rich as SVG to docs/img/dashboard.svg; the window's title
names the command, the model, the CPU, the date and the clock, because its figures are that
machine's on that day.

The replay keeps the workload's arrivals on the clock, so a busy machine, whose steps are slow,
queues and preempts far more than a quiet one. `--modelled-clock` replays it under
scripts/postmortem.py's model of smollm2-135m's steps on a quiet 2-core machine instead (the forward,
scheduler, block manager, trace and analyses stay real; docs/postmortem.md is written the same way);
with `--run`, it only says in the title that RUN was recorded so.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402

from kvtrace.views import dashboard  # noqa: E402

README = ROOT / "README.md"
OUT = ROOT / "docs" / "img" / "dashboard.svg"
RUN = ROOT / "traces" / "runs" / "readme-picture"
WIDTH = 120


class NoMainCommand(Exception):
    """README.md has no line that records a run and analyzes it."""


def main_command(readme: str) -> tuple[list[str], list[str]]:
    """The `kvtrace record` and `kvtrace analyze` words of the README's main command: the first line of
    a code block that runs both (joined by `&&`)."""
    code = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE))
    for line in code.splitlines():
        parts = [shlex.split(part) for part in line.split("&&")]
        record = [p for p in parts if p[:2] == ["kvtrace", "record"]]
        analyze = [p for p in parts if p[:2] == ["kvtrace", "analyze"]]
        if record and analyze:
            return record[0], analyze[0]
    raise NoMainCommand(f"no line of {README.name}'s code runs both `kvtrace record` and `kvtrace analyze`")


def without_output(words: list[str]) -> list[str]:
    """`kvtrace record` words without an -o/--out option (the picture's run goes elsewhere)."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("-o", "--out", "--output"):
            skip = True
        elif not word.startswith(("--out=", "--output=")):
            kept.append(word)
    return kept


def record(words: list[str], run: Path, modelled: bool = False) -> None:
    """Run the README's `kvtrace record` into `run`: as a user runs it (its own process), or in this
    process under scripts/postmortem.py's modelled clock."""
    args = ["record", *without_output(words)[2:], "-o", str(run), "-q"]
    print("$ kvtrace", shlex.join(args), "(under the modelled clock)" if modelled else "", flush=True)
    if not modelled:
        subprocess.run([sys.executable, "-m", "kvtrace", *args], cwd=ROOT, check=True)
        return
    spec = importlib.util.spec_from_file_location("postmortem", ROOT / "scripts" / "postmortem.py")
    postmortem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(postmortem)
    with contextlib.chdir(ROOT), postmortem.modelled_clock():
        postmortem.kvtrace(args)


def title(analyze: list[str], run: Path, modelled: bool = False) -> str:
    """The window's title: the command as the README gives it, on what and when its run was recorded,
    and by which clock."""
    meta = json.loads((run / "meta.json").read_text())
    device, model = meta.get("device", {}), meta.get("model", {})
    threads = device.get("threads")
    where = ", ".join(str(x) for x in (device.get("name"), threads and f"{threads} thread{'s' * (threads != 1)}",
                                       device.get("kernels")) if x)
    clock = "modelled clock" if modelled else "host clock"
    return f"{shlex.join(analyze)}  ·  {model.get('name', '?')} on {where}, {str(meta.get('started_at', ''))[:10]}, {clock}"


def draw(run: Path, heading: str, out: Path, width: int = WIDTH) -> str:
    """The dashboard of `run` at `width` columns as SVG, written to `out`; returns its text too."""
    console = Console(record=True, width=width, force_terminal=True, color_system="truecolor",
                      file=io.StringIO(), soft_wrap=False, legacy_windows=False)
    console.print(dashboard.view([str(run)], {}, width))
    text = console.export_text(clear=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(console.export_svg(title=heading))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="draw this recorded run instead of replaying the main command")
    parser.add_argument("--modelled-clock", action="store_true",
                        help="replay under a model of smollm2-135m's steps on a quiet 2-core machine (with --run: "
                             "say that RUN was recorded so)")
    parser.add_argument("--out", type=Path, default=OUT, help="the SVG to write")
    args = parser.parse_args(argv)
    record_words, analyze_words = main_command(README.read_text())
    run = args.run or RUN
    if args.run is None:
        record(record_words, run, args.modelled_clock)
    print(draw(run, title(analyze_words, run, args.modelled_clock), args.out))
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
