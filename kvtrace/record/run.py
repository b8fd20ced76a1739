"""One recording: check everything, then replay into a run folder with meta.json and the tables."""
from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import kvtrace
from engine.build import build_engine
from engine.config import EngineConfig, ModelConfig, scheduling_description
from engine.llm_engine import LLMEngine
from engine.model.tokenizer import load_tokenizer
from kvtrace.atomic import write_json_atomic
from kvtrace.errors import KvtraceError
from kvtrace.record.nvml import NvmlSampler
from kvtrace.record.recorder import TraceWriter
from kvtrace.process import steady_gc
from kvtrace.record.replay import ReplayItem, ReplayStats, fill_stats, prepare, replay
from kvtrace.trace.schema import SCHEMA_VERSION
from kvtrace.workload import load_workload, workload_sha256

if TYPE_CHECKING:
    from rich.console import Console


def default_run_dir(model: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).name if os.sep in model else model)
    return Path("traces") / "runs" / f"{stamp}-{name}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    """The installed torch's version, without importing it: the Version line of the first torch
    dist-info on sys.path (importlib.metadata, which finds it the same way, costs 16 ms of a simulated
    recording's start-up to import and parse; it answers where there is no dist-info)."""
    for entry in sys.path:
        for metadata in Path(entry or ".").glob("torch-*.dist-info/METADATA"):
            with open(metadata, encoding="utf-8") as f:
                for line in f:
                    if line.startswith("Version:"):
                        return line.partition(":")[2].strip()
                    if not line.strip():   # the headers' end
                        break
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


class QuietConsole:
    """What a recording asks of its Rich console, doing nothing: `--quiet` (Rich, 20 ms of imports,
    is then not loaded at all)."""

    quiet = True

    def print(self, *objects, **options) -> None:
        pass

    def status(self, *args, **options) -> contextlib.nullcontext:
        return contextlib.nullcontext()


def recording_console(quiet: bool) -> Console | QuietConsole:
    """The console a recording reports on: standard error, or nothing when quiet."""
    if quiet:
        return QuietConsole()
    from rich.console import Console

    return Console(stderr=True)


def kernels_note(engine: LLMEngine) -> str | None:
    """On CPU without kvtrace's own kernels: why, and what runs instead."""
    model = engine.model
    if engine.simulated or engine.device.type != "cpu" or model.linear_kernel == "kvtrace":
        return None
    import torch

    from engine.kernels import cpu_kernels

    if model.dtype != torch.float32:
        return f"kvtrace's CPU kernels are fp32 only: this {str(model.dtype).removeprefix('torch.')} model runs on torch ops"
    return (f"kvtrace's CPU kernels are off ({cpu_kernels.unavailable_reason()}); the model runs on "
            f"{model.linear_kernel}, which is slower")


class Recording:
    def __init__(self, engine: LLMEngine, items: list[ReplayItem], run_dir: Path, meta: dict,
                 record_token_ids: bool, console: Console) -> None:
        self.engine = engine
        self.items = items
        self.run_dir = run_dir
        self.meta = meta
        self.record_token_ids = record_token_ids
        self.console = console
        self.stats: ReplayStats | None = None

    @classmethod
    def prepare(cls, config: EngineConfig, workload: Path, run_dir: Path, *, max_requests: int | None,
                time_scale: float | None, backlog: bool, record_token_ids: bool, command: str,
                console: Console) -> Recording:
        """Check every input before anything is written; raise KvtraceError / ValueError on bad input."""
        if run_dir.exists() and any(run_dir.iterdir()):
            raise KvtraceError(f"run folder {run_dir} already exists and is not empty")
        with steady_gc():   # the workload, its prompts and the engine's blocks live to the end
            return cls._prepare(config, workload, run_dir, max_requests=max_requests, time_scale=time_scale,
                                backlog=backlog, record_token_ids=record_token_ids, command=command, console=console)

    @classmethod
    def _prepare(cls, config: EngineConfig, workload: Path, run_dir: Path, *, max_requests: int | None,
                 time_scale: float | None, backlog: bool, record_token_ids: bool, command: str,
                 console: Console) -> Recording:
        requests = load_workload(workload)
        if max_requests is not None:
            requests = requests[:max_requests]
        with console.status(f"loading {config.model}"):
            engine = build_engine(config)
            tokenizer = load_tokenizer(config.model) if config.load_format != "dummy" else None
        items = prepare(requests, engine, tokenizer=tokenizer, seed=config.seed, time_scale=time_scale,
                        backlog=backlog, workload_name=str(workload))
        mc = engine.model_config
        g = engine.geometry
        if engine.simulated:   # no model runs: torch is not imported, only its version is noted
            device = {"type": "sim", "name": engine.runner.cost_model.profile.name, "torch": torch_version(),
                      "threads": None, "kernels": None, "kernels_note": None}
        else:
            import torch

            device_name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else cpu_name()
            device = {"type": engine.device.type, "name": device_name, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "kernels": engine.model.linear_kernel,
                      "kernels_note": kernels_note(engine)}
        meta = {
            "run_id": run_dir.name,
            "schema_version": SCHEMA_VERSION,
            "kvtrace_version": kvtrace.__version__,
            "command": command,
            "engine_config": engine.config.to_dict(),
            "scheduling": scheduling_description(engine.config),
            "model": {"name": mc.name, "source": engine.model_source, "dtype": engine.config.dtype,
                      "shape": {"layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads,
                                "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size},
                      "max_model_len": engine.max_model_len},
            "device": device,
            # a simulated run: the real scheduler and block manager, step times from this cost model
            "simulated": engine.runner.cost_model.describe() if engine.simulated else None,
            "kv_pool": {"num_gpu_blocks": g.num_gpu_blocks, "block_size": g.block_size,
                        "bytes_per_block": g.bytes_per_block, "num_cpu_blocks": g.num_cpu_blocks,
                        "total_bytes": g.num_gpu_blocks * g.bytes_per_block,
                        "watermark_blocks": engine.block_manager.watermark_blocks,
                        "kv_reserve": config.kv_reserve, "derivation": g.derivation,
                        "kv_cache_groups": kv_cache_groups(config, mc, g.block_size)},
            "kv_tiers": kv_tiers(engine),
            "workload": {"path": str(workload), "sha256": workload_sha256(workload),
                         "num_requests": len(items)},
            "replay": {"mode": "backlog" if backlog else ("time-scale" if time_scale else "wallclock"),
                       "time_scale": time_scale or 1.0},
            "seed": config.seed,
            "record_token_ids": record_token_ids,
            "started_at": None,
            "status": "pending",
            "error": None,
            "nvml": {"enabled": False, "reason": "not started"},
            "summary": None,
        }
        return cls(engine, items, run_dir, meta, record_token_ids, console)

    def run(self, interrupt_types: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
            stop: Callable[[], None] | None = None) -> str:
        """Replay into the run folder; return the end status (completed / interrupted). `stop`: see replay()."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        meta_path = self.run_dir / "meta.json"
        self.meta["started_at"] = datetime.now(timezone.utc).isoformat()
        self.meta["status"] = "running"
        writer = TraceWriter(self.run_dir, self.meta["run_id"], record_token_ids=self.record_token_ids,
                             engine_makes_tables=self.engine.simulated,
                             kv_cache_groups=self.engine.block_manager.hybrid)
        sampler = NvmlSampler(None if self.engine.simulated else self.engine.device, writer, clock=self.engine.now)
        self.meta["nvml"] = {"enabled": sampler.enabled, "reason": sampler.reason, "fields": sampler.fields}
        write_json_atomic(meta_path, self.meta)
        if self.engine.simulated:
            self.console.print(f"[dim]simulated: {self.meta['device']['name']} profile, no model run, virtual time[/]")
        if self.meta["device"]["kernels_note"]:
            self.console.print(f"[dim]note: {self.meta['device']['kernels_note']}[/]")
        self.engine.tracer = writer
        status, error = "completed", None
        with steady_gc():   # to the trace's close (process.steady_gc)
            sampler.start()
            try:
                with self._progress() as on_progress:
                    self.stats = ReplayStats()
                    replay(self.engine, self.items, on_progress=on_progress, stop=stop, stats=self.stats)
            except interrupt_types:
                status = "interrupted"
            except BaseException as exc:
                status, error = "failed", f"{type(exc).__name__}: {exc}"
                raise
            finally:
                try:
                    sampler.stop()
                    if status != "completed":
                        self.engine.flush()
                        for stats in self.engine.abort_all():
                            writer.add_request(stats)
                    writer.close()
                except BaseException as exc:  # the trace may be short: never leave meta saying "running"
                    if status != "failed":
                        status, error = "failed", f"closing the trace: {type(exc).__name__}: {exc}"
                    raise
                finally:
                    if self.stats is None:
                        self.stats = ReplayStats(num_requests=len(self.items))
                    if status != "completed":   # the counts up to the interruption
                        fill_stats(self.stats, self.engine)
                    self.meta["status"] = status
                    self.meta["error"] = error
                    self.meta["ended_at"] = datetime.now(timezone.utc).isoformat()
                    self.meta["summary"] = {**asdict(self.stats), "rows": dict(writer.rows_written)}
                    write_json_atomic(meta_path, self.meta)
        return status

    @contextlib.contextmanager
    def _progress(self) -> Iterator[Callable[[ReplayStats], None] | None]:
        """A live bar: sequences done, output rate so far, KV use, preemptions (a view, not a metric).
        None when quiet: nothing to draw."""
        if self.console.quiet:
            yield None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bm = self.engine.block_manager
        progress = Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console)
        task = progress.add_task("replay", total=sum(item.params.n for item in self.items), info="")

        def update(stats: ReplayStats) -> None:
            rate = stats.num_output_tokens / stats.duration_s if stats.duration_s else 0.0
            info = f"{rate:6.1f} tok/s  KV {100 * bm.num_used_blocks / bm.num_blocks:5.1f}%  " \
                   f"preemptions {stats.num_preemptions}"
            progress.update(task, completed=stats.num_finished, info=info)

        with progress:
            yield update

    def print_summary(self) -> None:
        """The run's headline figures, from the SQL library like everywhere else."""
        print_recorded(self.console, self.run_dir, self.meta["status"], len(self.items))


def print_recorded(console: Console, run_dir: Path, status: str, num_requests: int, label: str = "") -> None:
    """A recording's last lines: its headline figures from summary.sql, and what to run next."""
    if console.quiet:
        return
    from kvtrace.trace import db

    rows = db.run_analysis(db.connect([run_dir]), "summary").to_pylist()
    if not rows:  # interrupted before a chunk was written
        console.print(f"[bold]{status}[/]: nothing recorded in {run_dir}")
        return
    s = rows[0]
    console.print(
        f"[bold]{status}[/]{label}: {s['completed_requests']}/{num_requests} requests, "
        f"{s['output_tokens']} tokens in {s['duration_s']:.1f} s ({s['output_tok_s'] or 0:.1f} tok/s), "
        f"{s['preemptions']} preemptions")
    console.print(f"trace: {run_dir}   next: kvtrace analyze {run_dir}")


def kv_tiers(engine) -> list[dict]:
    """meta.json's kv_tiers (docs/trace-format.md): the engine's host KV tier, if any, and the host link
    bandwidth the simulator costs its copies with (GB/s, as the profile's swaps reach it; null for the
    real engine, whose copies are measured)."""
    tier = engine.scheduler.tier
    if tier is None:
        return []
    g = engine.geometry
    link_gb_s = None
    if engine.simulated:
        link_gb_s = 1e-6 / engine.runner.cost_model.coefficients["swap_byte_ms"]
    return [{"name": tier.name, "num_blocks": tier.num_blocks, "bytes": tier.num_blocks * g.bytes_per_block,
             "block_size": g.block_size, "policy": tier.policy, "link_gb_s": link_gb_s}]


def kv_cache_groups(config: EngineConfig, mc: ModelConfig, block_size: int) -> list[dict] | None:
    """meta.json's kv_pool.kv_cache_groups (docs/trace-format.md), as the vLLM capture writes it: None for
    a model of one group of full attention."""
    if not config.hybrid_kv_cache(mc):
        return None
    groups = config.kv_cache_groups(mc)
    return [{"kind": g.kind, "block_size": block_size, "layers": len(g.layers),
             **({"sliding_window": g.window} if g.window is not None else {})} for g in groups]
