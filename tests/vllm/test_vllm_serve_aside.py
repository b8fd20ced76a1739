"""`vllm serve` (the 0.32 CPU build) with a capture that cannot follow it, and a hybrid model's that can.

Three server starts, each on a tiny two-layer Llama config with dummy weights and SmolLM2's tokenizer
(start-up is most of each), set up by `kvtrace vllm-env` as docs/vllm.md says.

A vLLM release the capture does not accept. The installed vLLM is one the guard supports, and no other
release has a CPU build here, so KVTRACE_VLLM_VERSIONS (the operator's list of the releases they have
validated, a subset of those the capture supports) names the supported releases but this one: the
guard's own version check refuses the real server's `vllm.__version__`. By default the capture steps
aside: the server answers a completion over HTTP, vLLM's log has the one warning line, error.json says
why, `kvtrace capture metrics` (a real exporter, scraped over HTTP) serves `kvtrace_capture_up 0` with
the reason, `capture ls` says the capture stepped aside; in strict mode (KVTRACE_CAPTURE_STRICT=1,
`kvtrace vllm-env --strict`) the server exits at start-up, the reason in its log and error.json. (A
KV cache the capture cannot follow, such as R-SWA's, steps aside the same way: the scheduler-level
tests build one; no model the CPU build serves has it.)

A hybrid model: the same config with a sliding window on its second layer (`layer_types`, as Gemma 3 and
gpt-oss interleave them). vLLM 0.32's CPU build keeps the hybrid KV cache manager on, so the model has
two KV-cache groups (full attention, a 64-token window); the capture follows both, self-checked every
step, and its run holds each group's blocks and the window's frees.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtrace.vllm.capture import guard
from tests.helpers.vllm_runs import (
    VLLM_MARKS,
    VLLM_PYTHON,
    free_port,
    kvtrace,
    start_vllm_server,
)

pytestmark = VLLM_MARKS
SERVE = ["--load-format", "dummy", "--dtype", "float32", "--block-size", "32", "--num-gpu-blocks-override", "16",
         "--max-model-len", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5", "--enforce-eager"]
WARNING = "kvtrace capture stepped aside (vLLM serves, unrecorded): "
REFUSAL = "kvtrace capture refused to start (KVTRACE_CAPTURE_STRICT=1: vLLM does not start): "


def _tiny_model(folder: Path, sliding: bool) -> Path:
    """Two layers of SmolLM2's shape, shrunk, with its tokenizer; the second with a 64-token sliding window."""
    from kvtrace.vllm.record import model_folder

    source = model_folder("smollm2-135m")
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)
    if sliding:
        config.update(layer_types=["full_attention", "sliding_attention"], sliding_window=64)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _env(capture: Path, strict: bool, extra: dict) -> dict:
    """The environment `kvtrace vllm-env` prints, applied as a shell would."""
    lines = kvtrace("vllm-env", "--capture-dir", capture, *(["--strict"] if strict else [])).stdout
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    for line in lines.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip('"').replace("${PYTHONPATH:+:$PYTHONPATH}", "")
    return {**env, **extra}


def _other_versions() -> str:
    """The versions the capture supports, but the installed vLLM's."""
    installed = subprocess.run([VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, check=True).stdout.strip()
    return ",".join(f"{a}.{b}" for a, b in guard.SUPPORTED if (a, b) != guard.version_tuple(installed))


CASES = {   # case -> (sliding-window model, extra environment, reason, what the message says)
    "version": (False, lambda: {"KVTRACE_VLLM_VERSIONS": _other_versions(), "KVTRACE_VLLM_ANY_VERSION": "0"}, "vllm_version",
                "is outside the versions KVTRACE_VLLM_VERSIONS lets the capture start on"),
}


def _scrape_capture_up(capture: Path) -> dict:
    """`kvtrace capture metrics` on the folder, scraped over HTTP: kvtrace_capture_up's samples."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "kvtrace", "capture", "metrics", str(capture), "--port",
                                 str(port), "--refresh", "1s"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                break
            except OSError:
                assert exporter.poll() is None and time.monotonic() < deadline, exporter.communicate()[1][-2000:]
                time.sleep(0.5)
    finally:
        exporter.send_signal(signal.SIGINT)
        exporter.wait(timeout=30)
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvtrace_capture_up"}


@pytest.mark.parametrize("case", CASES)
def test_by_default_the_capture_steps_aside_and_vllm_serves(case, tmp_path):
    sliding, extra, reason, message = CASES[case]
    model = _tiny_model(tmp_path / "model", sliding)
    capture, log = tmp_path / "capture", tmp_path / "serve.log"
    env = _env(capture, False, extra())
    proc, port = start_vllm_server(VLLM_PYTHON, str(model), ["--scheduler-cls", env["KVTRACE_SCHEDULER_CLS"], *SERVE],
                                   env, log, cwd=tmp_path, timeout_s=600)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": str(model), "prompt": "the quick brown fox", "max_tokens": 4,
                             "temperature": 0.0, "ignore_eos": True}).encode())
        answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
        assert answer["usage"]["completion_tokens"] == 4, answer
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    lines = [line for line in log.read_text().splitlines() if "kvtrace capture" in line]
    (said,) = [line for line in lines if WARNING in line]   # one line says why
    assert "WARNING" in said and message in said and f"[{reason}]" in said, said
    assert not [line for line in lines if line is not said and "kvtrace capture" in line], lines
    error = json.loads((capture / "error.json").read_text())
    assert (error["status"], error["reason"], error["strict"]) == ("stepped_aside", reason, False), error
    assert message in error["error"] and error["pid"] != proc.pid and error["vllm_version"].startswith("0.32"), error
    assert error["error"] in said
    assert not list(capture.rglob("*.kvtc")) and not (capture / "capture.json").exists()   # nothing of a capture
    assert _scrape_capture_up(capture) == {(("reason", reason), ("server", error["server_id"])): 0.0}
    ls = kvtrace("capture", "ls", capture).stdout
    assert f"capture stepped aside (vLLM served unrecorded) at {error['at']}: {error['error']} [{reason}]" in ls, ls


@pytest.mark.parametrize("case", CASES)
def test_in_strict_mode_vllm_does_not_start_and_says_why(case, tmp_path):
    sliding, extra, reason, message = CASES[case]
    model = _tiny_model(tmp_path / "model", sliding)
    capture, log = tmp_path / "capture", tmp_path / "serve.log"
    env = _env(capture, True, extra())
    assert env["KVTRACE_CAPTURE_STRICT"] == "1"
    proc = subprocess.Popen([VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port",
                             str(free_port()), "--scheduler-cls", env["KVTRACE_SCHEDULER_CLS"], *SERVE],
                            env={**env, "VLLM_USE_AOT_COMPILE": "0"}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    try:
        assert proc.wait(timeout=600) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    (said,) = [line for line in text.splitlines() if REFUSAL in line]
    assert message in said and f"[{reason}]" in said, said
    assert WARNING not in text and "Engine core initialization failed" in text
    error = json.loads((capture / "error.json").read_text())
    assert (error["status"], error["reason"], error["strict"]) == ("refused", reason, True), error


def test_a_hybrid_models_server_is_captured_group_by_group(tmp_path):
    """Prompts past the 64-token window on a real server: every step self-checked (each request's blocks
    in both groups replayed from the events against vLLM's tables), the run's blocks per group and the
    window's mid-request frees, the groups in meta.json, and kvtrace's SQL reading them."""
    from kvtrace.trace import db

    model = _tiny_model(tmp_path / "model", sliding=True)
    capture, log = tmp_path / "capture", tmp_path / "serve.log"
    env = _env(capture, False, {"KVTRACE_CAPTURE_SELF_CHECK": "1"})
    proc, port = start_vllm_server(VLLM_PYTHON, str(model), ["--scheduler-cls", env["KVTRACE_SCHEDULER_CLS"], *SERVE],
                                   env, log, cwd=tmp_path, timeout_s=600)
    try:
        words = "the quick brown fox jumps over the lazy dog and keeps running far away".split()
        # a prompt of about 96 to 105 tokens, 20 more generated: past the window by a block; the last sent
        # again, a prefix hit in both groups (the window's blocks found cached after it dropped them)
        for n in [0, 1, 2, 3, 3]:
            prompt = " ".join(words[(n + i) % len(words)] for i in range(96 + 3 * n))
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 20, "temperature": 0.0,
                                 "ignore_eos": True}).encode())
            answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
            assert answer["usage"]["completion_tokens"] == 20, answer
        # the interrupted CPU build skips the capture's last flush: the five requests' rows written first
        from kvtrace.vllm.importer import read_chunks
        deadline = time.monotonic() + 60
        while len(read_chunks(capture)["requests"]["req_id"]) < 5:
            assert time.monotonic() < deadline, "the capture did not write the five requests' rows"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    assert not (capture / "error.json").exists(), (capture / "error.json").read_text()
    identity = json.loads((capture / "capture.json").read_text())
    assert [(g["kind"], g.get("sliding_window")) for g in identity["kv_cache_groups"]] == [
        ("full_attention", None), ("sliding_window", 64)], identity["kv_cache_groups"]
    # the self-check's first problem is a warning in vLLM's log (done.json, which has them all, is written
    # when the engine core shuts the scheduler down, which the CPU build's interrupted server skips)
    logged = [line for line in log.read_text().splitlines() if "kvtrace capture" in line]
    assert not [line for line in logged if "self-check" in line], logged
    assert json.loads((capture / "capture.json").read_text())["self_check"] is True
    run = tmp_path / "run"
    kvtrace("capture", "run", capture, "-o", run)
    meta = json.loads((run / "meta.json").read_text())
    assert [g["kind"] for g in meta["kv_pool"]["kv_cache_groups"]] == ["full_attention", "sliding_window"], meta
    con = db.connect([run])
    per_group = dict(con.sql("SELECT kv_group, sum(num_blocks) FROM kv_events WHERE kind = 'alloc' "
                             "GROUP BY 1").fetchall())
    assert set(per_group) == {0, 1} and all(per_group.values()), per_group   # both groups' blocks
    window = con.sql("SELECT count(*), count(DISTINCT req_id), min(kv_group), max(kv_group) FROM kv_events "
                     "WHERE kind = 'free' AND reason = 'window'").fetchall()[0]
    # each request's window moved on (the resent one's hit holds only the window's blocks: it drops none)
    assert window[0] > 0 and window[1] == 4 and window[2:] == (1, 1), window
    # when each request finished, its window had kept its sliding group to fewer blocks than its
    # full-attention group, which holds every position (a prefix hit's blocks per group counted too)
    held = con.sql("""
        SELECT req_id, kv_group, sum(n) AS held
        FROM (SELECT req_id, kv_group, CASE WHEN kind = 'free' THEN -num_blocks ELSE num_blocks END AS n
              FROM kv_events
              WHERE kv_group IS NOT NULL AND (kind = 'alloc' OR (kind = 'free' AND reason = 'window'))
              UNION ALL
              SELECT req_id, unnest(range(len(kv_group_blocks))), unnest(kv_group_blocks)
              FROM kv_events WHERE kind = 'prefix_hit')
        GROUP BY ALL""").fetchall()
    at_finish = {(rid, group): n for rid, group, n in held}
    assert all(at_finish[rid, 1] < at_finish[rid, 0] for rid, _ in at_finish), at_finish
    assert meta["engine_config"]["enable_prefix_caching"] is True, meta["engine_config"]
    (hits,), = con.sql("SELECT sum(prefix_hit_tokens) FROM requests").fetchall()
    assert hits >= 64, hits
    # a what-if on the capture's traffic: vLLM's Llama honours the config's layer_types, transformers' (which
    # kvtrace's reading follows) does not, so the simulator refuses a model of one group in one line; given
    # the same layers as a Ministral config, it keeps the groups and their prefix caching (vLLM's default
    # here), and hits the resent prompt as the server did
    refused = kvtrace("sweep", "--from-run", run, "--model", model, "--set", "max_num_seqs=1,4", "-o",
                      tmp_path / "refused", check=False)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "the run's KV cache is full attention + sliding window 64 tok" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()
    twin = tmp_path / "ministral"
    shutil.copytree(model, twin)
    config = json.loads((twin / "config.json").read_text())
    config.update(model_type="ministral", architectures=["MinistralForCausalLM"])
    (twin / "config.json").write_text(json.dumps(config))
    kvtrace("sweep", "--from-run", run, "--model", twin, "--set", "max_num_seqs=1,4", "--jobs", "1",
            "-o", tmp_path / "sweep")
    shown = json.loads(kvtrace("sweep", "show", tmp_path / "sweep", "--json").stdout)
    assert len(shown["points"]) == 2 and not shown["not_completed"], shown
    for point in shown["points"]:
        simulated = db.connect([tmp_path / "sweep" / "runs" / point["run_id"]])
        assert simulated.sql("SELECT sum(prefix_hit_tokens) FROM requests").fetchall() == [(hits,)], point
        assert simulated.sql("SELECT count(*) FROM kv_events WHERE reason = 'window'").fetchall()[0][0] > 0, point
    shown = kvtrace("analyze", run, env={"COLUMNS": "200"}).stdout   # the dashboard names the groups, the drops
    assert "2 KV-cache groups: full attention (" in shown and "sliding window 64 tok (" in shown, shown
    assert "dropped)" in shown.split("sliding window 64 tok (", 1)[1].split("\n", 1)[0], shown
