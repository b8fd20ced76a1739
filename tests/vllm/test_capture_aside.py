"""What kvtrace's readers say of a capture folder whose newest server's capture did not record (stepped
aside, refused, stopped: kvtrace/vllm/capture/aside.py's files, written here as it writes them): the
exporter's `kvtrace_capture_up`, `capture ls`, `capture watch` and `record --endpoint`. A real server
writes them in tests/vllm/test_vllm_serve_aside.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrace.errors import KvtraceError
from kvtrace.vllm import live
from kvtrace.vllm.follow import capture_status
from kvtrace.vllm.metrics import Exporter
from tests.helpers.capture_figures import scraped

AT = {"A": "2026-12-01T02:00:00+00:00", "B": "2026-12-01T03:00:00+00:00", "C": "2026-12-01T04:00:00+00:00"}


def _identity(capture: Path, server: str) -> None:
    (capture / "servers").mkdir(parents=True, exist_ok=True)
    (capture / "servers" / f"{server}.json").write_text(json.dumps(
        {"server_id": server, "started_at": AT[server], "pid": 7, "vllm_version": "0.32.0", "model": "m"}))


def _error(capture: Path, server: str, status: str, reason: str, error: str) -> None:
    (capture / "servers").mkdir(parents=True, exist_ok=True)
    said = {"status": status, "reason": reason, "error": error, "at": AT[server], "server_id": server,
            "started_at": AT[server], "pid": 8, "vllm_version": "0.32.0", "model": "hybrid", "scheduler": "S",
            "async_scheduling": False, "strict": status == "refused"}
    (capture / "servers" / f"{server}.error.json").write_text(json.dumps(said))
    (capture / "error.json").write_text(json.dumps(said))


def _up(capture: Path) -> dict:
    exporter = Exporter(capture, window_s=5.0)
    try:
        exporter.poll()
        return {dict(labels)["server"]: (dict(labels)["reason"], value)
                for (name, labels), value in scraped(exporter).items() if name == "kvtrace_capture_up"}
    finally:
        exporter.close()


def test_the_exporter_says_whether_the_newest_server_captures_and_why_not(tmp_path):
    capture = tmp_path / "capture"
    capture.mkdir()
    assert _up(capture) == {}   # no server yet: nothing said
    _identity(capture, "A")
    assert _up(capture) == {"A": ("", 1.0)}
    _error(capture, "B", "stepped_aside", "model", "this model's KV cache is 2 group(s)")
    assert _up(capture) == {"B": ("model", 0.0)}   # the newest, not the one that captured before it
    _identity(capture, "C")
    assert _up(capture) == {"C": ("", 1.0)}        # a later server captures again
    _error(capture, "C", "stopped", "error", "planted")
    assert _up(capture) == {"C": ("error", 0.0)}   # ... until an error of its own stopped it


def test_capture_ls_and_watch_say_the_capture_stepped_aside_and_why(tmp_path):
    capture = tmp_path / "capture"
    _identity(capture, "A")
    _error(capture, "B", "stepped_aside", "vllm_version", "vLLM 0.32.0 is outside the versions")
    lines = _kvtrace("capture", "ls", str(capture)).splitlines()
    assert lines[0].startswith(f"{capture}: 2 servers")
    (at,) = [i for i, line in enumerate(lines) if line.startswith("server B")]
    assert "vLLM 0.32.0" in lines[at] and "hybrid" in lines[at]
    assert lines[at + 1] == (f"  capture stepped aside (vLLM served unrecorded) at {AT['B']}: vLLM 0.32.0 is outside "
                             "the versions [vllm_version]")
    assert at + 2 == len(lines) or not lines[at + 2].startswith("  ")   # nothing that looks like a capture of it
    described = {s["server_id"]: s for s in json.loads(_kvtrace("capture", "ls", str(capture), "--json"))["servers"]}
    assert (described["B"]["capture"], described["B"]["capture_reason"]) == ("stepped_aside", "vllm_version")
    assert described["A"]["capture"] == "recorded"
    from kvtrace.cli.capture_live import watch_view
    from kvtrace.vllm.follow import LiveTrace

    text = str(watch_view(LiveTrace(5.0), capture, 5.0, {}, 100))
    assert text == "the capture of server B stepped aside: vLLM 0.32.0 is outside the versions [vllm_version] " \
                   "(docs/vllm.md)"


def _kvtrace(*args: str) -> str:
    from typer.testing import CliRunner

    import kvtrace.cli.commands  # noqa: F401  (registers every command)
    from kvtrace.cli.app import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_folder_with_only_a_server_that_stepped_aside_is_a_capture_folder(tmp_path):
    capture = tmp_path / "capture"
    _error(capture, "B", "refused", "model", "this model's KV cache is 2 group(s)")
    (server,) = live.servers(capture)
    assert server.server_id == "B" and server.error["status"] == "refused" and not server.chunks
    assert capture_status(capture)[:4] == ("B", False, "refused", "model")


def test_record_endpoint_refuses_a_folder_whose_capture_stepped_aside(tmp_path):
    from kvtrace.vllm.client import record_endpoint

    capture = tmp_path / "capture"
    _error(capture, "B", "stepped_aside", "model", "this model's KV cache is 2 group(s)")
    with pytest.raises(KvtraceError, match=r"the capture of its newest server \(B\) stepped aside: this model's KV "
                                           r"cache is 2 group\(s\) \[model\]"):
        record_endpoint(None, "http://127.0.0.1:1", capture, timeout=1.0)
