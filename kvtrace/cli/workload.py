"""`kvtrace workload synth | import | check`: make, import and check workload files."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from kvtrace.cli.app import user_errors, workload_app
from kvtrace.errors import KvtraceError
from kvtrace.workload.format import (
    WorkloadRequest,
    encode_text,
    load_workload,
    save_workload,
    validate_lengths,
    workload_sha256,
)
from kvtrace.workload.from_run import workload_from_run
from kvtrace.workload.importers import FORMATS, ImportOptions, import_trace
from kvtrace.workload.synth import PRESETS, SynthConfig, generate

OutOption = Annotated[Path | None, typer.Option("--out", "-o", help="Write here (atomically); default: stdout.")]
SeedOption = Annotated[int | None, typer.Option(help="Random seed; the same seed gives the same file.")]
ScaleOption = Annotated[float | None, typer.Option(help="Multiply every length by this (e.g. 0.2 for a CPU replay).")]


def _command_line(words: list[str], options: dict) -> str:
    """The command that reproduces this output, for the file's first comment line."""
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(["kvtrace", "workload", *words])


def _write(requests, out: Path | None, comments: list[str]) -> int:
    return save_workload(requests, out if out is not None else sys.stdout, comments=comments)


@workload_app.command("synth")
@user_errors
def synth(
    preset: Annotated[str | None, typer.Option(help=f"Start from a preset: {' | '.join(PRESETS)}.")] = None,
    num_requests: Annotated[int | None, typer.Option(help="Number of requests.")] = None,
    duration: Annotated[float | None, typer.Option(help="Seconds of arrivals (instead of or with --num-requests).")] = None,
    rate: Annotated[float | None, typer.Option(help="Mean arrival rate, requests (conversations) per second.")] = None,
    cv: Annotated[float | None, typer.Option(help="Burstiness: CV of inter-arrival gaps (gamma; 1 = Poisson, 0 = even).")] = None,
    backlog: Annotated[bool, typer.Option("--backlog", help="Everything arrives at t = 0.")] = False,
    prompt_median: Annotated[float | None, typer.Option(help="Median prompt length, log-normal [1000].")] = None,
    prompt_sigma: Annotated[float | None, typer.Option(help="Sigma of log prompt length [1.0].")] = None,
    output_median: Annotated[float | None, typer.Option(help="Median output length, log-normal [130].")] = None,
    output_sigma: Annotated[float | None, typer.Option(help="Sigma of log output length [0.9].")] = None,
    prompt_len: Annotated[int | None, typer.Option(help="Fixed prompt length instead.")] = None,
    output_len: Annotated[int | None, typer.Option(help="Fixed output length instead.")] = None,
    lengths_from: Annotated[Path | None, typer.Option(help="Resample (prompt, output) lengths from this workload.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Prompt + output must fit this [8192].")] = None,
    output_cap: Annotated[int | None, typer.Option(help="Longest output [2048].")] = None,
    prefix_groups: Annotated[int | None, typer.Option(help="Number of shared system prompts.")] = None,
    prefix_tokens: Annotated[int | None, typer.Option(help="Length of each shared system prompt.")] = None,
    turns: Annotated[int | None, typer.Option(help="Turns per conversation (prompts grow; explicit ids).")] = None,
    think_time: Annotated[float | None, typer.Option(help="Mean seconds between a conversation's turns [10].")] = None,
    scale: ScaleOption = None,
    seed: SeedOption = None,
    vocab_size: Annotated[int | None, typer.Option(help="Explicit ids (multi-turn) are drawn below this [32000].")] = None,
    out: OutOption = None,
) -> None:
    """Generate a production-like workload: log-normal lengths, Poisson or bursty arrivals,
    shared system prompts, multi-turn conversations."""
    given = dict(locals())
    if preset is not None and preset not in PRESETS:
        raise KvtraceError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)}")
    settings = dict(PRESETS.get(preset, {}))
    renamed = {"duration": "duration_s", "think_time": "think_time_s"}
    for name, value in given.items():
        if value is not None and value is not False and name not in ("preset", "out", "lengths_from"):
            settings[renamed.get(name, name)] = value
    if lengths_from is not None:
        settings["lengths_from"] = [(len(r.prompt_token_ids) if r.prompt_token_ids else r.prompt_tokens, r.max_tokens)
                                    for r in load_workload(lengths_from) if r.prompt is None]
    requests = generate(SynthConfig(**settings))
    count = _write(requests, out, [_command_line(["synth"], given)])
    span = requests[-1].arrival_s - requests[0].arrival_s
    typer.echo(f"wrote {count} requests over {span:.1f} s to {out or 'stdout'}", err=True)


@workload_app.command("import")
@user_errors
def import_(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help=f"Trace format: {' | '.join(FORMATS)}.")],
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The trace file (CSV, JSONL or JSON).")],
    start: Annotated[float | None, typer.Option(help="Skip this many seconds of the trace.")] = None,
    duration: Annotated[float | None, typer.Option(help="Keep this many seconds of the trace.")] = None,
    sample: Annotated[float | None, typer.Option(help="Keep each request with this probability (seeded).")] = None,
    max_requests: Annotated[int | None, typer.Option(help="Keep at most this many requests (the first ones).")] = None,
    time_scale: Annotated[float | None, typer.Option(help="Replay arrivals this many times faster.")] = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(help="Clip prompts to this many tokens.")] = None,
    max_output_tokens: Annotated[int | None, typer.Option(help="Clip outputs to this many tokens.")] = None,
    scale: ScaleOption = None,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals at this rate instead of the trace's times.")] = None,
    backlog: Annotated[bool, typer.Option("--backlog", help="Everything arrives at t = 0.")] = False,
    model: Annotated[str | None, typer.Option(help="sharegpt: tokenise with this model's tokenizer.")] = None,
    vocab_size: Annotated[int | None, typer.Option(help="mooncake: synthetic ids are drawn below this [32000].")] = None,
    seed: SeedOption = None,
    out: OutOption = None,
) -> None:
    """Import a public trace (Azure LLM inference, BurstGPT, Mooncake, ShareGPT) as a workload."""
    given = dict(locals())
    renamed = {"start": "start_s", "duration": "duration_s"}
    options = ImportOptions(**{renamed.get(name, name): value for name, value in given.items()
                               if name not in ("fmt", "file", "out") and value is not None})
    result = import_trace(fmt, file, options)
    command = _command_line(["import", fmt, str(file)], {k: v for k, v in given.items() if k not in ("fmt", "file")})
    _write(result.requests, out, [command, *result.comments])
    typer.echo(result.summary(str(file)), err=True)


@workload_app.command("from-run")
@user_errors
def from_run(
    run: Annotated[Path, typer.Argument(help="A run folder: kvtrace's engine, the simulator or a vLLM capture.")],
    out: OutOption = None,
    unfinished: Annotated[str, typer.Option(
        help="The output length of a request that never finished (in flight at a window's end): typical (the "
             "median of the finished, or what it had produced if more), seen (what it had produced) or "
             "max-tokens.")] = "typical",
) -> None:
    """A run's traffic as a workload: arrivals, prompt lengths, where each request stopped, priority, n,
    sampling, and the prompts' shared blocks as hash_ids at the run's block size; no token content. A
    window of live traffic keeps the requests in flight at its edges; the header says how (docs/sweep.md)."""
    result = workload_from_run(run, unfinished)
    command = ["kvtrace", "workload", "from-run", str(run), *(["--unfinished", unfinished] if unfinished != "typical" else [])]
    _write(result.requests, out, [shlex.join(command), *result.comments(run)])
    typer.echo(result.summary(run, str(out or "stdout")), err=True)


def _percentiles(values: list[int]) -> str:
    if not values:
        return "-"
    median, p90 = np.percentile(values, [50, 90])
    return f"median {median:.0f}, p90 {p90:.0f}"


def _prompt_lengths(requests: list[WorkloadRequest], model: str | None) -> list[int | None]:
    """Prompt lengths; text prompts need `model`'s tokenizer, else None."""
    tokenizer = None
    if model is not None and any(r.prompt is not None for r in requests):
        try:
            from engine.model.tokenizer import load_tokenizer
        except ImportError as exc:
            raise KvtraceError(f"cannot load a tokenizer: {exc}") from None
        tokenizer = load_tokenizer(model)
    lengths: list[int | None] = []
    for r in requests:
        if r.prompt is not None:
            lengths.append(len(encode_text(tokenizer, r.prompt)) if tokenizer is not None else None)
        else:
            lengths.append(r.prompt_tokens or len(r.prompt_token_ids))
    return lengths


@workload_app.command("check")
@user_errors
def check(
    file: Annotated[Path, typer.Argument(help="The workload file (JSONL).")],
    model: Annotated[str | None, typer.Option(help="Tokenise text prompts with this model's tokenizer.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Fail if a prompt leaves no room in this context.")] = None,
) -> None:
    """Validate a workload file and summarise it: lengths, arrival rate, burstiness."""
    requests = load_workload(file)
    lengths = _prompt_lengths(requests, model)
    known = [(r, n) for r, n in zip(requests, lengths) if n is not None]
    if max_model_len is not None:
        validate_lengths([r for r, _ in known], [n for _, n in known], max_model_len)
    arrivals = np.array([r.arrival_s for r in requests])
    span = arrivals[-1] - arrivals[0]
    gaps = np.diff(arrivals)
    rate = f"{(len(requests) - 1) / span:.2f} req/s" if span > 0 else "all at once"
    cv = f"{gaps.std() / gaps.mean():.2f}" if len(gaps) >= 2 and gaps.mean() > 0 else "-"
    outputs = [r.max_tokens for r in requests]
    num_text = len(requests) - len(known)
    groups = {r.prefix_group for r in requests if r.prefix_group is not None}
    typer.echo(f"{file}: {len(requests)} requests, sha256 {workload_sha256(file)[:16]}")
    typer.echo(f"arrivals: {arrivals[0]:.1f} to {arrivals[-1]:.1f} s, {rate}, inter-arrival CV {cv}")
    typer.echo(f"prompt tokens: {_percentiles([n for _, n in known])}, total {sum(n for _, n in known)}"
               + (f" ({num_text} text prompts not counted: give --model)" if num_text else ""))
    typer.echo(f"output tokens (max_tokens): {_percentiles(outputs)}, total {sum(outputs)}")
    if groups:
        typer.echo(f"prefix groups: {len(groups)}, over {sum(r.prefix_group is not None for r in requests)} requests")
    hashed = [r for r in requests if r.hash_ids]
    if hashed:
        blocks = [(r.hash_block_size, h) for r in hashed for h in r.hash_ids]
        sizes = ", ".join(str(size) for size in sorted({r.hash_block_size for r in hashed}))
        typer.echo(f"block hashes: {len(hashed)} requests, {len(set(blocks))} distinct blocks of {sizes} tokens, "
                   f"{len(blocks) - len(set(blocks))} repeat an earlier request's")
