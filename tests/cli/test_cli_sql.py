"""`kvtrace sql` and `kvtrace compare`, driven through the CLI on the hand-built golden runs."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

import kvtrace.cli.sql  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from kvtrace.views import headline
from tests.helpers.cli import one_line_error
from tests.helpers.tracegen import recompute_run

runner = CliRunner()


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def ok(*args: str, input: str | None = None):
    result = invoke(*args, input=input)
    assert result.exit_code == 0, result.output
    return result


QUERY = "SELECT run_id, count(*) AS steps, max(end_s) AS end_s FROM steps GROUP BY run_id ORDER BY run_id"


def test_query_as_table(root):
    out = ok("sql", root, QUERY).stdout
    assert "run_id" in out and "rec" in out and "swp" in out and "1.5" in out


def test_query_as_csv_json_and_parquet(root, tmp_path):
    assert ok("sql", root / "rec", root / "swp", QUERY, "--format", "csv").stdout == (
        "run_id,steps,end_s\nrec,6,1.5\nswp,6,1.5\n")
    assert json.loads(ok("sql", root, QUERY, "--format", "json").stdout) == [
        {"run_id": "rec", "steps": 6, "end_s": 1.5}, {"run_id": "swp", "steps": 6, "end_s": 1.5}]
    ok("sql", root, QUERY, "--format", "parquet", "-o", tmp_path / "out.parquet")
    assert pq.read_table(tmp_path / "out.parquet").to_pylist()[0] == {"run_id": "rec", "steps": 6, "end_s": 1.5}
    # the format follows the output file's suffix when not given
    ok("sql", root, QUERY, "-o", tmp_path / "out.csv")
    assert (tmp_path / "out.csv").read_text().startswith("run_id,steps,end_s\n")


def test_lists_in_csv_and_json(root):
    query = "SELECT blocks FROM kv_events WHERE run_id = 'rec' AND kind = 'free' ORDER BY seq"
    assert ok("sql", root, query, "--format", "csv").stdout == 'blocks\n[2]\n"[0, 1, 2]"\n"[0, 1]"\n'
    assert json.loads(ok("sql", root, query, "--format", "json").stdout)[1] == {"blocks": [0, 1, 2]}


def test_glob_of_runs_is_not_taken_for_the_query(root):
    out = ok("sql", str(root / "*"), QUERY, "--format", "csv").stdout
    assert out.count("\n") == 3


def test_a_query_longer_than_a_file_name_is_still_a_query(root):
    padded = QUERY.replace("SELECT ", "SELECT " + " " * 300)   # over the 255-byte name limit
    assert ok("sql", root, padded, "--format", "csv").stdout.startswith("run_id,steps,end_s\n")


def test_query_from_file(root, tmp_path):
    (tmp_path / "q.sql").write_text(QUERY + ";\n")
    assert ok("sql", root, "-f", tmp_path / "q.sql", "--format", "csv").stdout.endswith("swp,6,1.5\n")


def test_list_analyses_needs_no_run():
    out = ok("sql", "--list").stdout
    assert "itl_cliffs  (threshold_ms=0, median_multiple=5)" in out
    assert "thrash  (window_s=5" in out and "Did the engine thrash?" in out


def test_analysis_with_params(root):
    got = json.loads(ok("sql", root, "--analysis", "goodput", "--param", "tpot_ms=300", "--format", "json").stdout)
    assert [(r["run_id"], r["good_requests"], r["tpot_slo_ms"]) for r in got] == [("rec", 1, 300.0), ("swp", 1, 300.0)]
    got = json.loads(ok("sql", root, "-a", "itl_cliffs", "-p", "threshold_ms=200", "--format", "json").stdout)
    assert {r["cause"] for r in got} == {"preempted", "swap_wait", "prefill_interference", "other"}


def test_table_output_is_capped(root):
    out = ok("sql", root, "SELECT * FROM range(300)", "--max-rows", "5").stdout
    assert "(5 of 300 rows shown" in out
    assert "(no rows)" in ok("sql", root, "SELECT 1 WHERE false").stdout


@pytest.mark.parametrize("args, message", [
    (("sql", "/nonexistent/run", "SELECT 1"), "/nonexistent/run: no such run folder"),
    (("sql", "SELECT 1"), "give at least one run folder"),
    (("sql", "{root}", "SELEC nonsense"), "Parser Error"),
    (("sql", "{root}", "-a", "nope"), "no analysis named 'nope'"),
    (("sql", "{root}", "-a", "goodput", "-p", "ttft_ms"), "--param expects NAME=VALUE"),
    (("sql", "{root}", "-a", "goodput", "-p", "slo=1"), "unknown param slo"),
    (("sql", "{root}", "-p", "x=1", "SELECT 1"), "--param goes with --analysis"),
    (("sql", "{root}", "SELECT 1", "--format", "parquet"), "--format parquet needs --output"),
    (("compare", "{root}/rec"), "compare needs at least two runs"),
    (("compare", "{root}/rec", "/nonexistent/b"), "/nonexistent/b: no such run folder"),
])
def test_errors_are_one_line_and_exit_2(root, args, message):
    assert message in one_line_error([str(a).format(root=root) for a in args])


def test_interactive_session(root):
    stdin = ("SELECT run_id, count(*) AS n\nFROM tokens GROUP BY ALL ORDER BY 1;\n"
             ".tables\nSELECT nope;\n.run swap\n.quit\nSELECT 99;\n")
    result = ok("sql", root, input=stdin)
    out = result.stdout
    assert "2 run(s): rec, swp" in out
    assert "rec" in out and " 7 " in out                     # 7 tokens per run
    assert "kv_events" in out and "_itl" not in out           # .tables hides the helpers
    assert "swap_out" in out and "0.6667" in out              # .run swap
    assert "99" not in out                                    # nothing after .quit
    assert 'Referenced column "nope"' in result.stderr


def test_interactive_session_ends_at_eof(root):
    out = ok("sql", root, input="SELECT 41 + 1 AS answer\n").stdout   # no ';' before EOF: still run
    assert "42" in out


def test_compare(root):
    out = ok("compare", root / "rec", root / "swp").stdout
    lines = {cells[0]: cells for cells in map(str.split, out.splitlines()) if cells and cells[0].isidentifier()}
    assert lines["recomputed_tokens"][1:] == ["│", "4", "│", "0", "│", "-4", "│", "-100%"]
    assert lines["num_gpu_blocks"][1:] == ["│", "3", "│", "6", "│", "+3", "│", "+100%"]
    assert lines["preemption_mode"][1:] == ["│", "recompute", "│", "swap", "│", "differs", "│"]


def test_compare_json_and_workload_warning(root, tmp_path):
    other = recompute_run(tmp_path, "other", workload={"sha256": "b" * 64})
    clean = ok("compare", root / "rec", root / "swp", "--format", "json")
    assert json.loads(clean.stdout)["warnings"] == [] and "warning" not in clean.stderr
    result = ok("compare", root / "swp", other, "--format", "json")
    document = json.loads(result.stdout)
    assert document["baseline"] == "swp" and document["runs"] == ["swp", "other"]
    assert result.stderr.startswith("warning: the runs did not replay the same workload")
    assert document["warnings"] == [result.stderr.strip().removeprefix("warning: ")]
    metrics = {m["metric"]: m for m in document["metrics"]}
    assert metrics["recomputed_tokens"] == {"metric": "recomputed_tokens", "values": {"swp": 0, "other": 4},
                                            "delta": {"other": 4}, "delta_pct": {"other": None}}
    assert metrics["swap_out_bytes"]["delta_pct"] == {"other": -100.0}
    assert metrics["thrash_verdict"] == {"metric": "thrash_verdict",
                                         "values": {"swp": "occasional", "other": "occasional"}}
    # params reach summary.sql
    with_slo = json.loads(ok("compare", root / "rec", root / "swp", "--format", "json", "-p", "tpot_ms=300").stdout)
    assert {m["metric"]: m for m in with_slo["metrics"]}["good_share"]["values"] == {"rec": 0.5, "swp": 0.5}


def test_compare_opens_with_what_changed(root):
    lines = ok("compare", root / "rec", root / "swp").stdout.splitlines()
    assert lines[0] == ("what changed: swp against rec "
                        "(block_size 4 → 2, num_gpu_blocks 3 → 6, preemption_mode recompute → swap)")
    assert [line.split()[:4] for line in lines[1:6]] == [
        ["thrash", "OCCASIONAL", "→", "OCCASIONAL"],
        ["preemptions", "1", "→", "1"],
        ["recomputed", "21%", "→", "0.0%"],
        ["goodput", "0", "→", "0"],
        ["ITL", "p99", "730", "ms"],
    ]
    assert lines[2].split()[-1] == "unchanged" and lines[3].split()[-2:] == ["−21", "points"]
    assert lines[7].split()[:3] == ["metric", "┃", "rec"], "then the full table"


def test_compare_says_which_way_each_figure_moved():
    summary = pa.Table.from_pylist([
        {"run_id": "thrash", "thrash_verdict": "sustained", "preemptions": 90, "recompute_share": 0.3,
         "goodput_req_s": 1.0, "good_share": 0.5, "itl_p99_ms": 400.0},
        {"run_id": "cap", "thrash_verdict": "occasional", "preemptions": 5, "recompute_share": 0.01,
         "goodput_req_s": 0.5, "good_share": 0.25, "itl_p99_ms": 400.0},
        {"run_id": "more-kv", "thrash_verdict": "none", "preemptions": 0, "recompute_share": 0.0,
         "goodput_req_s": 3.0, "good_share": 1.0, "itl_p99_ms": 100.0},
    ])
    changes = headline.headline(summary, {"more-kv": {"num_gpu_blocks": [80, 240]}})
    better = {c["run_id"]: {name: f["better"] for name, f in c["figures"].items()} for c in changes}
    assert better == {
        "cap": {"thrash_verdict": True, "preemptions": True, "recompute_share": True, "goodput_req_s": False,
                "itl_p99_ms": None, "good_share": False},
        "more-kv": {"thrash_verdict": True, "preemptions": True, "recompute_share": True, "goodput_req_s": True,
                    "itl_p99_ms": True, "good_share": True},
    }
    assert changes[1]["settings"] == {"num_gpu_blocks": [80, 240]} and changes[0]["settings"] == {}
    text = rendered_text(headline.render(changes[1:]))
    assert "3.0× higher" in text and "4.0× lower" in text and "−100%" in text and "−30 points" in text


def test_compare_says_a_size_in_gib():
    summary = pa.Table.from_pylist([{"run_id": run, "thrash_verdict": "none", "preemptions": 0, "recompute_share": 0.0,
                                     "goodput_req_s": 1.0, "good_share": 1.0, "itl_p99_ms": 10.0}
                                    for run in ("base", "tier")])
    changes = headline.headline(summary, {"tier": {"offload_size": [None, 8 * 2**30], "max_num_seqs": [64, 8]}})
    title = rendered_text(headline.render(changes)).splitlines()[0]
    assert title == "what changed: tier against base (offload_size – → 8 GiB, max_num_seqs 64 → 8)"


def rendered_text(renderable) -> str:
    console = Console(width=120, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()
