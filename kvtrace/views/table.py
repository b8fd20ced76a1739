"""A query result as a Rich table, and the cell formatting `kvtrace sql` uses in every format meant
for reading (numbers right-aligned, floats to a few significant digits, NULL as `null`)."""
from __future__ import annotations

import math

import pyarrow as pa
from rich.table import Table
from rich.text import Text


def format_cell(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        if abs(value) >= 1000:
            return f"{value:.2f}".rstrip("0").rstrip(".")
        if abs(value) >= 1:
            return f"{value:.3f}".rstrip("0").rstrip(".")
        return f"{value:.4g}"
    return str(value)


def is_numeric(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_decimal(type_)


def rich_table(result: pa.Table, max_rows: int) -> Table:
    """The first `max_rows` rows of `result` (all of them for 0 or less), one column per field."""
    table = Table(show_edge=False, header_style="bold")
    for field in result.schema:
        table.add_column(Text(field.name), justify="right" if is_numeric(field.type) else "left")
    shown = result.slice(0, max_rows) if max_rows > 0 else result
    # column by column: a result may repeat a column name (SELECT a.x, b.x)
    for row in zip(*(column.to_pylist() for column in shown.columns)):
        table.add_row(*(Text(format_cell(v)) for v in row))
    return table
