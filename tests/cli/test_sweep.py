"""kvtrace sweep: the grid, running points in parallel, resuming, the table, the knee sentence."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.cli.sweep import _record_command
from kvtrace.errors import KvtraceError
from kvtrace.sweep.grid import parse_range, parse_set, points, record_knobs
from kvtrace.sweep.view import OBJECTIVES, best_point, recommend
from kvtrace.trace import db
from tests.helpers.cli import interruptible, one_line_error

ROOT = Path(__file__).parents[2]
WORKLOAD = ROOT / "tests" / "fixtures" / "tiny.jsonl"
# the tiny model on a pool small enough to preempt, every request queued at t=0
SHARED = ["--model", "tiny", "--load-format", "dummy", "--backlog", "--num-gpu-blocks", "24", "--block-size", "4",
          "--max-requests", "10"]
# the same workload and pool on the simulated engine: the same decisions, on a virtual clock, so a
# point's every figure is the same wherever and however often it runs
SIM = ["--engine", "sim", "--hardware", "h100-sxm", *SHARED]
KNOBS = record_knobs(_record_command())


# --------------------------------------------------------------------------- the grid

def test_lists_and_ranges():
    assert parse_set("max_num_seqs=16,32,64", KNOBS) == ("max_num_seqs", ["16", "32", "64"])
    assert parse_range("max_num_seqs", "64:512:x2") == ["64", "128", "256", "512"]
    assert parse_range("max_num_seqs", "16:60:+16") == ["16", "32", "48"]
    assert parse_range("kv_cache_memory", "0.5GiB:2GiB:+0.5GiB") == ["0.5GiB", "1GiB", "1.5GiB", "2GiB"]
    assert parse_range("watermark", "0:0.1:+0.05") == ["0", "0.05", "0.1"]
    # dashes work as in the option's name; a range is recognised only without commas
    assert parse_set("preemption-mode=recompute,swap", KNOBS) == ("preemption_mode", ["recompute", "swap"])
    grid = {"a": ["1", "2"], "b": ["x", "y", "z"]}
    assert points(grid)[:4] == [{"a": "1", "b": "x"}, {"a": "1", "b": "y"}, {"a": "1", "b": "z"}, {"a": "2", "b": "x"}]
    assert len(points(grid)) == 6


def test_on_off_knobs_become_their_flags():
    prefix = KNOBS["enable_prefix_caching"]
    assert prefix.args("true") == ["--enable-prefix-caching"]
    assert prefix.args("false") == ["--no-enable-prefix-caching"]
    assert KNOBS["backlog"].args("false") == ["--no-backlog"]
    # a flag with no off form: off is its default, given by leaving it out
    assert KNOBS["no_token_ids"].args("false") == [] and KNOBS["no_token_ids"].args("true") == ["--no-token-ids"]
    assert KNOBS["max_num_seqs"].args("8") == ["--max-num-seqs", "8"]
    with pytest.raises(KvtraceError, match="not true or false"):
        parse_set("enable_prefix_caching=true,maybe", KNOBS)


@pytest.mark.parametrize("text, message", [
    ("64:32:x2", "empty"), ("64:512", "START:STOP"), ("64:512:x1", "never ends"), ("1:8:-1", "xFACTOR or"),
    ("a:b:+1", "not a number"), ("64::x2", "START:STOP"),
])
def test_bad_ranges(text, message):
    with pytest.raises(KvtraceError, match=message):
        parse_set(f"max_num_seqs={text}", KNOBS)


def test_workload_and_output_are_not_knobs():
    assert {"workload", "out", "quiet"}.isdisjoint(KNOBS)
    assert {"model", "preemption_mode", "num_gpu_blocks", "kv_cache_memory", "watermark"} <= set(KNOBS)


@pytest.mark.parametrize("args, message", [
    (["--set", "max_num_sequences=1,2"], "max_num_sequences: not an option of kvtrace record"),
    (["--set", "max_num_seqs="], "no values"),
    (["--set", "max_num_seqs=8:4:x2"], "range is empty"),
    (["--set", "max_num_seqs=8:4"], "START:STOP:xFACTOR"),
    (["--set", "max_num_seqs=1:200:+1", "--set", "seed=1:60:+1"], "12,000 points"),
    (["--set", "max_num_seqs=1,2", "--max-num-seqs", "4"], "both shared and swept"),
    (["--set", "max_num_seqs=1,2", "--bogus-option", "4"], "--bogus-option: not an option of kvtrace record"),
    (["--set", "max_num_seqs=1,x"], "point 1 (max_num_seqs=x)"),
])
def test_bad_input_runs_nothing(tmp_path, args, message):
    out = tmp_path / "sweep"
    line = one_line_error(["sweep", "-w", str(WORKLOAD), *SHARED, *args, "-o", str(out)])
    assert message in line
    assert not (out / "runs").exists()


@pytest.mark.long  # runs a sweep of recordings (tens of seconds)
def test_a_sweep_whose_points_all_fail_stops_early(tmp_path):
    out = tmp_path / "failing"
    result = CliRunner().invoke(app, ["sweep", "-w", str(WORKLOAD), "--model", "tiny", "--num-gpu-blocks", "2",
                                      "--set", "max_num_seqs=1:8:+1", "--jobs", "1", "-o", str(out)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("kvtrace: error: the first 2 points all failed, so the sweep stopped: ")
    assert "can never fit the KV pool" in line and "error: kvtrace: error" not in line
    saved = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in saved["points"]] == ["failed", "failed"] + ["pending"] * 6


def test_a_folder_holding_another_sweep_is_refused(tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "holds no sweep.json" in one_line_error(["sweep", "-w", str(WORKLOAD), "--set", "max_num_seqs=1,2",
                                                    "-o", str(out)])
    other = tmp_path / "other"
    other.mkdir()
    (other / "sweep.json").write_text(json.dumps({
        "version": 1, "name": "other", "workload": str(WORKLOAD), "workload_sha256": "0", "shared_args": [],
        "grid": {"max_num_seqs": ["1", "2"]}, "points": []}))
    line = one_line_error(["sweep", "-w", str(WORKLOAD), "--set", "max_num_seqs=1,2", "-o", str(other)])
    assert "holds another sweep" in line
    assert not (other / "runs").exists()


# --------------------------------------------------------------------------- the recommendation

def _row(index: int, seqs: int, goodput: float, preemptions: int, mode: str = "recompute") -> dict:
    return {"point": index, "run_id": f"p{index}", "settings": {"max_num_seqs": str(seqs), "preemption_mode": mode},
            "goodput_req_s": goodput, "itl_p99_ms": 100 / goodput if goodput else None, "preemptions": preemptions}


def test_the_knee_is_named():
    rows = [_row(0, 16, 20, 0), _row(1, 32, 35, 2), _row(2, 48, 41, 5), _row(3, 64, 36, 12), _row(4, 128, 31.5, 30)]
    sentence = recommend(rows, OBJECTIVES["goodput"])
    assert sentence.startswith("max_num_seqs 48 gives the highest goodput (41 req/s)")
    assert "above it preemptions rise 6x and goodput falls 23% by max_num_seqs 128" in sentence
    # the lowest ITL p99 is the same point: a min objective words it the other way round
    assert "ITL p99 rises 30%" in recommend(rows, OBJECTIVES["itl_p99"])


def test_no_knee_is_said_plainly():
    rising = [_row(i, s, g, 0) for i, (s, g) in enumerate([(16, 10), (32, 19), (64, 30)])]
    assert recommend(rising, OBJECTIVES["goodput"]).startswith(
        "No knee within the grid: goodput keeps improving up to max_num_seqs 64, the largest value swept")
    flat = [_row(i, s, g, 0) for i, (s, g) in enumerate([(16, 30), (32, 30.6), (64, 29.8)])]
    assert recommend(flat, OBJECTIVES["goodput"]).startswith("No knee: goodput stays within 5% of its best")
    nothing = [_row(i, s, 0.0, 0) for i, s in enumerate([16, 32, 64])]
    assert recommend(nothing, OBJECTIVES["goodput"]).startswith("No point has any goodput: it is 0 at every point")
    plateau = [_row(i, s, g, 0) for i, (s, g) in enumerate([(16, 10), (32, 30), (64, 29)])]
    assert "no knee, the plateau starts at 32" in recommend(plateau, OBJECTIVES["goodput"])


def test_the_knee_is_found_along_the_best_points_line():
    rows = [_row(0, 16, 10, 0, "recompute"), _row(1, 32, 20, 9, "recompute"), _row(2, 64, 12, 40, "recompute"),
            _row(3, 16, 11, 0, "swap"), _row(4, 32, 25, 5, "swap"), _row(5, 64, 24.5, 6, "swap")]
    assert best_point(rows, OBJECTIVES["goodput"])["point"] == 4
    sentence = recommend(rows, OBJECTIVES["goodput"])
    assert sentence.startswith("max_num_seqs 32, preemption_mode swap gives the highest goodput")
    assert "(with preemption_mode swap)" in sentence and "plateau starts at 32" in sentence


# --------------------------------------------------------------------------- running sweeps

def _sweep(out: Path, *args: str, shared: list[str] = SIM) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtrace", "sweep", "-w", str(WORKLOAD), *shared, *args,
                           "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)


def _show(out: Path) -> dict:
    result = CliRunner().invoke(app, ["sweep", "show", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def twelve_points(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweeps") / "twelve"
    result = _sweep(out, "--set", "max_num_seqs=2:8:x2", "--set", "preemption_mode=recompute,swap",
                    "--set", "enable_prefix_caching=true,false", "--jobs", "2")
    assert result.returncode == 0, result.stderr
    assert "goodput" in result.stdout.strip().splitlines()[-1]  # the recommendation closes the table
    return out


@pytest.mark.long  # runs a sweep of recordings (tens of seconds)
def test_twelve_points_in_parallel_match_each_runs_own_analyses(twelve_points):
    """On the simulated engine, in parallel: the table is each run's own summary."""
    shown = _show(twelve_points)
    assert shown["grid"] == {"max_num_seqs": ["2", "4", "8"], "preemption_mode": ["recompute", "swap"],
                             "enable_prefix_caching": ["true", "false"]}
    assert [p["point"] for p in shown["points"]] == list(range(12)) and not shown["not_completed"]
    for row in shown["points"]:
        run = twelve_points / "runs" / row["run_id"]
        meta = json.loads((run / "meta.json").read_text())
        config = meta["engine_config"]
        assert str(config["max_num_seqs"]) == row["settings"]["max_num_seqs"]
        assert config["preemption_mode"] == row["settings"]["preemption_mode"]
        assert str(config["enable_prefix_caching"]).lower() == row["settings"]["enable_prefix_caching"]
        own = db.records(db.run_analysis(db.connect([run]), "summary"))[0]
        for column in ("output_tok_s", "useful_tok_s", "goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                       "itl_p99_ms", "preemptions", "recomputed_tokens", "recompute_share", "thrash_verdict"):
            assert row[column] == own[column], (row["run_id"], column)
        assert row["swap_bytes"] == own["swap_out_bytes"] + own["swap_in_bytes"]
    # the pool is tight: the grid spans runs that preempt and swap
    assert max(p["preemptions"] for p in shown["points"]) > 0
    assert any(p["swap_bytes"] > 0 for p in shown["points"] if p["settings"]["preemption_mode"] == "swap")
    assert all(p["swap_bytes"] == 0 for p in shown["points"] if p["settings"]["preemption_mode"] == "recompute")


def test_every_point_is_a_normal_run(twelve_points):
    result = CliRunner().invoke(app, ["sql", str(twelve_points / "runs"), "--format", "json",
                                      "SELECT count(*) AS n FROM runs WHERE status = 'completed'"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["n"] == 12
    report = twelve_points / "sweep.html"
    result = CliRunner().invoke(app, ["report", str(twelve_points), "-o", str(report)])
    assert result.exit_code == 0, result.output
    page = report.read_text()
    specs = json.loads(page.split("var specs = ", 1)[1].split(";\n", 1)[0].replace("<\\/", "</"))
    goodput = specs["sweep-goodput_req_s"]
    values = goodput["layer"][0]["data"]["values"] if "data" in goodput["layer"][0] else goodput["data"]["values"]
    assert len(values) == 12 and sum(v["best"] for v in values) == 1
    assert {v["line"] for v in values} == {f"preemption_mode={m}, enable_prefix_caching={c}"
                                           for m in ("recompute", "swap") for c in ("true", "false")}


def test_rerunning_a_completed_sweep_runs_nothing(twelve_points):
    before = {p.name: (p / "meta.json").stat().st_mtime_ns for p in (twelve_points / "runs").iterdir()}
    result = _sweep(twelve_points, "--set", "max_num_seqs=2:8:x2", "--set", "preemption_mode=recompute,swap",
                    "--set", "enable_prefix_caching=true,false", "--jobs", "2")
    assert result.returncode == 0, result.stderr
    assert "12 already completed, 0 to run" in result.stderr
    assert before == {p.name: (p / "meta.json").stat().st_mtime_ns for p in (twelve_points / "runs").iterdir()}


@pytest.mark.long  # runs a sweep of recordings (tens of seconds)
def test_interrupted_sweep_resumes_with_only_the_missing_points(tmp_path):
    out = tmp_path / "resume"
    args = ["--set", "max_num_seqs=1:6:+1", "--jobs", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "sweep", "-w", str(WORKLOAD), *SHARED, *args,
                             "-o", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        statuses = [json.loads(m.read_text()).get("status") for m in out.glob("runs/*/meta.json")]
        if statuses.count("completed") >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "re-run the same command to resume" in stderr
    saved = json.loads((out / "sweep.json").read_text())
    done = {p["run_id"] for p in saved["points"] if p["status"] == "completed"}
    assert 2 <= len(done) < 6
    assert all(p["status"] in ("pending", "interrupted") for p in saved["points"] if p["run_id"] not in done)
    kept = {name: (out / "runs" / name / "meta.json").stat().st_mtime_ns for name in done}

    result = _sweep(out, *args, shared=SHARED)
    assert result.returncode == 0, result.stderr
    assert f"{len(done)} already completed, {6 - len(done)} to run" in result.stderr
    assert kept == {name: (out / "runs" / name / "meta.json").stat().st_mtime_ns for name in done}
    assert len(_show(out)["points"]) == 6


@pytest.mark.long  # runs a sweep of recordings (tens of seconds)
@pytest.mark.skipif(os.environ.get("KVTRACE_SKIP_RAY") == "1", reason="KVTRACE_SKIP_RAY=1")
def test_ray_gives_the_same_table(tmp_path, twelve_points):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    result = _sweep(out, "--set", "max_num_seqs=2:8:x2", "--set", "preemption_mode=recompute,swap",
                    "--set", "enable_prefix_caching=true,false", "--ray")
    assert result.returncode == 0, result.stderr
    assert "Ray at local" in result.stderr
    local, ray = _show(twelve_points)["points"], _show(out)["points"]
    assert [p["settings"] for p in ray] == [p["settings"] for p in local]
    # simulated time: the same table, figure for figure
    def figures(rows):
        return [{k: v for k, v in row.items() if k not in ("run_id", "sweep")} for row in rows]
    assert figures(ray) == figures(local)
    assert [p["run_id"] for p in ray] == [p["run_id"].replace("twelve-", "ray-", 1) for p in local]


def _synth(path: Path, *args: str) -> Path:
    result = CliRunner().invoke(app, ["workload", "synth", *args, "--seed", "5", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


# short prompts, long answers, on a 2 GiB pool of a simulated Llama-3-8B on an H100
KNEE_RECORD = ["--engine", "sim", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--kv-cache-memory", "2GiB",
               "--max-num-batched-tokens", "8192"]


@pytest.mark.long  # runs a sweep of recordings (tens of seconds)
def test_a_workload_built_to_have_a_knee_gets_it_named(tmp_path):
    """Admitting more sequences than the pool can carry to the end of their answers: past the knee
    the engine preempts and re-prefills, and the streams stall."""
    workload = _synth(tmp_path / "long-answers.jsonl", "--num-requests", "120", "--rate", "20", "--prompt-median",
                      "150", "--prompt-sigma", "0.6", "--output-median", "600", "--output-sigma", "0.7")
    out = tmp_path / "knee"
    result = subprocess.run([sys.executable, "-m", "kvtrace", "sweep", "-w", str(workload), *KNEE_RECORD,
                             "--set", "max_num_seqs=8:64:x2", "--objective", "itl_p99", "-o", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    points = _show(out)["points"]
    by_seqs = {int(p["settings"]["max_num_seqs"]): p for p in points}
    assert by_seqs[8]["preemptions"] == 0 and by_seqs[64]["preemptions"] > 50
    assert by_seqs[64]["itl_p99_ms"] > 1.5 * by_seqs[8]["itl_p99_ms"]
    sentence = result.stdout.strip().splitlines()[-1]
    assert sentence.startswith("max_num_seqs 8 gives the lowest ITL p99"), sentence
    assert f"above it preemptions rise from 0 to {by_seqs[64]['preemptions']:,} and ITL p99 rises" in sentence


@pytest.mark.long  # runs a sweep of recordings (tens of seconds)
def test_a_workload_without_a_knee_is_said_to_have_none(tmp_path):
    """Light traffic that the pool carries at every cap: the cap does not matter."""
    workload = _synth(tmp_path / "light.jsonl", "--num-requests", "40", "--rate", "1", "--prompt-median", "150",
                      "--output-median", "100")
    out = tmp_path / "flat"
    result = subprocess.run([sys.executable, "-m", "kvtrace", "sweep", "-w", str(workload), *KNEE_RECORD,
                             "--set", "max_num_seqs=8:64:x2", "-o", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    assert all(p["preemptions"] == 0 for p in _show(out)["points"])
    sentence = result.stdout.strip().splitlines()[-1]
    assert sentence.startswith("No knee: goodput stays within 5% of its best"), sentence


# --------------------------------------------------------------------------- a run's traffic

def test_the_traffic_to_replay_is_one_of_a_workload_and_a_run(tmp_path):
    line = one_line_error(["sweep", *SHARED, "--set", "max_num_seqs=1,2", "-o", str(tmp_path / "s")])
    assert line == "kvtrace: error: give the traffic to replay: --workload FILE or --from-run RUN (one of them)"
    line = one_line_error(["sweep", "-w", str(WORKLOAD), "--from-run", str(tmp_path), "--set", "max_num_seqs=1,2"])
    assert line == "kvtrace: error: give the traffic to replay: --workload FILE or --from-run RUN (one of them)"
    assert "cannot be turned into a workload: no meta.json" in one_line_error(
        ["sweep", "--from-run", str(tmp_path), *SHARED, "--set", "max_num_seqs=1,2", "-o", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()


@pytest.mark.long  # a recording, then a sweep of two (tens of seconds)
def test_a_sweep_of_a_runs_traffic_replays_its_workload_and_resumes(tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["record", "-w", str(WORKLOAD), *SIM, "-o", str(run), "-q"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "sweep"
    args = ["sweep", "--from-run", str(run), *SIM, "--set", "max_num_seqs=2,8", "--jobs", "2", "-o", str(out)]
    result = subprocess.run([sys.executable, "-m", "kvtrace", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["workload"] == str(out / "from-run.jsonl")
    assert [p["status"] for p in saved["points"]] == ["completed", "completed"]
    assert "prefix structure from tokens" in (out / "from-run.jsonl").read_text()
    # the same command again resumes (the workload made again is the same bytes); another run is another sweep
    again = subprocess.run([sys.executable, "-m", "kvtrace", *args], capture_output=True, text=True)
    assert again.returncode == 0 and "2 already completed, 0 to run" in again.stderr
    before = (out / "from-run.jsonl").read_bytes()
    other = tmp_path / "other-run"
    result = CliRunner().invoke(app, ["record", "-w", str(WORKLOAD), *SIM, "--max-requests", "5", "-o", str(other), "-q"])
    assert result.exit_code == 0, result.output
    line = one_line_error(["sweep", "--from-run", str(other), *SIM, "--set", "max_num_seqs=2,8", "-o", str(out)])
    assert "holds another sweep (its workload_sha256 differ)" in line
    assert (out / "from-run.jsonl").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no staged file left


# --------------------------------------------------------------------------- a capture's window, swept

CAPTURE = ROOT / "tests" / "fixtures" / "captures" / "bursts"


def test_a_captures_model_is_mapped_to_the_simulators_or_refused_in_one_line(tmp_path):
    from kvtrace.sweep.from_run import simulator_model

    assert simulator_model("smollm2-135m") == ("smollm2-135m", None)
    assert simulator_model("/models/SmolLM2-135M-Instruct")[0] == "smollm2-135m"
    assert simulator_model("meta-llama/Llama-3.1-8B-Instruct") == (
        "llama-3-8b", "served as 'meta-llama/Llama-3.1-8B-Instruct', the same shape")
    assert simulator_model("mistralai/Mistral-7B-Instruct-v0.3")[0] == "mistral-7b"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert simulator_model(str(tmp_path / "mine")) == (str(tmp_path / "mine"), None)
    with pytest.raises(KvtraceError, match="'openai/gpt-oss-20b' is no model the simulator knows: pass --model"):
        simulator_model("openai/gpt-oss-20b")


def test_the_vllm_flags_of_a_point():
    from kvtrace.sweep.from_run import vllm_args

    assert vllm_args({"max_num_seqs": "64", "num_gpu_blocks": "2048", "enable_prefix_caching": "false",
                      "preemption_policy": "newest"}) == (
        "--max-num-seqs 64 --num-gpu-blocks-override 2049 --no-enable-prefix-caching --scheduling-policy fcfs")
    assert "vLLM V1 always recomputes" in vllm_args({"preemption_mode": "swap"})


def test_a_sweep_of_a_captures_window_needs_no_option_copied_by_hand(tmp_path):
    """The run of a capture names its model as served, its pool and limits: the sweep reads them, says
    what it took, runs the simulator, and words its best point as vLLM flags; a model the simulator does
    not know is one line."""
    run = tmp_path / "window"
    assert CliRunner().invoke(app, ["capture", "run", str(CAPTURE), "-o", str(run)]).exit_code == 0
    out = tmp_path / "sweep"
    args = ["sweep", "--from-run", str(run), "--set", "num_gpu_blocks=12,16,24,48", "--jobs", "2", "-o", str(out)]
    result = subprocess.run([sys.executable, "-m", "kvtrace", *args], capture_output=True, text=True, cwd=tmp_path,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert ("sweep: from the run: --model smollm2-135m --block-size 32 --max-num-seqs 16 --max-num-batched-tokens 2048 "
            "--max-model-len 271 --enable-prefix-caching --engine sim") in result.stderr
    assert "the simulator models an h100-sxm" in result.stderr
    shared = json.loads((out / "sweep.json").read_text())["shared_args"]
    assert shared[shared.index("--model") + 1] == "smollm2-135m" and "--num-gpu-blocks" not in shared  # swept
    shown = _show(out)
    best = best_point(shown["points"], OBJECTIVES["goodput"])
    lines = result.stdout.strip().splitlines()
    if not lines[-1].startswith("No "):
        assert lines[-2] == f"the best point as vLLM engine arguments: --num-gpu-blocks-override " \
                            f"{int(best['settings']['num_gpu_blocks']) + 1}"   # vLLM's null block
        assert shown["best_as_vllm_args"] == lines[-2].split(": ", 1)[1]
    meta = json.loads((run / "meta.json").read_text())
    meta["engine_config"]["model"] = meta["model"]["name"] = "gpt-oss-20b"
    (run / "meta.json").write_text(json.dumps(meta))
    line = one_line_error(["sweep", "--from-run", str(run), "--set", "max_num_seqs=4,8", "-o", str(tmp_path / "x")])
    assert "the run's model 'gpt-oss-20b' is no model the simulator knows: pass --model" in line
    assert not (tmp_path / "x").exists()


def test_a_captures_kv_cache_groups_must_be_the_simulated_models(tmp_path):
    """A what-if on a hybrid server's capture models its groups or says why not: vLLM's Llama reads a
    config's layer_types, kvtrace (as transformers) does not, and the pool would be another."""
    from kvtrace.sweep.from_run import check_kv_cache_groups

    captured = [{"kind": "full_attention", "block_size": 16}, {"kind": "sliding_window", "block_size": 16,
                                                                "sliding_window": 64}]
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "layer_types": ["full_attention", "sliding_attention"],
              "sliding_window": 64}
    for model_type in ("llama", "ministral"):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(KvtraceError, match="the run's KV cache is full attention \\+ sliding window 64 tok .*"
                                           "as full attention: pass --model"):
        check_kv_cache_groups(captured, str(tmp_path / "llama"))
    with pytest.raises(KvtraceError, match="as full attention:"):
        check_kv_cache_groups(captured, "tiny")
    check_kv_cache_groups(captured, str(tmp_path / "ministral"))   # the same layers: nothing to say
    check_kv_cache_groups([], "tiny")                              # a capture of one group names none
    with pytest.raises(KvtraceError, match="chunked_local \\+ full attention"):
        check_kv_cache_groups([{"kind": "full_attention"}, {"kind": "chunked_local", "attention_chunk_size": 64}],
                              str(tmp_path / "ministral"))
