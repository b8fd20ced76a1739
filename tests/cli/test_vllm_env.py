"""`kvtrace vllm-env`: the path it hands vLLM lasts (kvtrace's cache folder, not the temporary folder
that cleaners empty), links to this kvtrace and nothing else, and the capture folder it makes is the
owner's and group's."""
from __future__ import annotations

import re
import stat
from pathlib import Path

from typer.testing import CliRunner

import kvtrace
import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from tests.helpers.cli import one_line_error


def test_the_path_is_in_the_cache_folder_and_links_to_this_kvtrace_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("KVTRACE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir()
    result = CliRunner().invoke(app, ["vllm-env", "--capture-dir", str(tmp_path / "capture")])
    assert result.exit_code == 0, result.output
    (path,) = re.findall(r'^export PYTHONPATH="([^"$]+)\$\{PYTHONPATH', result.stdout, re.MULTILINE)
    path = Path(path)
    assert path.parent == tmp_path / "cache" and not list((tmp_path / "tmp").iterdir())
    assert [p.name for p in path.iterdir()] == ["kvtrace"]
    assert (path / "kvtrace").resolve() == Path(kvtrace.__file__).resolve().parent
    assert f"# PYTHONPATH: {path} holds one entry" in result.stdout
    assert 'export KVTRACE_CAPTURE_MODE="0640"' in result.stdout
    assert stat.S_IMODE((tmp_path / "capture").stat().st_mode) == 0o750


def test_a_bad_file_mode_is_one_line():
    assert "--file-mode='rw'" in one_line_error(["vllm-env", "--capture-dir", "/tmp/x", "--file-mode", "rw"])


def test_strict_mode_is_off_unless_asked(tmp_path):
    """By default a capture that cannot start steps aside (vLLM serves); --strict makes it refuse."""
    for args, value in (([], "0"), (["--strict"], "1"), (["--no-strict"], "0")):
        result = CliRunner().invoke(app, ["vllm-env", "--capture-dir", str(tmp_path / "capture"), *args])
        assert result.exit_code == 0, result.output
        assert re.findall(r'^export KVTRACE_CAPTURE_STRICT="(\d)"$', result.stdout, re.MULTILINE) == [value]
