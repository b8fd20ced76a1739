"""Every command's help reads as wrapped paragraphs at 80 and 120 columns: each paragraph of a
command's, a group's and an option's help appears whole, in one column, and no line of it ends
while the paragraph's next word would still have fitted (a line broken mid-sentence, as a
docstring's own line breaks gave: "the thrash verdict, the" / "KV pool over time").
"""
from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app

runner = CliRunner()
WIDTHS = (80, 120)
BORDER = "│"
# (command path, width) whose options' help is not checked, only the prose: none. `record`'s options
# come in panels (kvtrace/cli/record.py) so that no panel's names leave its help column too narrow.
OPTIONS_TOO_WIDE: set[tuple[tuple[str, ...], int]] = set()


def commands(command, path: tuple[str, ...] = ()) -> list:
    """(path, command) of the app and every command and group under it (Typer's own Click: duck-typed)."""
    found = [(path, command)]
    if hasattr(command, "commands"):
        for name, sub in sorted(command.commands.items()):
            if not sub.hidden:
                found += commands(sub, path + (name,))
    return found


COMMANDS = commands(typer.main.get_command(app))


def paragraphs(text: str | None) -> list[str]:
    """The help's paragraphs, whitespace-normalised (what `kvtrace.cli.app.paragraphs` leaves of them)."""
    text = (text or "").partition("\f")[0]
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def expected(command, options: bool = True) -> list[str]:
    """What its --help must show whole: its help, each subcommand's first paragraph, each parameter's help."""
    texts = paragraphs(command.help)
    if hasattr(command, "commands"):
        texts += [paragraphs(sub.short_help or sub.help)[0] for sub in command.commands.values()
                  if not sub.hidden and (sub.short_help or sub.help)]
    for param in command.params if options else ():
        if not getattr(param, "hidden", False):
            texts += paragraphs(getattr(param, "help", None))
    return texts


def render(path: tuple[str, ...], width: int) -> list[str]:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(width), "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\x1b\[[0-9;]*m", "", result.output).splitlines()


def cell(line: str, x: int, width: int) -> tuple[str, int]:
    """The text of `line` from column x to its cell's end, and the room the cell had from x: inside a
    panel up to the right border less its padding, in plain text up to the terminal's width less one."""
    inner = line.rstrip()
    if inner.endswith(BORDER):
        return inner[x:-1].strip(), len(inner) - 2 - x
    return inner[x:].strip(), width - 1 - x


def find_paragraph(lines: list[str], text: str, width: int) -> str | None:
    """None if `text` is shown whole in one column and wrapped only where its next word did not fit,
    else what is wrong."""
    words = text.split()
    problems = []
    for i, line in enumerate(lines):
        for x in (m.start() for m in re.finditer(re.escape(words[0]), line)):
            if x > 0 and line[x - 1] not in f" {BORDER}":
                continue
            shown, k, breaks = [], i, []
            while k < len(lines) and len(shown) < len(words):
                if x > 0 and len(lines[k]) > x and lines[k][x - 1] not in f" {BORDER}":
                    break          # a neighbouring column runs into this one
                segment, room = cell(lines[k], x, width)
                if not segment:
                    break
                shown += segment.split()
                if len(shown) < len(words):
                    breaks.append((lines[k], len(segment), room, words[len(shown)] if len(shown) < len(words) else ""))
                k += 1
            if shown[:len(words)] != words:
                continue
            early = [line for line, used, room, nxt in breaks if used + 1 + len(nxt) <= room]
            if not early:
                return None
            problems.append(f"broken before the next word fitted: {early}")
    return "; ".join(problems) or "not shown whole in one column"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) or "kvtrace" for p, _ in COMMANDS])
def test_help_reads_as_wrapped_paragraphs(path, command, width):
    lines = render(path, width)
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    assert not [line for line in lines if "…" in line], "cut short:\n" + "\n".join(lines)
    texts = expected(command, options=(path, width) not in OPTIONS_TOO_WIDE)
    assert texts, f"kvtrace {' '.join(path)} has no help"
    problems = {text: problem for text in texts if (problem := find_paragraph(lines, text, width))}
    assert not problems, "\n".join([f"{t!r}: {p}" for t, p in problems.items()] + lines)


def test_the_checker_sees_a_hard_line_break():
    """A paragraph broken where the next word would have fitted fails; wrapped as Rich wraps, it passes."""
    text = "one two three four five six"
    assert find_paragraph([" one two three four five", " six"], text, 26) is None
    assert "broken" in find_paragraph([" one two three", " four five six"], text, 26)
    boxed = ["│ --opt  one two three four │", "│        five six           │"]
    assert find_paragraph(boxed, text, 30) is None
    assert find_paragraph(["│ --opt  one two three      │", "│        four five six      │"], text, 30)
    assert find_paragraph([" one two", " three"], text, 30) == "not shown whole in one column"


def test_a_switch_shows_one_name_and_keeps_both_forms():
    """A --x/--no-x switch reads `--[no-]x` with its default as on/off, and after the help has been
    shown both forms still parse and the sweep still finds the off form."""
    from kvtrace.sweep.grid import record_knobs

    lines = render(("record",), 80)
    assert any("--[no-]enable-prefix-caching" in line for line in lines)
    command = typer.main.get_command(app).commands["record"]
    assert record_knobs(command)["enable_prefix_caching"].off_flag == "--no-enable-prefix-caching"
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        assert runner.invoke(app, ["record", flag, "--help"]).exit_code == 0
