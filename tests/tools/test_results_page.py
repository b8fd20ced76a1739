"""benchmarks/results.py, the writer every suite ends with, driven on a copy of RESULTS.md: a run
rewrites its own suite's section and nothing else, keeps the last 3 figures, appends to the log."""
from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks import results
from benchmarks.__main__ import SUITES

PAGE = Path(results.__file__).resolve().parent / "RESULTS.md"


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """A copy of RESULTS.md and an empty log folder, and a machine that answers the same every time."""
    page = tmp_path / "RESULTS.md"
    shutil.copy(PAGE, page)
    monkeypatch.setattr(results, "RESULTS_MD", page)
    monkeypatch.setattr(results, "LOG_DIR", tmp_path / "log")
    monkeypatch.setattr(results, "git_revision", lambda: "abc1234")
    monkeypatch.setattr(results, "load_average", lambda: "0.5")
    monkeypatch.setattr(results, "describe_machine", lambda: "a test machine")
    monkeypatch.setattr(results, "describe_software", lambda revision: f"test software (git {revision})")
    return tmp_path


def run_suite(suite: str, headline: str, report: str = "| a | b |\n|---|---|\n| 1 | 2 |") -> None:
    section = results.Section(suite)
    section.add(report)
    section.write(headline, argv=[suite, "--repeats", "2"])


def split_at(page: str, suite: str) -> tuple[str, str, str]:
    """(before the suite's block, the block, after it), markers in the block."""
    match = re.search(rf"<!-- suite:{re.escape(suite)} -->\n.*?<!-- /suite:{re.escape(suite)} -->", page, re.DOTALL)
    assert match, f"no section {suite}"
    return page[:match.start()], match.group(0), page[match.end():]


def rows_of(block: str) -> list[list[str]]:
    lines = [line for line in block.splitlines() if line.startswith("|")]
    assert lines[0] == "| date (UTC) | commit | figure | load |"
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_page_has_a_marked_section_for_every_suite_and_stays_short():
    page = PAGE.read_text()
    for suite in SUITES:
        assert results.section_block(page, suite) is not None, suite
        assert len(rows_of(split_at(page, suite)[1])) <= results.HISTORY
    assert len(page.splitlines()) < 300


def test_a_run_rewrites_its_own_section_only(bench):
    before = (bench / "RESULTS.md").read_text()
    run_suite("tracing", "traced / untraced replay: 1.00× (0.99–1.01, n=2); goal ≤ 1.02: met")
    after = (bench / "RESULTS.md").read_text()

    head_before, block_before, tail_before = split_at(before, "tracing")
    head_after, block_after, tail_after = split_at(after, "tracing")
    assert head_after == head_before and tail_after == tail_before   # every other section byte for byte
    assert "Not yet measured" not in block_after
    today = datetime.now(timezone.utc).strftime("%Y-%m")
    lines = block_after.splitlines()
    assert lines[1:3] == ["Latest: **traced / untraced replay: 1.00× (0.99–1.01, n=2); goal ≤ 1.02: met**", ""]
    assert re.fullmatch(rf"`python -m benchmarks tracing --repeats 2` · {today}-\d\d \d\d:\d\d UTC · "
                        rf"commit abc1234 · "
                        rf"load 0\.5 → 0\.5 · full report: \[log/{today}\.md\]\(log/{today}\.md\)", lines[3])
    rows, old_rows = rows_of(block_after), rows_of(block_before)
    assert rows[0][1:] == ["abc1234", "traced / untraced replay: 1.00× (0.99–1.01, n=2); goal ≤ 1.02: met",
                           "0.5 → 0.5"]
    assert rows[0][0].startswith(today)
    assert rows[1:] == old_rows[:results.HISTORY - 1]


def test_the_table_keeps_the_last_three_newest_first(bench):
    for i in range(5):
        run_suite("kernels", f"figure {i}")
    rows = rows_of(split_at((bench / "RESULTS.md").read_text(), "kernels")[1])
    assert [row[2] for row in rows] == ["figure 4", "figure 3", "figure 2"]


def test_each_run_is_appended_in_full_to_the_months_log(bench):
    run_suite("tracing", "first figure", report="the first report")
    run_suite("sim-speed", "second figure", report="the second report")
    logs = list((bench / "log").iterdir())
    assert [p.name for p in logs] == [f"{datetime.now(timezone.utc):%Y-%m}.md"]
    text = logs[0].read_text()
    assert text.startswith("# Benchmark log, ")
    first, second = text.index("UTC — tracing"), text.index("UTC — sim-speed")
    assert first < text.index("the first report") < second < text.index("the second report")
    for line in ("- Command: `python -m benchmarks tracing --repeats 2`", "- Headline: first figure",
                 ("- Machine: a test machine; 1-min load average 0.5 at the start, 0.5 at the end "
                  "(other workers share it)"),
                 "- Software: test software (git abc1234)"):
        assert line in text


def entry(suite: str, headline: str) -> results.Entry:
    return results.Entry(suite, datetime(2026, 12, 1, 9, 30, tzinfo=timezone.utc), f"python -m benchmarks {suite}",
                         "abc1234", "1.0", "1.5", headline, "log/2026-12.md")


def test_the_same_entry_twice_is_the_same_page():
    page = PAGE.read_text()
    once = results.update_page(page, entry("roofline", "batch 8 1.20×"))
    assert results.update_page(once, entry("roofline", "batch 8 1.20×")) == once


def test_a_suite_without_a_section_gets_one_at_the_end_and_a_bar_cannot_split_a_cell():
    page = "# Benchmark results\n\nSome prose.\n"
    new = results.update_page(page, entry("new-suite", "a | b"))
    assert new.startswith(page.rstrip("\n") + "\n\n## new-suite\n\n<!-- suite:new-suite -->\n")
    assert rows_of(split_at(new, "new-suite")[1]) == [["2026-12-01 09:30", "abc1234", "a / b", "1.0 → 1.5"]]
    assert new.endswith("<!-- /suite:new-suite -->\n")


def test_two_sections_with_the_same_marker_are_refused():
    block = "<!-- suite:tracing -->\n<!-- /suite:tracing -->\n"
    with pytest.raises(ValueError, match="2 sections"):
        results.update_page(block + block, entry("tracing", "x"))
