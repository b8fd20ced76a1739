"""Perfetto's native trace format, written one packet at a time or a table of packets at once.

A Perfetto trace is the protobuf message `Trace { repeated TracePacket packet = 1; }`. On the wire
a repeated field is just its elements one after another, each as tag 0x0a, the length as a varint,
then the packet's bytes, so a trace can be appended to a file packet by packet: memory stays flat
however long the trace. The message classes are the ones Perfetto generates for Python (PyPI
`perfetto`); the tests decode the file back with the same classes.

What the writer looks after, so the exporter only says what goes where:
- sequences: every packet carries `trusted_packet_sequence_id`; the first packet of a sequence sets
  SEQ_INCREMENTAL_STATE_CLEARED, and every track event SEQ_NEEDS_INCREMENTAL_STATE (it refers to
  interned names, which are that incremental state);
- interning: an event name or an argument name is sent once per sequence, in the `interned_data`
  of the first packet that uses it, and referred to by its id (iid, from 1) afterwards;
- arguments as debug annotations: int, float, str and bool values; None is left out.
Timestamps are integer nanoseconds on the trace's default clock.

Track descriptors (a few per run and sequence) are built with the message classes. Track events,
millions of them, come as an Arrow table with one row per packet in the order they are to be
written (`events`), and are encoded with numpy a column at a time: each field is a column of byte
strings (a tag, a varint, a length-prefixed string, 8 little-endian bytes), and a packet is its
fields' byte strings side by side, written in field-number order as protobuf's own serializer
writes them, so the bytes are the ones the message classes would give. Per packet, only the
interning of a name never seen before goes through Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

TYPE_SLICE_BEGIN = pb.TrackEvent.TYPE_SLICE_BEGIN
TYPE_SLICE_END = pb.TrackEvent.TYPE_SLICE_END
TYPE_INSTANT = pb.TrackEvent.TYPE_INSTANT
TYPE_COUNTER = pb.TrackEvent.TYPE_COUNTER
CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS_STATE = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
EXPLICIT_ORDER = pb.TrackDescriptor.EXPLICIT
UNIT_BYTES = pb.CounterDescriptor.UNIT_SIZE_BYTES
MERGE_BY_NAME = pb.TrackDescriptor.SIBLING_MERGE_BEHAVIOR_BY_TRACK_NAME

# The columns of a table of track events (`TraceWriter.events`), one row per packet; every column
# but type, ts and track may be left out (all null) and is left out of a packet where null. Any
# other column is an argument, a debug annotation named after it (in the order of the columns).
EVENT_COLUMNS = {
    "type": pa.int8(),                      # TYPE_SLICE_BEGIN / _END / INSTANT / COUNTER
    "ts": pa.int64(),                       # ns
    "track": pa.int64(),                    # track uuid
    "name": pa.string(),                    # interned: sent once per sequence, then by iid
    "plain_name": pa.string(),              # sent as is in every packet (names used once)
    "counter": pa.int64(),                  # counter_value
    "flow_ids": pa.list_(pa.int64()),
    "terminating_flow_ids": pa.list_(pa.int64()),
}

_PACKET_TAG = b"\x0a"                # field 1 (Trace.packet), wire type 2 (length-delimited)
# field tags: (number << 3) | wire type (0 varint, 1 fixed 64 bits, 2 length-delimited), as varints
_TIMESTAMP, _SEQUENCE_ID, _TRACK_EVENT, _INTERNED, _FLAGS = b"\x40", b"\x50", b"\x5a", b"\x62", b"\x68"
_ANNOTATION, _TYPE, _NAME_IID, _TRACK_UUID = b"\x22", b"\x48", b"\x50", b"\x58"
_NAME, _COUNTER_VALUE, _FLOW_IDS, _TERMINATING_FLOW_IDS = b"\xba\x01", b"\xf0\x01", b"\xf9\x02", b"\x81\x03"
_ANNOTATION_NAME_IID = b"\x08"
_TRACK_DESCRIPTOR = b"\xe2\x03"
_UUID, _TRACK_NAME, _PARENT_UUID, _SIBLING_ORDER_RANK = b"\x08", b"\x12", b"\x28", b"\x60"
# a debug annotation's value fields: bool_value, int_value, double_value, string_value
_BOOL, _INT, _DOUBLE, _STRING = b"\x10", b"\x20", b"\x29", b"\x32"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# --------------------------------------------------------------------------- columns of byte strings

@dataclass
class _Rows:
    """One byte string per row, side by side: row i is the next lengths[i] bytes of data."""
    data: np.ndarray            # uint8
    lengths: np.ndarray         # int64, one per row
    width: int = 0              # > 0: every row has 0 or `width` bytes


@dataclass
class _Const:
    """The same bytes in every row, or in the rows of `mask` and none in the others."""
    data: bytes
    mask: np.ndarray | None = None

    def lengths(self, n: int) -> np.ndarray | int:
        return len(self.data) if self.mask is None else self.mask * len(self.data)


_Piece = _Rows | _Const


def _lengths(n: int, pieces: list[_Piece]) -> np.ndarray:
    total = np.zeros(n, np.int64)
    for piece in pieces:
        total += piece.lengths if isinstance(piece, _Rows) else piece.lengths(n)
    return total


def _spread(n: int, mask: np.ndarray | None, data: np.ndarray, lengths: np.ndarray, width: int = 0) -> _Rows:
    """The byte strings of the rows of `mask` (all when None) as a column of n rows, empty elsewhere."""
    if mask is None:
        return _Rows(data, lengths, width)
    full = np.zeros(n, np.int64)
    full[mask] = lengths
    return _Rows(data, full, width)


def _concat(n: int, pieces: list[_Piece]) -> _Rows:
    """Row by row, the pieces' byte strings one after another."""
    merged: list[_Piece] = []
    for piece in pieces:                # neighbouring constants in the same rows: one piece
        if (isinstance(piece, _Const) and merged and isinstance(merged[-1], _Const)
                and merged[-1].mask is piece.mask):
            merged[-1] = _Const(merged[-1].data + piece.data, piece.mask)
        else:
            merged.append(piece)
    pieces = merged
    lengths = _lengths(n, pieces)
    out = np.empty(int(lengths.sum()), np.uint8)
    at = np.zeros(n, np.int64)          # where the next piece's bytes go, row by row
    np.cumsum(lengths[:-1], out=at[1:])
    for piece in pieces:
        if isinstance(piece, _Const):
            size = len(piece.data)
            rows = at if piece.mask is None else at[piece.mask]
            out[rows[:, None] + np.arange(size)] = np.frombuffer(piece.data, np.uint8)
            at += piece.lengths(n)
        elif piece.width:
            out[at[piece.lengths > 0][:, None] + np.arange(piece.width)] = piece.data.reshape(-1, piece.width)
            at += piece.lengths
        else:
            if piece.data.size:
                starts = np.cumsum(piece.lengths) - piece.lengths
                out[np.repeat(at - starts, piece.lengths) + np.arange(piece.data.size)] = piece.data
            at += piece.lengths
    return _Rows(out, lengths)


def _varints(values: np.ndarray, mask: np.ndarray | None = None) -> _Rows:
    """Protobuf varints of integers (negative ones as their 64-bit two's complement, 10 bytes)."""
    n = len(values)
    if mask is not None:
        values = values[mask]
    values = values.astype(np.int64, copy=False).view(np.uint64)
    top = int(values.max(initial=0))
    if top < 0x80:                                              # one byte each
        return _spread(n, mask, values.astype(np.uint8), np.ones(len(values), np.int64), width=1)
    width = (top.bit_length() + 6) // 7
    # groups: [values, width] the 7-bit groups, low first, with the continuation bit where more follow
    shifts = np.arange(0, 7 * width, 7, dtype=np.uint64)
    groups = (values[:, None] >> shifts).astype(np.uint8) & 0x7F
    lengths = np.ones(len(values), np.int64)
    for k in range(1, width):
        lengths += values >= np.uint64(1 << (7 * k))
    used = np.arange(width) < lengths[:, None]
    groups[:, :-1] |= (used[:, 1:] * 0x80).astype(np.uint8)
    return _spread(n, mask, groups[used], lengths)


def _fixed64(tag: bytes, values: np.ndarray, counts: np.ndarray) -> _Rows:
    """Each of the (64-bit) values as `tag` and its 8 little-endian bytes; `counts` says how many
    of them each row has, in order."""
    entry = np.empty((len(values), len(tag) + 8), np.uint8)
    entry[:, :len(tag)] = np.frombuffer(tag, np.uint8)
    entry[:, len(tag):] = values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, 8)
    return _Rows(entry.reshape(-1), counts * entry.shape[1], entry.shape[1] if counts.max(initial=0) <= 1 else 0)


def _strings(column: pa.Array, mask: np.ndarray) -> _Rows:
    """The UTF-8 bytes of a string column's rows (none for the rows outside `mask`)."""
    column = pc.fill_null(column, "").cast(pa.large_string())
    offsets = np.frombuffer(column.buffers()[1], np.int64)[column.offset:column.offset + len(column) + 1]
    data = np.frombuffer(column.buffers()[2], np.uint8) if column.buffers()[2] is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets) * mask
    keep = np.repeat(mask, np.diff(offsets))
    return _Rows(data[offsets[0]:offsets[-1]][keep], lengths)


def _field_varint(tag: bytes, values: np.ndarray, mask: np.ndarray | None) -> list[_Piece]:
    return [_Const(tag, mask), _varints(values, mask)]


def _field_bytes(tag: bytes, body: list[_Piece], n: int, mask: np.ndarray | None) -> list[_Piece]:
    """A length-delimited field whose value is `body` (empty in the rows outside `mask`)."""
    return [_Const(tag, mask), _varints(_lengths(n, body), mask), *body]


def _valid(column: pa.Array) -> np.ndarray:
    return np.asarray(column.is_valid(), dtype=bool)


def _numbers(column: pa.Array, dtype: type) -> np.ndarray:
    return np.asarray(pc.fill_null(column, 0).to_numpy(zero_copy_only=False), dtype=dtype)


def _list_values(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, how many per row) of a list<int64> column; a null list has none."""
    counts = _numbers(pc.list_value_length(column), np.int64)
    return np.asarray(column.flatten().to_numpy(zero_copy_only=False), np.int64), counts


class TraceWriter:
    """Appends TracePackets to a binary file; `close()` writes what is still buffered."""

    def __init__(self, file: BinaryIO, buffer_bytes: int = 1 << 20) -> None:
        self.file = file
        self.buffer_bytes = buffer_bytes
        self.num_packets = 0
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._sequence_id = 0
        self._cleared = False
        self._event_names: dict[str, int] = {}
        self._arg_names: dict[str, int] = {}

    def start_sequence(self, sequence_id: int) -> None:
        """Packets from here on belong to `sequence_id`, whose interned names start afresh."""
        assert sequence_id > 0, "sequence ids start at 1"
        self._sequence_id = sequence_id
        self._cleared = False
        self._event_names = {}
        self._arg_names = {}

    # ------------------------------------------------------------------ packets

    def track(self, uuid: int, name: str, parent: int | None = None, rank: int | None = None,
              explicit_child_order: bool = False, description: str | None = None,
              counter: pb.CounterDescriptor | None = None, merge_by_name: bool = False) -> None:
        """Describe a track; `rank` orders it among its parent's children when the parent asked for
        explicit order; `merge_by_name`: the UI shows it and its siblings of the same name as one."""
        assert self._sequence_id, "start_sequence() first"
        packet = pb.TracePacket()
        packet.trusted_packet_sequence_id = self._sequence_id
        if not self._cleared:
            packet.sequence_flags = CLEARED
            self._cleared = True
        track = packet.track_descriptor
        track.uuid = uuid
        track.name = name
        if parent is not None:
            track.parent_uuid = parent
        if rank is not None:
            track.sibling_order_rank = rank
        if explicit_child_order:
            track.child_ordering = EXPLICIT_ORDER
        if description:
            track.description = description
        if counter is not None:
            track.counter.CopyFrom(counter)
        if merge_by_name:
            track.sibling_merge_behavior = MERGE_BY_NAME
        self._write(packet.SerializeToString())

    def tracks(self, uuids: np.ndarray, names: pa.Array, parent: int, ranks: np.ndarray) -> None:
        """Describe many tracks under one parent at once, as `track` would one by one."""
        assert self._cleared, "the first packet of a sequence is a track descriptor"
        n = len(uuids)
        if n == 0:
            return
        everywhere = np.ones(n, bool)
        text = _strings(names, everywhere)
        descriptor = [*_field_varint(_UUID, uuids, None), *_field_bytes(_TRACK_NAME, [text], n, None),
                      _Const(_PARENT_UUID + _varint(parent)), *_field_varint(_SIBLING_ORDER_RANK, ranks, None)]
        packet = [_Const(_SEQUENCE_ID + _varint(self._sequence_id)), *_field_bytes(_TRACK_DESCRIPTOR, descriptor, n, None)]
        self._write_rows(_concat(n, _field_bytes(_PACKET_TAG, packet, n, None)), n)

    def events(self, table: pa.Table) -> None:
        """Write one track event per row of `table` (columns: EVENT_COLUMNS, then the arguments), in
        its order. The packets are those the message classes would give, field by field."""
        assert self._cleared, "the first packet of a sequence is a track descriptor"
        n = table.num_rows
        if n == 0:
            return
        table = table.combine_chunks()
        columns = {name: table.column(name).chunk(0) for name in table.column_names
                   if table.column(name).null_count < n}          # an all-null column: no field
        args = [name for name in columns if name not in EVENT_COLUMNS]
        interned: dict[int, pb.InternedData] = {}       # row -> the names it is the first to use
        self._intern_args({arg: _valid(columns[arg]) for arg in args}, interned)

        event: list[_Piece] = []
        for arg in args:
            event += self._annotation(self._arg_names.get(arg, 0), columns[arg], n)
        event += _field_varint(_TYPE, _numbers(columns["type"], np.int64), None)
        if "name" in columns:
            event += self._name_iids(columns["name"], n, interned)
        event += _field_varint(_TRACK_UUID, _numbers(columns["track"], np.int64), None)
        if "plain_name" in columns:
            present = _valid(columns["plain_name"])
            text = _strings(columns["plain_name"], present)
            event += _field_bytes(_NAME, [text], n, present)
        if "counter" in columns:
            event += _field_varint(_COUNTER_VALUE, _numbers(columns["counter"], np.int64), _valid(columns["counter"]))
        for name, tag in (("flow_ids", _FLOW_IDS), ("terminating_flow_ids", _TERMINATING_FLOW_IDS)):
            if name in columns:
                values, counts = _list_values(columns[name])
                event.append(_fixed64(tag, values.view(np.uint64), counts))

        packet = [*_field_varint(_TIMESTAMP, _numbers(columns["ts"], np.int64), None),
                  _Const(_SEQUENCE_ID + _varint(self._sequence_id)),
                  *_field_bytes(_TRACK_EVENT, event, n, None)]
        if interned:
            rows = np.fromiter(interned, np.int64, len(interned))
            order = np.argsort(rows)
            encoded = [interned[int(row)].SerializeToString() for row in rows[order]]
            body = _Rows(np.frombuffer(b"".join(encoded), np.uint8),
                         np.array([len(b) for b in encoded], np.int64))
            mask = np.zeros(n, bool)
            mask[rows] = True
            packet += _field_bytes(_INTERNED, [_spread(n, mask, body.data, body.lengths)], n, mask)
        packet.append(_Const(_FLAGS + _varint(NEEDS_STATE)))
        self._write_rows(_concat(n, _field_bytes(_PACKET_TAG, packet, n, None)), n)

    def close(self) -> None:
        self._flush()

    # ------------------------------------------------------------------ helpers

    def _name_iids(self, column: pa.Array, n: int, interned: dict[int, pb.InternedData]) -> list[_Piece]:
        """name_iid of each row with a name, interning the names new to this sequence in the first
        row that uses each (ids in the order of those rows)."""
        present = _valid(column)
        encoded = column.dictionary_encode()
        codes = _numbers(encoded.indices, np.int64)
        names = encoded.dictionary.to_pylist()
        iids = np.zeros(len(names), np.int64)
        new = []
        for code, name in enumerate(names):
            if name in self._event_names:
                iids[code] = self._event_names[name]
            else:
                new.append(code)
        if new:
            rows = np.flatnonzero(present)
            used, first = np.unique(codes[rows], return_index=True)
            first_row = dict(zip(used.tolist(), rows[first].tolist()))
            for code in sorted(new, key=first_row.__getitem__):
                row, name = first_row[code], names[code]
                iids[code] = self._event_names[name] = len(self._event_names) + 1
                interned.setdefault(row, pb.InternedData()).event_names.add(iid=int(iids[code]), name=name)
        return _field_varint(_NAME_IID, iids[codes], present)

    def _intern_args(self, present: dict[str, np.ndarray], interned: dict[int, pb.InternedData]) -> None:
        """Intern the argument names new to this sequence in the first row with a value for each:
        ids in the order of those rows, and of the columns within a row."""
        first = [(int(np.argmax(mask)), position, arg) for position, (arg, mask) in enumerate(present.items())
                 if arg not in self._arg_names and mask.any()]
        for row, _, arg in sorted(first):
            iid = self._arg_names[arg] = len(self._arg_names) + 1
            interned.setdefault(row, pb.InternedData()).debug_annotation_names.add(iid=iid, name=arg)

    @staticmethod
    def _annotation(iid: int, column: pa.Array, n: int) -> list[_Piece]:
        """The debug annotation (name `iid`) of an argument in each row where it is not null."""
        present = _valid(column)
        if not present.any():
            return []
        name = _Const(_ANNOTATION_NAME_IID + _varint(iid), present)
        kind = column.type
        if pa.types.is_boolean(kind):
            value = [_Const(_BOOL, present), _varints(_numbers(column, np.int64), present)]
        elif pa.types.is_integer(kind):
            value = [_Const(_INT, present), _varints(_numbers(column, np.int64), present)]
        elif pa.types.is_floating(kind):
            value = [_fixed64(_DOUBLE, _numbers(column, np.float64)[present], present.astype(np.int64))]
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            text = _strings(column, present)
            value = [_Const(_STRING, present), _varints(text.lengths, present), text]
        else:
            raise TypeError(f"no debug annotation for values of type {kind}")
        return _field_bytes(_ANNOTATION, [name, *value], n, present)

    def _write_rows(self, framed: _Rows, n: int) -> None:
        self._flush()
        self.file.write(framed.data.data)
        self.num_packets += n

    def _write(self, data: bytes) -> None:
        self._chunks.append(_PACKET_TAG + _varint(len(data)))
        self._chunks.append(data)
        self._buffered += len(data)
        self.num_packets += 1
        if self._buffered >= self.buffer_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._chunks:
            self.file.write(b"".join(self._chunks))
            self._chunks = []
            self._buffered = 0
