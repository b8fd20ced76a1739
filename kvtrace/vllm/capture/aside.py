"""When the capture does not record, and how it says why: it steps aside, refuses, or stops.

Code that runs inside a user's vLLM never takes it down. Under `vllm serve`, a capture that cannot start
(a vLLM release it does not accept, a name it uses gone, a model whose KV cache it cannot follow, an
option it cannot parse, a folder it cannot write, an error of its own) **steps aside**: the scheduler
runs as vLLM's own, unrecorded, and vLLM serves. `KVTRACE_CAPTURE_STRICT=1` makes it **refuse**
instead: the exception stops vLLM's start-up (`kvtrace record --engine vllm` sets it: a replay that
records nothing is no replay). A capture that has started and then hits an error of its own in a step
hook **stops** (recorder.py's `fail`): vLLM serves on.

Each says so in one line of vLLM's log (logger `vllm.kvtrace.capture`) and in the capture folder, as
`servers/<server id>.error.json` and `error.json` (the newest such server's; `kvtrace record` reads
it), which `kvtrace capture ls` and the exporter's `kvtrace_capture_up` read:
- `status`: `stepped_aside`, `refused` or `stopped`;
- `reason`, one word: `vllm_version`, `vllm_changed`, `model` (guard.VllmChanged's), `settings` (an
  option: KVTRACE_CAPTURE_DIR unset, a value that does not parse), `folder` (the folder cannot be made
  or written), `error` (the capture's own error; `traceback` says where), `disk` (a running capture's
  chunks could not be written: a full disk, a permission taken away; the capture stopped);
- `error` (the message), `exception` (its class), `at` (UTC, ISO 8601), `strict`, and what is known of
  the server: `server_id`, `started_at`, `pid` (EngineCore's), `vllm_version`, `model`, `scheduler`,
  `async_scheduling`.
Without a folder (KVTRACE_CAPTURE_DIR unset) the log line is all there is. A capture that did not
start leaves no identity of its own (`servers/<server id>.json`), so nothing in the folder looks like a
capture of that server. Standard library only, as the whole package.
"""
from __future__ import annotations

import logging
import os
import traceback
from datetime import datetime, timezone
from pathlib import Path

from kvtrace.vllm.capture import guard
from kvtrace.vllm.capture.files import FILE_MODE, write_json

# vLLM's handlers are on its "vllm" logger: a child of it writes where vLLM's own lines go
logger = logging.getLogger("vllm.kvtrace.capture")

STEPPED_ASIDE, REFUSED, STOPPED = "stepped_aside", "refused", "stopped"


def strict() -> bool:
    """KVTRACE_CAPTURE_STRICT=1: a capture that cannot start stops vLLM's start-up."""
    return os.environ.get("KVTRACE_CAPTURE_STRICT") == "1"


def not_started(exc: BaseException, kind: str | None, settings, server, scheduler, version: str) -> None:
    """Say why the capture did not start: error.json's `reason` is `kind`, or where None the exception's.
    `settings`: the options, where they parsed. The caller raises in strict mode. (`kind`, not `reason`,
    here: the trace's reasons are another vocabulary, tests/vllm/test_trace_vocabulary.py.)"""
    kind = kind or (exc.reason if isinstance(exc, guard.VllmChanged) else "folder" if isinstance(exc, OSError)
                      else "error")
    refused = strict()
    said = _said(REFUSED if refused else STEPPED_ASIDE, kind, exc, server, scheduler, version)
    if kind == "error":
        said["traceback"] = "".join(traceback.format_exception(exc))
    folder = settings.folder if settings is not None else os.environ.get("KVTRACE_CAPTURE_DIR")
    where = _write(folder, settings.file_mode if settings is not None else FILE_MODE, said, forget=True)
    if refused:
        logger.error("kvtrace capture refused to start (KVTRACE_CAPTURE_STRICT=1: vLLM does not start): %s [%s]; %s",
                     said["error"], kind, where)
    else:
        logger.warning("kvtrace capture stepped aside (vLLM serves, unrecorded): %s [%s]; %s",
                       said["error"], kind, where)


def stopped(exc: BaseException, settings, server, scheduler, version: str) -> None:
    """Say that an error of the capture's own stopped it at runtime."""
    said = _said(STOPPED, "error", exc, server, scheduler, version)
    said["traceback"] = "".join(traceback.format_exception(exc))
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    where = _write(settings.folder, settings.file_mode, said, forget=False)
    logger.warning("kvtrace capture stopped (vLLM serves on): an error of the capture's own%s: %s [error]; %s",
                   at, said["error"], where)


def writer_stopped(exc: BaseException, settings, server, scheduler, version: str) -> None:
    """Write down that the sink could not write (a full disk, no permission): the capture has stopped,
    reason `disk`, as the sink's own log line said. A folder that is gone (removed by an operator) is
    not made again for it."""
    _write(settings.folder, settings.file_mode, _said(STOPPED, "disk", exc, server, scheduler, version),
           forget=False)


def _said(status: str, reason: str, exc: BaseException, server, scheduler, version: str) -> dict:
    model = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    name = getattr(model, "served_model_name", None) or getattr(model, "model", None)
    config = getattr(getattr(scheduler, "vllm_config", None), "scheduler_config", None)
    return {
        "status": status, "reason": reason,
        "error": " ".join(str(exc).split()) or type(exc).__name__,   # one line
        "exception": type(exc).__name__, "at": datetime.now(timezone.utc).isoformat(), "strict": strict(),
        "server_id": server.server_id, "started_at": server.started.isoformat(), "pid": os.getpid(),
        "vllm_version": version, "model": name[0] if isinstance(name, list) else name,
        "scheduler": type(scheduler).__name__, "async_scheduling": getattr(config, "async_scheduling", None),
    }


def _write(folder: str | Path | None, file_mode: int, said: dict, forget: bool) -> str:
    """servers/<server id>.error.json and error.json; where they went, or why not (for the log line).
    `forget`: remove the server's identity, if its start got that far."""
    if not folder:
        return "no error.json: KVTRACE_CAPTURE_DIR is not set"
    folder = Path(folder)
    server_id = said["server_id"]
    if not forget and not folder.is_dir():   # a running capture's folder removed: not made again
        return "no error.json: the capture folder is gone"
    try:
        if forget:
            (folder / "servers" / f"{server_id}.json").unlink(missing_ok=True)
        write_json(folder, f"servers/{server_id}.error.json", said, file_mode)
        write_json(folder, "error.json", said, file_mode)
    except OSError as exc:
        return f"no error.json ({exc})"
    return f"see {folder / 'error.json'}"
