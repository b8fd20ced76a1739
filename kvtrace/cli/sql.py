"""`kvtrace sql` and `kvtrace compare`: postmortems in SQL over one or many recorded runs."""
from __future__ import annotations

import glob
import json
import shutil
import sys
import tempfile
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import pyarrow as pa
import pyarrow.parquet as pq
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvtrace.cli.app import RUNS_HELP, app, parse_params, user_errors
from kvtrace.errors import KvtraceError
from kvtrace.trace import db
from kvtrace.views import headline
from kvtrace.views.table import format_cell, is_numeric, rich_table

if TYPE_CHECKING:   # duckdb is imported where a connection is made: not by every command's start-up
    import duckdb

INTERACTIVE_HELP = """\
Views: requests, steps, kv_events, tokens, gpu_samples (every row has run_id) and runs (meta.json).
End a statement with ';'. Commands: .tables  .analyses  .run NAME [k=v ...]  .help  .quit"""


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


class CompareFormat(str, Enum):
    table = "table"
    json = "json"


def _console(output: Path | None) -> Console:
    if output is not None:
        return Console(file=output.open("w"), width=100_000, color_system=None)
    return Console(width=None if sys.stdout.isatty() else 100_000, soft_wrap=False)


def write_result(result: pa.Table, fmt: OutputFormat, output: Path | None, max_rows: int) -> None:
    """Print or write a query result in the format asked for."""
    if fmt is OutputFormat.parquet:
        if output is None:
            raise KvtraceError("--format parquet needs --output FILE")
        pq.write_table(result, output)
        return
    if fmt is OutputFormat.table:
        console = _console(output)
        console.print(rich_table(result, max_rows))
        if 0 < max_rows < result.num_rows:
            console.print(f"({max_rows} of {result.num_rows} rows shown; --max-rows 0 shows all, "
                          f"--format csv -o FILE writes all)")
        elif result.num_rows == 0:
            console.print("(no rows)")
        if output is not None:
            console.file.close()
        return
    if fmt is OutputFormat.csv:
        # DuckDB's writer: quotes only where needed, lists as [1, 2], fast on big results
        with tempfile.TemporaryDirectory() as folder:
            path = output or Path(folder) / "result.csv"
            import duckdb

            duckdb.connect().from_arrow(result).write_csv(str(path))
            if output is None:
                with path.open() as csv_file:
                    shutil.copyfileobj(csv_file, sys.stdout)
        return
    records = db.records(result)
    text = json.dumps(records, indent=2, default=str) + "\n"
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)


# --------------------------------------------------------------------------- kvtrace sql

def _split_query(args: list[str], query_elsewhere: bool) -> tuple[list[str], str | None]:
    """The last argument is the query when it names no existing path (nor a glob matching one)."""
    if query_elsewhere or not args:
        return args, None
    last = args[-1]
    if _names_a_path(last):
        return args, None
    return args[:-1], last


def _names_a_path(text: str) -> bool:
    try:   # a long query is too long a file name: that is an answer, not an error
        return Path(text).exists() or bool(glob.has_magic(text) and glob.glob(text))
    except OSError:
        return False


def _analyses_text() -> str:
    """Each analysis: its name and params with their defaults, then what it answers."""
    lines = []
    for info in db.list_analyses():
        params = ", ".join(f"{p.name}={p.default!r}" for p in info.params)
        lines.append(f"{info.name}" + (f"  ({params})" if params else ""))
        lines.append(f"    {info.description}")
    return "\n".join(lines)


def _run_query(con: duckdb.DuckDBPyConnection, query: str) -> pa.Table | None:
    import duckdb

    try:
        relation = con.sql(query)
        return None if relation is None else relation.to_arrow_table()
    except duckdb.Error as exc:
        raise KvtraceError(str(exc).splitlines()[0]) from exc


def _interactive(con: duckdb.DuckDBPyConnection, max_rows: int) -> None:
    """A minimal prompt: statements end with ';', dot-commands stand on their own line."""
    console = _console(None)
    err = Console(stderr=True, soft_wrap=True)
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    run_ids = [row[0] for row in con.sql("SELECT run_id FROM runs ORDER BY ordinal").fetchall()]
    console.print(f"kvtrace sql: {len(run_ids)} run(s): {', '.join(run_ids)}")
    console.print(INTERACTIVE_HELP, markup=False, highlight=False)
    lines: list[str] = []
    while True:
        try:
            line = input(("kvtrace> " if not lines else "     ..> ") if tty else "")
        except EOFError:
            line = None
        except KeyboardInterrupt:
            console.print()
            lines = []
            continue
        if line is None:
            if "".join(lines).strip():
                _interactive_statement(con, "\n".join(lines), console, err, max_rows)
            return
        if not lines and line.strip().startswith("."):
            if not _interactive_command(con, line.strip(), console, err, max_rows):
                return
            continue
        lines.append(line)
        if line.rstrip().endswith(";"):
            _interactive_statement(con, "\n".join(lines), console, err, max_rows)
            lines = []


def _interactive_statement(con, text: str, console: Console, err: Console, max_rows: int) -> None:
    try:
        result = _run_query(con, text)
    except KvtraceError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        return
    if result is not None:
        write_result(result, OutputFormat.table, None, max_rows)


def _interactive_command(con, line: str, console: Console, err: Console, max_rows: int) -> bool:
    """Run a dot-command; False when it asks to leave."""
    command, *args = line.split()
    if command in (".quit", ".exit", ".q"):
        return False
    if command == ".help":
        console.print(INTERACTIVE_HELP, markup=False, highlight=False)
    elif command == ".tables":
        names = [row[0] for row in con.sql("SHOW TABLES").fetchall() if not row[0].startswith("_")]
        console.print("  ".join(sorted(names)), markup=False)
    elif command == ".analyses":
        console.print(_analyses_text(), markup=False, highlight=False)
    elif command == ".run" and args:
        try:
            result = db.run_analysis(con, args[0], **parse_params(args[1:]))
        except KvtraceError as exc:
            err.print(f"error: {exc}", markup=False, highlight=False)
            return True
        write_result(result, OutputFormat.table, None, max_rows)
    else:
        err.print(f"error: unknown command {line!r} (.help lists them)", markup=False, highlight=False)
    return True


def _resolve_format(fmt: OutputFormat | None, output: Path | None) -> OutputFormat:
    if fmt is not None:
        return fmt
    if output is not None and output.suffix.lstrip(".") in {"csv", "json", "parquet"}:
        return OutputFormat(output.suffix.lstrip("."))
    return OutputFormat.table


@app.command("sql")
@user_errors
def sql(
    args: Annotated[list[str] | None, typer.Argument(
        help=f"{RUNS_HELP} Then, optionally, the query (the last argument, when it is not a path).",
        show_default=False)] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the query from this SQL file.")] = None,
    analysis: Annotated[str | None, typer.Option(
        "--analysis", "-a", help="Run this analysis of the SQL library (see --list).")] = None,
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", help="A parameter of --analysis, NAME=VALUE (repeatable).")] = None,
    list_analyses: Annotated[bool, typer.Option(
        "--list", help="List the analyses of the SQL library with their parameters.")] = False,
    fmt: Annotated[OutputFormat | None, typer.Option(
        "--format", help="table, csv, json or parquet (default: from --output's suffix, else table).",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the result to this file.")] = None,
    max_rows: Annotated[int, typer.Option(help="Rows shown by --format table; 0 shows all.")] = 200,
) -> None:
    """Query recorded runs with SQL.

    Views requests, steps, kv_events, tokens and gpu_samples hold every run given; each row has run_id.

    The runs table has one row per run, from its meta.json.

    With no query, --file or --analysis: an interactive prompt.

    Example: kvtrace sql traces/runs "SELECT run_id, count(*) FROM kv_events GROUP BY ALL"

    Example: kvtrace sql traces/runs/r1 --analysis itl_cliffs --param threshold_ms=50
    """
    if list_analyses:
        text = _analyses_text() + "\n"
        if output is None:
            sys.stdout.write(text)
        else:
            output.write_text(text)
        return
    if file is not None and analysis is not None:
        raise KvtraceError("give a query, --file or --analysis, not both --file and --analysis")
    runs, query = _split_query(list(args or []), file is not None or analysis is not None)
    if param and analysis is None:
        raise KvtraceError("--param goes with --analysis")
    if not runs:
        raise KvtraceError("give at least one run folder (e.g. traces/runs)")
    if file is not None:
        try:
            query = file.read_text()
        except OSError as exc:
            raise KvtraceError(f"{file}: cannot read ({exc.strerror})") from exc
    con = db.connect(runs)
    if analysis is not None:
        result = db.run_analysis(con, analysis, **parse_params(param or []))
    elif query is not None:
        result = _run_query(con, query)
    else:
        _interactive(con, max_rows)
        return
    if result is not None:
        write_result(result, _resolve_format(fmt, output), output, max_rows)


# --------------------------------------------------------------------------- kvtrace compare

def compare_rows(summary: pa.Table) -> list[dict]:
    """One dict per summary column: its values per run and, for numbers, deltas against the first."""
    runs = summary.column("run_id").to_pylist()
    rows = []
    for field in summary.schema:
        if field.name == "run_id":
            continue
        values = summary.column(field.name).to_pylist()
        row = {"metric": field.name, "values": dict(zip(runs, values, strict=True))}
        if is_numeric(field.type):
            base = values[0]
            row["delta"] = {run: None if v is None or base is None else v - base
                            for run, v in zip(runs[1:], values[1:], strict=True)}
            row["delta_pct"] = {run: None if v is None or not base else (v - base) / abs(base) * 100
                                for run, v in zip(runs[1:], values[1:], strict=True)}
        rows.append(row)
    return rows


def run_tiers(con: duckdb.DuckDBPyConnection) -> dict[str, list[dict]]:
    """Each run's KV tiers (tier_hits.sql and tier_transfers.sql, as the dashboard reads them)."""
    from kvtrace.views.dashboard import tier_rows

    hits, transfers = (db.records(db.run_analysis(con, name)) for name in ("tier_hits", "tier_transfers"))
    return {run: tier_rows([r for r in hits if r["run_id"] == run], [r for r in transfers if r["run_id"] == run])
            for run in {r["run_id"] for r in hits + transfers}}


# (label, a tier's figure: tier_hits.sql's columns and tier_rows' bytes each way)
TIER_FIGURES = [("hit_tokens", "tier_hit_tokens"), ("hit_rate", "tier_hit_rate"),
                ("stored_bytes", "stored_bytes"), ("loaded_bytes", "loaded_bytes")]


def with_tier_columns(summary: pa.Table, tiers: dict[str, list[dict]]) -> pa.Table:
    """The summary with a column tier_<name>_<figure> for each KV tier a run has (null for a run without
    it), so that compare_rows compares them as the rest."""
    runs = summary.column("run_id").to_pylist()
    for name in sorted({t["tier"] for side in tiers.values() for t in side}):
        of = {run: next((t for t in tiers.get(run, []) if t["tier"] == name), {}) for run in runs}
        for label, key in TIER_FIGURES:
            summary = summary.append_column(f"tier_{name}_{label}", pa.array([of[run].get(key) for run in runs]))
    return summary


def workload_warning(con: duckdb.DuckDBPyConnection) -> str | None:
    """A warning when the runs did not replay the same workload (their sha256 differ)."""
    shas = con.sql("SELECT run_id, workload_sha256 FROM runs ORDER BY ordinal").fetchall()
    if len({sha for _, sha in shas}) <= 1:
        return None
    listed = ", ".join(f"{run} {sha[:12] if sha else 'unknown'}" for run, sha in shas)
    return f"the runs did not replay the same workload (workload sha256: {listed})"


def _signed(value: object, suffix: str = "") -> str:
    if value is None:
        return ""
    text = format_cell(value)
    return (text if text.startswith("-") else "+" + text) + suffix


@app.command("compare")
@user_errors
def compare(
    runs: Annotated[list[str], typer.Argument(
        help=f"{RUNS_HELP} The first run is the baseline.", show_default=False)],
    fmt: Annotated[CompareFormat, typer.Option("--format", help="table or json.")] = CompareFormat.table,
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", help="A parameter of the summary analysis (SLOs, thrash thresholds), NAME=VALUE.")] = None,
) -> None:
    """Compare runs side by side: what changed first, then the key figures of each, with deltas
    against the first run.

    The first lines say, per run against the first: the settings that differ, the thrash verdicts,
    and how preemptions, the recomputed share, goodput and ITL p99 moved (green: better).

    The figures are those of analyses/summary.sql; deltas are absolute and relative (%).

    Warns when the runs did not replay the same workload (the sha256 in meta.json differs).
    """
    con = db.connect(runs)
    summary = db.run_analysis(con, "summary", **parse_params(param or []))
    if summary.num_rows < 2:
        raise KvtraceError("compare needs at least two runs")
    warning = workload_warning(con)
    if warning:
        Console(stderr=True, soft_wrap=True).print(f"warning: {warning}", markup=False, highlight=False)
    tiers = run_tiers(con)
    rows = compare_rows(with_tier_columns(summary, tiers))
    changes = headline.headline(summary, headline.settings_changed(con), tiers)
    run_ids = summary.column("run_id").to_pylist()
    if fmt is CompareFormat.json:
        document = {"baseline": run_ids[0], "runs": run_ids, "warnings": [warning] if warning else [],
                    "changes": [{**change, "figures": {name: {k: db.json_value(v) for k, v in figure.items()}
                                                       for name, figure in change["figures"].items()}}
                                for change in changes],
                    "metrics": [{key: ({k: db.json_value(v) for k, v in value.items()} if isinstance(value, dict)
                                       else value) for key, value in row.items()} for row in rows]}
        sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
        return
    table = Table(show_edge=False, header_style="bold")
    table.add_column("metric")
    table.add_column(Text(run_ids[0]), justify="right")
    for run in run_ids[1:]:
        table.add_column(Text(run), justify="right")
        table.add_column("Δ", justify="right")
        table.add_column("Δ%", justify="right")
    for row in rows:
        cells = [row["metric"], format_cell(row["values"][run_ids[0]])]
        for run in run_ids[1:]:
            cells.append(format_cell(row["values"][run]))
            if "delta" in row:
                cells += [_signed(row["delta"][run]), _signed(row["delta_pct"][run], "%")]
            else:
                same = row["values"][run] == row["values"][run_ids[0]]
                cells += ["" if same else "differs", ""]
        table.add_row(*map(Text, cells))
    console = _console(None)
    console.print(headline.render(changes))
    console.print(table)
