"""The README is a front page that stays true: its two commands run what exists (the set-up and test
scripts, the workload, `kvtrace record`'s options as the CLI parses them), its main command is the
story that docs/postmortem.md tells and tests/analysis/test_story.py replays, every command of its
tour is one the CLI has, its picture was drawn from its main command by scripts/readme_picture.py,
and it stays short."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CLI = typer.main.get_command(app)


picture = load_script("readme_picture")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def command(path: list[str]):
    """The CLI's command at `path` (['capture', 'run']), or None."""
    found = CLI
    for name in path:
        found = getattr(found, "commands", {}).get(name)
        if found is None:
            return None
    return found


def test_the_readme_stays_a_front_page():
    assert len(README.read_bytes()) < 10_000
    assert "![" in README.read_text() and "docs/img/dashboard.svg" in README.read_text()


def test_the_main_command_runs_what_exists_and_parses():
    record, analyze = picture.main_command(README.read_text())
    (line,) = [line for block in code_blocks(README.read_text()) for line in block.splitlines()
               if "kvtrace record" in line and "kvtrace analyze" in line]
    first = shlex.split(line.split("&&")[0])
    assert first == ["bash", "scripts/setup.sh"] and (ROOT / first[1]).is_file()
    # record's options as the CLI parses them (a renamed or removed option fails here), no run
    context = CLI.commands["record"].make_context("record", record[2:])
    assert (ROOT / context.params["workload"]).is_file()
    assert context.params["out"] is None, "without -o the run is traces/runs/latest, which analyze reads"
    assert analyze == ["kvtrace", "analyze", "traces/runs/latest"]


def test_the_main_command_is_the_story_that_postmortem_tells():
    """scripts/postmortem.py writes docs/postmortem.md and tests/analysis/test_story.py replays it: both
    must be of the README's main command."""
    postmortem = load_script("postmortem")
    record, _ = picture.main_command(README.read_text())
    params = CLI.commands["record"].make_context("record", record[2:]).params
    story = CLI.commands["record"].make_context("record", ["-w", postmortem.WORKLOAD, *postmortem.THRASH_SETTINGS]).params
    assert params["model"] == "smollm2-135m"
    for name in ("workload", "num_gpu_blocks", "kv_cache_memory", "block_size", "max_num_seqs", "watermark",
                 "preemption_mode", "backlog", "time_scale"):
        assert params[name] == story[name], name


def test_the_test_command_is_the_test_script():
    assert "bash scripts/test.sh" in [line.strip() for block in code_blocks(README.read_text())
                                      for line in block.splitlines()]
    assert (ROOT / "scripts" / "test.sh").is_file()


def tour() -> list[str]:
    """The tour's lines: the code block whose every line is a `kvtrace` command and its description."""
    (block,) = [b for b in code_blocks(README.read_text()) if b.strip() and all(
        line.startswith("kvtrace ") and re.search(r"\S  +\S", line) for line in b.splitlines())]
    return block.splitlines()


def tour_targets(line: str) -> list:
    """The CLI commands a tour line names: `kvtrace capture ls|run` names two; `kvtrace sweep -w ...`
    is the group's `run` (Typer's shorthand); None for a name the CLI does not have."""
    words = line.split("  ")[0].split()[1:]              # the command line, before its description
    found = command(words[:1])
    if found is None or not hasattr(found, "commands"):
        return [found]
    if len(words) > 1 and words[1].startswith("-"):
        return [found.commands.get("run")]
    return [command([words[0], name]) for name in words[1].split("|")] if len(words) > 1 else [None]


def test_every_command_and_option_of_the_tour_is_the_clis():
    lines = tour()
    assert len(lines) >= 10
    problems = []
    for line in lines:
        for target in tour_targets(line):
            if target is None:
                problems.append(f"{line}: no such command")
                continue
            options = {opt for param in target.params for opt in [*getattr(param, "opts", []),
                                                                  *getattr(param, "secondary_opts", [])]}
            problems += [f"{line}: no option {option}" for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", line)
                         if option not in options]
    assert problems == []


def test_the_picture_was_drawn_from_the_main_command():
    svg = (ROOT / "docs" / "img" / "dashboard.svg").read_text()
    _, analyze = picture.main_command(README.read_text())
    assert svg.startswith("<svg") and "Generated with Rich" in svg
    # Rich writes the window's title with its spaces as &#160;
    title = re.sub(r"&#160;", " ", svg)
    assert shlex.join(analyze) + "  ·  smollm2-135m on " in title
    assert "thrash" in title


def test_the_picture_script_draws_a_run_and_finds_the_command(tmp_path):
    run = ROOT / "tests" / "fixtures" / "runs" / "tiny-recompute"
    text = picture.draw(run, picture.title(["kvtrace", "analyze", "traces/runs/latest"], run), tmp_path / "d.svg")
    svg = (tmp_path / "d.svg").read_text()
    assert "tiny-recompute" in text and "thrash" in text
    assert "kvtrace analyze traces/runs/latest  ·  tiny on AMD EPYC" in svg.replace("&#160;", " ")
    assert picture.without_output(["kvtrace", "record", "-w", "w.jsonl", "-o", "x", "--out=y", "-q"]) == \
        ["kvtrace", "record", "-w", "w.jsonl", "-q"]
    with pytest.raises(picture.NoMainCommand):
        picture.main_command("# A readme\n\n```bash\nkvtrace record -w w.jsonl\n```\n")
