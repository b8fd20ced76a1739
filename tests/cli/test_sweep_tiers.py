"""kvtrace sweep of the host KV tier's size (--set offload_size=...): the operator's answer, the smallest
size past the knee and what it saves against no tier (kvtrace/sweep/view.py's tier_sizing)."""
from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.sweep.from_run import run_options, vllm_args
from kvtrace.sweep.view import tier_sizing
from kvtrace.vllm.follow import run_meta
from tests.cli.test_sweep import CAPTURE, KNOBS, SIM, WORKLOAD

# the tier capture.json names where vLLM serves with --kv-offloading-size 0.0625 (connector.py's kv_tiers)
TIER = {"name": "cpu", "num_blocks": 45, "bytes": 67108864.0, "block_size": 32, "policy": "lru", "link_gb_s": None}


def point(size: str, recomputed: int, ttft: float, itl: float, preemptions: int = 9, **settings: str) -> dict:
    return {"settings": {"offload_size": size, **settings}, "recomputed_tokens": recomputed, "ttft_p99_ms": ttft,
            "itl_p99_ms": itl, "preemptions": preemptions}


def test_the_smallest_size_past_the_knee_and_what_it_saves():
    points = [point("0", 1000, 900.0, 60.0), point("8GiB", 400, 700.0, 50.0), point("2GiB", 700, 800.0, 55.0),
              point("32GiB", 120, 650.0, 45.0, preemptions=11), point("128GiB", 100, 640.0, 44.0)]
    # the largest cuts 900; 32GiB is the first with 90% of that (880); vLLM's size is in GiB
    assert tier_sizing(points) == (
        "A host KV tier of 32GiB (vLLM: --kv-offloading-size 32) is the smallest past the knee in recomputed "
        "positions: against 0 it cuts them from 1,000 to 120 (−88%), TTFT p99 900 ms → 650 ms, ITL p99 60.0 ms → "
        "45.0 ms, preemptions 9 → 11; the largest, 128GiB, saves 20 more.")
    # the preemptions are said only where they change
    assert "preemptions" not in tier_sizing([point("0", 1000, 900.0, 60.0), point("512MiB", 100, 600.0, 40.0)])


def test_no_saving_is_said_plainly_and_other_sweeps_say_nothing():
    flat = [point("0", 50, 100.0, 10.0), point("4GiB", 50, 100.0, 10.0)]
    assert tier_sizing(flat).startswith("No host tier size swept (0..4GiB) recomputes fewer positions than 0 (50)")
    other = [{"settings": {"max_num_seqs": n}, "recomputed_tokens": 1, "ttft_p99_ms": 1.0, "itl_p99_ms": 1.0}
             for n in ("8", "16")]
    assert tier_sizing(other) is None


def test_a_sweep_of_tier_sizes_on_the_simulator_answers(tmp_path):
    out = tmp_path / "tiers"
    # no prefix cache keeps no block: without a tier the preempted requests recompute their prompts
    result = CliRunner().invoke(app, ["sweep", "-w", str(WORKLOAD), *SIM, "--set", "offload_size=0,64KiB,16MiB",
                                      "-o", str(out), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(app, ["sweep", "show", str(out), "--json"])
    data = json.loads(shown.output)
    by_size = {p["settings"]["offload_size"]: p["recomputed_tokens"] for p in data["points"]}
    assert by_size["16MiB"] < by_size["0"], by_size
    assert data["tier_sizing"].startswith("A host KV tier of "), data["tier_sizing"]


def test_vllms_flag_for_a_tier_is_in_gib_and_no_tier_is_none():
    assert vllm_args({"offload_size": "8GiB"}) == "--kv-offloading-size 8"
    assert vllm_args({"offload_size": "512MiB"}) == "--kv-offloading-size 0.5"
    assert vllm_args({"offload_size": "0"}) == "(no --kv-offloading-size)"


def capture_run(tmp_path, tiers: list[dict] | None) -> tuple:
    """The capture fixture (24 requests in two bursts into vLLM's 16-block pool) as a run, its server's
    identity naming `tiers` (None: a capture from before kv_tiers)."""
    capture = tmp_path / "capture"
    shutil.copytree(CAPTURE, capture)
    if tiers is not None:
        for identity in [capture / "capture.json", *(capture / "servers").glob("*.json")]:
            identity.write_text(json.dumps({**json.loads(identity.read_text()), "kv_tiers": tiers}))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["capture", "run", str(capture), "-o", str(run)])
    assert result.exit_code == 0, result.output
    return run, json.loads((run / "meta.json").read_text())


def test_a_captures_tier_is_in_its_run_and_a_sweep_of_its_traffic_keeps_it(tmp_path):
    run, meta = capture_run(tmp_path, [TIER])
    assert meta["kv_tiers"] == [TIER]
    assert run_meta("r", {"kv_tiers": [TIER]}, "", {})["kv_tiers"] == [TIER]   # a live capture's run too
    # a what-if on another knob simulates the server's tier; the capture says no dtype, so the tier's
    # bytes are read as the simulator's blocks, and said where a size in bytes is swept
    args, notes = run_options(run, [], {"num_gpu_blocks": ["12", "24"]}, KNOBS)
    assert args[args.index("--offload-size") + 1] == "67108864"
    assert "the run's host KV tier 'cpu' of 67,108,864 bytes (45 blocks in vLLM) is simulated" in notes
    args, notes = run_options(run, [], {"offload_size": ["0", "8MiB"]}, KNOBS)
    assert "--offload-size" not in args
    assert any(n.startswith("the run does not say its KV cache's dtype") for n in notes)
    # a connector's tier of no known size is left out, and said
    meta["kv_tiers"] = [{**TIER, "name": "LMCacheConnectorV1", "bytes": None}]
    (run / "meta.json").write_text(json.dumps(meta))
    args, notes = run_options(run, [], {"num_gpu_blocks": ["12", "24"]}, KNOBS)
    assert "--offload-size" not in args and any("simulated without it" in n for n in notes)
    # a run that says its dtype (record --engine vllm) has it taken: a size in bytes holds the served blocks
    meta["engine_config"]["dtype"] = "float32"
    (run / "meta.json").write_text(json.dumps(meta))
    args, notes = run_options(run, [], {"offload_size": ["0", "8MiB"]}, KNOBS)
    assert args[args.index("--dtype") + 1] == "float32"
    assert not any(n.startswith("the run does not say its KV cache's dtype") for n in notes)


def test_a_recorded_vllm_runs_meta_names_the_captures_tier(tmp_path):
    """`kvtrace record --engine vllm` finishes its meta.json from the capture's identity."""
    from types import SimpleNamespace

    from kvtrace.vllm.record import VllmRecording

    meta = {"status": "running", "kv_pool": {"bytes_per_block": 4096}, "engine_config": {}, "device": {"name": "cpu"},
            "vllm": {}}
    recording = SimpleNamespace(meta=meta, run_dir=tmp_path, opts=SimpleNamespace(self_check=False), import_items=[])
    captured = {"num_gpu_blocks": 17, "max_num_seqs": 16, "max_num_batched_tokens": 2048, "kv_tiers": [TIER]}
    VllmRecording._finish_meta(recording, "completed", {}, captured, {}, {})
    assert json.loads((tmp_path / "meta.json").read_text())["kv_tiers"] == [TIER]


def test_a_capture_without_a_tier_says_so(tmp_path):
    _, meta = capture_run(tmp_path, None)
    assert meta["kv_tiers"] == []


def test_a_sweep_of_tier_sizes_on_a_captures_traffic_answers_in_vllms_terms(tmp_path):
    run, _ = capture_run(tmp_path, [])
    out = tmp_path / "tiers"
    result = CliRunner().invoke(app, ["sweep", "--from-run", str(run), "--set", "offload_size=0,2MiB,8MiB",
                                      "-o", str(out), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(CliRunner().invoke(app, ["sweep", "show", str(out), "--json"]).output)
    by_size = {p["settings"]["offload_size"]: p["recomputed_tokens"] for p in data["points"]}
    assert by_size["8MiB"] < by_size["0"], by_size
    assert data["tier_sizing"].startswith("A host KV tier of 8MiB (vLLM: --kv-offloading-size 0.0078125) is the "
                                          "smallest past the knee in recomputed positions: against 0"), \
        data["tier_sizing"]


def test_a_sweep_of_a_kvtrace_runs_traffic_keeps_its_tier(tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["record", "-w", str(WORKLOAD), *SIM, "--offload-size", "64KiB", "-o", str(run),
                                      "-q"])
    assert result.exit_code == 0, result.output
    args, _ = run_options(run, [], {"max_num_seqs": ["2", "4"]}, KNOBS)
    assert args[args.index("--offload-size") + 1] == "65536"
