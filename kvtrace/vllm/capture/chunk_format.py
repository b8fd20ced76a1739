"""The capture's chunk file: columns of typed values behind a header that names the format's version.

Written inside vLLM's environment, so the standard library only; read by `kvtrace capture ...`, whose
reader can run no code whatever a file holds (a pickle could: anyone able to write into a capture
folder would run code as whoever reads it). A chunk is

    KVTRACE-CHUNK <format>\\n          the magic line: the format's version, in ASCII
    <header length> <checksum>         4 bytes each, big-endian: the CRC-32 of the header and body
    <header>                           JSON: tables, rows, each column's type and where its bytes lie
    <body>                             the columns' bytes, zlib-compressed as one stream

A column is one of five types: `i8` (64-bit integers), `f8` (64-bit floats), `str` (UTF-8, with each
value's length), `i8list` (a list of integers per row: block ids, block hashes, with each row's
length), `null` (every value None). A column with some None values carries a null mask (one byte a row).
Integers and floats are in the writer's byte order, which the header names. The reader checks every
length against the rows and the body before it trusts it, checks the checksum, and decompresses no
more than the header announced: a truncated, damaged, planted or foreign file is a `ChunkError`,
never a crash or a half-read table.

FORMAT changes when a reader of the older version could not read the new one; a reader refuses a
version it does not know with one line (the chunk is skipped, the others read). Format 2: a tokens
row may stand for several tokens (its `num_tokens`; sink.py's CHUNK_COLUMNS), which a reader of
format 1 would take for one; this reader reads both (READS).
"""
from __future__ import annotations

import json
import struct
import sys
import zlib
from array import array
from itertools import accumulate, chain

FORMAT = 2
READS = (1, 2)               # the formats this reader reads
MAGIC = b"KVTRACE-CHUNK "
SUFFIX = ".kvtc"
MAX_HEADER = 16 * 1024**2    # bytes: a header is a few KB; a larger one is no chunk of ours
MAX_BODY = 4 * 1024**3       # bytes once decompressed: no chunk is this big (a chunk holds seconds of rows)


class ChunkError(ValueError):
    """A file that is no chunk this reader understands (says why)."""


# ---- writing ---------------------------------------------------------------------------------------------
def encode(tables: dict[str, dict[str, list]], meta: dict | None = None, level: int = 1,
           segments: bool = False) -> bytes:
    """The chunk's bytes: `tables` is `{table: {column: values}}`, every column of a table as long as the
    others; `meta` goes into the header as it is (JSON). TypeError for a value of no column type.
    `segments`: each column is a list of runs of values (the sink's, sink.py's `_seal`), joined here a
    column at a time."""
    parts: list[bytes] = []
    offset = 0

    def put(data: bytes) -> list[int]:
        nonlocal offset
        parts.append(data)
        span = [offset, len(data)]
        offset += len(data)
        return span

    header_tables = {}
    for table, cols in tables.items():
        rows = None
        described = {}
        for name, values in cols.items():
            typed = _typed(values) if segments else None
            if segments and typed is None:
                values = list(chain.from_iterable(values))
            num_values = len(values) if typed is None else sum(map(len, values))
            if rows is None:
                rows = num_values
            if num_values != rows:
                raise TypeError(f"{table}.{name}: {num_values} values, the table has {rows} rows")
            kind, nulls, *data = _column(values) if typed is None else typed
            entry = {"type": kind, "nulls": put(nulls) if nulls else None}
            if data:
                entry["data"] = put(data[0])
            if len(data) > 1:
                entry["lengths"] = put(data[1])
            described[name] = entry
        header_tables[table] = {"rows": rows or 0, "columns": described}
    body = b"".join(parts)
    header = json.dumps({"format": FORMAT, "byteorder": sys.byteorder, "compression": "zlib",
                         "raw_bytes": len(body), "tables": header_tables, **(meta or {})},
                        separators=(",", ":")).encode()
    packed = zlib.compress(body, level)
    checksum = zlib.crc32(packed, zlib.crc32(header))
    return b"".join((MAGIC, str(FORMAT).encode(), b"\n", struct.pack(">II", len(header), checksum), header, packed))


class Lists:
    """A run of an `i8list` column's rows kept flat: every row's integers one after another, each row's
    length, and a null mask (b"" where no row is null), so that a row is no object of its own. The
    capture's block ids are kept so (sink.py's `segment`): a tuple a row, each an object the cyclic GC
    tracks until its first collection, was hundreds of objects a step at 1,024 running for the young
    generation's collections to count, and each collection promotes whatever the server holds then."""

    __slots__ = ("lengths", "nulls", "values")

    def __init__(self, rows: list | tuple) -> None:
        """`rows`: each a sequence of integers or None."""
        self.values = array("q", chain.from_iterable(filter(None, rows)))
        self.lengths = array("q", [len(row) if row else 0 for row in rows])
        self.nulls = bytes(row is None for row in rows) if None in rows else b""

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def joined(cls, runs: list[Lists]) -> Lists:
        """The runs' rows as one run, in order."""
        if len(runs) == 1:
            return runs[0]
        joined = cls(())
        for run in runs:
            joined.values += run.values
            joined.lengths += run.lengths
        if any(run.nulls for run in runs):
            joined.nulls = b"".join(run.nulls or bytes(len(run)) for run in runs)
        return joined

    def rows(self) -> list:
        """The rows as tuples (None for a null row), for a look at a run (the encoder never needs them)."""
        values, at, rows = self.values, 0, []
        for i, n in enumerate(self.lengths):
            rows.append(None if self.nulls and self.nulls[i] else tuple(values[at:at + n]))
            at += n
        return rows


def _typed(segments: list) -> tuple | None:
    """`_column` of a column whose segments are all typed arrays of one type (the sink seals a step's
    numbers so, sink.py's `segment`): their bytes joined as they are, no Python object made per value
    (a chunk of two seconds at 1,024 running with drafts holds over a million, and the writer's thread
    holds the GIL while it encodes them); the same of a list column's flat runs (`Lists`); None for any
    other column."""
    if segments and all(type(segment) is Lists for segment in segments):
        run = Lists.joined(segments)
        return ("i8list", run.nulls, run.values.tobytes(), run.lengths.tobytes())
    codes = {getattr(segment, "typecode", None) for segment in segments}
    if codes == {"q"} or codes == {"d"}:
        return ("i8" if codes == {"q"} else "f8", b"", b"".join(segment.tobytes() for segment in segments))
    return None


def _column(values: list) -> tuple:
    """(type, null mask or b"", data bytes[, lengths bytes]) of one column's values."""
    nones = values.count(None)
    if nones == len(values):
        return ("null", b"")
    nulls = b""
    first = next(v for v in values if v is not None)
    if nones:
        nulls = bytes(v is None for v in values)
        blank = "" if isinstance(first, str) else () if isinstance(first, (list, tuple)) else 0
        values = [blank if v is None else v for v in values]
    if isinstance(first, (bool, int, float)):
        try:
            return ("i8", nulls, array("q", values).tobytes())
        except TypeError:                 # floats among them (an int column's overflow raises: not ours)
            return ("f8", nulls, array("d", values).tobytes())
    if isinstance(first, str):
        encoded = list(map(str.encode, values))    # TypeError if any is not a str
        return ("str", nulls, b"".join(encoded), array("q", map(len, encoded)).tobytes())
    if isinstance(first, (list, tuple)):
        return ("i8list", nulls, array("q", chain.from_iterable(values)).tobytes(),
                array("q", map(len, values)).tobytes())
    raise TypeError(f"no chunk column holds a {type(first).__name__}")


# ---- reading ---------------------------------------------------------------------------------------------
def _frame(data: bytes) -> tuple[int, int, int]:
    """Where a chunk's header starts and its body starts, and its checksum."""
    if not data.startswith(MAGIC):
        raise ChunkError("not a kvtrace capture chunk (no KVTRACE-CHUNK line at its start)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + 12)
    version = data[len(MAGIC):end]
    if end < 0 or not version.isdigit():
        raise ChunkError("not a kvtrace capture chunk (its first line names no format)")
    if int(version) not in READS:
        raise ChunkError(f"chunk format {int(version)}; this kvtrace reads formats "
                         f"{', '.join(map(str, READS))} (read it with the kvtrace that wrote it, or a newer one)")
    start = end + 1 + 8
    if len(data) < start:
        raise ChunkError("truncated: it ends inside its header")
    size, checksum = struct.unpack(">II", data[end + 1:start])
    if size > MAX_HEADER:
        raise ChunkError("its header is too large")
    if len(data) < start + size:
        raise ChunkError("truncated: it ends inside its header")
    return start, start + size, checksum


def _header(data: bytes, start: int, end: int) -> dict:
    try:
        header = json.loads(data[start:end])
    except ValueError as exc:
        raise ChunkError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("tables"), dict):
        raise ChunkError("its header names no tables")
    return header


def read_header(data: bytes) -> tuple[dict, int]:
    """The header of a chunk's bytes (its body unchecked: the first few KB suffice) and where its body starts."""
    start, end, _ = _frame(data)
    return _header(data, start, end), end


def decode(data: bytes) -> dict[str, dict[str, list]]:
    """`{table: {column: values}}` of a chunk's bytes; ChunkError says what is wrong with them."""
    start, end, checksum = _frame(data)
    if zlib.crc32(data[end:], zlib.crc32(data[start:end])) != checksum:
        raise ChunkError("truncated or damaged: its checksum does not match its bytes")
    header = _header(data, start, end)
    raw = header.get("raw_bytes")
    if header.get("compression") != "zlib" or not isinstance(raw, int) or not 0 <= raw <= MAX_BODY:
        raise ChunkError("its header names no body this reader can read")
    inflate = zlib.decompressobj()
    try:
        body = inflate.decompress(data[end:], raw)
    except zlib.error as exc:
        raise ChunkError(f"its body is damaged ({exc})") from None
    if len(body) != raw or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise ChunkError(f"truncated or damaged: its body holds {len(body)} of the {raw} bytes its header announced")
    swap = header.get("byteorder") != sys.byteorder
    tables = {}
    try:
        for table, described in header["tables"].items():
            rows = described["rows"]
            if not isinstance(rows, int) or rows < 0:
                raise ChunkError(f"{table}: rows is not a count")
            tables[table] = {name: _values(body, entry, rows, swap, f"{table}.{name}")
                             for name, entry in described["columns"].items()}
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ChunkError(f"its header does not describe its columns ({type(exc).__name__}: {exc})") from None
    return tables


def _slice(body: bytes, span, what: str) -> bytes:
    if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(x, int) and x >= 0 for x in span)
            or span[0] + span[1] > len(body)):
        raise ChunkError(f"{what}: its bytes lie outside the chunk")
    return body[span[0]:span[0] + span[1]]


def _numbers(data: bytes, code: str, count: int | None, swap: bool, what: str) -> list:
    if len(data) % 8 or (count is not None and len(data) != 8 * count):
        raise ChunkError(f"{what}: {len(data)} bytes for {count} values")
    values = array(code)
    values.frombytes(data)
    if swap:
        values.byteswap()
    return values.tolist()


def _values(body: bytes, entry: dict, rows: int, swap: bool, what: str) -> list:
    kind = entry["type"]
    if kind == "null":
        return [None] * rows
    if kind not in ("i8", "f8", "str", "i8list"):
        raise ChunkError(f"{what}: a column of type {kind!r}, which this reader does not know")
    data = _slice(body, entry["data"], what)
    if kind in ("i8", "f8"):
        values = _numbers(data, "q" if kind == "i8" else "d", rows, swap, what)
    else:
        lengths = _numbers(_slice(body, entry["lengths"], what), "q", rows, swap, what)
        ends = list(accumulate(lengths))
        if any(n < 0 for n in lengths) or (ends[-1] if ends else 0) != (len(data) if kind == "str" else len(data) // 8):
            raise ChunkError(f"{what}: its lengths do not add up to its data")
        if kind == "str":
            values = [data[e - n:e].decode() for e, n in zip(ends, lengths)]
        else:
            flat = _numbers(data, "q", None, swap, what)
            values = [flat[e - n:e] for e, n in zip(ends, lengths)]
    if entry.get("nulls") is not None:
        mask = _slice(body, entry["nulls"], what)
        if len(mask) != rows:
            raise ChunkError(f"{what}: a null mask of {len(mask)} rows for {rows}")
        values = [None if m else v for v, m in zip(values, mask)]
    return values
