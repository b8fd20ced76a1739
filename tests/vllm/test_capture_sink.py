"""The capture's sink without vLLM (it is standard library only): retention by bytes and by age, its
builder thread (a step's rows are built off the engine's thread; an error of its own stops the capture, never
vLLM), its writer thread behind a bounded queue (a slow disk drops whole chunks, counted; a step never waits), the
modes of its files and folders, and a write that fails (a full disk, simulated: ENOSPC from the write itself, since a real full filesystem
needs a mount, which tests/vllm/test_vllm_live.py makes where it may) or a removed folder stops the
capture with one warning and never raises."""
from __future__ import annotations

import errno
import json
import logging
import shutil
import threading
import time
from functools import partial

from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.vllm.capture import sink as sink_module
from kvtrace.vllm.capture.sink import Sink, parse_age, parse_bytes

SERVER = "20261201T030000Z-77"


def _step(sink: Sink, t: float) -> None:
    """One step's rows handed to the sink, as the recorder hands its over: built on its builder thread."""
    sink.build = partial(_build, sink)
    sink.add(t)


def _build(sink: Sink, t: float) -> None:
    row = {"step": int(t), "start_s": t, "end_s": t + 0.5}
    for name, values in sink.columns["steps"].items():
        values.append(row.get(name, 0))
    sink.columns["arrivals"]["req_id"].append(f"r{int(t)}")
    for name in ("arrival_s", "prompt_tokens", "max_tokens", "priority"):
        sink.columns["arrivals"][name].append(0)
    sink.columns["arrivals"]["block_hashes"].append([1, 2, 3])


def _parts(folder) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (folder / "chunks").glob(f"{SERVER}_*.kvtc"))


def test_sizes_and_ages_parse():
    assert parse_bytes("4GiB", "x") == 4 * 1024**3 and parse_bytes("500MB", "x") == 500_000_000
    assert parse_bytes("1000", "x") == 1000 and parse_age("7d", "x") == 7 * 86400 and parse_age("90m", "x") == 5400


def test_the_oldest_whole_chunks_go_first_and_ls_says_so(tmp_path):
    folder = tmp_path / "capture"
    sink = Sink(folder, SERVER, max_bytes=1, wall_minus_monotonic=0.0)   # a budget below one chunk
    for t in range(5):
        _step(sink, float(t))
        sink.flush()
        sink.drain()
    assert _parts(folder) == [4] and sink.num_removed == 4   # the newest always stays
    (folder / "servers").mkdir()
    (folder / "servers" / f"{SERVER}.json").write_text(json.dumps({"server_id": SERVER, "pid": 77}))
    out = CliRunner().invoke(app, ["capture", "ls", str(folder)]).stdout
    assert "gap: chunks 0–3 removed by retention" in out and "1 requests" in out

    budget = Sink(tmp_path / "roomy", SERVER, max_bytes=10**9, max_age_s=10**6)
    for t in range(3):
        _step(budget, float(t))
        budget.flush()
    budget.drain()
    assert _parts(tmp_path / "roomy") == [0, 1, 2]
    aged = Sink(tmp_path / "roomy", SERVER + "b", max_age_s=0.0)   # lists the folder's chunks at start
    _step(aged, 9.0)
    aged.flush()
    aged.drain()
    assert _parts(tmp_path / "roomy") == [] and len(list((tmp_path / "roomy" / "chunks").glob("*.kvtc"))) == 1


def test_a_chunk_of_several_steps_holds_and_names_every_row(tmp_path):
    """The builder seals each step's rows into one segment a column (sink.py's `_seal`): a chunk of several
    steps, each with several arrivals, holds every row in order, and its name counts its arrivals, not
    its segments."""
    from kvtrace.vllm.capture import chunk_format

    def build(sink: Sink, t: float) -> None:
        _build(sink, t)
        _build(sink, t + 0.25)   # two steps' rows, two arrivals, in one build
    sink = Sink(tmp_path / "capture", SERVER, wall_minus_monotonic=0.0)
    sink.build = partial(build, sink)
    for t in range(3):
        sink.add(float(t))
    sink.flush()
    sink.drain()
    (path,) = (tmp_path / "capture" / "chunks").glob("*.kvtc")
    assert path.stem.split("_")[-1] == "6"
    chunk = chunk_format.decode(path.read_bytes())
    assert chunk["arrivals"]["req_id"] == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert chunk["steps"]["start_s"] == [0.0, 0.25, 1.0, 1.25, 2.0, 2.25]
    assert chunk["arrivals"]["block_hashes"] == [[1, 2, 3]] * 6


def test_sealed_segments_write_the_chunk_flat_columns_would():
    """A step's numbers are sealed as typed arrays, other values as tuples (sink.py's `segment`): the
    chunk of those segments is the chunk of the same values as flat columns, byte for byte, whatever
    each step's values are (integers, floats, integers beside floats, nulls, strings, block ids)."""
    from kvtrace.vllm.capture import chunk_format
    from kvtrace.vllm.capture.sink import segment

    steps = {   # a column's values, step by step (three steps of 2, 1 and 3 rows)
        "idx": [[0, 1], [2], [3, 4, 2**40]],
        "ts_s": [[0.5, 0.5], [1.0], [2.25, 2.5, 2.5]],
        "device_ms": [[1.5, 2], [None], [4, 5, 6]],   # floats first with integers, a null, integers alone
        "mixed": [[1, 2.5], [3], [4.0, 5, 6]],          # an integer first, then a float
        "req_id": [["r0", "r1"], ["r2"], [None, "r3", "r4"]],
        "blocks": [[(1, 2), (3,)], [None], [(4, 5, 6), (), (7,)]],
    }
    flat = {"t": {name: [v for step in values for v in step] for name, values in steps.items()}}
    sealed = {"t": {name: [segment(step) for step in values] for name, values in steps.items()}}
    assert type(sealed["t"]["idx"][0]).__name__ == "array" and type(sealed["t"]["req_id"][0]) is tuple
    data = chunk_format.encode(sealed, segments=True)
    assert data == chunk_format.encode(flat)
    assert chunk_format.decode(data)["t"]["idx"] == [0, 1, 2, 3, 4, 2**40]


def test_block_ids_kept_flat_write_the_chunk_tuples_would():
    """The capture keeps a step's block ids flat (chunk_format.Lists: no object a row), each step one run
    or several joined (sink.py's `segment`): the chunk is the chunk of the same rows as tuples, byte for
    byte, null rows, empty ones and arrays among them, and reads back as those rows."""
    from array import array

    from kvtrace.vllm.capture import chunk_format
    from kvtrace.vllm.capture.chunk_format import Lists
    from kvtrace.vllm.capture.sink import segment

    steps = [[(1, 2), array("q", [3])], [None], [(4, 5, 6), (), array("q"), (2**40,)], [(8,), (9, 10)]]
    runs = [[Lists(step)] for step in steps[:3]] + [[Lists(steps[3][:1]), Lists(steps[3][1:])]]   # the last: two runs
    rows = [None if b is None else tuple(b) for step in steps for b in step]
    sealed = {"t": {"blocks": [segment(step_runs) for step_runs in runs], "n": [segment([1] * len(step)) for step in steps]}}
    assert all(type(run) is Lists for run in sealed["t"]["blocks"])
    flat = {"t": {"blocks": rows, "n": [1] * len(rows)}}
    data = chunk_format.encode(sealed, segments=True)
    assert data == chunk_format.encode(flat)
    assert [None if b is None else tuple(b) for b in chunk_format.decode(data)["t"]["blocks"]] == rows
    assert Lists.joined(runs[3]).rows() == [(8,), (9, 10)] and Lists(steps[1]).rows() == [None]


def test_a_full_disk_stops_the_capture_with_one_warning(tmp_path, monkeypatch, caplog):
    told: list[BaseException] = []   # the recorder's on_stop writes error.json (reason disk) from it
    sink = Sink(tmp_path / "capture", SERVER, on_stop=told.append)
    _step(sink, 0.0)
    sink.flush()
    sink.drain()

    def full(path, data, mode):   # the disk fills up halfway through the chunk's bytes
        (path.parent / f".{path.name}.tmp").write_bytes(data[:100])
        (path.parent / f".{path.name}.tmp").unlink()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink_module, "write_file", full)
    with caplog.at_level(logging.WARNING, logger="vllm.kvtrace.capture"):
        for t in range(1, 4):
            _step(sink, float(t))
            sink.flush()   # never raises
            sink.drain()
    assert [r.getMessage() for r in caplog.records if "kvtrace capture stopped" in r.getMessage()] == [
        f"kvtrace capture stopped (vLLM serves on): cannot write into {sink.folder}: "
        "[Errno 28] No space left on device"]
    assert _parts(tmp_path / "capture") == [0] and isinstance(sink.error, OSError)
    assert told == [sink.error]                                      # said once, with the disk's error
    assert not list((tmp_path / "capture").rglob("*.tmp"))          # no half-written chunk left
    assert not sink.columns["steps"]["step"]                         # rows are dropped, not kept in memory


def test_a_removed_folder_stops_the_capture(tmp_path, caplog):
    sink = Sink(tmp_path / "capture", SERVER)
    shutil.rmtree(tmp_path / "capture")
    with caplog.at_level(logging.WARNING, logger="vllm.kvtrace.capture"):
        _step(sink, 0.0)
        sink.flush()
        sink.drain()
        _step(sink, 1.0)
        sink.flush()
        sink.drain()
    assert len([r for r in caplog.records if "kvtrace capture stopped" in r.getMessage()]) == 1
    assert not (tmp_path / "capture").exists()


def test_a_slow_disk_never_holds_a_step_and_loses_whole_chunks_counted(tmp_path, monkeypatch, caplog):
    """Each write takes 0.5 s: a flush (the engine's thread) returns at once; once the queue is full whole
    chunks are dropped, said once in the log, counted in dropped.json, and `capture ls` shows the gap with its
    reason; what was queued is written, whole."""
    import time

    real = Sink._write_file

    def slow(self, path, data):
        time.sleep(0.5)
        return real(self, path, data)

    monkeypatch.setattr(Sink, "_write_file", slow)
    folder = tmp_path / "capture"
    sink = Sink(folder, SERVER, wall_minus_monotonic=0.0, queue_chunks=2)
    waits = []
    with caplog.at_level(logging.WARNING, logger="vllm.kvtrace.capture"):
        for t in range(8):
            _step(sink, float(t))
            start = time.perf_counter()
            sink.flush()
            waits.append(time.perf_counter() - start)
        sink.close()
    assert max(waits) < 0.1, waits                          # never the disk's 0.5 s
    written = _parts(folder)
    assert sink.num_dropped == 8 - len(written) >= 4 and written[0] == 0
    warned = [r.getMessage() for r in caplog.records if "slower than the capture" in r.getMessage()]
    assert len(warned) == 1
    said = json.loads((folder / "servers" / f"{SERVER}.dropped.json").read_text())
    assert said["dropped_chunks"] == sink.num_dropped and said["dropped_rows"] == 2 * sink.num_dropped
    assert sorted(p for s in said["spans"] for p in range(s["parts"][0], s["parts"][1] + 1)) == sorted(
        set(range(8)) - set(written))
    (folder / "servers" / f"{SERVER}.json").write_text(json.dumps({"server_id": SERVER, "pid": 77}))
    out = CliRunner().invoke(app, ["capture", "ls", str(folder)]).stdout
    assert "dropped" in out and "the disk was slower than the capture" in out and "missing" not in out
    from kvtrace.vllm.metrics import Exporter
    following = tmp_path / "following"   # the exporter of that folder (its test chunks' rows are no trace's)
    shutil.copytree(folder / "servers", following / "servers")
    exporter = Exporter(following, window_s=60.0)
    try:
        exporter.poll()
        (family,) = [m for m in exporter.collect() if m.name == "kvtrace_capture_dropped_chunks"]
        assert [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
            ({"server": SERVER}, sink.num_dropped)]
    finally:
        exporter.close()


def test_the_capture_files_are_for_owner_and_group_whatever_the_umask(tmp_path, monkeypatch):
    import os
    import stat

    from kvtrace.vllm.capture.files import parse_mode

    old = os.umask(0o000)   # a umask that would leave everything open to everyone
    try:
        sink = Sink(tmp_path / "capture", SERVER)
        _step(sink, 0.0)
        sink.close()
        own = Sink(tmp_path / "private", SERVER, file_mode=parse_mode("0600", "KVTRACE_CAPTURE_MODE"))
        _step(own, 0.0)
        own.close()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "capture") == mode(tmp_path / "capture" / "chunks") == 0o750
    assert [mode(p) for p in (tmp_path / "capture" / "chunks").iterdir()] == [0o640]
    assert mode(tmp_path / "private" / "chunks") == 0o700
    assert [mode(p) for p in (tmp_path / "private" / "chunks").iterdir()] == [0o600]
    for bad in ("0999", "rw-r-----", "0040"):
        try:
            parse_mode(bad, "KVTRACE_CAPTURE_MODE")
        except ValueError as exc:
            assert str(exc).startswith(f"KVTRACE_CAPTURE_MODE='{bad}'")
        else:
            raise AssertionError(bad)


def test_at_interpreter_shutdown_the_last_chunk_is_written_without_a_thread(tmp_path, monkeypatch):
    """Python 3.12 refuses to start a thread in an atexit handler, where the capture's close may run:
    the chunk is then written on the closing thread."""
    import threading

    def refused(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    sink = Sink(tmp_path / "capture", SERVER)
    _step(sink, 0.0)
    sink.close()
    assert _parts(tmp_path / "capture") == [0] and sink.error is None


def test_a_steps_rows_are_built_off_the_engines_thread_and_a_builder_error_stops_only_the_capture(tmp_path):
    """The engine's thread only hands rows over: a slow build never holds it, the rows are built on the
    builder thread, in the order handed over, and an error in building drops the rows from then on (not
    kept in memory) and is kept for the recorder to stop the capture with (build_error), never raising
    into the engine's thread. (That the recorder then stops, says so and vLLM decides on:
    tests/vllm/test_capture_on_vllm.py's planted errors.)"""
    built: list[tuple[str, float]] = []

    def slow_build(t):
        time.sleep(0.2)
        built.append((threading.current_thread().name, t))
        _build(sink, t)

    sink = Sink(tmp_path / "capture", SERVER, build=slow_build, wall_minus_monotonic=0.0)
    start = time.perf_counter()
    for t in range(3):
        sink.add(float(t))
    sink.flush()
    assert time.perf_counter() - start < 0.1            # never the builder's 0.6 s
    sink.drain()
    assert built == [("kvtrace-capture-builder", float(t)) for t in range(3)]
    assert _parts(tmp_path / "capture") == [0] and sink.build_s > 0.0 and sink.build_error is None

    def broken(t):
        raise KeyError("a column the capture's own bug names")

    sink.build = broken
    for t in range(3, 6):
        sink.add(float(t))   # never raises
        sink.flush()
    sink.drain()
    assert isinstance(sink.build_error, KeyError) and sink.error is sink.build_error
    assert _parts(tmp_path / "capture") == [0] and not sink.columns["steps"]["step"]
    sink.close()
