"""A sweep's grid: `--set KNOB=VALUES` options read into knobs, their values and the points.

A knob is any option of `kvtrace record` (by its parameter name, `max_num_seqs`); VALUES is a list
(`16,32,64`, `recompute,swap`, `true,false`) or a range: `64:512:x2` (start, stop, factor) or
`0.5GiB:4GiB:+0.5GiB` and `16:128:+16` (start, stop, step). A range includes its stop when a step
lands on it. Sizes keep the unit their start was written in.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from engine.config import parse_bytes
from kvtrace.errors import KvtraceError

MAX_POINTS_WITHOUT_YES = 10_000
MAX_RANGE_VALUES = 10_000
# record options that describe the sweep itself, not a point of it
NOT_SWEPT = {"workload", "out", "quiet", "sweep_point", "help"}
_SIZE_UNIT = re.compile(r"^\s*\d+(?:\.\d+)?\s*([KMGT]i?B?|B)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Knob:
    """One option of `kvtrace record` that a sweep may set."""

    name: str                   # parameter name: max_num_seqs
    flag: str                   # --max-num-seqs
    off_flag: str | None        # --no-enable-prefix-caching for an on/off flag
    is_flag: bool

    def args(self, value: str) -> list[str]:
        """Command-line arguments that set this knob to `value`."""
        if not self.is_flag:
            return [self.flag, value]
        on = parse_bool(value, self.name)
        if on:
            return [self.flag]
        if self.off_flag is None:  # a flag without an off form (--backlog): off is its default
            return []
        return [self.off_flag]


def parse_bool(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "on", "yes", "1"):
        return True
    if lowered in ("false", "off", "no", "0"):
        return False
    raise KvtraceError(f"--set {name}: {value!r} is not true or false")


def record_knobs(record_command) -> dict[str, Knob]:
    """Every option of `kvtrace record` (its Typer/Click command) a sweep may set, by parameter name."""
    knobs = {}
    for param in record_command.params:
        if param.param_type_name != "option" or param.name in NOT_SWEPT or param.hidden:
            continue
        long_flags = [opt for opt in param.opts if opt.startswith("--")]
        off = [opt for opt in param.secondary_opts if opt.startswith("--")]
        knobs[param.name] = Knob(param.name, long_flags[0] if long_flags else param.opts[0],
                                 off[0] if off else None, bool(param.is_flag))
    return knobs


def flag_names(knobs: dict[str, Knob]) -> dict[str, str]:
    """Each knob's flags (`--max-num-seqs`, `--no-enable-prefix-caching`) -> its name."""
    flags = {}
    for knob in knobs.values():
        flags[knob.flag] = knob.name
        if knob.off_flag:
            flags[knob.off_flag] = knob.name
    return flags


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def _format_size(num_bytes: float, unit_of: str) -> str:
    unit = _SIZE_UNIT.match(unit_of).group(1)
    scale = parse_bytes(f"1{unit}")
    value = num_bytes / scale
    text = f"{value:.6g}"
    return f"{text}{unit}"


def parse_range(name: str, text: str) -> list[str]:
    """`start:stop:xF` or `start:stop:+S` as the values it names, as strings."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.strip() for p in parts):
        raise KvtraceError(f"--set {name}={text}: a range is START:STOP:xFACTOR or START:STOP:+STEP")
    start_text, stop_text, step_text = (p.strip() for p in parts)
    sized = bool(_SIZE_UNIT.match(start_text) or _SIZE_UNIT.match(stop_text))
    try:
        if sized:
            start, stop = float(parse_bytes(start_text)), float(parse_bytes(stop_text))
        else:
            start, stop = float(_number(start_text)), float(_number(stop_text))
    except ValueError:
        raise KvtraceError(f"--set {name}={text}: {start_text!r} or {stop_text!r} is not a number or a size") from None
    kind, step_value = step_text[0], step_text[1:]
    if kind not in "x+" or not step_value:
        raise KvtraceError(f"--set {name}={text}: the step {step_text!r} must be xFACTOR or +STEP")
    try:
        step = float(parse_bytes(step_value)) if sized and kind == "+" else float(_number(step_value))
    except ValueError:
        raise KvtraceError(f"--set {name}={text}: the step {step_text!r} is not a number") from None
    if stop < start:
        raise KvtraceError(f"--set {name}={text}: the range is empty (stop below start)")
    if (kind == "x" and step <= 1) or (kind == "+" and step <= 0) or (kind == "x" and start <= 0):
        raise KvtraceError(f"--set {name}={text}: the range never ends (step {step_text} from {start_text})")
    values: list[float] = []
    current = start
    while current <= stop * (1 + 1e-9):
        values.append(current)
        if len(values) > MAX_RANGE_VALUES:
            raise KvtraceError(f"--set {name}={text}: more than {MAX_RANGE_VALUES} values")
        current = current * step if kind == "x" else current + step
    integral = not sized and all(float(v).is_integer() for v in values) and all(
        "." not in t for t in (start_text, stop_text, step_value))
    if sized:
        return [_format_size(v, start_text if _SIZE_UNIT.match(start_text) else stop_text) for v in values]
    if integral:
        return [str(int(v)) for v in values]
    return [f"{v:.6g}" for v in values]


def parse_set(item: str, knobs: dict[str, Knob]) -> tuple[str, list[str]]:
    """One `--set KNOB=VALUES` option as (knob, values)."""
    name, sep, text = item.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name:
        raise KvtraceError(f"--set expects KNOB=VALUES, got {item!r}")
    if name not in knobs:
        close = ", ".join(sorted(k for k in knobs if k.split("_")[0] == name.split("_")[0])) or \
            ", ".join(sorted(knobs))
        raise KvtraceError(f"--set {name}: not an option of kvtrace record (try: {close})")
    text = text.strip()
    if not text:
        raise KvtraceError(f"--set {name}: no values")
    if ":" in text and "," not in text and not text.startswith(("http:", "https:")):
        values = parse_range(name, text)
    else:
        values = [v.strip() for v in text.split(",")]
        if any(not v for v in values):
            raise KvtraceError(f"--set {name}={text}: an empty value in the list")
    if len(set(values)) != len(values):
        raise KvtraceError(f"--set {name}={text}: a value is listed twice")
    if knobs[name].is_flag:
        for value in values:
            parse_bool(value, name)
    return name, values


def parse_grid(items: list[str], knobs: dict[str, Knob]) -> dict[str, list[str]]:
    grid: dict[str, list[str]] = {}
    for item in items:
        name, values = parse_set(item, knobs)
        if name in grid:
            raise KvtraceError(f"--set {name}: given twice")
        grid[name] = values
    if not grid:
        raise KvtraceError("no --set KNOB=VALUES given: nothing to sweep")
    return grid


def grid_size(grid: dict[str, list[str]]) -> int:
    return math.prod(len(values) for values in grid.values())


def points(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the knobs' values, the first knob varying slowest."""
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*grid.values())]


def point_id(sweep_name: str, index: int, settings: dict[str, str]) -> str:
    """A run folder name (also the run's id) that says what the point set."""
    slug = "-".join(f"{k}={v}" for k, v in settings.items())
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", slug)[:120]
    return f"{sweep_name}-p{index:03d}-{slug}"
