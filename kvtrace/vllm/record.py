"""`kvtrace record --engine vllm`: replay a workload through an unmodified vLLM and write the same trace.

kvtrace resolves the workload's prompts exactly as for its own engine (same token ids for the same
workload, model and seed), checks every input, then starts `kvtrace.vllm.capture.driver` with the
Python of the user's vLLM environment; vLLM runs with kvtrace's scheduler subclass, which writes
chunks into a hidden capture folder of the run; the importer turns them into the run's tables.
Only the capture package is put on that Python's path (a folder holding a link to it), so nothing
else of this environment leaks into vLLM's.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

import kvtrace
from kvtrace.atomic import write_json_atomic
from kvtrace.errors import KvtraceError
from kvtrace.record.run import cpu_name
from kvtrace.trace.schema import SCHEMA_VERSION
from kvtrace.vllm.importer import Item, convert, kv_tiers, model_shape, read_json
from kvtrace.workload import load_workload, resolve_prompt_ids, validate_lengths, workload_sha256

NOT_IN_TRACE = [
    "swap: vLLM V1 has no swap, so the swap columns and swap_out / swap_in events stay empty",
    "cow: vLLM shares blocks through the prefix cache only; n > 1 samples are separate requests",
    "device_ms is the host time between scheduling and the model's output (forward, sampling and "
    "the hand-over between vLLM's processes), not a device measurement",
    "recomputed tokens are inferred: a resumed prefill's positions below the most the request ever "
    "had computed, less its prefix-cache hits",
    "an interrupted run's unfinished requests have 'aborted' rows without their preemption counts",
]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class VllmOptions:
    model: str
    dtype: str
    seed: int
    block_size: int
    num_gpu_blocks: int | None
    kv_cache_memory: str | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    max_model_len: int | None
    enable_prefix_caching: bool
    preemption_policy: str
    watermark: float = 0.0
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    vllm_python: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    self_check: bool = False
    capture: bool = True


def refuse_unsupported(*, preemption_mode: str, preemption_policy: str, kv_reserve: str, num_cpu_blocks,
                       swap_space, device: str, load_format: str, gpu_memory_utilization,
                       n_mode: str = "independent") -> None:
    """One line for each kvtrace option vLLM V1 cannot honour."""
    if n_mode != "independent":
        raise KvtraceError("--engine vllm: vLLM V1 runs n > 1 as independent requests; drop --n-mode cow")
    if preemption_mode != "recompute":
        raise KvtraceError("--engine vllm: vLLM V1 preempts by recompute only (it has no swap); "
                           "drop --preemption-mode swap")
    if preemption_policy not in ("newest", "priority"):
        raise KvtraceError(f"--engine vllm: vLLM has no {preemption_policy} policy "
                           "(newest = its fcfs, priority = its priority scheduling)")
    if kv_reserve != "none":
        raise KvtraceError("--engine vllm: vLLM always pages on demand; --kv-reserve is for kvtrace's engines")
    if num_cpu_blocks is not None or swap_space is not None:
        raise KvtraceError("--engine vllm: vLLM V1 has no swap space; drop --num-cpu-blocks / --swap-space")
    if device != "cpu":
        raise KvtraceError("--engine vllm: the device is the one vLLM's build runs on; drop --device")
    if load_format != "auto":
        raise KvtraceError("--engine vllm: --load-format dummy is for kvtrace's engine; pass "
                           "--vllm-arg load_format=dummy to vLLM")
    if gpu_memory_utilization is not None:
        raise KvtraceError("--engine vllm: pass --vllm-arg gpu_memory_utilization=X (vLLM sizes its own pool)")


def find_vllm_python(given: str | None) -> str:
    """The Python of the user's vLLM environment: --vllm-python, $KVTRACE_VLLM_PYTHON or this one."""
    given = given or os.environ.get("KVTRACE_VLLM_PYTHON")
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise KvtraceError(f"--vllm-python {given}: not an executable file")
        return str(path)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise KvtraceError("--engine vllm: vLLM is not importable here; name the Python of your vLLM environment "
                       "with --vllm-python PATH (or $KVTRACE_VLLM_PYTHON)")


def parse_vllm_args(pairs: list[str]) -> dict:
    """KEY=VALUE pairs; values read as JSON where they parse (numbers, true/false, null, lists)."""
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise KvtraceError(f"--vllm-arg {pair!r}: expected KEY=VALUE (e.g. enforce_eager=true)")
        try:
            args[key.strip().replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            args[key.strip().replace("-", "_")] = value
    return args


def model_folder(model: str) -> Path:
    """An HF folder vLLM can load: the folder given, or a built-in model exported once to the cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvtraceError(f"--model {model}: no config.json in that folder (vLLM loads Hugging Face folders)")
        return path
    from engine.config import PRESETS
    if model not in PRESETS:
        raise KvtraceError(f"--model {model}: --engine vllm needs a Hugging Face folder or a built-in model "
                           f"({', '.join(PRESETS)})")
    from engine.config import cache_root
    cache = cache_root() / "hf" / model
    if not (cache / "config.json").is_file():
        from engine.model.export import export_hf_folder
        if cache.exists():
            shutil.rmtree(cache)
        export_hf_folder(model, cache)
    return cache


def capture_path() -> Path:
    """A folder whose only entry is a link to this kvtrace package: what vLLM's Python gets on its path
    (the package's own parent would hand vLLM every package of kvtrace's environment, torch included).
    It lives in kvtrace's cache folder (engine.config.cache_root: ~/.cache/kvtrace, `KVTRACE_CACHE_DIR`
    moves it), not in the temporary folder, which cleaners empty under a server that runs for months. One
    folder per package (its path's hash in the name): two checkouts of kvtrace used at once (git
    worktrees, a wheel beside an editable install) never point each other's vLLM at the wrong code."""
    from engine.config import cache_root

    package = Path(kvtrace.__file__).resolve().parent
    digest = hashlib.blake2b(str(package).encode(), digest_size=4).hexdigest()
    root = cache_root() / f"capture-path-{digest}"
    link = root / "kvtrace"
    if not (link.is_symlink() and link.resolve() == package):
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".kvtrace.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(package)
        tmp.replace(link)
    return root


class VllmRecording:
    def __init__(self, opts: VllmOptions, workload: Path, run_dir: Path, *, max_requests: int | None,
                 time_scale: float | None, backlog: bool, record_token_ids: bool, command: str,
                 console: Console, server: bool = False) -> None:
        if run_dir.exists() and any(run_dir.iterdir()):
            raise KvtraceError(f"run folder {run_dir} already exists and is not empty")
        self.opts, self.run_dir, self.console = opts, run_dir, console
        self.record_token_ids = record_token_ids
        self.python = None if server else find_vllm_python(opts.vllm_python)
        extra = parse_vllm_args(opts.vllm_args)
        requests = load_workload(workload)
        if max_requests is not None:
            requests = requests[:max_requests]
        self.folder = model_folder(opts.model)
        from engine.model.loader import load_config
        mc, _ = load_config(str(self.folder))
        from engine.model.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(str(self.folder))
        ids = [resolve_prompt_ids(r, vocab_size=mc.vocab_size, tokenizer=tokenizer, seed=opts.seed) for r in requests]
        longest = max(len(p) + r.max_tokens for r, p in zip(requests, ids))
        max_model_len = opts.max_model_len or min(longest, mc.max_position_embeddings)
        validate_lengths(requests, [len(p) for p in ids], max_model_len)
        if opts.num_gpu_blocks is not None and (opts.num_gpu_blocks * opts.block_size < max_model_len):
            raise KvtraceError(f"--num-gpu-blocks {opts.num_gpu_blocks}: {opts.num_gpu_blocks} blocks of "
                               f"{opts.block_size} tokens cannot hold one sequence of {max_model_len} tokens "
                               f"(max model length; vLLM refuses to start) — give more blocks or --max-model-len")
        engine_args = {"dtype": opts.dtype, "seed": opts.seed, "block_size": opts.block_size,
                       "max_model_len": max_model_len, "enable_prefix_caching": opts.enable_prefix_caching,
                       "scheduling_policy": "priority" if opts.preemption_policy == "priority" else "fcfs"}
        for key in ("max_num_seqs", "max_num_batched_tokens"):  # else vLLM's defaults for its device
            if getattr(opts, key) is not None:
                engine_args[key] = getattr(opts, key)
        if opts.watermark:
            engine_args["watermark"] = opts.watermark
        if opts.long_prefill_token_threshold:
            engine_args["long_prefill_token_threshold"] = opts.long_prefill_token_threshold
        if not opts.enable_chunked_prefill:
            engine_args["enable_chunked_prefill"] = False
        if opts.async_scheduling:
            engine_args["async_scheduling"] = True
        if opts.num_gpu_blocks is not None:
            engine_args["num_gpu_blocks_override"] = opts.num_gpu_blocks + 1   # + vLLM's null block
        if opts.kv_cache_memory is not None:
            from engine.config import parse_bytes
            engine_args["kv_cache_memory_bytes"] = parse_bytes(opts.kv_cache_memory)
        engine_args.setdefault("gpu_memory_utilization", 0.3)   # on CPU it is a share of host memory
        engine_args.update(extra)
        self.engine_args = engine_args
        self.items = []
        for i, (r, p) in enumerate(zip(requests, ids)):
            arrival = 0.0 if backlog else r.arrival_s / (time_scale or 1.0)
            self.items.append({"index": i, "prompt_token_ids": p, "arrival_s": arrival, "max_tokens": r.max_tokens,
                               "n": r.n, "temperature": r.temperature, "top_p": r.top_p,
                               "seed": r.seed if r.seed is not None else opts.seed, "ignore_eos": r.ignore_eos,
                               "priority": r.priority, "output_tokens": r.output_tokens})
        self.import_items = [Item(i, r.id, r.n, r.priority, item["arrival_s"], len(p), r.max_tokens, r.output_tokens)
                             for i, (r, p, item) in enumerate(zip(requests, ids, self.items))]
        # a vLLM block holds KV for one KV-cache group's layers (every layer unless the model has sliding
        # windows beside full attention: ModelConfig.kv_cache_groups follows vLLM's grouping)
        bytes_per_block = (mc.layers_per_kv_cache_group * 2 * mc.num_kv_heads * mc.head_dim
                           * DTYPE_BYTES.get(opts.dtype, 4) * opts.block_size)
        self.meta = {
            "run_id": run_dir.name, "schema_version": SCHEMA_VERSION, "kvtrace_version": kvtrace.__version__,
            "command": command,
            "engine_config": {"engine": "vllm", "model": opts.model, "dtype": opts.dtype, "seed": opts.seed,
                              "block_size": opts.block_size, "num_gpu_blocks": opts.num_gpu_blocks,
                              "max_num_seqs": opts.max_num_seqs, "max_num_batched_tokens": opts.max_num_batched_tokens,
                              "max_model_len": max_model_len, "enable_prefix_caching": opts.enable_prefix_caching,
                              "preemption_mode": "recompute", "preemption_policy": opts.preemption_policy},
            "scheduling": {"follows": "vLLM itself (recorded from inside)", "departures": []},
            "model": {"name": Path(opts.model).name, "source": str(self.folder), "dtype": opts.dtype,
                      "shape": {"layers": mc.num_layers, "hidden": mc.hidden_size, "heads": mc.num_heads,
                                "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size},
                      "max_model_len": max_model_len},
            "device": {"type": "cpu", "name": cpu_name(), "torch": None, "threads": None, "kernels": "vllm",
                       "kernels_note": None},
            "simulated": None,
            "kv_pool": {"num_gpu_blocks": opts.num_gpu_blocks, "block_size": opts.block_size,
                        "bytes_per_block": bytes_per_block, "num_cpu_blocks": 0, "total_bytes": None,
                        "watermark_blocks": None, "kv_reserve": "none",
                        "derivation": "vLLM's pool less its null block (block 0)"},
            "workload": {"path": str(workload), "sha256": workload_sha256(workload), "num_requests": len(requests)},
            "replay": {"mode": "backlog" if backlog else ("time-scale" if time_scale else "wallclock"),
                       "time_scale": time_scale or 1.0},
            "seed": opts.seed, "record_token_ids": record_token_ids,
            "vllm": {"python": self.python, "engine_args": engine_args, "not_in_trace": NOT_IN_TRACE},
            "started_at": None, "status": "pending", "error": None,
            "nvml": {"enabled": False, "reason": "vLLM run: not sampled"}, "summary": None,
        }

    def run(self) -> str:
        """Start vLLM, replay, import; return completed or interrupted. KvtraceError if vLLM refuses."""
        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        capture = run_dir / ".vllm-capture"
        capture.mkdir()
        requests_path = capture / "requests.jsonl"
        requests_path.write_text("".join(json.dumps(item) + "\n" for item in self.items))
        results_path = capture / "results.json"
        config = {"model": str(self.folder), "engine_args": self.engine_args, "capture_dir": str(capture),
                  "requests": str(requests_path), "results": str(results_path), "self_check": self.opts.self_check,
                  "capture": self.opts.capture, "token_ids": self.record_token_ids}
        (capture / "driver.json").write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = str(capture_path())
        if self.meta["replay"]["mode"] == "backlog":
            # the engine core in this process: every request is queued before the first step, so a
            # backlog replays deterministically (a core process would start stepping on the first)
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.meta["vllm"]["engine_core"] = ("in-process" if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                                            else "separate process")
        log_path = run_dir / "vllm.log"
        self.meta["started_at"] = datetime.now(timezone.utc).isoformat()
        self.meta["status"] = "running"
        write_json_atomic(run_dir / "meta.json", self.meta)
        interrupted = False
        with open(log_path, "w") as log:
            proc = subprocess.Popen([self.python, "-m", "kvtrace.vllm.capture.driver", str(capture / "driver.json")],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                with self.console.status(f"vLLM: starting and replaying {len(self.items)} requests (log: {log_path})"):
                    proc.wait()
            except KeyboardInterrupt:
                interrupted = True
                _stop(proc)
        results = read_json(results_path) or {}
        if results.get("error") and not interrupted:
            refused = read_json(capture / "error.json")
            message = refused["error"] if refused else results["error"]
            shutil.rmtree(run_dir)   # nothing was recorded: leave nothing that looks like a run
            raise KvtraceError(f"--engine vllm: {message}" + ("" if refused else f" (vLLM's log was {log_path}, removed)"))
        if proc.returncode not in (0, 130) and not interrupted:
            self.meta["status"], self.meta["error"] = "failed", f"vLLM's driver exited with {proc.returncode}; see vllm.log"
        interrupted = interrupted or proc.returncode == 130 or bool(results.get("interrupted"))
        captured = read_json(capture / "capture.json") or {}
        origin = results.get("origin_monotonic") or captured.get("started_monotonic") or 0.0
        rows = convert(capture, run_dir, run_dir.name, self.import_items, origin, interrupted=interrupted,
                       record_token_ids=self.record_token_ids)
        done = read_json(capture / "done.json") or {}
        status = "interrupted" if interrupted else (self.meta["status"] if self.meta["status"] == "failed" else "completed")
        self._finish_meta(status, results, captured, done, rows)
        (run_dir / "vllm_requests.json").write_text(json.dumps(
            {"tokens": results.get("tokens", {}), "preemptions": results.get("preemptions_per_request", {})}))
        shutil.rmtree(capture)
        return status

    def _finish_meta(self, status: str, results: dict, captured: dict, done: dict, rows: dict) -> None:
        meta = self.meta
        meta["status"] = status
        meta["ended_at"] = datetime.now(timezone.utc).isoformat()
        pool = meta["kv_pool"]
        if captured:
            pool["num_gpu_blocks"] = captured["num_gpu_blocks"] - 1
            pool["watermark_blocks"] = captured.get("watermark_blocks")
            pool["total_bytes"] = pool["num_gpu_blocks"] * pool["bytes_per_block"]
            meta["engine_config"]["num_gpu_blocks"] = pool["num_gpu_blocks"]
            groups, drafting = model_shape(captured)
            pool.update(groups)
            meta["engine_config"].update(drafting)
            meta["kv_tiers"] = kv_tiers(captured)
            for key in ("max_num_seqs", "max_num_batched_tokens"):  # vLLM's defaults, where not given
                if meta["engine_config"].get(key) is None:
                    meta["engine_config"][key] = captured.get(key)
        version = results.get("vllm_version") or captured.get("vllm_version")
        meta["device"]["name"] = f"{meta['device']['name']} · vLLM {version}"
        meta["vllm"].update({
            "version": version,
            "scheduler": captured.get("scheduler"), "async_scheduling": captured.get("async_scheduling"),
            "settings": {k: captured.get(k) for k in ("block_size", "num_gpu_blocks", "max_num_seqs",
                                                      "max_num_batched_tokens", "max_model_len",
                                                      "enable_prefix_caching", "watermark_blocks")},
            "startup_s": results.get("startup_s"),
            "counters": {"num_preemptions": results.get("num_preemptions")},
            "self_check": {"enabled": self.opts.self_check, "steps": done.get("self_check_steps"),
                           "errors": done.get("self_check_errors"), "examples": done.get("self_check_examples")},
            "capture_closed": bool(done), "writer_error": done.get("writer_error"),
        })
        steps = rows.get("steps", 0)
        meta["summary"] = {"num_requests": sum(item.n for item in self.import_items), "num_steps": steps,
                           "num_output_tokens": rows.get("tokens", 0),
                           "num_preemptions": results.get("num_preemptions"),
                           "duration_s": results.get("duration_s"), "rows": rows}
        write_json_atomic(self.run_dir / "meta.json", meta)

    def print_summary(self) -> None:
        from kvtrace.record.run import print_recorded

        print_recorded(self.console, self.run_dir, self.meta["status"], len(self.items),
                       f" (vLLM {self.meta['vllm'].get('version')})")


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C: let the driver stop vLLM cleanly (the capture closes its chunks), then insist."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
