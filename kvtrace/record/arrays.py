"""Arrow arrays made from numpy buffers, for the trace writer's table builders (tables.py).

Each function here is what one pyarrow call would do: `from_numpy` is `pa.array` of a numpy column,
`take_strings` and `lists_then_singles` are `pyarrow.compute.take`. They build the array's buffers
(validity bits, offsets, values) with numpy instead, because those calls import `numpy.ma` and
`pyarrow.compute`, and `kvtrace record --engine sim` is timed whole, start-up included
(tests/cli/test_sim_startup.py checks that neither is imported; what they cost is in
benchmarks/log/2026-12.md, 2026-12-05).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa


def from_numpy(values: np.ndarray, type: pa.DataType, missing: np.ndarray | None = None) -> pa.Array:
    """A numeric numpy column as an Arrow array of `type`, null where `missing` is true."""
    values = np.ascontiguousarray(values, dtype=np.dtype(type.to_pandas_dtype()))
    validity = pa.py_buffer(np.packbits(~missing, bitorder="little")) if missing is not None and missing.any() else None
    return pa.Array.from_buffers(type, len(values), [validity, pa.py_buffer(values)])


def as_arrow(values: list | tuple | np.ndarray | pa.Array, type: pa.DataType) -> pa.Array:
    """A column as a builder made it (Python values, a numpy array, an Arrow array) as an Arrow array
    of `type`."""
    if isinstance(values, pa.Array):
        return values
    if isinstance(values, np.ndarray):
        return from_numpy(values, type) if values.dtype != object else pa.array(values.tolist(), type)
    return pa.array(values, type)


def take_strings(names: pa.Array, codes: np.ndarray) -> pa.Array:
    """`names[codes]` as a string array: each row's characters copied from `names` by numpy."""
    _, offsets, data = names.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int32, count=names.offset + len(names) + 1)[names.offset:]
    lengths = np.diff(offsets)[codes]
    row_offsets = np.zeros(len(codes) + 1, dtype=np.int64)
    np.cumsum(lengths, out=row_offsets[1:])
    if row_offsets[-1] >= 2 ** 31:   # past one string array's 32-bit offsets: Arrow's chunks
        strings = names.to_pylist()
        return pa.array([strings[code] for code in codes.tolist()], pa.string())
    index = np.repeat(offsets[:-1][codes] - row_offsets[:-1], lengths) + np.arange(row_offsets[-1])
    chars = np.frombuffer(data, dtype=np.uint8)[index] if data is not None else np.zeros(0, dtype=np.uint8)
    return pa.Array.from_buffers(pa.string(), len(codes), [None, pa.py_buffer(row_offsets.astype(np.int32)),
                                                          pa.py_buffer(chars)])


def lists_then_singles(lists: pa.ListArray, values: np.ndarray, order: np.ndarray) -> pa.Array:
    """The rows of `lists`, then a one-element list for each of `values`, taken in `order` (a
    permutation of all those rows)."""
    offsets = lists.offsets.to_numpy()
    source = np.concatenate([lists.values.to_numpy(), values])
    lengths = np.concatenate([np.diff(offsets), np.ones(len(values), dtype=np.int64)])[order]
    starts = np.concatenate([offsets[:-1], len(lists.values) + np.arange(len(values))])[order]
    new_offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    index = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    validity = None
    if lists.null_count:
        valid = np.unpackbits(np.frombuffer(lists.buffers()[0], dtype=np.uint8), bitorder="little")
        valid = np.concatenate([valid[lists.offset:lists.offset + len(lists)].astype(bool),
                                np.ones(len(values), dtype=bool)])[order]
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    child = from_numpy(source[index], lists.type.value_type)
    return pa.Array.from_buffers(lists.type, len(order), [validity, pa.py_buffer(new_offsets.astype(np.int32))],
                                 children=[child])
