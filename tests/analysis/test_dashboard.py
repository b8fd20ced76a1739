"""`kvtrace analyze`: snapshots of the dashboard on two recorded runs, its figures against the SQL
library's, --json, --follow and the CLI's errors.

The runs under tests/fixtures/runs were recorded once (see tests/fixtures/README.md). The golden
files tests/fixtures/dashboard/*.txt are the rendered text; regenerate them after a deliberate
change with KVTRACE_UPDATE_GOLDEN=1 pytest tests/analysis/test_dashboard.py: that run fails, showing each
file's diff against the previous one; review it and rerun to accept. tests/analysis/test_fresh_run.py draws
the dashboard and the report from a run recorded by the engine during the tests.
"""
from __future__ import annotations

import difflib
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.cli.view import dashboard_view, follow
from kvtrace.trace import db
from kvtrace.views import dashboard
from tests.helpers.cli import one_line_error

FIXTURES = Path(__file__).parents[1] / "fixtures"
RUNS = FIXTURES / "runs"
RECOMPUTE, SWAP = RUNS / "tiny-recompute", RUNS / "tiny-swap"
GOLDEN = FIXTURES / "dashboard"
# CI never rewrites a golden file: there the variable is ignored and a difference fails
UPDATE = os.environ.get("KVTRACE_UPDATE_GOLDEN") == "1" and os.environ.get("CI") != "true"

runner = CliRunner()


def rendered(renderable, width: int) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def check_golden(name: str, text: str, folder: Path = GOLDEN, update: bool = UPDATE) -> None:
    """Compare `text` with the golden file `folder/name`; a difference fails with a unified diff.

    With KVTRACE_UPDATE_GOLDEN=1 a golden file that differs (or is missing) is rewritten and the test
    still fails, showing the diff against the previous file: an update is never green in the run
    that makes it. Review the diff (also in `git diff`), then rerun to accept it.
    """
    path = folder / name
    previous = path.read_text() if path.exists() else None
    if previous == text:
        return
    diff = "".join(difflib.unified_diff((previous or "").splitlines(keepends=True), text.splitlines(keepends=True),
                                        f"{name} (golden)", f"{name} (now)"))
    if not update:
        assert previous is not None, f"{path} missing: run with KVTRACE_UPDATE_GOLDEN=1 and review it"
        pytest.fail(f"{name} differs from its golden file (KVTRACE_UPDATE_GOLDEN=1 rewrites it):\n{diff}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    what = "written (new)" if previous is None else "rewritten"
    pytest.fail(f"{path} {what}; review the diff, then rerun to accept it:\n{diff}")


def test_a_golden_update_fails_and_shows_the_diff_against_the_previous_file(tmp_path):
    (tmp_path / "g.txt").write_text("pool 3/4\n")
    check_golden("g.txt", "pool 3/4\n", tmp_path, update=False)
    check_golden("g.txt", "pool 3/4\n", tmp_path, update=True)      # unchanged: nothing to accept
    with pytest.raises(pytest.fail.Exception, match=r"(?s)differs.*-pool 3/4\n\+pool 4/4"):
        check_golden("g.txt", "pool 4/4\n", tmp_path, update=False)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rewritten; review the diff.*-pool 3/4\n\+pool 4/4"):
        check_golden("g.txt", "pool 4/4\n", tmp_path, update=True)
    assert (tmp_path / "g.txt").read_text() == "pool 4/4\n"
    check_golden("g.txt", "pool 4/4\n", tmp_path, update=False)     # the rerun accepts it
    with pytest.raises(pytest.fail.Exception, match="written \\(new\\)"):
        check_golden("new.txt", "x\n", tmp_path, update=True)


# --------------------------------------------------------------------------- snapshots

@pytest.mark.parametrize("width", [80, 160])
@pytest.mark.parametrize("run", [RECOMPUTE, SWAP], ids=["recompute", "swap"])
def test_dashboard_snapshot(run, width):
    text = rendered(dashboard_view([run], {}, width, None, None), width)
    check_golden(f"{run.name}-{width}.txt", text)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    if width == 80:
        assert len(lines) <= 24, "one run must fit 80 x 24"


@pytest.mark.parametrize("width", [80, 160])
def test_comparison_snapshot(width):
    text = rendered(dashboard_view([RECOMPUTE, SWAP], {}, width, None, None), width)
    check_golden(f"compare-{width}.txt", text)
    header = next(line for line in text.splitlines() if "tiny-recompute" in line)
    assert header.index("tiny-recompute") < header.index("tiny-swap"), "runs are columns, in the order given"


def test_two_columns_from_120():
    narrow = rendered(dashboard_view([RECOMPUTE], {}, 119, None, None), 119).splitlines()
    wide = rendered(dashboard_view([RECOMPUTE], {}, 120, None, None), 120).splitlines()
    # side by side: the key figures and the pool strip share lines
    assert not any("key figures" in line and "KV pool used" in line for line in narrow)
    assert any("key figures" in line and "KV pool used" in line for line in wide)
    assert len(wide) < len(narrow)


# --------------------------------------------------------------------------- the figures are the SQL library's

def approx(value):
    """Floats compared to 1e-9: DuckDB's parallel sums may round their last digit differently."""
    if isinstance(value, dict):
        return {k: approx(v) for k, v in value.items()}
    if isinstance(value, list):
        return [approx(v) for v in value]
    return pytest.approx(value, rel=1e-9) if isinstance(value, float) else value


def test_json_figures_are_the_analyses_rows():
    result = runner.invoke(app, ["analyze", str(RECOMPUTE), str(SWAP), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    con = db.connect([RECOMPUTE, SWAP])

    def rows(name, **params):
        return db.records(db.run_analysis(con, name, **params))

    def without_run(row):
        return {k: v for k, v in row.items() if k != "run_id"}

    assert [f["run"]["run_id"] for f in data["runs"]] == ["tiny-recompute", "tiny-swap"]
    for name, key in (("summary", "summary"), ("thrash", "thrash")):
        assert [f[key] for f in data["runs"]] == approx([without_run(r) for r in rows(name)]), name
    for fig in data["runs"]:
        rid = fig["run"]["run_id"]
        for name, key, params in (("most_preempted", "most_preempted", {"limit": 5}),
                                  ("itl_cliff_summary", "itl_tail", {}), ("thrash_windows", "thrash_windows", {}),
                                  ("pool_timeline", "pool_timeline", {"buckets": 60})):
            assert fig[key] == approx([without_run(r) for r in rows(name, **params) if r["run_id"] == rid]), name
        latency = {r["metric"]: r for r in rows("latency") if r["run_id"] == rid}
        assert fig["latency"] == approx({m: {k: v for k, v in r.items() if k not in ("run_id", "metric")}
                                         for m, r in latency.items()})
    assert data["params"]["summary"]["ttft_ms"] == 2000


def test_params_reach_the_analyses_that_declare_them():
    result = runner.invoke(app, ["analyze", str(RECOMPUTE), "--json", "-p", "ttft_ms=1", "-p", "window_s=1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["params"]["summary"]["ttft_ms"] == 1
    assert data["params"]["thrash"]["window_s"] == 1 and data["params"]["thrash_windows"]["window_s"] == 1
    con = db.connect([RECOMPUTE])
    summary = db.run_analysis(con, "summary", ttft_ms=1, window_s=1).to_pylist()[0]
    assert data["runs"][0]["summary"]["good_share"] == pytest.approx(summary["good_share"])


def test_the_screen_shows_the_sql_figures():
    """Each key figure on the screen is the summary row's value, formatted."""
    con = db.connect([RECOMPUTE])
    s = db.run_analysis(con, "summary").to_pylist()[0]
    t = db.run_analysis(con, "thrash").to_pylist()[0]
    text = rendered(dashboard_view([RECOMPUTE], {}, 80, None, None), 80)
    shown = [dashboard.fmt_num(s["output_tok_s"], "tok/s"), dashboard.fmt_num(s["request_throughput"], "req/s"),
             dashboard.fmt_num(s["goodput_req_s"], "req/s"), dashboard.fmt_share(s["good_share"]),
             f"preemptions {s['preemptions']}", dashboard.fmt_num(s["recomputed_tokens"], "tok"),
             dashboard.fmt_share(s["recompute_share"]), t["verdict"].upper(),
             f"{t['preempted_sequences']} seqs, {t['repreempted_sequences']} again"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        shown += [dashboard.fmt_ms(s[f"{metric}_p50_ms"]), dashboard.fmt_ms(s[f"{metric}_p99_ms"])]
    for figure in shown:
        assert figure in text, figure
    worst = db.run_analysis(con, "most_preempted", limit=1).to_pylist()[0]
    assert re.search(rf"^{worst['req_id']} +{worst['preemptions']}× +{re.escape(dashboard.fmt_ms(worst['stall_ms']))}",
                     text, re.MULTILINE)


def test_swap_figures():
    con = db.connect([SWAP])
    s = db.run_analysis(con, "summary").to_pylist()[0]
    text = rendered(dashboard_view([SWAP], {}, 80, None, None), 80)
    assert s["swap_out_bytes"] == s["swap_in_bytes"]  # every swapped block came back
    assert f"{dashboard.fmt_bytes(s['swap_out_bytes'])} each way" in text
    assert dashboard.fmt_num(s["swap_gb_s"], "GB/s") in text
    assert "▼" in text and "swap wait" in text


# --------------------------------------------------------------------------- formatting

def test_formatting():
    assert [dashboard.fmt_ms(v) for v in (None, 0.5234, 15.04, 425.4, 1671.6, 61234.0)] == [
        "–", "0.52 ms", "15.0 ms", "425 ms", "1.67 s", "61.2 s"]
    assert [dashboard.fmt_num(v) for v in (None, 22, 2.8, 0.11, 68.75, 3276.2)] == ["–", "22", "2.8", "0.11", "68.8",
                                                                                   "3,276"]
    assert [dashboard.fmt_share(v) for v in (None, 0.0, 0.051, 0.241, 1.0)] == ["–", "0.0%", "5.1%", "24%", "100%"]
    assert [dashboard.fmt_bytes(v) for v in (0, 2048, 343_968, 2.5e9)] == ["0 B", "2.05 kB", "344 kB", "2.5 GB"]


def test_pool_strip_levels_and_marks():
    rows = [{"start_s": i * 0.1, "end_s": (i + 1) * 0.1, "mean_used_frac": frac, "full_pool_steps": 0,
             "preemptions": p, "swap_preemptions": s} for i, (frac, p, s) in
            enumerate([(None, 0, 0), (0.0, 0, 0), (0.5, 1, 0), (1.0, 2, 2), (0.25, 0, 0)])]
    lines = rendered(dashboard.pool_strip(rows), 40).splitlines()
    assert [line[5:10] for line in lines[:3]] == ["   █ ", "·▁██▄", "  ▲▼ "]


# --------------------------------------------------------------------------- --follow

def test_follow_redraws_until_the_run_is_no_longer_running(tmp_path):
    run = tmp_path / "live"
    run.mkdir()
    meta = json.loads((RECOMPUTE / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "run_id": "live", "status": "running"}))
    chunks = sorted(RECOMPUTE.glob("*/part-*.parquet"))
    frames = []
    console = Console(width=80, record=True, color_system=None, file=io.StringIO())

    def view(width: int):
        frames.append(width)
        return dashboard_view([run], {}, width, None, None)

    def sleep(seconds: float) -> None:   # each wait: the recorder lands chunks, then finishes
        assert seconds == 0.5
        if not any(run.glob("*/part-*.parquet")):
            for chunk in chunks:
                (run / chunk.parent.name).mkdir(exist_ok=True)
                shutil.copy(chunk, run / chunk.parent.name / chunk.name)
        else:
            (run / "meta.json").write_text(json.dumps({**meta, "run_id": "live", "status": "completed"}))

    follow(console, [str(run)], view, 0.5, sleep=sleep)
    assert frames == [80, 80], "no chunk yet: a waiting line; then one frame while running, one when done"
    assert "completed" in console.export_text()


def test_follow_stops_at_once_on_a_finished_run():
    console = Console(width=80, record=True, color_system=None, file=io.StringIO())
    follow(console, [str(SWAP)], lambda width: dashboard_view([SWAP], {}, width, None, None), 1.0,
           sleep=lambda s: pytest.fail("slept on a finished run"))
    assert "tiny-swap" in console.export_text()


# --------------------------------------------------------------------------- the command line

def test_cli_errors(tmp_path):
    assert "no such run folder" in one_line_error(["analyze", str(tmp_path / "nope")])
    assert "not a run folder" in one_line_error(["analyze", str(tmp_path)])
    assert "unknown param nope" in one_line_error(["analyze", str(SWAP), "-p", "nope=1"])
    assert "NAME=VALUE" in one_line_error(["analyze", str(SWAP), "-p", "ttft_ms"])
    assert "--top must be >= 1" in one_line_error(["analyze", str(SWAP), "--top", "0"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "meta.json").write_text("{}")
    assert "no parquet chunk files" in one_line_error(["analyze", str(tmp_path / "empty")])


def test_cli_renders_and_honours_no_color():
    colored = runner.invoke(app, ["analyze", str(RECOMPUTE)], env={"FORCE_COLOR": "1", "COLUMNS": "80"})
    plain = runner.invoke(app, ["analyze", str(RECOMPUTE)], env={"FORCE_COLOR": "1", "NO_COLOR": "1",
                                                                 "COLUMNS": "80"})
    assert colored.exit_code == plain.exit_code == 0, colored.output + plain.output
    color_code = re.compile(r"\x1b\[[0-9;]*(3[0-7]|38;[0-9;]+)m")
    assert color_code.search(colored.stdout)
    assert not color_code.search(plain.stdout)
    assert "thrash SUSTAINED" in re.sub(r"\x1b\[[0-9;]*m", "", plain.stdout)
