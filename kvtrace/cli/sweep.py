"""`kvtrace sweep`: replay one workload across a grid of record settings; `kvtrace sweep show`."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text
from typer.core import TyperGroup

from kvtrace.cli.app import app, parse_params, user_errors
from kvtrace.errors import KvtraceError
from kvtrace.sweep.from_run import run_options, vllm_args
from kvtrace.sweep.grid import (
    MAX_POINTS_WITHOUT_YES,
    flag_names,
    grid_size,
    parse_grid,
    record_knobs,
)
from kvtrace.sweep.runner import (
    LocalRunner,
    RayRunner,
    Sweep,
    make_spec,
    point_command,
    threads_per_point,
)
from kvtrace.sweep.view import (
    objective,
    points_of,
    recommendation,
    summary_rows,
    table,
    tier_sizing,
    varying_knobs,
)
from kvtrace.workload.format import save_workload
from kvtrace.workload.from_run import workload_from_run
from kvtrace.workload.header import FOLLOW_NOTE

PARAM_HELP = "A parameter of sweep_summary.sql (SLOs, thrash thresholds), NAME=VALUE."
FROM_RUN_WORKLOAD = "from-run.jsonl"   # in the sweep folder: the workload `--from-run` made of the run


class RunByDefault(TyperGroup):
    """`kvtrace sweep --workload ...` runs a sweep (the `run` command); `kvtrace sweep show` shows one."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        # `--ray` with no address (last, or followed by another option) starts a local cluster
        args = [a for i, arg in enumerate(args)
                for a in ([arg, "local"] if arg == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-"))
                          else [arg])]
        return super().parse_args(ctx, args)


sweep_app = typer.Typer(cls=RunByDefault, no_args_is_help=True,
                        help="Replay one workload across a grid of settings and find the knee.")
app.add_typer(sweep_app, name="sweep")


def _record_command():
    """`kvtrace record` as its Click command, whose options are the knobs a sweep may set."""
    from kvtrace.cli import record as cli_record  # noqa: F401  (registers the command)
    return typer.main.get_command(app).commands["record"]  # type: ignore[attr-defined]


def _check_shared(shared: list[str], grid: dict[str, list[str]], knobs: dict) -> None:
    """Shared options must be record options that no --set also sets."""
    flags = flag_names(knobs)
    for arg in shared:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if flag not in flags:
            raise KvtraceError(f"{flag}: not an option of kvtrace record (see kvtrace record --help)")
        if flags[flag] in grid:
            raise KvtraceError(f"{flag} is both shared and swept (--set {flags[flag]}=...); give it once")


def _validate_points(sweep: Sweep, knobs: dict) -> None:
    """Parse every point's record command line here, so that a bad value stops the sweep before
    anything runs."""
    record = _record_command()
    for point in sweep.points:
        args = point_command(sweep, point, knobs)[4:]
        try:
            record.make_context("record", list(args), resilient_parsing=False)
        except Exception as exc:  # Click's usage errors (Typer vendors its own Click)
            if not hasattr(exc, "format_message"):
                raise
            raise KvtraceError(f"point {point.index} ({', '.join(f'{k}={v}' for k, v in point.settings.items())}): "
                               f"{exc.format_message()}") from None


class ProgressLine:
    """points done, running, failed, elapsed and an estimate, on one live line."""

    def __init__(self, console: Console, total: int, parallel: int) -> None:
        self.console, self.total, self.parallel = console, total, parallel
        self.live = Live(Text(""), console=console, transient=False, auto_refresh=False)

    def __call__(self, sweep: Sweep, elapsed_s: float) -> None:
        counts = {s: sum(p.status == s for p in sweep.points) for s in ("completed", "running", "failed",
                                                                        "interrupted")}
        times = [p.elapsed_s for p in sweep.points if p.status == "completed" and p.elapsed_s]
        left = self.total - counts["completed"] - counts["failed"]
        eta = ""
        if times and left:
            eta = f"  ~{sum(times) / len(times) * left / self.parallel:.0f} s left"
        self.live.update(Text(f"sweep: {counts['completed']}/{self.total} done, {counts['running']} running, "
                              f"{counts['failed']} failed  {elapsed_s:.0f} s{eta}"), refresh=True)


@sweep_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def run(
    ctx: typer.Context,
    set_: Annotated[list[str], typer.Option("--set", help="KNOB=VALUES: a record option and its values, a list "
                                                          "(16,32,64) or a range (64:512:x2, 0.5GiB:4GiB:+0.5GiB).")],
    workload: Annotated[Path | None, typer.Option("--workload", "-w", help="Workload JSONL, replayed at every point.")]
    = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Sweep folder (default: sweeps/<time>).")] = None,
    jobs: Annotated[int | None, typer.Option(help="Points run at once as local processes, each with its share of "
                                                  "the cores (default: one per core).")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="[ADDRESS]",
        help="Run points as Ray tasks: --ray ADDRESS joins a cluster, --ray alone starts a local one.")] = None,
    cpus_per_point: Annotated[int, typer.Option(help="With --ray: CPUs each point's task asks for.")] = 1,
    yes: Annotated[bool, typer.Option("--yes", help=f"Run a grid of over {MAX_POINTS_WITHOUT_YES:,} points.")] = False,
    objective_name: Annotated[str, typer.Option("--objective", help="What 'best' means in the final table.")]
    = "goodput",
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
    from_run: Annotated[Path | None, typer.Option(
        "--from-run", metavar="RUN",
        help=f"Instead of -w: the traffic of this run (kvtrace workload from-run), kept as {FROM_RUN_WORKLOAD} "
             "in the sweep folder.")] = None,
    unfinished: Annotated[str, typer.Option(
        help="With --from-run: the output length of a request that never finished in the run (typical, seen or "
             "max-tokens; kvtrace workload from-run --help).")] = "typical",
) -> None:
    """Replay WORKLOAD at every point of a grid of `kvtrace record` settings (any record option may
    be swept with --set; other record options given here are shared by every point), then show the
    table and the knee. Re-running the same command resumes: completed points are kept.
    `kvtrace sweep --workload ...` is the same as `kvtrace sweep run --workload ...`; `--from-run RUN`
    sweeps a run's traffic instead (docs/sweep.md, "What if, on a run's traffic").

    Example: kvtrace sweep -w chat.jsonl --model tiny --backlog --set max_num_seqs=8:64:x2
    --set preemption_mode=recompute,swap -o sweeps/chat
    """
    if (workload is None) == (from_run is None):
        raise KvtraceError("give the traffic to replay: --workload FILE or --from-run RUN (one of them)")
    obj = objective(objective_name)
    knobs = record_knobs(_record_command())
    shared = list(ctx.args)
    grid = parse_grid(set_, knobs)
    _check_shared(shared, grid, knobs)
    size = grid_size(grid)
    if size > MAX_POINTS_WITHOUT_YES and not yes:
        raise KvtraceError(f"the grid has {size:,} points (over {MAX_POINTS_WITHOUT_YES:,}); add --yes to run it")
    if jobs is not None and jobs < 1:
        raise KvtraceError(f"--jobs must be >= 1, got {jobs}")
    if cpus_per_point < 1:
        raise KvtraceError(f"--cpus-per-point must be >= 1, got {cpus_per_point}")
    folder = out or Path("sweeps") / time.strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", folder.resolve().name)
    if from_run is None:
        sweep = Sweep.open(folder, make_spec(name, workload, shared, grid))
    else:
        sweep = _open_from_run(folder, name, from_run, shared, grid, knobs, unfinished)
    _validate_points(sweep, knobs)
    sweep.refresh()
    parallel = jobs or threads_per_point(1)
    runner = RayRunner(ray, cpus_per_point) if ray else LocalRunner(parallel)
    console = Console(stderr=True, soft_wrap=True)
    todo = len(sweep.todo())
    console.print(f"sweep {folder}: {size} points, {size - todo} already completed, {todo} to run "
                  f"({'Ray at ' + ray if ray else f'{parallel} at a time'})", highlight=False)
    sweep.save()
    progress = ProgressLine(console, size, parallel)
    try:
        try:
            with progress.live:
                runner.run(sweep, knobs, progress)
        finally:
            if not console.is_terminal:
                console.print()  # end the progress line
    except KeyboardInterrupt:
        done = sum(p.status == "completed" for p in sweep.points)
        print(f"kvtrace: sweep interrupted; {done}/{size} points completed are kept in {folder} "
              f"(re-run the same command to resume)", file=sys.stderr)
        raise typer.Exit(code=130) from None
    failed = [p for p in sweep.points if p.status != "completed"]
    for p in failed:
        console.print(f"[red]point {p.index} {p.status}[/]: {p.error or ''}  (log: {sweep.log_path(p)})",
                      highlight=False)
    if len(failed) < size:
        _show(folder, obj, parse_params(param), as_json=False)
    if failed:
        raise typer.Exit(code=1)


def _open_from_run(folder: Path, name: str, run: Path, shared: list[str], grid: dict[str, list[str]],
                   knobs: dict, unfinished: str = "typical") -> Sweep:
    """The sweep of a run's traffic, with the run's model, pool and limits where the command line does not
    give them (kvtrace/sweep/from_run.py): the workload is made first, beside the folder, and moved into it
    only once the folder is known to be this sweep's (new, or the same one resumed: the same bytes)."""
    result = workload_from_run(run, unfinished)
    taken, said = run_options(run, shared, grid, knobs)
    shared = [*shared, *taken]
    # said once the sweep is open (a refused one says only why): what was taken, and how the edges were kept
    said = [f"sweep: {line}" for line in (*said, *result.edges)]
    given = "follow_vllm" in grid or any(a == "--follow-vllm" or a.startswith("--follow-vllm=") for a in shared)
    if result.follow_vllm and not given:   # the run's vLLM, a setting every point shares (sweep.json shows it)
        shared = [*shared, "--follow-vllm", result.follow_vllm]
        said.append(f"sweep: every point follows vLLM {result.follow_vllm} ({result.followed}); "
                    "--follow-vllm or --set follow_vllm=... says otherwise")
    said += [f"sweep: {note}" for note in result.notes if note.startswith(FOLLOW_NOTE) and not given]
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{folder.name}.", suffix=".jsonl", dir=folder.parent)
    try:
        with os.fdopen(fd, "w") as f:
            save_workload(result.requests, f, comments=[f"kvtrace workload from-run {run}", *result.comments(run)])
        spec = make_spec(name, Path(staged), shared, grid)
        spec.workload = str(folder / FROM_RUN_WORKLOAD)
        sweep = Sweep.open(folder, spec)
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(staged, folder / FROM_RUN_WORKLOAD)
    finally:
        if os.path.exists(staged):
            os.unlink(staged)
    for line in said:
        typer.echo(line, err=True)
    return sweep


def _show(folder: Path, obj, params: dict[str, str], as_json: bool) -> None:
    sweep, rows = summary_rows(folder, params)
    points = points_of(rows, list(sweep.spec.grid))
    sentence, chosen = recommendation(points, obj) if points else ("No point has completed yet.", None)
    flags = vllm_args({k: v for k, v in chosen["settings"].items() if k in varying_knobs(points)}) if chosen else ""
    if as_json:
        print(json.dumps({"sweep": sweep.spec.name, "folder": str(folder), "grid": sweep.spec.grid,
                          "objective": obj.column, "points": [{**p} for p in points],
                          "not_completed": [{"point": p.index, "run_id": p.run_id, "status": p.status, "error": p.error}
                                            for p in sweep.points if p.status != "completed"],
                          "recommendation": sentence, "best_as_vllm_args": flags or None,
                          "tier_sizing": tier_sizing(points)}, indent=2, default=str))
        return
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    done = len(points)
    console.print(table(points, obj, f"sweep {sweep.spec.name}: {done}/{len(sweep.points)} points, "
                                     f"★ best by {obj.label}"))
    if flags:
        print(f"the best point as vLLM engine arguments: {flags}")
    print(sentence)  # one line, unwrapped: scripts read it
    sizing = tier_sizing(points)
    if sizing:   # a sweep of the host KV tier's size: the operator's question, answered
        print(sizing)


@sweep_app.command("show")
@user_errors
def show(
    folder: Annotated[Path, typer.Argument(help="A sweep folder (holds sweep.json).")],
    objective_name: Annotated[str, typer.Option("--objective", help="goodput, useful_tok_s, output_tok_s, itl_p99, "
                                                                    "itl_p50, ttft_p99, ttft_p50, preemptions or "
                                                                    "recompute_share.")] = "goodput",
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The table and the recommendation as JSON.")] = False,
) -> None:
    """One row per point (throughput, useful throughput, goodput, TTFT / ITL p50 and p99,
    preemptions, recomputed share, swap traffic, thrash verdict), the best point by --objective,
    and a sentence that names the knee, or says there is none."""
    _show(folder, objective(objective_name), parse_params(param), as_json)
