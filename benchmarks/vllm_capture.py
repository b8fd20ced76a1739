"""Suite `vllm-capture`: what recording costs vLLM (issue 13's goal: at most 2 % with 64 running).

Two vLLM engines (its CPU build, the venv of scripts/vllm_env.sh or --vllm-python) serve the same
workload, one with kvtrace's capture scheduler and one with vLLM's own, each started once; the
replays alternate between them (plain, captured, plain, ...), each from a cold prefix cache, so a
slow spell of the machine falls on both. Reported: every replay's wall time, the median of each,
their ratio, and the capture's own time in its step hooks per step (from the capture's done.json;
the block-pool wrappers it also adds are inside the end-to-end ratio).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.results import Section, markdown_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=os.environ.get("KVTRACE_VLLM_PYTHON"),
                        help="Python of the vLLM venv (default: $KVTRACE_VLLM_PYTHON)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=48, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=4, help="replays per engine, alternating")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    parser.add_argument("--a-a", action="store_true", help="a control: neither engine captures (how different "
                                                            "two plain engines measure)")


class Engine:
    def __init__(self, python: str, config: dict, folder: Path, capture: bool) -> None:
        from kvtrace.vllm.record import capture_path

        self.folder = folder
        path = folder / "config.json"
        path.write_text(json.dumps({**config, "capture": capture, "interactive": True,
                                    "capture_dir": str(folder / "capture"), "results": str(folder / "results.json")}))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(capture_path())
        self.log = open(folder / "vllm.log", "w")
        self.proc = subprocess.Popen([python, "-m", "kvtrace.vllm.capture.driver", str(path)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM did not start: see {folder / 'vllm.log'}")
        self.startup_s = json.loads(line)["startup_s"]

    def replay(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def run(args: argparse.Namespace) -> None:
    if not args.vllm_python:
        raise SystemExit("vllm-capture: give --vllm-python (the Python of a vLLM venv; scripts/vllm_env.sh builds one)")
    from kvtrace.vllm.record import model_folder

    folder = Path(tempfile.mkdtemp(prefix="kvtrace-vllm-capture-"))
    rng = random.Random(0)
    requests = folder / "requests.jsonl"
    requests.write_text("".join(json.dumps({"index": i, "arrival_s": 0.0, "max_tokens": args.output,
                                            "ignore_eos": True,
                                            "prompt_token_ids": [rng.randrange(17, 49152) for _ in range(args.prompt)]})
                                + "\n" for i in range(args.requests)))
    engine_args = {"dtype": "float32", "seed": 0, "block_size": 32, "max_model_len": args.prompt + args.output,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.3,
                   "num_gpu_blocks_override": 1 + args.requests * ((args.prompt + args.output + 31) // 32)}
    if args.eager:
        engine_args["enforce_eager"] = True
    config = {"model": str(model_folder("smollm2-135m")), "engine_args": engine_args, "requests": str(requests)}
    (folder / "plain").mkdir()
    (folder / "captured").mkdir()
    engines = {"plain": Engine(args.vllm_python, config, folder / "plain", capture=False),
               "captured": Engine(args.vllm_python, config, folder / "captured", capture=not args.a_a)}
    times: dict[str, list[float]] = {"plain": [], "captured": []}
    tokens = preemptions = None
    try:
        engines["plain"].replay()       # a warm-up replay each, not counted
        engines["captured"].replay()
        for i in range(args.repeats):   # ABBA: neither engine always goes first
            order = list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]
            for name, engine in order:
                answer = engine.replay()
                times[name].append(answer["duration_s"])
                tokens, preemptions = answer["output_tokens"], answer["num_preemptions"]
    finally:
        for engine in engines.values():
            engine.close()
    done_path = folder / "captured" / "capture" / "done.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {"hook_s": 0.0, "steps": 0, "events": 0}
    plain, captured = statistics.median(times["plain"]), statistics.median(times["captured"])
    section = Section("vllm-capture")
    if args.a_a:
        section.add("**A/A control: the 'captured' engine does not capture here.**")
    section.add(f"vLLM {args.requests} requests ({args.prompt} prompt + {args.output} output tokens, all at once), "
                f"{args.max_num_seqs} running at most, {tokens} tokens and {preemptions} preemptions a replay; "
                f"{'enforce_eager' if args.eager else 'compiled (vLLM default)'}; SmolLM2-135M fp32, CPU build. "
                f"Replays alternate between the two engines, {args.repeats} each after one warm-up.")
    rows = [[name, " ".join(f"{t:.2f}" for t in times[name]), f"{statistics.median(times[name]):.2f}"]
            for name in times]
    section.add(markdown_table(["engine", "each replay s", "median s"], rows))
    per_step_us = 1e6 * done["hook_s"] / max(done["steps"], 1)
    paired = statistics.median(c / p for p, c in zip(times["plain"], times["captured"]))
    section.add(f"Recording costs **{100 * (captured / plain - 1):+.1f} %** of the replay's wall time (median "
                f"captured / median plain = {captured / plain:.3f}; median of the {args.repeats} paired rounds' "
                f"ratios = {paired:.3f}; goal ≤ 2 %). The capture's step hooks took "
                f"{per_step_us:.0f} µs per step ({done['steps']} steps, {done['events']} KV events over every "
                f"replay, warm-up included).")
    workload = f"{args.requests} requests, {args.max_num_seqs} running"
    if args.a_a:
        section.write(f"A/A control, neither engine captures: the second engine took "
                      f"{100 * (captured / plain - 1):+.1f} % of the first's replay time ({workload})")
    else:
        section.write(f"recording costs {100 * (captured / plain - 1):+.1f} % of vLLM's replay time ({workload}); "
                      f"goal ≤ 2 %: {'met' if captured / plain <= 1.02 else 'missed'}")
