"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[IO[str]]:
    """Write to a temporary file beside `path`, renamed into place only when the block succeeds."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    """`data` as indented JSON (anything else as its string), written atomically."""
    with atomic_write(path) as f:
        f.write(json.dumps(data, indent=2, default=str) + "\n")
