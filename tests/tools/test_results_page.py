"""benchmarks/results.py, the writer every suite ends with, driven on a copy of RESULTS.md: the page is
one table with one row per figure; a run rewrites its own suite's row (its figure, date, commit and
machine) and nothing else, and appends its full report to the log, where its row's date links."""
from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks import results
from benchmarks.__main__ import SUITES

PAGE = Path(results.__file__).resolve().parent / "RESULTS.md"
HEADER = "| what | goal | latest figure | date (UTC) | commit | machine |"


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
    monkeypatch.setattr(results, "machine_cell", lambda: "a CPU, 2 cores")
    monkeypatch.setattr(results, "describe_software", lambda revision: f"test software (git {revision})")
    return tmp_path


def run_suite(suite: str, headline: str, report: str = "| a | b |\n|---|---|\n| 1 | 2 |") -> None:
    section = results.Section(suite)
    section.add(report)
    section.write(headline, argv=[suite, "--repeats", "2"])


def table(page: str) -> list[list[str]]:
    """The rows of the page's one table, as cells."""
    lines = page.splitlines()
    assert lines.count(HEADER) == 1, "one results table"
    start = lines.index(HEADER)
    assert re.fullmatch(r"\|(---\|){6}", lines[start + 1])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(results.split_row(line))
    return rows


def row(page: str, suite: str) -> list[str]:
    (found,) = [cells for cells in table(page) if cells[0].startswith(f"`{suite}`")]
    return found


def log_entries(log_dir: Path) -> dict[tuple[str, str], str | None]:
    """(log file name, heading anchor) -> the entry's headline, for every `##` heading of the logs."""
    entries = {}
    for log in log_dir.glob("*.md"):
        lines = log.read_text().splitlines()
        found = results.headings("\n".join(lines))
        for k, (i, level, anchor) in enumerate(found):
            if level == 2:
                end = next((j for j, lvl, _ in found[k + 1:] if lvl <= 2), len(lines))
                headline = [line[len("- Headline: "):] for line in lines[i:end] if line.startswith("- Headline: ")]
                entries[(log.name, anchor)] = headline[0] if headline else None
    return entries


def test_the_page_is_one_table_with_one_row_per_suite_and_each_figure_is_its_logged_run():
    page = PAGE.read_text()
    rows = table(page)
    assert all(len(cells) == 6 for cells in rows), [cells[0] for cells in rows if len(cells) != 6]
    for suite in SUITES:
        assert len([cells for cells in rows if cells[0].startswith(f"`{suite}`")]) == 1, suite
    logged = log_entries(PAGE.parent / "log")
    for suite in SUITES:
        _what, goal, figure, date, commit, machine = row(page, suite)
        assert goal, f"{suite}: no goal"
        link = re.fullmatch(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d)\]\(log/([^#)]+)#([^)]+)\)", date)
        assert link, f"{suite}: the date does not link to its report: {date}"
        assert link.group(3).startswith(results.anchor(f"{link.group(1)} UTC — {suite}")), suite
        assert logged.get((link.group(2), link.group(3))) == figure, f"{suite}: not the logged run's headline"
        assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", commit), suite
        assert re.search(r"\d+ cores; load \S+ → \S+$", machine), suite
    assert "<!-- suite:" not in page and len(page.encode()) < 12_000


def test_a_run_rewrites_its_own_row_only(bench):
    before = (bench / "RESULTS.md").read_text()
    run_suite("tracing", "traced / untraced replay: 1.00× (0.99–1.01, n=2); goal ≤ 1.02: met")
    after = (bench / "RESULTS.md").read_text()

    changed = [(old, new) for old, new in zip(before.splitlines(), after.splitlines(), strict=True) if old != new]
    assert len(changed) == 1, changed                                   # every other line byte for byte
    old, new = (results.split_row(line) for line in changed[0])
    today = datetime.now(timezone.utc).strftime("%Y-%m")
    assert new[:2] == old[:2] and new[0].startswith("`tracing`")        # what and goal: as written by hand
    assert new[2] == "traced / untraced replay: 1.00× (0.99–1.01, n=2); goal ≤ 1.02: met"
    assert re.fullmatch(rf"\[{today}-\d\d \d\d:\d\d\]\(log/{today}\.md#{today}-\d\d-\d{{4}}-utc--tracing\)", new[3])
    assert new[4:] == ["abc1234", "a CPU, 2 cores; load 0.5 → 0.5"]


def test_the_row_shows_the_latest_run_and_the_log_keeps_them_all(bench):
    for i in range(3):
        run_suite("kernels", f"figure {i}")
    page = (bench / "RESULTS.md").read_text()
    assert row(page, "kernels")[2] == "figure 2"
    assert "figure 0" not in page and "figure 1" not in page
    logged = log_entries(bench / "log")
    assert sorted(h for h in logged.values() if h and h.startswith("figure")) == ["figure 0", "figure 1", "figure 2"]
    link = re.fullmatch(r"\[.*\]\(log/([^#)]+)#([^)]+)\)", row(page, "kernels")[3])
    assert logged[(link.group(1), link.group(2))] == "figure 2"        # the date links to the run it shows


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
                         "abc1234", "1.0", "1.5", headline, f"log/2026-12.md#2026-12-01-0930-utc--{suite}", "a CPU, 2 cores")


def test_the_same_entry_twice_is_the_same_page():
    page = PAGE.read_text()
    once = results.update_page(page, entry("roofline", "batch 8 1.20×"))
    assert once != page
    assert results.update_page(once, entry("roofline", "batch 8 1.20×")) == once


def test_a_suite_without_a_row_gets_one_at_the_tables_end_and_a_bar_cannot_split_a_cell():
    page = PAGE.read_text()
    new = results.update_page(page, entry("new-suite", "a | b"))
    rows = table(new)
    assert rows[:-1] == table(page)
    assert rows[-1] == ["`new-suite`", "", "a / b", "[2026-12-01 09:30](log/2026-12.md#2026-12-01-0930-utc--new-suite)",
                        "abc1234", "a CPU, 2 cores; load 1.0 → 1.5"]
    lines = new.splitlines()
    del lines[lines.index(HEADER) + 1 + len(rows)]                      # the new row: the rest is the page
    assert "\n".join(lines) + "\n" == page


def test_a_page_without_the_table_gets_one_at_its_end():
    page = "# Benchmark results\n\nSome prose.\n"
    new = results.update_page(page, entry("tracing", "x"))
    assert new.startswith(page + "\n" + HEADER + "\n")
    assert table(new) == [["`tracing`", "", "x", "[2026-12-01 09:30](log/2026-12.md#2026-12-01-0930-utc--tracing)",
                           "abc1234", "a CPU, 2 cores; load 1.0 → 1.5"]]


def test_two_rows_for_one_suite_are_refused():
    page = f"{HEADER}\n|---|---|---|---|---|---|\n| `tracing` | a | b | c | d | e |\n| `tracing` | a | b | c | d | e |\n"
    with pytest.raises(ValueError, match="2 rows for suite tracing"):
        results.update_page(page, entry("tracing", "x"))
    assert results.suite_of("| `vllm-capture`: what | goal |") == "vllm-capture"   # not vllm's row


def test_a_heading_anchor_is_the_one_a_markdown_renderer_makes():
    assert results.anchor("2026-12-02 04:44 UTC — vllm") == "2026-12-02-0444-utc--vllm"
    assert results.anchor("What if, on a run's traffic") == "what-if-on-a-runs-traffic"
    assert results.anchor("`steps` — one row per engine step") == "steps--one-row-per-engine-step"
    page = "# Log\n\n## 09:30 — a\n\n```\n# not a heading\n```\n\n## 09:30 — a\n\n### 09:30 — a\n"
    assert results.heading_anchors(page) == ["log", "0930--a", "0930--a-1", "0930--a-2"]
