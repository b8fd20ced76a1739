"""A production-style capture: `vllm serve` with kvtrace installed as the docs say (`pip install
--no-deps` of kvtrace's wheel into the vLLM environment), driven by the `openai` client, streaming.

Two server start-ups in all. The first runs from a fresh venv whose site-packages chain to the vLLM
venv's (a .pth file) with kvtrace's wheel installed there with --no-deps and nothing on PYTHONPATH;
its capture folder is a small tmpfs (mounted by the test where it may; else a plain folder, and
the full-disk check removes the folder instead). Traffic in two bursts, then `capture ls` and `capture run`
of the second burst; then the tmpfs is filled and a third burst is still answered. The second server
(the path `kvtrace vllm-env` prints, a tiny disk budget) is killed with SIGKILL mid-burst.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtrace.trace import db
from kvtrace.vllm.importer import read_chunk
from tests.helpers.vllm_runs import (
    VLLM_MARKS,
    VLLM_PYTHON,
    kvtrace,
    start_vllm_server,
    vllm_preemptions,
)

pytestmark = VLLM_MARKS
ROOT = Path(__file__).resolve().parents[2]
SERVE = ["--dtype", "float32", "--block-size", "32", "--num-gpu-blocks-override", "6", "--max-model-len", "128",
         "--max-num-seqs", "8", "--gpu-memory-utilization", "0.3", "--enforce-eager"]
CLS = "kvtrace.vllm.capture.scheduler.KvtraceCaptureScheduler"


class Server:
    def __init__(self, python: str, capture: Path, log: Path, env: dict) -> None:
        """Serve from the log's folder: `python -m` puts the working directory first on sys.path,
        and the checkout's kvtrace must not shadow the installed one."""
        from kvtrace.vllm.record import model_folder

        self.capture, self.log = capture, log
        self.model = str(model_folder("smollm2-135m"))
        self.proc, self.port = start_vllm_server(
            python, self.model, ["--scheduler-cls", CLS, *SERVE], {**env, "KVTRACE_CAPTURE_DIR": str(capture)},
            log, cwd=log.parent)
        import openai
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=600,
                                    max_retries=0)   # one POST per request: the counts are exact

    def burst(self, name: str, num: int, max_tokens: int = 40, wait: bool = True) -> list[threading.Thread]:
        """`num` streaming completions at once, as an application sends them; each request's id
        (X-Request-Id) starts with `name`."""
        errors = self.errors = []

        def one(i: int) -> None:
            try:
                stream = self.client.completions.create(
                    model=self.model, prompt=f"Request {name} {i}: " + "the quick brown fox jumps " * 8,
                    max_tokens=max_tokens, stream=True, temperature=0.0, extra_body={"ignore_eos": True},
                    extra_headers={"X-Request-Id": f"{name}-{i}"})
                got = sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text is not None)
                assert got > 0
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(f"{name}-{i}: {exc!r}")

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num)]
        for t in threads:
            t.start()
        if wait:
            for t in threads:
                t.join(timeout=900)
            assert not errors, errors
        return threads

    def stop(self, sig=signal.SIGINT) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=120)


def _wait_for(capture: Path, prefix: str, num: int) -> None:
    """Until the capture's closed chunks hold the finished rows of `num` requests named `prefix`."""
    from kvtrace.vllm.importer import read_chunks
    deadline = time.monotonic() + 120
    while sum(1 for r in read_chunks(capture)["requests"]["req_id"] if prefix in r) < num:
        assert time.monotonic() < deadline, f"the capture did not write {prefix}'s rows"
        time.sleep(0.5)


def _fresh_venv(root: Path) -> str:
    """A venv of the vLLM venv's interpreter whose site-packages chain to the vLLM venv's, with
    kvtrace's wheel installed by `pip install --no-deps`, as docs/vllm.md says for an image."""
    source = root / "source"
    for name in ("pyproject.toml", "setup.py", "README.md", "kvtrace", "engine", "analyses"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), str(source)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = (root / "dist").glob("kvtrace-*.whl")
    venv = root / "vllm-with-kvtrace"
    subprocess.run([VLLM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    vllm_site = subprocess.run([VLLM_PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_vllm_venv.pth").write_text(vllm_site + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    return python


def _mount_tmpfs(folder: Path, size: str) -> str | None:
    """Mount a small tmpfs on `folder`; None when it worked, else why not."""
    folder.mkdir(parents=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        return f"no mount command ({exc})"
    return None if proc.returncode == 0 else f"cannot mount a tmpfs here: {proc.stderr.strip()}"


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    python = _fresh_venv(root)
    capture = root / "capture"
    no_tmpfs = _mount_tmpfs(capture, "8m")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    server = None
    try:
        server = Server(python, capture, root / "serve.log", env)
        found = {"root": root, "capture": capture, "server": server, "no_tmpfs": no_tmpfs, "venv_python": python}
        server.burst("first", 3)
        found["between"] = time.time()
        _wait_for(capture, "first", 3)
        time.sleep(1.0)
        before = vllm_preemptions(server.port)
        found["since"] = time.time()
        server.burst("second", 4)
        found["preemptions"] = vllm_preemptions(server.port) - before
        _wait_for(capture, "second", 4)
        found["until"] = time.time()
        yield found
    finally:
        if server is not None:
            server.stop()
        if no_tmpfs is None:
            subprocess.run(["umount", str(capture)], capture_output=True, check=False)


def test_the_capture_ran_from_the_no_deps_install(production):
    (identity,) = [json.loads(p.read_text()) for p in (production["capture"] / "servers").glob("*.json")]
    venv = Path(production["venv_python"]).parents[1]
    assert Path(identity["capture_module"]).resolve().is_relative_to(venv.resolve())
    assert identity["scheduler"] == "KvtraceScheduler" and identity["async_scheduling"] is False   # vLLM's choice on CPU


def test_ls_shows_both_bursts(production):
    (server,) = json.loads(kvtrace("capture", "ls", production["capture"], "--json").stdout)["servers"]
    assert server["num_requests"] == 7 and server["vllm_version"].startswith("0.32") and server["gaps"] == []
    assert server["scheduling"] == "sync" and server["pid"] > 0   # EngineCore's process
    assert server["first"] < production["between"] < production["since"] < server["last"]
    lines = kvtrace("capture", "ls", production["capture"]).stdout
    assert "7 requests" in lines and "token ids not kept" in lines


def test_a_window_of_the_second_burst_holds_exactly_its_requests(production, tmp_path):
    run = tmp_path / "second"
    kvtrace("capture", "run", production["capture"], "-o", run, "--since", production["since"],
            "--until", production["until"])
    con = db.connect([run])
    ids = [r[0] for r in con.execute("SELECT req_id FROM requests ORDER BY req_id").fetchall()]
    assert len(ids) == 4 and all("second-" in i for i in ids), ids   # vLLM's ids, the client's X-Request-Id in them
    preemptions = con.execute("SELECT sum(preemptions) FROM requests").fetchone()[0]
    assert preemptions == production["preemptions"] > 0                # as vLLM's own counter
    assert con.execute("SELECT count(*) FROM kv_events WHERE kind = 'preempt'").fetchone()[0] == preemptions
    assert con.execute("SELECT count(*) FROM requests WHERE finish_reason = 'length'").fetchone()[0] == 4
    flags = con.execute("SELECT bool_or(in_flight_at_start), bool_or(in_flight_at_end), min(len(block_hashes)) "
                        "FROM capture_requests").fetchone()
    assert flags[:2] == (False, False) and flags[2] >= 1   # each prompt's full blocks of 32, hashed
    for info in db.list_analyses():
        db.run_analysis(con, info.name)
    kvtrace("analyze", run)
    kvtrace("export", "perfetto", run, "-o", tmp_path / "second.pftrace")
    # the request sent with X-Request-Id second-2, found by that id (vLLM named it cmpl-second-2-0-<suffix>)
    (named,) = [i for i in ids if i.startswith(("second-2", "cmpl-second-2-"))]
    story = json.loads(kvtrace("explain", run, "second-2", "--json").stdout)
    assert story["req_id"] == named and story["clock"] == "wall (UTC)"


def test_no_token_id_in_a_default_capture(production):
    chunks = list((production["capture"] / "chunks").glob("*.kvtc"))
    assert chunks
    for path in chunks:
        chunk = read_chunk(path)
        assert set(chunk.get("tokens", {}).get("token_id", [])) <= {None}, path


def test_a_full_filesystem_stops_the_capture_and_the_server_answers(production):
    """The capture's tmpfs filled up (dd until ENOSPC). Where no tmpfs can be mounted (no privilege),
    the folder is removed instead, another failure the capture must survive; ENOSPC itself is then
    covered by tests/vllm/test_capture_sink.py, which simulates it."""
    if production["no_tmpfs"]:
        shutil.rmtree(production["capture"] / "chunks")
    else:
        filler = production["capture"] / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True, check=False)   # until ENOSPC
    server = production["server"]
    server.burst("third", 2, max_tokens=8)   # answered
    log = production["root"] / "serve.log"
    deadline = time.monotonic() + 60
    while "kvtrace capture stopped (vLLM serves on)" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    assert log.read_text().count("kvtrace capture stopped") == 1
    server.burst("fourth", 1, max_tokens=4)   # and still answered
    assert server.proc.poll() is None


def test_sigkill_mid_burst_leaves_a_readable_folder_and_retention_drops_the_oldest(tmp_path):
    capture = tmp_path / "killed"
    lines = kvtrace("vllm-env", "--capture-dir", capture, "--max-bytes", "4KB").stdout
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    for line in lines.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip('"').replace("${PYTHONPATH:+:$PYTHONPATH}", "")
    server = Server(VLLM_PYTHON, capture, tmp_path / "serve.log", env)
    try:
        server.burst("warm", 2, max_tokens=24)
        # six requests of 4 blocks each on a pool of 6 blocks run mostly one after another, with
        # preemptions: the burst outlasts several chunks, so its arrivals are read while it runs (three
        # could finish within a couple of seconds on a fast machine, and the chunk holding their
        # arrivals be dropped by retention before the loop below saw it)
        server.burst("cut", 6, max_tokens=80, wait=False)
        deadline = time.monotonic() + 120
        while not any("cut-" in r for r in _arrived(capture)):   # mid-burst, in a written chunk
            assert time.monotonic() < deadline and not server.errors and server.proc.poll() is None, (
                server.errors, sorted(p.name for p in (capture / "chunks").glob("*")),
                server.log.read_text()[-3000:])
            time.sleep(0.2)
    finally:
        server.stop(signal.SIGKILL)
    (listed,) = json.loads(kvtrace("capture", "ls", capture, "--json").stdout)["servers"]
    assert listed["gaps"] and "removed by retention" in listed["gaps"][0]
    assert listed["bytes"] <= 4_000 + max(p.stat().st_size for p in (capture / "chunks").glob("*.kvtc"))
    run = tmp_path / "after-kill"
    kvtrace("capture", "run", capture, "-o", run, "--last", "10m")
    con = db.connect([run])
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] > 0
    reasons = dict(con.execute("SELECT finish_reason, count(*) FROM requests WHERE req_id LIKE '%cut-%' "
                               "GROUP BY ALL").fetchall())
    assert reasons.get("in-flight", 0) >= 1, reasons   # cut off by the kill: marked, not dropped


def _arrived(capture: Path) -> list[str]:
    from kvtrace.vllm.importer import read_chunks
    return read_chunks(capture)["arrivals"]["req_id"]
