"""`kvtrace sweep`: one workload replayed at every point of a grid of record settings.

Each point is an ordinary `kvtrace record` run, in its own process, into `SWEEP/runs/<point id>`,
so every command that reads runs reads a sweep's points. `SWEEP/sweep.json` keeps the grid, the
options every point shares, and each point's run id and status; a point's own `meta.json` says
whether its run completed, which is what resuming trusts. Points run as local processes (`--jobs`,
each with its share of the cores) or as Ray tasks on a cluster (`--ray`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvtrace.atomic import atomic_write
from kvtrace.errors import KvtraceError
from kvtrace.sweep.grid import Knob, point_id, points
from kvtrace.workload import workload_sha256

SWEEP_FILE = "sweep.json"
SWEEP_VERSION = 1
POLL_S = 0.1


@dataclass
class Point:
    index: int
    run_id: str
    settings: dict[str, str]
    status: str = "pending"        # pending | running | completed | failed | interrupted
    returncode: int | None = None
    error: str | None = None       # the last line the point's record printed on failure
    elapsed_s: float | None = None


@dataclass
class SweepSpec:
    """What defines a sweep: the same spec in the same folder resumes it."""

    name: str
    workload: str
    workload_sha256: str
    shared_args: list[str]
    grid: dict[str, list[str]]


@dataclass
class Sweep:
    folder: Path
    spec: SweepSpec
    points: list[Point] = field(default_factory=list)
    created_at: str = ""

    # ---- the sweep file ------------------------------------------------------------------
    @classmethod
    def open(cls, folder: Path, spec: SweepSpec) -> Sweep:
        """The sweep in `folder`: a new one, or the same one again (resumed); KvtraceError when the
        folder holds another sweep or something else."""
        path = folder / SWEEP_FILE
        if path.is_file():
            saved = load(folder)
            if asdict(saved.spec) != asdict(spec):
                what = [k for k in ("workload_sha256", "shared_args", "grid") if getattr(saved.spec, k) != getattr(spec, k)]
                raise KvtraceError(f"{folder}: holds another sweep (its {', '.join(what) or 'name'} differ); "
                                   f"choose another -o folder")
            for point in saved.points:
                if point.status == "running":  # the process that ran it is gone
                    point.status = "interrupted"
            return saved
        if folder.exists() and any(folder.iterdir()):
            raise KvtraceError(f"{folder}: exists, is not empty and holds no {SWEEP_FILE}; choose another -o folder")
        sweep = cls(folder, spec, created_at=datetime.now(timezone.utc).isoformat())
        sweep.points = [Point(i, point_id(spec.name, i, s), s) for i, s in enumerate(points(spec.grid))]
        return sweep

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {"version": SWEEP_VERSION, **asdict(self.spec), "created_at": self.created_at,
                "updated_at": datetime.now(timezone.utc).isoformat(),
                "points": [asdict(p) for p in self.points]}
        with atomic_write(self.folder / SWEEP_FILE) as f:
            f.write(json.dumps(data, indent=2) + "\n")

    def run_dir(self, point: Point) -> Path:
        return self.folder / "runs" / point.run_id

    def log_path(self, point: Point) -> Path:
        return self.folder / "logs" / f"{point.run_id}.log"

    def refresh(self) -> None:
        """Trust each point's own meta.json: a completed run is done, whatever sweep.json said."""
        for point in self.points:
            status = run_status(self.run_dir(point))
            if status == "completed":
                point.status = "completed"
            elif point.status == "completed":  # the run folder was removed or is damaged
                point.status = "pending"

    def todo(self) -> list[Point]:
        return [p for p in self.points if p.status != "completed"]


def run_status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "meta.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def load(folder: Path) -> Sweep:
    path = folder / SWEEP_FILE
    try:
        data = json.loads(path.read_text())
        spec = SweepSpec(data["name"], data["workload"], data["workload_sha256"], data["shared_args"], data["grid"])
        sweep = Sweep(folder, spec, [Point(**p) for p in data["points"]], data.get("created_at", ""))
    except FileNotFoundError:
        raise KvtraceError(f"{folder}: not a sweep folder (no {SWEEP_FILE})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvtraceError(f"{path}: cannot read ({exc})") from None
    return sweep


def make_spec(name: str, workload: Path, shared_args: list[str], grid: dict[str, list[str]]) -> SweepSpec:
    if not workload.is_file():
        raise KvtraceError(f"{workload}: no such workload file")
    return SweepSpec(name, str(workload), workload_sha256(workload), shared_args, grid)


def point_command(sweep: Sweep, point: Point, knobs: dict[str, Knob]) -> list[str]:
    """The `kvtrace record` command line of one point."""
    args = [sys.executable, "-m", "kvtrace", "record", "-w", sweep.spec.workload, *sweep.spec.shared_args]
    for name, value in point.settings.items():
        args += knobs[name].args(value)
    marker = {"name": sweep.spec.name, "index": point.index, "settings": point.settings}
    return args + ["-o", str(sweep.run_dir(point)), "--quiet", "--sweep-point", json.dumps(marker)]


def threads_per_point(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs)


def point_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def last_error(log: Path) -> str | None:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if line.startswith("kvtrace: error:")]
    return (errors or lines or [None])[-1]


def run_one(command: list[str], log: str, env: dict[str, str], cwd: str) -> int:
    """Run a point's record to the end (also the body of a Ray task); Ctrl-C is passed on to it, so
    that it closes its trace as interrupted."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            stop_process(proc)
            raise


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


Progress = Callable[[Sweep, float], None]
FAIL_FAST_POINTS = 2    # this many points failed the same way before any completed: stop the sweep


def stop_if_every_point_fails(sweep: Sweep, ran: list[Point]) -> None:
    """The points run so far all failed with one error (a bad option value, a workload the pool can
    never hold): the rest would too, so stop instead of running them all."""
    if len(ran) < min(FAIL_FAST_POINTS, len(sweep.points)) or any(p.status != "failed" for p in ran):
        return
    errors = {(p.error or "").removeprefix("kvtrace: error: ") for p in ran}
    if len(errors) == 1:
        raise KvtraceError(f"the first {len(ran)} points all failed, so the sweep stopped: {errors.pop()} "
                           f"(log: {sweep.log_path(ran[0])})")


class LocalRunner:
    """Points as local processes, `jobs` at a time."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs

    def run(self, sweep: Sweep, knobs: dict[str, Knob], on_progress: Progress) -> None:
        queue = list(sweep.todo())
        active: dict[int, tuple[Point, subprocess.Popen, float, object]] = {}
        env = point_env(threads_per_point(self.jobs))
        started = time.monotonic()
        ran: list[Point] = []
        try:
            while queue or active:
                while queue and len(active) < self.jobs:
                    point = queue.pop(0)
                    prepare_point(sweep, point)
                    log = open(sweep.log_path(point), "w")
                    proc = subprocess.Popen(point_command(sweep, point, knobs), stdout=log, stderr=subprocess.STDOUT,
                                            env=env, cwd=os.getcwd(), start_new_session=True)
                    active[point.index] = (point, proc, time.monotonic(), log)
                    sweep.save()
                for index, (point, proc, t0, log) in list(active.items()):
                    if proc.poll() is None:
                        continue
                    log.close()
                    finish_point(sweep, point, proc.returncode, time.monotonic() - t0)
                    del active[index]
                    sweep.save()
                    ran.append(point)
                    stop_if_every_point_fails(sweep, ran)
                on_progress(sweep, time.monotonic() - started)
                time.sleep(POLL_S)
        except BaseException:
            for point, proc, t0, log in active.values():
                stop_process(proc)
                log.close()
                finish_point(sweep, point, proc.returncode, time.monotonic() - t0, interrupted=True)
            sweep.save()
            raise


class RayRunner:
    """Points as Ray tasks on a cluster (`address`), or on a local one started here ('local')."""

    def __init__(self, address: str, cpus_per_point: int) -> None:
        self.address = address
        self.cpus_per_point = cpus_per_point

    def run(self, sweep: Sweep, knobs: dict[str, Knob], on_progress: Progress) -> None:
        try:
            import ray
        except ImportError:
            raise KvtraceError("--ray needs Ray: pip install \"kvtrace[ray]\"") from None
        if not ray.is_initialized():
            # workers import kvtrace from where this process does (a checkout need not be installed)
            root = str(Path(__file__).resolve().parents[2])
            runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}}
            if self.address == "local":
                ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
            else:
                ray.init(address=self.address, log_to_driver=False, runtime_env=runtime_env)
        task = ray.remote(num_cpus=self.cpus_per_point, max_retries=0)(run_one)
        env = point_env(self.cpus_per_point)
        pending = {}
        ran: list[Point] = []
        started = time.monotonic()
        for point in sweep.todo():
            prepare_point(sweep, point)
            ref = task.remote(point_command(sweep, point, knobs), str(sweep.log_path(point).resolve()), env,
                              os.getcwd())
            pending[ref] = (point, time.monotonic())
        sweep.save()
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in done:
                    point, t0 = pending.pop(ref)
                    try:
                        code = ray.get(ref)
                    except Exception as exc:  # the task itself failed (worker lost, ...)
                        code, point.error = -1, f"Ray task failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                    finish_point(sweep, point, code, time.monotonic() - t0)
                    sweep.save()
                    ran.append(point)
                    stop_if_every_point_fails(sweep, ran)
                on_progress(sweep, time.monotonic() - started)
        except BaseException:
            for ref, (point, t0) in pending.items():
                ray.cancel(ref)
                finish_point(sweep, point, None, time.monotonic() - t0, interrupted=True)
            sweep.save()
            raise


def prepare_point(sweep: Sweep, point: Point) -> None:
    """A point about to run again starts from an empty folder (record refuses a used one)."""
    run_dir = sweep.run_dir(point)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep.log_path(point).parent.mkdir(parents=True, exist_ok=True)
    point.status, point.returncode, point.error, point.elapsed_s = "running", None, None, None


def finish_point(sweep: Sweep, point: Point, returncode: int | None, elapsed_s: float,
                 interrupted: bool = False) -> None:
    status = run_status(sweep.run_dir(point))
    point.returncode = returncode
    point.elapsed_s = round(elapsed_s, 3)
    if status == "completed":  # the trace is whole, even if the process was stopped while exiting
        point.status = "completed"
    elif interrupted or status == "interrupted":
        point.status = "interrupted"
    else:
        point.status = "failed"
        point.error = point.error or last_error(sweep.log_path(point)) or f"exit code {returncode}"
