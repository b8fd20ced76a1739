"""The capture's files and folders, made with the mode the operator chose (standard library only).

A capture holds what a server did with its users' requests (and, if asked, their token ids), so its
folder and files are readable by their owner and group only by default: files 0640, folders 0750,
whatever the process's umask. `KVTRACE_CAPTURE_MODE` (octal, the files' mode: `0600` for the owner
alone, `0644` for everyone) sets another; a folder gets the execute bit wherever its files are
readable. A folder that exists already keeps the mode it has: it is the operator's.
Every file is written to a hidden name and renamed into place, so a reader never sees half of one.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

FILE_MODE = 0o640


def parse_mode(text: str, name: str) -> int:
    """`640`, `0640` or `0o640` -> 0o640 (ValueError names the variable)."""
    m = re.fullmatch(r"\s*(?:0o?)?([0-7]{3})\s*", text)
    if not m:
        raise ValueError(f"{name}={text!r}: expected a file mode in octal, such as 0640 or 0600")
    mode = int(m[1], 8)
    if not mode & 0o400:
        raise ValueError(f"{name}={text!r}: the owner must be able to read the capture's files")
    return mode


def folder_mode(file_mode: int) -> int:
    """The files' mode with the execute (search) bit wherever they are readable, and the owner's write."""
    return file_mode | 0o200 | ((file_mode & 0o444) >> 2)


def make_folder(path: Path, file_mode: int = FILE_MODE) -> None:
    """`path` and the folders above it that are missing, each made with folder_mode(file_mode)."""
    path = Path(path)
    if path.is_dir():
        return
    if not path.parent.is_dir():
        make_folder(path.parent, file_mode)
    try:
        path.mkdir()
    except FileExistsError:
        return   # made meanwhile (another server of the folder): its mode stands
    os.chmod(path, folder_mode(file_mode))


def write_file(path: Path, data: bytes, file_mode: int = FILE_MODE) -> int:
    """`data` into `path` through a hidden temporary name and a rename; the bytes written. OSError as the
    disk gives it (the temporary file removed)."""
    # this process's own temporary name: a data-parallel server's ranks start together and each writes
    # the folder's capture.json (the same name would have one rename the other's file away from under it)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode)
        try:
            os.fchmod(fd, file_mode)   # exactly the mode asked, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    return len(data)


def write_json(folder: Path, name: str, data: dict, file_mode: int = FILE_MODE) -> None:
    """`data` as `folder/name` (its folders made as make_folder makes them)."""
    path = Path(folder) / name
    make_folder(path.parent, file_mode)
    write_file(path, (json.dumps(data, indent=2) + "\n").encode(), file_mode)
