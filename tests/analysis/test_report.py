"""`kvtrace report`: the HTML holds every chart and opens offline, the charts draw in headless
Chromium without a script error, --format svg / png write one file per chart, and the errors."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.trace import db
from kvtrace.views import report
from tests.helpers.cli import one_line_error
from tests.helpers.report import specs_of

RUNS = Path(__file__).parents[1] / "fixtures" / "runs"
RECOMPUTE, SWAP = RUNS / "tiny-recompute", RUNS / "tiny-swap"
CHARTS = ["pool_occupancy", "request_gantt", "itl_cdf", "latency_distributions", "recompute_swap"]

runner = CliRunner()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    result = runner.invoke(app, ["report", str(RECOMPUTE), str(SWAP), "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


def test_the_page_holds_every_chart_for_every_run(page):
    html = page.read_text()
    for name in CHARTS:
        assert f"id='chart-{name}'" in html, name
    specs = specs_of(html)
    assert list(specs) == CHARTS
    for name, spec in specs.items():
        assert "tiny-recompute" in json.dumps(spec) and "tiny-swap" in json.dumps(spec), f"{name}: both runs"
    assert "tiny-recompute" in html.split("<h1>")[1]


def test_the_page_opens_offline(page):
    html = page.read_text()
    assert not re.search(r"<script[^>]*\bsrc=", html), "scripts are inlined, none is fetched"
    assert not re.search(r"<link[^>]*\bhref=\"?https?:", html)
    assert "window.vegaEmbed=" in html.replace(" ", ""), "the vega-embed bundle is inlined"
    assert html.count("window.vegaEmbed") == 1, "the bundle is inlined once, not per chart"


@pytest.mark.long  # renders charts to files
def test_timelines_are_downsampled():
    """A chart's data grows with the buckets asked for, not with the run's steps."""
    con = db.connect([RECOMPUTE, SWAP])
    charts = {c.name: c.chart.to_dict() for c in report.build(con, buckets=40, requests=3)}
    pool = charts["pool_occupancy"]
    assert len(pool["data"]["values"]) == 2 * 40
    rates = charts["recompute_swap"]["data"]["values"]     # shared by its two panels
    assert len(rates) == 2 * (40 // report.RATE_BUCKETS_DIVISOR)
    gantt_requests = {row["req_id"] for row in charts["request_gantt"]["data"]["values"]}
    top = db.run_analysis(con, "most_preempted", limit=3).column("req_id").to_pylist()
    assert gantt_requests == set(top)


# --------------------------------------------------------------------------- in a browser

class ChartDom(HTMLParser):
    """The root's data-errors and, per chart container, whether it rendered and its SVG elements."""

    def __init__(self):
        super().__init__()
        self.errors: str | None = None
        self.charts: dict[str, dict] = {}
        self.stack: list[tuple[str, str | None]] = []     # (tag, chart name it opens, if any)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "html" and not self.stack:
            self.errors = attrs.get("data-errors")
        chart = None
        if (attrs.get("id") or "").startswith("chart-"):
            chart = attrs["id"].removeprefix("chart-")
            self.charts[chart] = {"rendered": attrs.get("data-rendered"), "svg": 0, "marks": 0}
        inside = [name for _, name in self.stack if name]
        if inside and tag == "svg":
            self.charts[inside[-1]]["svg"] += 1
        if inside and tag in ("path", "rect", "line", "text"):
            self.charts[inside[-1]]["marks"] += 1
        if tag not in ("meta", "link", "br", "img", "input", "hr", "source"):
            self.stack.append((tag, chart))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                return


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.browser
def test_the_charts_draw_in_headless_chromium(page):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary (scripts/test.sh installs one)")
    result = subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = ChartDom()
    dom.feed(result.stdout)
    assert dom.errors is None, f"script errors: {dom.errors}"
    assert set(dom.charts) == set(CHARTS)
    for name, chart in dom.charts.items():
        assert chart["rendered"] == "true", name
        assert chart["svg"] >= 1 and chart["marks"] > 20, f"{name}: {chart}"


# --------------------------------------------------------------------------- single charts and errors

@pytest.mark.long  # renders charts to files
def test_svg_writes_one_file_per_chart(tmp_path):
    result = runner.invoke(app, ["report", str(SWAP), "--format", "svg", "-o", str(tmp_path / "charts")])
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "charts").iterdir())
    assert files == sorted(f"{name}.svg" for name in CHARTS)
    for name in CHARTS:
        text = (tmp_path / "charts" / f"{name}.svg").read_text()
        assert text.lstrip().startswith("<svg") and "<path" in text, name


@pytest.mark.long  # renders charts to files
def test_png(tmp_path):
    result = runner.invoke(app, ["report", str(RECOMPUTE), "--format", "png", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    png = (tmp_path / "pool_occupancy.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # IHDR
    assert width >= report.WIDTH and height >= 240, (width, height)  # the chart's size, not an empty image


def test_errors(tmp_path):
    assert "no such run folder" in one_line_error(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")])
    assert "is a folder" in one_line_error(["report", str(SWAP), "-o", str(tmp_path)])
    (tmp_path / "file").write_text("")
    assert "not a folder" in one_line_error(["report", str(SWAP), "--format", "svg", "-o", str(tmp_path / "file")])
    assert "--buckets must be >= 1" in one_line_error(["report", str(SWAP), "--buckets", "0"])
    assert "unknown param nope" in one_line_error(["report", str(SWAP), "-p", "nope=1"])


def test_params_reach_the_analyses(tmp_path):
    con = db.connect([SWAP])
    charts = {c.name: c.chart.to_dict() for c in report.build(con, params={"threshold_ms": "1"})}
    assert "threshold_ms\":1.0" in json.dumps(charts["itl_cdf"], separators=(",", ":")).replace(" ", "")
