"""Suite `vllm-capture-cost`: what the capture adds to each step of vLLM's real scheduler (issue 29's goal: ≤ 1 ms at 1,024 running, growing no faster than the running count).

No model: two schedulers of kvtrace's capture class (`KvtraceCaptureScheduler`, no self-check), one
capturing and one whose capture stepped aside ("plain": vLLM's own code, run through the class), are
built in a vLLM venv as vLLM's scheduler unit tests build them, side by side in one process (one
class, as in a server: the driver's docstring says what two classes would cost the benchmark), each
with the same `N` running requests (distinct prompts, a long max_tokens, a pool that holds them
all); their decode steps (schedule, a placeholder model output, update_from_output) alternate plain,
captured, plain, ... (benchmarks/vllm_capture_cost_driver.py). Both schedulings (`--scheduling`):
vLLM's Scheduler, and its AsyncScheduler stepped as the engine core's batch queue steps it (schedule
a step, then process the one before's output). Reported per scheduling and N: the median step time
of each, the difference (what the capture adds, its block-pool wrappers included), the same
difference in CPU time (the driver thread's: on a shared machine, what other processes take of the
cores is not in it), the capture's own hook time per step, and the bytes its chunks take per step;
and the bytes per hour at a stated load (`--rate` requests/s of `--output-tokens` tokens each, from
the bytes per generated token at full batches, steps' and KV events' rows included), so that
KVTRACE_CAPTURE_MAX_BYTES can be chosen. The server's shape: `--kv-cache-groups` (a hybrid model's
groups), `--spec-tokens` (draft tokens a step), `--offload-chunks` (a host KV tier behind the pool:
vLLM's OffloadingConnector, its worker stood in for). `--forward-ms` stands in for the model's
forward (each step sleeps that long between its scheduling and its output, the GIL released, as
while a GPU computes): the capture builds its columns on a thread of its own (sink.py), which on a
server works while the engine waits for the forward; without one (0, the default) that thread's work
competes with the very steps measured. The builder thread's CPU time per step is reported beside the
hooks', so that the capture's whole CPU cost is in the table either way.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from benchmarks.results import Section, markdown_table

DRIVER = Path(__file__).with_name("vllm_capture_cost_driver.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=os.environ.get("KVTRACE_VLLM_PYTHON"),
                        help="Python of a vLLM venv (default: $KVTRACE_VLLM_PYTHON)")
    parser.add_argument("--sizes", default="64,256,1024,4096", help="running requests, comma-separated")
    parser.add_argument("--scheduling", default="sync,async",
                        help="vLLM's Scheduler (sync), its AsyncScheduler (async), or both, comma-separated")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed decode steps per scheduler (enough for several full collections)")
    parser.add_argument("--warmup", type=int, default=10, help="decode steps before timing")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every size, interleaved (64, 256, ..., 64, 256, ...); medians over them")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s for the bytes-per-hour figure")
    parser.add_argument("--output-tokens", type=int, default=256, help="output tokens per request, ditto")
    parser.add_argument("--flush-every", type=float, default=None,
                        help="seconds between the capture's chunks (KVTRACE_CAPTURE_FLUSH_EVERY; default its 2 s)")
    parser.add_argument("--slow-write", type=float, default=None,
                        help="a slow volume: every chunk's write takes this many seconds (the writer thread waits; "
                             "a step never should)")
    parser.add_argument("--kv-cache-groups", default="full",
                        help="the model's KV-cache groups, comma-separated: full, sliding (a 4-block window), chunked, "
                             "mamba; full,sliding is a hybrid model such as Gemma 3")
    parser.add_argument("--forward-ms", type=float, default=0.0,
                        help="a stand-in for the model's forward: each step sleeps this long between its scheduling "
                             "and its output (the GIL released, as while a GPU computes); 0: none")
    parser.add_argument("--spec-tokens", type=int, default=0,
                        help="draft tokens a step (speculative decoding with a draft model's config: as many "
                             "lookahead slots); 0: none")
    parser.add_argument("--offload-chunks", type=int, default=0,
                        help="a host KV tier of this many chunks (a block each) behind the pool: vLLM's "
                             "OffloadingConnector on the scheduler, its worker stood in for; 0: no connector")
    parser.add_argument("--no-write", action="store_true", help="print the report only (RESULTS.md untouched)")


def measure(python: str, running: int, args: argparse.Namespace, asynchronous: bool = False,
            slow_write: float | None = None) -> dict:
    from kvtrace.vllm.record import capture_path, model_folder

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(capture_path())
    opts = {"running": running, "steps": args.steps, "warmup": args.warmup, "prompt": args.prompt,
            "block_size": args.block_size, "async": asynchronous, "flush_s": args.flush_every,
            "slow_write_s": slow_write, "kv_cache_groups": args.kv_cache_groups.split(","),
            "spec_tokens": args.spec_tokens, "offload_chunks": args.offload_chunks, "forward_ms": args.forward_ms}
    proc = subprocess.run([python, str(DRIVER), str(model_folder("smollm2-135m")), json.dumps(opts)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode or not proc.stdout.strip():
        raise SystemExit(f"vllm-capture-cost: the driver failed at {running} running:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> None:
    if not args.vllm_python:
        raise SystemExit("vllm-capture-cost: give --vllm-python (the Python of a vLLM venv; scripts/vllm_env.sh)")
    section = Section("vllm-capture-cost")   # now: its commit and load are those of the start
    sizes = [int(s) for s in args.sizes.split(",")]
    schedulings = [s.strip() for s in args.scheduling.split(",")]
    if not schedulings or set(schedulings) - {"sync", "async"}:
        raise SystemExit(f"vllm-capture-cost: --scheduling takes sync, async or both, not {args.scheduling!r}")
    disks = [None, args.slow_write] if args.slow_write else [None]   # a slow volume beside the fast one, interleaved
    cases = [(mode, n, disk) for mode in schedulings for n in sizes for disk in disks]
    # per case, one dict per run: plain and captured medians, what the capture added (wall and CPU),
    # its hooks and bytes per step
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    version = "?"
    for _ in range(max(1, args.repeats)):   # interleaved: a load that changes meets every case alike
        for mode, n, disk in cases:
            m = measure(args.vllm_python, n, args, asynchronous=mode == "async", slow_write=disk)
            version = m["vllm_version"]
            if m["running"] != {"plain": n, "captured": n}:
                raise SystemExit(f"vllm-capture-cost: not all {n} requests ran ({mode}): {m['running']}")
            plain, captured = statistics.median(m["times"]["plain"]), statistics.median(m["times"]["captured"])
            cpu = {name: statistics.median(m["cpu_times"][name]) for name in ("plain", "captured")}
            steps = len(m["times"]["captured"])
            mean = {name: statistics.mean(m["times"][name]) for name in ("plain", "captured")}
            gc_s = m["gc_s"]
            runs[mode, n, disk].append({"plain": plain, "captured": captured, "added": captured - plain,
                                  "added_mean": mean["captured"] - mean["plain"],
                                  "gc_plain": gc_s["plain"] / steps, "gc_captured": gc_s["captured"] / steps,
                                  "added_cpu": cpu["captured"] - cpu["plain"],
                                  "hooks": m["hook_s"] / steps, "build": m.get("build_s", 0.0) / steps,
                                  "bytes": m["bytes"] / steps,
                                  "chunks": m.get("chunks", 0), "dropped": m.get("dropped", 0)})
    rows = []
    added: dict[tuple, float] = {}   # what the capture adds per step, per (mode, n, disk)
    added_mean: dict[tuple, float] = {}
    per_token_bytes = []             # on the fast disk
    for mode, n, disk in cases:
        case_runs = runs[mode, n, disk]
        med = {key: statistics.median(run[key] for run in case_runs) for key in case_runs[0]}
        added[mode, n, disk] = med["added"]
        added_mean[mode, n, disk] = med["added_mean"]
        if disk is None:
            per_token_bytes.append(med["bytes"] / n)
        spread = (f" ({min(r['added'] for r in case_runs) * 1e3:+.3f} to "
                  f"{max(r['added'] for r in case_runs) * 1e3:+.3f})" if len(case_runs) > 1 else "")
        rows.append([mode, f"{n:,}", "fast" if disk is None else f"{disk:g} s writes", f"{med['plain'] * 1e3:.3f}",
                     f"{med['captured'] * 1e3:.3f}", f"{med['added'] * 1e3:+.3f}{spread}",
                     f"{med['added_mean'] * 1e3:+.3f}", f"{med['gc_plain'] * 1e3:.3f} / {med['gc_captured'] * 1e3:.3f}",
                     f"{med['added_cpu'] * 1e3:+.3f}", f"{med['added'] / n * 1e6:+.2f}", f"{med['hooks'] * 1e3:.3f}",
                     f"{med['build'] * 1e3:.3f}",
                     f"{med['bytes']:,.0f}", f"{med['chunks']:.0f} / {med['dropped']:.0f}"])
    repeats = len(runs[cases[0]])
    section.add(f"vLLM {version}'s Scheduler (sync) and AsyncScheduler (async, batch-queue steps) without a model, "
                f"decode steps of N running requests ({args.prompt}-token prompts, block size {args.block_size}, "
                f"every request running"
                + (f"; KV-cache groups {args.kv_cache_groups}" if args.kv_cache_groups != "full" else "")
                + (f"; {args.spec_tokens} draft tokens a step" if args.spec_tokens else "")
                + (f"; a host KV tier of {args.offload_chunks:,} blocks (vLLM's OffloadingConnector, its worker "
                   "stood in for: copies finish in the next step)" if args.offload_chunks else "")
                + (f"; **a {args.forward_ms:g} ms forward stood in for** (a sleep between each step's scheduling and "
                   "its output)" if args.forward_ms else "")
                + f"), plain (the capture class, its capture stepped aside) and captured alternating, "
                f"{args.steps} timed steps each after "
                f"{args.warmup}; medians of per-step time (CPU: the driver thread's; 'added, means': the "
                "difference of the mean steps, which holds what a chunk write or a collection adds; GC: the "
                "cyclic collector's time inside each one's timed steps, per step)"
                + (f", then the median of {repeats} interleaved runs (added: its range over them)." if repeats > 1
                   else ".")
                + (f" Chunks every {args.flush_every:g} s." if args.flush_every else "")
                + (f" **A slow volume: every chunk's write takes {args.slow_write:g} s** (the writer thread's wait; "
                   "a full queue drops whole chunks)." if args.slow_write else ""))
    section.add(markdown_table(["scheduling", "running", "disk", "plain ms/step", "captured ms/step", "added ms/step",
                                "added, means", "GC ms/step, plain / captured", "added CPU ms/step",
                                "added µs per running", "capture hooks ms/step", "builder thread CPU ms/step",
                                "bytes/step", "chunks written / dropped"], rows))
    bytes_per_token = statistics.median(per_token_bytes)
    per_hour = 3600 * args.rate * args.output_tokens * bytes_per_token
    section.add(f"The capture writes about {bytes_per_token:.1f} bytes per generated token (median over the sizes; "
                f"token, step and KV-event rows, in the chunk format, compressed): at {args.rate:g} requests/s of {args.output_tokens} "
                f"output tokens that is **{per_hour / 1e9:.2f} GB per hour** ({per_hour * 24 / 1e9:.1f} GB a day).")
    target = 1024 if 1024 in sizes else sizes[-1]
    parts, met = [], True
    for mode in schedulings:
        linear = added[mode, sizes[-1], None] / sizes[-1] <= 1.5 * max(added[mode, sizes[0], None] / sizes[0], 1e-7)
        met = met and added[mode, target, None] <= 1e-3 and linear
        others = ", ".join(f"{added[mode, n, None] * 1e3:+.3f} ms at {n:,}" for n in sizes if n != target)
        parts.append(f"{mode} {added[mode, target, None] * 1e3:+.3f} ms per step at {target:,} running "
                     f"(mean {added_mean[mode, target, None] * 1e3:+.3f}{f'; {others}' if others else ''})")
    forward = f" beside a {args.forward_ms:g} ms forward" if args.forward_ms else ""
    headline = (f"the capture adds{forward} {'; '.join(parts)}; goal ≤ 1 ms at 1,024 and no faster than the running count: "
                f"{('met' if met else 'missed') if target == 1024 else 'not measured'}")
    if args.slow_write:   # what the capture adds on a slow volume against on a fast one (issue 60: ≤ 1 ms); each
        # against its own plain scheduler, stepped alternately in the same process: separate processes' step
        # times differ by more than that
        slower = {mode: added[mode, target, args.slow_write] - added[mode, target, None] for mode in schedulings}
        headline += (f"; with every chunk's write taking {args.slow_write:g} s what it adds changes by "
                     + ", ".join(f"{d * 1e3:+.3f} ms ({mode})" for mode, d in slower.items())
                     + f" at {target:,} running (goal ≤ 1 ms: {'met' if all(d <= 1e-3 for d in slower.values()) else 'missed'})")
    if args.no_write:
        print(headline)
    else:
        section.write(headline)
