"""Suite `model-ab`: decode steps of engine/model/llama.py at a git revision against the working tree's.

Both models run inside the same engine code on the same weights and prompts, one engine each, their
steps interleaved (4 steps of A, 4 of B, ...), so an engine change's effect is measured on the same
neighbours. Also says whether both generated the same greedy tokens.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from benchmarks.kvtrace_runner import KvtraceRunner, ensure_weights
from benchmarks.machine import REPO
from benchmarks.results import Section, markdown_table
from benchmarks.stats import fmt_ratio, median, ratios
from engine.sequence import SamplingParams

BLOCK_SIZE = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, help="git revision whose engine/model/llama.py is the baseline")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--repeats", type=int, default=6, help="rounds of 4 steps per model")
    parser.add_argument("--weights", type=Path, default=None)


def model_module(revision: str | None) -> types.ModuleType:
    """engine/model/llama.py at `revision` (None: the working tree) as a fresh module."""
    if revision is None:
        source = (REPO / "engine" / "model" / "llama.py").read_text()
    else:
        source = subprocess.run(["git", "show", f"{revision}:engine/model/llama.py"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
    name = f"_model_{'working_tree' if revision is None else revision.replace('~', '_').replace('^', '_')}"
    module = types.ModuleType(name)
    module.__file__ = str(Path(tempfile.gettempdir()) / f"{name}.py")
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def run(args: argparse.Namespace) -> None:
    weights = ensure_weights(args.weights)
    variants = {f"base ({args.base})": model_module(args.base), "working tree": model_module(None)}
    section = Section("model-ab")
    rows = []
    speedups = []
    loaded = None
    for batch in [int(b) for b in args.batches.split(",")]:
        max_len = args.context + 4 * args.repeats + 16
        engines = {}
        for name, module in variants.items():
            runner = KvtraceRunner(weights, block_size=BLOCK_SIZE, num_blocks=batch * -(-max_len // BLOCK_SIZE),
                                   max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.context),
                                   loaded=loaded)
            loaded = runner.loaded
            engine = runner.engine()
            engine.model = engine.runner.model = module.LlamaModel(engine.model_config, loaded.weights,
                                                                   engine.device, engine.model.dtype)
            rng = random.Random(batch)
            for i in range(batch):
                engine.add_request(str(i), [rng.randrange(17, 49_152) for _ in range(args.context)],
                                   SamplingParams(max_tokens=4 * args.repeats + 2, ignore_eos=True), arrival_s=0.0)
            engine.step()  # the prefill
            engine.step()
            engines[name] = engine
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                t0 = time.perf_counter()
                for _ in range(4):
                    engine.step()
                times[name].append((time.perf_counter() - t0) * 1000 / 4)
        (base_name, base), (new_name, new) = engines.items()
        same = all(base.outputs[(str(i), 0)].token_ids == new.outputs[(str(i), 0)].token_ids for i in range(batch))
        rows.append([str(batch), f"{median(times[base_name]):.1f}", f"{median(times[new_name]):.1f}",
                     fmt_ratio(ratios(times[base_name], times[new_name])), "yes" if same else "no"])
        speedups.append(f"batch {batch} {median(ratios(times[base_name], times[new_name])):.2f}×"
                        + ("" if same else " (tokens differ)"))
        print(f"  batch {batch}: {rows[-1]}", flush=True)
        del engines, base, new
    section.add(f"Decode steps after {args.context}-token prompts, SmolLM2-135M fp32, block size {BLOCK_SIZE}, "
                f"{torch.get_num_threads()} threads; {args.repeats} interleaved rounds of 4 steps per model.")
    section.add(markdown_table(["batch", f"base ({args.base}) ms/step", "working tree ms/step",
                                "speed-up (base / working tree)", "same greedy tokens"], rows))
    section.write(f"decode step, {args.base} / working tree: {', '.join(speedups)}")
