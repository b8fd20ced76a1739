"""The Grafana dashboard of `kvtrace capture metrics` (kvtrace/vllm/dashboards/kvtrace-capture.json).

Every query of every panel is held against a real exporter following a capture of vLLM (the fixture
tests/fixtures/captures/bursts, one server), and one of two data-parallel ranks (tests/helpers/ranks.py),
each with a `dropped.json` and a foreign file added so that the capture's health has figures too, and
a real Prometheus server scraping it: each metric a query names is one
the exporter serves, each query evaluates through Prometheus's HTTP API with Grafana's variables
filled in as Grafana fills them, and returns series; each metric the exporter serves is on some
panel; and the `server` variable picks a server's figures (a pool and a verdict per server, never
one server's shown for another's). `kvtrace capture dashboard` prints (or writes) that file.
"""
from __future__ import annotations

import json
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from tests.helpers.cli import one_line_error
from tests.helpers.prometheus import PROMETHEUS, exporter_scraped, get, wait
from tests.helpers.ranks import RANK0, write_ranks

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "kvtrace" / "vllm" / "dashboards" / "kvtrace-capture.json"
FIXTURE = ROOT / "tests" / "fixtures" / "captures" / "bursts"
SERVER = "20261119T000008Z-24953"   # the fixture's one server
SCRAPE_SERIES = {"up"}   # what Prometheus records itself for each target it scrapes
# PromQL's keywords, aggregation operators and literals: identifiers that name no metric
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "group"}
# what Grafana puts in place of its variables here: a concrete selection, as an operator's would be
RATE_INTERVAL, RANGE = "1m", "1h"
# figures every folder below determines (by panel title and legend)
EXACT = {("Thrash verdict", "A"): 1.0,                 # occasional (test_capture_live.py)
         ("KV pool in use", "A"): 0.0,                 # the last step freed every block
         ("Chunks dropped", "A"): 2.0,                 # the dropped.json written below
         ("Files skipped", "A"): 1.0,                  # the foreign file written below
         ("Exporter scraped", "A"): 1.0,
         ("Capture recording", "A"): 1.0}              # no error.json


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, those inside a collapsed row included."""
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def targets(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every query of every panel."""
    return [(p["title"], t["refId"], t["expr"]) for p in panels(board) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers, less label matchers, ranges,
    grouping labels, function calls, keywords and numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)          # string literals
    text = re.sub(r"\{[^}]*\}", "{}", text)                                         # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)                                        # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)   # label lists
    return {m[1] for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(?![\w:]*\s*\()", text)
            if m[1].lower() not in PROMQL_WORDS}


def grafana_expr(expr: str, values: dict[str, str]) -> str:
    """`expr` with Grafana's variables ($name, ${name}, ${name:format}, [[name]]) filled in from
    `values`; a variable with no value is an error."""
    def value(m: re.Match) -> str:
        name = m[1] or m[2] or m[3]
        if name not in values:
            raise AssertionError(f"{expr}: Grafana variable ${name} has no value here")
        return values[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", value, expr)


def test_metric_names_reads_the_selectors_only():
    assert metric_names('histogram_quantile(0.99, sum by (cause, le) (rate(kvtrace_itl_seconds_bucket'
                        '{job=~"$job", cause!="other{x}"}[$__rate_interval])))') == {"kvtrace_itl_seconds_bucket"}
    assert metric_names("a_total / on (instance) group_left (server) b:recorded + 2 * up offset 5m") == {
        "a_total", "b:recorded", "up"}
    assert metric_names('max by (job) (kvtrace_kv_used_blocks) / max without (le) (kvtrace_kv_total_blocks > 0)'
                        ' or vector(1e3) and Inf') == {"kvtrace_kv_used_blocks", "kvtrace_kv_total_blocks"}
    assert grafana_expr('x{a=~"$a", b="${b:regex}"}[$__range] [[a]]', {"a": "1", "b": "2", "__range": "1h"}) == \
        'x{a=~"1", b="2"}[1h] 1'


def test_the_dashboard_imports_anywhere():
    """Grafana's format for sharing a dashboard: the data source is an input that the import asks
    for (or a variable of the same name, where the file is provisioned), every panel and query
    reads it, panel ids are unique and the panels tile the 24-column grid without overlapping."""
    board = dashboard()
    assert [(i["name"], i["type"], i["pluginId"]) for i in board["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    assert isinstance(board["schemaVersion"], int) and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == source, variable["name"]
    ids, cells = set(), {}
    for panel in panels(board):
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"] and panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["expr"].strip(), (panel["title"], target["refId"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def _one_server(capture: Path) -> str:
    """The fixture's capture of vLLM: one server; its id."""
    shutil.copytree(FIXTURE, capture)
    return SERVER


def _two_ranks(capture: Path) -> str:
    """Two data-parallel ranks of one server, built by hand (tests/helpers/ranks.py); rank 0's id."""
    write_ranks(capture)
    return RANK0


# per folder: what it holds, the labels of its servers, and the figures it determines by panel title and legend
# (per server where the panel shows each; the exporter's own tests check the rest)
FOLDERS = {
    "one server": (_one_server, [], {**EXACT}),
    "two ranks": (_two_ranks, ["dp0", "dp1"], {
        **EXACT, ("Thrash verdict", "A"): {"dp0": 2.0, "dp1": 0.0},   # rank 0 sustained, rank 1 none
        ("KV pool in use", "A"): {"dp0": 1.0, "dp1": 6 / 16}, ("KV blocks", "D"): {"dp0": 16.0, "dp1": 16.0}}),
}


def _figures(result: list[dict], expected: float | dict[str, float]) -> list[float] | dict[str, float]:
    """A query's values: a list, or by server where `expected` is."""
    if isinstance(expected, dict):
        return {r["metric"].get("server", ""): float(r["value"][1]) for r in result}
    return [float(r["value"][1]) for r in result]


def _selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, label matchers) of each selector of `expr` that has matchers."""
    return re.findall(r"([A-Za-z_:][\w:]*)\{([^}]*)\}", expr)


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's prometheus package; "
                                               "scripts/test.sh installs it)")
@pytest.mark.parametrize("folder", FOLDERS)
def test_every_panel_queries_what_a_real_exporter_serves(tmp_path, folder):
    build, servers, exact = FOLDERS[folder]
    capture = tmp_path / "capture"
    server = build(capture)
    (capture / "servers" / f"{server}.dropped.json").write_text(json.dumps(   # as the capture's sink writes it
        {"server_id": server, "dropped_chunks": 2, "dropped_rows": 80, "reason": "the disk was slower than the "
         "capture (its queue of 8 chunks was full)", "spans": []}))
    (capture / "chunks" / "notes.txt").write_text("not a chunk\n")
    with exporter_scraped(capture, tmp_path) as scrape:
        def answer(path: str, **params: str) -> dict:
            """Prometheus's answer, an error's included (it answers 400 or 422 with a JSON body)."""
            try:
                url = f"{scrape.api}/{path}?{urllib.parse.urlencode(params)}"
                with urllib.request.urlopen(url, timeout=10) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                return json.loads(exc.read())

        board = dashboard()
        instance = f"127.0.0.1:{scrape.exporter_port}"
        values = {"job": "kvtrace", "instance": re.escape(instance).replace("\\", "\\\\"), "server": ".*",   # All
                  "__rate_interval": RATE_INTERVAL, "__interval": "15s", "__range": RANGE}
        exposition = wait("the exporter", lambda: get(f"http://{instance}/metrics"), (scrape.exporter,)).decode()
        families = list(text_string_to_metric_families(exposition))
        assert all(f.samples for f in families), [f.name for f in families if not f.samples]
        served = {s.name for f in families for s in f.samples}
        # the metrics of each server, labelled as capture run labels it (the health ones name a server by its id)
        per_server = {s.name for f in families for s in f.samples if s.labels.get("server") in servers}
        scraped = f"{scrape.api}/query?query=" + urllib.parse.quote(
            'count_over_time(kvtrace_steps_total{job="kvtrace"}[1m]) >= 3')
        wait("three scrapes", lambda: (body := get(scraped)) and json.loads(body)["data"]["result"] or None,
             (scrape.prometheus,))
        named, results = set(), {}
        for title, ref, expr in targets(board):
            names = metric_names(expr)
            assert names, (title, expr)
            assert names <= served | SCRAPE_SERIES, f"{title} ({ref}) queries {sorted(names - served)}, which " \
                                                    f"`kvtrace capture metrics` does not serve"
            named |= names
            for name, matchers in _selectors(expr):   # the server variable picks every figure of a server
                assert name not in per_server or 'server=~"$server"' in matchers, (title, ref, name)
            got = answer("query", query=grafana_expr(expr, values))
            assert got["status"] == "success", f"{title} ({ref}): {got.get('error')}\n{expr}"
            assert got["data"]["result"], f"{title} ({ref}) has no series on a capture that has data:\n{expr}"
            results[title, ref] = got["data"]["result"]
        missing = sorted(f.name for f in families if not {s.name for s in f.samples} & named)
        assert missing == [], f"served but on no panel of {DASHBOARD.name}: {missing}"
        for (title, ref), value in exact.items():
            want = value if isinstance(value, dict) else [value]
            assert _figures(results[title, ref], value) == pytest.approx(want), (title, results[title, ref])
        assert {r["metric"]["server"] for r in results["Chunks dropped", "A"]} == {server}
        for server_label in servers:   # one server chosen: its figures alone
            for title, ref, expr in targets(board):
                if (title, ref) in exact and isinstance(exact[title, ref], dict):
                    got = answer("query", query=grafana_expr(expr, {**values, "server": server_label}))
                    assert _figures(got["data"]["result"], exact[title, ref]) == pytest.approx(
                        {server_label: exact[title, ref][server_label]}), (title, server_label)
        expected = {"job": ["kvtrace"], "instance": [instance], "server": servers}
        for variable in board["templating"]["list"]:   # label_values(selector, label), as Grafana asks it
            if variable["type"] == "query":
                m = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
                got = answer(f"label/{m[2]}/values", **{"match[]": grafana_expr(m[1], values)})
                assert got["status"] == "success" and got["data"] == expected[m[2]], (m[2], got)
    assert scrape.exporter.returncode == 0 and "Traceback" not in scrape.output, scrape.output


def test_capture_dashboard_prints_the_packaged_file(tmp_path):
    result = CliRunner().invoke(app, ["capture", "dashboard"])
    assert result.exit_code == 0, result.output
    assert result.stdout == DASHBOARD.read_text() and json.loads(result.stdout)["uid"] == "kvtrace-capture"
    result = CliRunner().invoke(app, ["capture", "dashboard", "-o", str(tmp_path / "board.json")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "board.json").read_text() == DASHBOARD.read_text() and result.stdout == ""


def test_capture_dashboard_into_a_missing_folder_is_one_line(tmp_path):
    line = one_line_error(["capture", "dashboard", "-o", str(tmp_path / "missing" / "board.json")])
    assert f"{tmp_path / 'missing' / 'board.json'}: cannot write (No such file or directory)" in line
    assert not (tmp_path / "missing").exists()
