"""Perfetto's native trace format, written one packet at a time.

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

Packets are written by setting the changing fields of one reused packet per shape (counter value,
slice end, or an event's kind, argument names and value types): a fresh message per packet costs
two to three times as much CPU. A shape's first packet is built afresh, which interns its names.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

Args = Iterable[tuple[str, object]]

TYPE_SLICE_BEGIN = pb.TrackEvent.TYPE_SLICE_BEGIN
TYPE_SLICE_END = pb.TrackEvent.TYPE_SLICE_END
TYPE_INSTANT = pb.TrackEvent.TYPE_INSTANT
TYPE_COUNTER = pb.TrackEvent.TYPE_COUNTER
CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS_STATE = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
EXPLICIT_ORDER = pb.TrackDescriptor.EXPLICIT
UNIT_BYTES = pb.CounterDescriptor.UNIT_SIZE_BYTES

# a debug annotation's value field by the Python type of the value
_VALUE_FIELDS = {bool: "bool_value", int: "int_value", float: "double_value", str: "string_value"}

_PACKET_TAG = b"\x0a"                # field 1 (Trace.packet), wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SHORT_PREFIXES = [_PACKET_TAG + _varint(n) for n in range(1 << 14)]     # packets under 16 kB


def _prefix(length: int) -> bytes:
    return _SHORT_PREFIXES[length] if length < len(_SHORT_PREFIXES) else _PACKET_TAG + _varint(length)


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
        self._reused: dict[int, tuple[pb.TracePacket, pb.TrackEvent]] = {}
        self._shapes: dict[tuple, tuple[pb.TracePacket, pb.TrackEvent, list]] = {}

    def start_sequence(self, sequence_id: int) -> None:
        """Packets from here on belong to `sequence_id`, whose interned names start afresh."""
        assert sequence_id > 0, "sequence ids start at 1"
        self._sequence_id = sequence_id
        self._cleared = False
        self._event_names = {}
        self._arg_names = {}
        self._reused = {}
        self._shapes = {}
        for kind in (TYPE_SLICE_END, TYPE_COUNTER):
            packet = pb.TracePacket(trusted_packet_sequence_id=sequence_id, sequence_flags=NEEDS_STATE)
            packet.track_event.type = kind
            self._reused[kind] = packet, packet.track_event

    # ------------------------------------------------------------------ packets

    def track(self, uuid: int, name: str, parent: int | None = None, rank: int | None = None,
              explicit_child_order: bool = False, description: str | None = None,
              counter: pb.CounterDescriptor | None = None) -> None:
        """Describe a track; `rank` orders it among its parent's children when the parent asked for
        explicit order."""
        packet = self._packet()
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
        self._write(packet)

    def slice_begin(self, track: int, ts: int, name: str, args: Args = (), flow_ids: Iterable[int] = (),
                    terminating_flow_ids: Iterable[int] = (), intern_name: bool = True) -> None:
        if intern_name and self._write_shaped(TYPE_SLICE_BEGIN, track, ts, name, args, flow_ids, terminating_flow_ids):
            return
        packet, event = self._event(track, ts, TYPE_SLICE_BEGIN)
        if intern_name:
            event.name_iid = self._event_name(packet, name)
        else:
            event.name = name
        self._args(packet, event, args)
        if flow_ids:
            event.flow_ids.extend(flow_ids)
        if terminating_flow_ids:
            event.terminating_flow_ids.extend(terminating_flow_ids)
        self._write(packet)

    def slice_end(self, track: int, ts: int) -> None:
        self._write_reused(TYPE_SLICE_END, track, ts)
        self._write_last(TYPE_SLICE_END)

    def instant(self, track: int, ts: int, name: str, args: Args = (), flow_ids: Iterable[int] = ()) -> None:
        if self._write_shaped(TYPE_INSTANT, track, ts, name, args, flow_ids, ()):
            return
        packet, event = self._event(track, ts, TYPE_INSTANT)
        event.name_iid = self._event_name(packet, name)
        self._args(packet, event, args)
        if flow_ids:
            event.flow_ids.extend(flow_ids)
        self._write(packet)

    def counter(self, track: int, ts: int, value: int) -> None:
        self._write_reused(TYPE_COUNTER, track, ts).counter_value = value
        self._write_last(TYPE_COUNTER)

    def close(self) -> None:
        self._flush()

    # ------------------------------------------------------------------ helpers

    def _packet(self) -> pb.TracePacket:
        assert self._sequence_id, "start_sequence() first"
        packet = pb.TracePacket()
        packet.trusted_packet_sequence_id = self._sequence_id
        if not self._cleared:
            packet.sequence_flags = CLEARED
            self._cleared = True
        return packet

    def _event(self, track: int, ts: int, kind: int) -> tuple[pb.TracePacket, pb.TrackEvent]:
        packet = self._packet()
        packet.timestamp = ts
        packet.sequence_flags |= NEEDS_STATE
        event = packet.track_event
        event.type = kind
        event.track_uuid = track
        return packet, event

    def _write_reused(self, kind: int, track: int, ts: int) -> pb.TrackEvent:
        """The reused packet of `kind`, its track and time set; the caller sets the rest and calls
        _write_last(kind)."""
        assert self._cleared, "the first packet of a sequence is a track descriptor"
        packet, event = self._reused[kind]
        packet.timestamp = ts
        event.track_uuid = track
        return event

    def _write_last(self, kind: int) -> None:
        self._write(self._reused[kind][0])

    def _write_shaped(self, kind: int, track: int, ts: int, name: str, args: Args, flow_ids: Iterable[int],
                      terminating_flow_ids: Iterable[int]) -> bool:
        """Write an event through the reused packet of its shape (kind, argument names and value
        types, flows or not) when its names are interned already; False when it must be built."""
        name_iid = self._event_names.get(name)
        if name_iid is None:
            return False
        if args:
            present = [(arg, value) for arg, value in args if value is not None]
            shape = (kind, bool(flow_ids), bool(terminating_flow_ids), *((arg, type(v)) for arg, v in present))
        else:
            present, shape = [], (kind, bool(flow_ids), bool(terminating_flow_ids))
        reused = self._shapes.get(shape)
        if reused is None:
            if any(arg not in self._arg_names or type(value) not in _VALUE_FIELDS for arg, value in present):
                return False
            packet = pb.TracePacket(trusted_packet_sequence_id=self._sequence_id, sequence_flags=NEEDS_STATE)
            event = packet.track_event
            event.type = kind
            slots = [(event.debug_annotations.add(name_iid=self._arg_names[arg]), _VALUE_FIELDS[type(value)])
                     for arg, value in present]
            reused = self._shapes[shape] = packet, event, slots
        packet, event, slots = reused
        packet.timestamp = ts
        event.track_uuid = track
        event.name_iid = name_iid
        for (annotation, value_field), (_, value) in zip(slots, present):
            setattr(annotation, value_field, value)
        if flow_ids:
            del event.flow_ids[:]
            event.flow_ids.extend(flow_ids)
        if terminating_flow_ids:
            del event.terminating_flow_ids[:]
            event.terminating_flow_ids.extend(terminating_flow_ids)
        self._write(packet)
        return True

    def _event_name(self, packet: pb.TracePacket, name: str) -> int:
        iid = self._event_names.get(name)
        if iid is None:
            iid = self._event_names[name] = len(self._event_names) + 1
            packet.interned_data.event_names.add(iid=iid, name=name)
        return iid

    def _args(self, packet: pb.TracePacket, event: pb.TrackEvent, args: Args) -> None:
        for name, value in args:
            if value is None:
                continue
            iid = self._arg_names.get(name)
            if iid is None:
                iid = self._arg_names[name] = len(self._arg_names) + 1
                packet.interned_data.debug_annotation_names.add(iid=iid, name=name)
            annotation = event.debug_annotations.add(name_iid=iid)
            if isinstance(value, bool):
                annotation.bool_value = value
            elif isinstance(value, int):
                annotation.int_value = value
            elif isinstance(value, float):
                annotation.double_value = value
            else:
                annotation.string_value = str(value)

    def _write(self, packet: pb.TracePacket) -> None:
        data = packet.SerializeToString()
        self._chunks.append(_prefix(len(data)))
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
