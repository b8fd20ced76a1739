"""`kvtrace record`: replay a workload through the engine and write its trace."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from engine.config import EngineConfig
from kvtrace.cli.app import app, user_errors
from kvtrace.errors import KvtraceError
from kvtrace.workload.header import resolve_follow_vllm

PRESETS_HELP = "built-in name (tiny, smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, llama-3-8b, mistral-7b), HF folder or .gguf"


class Terminated(Exception):
    """SIGTERM arrived: stop like Ctrl-C."""


class DeferredSignals:
    """SIGINT and SIGTERM while recording: noted when they arrive, raised by the replay between steps,
    so a step's tokens, events and request stats are never cut apart in the trace."""

    def __init__(self) -> None:
        self.pending: list[BaseException] = []
        self.previous: dict[int, object] = {}

    def __enter__(self) -> DeferredSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _note(self, signum: int, frame: object) -> None:
        self.pending.append(KeyboardInterrupt() if signum == signal.SIGINT else Terminated())

    def raise_pending(self) -> None:
        if self.pending:
            raise self.pending[0]


@app.command()
@user_errors
def record(
    workload: Annotated[Path, typer.Option("--workload", "-w", rich_help_panel="Workload and run", help="Workload JSONL (see docs/workload-format.md).")],
    model: Annotated[str, typer.Option(rich_help_panel="Model and device", help=f"Model: {PRESETS_HELP}.")] = "smollm2-135m",
    out: Annotated[Path | None, typer.Option("--out", "-o", rich_help_panel="Workload and run", help="Run folder (default: traces/runs/<time>-<model>, and traces/runs/latest points to it).")] = None,
    engine: Annotated[str, typer.Option(rich_help_panel="Model and device", help="real (run the model), sim (the same scheduler and block manager, "
                                             "step times from a cost model, virtual time; see docs/simulation.md) "
                                             "or vllm (an unmodified vLLM, recorded from inside; see docs/vllm.md).")] = "real",
    hardware: Annotated[str | None, typer.Option(rich_help_panel="Model and device", help="--engine sim: h100-sxm (default), h200, a100-80gb, l40s, "
                                                      "cpu-here, or a profile JSON from kvtrace calibrate.")] = None,
    device: Annotated[str, typer.Option(rich_help_panel="Model and device", help="cpu or cuda[:N].")] = "cpu",
    dtype: Annotated[str | None, typer.Option(rich_help_panel="Model and device", help="auto, float32, bfloat16 or float16 (default auto: the model's dtype on CUDA, as vLLM's, "
                                                            "float32 on CPU; bfloat16 with --engine sim).")] = None,
    load_format: Annotated[str, typer.Option(rich_help_panel="Model and device", help="auto, or dummy for random weights of the model's shape.")] = "auto",
    block_size: Annotated[int, typer.Option(rich_help_panel="KV cache", help="Tokens per KV block.")] = 16,
    num_gpu_blocks: Annotated[int | None, typer.Option(rich_help_panel="KV cache", help="Device KV blocks (overrides --kv-cache-memory).")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option(rich_help_panel="KV cache", help="Device KV pool size, bytes or e.g. 2GiB.")] = None,
    num_cpu_blocks: Annotated[int | None, typer.Option(rich_help_panel="KV cache", help="Host swap blocks.")] = None,
    swap_space: Annotated[str | None, typer.Option(rich_help_panel="KV cache", help="Host swap space, bytes or e.g. 4GiB.")] = None,
    offload_size: Annotated[str | None, typer.Option(rich_help_panel="KV cache", help="A host KV tier of this size, bytes or e.g. 8GiB (vLLM's native CPU offloading, --kv-offloading-size): prompt blocks stored as they are computed, loaded back instead of recomputed; 0: none. See docs/scheduling.md.")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(rich_help_panel="KV cache", help="Size the KV pool as vLLM does: this share of the device's memory, less weights and activations (CUDA or --engine sim).")] = None,
    kv_reserve: Annotated[str, typer.Option(rich_help_panel="KV cache", help="none (on-demand paging), max-model-len or max-tokens: a request holds the blocks of its whole context from admission, as pre-paging servers did.")] = "none",
    preemption_mode: Annotated[str, typer.Option(rich_help_panel="Scheduling", help="recompute (vLLM V1) or swap (vLLM V0's, falling back to "
                                                      "recompute when host space runs out).")] = "recompute",
    preemption_policy: Annotated[str, typer.Option(rich_help_panel="Scheduling", help="newest or priority (vLLM V1), fewest-computed or "
                                                        "newest-sparing (kvtrace's; see docs/scheduling.md).")] = "newest",
    n_mode: Annotated[str, typer.Option(rich_help_panel="Scheduling", help="n > 1: independent (vLLM V1: n requests sharing the prompt through "
                                             "the prefix cache) or cow (vLLM V0: one prefill, samples forked "
                                             "with copy-on-write).")] = "independent",
    max_num_seqs: Annotated[int | None, typer.Option(rich_help_panel="Scheduling", help="Most sequences in a batch (default: vLLM's for the "
                                                          "device: 256 on CPU, 1024 on an H100/H200).")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(rich_help_panel="Scheduling", help="Token budget of a step (default: vLLM's for "
                                                                    "the device: 4096 on CPU, 16384 on an H100/H200).")] = None,
    max_model_len: Annotated[int | None, typer.Option(rich_help_panel="Scheduling", help="Longest sequence (default: the model's).")] = None,
    watermark: Annotated[float, typer.Option(rich_help_panel="KV cache", help="Fraction of the pool kept free when admitting while other "
                                                  "requests run (vLLM V1's; default 0).")] = 0.0,
    long_prefill_token_threshold: Annotated[int, typer.Option(rich_help_panel="Scheduling", help="Cap a prefill chunk at this many tokens while "
                                                                   "other requests run (vLLM V1's; 0: no cap).")] = 0,
    enable_chunked_prefill: Annotated[bool, typer.Option(rich_help_panel="Switches", help="Split prompts over steps; off: a prompt "
                                                              "waits until it fits one step's budget.")] = True,
    async_scheduling: Annotated[bool, typer.Option(rich_help_panel="Switches", help="Schedule each step before the last one's output is "
                                                        "processed (vLLM V1's default on GPUs; finished requests free "
                                                        "their blocks a step later).")] = False,
    enable_prefix_caching: Annotated[bool, typer.Option(rich_help_panel="Switches", help="Share cached full blocks between requests.")] = True,
    disable_hybrid_kv_cache_manager: Annotated[bool, typer.Option("--disable-hybrid-kv-cache-manager", rich_help_panel="Switches",
                                                                  help="vLLM's: a model with sliding-window layers keeps every "
                                                                       "layer's KV as full attention's (one block table, no block "
                                                                       "dropped mid-request).")] = False,
    speculative_method: Annotated[str | None, typer.Option(rich_help_panel="Speculative decoding", help="--engine sim: draft as "
                                                "vLLM's method does: ngram or suffix (no lookahead slots), eagle, eagle3 or mtp "
                                                "(k lookahead slots), draft_model (k lookahead slots and a drafting slot "
                                                "a request) (docs/scheduling.md).")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(rich_help_panel="Speculative decoding", help="--engine sim: draft tokens "
                                                "proposed a step for each decoding request (vLLM's; with "
                                                "--speculative-method).")] = 0,
    spec_acceptance_rate: Annotated[float, typer.Option(rich_help_panel="Speculative decoding", help="--engine sim: the chance a "
                                                "draft is accepted when the drafts before it were (kvtrace calibrate fits it "
                                                "from a capture).")] = 0.7,
    sim_fast_path: Annotated[bool, typer.Option(rich_help_panel="Switches", help="--engine sim: make the general pass's decisions "
                                                     "faster where steps only decode (docs/simulation.md); off: the "
                                                     "general pass decides every step (the same trace, slower).")] = True,
    follow_vllm: Annotated[str | None, typer.Option(rich_help_panel="Scheduling", help="The vLLM whose scheduling decisions to make "
                                                "where versions differ: 0.31.0, 0.32.0, 0.33.0 or 0.34.0 (docs/scheduling.md); default: the "
                                                "one a `workload from-run` header names, else 0.32.0.")] = None,
    seed: Annotated[int, typer.Option(rich_help_panel="Workload and run", help="Seed for synthesised prompts, sampling and dummy weights.")] = 0,
    max_requests: Annotated[int | None, typer.Option(rich_help_panel="Workload and run", help="Replay only the first N requests.")] = None,
    time_scale: Annotated[float | None, typer.Option(rich_help_panel="Workload and run", help="Arrivals X times faster than the workload says.")] = None,
    backlog: Annotated[bool, typer.Option(rich_help_panel="Switches", help="All requests arrive at t=0.")] = False,
    no_token_ids: Annotated[bool, typer.Option("--no-token-ids", rich_help_panel="Workload and run", help="Do not record token ids.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel="Workload and run", help="No progress bar or summary.")] = False,
    vllm_python: Annotated[str | None, typer.Option(rich_help_panel="vLLM", help="--engine vllm: the Python of your vLLM environment "
                                                         "(default: $KVTRACE_VLLM_PYTHON, or this one if it imports vllm).")] = None,
    vllm_arg: Annotated[list[str] | None, typer.Option(rich_help_panel="vLLM", help="--engine vllm: any other vLLM engine argument, KEY=VALUE "
                                                           "(repeatable), e.g. enforce_eager=true.")] = None,
    endpoint: Annotated[str | None, typer.Option(rich_help_panel="vLLM", help="Replay against a running vllm serve that captures (http://HOST:PORT; "
                                                      "implies --engine vllm; see kvtrace vllm-env).")] = None,
    capture_dir: Annotated[Path | None, typer.Option(rich_help_panel="vLLM", help="--endpoint: the server's capture folder (KVTRACE_CAPTURE_DIR).")] = None,
    request_timeout: Annotated[float, typer.Option(rich_help_panel="vLLM", help="--endpoint: seconds a request may wait for its next token.")] = 600.0,
    self_check: Annotated[bool, typer.Option(rich_help_panel="Switches", help="--engine vllm: compare, every step, the pool state the captured "
                                                  "events describe with vLLM's own (slower; the result is in meta.json).")] = False,
    sweep_point: Annotated[str | None, typer.Option(hidden=True, help="Set by kvtrace sweep: the point, as JSON, "
                                                                      "kept in meta.json under 'sweep'.")] = None,
) -> None:
    """Replay a workload through the engine and write a Parquet trace of every KV-cache event."""
    if time_scale is not None and time_scale <= 0:
        raise KvtraceError(f"--time-scale must be > 0, got {time_scale}")
    if max_requests is not None and max_requests < 1:
        raise KvtraceError(f"--max-requests must be >= 1, got {max_requests}")
    if endpoint is not None:
        if engine not in ("real", "vllm"):
            raise KvtraceError("--endpoint records a vLLM server: drop --engine sim")
        if capture_dir is None:
            raise KvtraceError("--endpoint needs --capture-dir, the folder the server captures into")
        engine = "vllm"
    elif capture_dir is not None:
        raise KvtraceError("--capture-dir goes with --endpoint")
    if engine not in ("real", "sim", "vllm"):
        raise KvtraceError(f"--engine must be one of real, sim, vllm, got {engine!r}")
    if dtype is None:  # auto: the model's dtype on CUDA, float32 on CPU (engine/config.py, device_defaults)
        dtype = {"sim": "bfloat16", "vllm": "float32"}.get(engine, "auto")
    if engine == "vllm":
        _record_vllm(locals())
        return
    if vllm_python is not None or vllm_arg or self_check:
        raise KvtraceError("--vllm-python, --vllm-arg and --self-check are for --engine vllm")
    follow_vllm, follow_note = resolve_follow_vllm(follow_vllm, workload)   # the workload's header, if it names one
    if follow_note and not quiet:
        print(f"kvtrace: {follow_note}", file=sys.stderr)
    config = EngineConfig(
        model=model, load_format=load_format, device=device, dtype=dtype, seed=seed, block_size=block_size,
        engine=engine, hardware=hardware, kv_reserve=kv_reserve, gpu_memory_utilization=gpu_memory_utilization,
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_memory=kv_cache_memory,
        num_cpu_blocks=num_cpu_blocks, swap_space=swap_space, offload_size=offload_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        watermark=watermark, preemption_mode=preemption_mode, preemption_policy=preemption_policy,
        enable_prefix_caching=enable_prefix_caching, n_mode=n_mode,
        long_prefill_token_threshold=long_prefill_token_threshold, enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling, follow_vllm=follow_vllm, sim_fast_path=sim_fast_path,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        speculative_method=speculative_method, num_speculative_tokens=num_speculative_tokens,
        spec_acceptance_rate=spec_acceptance_rate,
    )
    from kvtrace.record.run import Recording, default_run_dir, recording_console  # torch: imported only when recording

    console = recording_console(quiet)
    run_dir = out or default_run_dir(model)
    try:
        recording = Recording.prepare(config, workload, run_dir, max_requests=max_requests, time_scale=time_scale,
                                      backlog=backlog, record_token_ids=not no_token_ids,
                                      command=" ".join(["kvtrace", *sys.argv[1:]]), console=console)
    except KeyboardInterrupt:  # before anything was written: nothing to clean up
        print("kvtrace: interrupted before recording started; nothing written", file=sys.stderr)
        raise typer.Exit(code=130) from None
    if sweep_point is not None:
        recording.meta["sweep"] = json.loads(sweep_point)
    with DeferredSignals() as signals:
        status = recording.run(interrupt_types=(KeyboardInterrupt, Terminated), stop=signals.raise_pending)
    if out is None:  # traces/runs/latest follows the newest default run
        latest = run_dir.parent / "latest"
        if latest.is_symlink() or not latest.exists():
            tmp = run_dir.parent / ".latest.tmp"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(run_dir.name)
            tmp.replace(latest)
    recording.print_summary()
    if status == "interrupted":
        raise typer.Exit(code=130)


@app.command("vllm-env")
@user_errors
def vllm_env(
    capture_dir: Annotated[Path, typer.Option(help="Where the server's capture writes its chunks.")],
    async_scheduling: Annotated[bool | None, typer.Option(
        "--async-scheduling/--no-async-scheduling",
        help="Force the async (or the synchronous) scheduler subclass; by default the one class follows "
             "the server's own choice (async on GPUs).")] = None,
    max_bytes: Annotated[str, typer.Option(help="Disk budget of the folder: the oldest chunks go first (4GiB, 500MB).")] = "4GiB",
    max_age: Annotated[str, typer.Option(help="Age limit of a chunk (7d, 12h, 90m, 600 seconds).")] = "7d",
    token_ids: Annotated[bool, typer.Option(
        help="Keep the output token ids (a test server's; live traffic's ids are its users' text).")] = False,
    file_mode: Annotated[str, typer.Option(
        help="The mode of the capture's files, in octal (0640: owner and group; folders get 0750); whatever "
             "the umask.")] = "0640",
    strict: Annotated[bool, typer.Option(
        help="Refuse to start vLLM where the capture cannot start (a vLLM or model it cannot follow, a folder it "
             "cannot write); by default the capture steps aside and vLLM serves unrecorded, saying why in its "
             "log and the folder's error.json.")] = False,
) -> None:
    """Shell lines that make `vllm serve` capture a kvtrace trace: eval "$(kvtrace vllm-env --capture-dir DIR)".

    Then start the server with --scheduler-cls "$KVTRACE_SCHEDULER_CLS" (one class for every server: it
    subclasses the Scheduler or AsyncScheduler vLLM would have used). Turn any window of its traffic
    into a run with kvtrace capture run DIR -o RUN --last 15m, or replay a workload against it with
    kvtrace record --endpoint http://HOST:PORT --capture-dir DIR --model MODEL -w W.jsonl -o RUN
    (a server started with --token-ids, to compare tokens).
    """
    from kvtrace.vllm.capture.files import make_folder, parse_mode
    from kvtrace.vllm.capture.sink import parse_age, parse_bytes
    from kvtrace.vllm.record import capture_path

    parse_bytes(max_bytes, "--max-bytes")
    parse_age(max_age, "--max-age")
    mode = parse_mode(file_mode, "--file-mode")
    folder = capture_dir.expanduser().resolve()
    make_folder(folder, mode)
    cls = {None: "KvtraceCaptureScheduler", True: "KvtraceAsyncScheduler", False: "KvtraceScheduler"}[async_scheduling]
    path = capture_path()
    print(f"# PYTHONPATH: {path} holds one entry, a link to this kvtrace ({(path / 'kvtrace').resolve()}),")
    print("# in kvtrace's cache folder (KVTRACE_CACHE_DIR moves it), not the temporary folder: it lasts while this")
    print("# kvtrace stays installed; run vllm-env again after moving or reinstalling kvtrace")
    print(f'export PYTHONPATH="{path}${{PYTHONPATH:+:$PYTHONPATH}}"')
    print(f'export KVTRACE_CAPTURE_DIR="{folder}"')
    print(f'export KVTRACE_CAPTURE_MAX_BYTES="{max_bytes}"')
    print(f'export KVTRACE_CAPTURE_MAX_AGE="{max_age}"')
    print(f'export KVTRACE_CAPTURE_TOKEN_IDS="{1 if token_ids else 0}"')
    print(f'export KVTRACE_CAPTURE_MODE="{mode:04o}"')
    print("# 1: a capture that cannot start stops vLLM's start-up; 0: it steps aside, vLLM serves unrecorded")
    print(f'export KVTRACE_CAPTURE_STRICT="{1 if strict else 0}"')
    print(f'export KVTRACE_SCHEDULER_CLS="kvtrace.vllm.capture.scheduler.{cls}"')
    print('# now: vllm serve MODEL --scheduler-cls "$KVTRACE_SCHEDULER_CLS" ...')


def _record_vllm(a: dict) -> None:
    """`kvtrace record --engine vllm`: the same checks and run folder, vLLM doing the work."""
    from kvtrace.vllm.record import VllmOptions, VllmRecording, refuse_unsupported

    if a["hardware"] is not None:
        raise KvtraceError("--hardware is for --engine sim")
    if a["offload_size"] is not None:
        raise KvtraceError("--offload-size is for kvtrace's engine: with --engine vllm, pass vLLM's "
                           "--vllm-arg=--kv-offloading-size=GIB")
    if not a["sim_fast_path"]:
        raise KvtraceError("--no-sim-fast-path is for --engine sim")
    if a["disable_hybrid_kv_cache_manager"]:
        raise KvtraceError("--disable-hybrid-kv-cache-manager: with --engine vllm, pass it to vLLM "
                           "(--vllm-arg=--disable-hybrid-kv-cache-manager)")
    if a["speculative_method"] is not None or a["num_speculative_tokens"]:
        raise KvtraceError("--speculative-method and --num-speculative-tokens are for --engine sim: with --engine vllm, "
                           "pass vLLM's --vllm-arg=speculative_config=JSON")
    refuse_unsupported(preemption_mode=a["preemption_mode"], preemption_policy=a["preemption_policy"],
                       kv_reserve=a["kv_reserve"], num_cpu_blocks=a["num_cpu_blocks"], swap_space=a["swap_space"],
                       device=a["device"], load_format=a["load_format"],
                       gpu_memory_utilization=a["gpu_memory_utilization"], n_mode=a["n_mode"])
    opts = VllmOptions(model=a["model"], dtype=a["dtype"], seed=a["seed"], block_size=a["block_size"],
                       num_gpu_blocks=a["num_gpu_blocks"], kv_cache_memory=a["kv_cache_memory"],
                       max_num_seqs=a["max_num_seqs"], max_num_batched_tokens=a["max_num_batched_tokens"],
                       max_model_len=a["max_model_len"], enable_prefix_caching=a["enable_prefix_caching"],
                       preemption_policy=a["preemption_policy"], watermark=a["watermark"],
                       long_prefill_token_threshold=a["long_prefill_token_threshold"],
                       enable_chunked_prefill=a["enable_chunked_prefill"], async_scheduling=a["async_scheduling"],
                       vllm_python=a["vllm_python"],
                       vllm_args=list(a["vllm_arg"] or []), self_check=a["self_check"])
    from kvtrace.record.run import default_run_dir, recording_console

    console = recording_console(a["quiet"])
    out = a["out"]
    run_dir = out or default_run_dir(Path(a["model"]).name)
    server = a["endpoint"] is not None
    if server and not (Path(a["capture_dir"]) / "capture.json").is_file():
        raise KvtraceError(f"--capture-dir {a['capture_dir']}: no capture.json — start the server with "
                           f"eval \"$(kvtrace vllm-env --capture-dir {a['capture_dir']})\" and kvtrace's --scheduler-cls")
    recording = VllmRecording(opts, a["workload"], run_dir, max_requests=a["max_requests"], time_scale=a["time_scale"],
                              backlog=a["backlog"], record_token_ids=not a["no_token_ids"],
                              command=" ".join(["kvtrace", *sys.argv[1:]]), console=console, server=server)
    if a["sweep_point"] is not None:
        recording.meta["sweep"] = json.loads(a["sweep_point"])
    if server:
        from kvtrace.vllm.client import record_endpoint

        with DeferredSignals() as signals:
            status = record_endpoint(recording, a["endpoint"], a["capture_dir"], timeout=a["request_timeout"],
                                     stop=signals.raise_pending)
    else:
        status = recording.run()
    recording.print_summary()
    if status == "interrupted":
        raise typer.Exit(code=130)
