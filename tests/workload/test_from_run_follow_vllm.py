"""`workload from-run` and `sweep --from-run` carry the vLLM version the run followed, so that a replay of a
vLLM 0.33 capture follows 0.33 unless told otherwise; a version kvtrace cannot follow gets a note and the
default (kvtrace/workload/header.py)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from engine.config import VLLM_VERSION
from kvtrace.cli.app import app
from kvtrace.cli.sweep import _open_from_run, _record_command
from kvtrace.sweep.from_run import run_options
from kvtrace.sweep.grid import record_knobs
from kvtrace.workload.from_run import run_follow_vllm
from kvtrace.workload.header import header_follow_vllm, resolve_follow_vllm
from tests.helpers.cli import record, write_workload

KNOBS = record_knobs(_record_command())

POOL = ["--engine", "sim", "--dtype", "float32", "--block-size", "4", "--num-gpu-blocks", "24", "--watermark", "0"]
ROWS = [{"id": "a", "arrival_s": 0, "prompt_tokens": 9, "max_tokens": 3},
        {"id": "b", "arrival_s": 0.5, "prompt_tokens": 12, "max_tokens": 2}]


@pytest.mark.parametrize("meta, expected", [
    ({"vllm": {"version": "0.33.0"}, "engine_config": {"engine": "vllm"}},
     ("0.33.0", "the run is vLLM 0.33.0's", None)),
    ({"vllm": {"version": "0.32.0+cpu"}}, ("0.32.0", "the run is vLLM 0.32.0+cpu's", None)),
    ({"engine_config": {"engine": "sim", "follow_vllm": "0.33.0"}},
     ("0.33.0", "the run's engine followed vLLM 0.33.0", None)),
    ({"engine_config": {"engine": "sim"}}, (None, None, None)),   # a run from before --follow-vllm
    ({"vllm": {"version": None}}, (None, None, None)),
])
def test_the_version_a_run_followed(meta, expected):
    assert run_follow_vllm(meta) == expected


def test_a_version_kvtrace_cannot_follow_is_a_note_not_a_version():
    version, followed, note = run_follow_vllm({"vllm": {"version": "0.34.1"}})
    assert (version, followed) == (None, None)
    assert note == ("vLLM version: the run is vLLM 0.34.1's, which kvtrace cannot follow (it follows "
                    "0.31.0, 0.32.0, 0.33.0, 0.34.0): a replay follows the default 0.32.0 unless --follow-vllm says otherwise")


def test_the_header_is_followed_unless_the_user_says_otherwise(tmp_path):
    plain = write_workload(tmp_path / "plain.jsonl", ROWS)
    assert resolve_follow_vllm(None, plain) == (VLLM_VERSION, None)
    headed = tmp_path / "headed.jsonl"
    headed.write_text("# kvtrace workload from-run r\n# follow_vllm: 0.33.0 (the run is vLLM 0.33.0's)\n"
                      + plain.read_text())
    assert header_follow_vllm(headed) == "0.33.0"
    assert resolve_follow_vllm(None, headed) == (
        "0.33.0", "following vLLM 0.33.0, as the workload's header says (--follow-vllm overrides)")
    assert resolve_follow_vllm("0.32.0", headed) == ("0.32.0", None)
    # only the leading comment lines are the header
    late = tmp_path / "late.jsonl"
    late.write_text(plain.read_text() + "# follow_vllm: 0.33.0\n")
    assert header_follow_vllm(late) is None
    odd = tmp_path / "odd.jsonl"
    odd.write_text("# follow_vllm: 0.30.0\n" + plain.read_text())
    assert resolve_follow_vllm(None, odd) == (
        VLLM_VERSION, ("the workload's header names vLLM 0.30.0, which kvtrace cannot follow (it follows "
                       "0.31.0, 0.32.0, 0.33.0, 0.34.0): following the default 0.32.0"))


def a_run_of(tmp_path, name: str, vllm_version: str | None, *args: str):
    """A simulated run whose meta.json says what a vLLM capture's says: `vllm.version`."""
    result, run = record(tmp_path, write_workload(tmp_path / f"{name}.jsonl", ROWS), name, *POOL, *args)
    assert result.exit_code == 0, result.output
    if vllm_version is not None:
        meta = json.loads((run / "meta.json").read_text())
        meta["vllm"] = {"version": vllm_version}
        (run / "meta.json").write_text(json.dumps(meta))
    return run


def from_run(run, out) -> str:
    result = CliRunner().invoke(app, ["workload", "from-run", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return result.stderr


def followed(run) -> str:
    return json.loads((run / "meta.json").read_text())["engine_config"]["follow_vllm"]


def test_a_replay_of_a_033_capture_follows_033_unless_told_otherwise(tmp_path):
    run = a_run_of(tmp_path, "capture", "0.33.0")
    out = tmp_path / "w.jsonl"
    assert "a replay follows vLLM 0.33.0 (the run is vLLM 0.33.0's)" in from_run(run, out)
    assert "# follow_vllm: 0.33.0 (the run is vLLM 0.33.0's)\n" in out.read_text()
    result, replay = record(tmp_path, out, "replay", *POOL)
    assert result.exit_code == 0, result.output
    assert followed(replay) == "0.33.0"
    assert json.loads((replay / "meta.json").read_text())["scheduling"]["follows"].startswith("vLLM 0.33.0")
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "-w", str(out), "-o", str(tmp_path / "loud"), *POOL])
    assert result.exit_code == 0, result.output
    assert "kvtrace: following vLLM 0.33.0, as the workload's header says (--follow-vllm overrides)" in result.stderr
    result, told = record(tmp_path, out, "told", *POOL, "--follow-vllm", "0.32.0")
    assert result.exit_code == 0, result.output
    assert followed(told) == "0.32.0"


def test_a_kvtrace_run_carries_the_version_its_engine_followed(tmp_path):
    run = a_run_of(tmp_path, "sim", None, "--follow-vllm", "0.33.0")
    out = tmp_path / "w.jsonl"
    from_run(run, out)
    assert "# follow_vllm: 0.33.0 (the run's engine followed vLLM 0.33.0)\n" in out.read_text()


def test_a_version_kvtrace_cannot_follow_falls_back_to_the_default_and_says_so(tmp_path):
    run = a_run_of(tmp_path, "capture", "0.35.0")
    out = tmp_path / "w.jsonl"
    stderr = from_run(run, out)
    assert "vLLM version: the run is vLLM 0.35.0's, which kvtrace cannot follow" in stderr
    text = out.read_text()
    assert "# vLLM version: the run is vLLM 0.35.0's, which kvtrace cannot follow" in text
    assert header_follow_vllm(out) is None   # the note names no version to follow
    result, replay = record(tmp_path, out, "replay", *POOL)
    assert result.exit_code == 0, result.output
    assert followed(replay) == VLLM_VERSION


@pytest.mark.parametrize("shared, grid, expected", [
    ([], {"max_num_seqs": ["2", "8"]}, ["--follow-vllm", "0.33.0"]),
    (["--follow-vllm", "0.32.0"], {"max_num_seqs": ["2", "8"]}, ["--follow-vllm", "0.32.0"]),
    (["--follow-vllm=0.32.0"], {"max_num_seqs": ["2", "8"]}, ["--follow-vllm=0.32.0"]),
    ([], {"follow_vllm": ["0.32.0", "0.33.0"]}, []),
])
def test_a_sweep_of_a_033_capture_shares_its_version_unless_the_user_sets_one(tmp_path, capsys, shared, grid,
                                                                             expected):
    run = a_run_of(tmp_path, "capture", "0.33.0")
    capsys.readouterr()
    taken, _ = run_options(run, shared, grid, KNOBS)   # the run's model and pool (tests/cli/test_sweep.py)
    sweep = _open_from_run(tmp_path / "sweep", "sweep", run, shared, grid, KNOBS)
    assert sweep.spec.shared_args == [*shared, *taken, *expected[len(shared):]]
    said = capsys.readouterr().err
    assert ("sweep: every point follows vLLM 0.33.0 (the run is vLLM 0.33.0's)" in said) == (not shared and
                                                                                          "follow_vllm" not in grid)
    assert "# follow_vllm: 0.33.0" in (tmp_path / "sweep" / "from-run.jsonl").read_text()


def test_a_sweep_of_a_run_kvtrace_cannot_follow_says_so_and_shares_nothing(tmp_path, capsys):
    run = a_run_of(tmp_path, "capture", "0.35.0")
    capsys.readouterr()
    taken, _ = run_options(run, [], {"max_num_seqs": ["2", "8"]}, KNOBS)
    sweep = _open_from_run(tmp_path / "sweep", "sweep", run, [], {"max_num_seqs": ["2", "8"]}, KNOBS)
    assert sweep.spec.shared_args == taken and "--follow-vllm" not in taken
    assert "sweep: vLLM version: the run is vLLM 0.35.0's, which kvtrace cannot follow" in capsys.readouterr().err
