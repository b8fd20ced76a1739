"""DuckDB over recorded runs: the trace tables as views, and the SQL library in `analyses/`.

`connect(runs)` opens an in-memory DuckDB with one view per trace table over every chunk of every
run given (each row carries `run_id`), a `runs` table made from the runs' meta.json, and the
library's helper views and macros (`analyses/_*.sql`). `run_analysis(con, name, **params)` runs
one analysis file and returns its result as an Arrow table.

An analysis declares its parameters in its opening comment, one a line:

    -- param: ttft_ms = 2000  SLO for time to first token (ms); <= 0 disables it

and refers to them as DuckDB prepared parameters (`$ttft_ms`), so values are bound, never pasted.

Memory does not grow with the trace: DuckDB runs under a memory limit (`KVTRACE_MEMORY_LIMIT`,
default 500MB) and spills to a per-user temporary folder (`KVTRACE_TEMP_DIR`, default
`<tmp>/kvtrace-duckdb-<user>`) when an operator needs more; `KVTRACE_THREADS` caps its threads
(default: one per core). Analyses run without preserving insertion order (each ends with its own
ORDER BY), so that DuckDB need not buffer rows to keep them in scan order.
"""
from __future__ import annotations

import functools
import getpass
import glob
import importlib.resources
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.errors import KvtraceError
from kvtrace.trace.schema import OPTIONAL_TABLES, SERVER_FIELD, SERVER_TABLES, TABLES

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    import duckdb

# duckdb itself is imported by the functions that use it: `kvtrace record` reads meta.json through this
# module and never queries, and every command's start-up would pay for it

META_FILE = "meta.json"
MEMORY_LIMIT = "500MB"             # DuckDB's memory limit unless KVTRACE_MEMORY_LIMIT says otherwise

# the `runs` table: one row per run, flattened from meta.json (the whole file is in meta_json)
RUNS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("ordinal", pa.int32()),               # position of the run in connect()'s arguments
    ("path", pa.string()),
    ("schema_version", pa.int32()),
    ("kvtrace_version", pa.string()),
    ("status", pa.string()),               # running | completed | interrupted | failed
    ("error", pa.string()),
    ("started_at", pa.string()),
    ("command", pa.string()),
    ("model", pa.string()),
    ("dtype", pa.string()),
    ("device", pa.string()),               # GPU name on CUDA, CPU model on CPU
    ("device_type", pa.string()),          # cpu | cuda
    ("preemption_mode", pa.string()),
    ("preemption_policy", pa.string()),
    ("enable_prefix_caching", pa.bool_()),
    ("max_num_seqs", pa.int32()),
    ("max_num_batched_tokens", pa.int32()),
    ("block_size", pa.int32()),
    ("num_gpu_blocks", pa.int32()),
    ("num_cpu_blocks", pa.int32()),
    ("bytes_per_block", pa.int64()),
    ("workload_path", pa.string()),
    ("workload_sha256", pa.string()),
    ("workload_requests", pa.int64()),
    ("replay_mode", pa.string()),
    ("time_scale", pa.float64()),
    ("seed", pa.int64()),
    ("meta_json", pa.string()),
    ("token_gaps_recorded", pa.bool_()),   # the tokens carry prev_step / prev_ts_s (schema 2)
])

_DUCKDB_TYPES = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    pa.list_(pa.int32()): "INTEGER[]",
    pa.list_(pa.int64()): "BIGINT[]",
}

_PARAM_RE = re.compile(r"^param:\s*(\w+)\s*=\s*('[^']*'|\S+)\s*(.*)$")
_HELPER_REF_RE = re.compile(r"\b(_[a-z][a-z0-9_]*)\b")
_DEFINES_RE = re.compile(r"^CREATE OR REPLACE (?:VIEW|MACRO|TABLE) (_[a-z0-9_]+)", re.MULTILINE | re.IGNORECASE)


# --------------------------------------------------------------------------- runs and views

def json_value(value: object) -> object:
    """A value as JSON can hold it: NaN and infinities (an empty window's rate) become null."""
    return None if isinstance(value, float) and (math.isnan(value) or math.isinf(value)) else value


def records(table: pa.Table) -> list[dict]:
    """An analysis's rows as dicts of JSON-safe values."""
    return [{k: json_value(v) for k, v in row.items()} for row in table.to_pylist()]


def find_runs(args: list[str | Path]) -> list[Path]:
    """Run folders named by `args`: a run folder, a glob of them, or a folder holding run folders."""
    found: list[Path] = []
    for arg in args:
        text = str(arg)
        path = Path(text)
        if not path.exists() and glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise KvtraceError(f"{text}: no run folder matches")
            candidates = [Path(m) for m in matches]
        else:
            candidates = [path]
        for candidate in candidates:
            found.extend(_runs_in(candidate))
    unique: dict[Path, Path] = {}
    for run in found:
        unique.setdefault(run.resolve(), run)
    return list(unique.values())


def _runs_in(path: Path) -> list[Path]:
    if not path.exists():
        raise KvtraceError(f"{path}: no such run folder")
    if not path.is_dir():
        raise KvtraceError(f"{path}: not a run folder (expected a folder with {META_FILE})")
    if (path / META_FILE).is_file():
        return [path]
    runs = sorted(child for child in path.iterdir() if (child / META_FILE).is_file())
    if not runs:
        raise KvtraceError(f"{path}: not a run folder (no {META_FILE}) and holds no run folders")
    return runs


def read_meta(run: Path) -> dict:
    try:
        meta = json.loads((run / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvtraceError(f"{run / META_FILE}: cannot read ({exc})") from exc
    if not isinstance(meta, dict):
        raise KvtraceError(f"{run / META_FILE}: not a JSON object")
    return meta


def _runs_row(run: Path, meta: dict, ordinal: int) -> dict:
    def get(*keys):
        value = meta
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    engine = get("engine_config") or {}
    return {
        "run_id": meta.get("run_id") or run.name,
        "ordinal": ordinal,
        "path": str(run),
        "schema_version": meta.get("schema_version"),
        "kvtrace_version": meta.get("kvtrace_version"),
        "status": meta.get("status"),
        "error": meta.get("error"),
        "started_at": meta.get("started_at"),
        "command": " ".join(map(str, command)) if isinstance(command := meta.get("command"), list) else command,
        "model": get("model", "name"),
        "dtype": get("model", "dtype") or engine.get("dtype"),
        "device": get("device", "name"),
        "device_type": get("device", "type"),
        "preemption_mode": engine.get("preemption_mode"),
        "preemption_policy": engine.get("preemption_policy"),
        "enable_prefix_caching": engine.get("enable_prefix_caching"),
        "max_num_seqs": engine.get("max_num_seqs"),
        "max_num_batched_tokens": engine.get("max_num_batched_tokens"),
        "block_size": get("kv_pool", "block_size") or engine.get("block_size"),
        "num_gpu_blocks": get("kv_pool", "num_gpu_blocks") or engine.get("num_gpu_blocks"),
        "num_cpu_blocks": get("kv_pool", "num_cpu_blocks") if get("kv_pool", "num_cpu_blocks") is not None
        else engine.get("num_cpu_blocks"),
        "bytes_per_block": get("kv_pool", "bytes_per_block"),
        "workload_path": get("workload", "path"),
        "workload_sha256": get("workload", "sha256"),
        "workload_requests": get("workload", "num_requests"),
        "replay_mode": get("replay", "mode"),
        "time_scale": get("replay", "time_scale"),
        "seed": meta.get("seed"),
        "meta_json": json.dumps(meta, sort_keys=True),
        "token_gaps_recorded": _token_gaps_recorded(run),
    }


def _token_gaps_recorded(run: Path) -> bool:
    """Whether the run's tokens carry each token's predecessor (schema 2), read from the chunks'
    footers: the column is there with values (a writer that has the column but leaves it null is
    read as schema 1, whose predecessors are computed: slower, never wrong; so is a run whose
    every token is a first one, where there is nothing to compute)."""
    for chunk in sorted((run / "tokens").glob("part-*.parquet")):
        try:
            meta = pq.ParquetFile(chunk).metadata
        except (OSError, pa.ArrowException) as exc:
            raise KvtraceError(f"{chunk}: cannot read the tokens chunk ({exc})") from exc
        names = meta.schema.names
        if "prev_ts_s" not in names:
            return False
        column = names.index("prev_ts_s")
        for group in range(meta.num_row_groups):
            stats = meta.row_group(group).column(column).statistics
            if stats is None or not stats.has_null_count:   # no statistics: read the column
                if pq.read_table(chunk, columns=["prev_ts_s"]).column(0).null_count < meta.num_rows:
                    return True
                break
            if stats.null_count < meta.row_group(group).num_rows:
                return True
    return False


def connect(runs: list[str | Path]) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with views `requests`, `steps`, `kv_events`, `tokens`, `gpu_samples`
    over every chunk of the runs given, a `runs` table from their meta.json, and the helpers of
    the SQL library. Raises KvtraceError naming the path when a run cannot be read."""
    run_dirs = find_runs(runs)
    if not run_dirs:
        raise KvtraceError("no run folder given")
    rows = [_runs_row(run, read_meta(run), i) for i, run in enumerate(run_dirs)]
    seen: dict[str, str] = {}
    for row in rows:
        if row["run_id"] in seen:
            raise KvtraceError(f"{row['path']}: run_id {row['run_id']!r} is also the id of {seen[row['run_id']]}")
        seen[row["run_id"]] = row["path"]

    chunks = {table: [run for run in run_dirs if any((run / table).glob("part-*.parquet"))] for table in TABLES}
    if not any(chunks.values()):
        names = ", ".join(str(run) for run in run_dirs)
        raise KvtraceError(f"{names}: no parquet chunk files (part-*.parquet) yet")

    for row in rows:
        try:
            pa.Table.from_pylist([row], schema=RUNS_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise KvtraceError(f"{Path(row['path']) / META_FILE}: unexpected value ({exc})") from exc
    import duckdb

    con = duckdb.connect(config=duckdb_config())
    runs_table = pa.Table.from_pylist(rows, schema=RUNS_SCHEMA)
    con.register("_runs_arrow", runs_table)
    con.execute("CREATE TABLE runs AS SELECT * FROM _runs_arrow")
    con.unregister("_runs_arrow")
    for table, schema in TABLES.items():
        globs = [str(run / table / "part-*.parquet") for run in chunks[table]]
        con.execute(_table_view_sql(con, table, schema, globs))
    for table, schema in OPTIONAL_TABLES.items():
        globs = [str(run / table / "part-*.parquet") for run in run_dirs if any((run / table).glob("part-*.parquet"))]
        con.execute(_table_view_sql(con, table, schema, globs))
    install_helpers(con)
    return con


def one_server_each(con: duckdb.DuckDBPyConnection, what: str) -> None:
    """KvtraceError if a run of the connection was joined from several servers' captures (schema 4's
    `server`): `what` (a timeline, the explorer) lays out one engine's steps and pool."""
    joined = con.execute("SELECT run_id, string_agg(server, ', ' ORDER BY server) FROM _servers "
                         "GROUP BY run_id HAVING count(*) > 1 ORDER BY run_id").fetchall()
    if joined:
        run_id, servers = joined[0]
        raise KvtraceError(f"run {run_id} joins several servers ({servers}): {what} shows one server's steps; "
                           "cut one server's run with kvtrace capture run --server or --rank")


def duckdb_config() -> dict[str, str]:
    """The settings every connection gets: a memory limit, a folder to spill to, threads."""
    limit = os.environ.get("KVTRACE_MEMORY_LIMIT") or MEMORY_LIMIT
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(B|[KMGT]i?B)\s*", limit, re.IGNORECASE):
        raise KvtraceError(f"KVTRACE_MEMORY_LIMIT={limit!r}: expected a size such as 500MB or 2GB")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    temp = os.environ.get("KVTRACE_TEMP_DIR") or str(Path(tempfile.gettempdir()) / f"kvtrace-duckdb-{user}")
    config = {"memory_limit": limit.replace(" ", ""), "temp_directory": temp}
    threads = os.environ.get("KVTRACE_THREADS")
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise KvtraceError(f"KVTRACE_THREADS={threads!r}: expected a whole number of threads >= 1")
        config["threads"] = threads
    return config


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _table_view_sql(con: duckdb.DuckDBPyConnection, table: str, schema: pa.Schema, globs: list[str]) -> str:
    """A view with the contract's columns in the contract's order: columns a trace lacks are typed
    NULLs, columns it has beyond the contract come last. No chunk at all: an empty typed view. A table
    of SERVER_TABLES gets `server` after the contract's columns, '' where a run has none (schema.py)."""
    server = table in SERVER_TABLES
    if not globs:
        columns = [f"NULL::{_DUCKDB_TYPES[f.type]} AS {f.name}" for f in schema]
        columns += ["''::VARCHAR AS server"] * server
        return f"CREATE OR REPLACE VIEW {table} AS SELECT {', '.join(columns)} WHERE false"
    import duckdb

    source = f"read_parquet([{', '.join(map(_sql_string, globs))}], union_by_name = true, hive_partitioning = false)"
    try:
        present = [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()]
    except duckdb.Error as exc:
        raise KvtraceError(f"{globs[0]}: cannot read the {table} chunks ({str(exc).splitlines()[0]})") from exc
    known = set(schema.names) | ({SERVER_FIELD.name} if server else set())
    columns = [f.name if f.name in present else f"NULL::{_DUCKDB_TYPES[f.type]} AS {f.name}" for f in schema]
    if server:
        columns.append("coalesce(server, '') AS server" if "server" in present else "''::VARCHAR AS server")
    columns += [f'"{name}"' for name in present if name not in known]
    return f"CREATE OR REPLACE VIEW {table} AS SELECT {', '.join(columns)} FROM {source}"


# --------------------------------------------------------------------------- the SQL library

@dataclass(frozen=True)
class AnalysisParam:
    name: str
    default: float | int | str
    help: str


@dataclass(frozen=True)
class AnalysisInfo:
    name: str
    description: str                      # the opening comment's first paragraph
    params: list[AnalysisParam] = field(default_factory=list)
    doc: str = ""                         # the whole opening comment


def analyses_dir() -> Traversable:
    """Where the .sql files are: the folder beside this package in a source checkout (so that a
    checkout, or a git worktree, runs its own SQL even when another checkout is the editable
    install), else the installed `kvtrace.analyses` package."""
    beside = Path(__file__).resolve().parents[2] / "analyses"
    if (beside / "__init__.py").is_file() and (beside / "summary.sql").is_file():
        return beside
    try:
        return importlib.resources.files("kvtrace.analyses")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "analyses"


@functools.cache
def _sql_files() -> dict[str, str]:
    """name -> text of every .sql file in the library (helpers included), read once per process."""
    return {
        entry.name.removesuffix(".sql"): entry.read_text()
        for entry in sorted(analyses_dir().iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".sql")
    }


def _header(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("--"):
            break
        lines.append(stripped[2:].removeprefix(" ").rstrip())
    return lines


def _parse_default(text: str) -> float | int | str:
    if text.startswith("'"):
        return text.strip("'")
    try:
        return int(text)
    except ValueError:
        return float(text)


def _parse_info(name: str, text: str) -> AnalysisInfo:
    header = _header(text)
    params = []
    for line in header:
        match = _PARAM_RE.match(line)
        if match:
            params.append(AnalysisParam(match.group(1), _parse_default(match.group(2)), match.group(3).strip()))
    paragraph = []
    for line in header:
        if not line.strip() or _PARAM_RE.match(line):
            if paragraph:
                break
            continue
        paragraph.append(line.strip())
    return AnalysisInfo(name=name, description=" ".join(paragraph), params=params, doc="\n".join(header))


def list_analyses() -> list[AnalysisInfo]:
    """Every analysis in the library (helpers, whose names start with `_`, left out), by name."""
    return [_parse_info(name, text) for name, text in _sql_files().items() if not name.startswith("_")]


def install_helpers(con: duckdb.DuckDBPyConnection) -> None:
    """Create the library's helper views and macros, each after the helpers it refers to."""
    helpers = {name: text for name, text in _sql_files().items() if name.startswith("_")}
    defined_in = {obj: name for name, text in helpers.items() for obj in _DEFINES_RE.findall(text)}
    done: set[str] = set()

    def install(name: str, path: tuple[str, ...]) -> None:
        if name in done:
            return
        assert name not in path, f"helpers refer to each other in a cycle: {' -> '.join(path + (name,))}"
        code = re.sub(r"--[^\n]*", "", helpers[name])
        for ref in dict.fromkeys(_HELPER_REF_RE.findall(code)):
            if defined_in.get(ref, name) != name:
                install(defined_in[ref], path + (name,))
        con.execute(helpers[name])
        done.add(name)

    for name in helpers:
        install(name, ())


def keep(con: duckdb.DuckDBPyConnection, *helpers: str) -> None:
    """Compute helper views once for this connection: each becomes a view of a temporary table
    of its rows, so that analyses run one after another (the dashboard's, the report's) share the
    work. Only for small helpers (the histograms), on a connection whose trace no longer changes."""
    for name in helpers:
        if not re.fullmatch(r"_[a-z0-9_]+", name):
            raise ValueError(f"not a helper view: {name!r}")
        _create_kept(con, f"CREATE OR REPLACE TEMP TABLE {name}_kept AS SELECT * FROM {name}")
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {name}_kept")


def _create_kept(con: duckdb.DuckDBPyConnection, sql: str, values: list | None = None) -> None:
    """Create a kept table without preserving insertion order (its readers order their rows)."""
    con.execute("SET preserve_insertion_order = false")
    try:
        con.execute(sql, values)
    finally:
        con.execute("RESET preserve_insertion_order")


def keep_calls(con: duckdb.DuckDBPyConnection, *macros: str, **params: object) -> None:
    """Compute table macros once for this connection, as `keep` does views: each macro, called
    with `params` (matched to its parameters by name, every one given), becomes a read of a
    temporary table of its rows. Called with other values it fails, never answers for the kept
    ones. For the thrash helpers that the dashboard's analyses each call with the same params."""
    for name in macros:
        if not re.fullmatch(r"_[a-z0-9_]+", name):
            raise ValueError(f"not a helper macro: {name!r}")
        found = con.execute("SELECT parameters FROM duckdb_functions() WHERE function_name = ? "
                            "AND function_type = 'table_macro'", [name]).fetchall()
        if len(found) != 1:
            raise ValueError(f"not a helper macro: {name!r}")
        names = found[0][0]
        values = []
        for param in names:
            value = params[param]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name}: param {param} must be a number to be kept, got {value!r}")
            values.append(value)
        # bound as run_analysis binds them (a float is a DOUBLE, not a DECIMAL literal)
        _create_kept(con, f"CREATE OR REPLACE TEMP TABLE {name}_kept AS SELECT * FROM {name}"
                     f"({', '.join('?' * len(values))})", values)
        same = " AND ".join(f"{param} = {value!r}::{'DOUBLE' if isinstance(value, float) else 'BIGINT'}"
                            for param, value in zip(names, values))
        con.execute(f"CREATE OR REPLACE MACRO {name}({', '.join(names)}) AS TABLE "
                    f"SELECT * FROM {name}_kept WHERE CASE WHEN {same} THEN true "
                    f"ELSE error('{name}: kept for other params') END")


def _coerce(info: AnalysisInfo, param: AnalysisParam, value: object) -> float | int | str:
    if isinstance(param.default, str):
        return str(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise KvtraceError(f"{info.name}: param {param.name} expects a number, got {value!r}")
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                raise KvtraceError(f"{info.name}: param {param.name} expects a number, got {value!r}") from None
    return value


def analysis_params(name: str, **params: object) -> dict[str, float | int | str]:
    """The values an analysis runs with: its declared defaults, overridden by `params`."""
    files = _sql_files()
    if name not in files or name.startswith("_"):
        known = ", ".join(info.name for info in list_analyses())
        raise KvtraceError(f"no analysis named {name!r} (known: {known})")
    info = _parse_info(name, files[name])
    declared = {p.name: p for p in info.params}
    unknown = sorted(set(params) - set(declared))
    if unknown:
        accepted = ", ".join(declared) or "none"
        raise KvtraceError(f"{name}: unknown param {', '.join(unknown)} (accepted: {accepted})")
    return {p.name: _coerce(info, p, params[p.name]) if p.name in params else p.default for p in info.params}


def run_analysis(con: duckdb.DuckDBPyConnection, name: str, **params: object) -> pa.Table:
    """Run `analyses/<name>.sql` with its declared params (defaults overridden by `params`)."""
    import duckdb

    values = analysis_params(name, **params)
    text = _sql_files()[name]
    bound = {key: value for key, value in values.items() if re.search(rf"\${key}\b", text)}
    con.execute("SET preserve_insertion_order = false")   # every analysis orders its own rows
    try:
        return con.sql(text, params=bound).to_arrow_table()
    except duckdb.Error as exc:
        raise KvtraceError(f"{name}: {str(exc).splitlines()[0]}") from exc
    finally:
        con.execute("RESET preserve_insertion_order")
