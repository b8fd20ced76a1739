"""The capture's chunk format (kvtrace/vllm/capture/chunk_format.py): what goes in comes out, with its
types; a damaged, truncated, foreign or newer file is a ChunkError and nothing else; and a capture
folder with a planted pickle and a truncated chunk in it is read by `capture run`, `watch` and
`metrics` without running anything, each skipped file said in one line, the rest kept."""
from __future__ import annotations

import json
import pickle
import shutil
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.chunk_format import ChunkError, decode, encode
from kvtrace.vllm.follow import ChunkReader
from kvtrace.vllm.importer import read_chunks

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "captures" / "bursts"

TABLES = {
    "steps": {"step": [0, 1, 2], "start_s": [1.5, 2.25, 3.0], "end_s": [1.75, 2.5, None],
              "admission_stop": ["budget", None, "é unicode ✓"], "swapped": [None, None, None]},
    "kv_events": {"blocks": [[1, 2, 3], [], None], "src_blocks": [None, [7], [2**62]],
                  "num_tokens": [-1, 0, 2**63 - 1], "duration_ms": [0, 1.5, None]},
    "empty": {"a": [], "b": []},
}


def test_what_goes_in_comes_out_with_its_types():
    back = decode(encode(TABLES, {"server_id": "s", "part": 3}))
    assert back == TABLES
    assert [type(v) for v in back["steps"]["step"]] == [int, int, int]
    assert [type(v) for v in back["kv_events"]["duration_ms"][:2]] == [float, float]
    header, _ = chunk_format.read_header(encode(TABLES, {"server_id": "s", "part": 3}))
    assert header["format"] == chunk_format.FORMAT and header["server_id"] == "s" and header["part"] == 3


def test_a_chunk_written_in_the_other_byte_order_reads_the_same(monkeypatch):
    data = encode(TABLES)
    other = "big" if sys.byteorder == "little" else "little"
    header, start = chunk_format.read_header(data)
    import zlib
    body = bytearray(zlib.decompress(data[start:]))
    for described in header["tables"].values():   # swap every 8-byte number, as the other machine wrote them
        for entry in described["columns"].values():
            for key in ("data", "lengths"):
                if key in entry and not (key == "data" and entry["type"] == "str"):
                    at, size = entry[key]
                    for i in range(at, at + size, 8):
                        body[i:i + 8] = body[i:i + 8][::-1]
    header["byteorder"] = other
    raw = json.dumps(header).encode()
    packed = zlib.compress(bytes(body))
    swapped = (chunk_format.MAGIC + b"1\n" + struct.pack(">II", len(raw), zlib.crc32(packed, zlib.crc32(raw)))
               + raw + packed)
    assert decode(swapped) == TABLES


def test_every_truncation_and_a_newer_format_are_chunk_errors():
    data = encode(TABLES)
    for end in range(len(data)):
        with pytest.raises(ChunkError):
            decode(data[:end])
    newer = data.replace(b"KVTRACE-CHUNK 2\n", b"KVTRACE-CHUNK 3\n", 1)
    with pytest.raises(ChunkError, match="chunk format 3; this kvtrace reads formats 1, 2"):
        decode(newer)
    with pytest.raises(ChunkError, match="not a kvtrace capture chunk"):
        decode(pickle.dumps(TABLES))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_bytes_are_a_chunk_error(data):
    """Any bytes changed or appended: the reader says ChunkError (the checksum, or the framing before it),
    and reads the chunk as written where nothing changed; it never raises anything else."""
    good = encode(TABLES)
    damaged = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, len(good) - 1))] = data.draw(st.integers(0, 255))
    damaged += data.draw(st.binary(max_size=8))
    if bytes(damaged) == good:
        assert decode(good) == TABLES
        return
    with pytest.raises(ChunkError):
        decode(bytes(damaged))


def test_a_header_that_lies_about_its_columns_is_a_chunk_error():
    """A planted chunk can carry a right checksum: its header is checked against its body all the same."""
    import zlib
    data = encode(TABLES)
    header, start = chunk_format.read_header(data)
    body = zlib.decompress(data[start:])
    for lie in ({"rows": 4}, {"rows": -1}, {"columns": {"step": {"type": "i8", "data": [0, 10**9]}}},
                {"columns": {"step": {"type": "pickle", "data": [0, 8]}}},
                {"columns": {"step": {"type": "str", "data": [0, 8], "lengths": [0, 24]}}},
                {"columns": {"step": {"type": "i8", "data": [0, 24], "nulls": [0, 2]}}}):
        lied = json.loads(json.dumps(header))
        lied["tables"]["steps"].update(lie)
        raw = json.dumps(lied).encode()
        packed = zlib.compress(body)
        forged = (chunk_format.MAGIC + b"1\n" + struct.pack(">II", len(raw), zlib.crc32(packed, zlib.crc32(raw)))
                  + raw + packed)
        with pytest.raises(ChunkError):
            decode(forged)


def test_a_value_of_no_column_type_is_refused_when_written():
    with pytest.raises(TypeError):
        encode({"t": {"c": [object()]}})
    with pytest.raises(TypeError):
        encode({"t": {"c": [1, 2], "d": [1]}})


# ---- planted files in a capture folder ------------------------------------------------------------------------
class Planted:
    """Loading its pickle creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture
def planted(tmp_path):
    """The fixture capture with a pickle that creates a file when loaded (under an old chunk's name and
    under a new one's) and a truncated chunk among its chunks."""
    capture = tmp_path / "capture"
    shutil.copytree(FIXTURE, capture)
    marker = tmp_path / "ran"
    payload = pickle.dumps({"steps": Planted(marker)})
    pickle.loads(payload)                     # the plant is real: loading it runs code
    assert marker.exists()
    marker.unlink()
    chunks = sorted((capture / "chunks").glob("*.kvtc"))
    server = chunks[0].name.split("_")[0]
    (capture / "chunks" / f"{server.split('-')[-1]}-000099.pkl").write_bytes(payload)
    disguised = capture / "chunks" / chunks[-1].name.replace("_000074_", "_000098_")
    disguised.write_bytes(payload)
    truncated = capture / "chunks" / chunks[-1].name.replace("_000074_", "_000097_")
    truncated.write_bytes(chunks[40].read_bytes()[:300])
    return capture, marker, {f"{server.split('-')[-1]}-000099.pkl", disguised.name, truncated.name}


def _skipped(text: str) -> set[str]:
    return {Path(line.removeprefix("kvtrace: skipped ").split(": ")[0]).name
            for line in text.splitlines() if line.startswith("kvtrace: skipped ")}


def test_capture_run_runs_nothing_says_each_skipped_file_and_keeps_the_rest(planted, tmp_path):
    capture, marker, bad = planted
    result = CliRunner().invoke(app, ["capture", "run", str(capture), "-o", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert not marker.exists()
    assert _skipped(result.stderr) == bad and len(result.stderr.splitlines()) == len(bad) + 1   # + "wrote ..."
    clean = CliRunner().invoke(app, ["capture", "run", str(FIXTURE), "-o", str(tmp_path / "clean")])
    assert clean.exit_code == 0 and not _skipped(clean.stderr)
    listed = CliRunner().invoke(app, ["capture", "ls", str(capture)]).stdout
    assert "not read: 1 file of chunks/ that no kvtrace reads (first: 24953-000099.pkl" in listed   # by its name
    assert not marker.exists()
    rows = json.loads((tmp_path / "run" / "meta.json").read_text())["summary"]["rows"]
    assert rows == json.loads((tmp_path / "clean" / "meta.json").read_text())["summary"]["rows"]


def test_watch_and_the_exporter_run_nothing_and_say_each_skipped_file_once(planted, capsys):
    capture, marker, bad = planted
    result = CliRunner().invoke(app, ["capture", "watch", str(capture), "--once", "--window", "90s"],
                                env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert not marker.exists() and _skipped(result.stderr) == bad
    lines: list[str] = []
    reader = ChunkReader(capture, warn=lines.append)
    assert len(reader.new_chunks()) == len(list(FIXTURE.glob("chunks/*.kvtc")))
    assert reader.new_chunks() == []   # said once, counted once
    assert _skipped("\n".join(lines)) == bad and len(lines) == len(bad) and reader.num_unreadable == len(bad)
    from kvtrace.vllm.metrics import Exporter
    exporter = Exporter(capture, window_s=60.0)
    try:
        exporter.poll()
        skipped = {m.name: m.samples[0].value for m in exporter.collect() if m.name == "kvtrace_capture_chunks_skipped"}
        assert skipped == {"kvtrace_capture_chunks_skipped": len(bad)}
    finally:
        exporter.close()
    assert not marker.exists()
    assert _skipped(capsys.readouterr().err) == bad


def test_read_chunks_of_a_planted_folder_keeps_every_good_chunk(planted):
    capture, marker, bad = planted
    lines: list[str] = []
    columns = read_chunks(capture, warn=lines.append)
    assert not marker.exists() and _skipped("\n".join(lines)) == bad
    assert columns["steps"]["step"] == read_chunks(FIXTURE, warn=lines.append)["steps"]["step"]


def test_a_tokens_row_of_several_tokens_reads_as_a_row_each(tmp_path):
    """Format 2: a speculative step's tokens are a row per request (num_tokens of them from idx on); the
    reader gives every reader past it a row per token, and a format-1 chunk (no such column) reads as it
    was written."""
    from kvtrace.vllm.importer import read_chunk

    tokens = {"req_id": ["a", "b", "c"], "sample": [0, 0, 0], "idx": [4, 0, 7], "token_id": [None, None, 9],
              "step": [3, 3, 3], "ts_s": [1.5, 1.5, 1.5]}
    path = tmp_path / "c.kvtc"
    path.write_bytes(encode({"tokens": {**tokens, "num_tokens": [3, 1, None]}}))
    t = read_chunk(path)["tokens"]
    assert t == {"req_id": ["a", "a", "a", "b", "c"], "sample": [0] * 5, "idx": [4, 5, 6, 0, 7],
                 "token_id": [None, None, None, None, 9], "step": [3] * 5, "ts_s": [1.5] * 5}
    path.write_bytes(encode({"tokens": tokens}).replace(b"KVTRACE-CHUNK 2\n", b"KVTRACE-CHUNK 1\n", 1))
    assert read_chunk(path)["tokens"] == tokens
    for bad in (0, -2, 1.5):
        path.write_bytes(encode({"tokens": {**tokens, "num_tokens": [3, bad, 1]}}))
        with pytest.raises(ChunkError, match="num_tokens"):
            read_chunk(path)
