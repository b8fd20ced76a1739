"""`kvtrace calibrate`: fit the simulator's cost model to recorded runs (kvtrace/calibrate.py)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from kvtrace.cli.app import RUNS_HELP, app, user_errors


@app.command()
@user_errors
def calibrate(
    runs: Annotated[list[str], typer.Argument(help=RUNS_HELP)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile JSON to write (for record --engine sim --hardware).")],
    name: Annotated[str | None, typer.Option(help="The profile's name (default: the output file's stem).")] = None,
) -> None:
    """Fit the simulated engine's step cost model to the steps of recorded runs and report the fit's error.

    The runs must share one model and dtype; the profile predicts steps of that model on the machine
    that recorded them. See docs/simulation.md.
    """
    from kvtrace.atomic import atomic_write
    from kvtrace.calibrate import INTERFERENCE
    from kvtrace.calibrate import calibrate as fit

    profile, error = fit(runs, name or out.stem)
    with atomic_write(out) as f:
        f.write(json.dumps(asdict(profile), indent=2) + "\n")
    c = profile.coefficients
    typer.echo(f"fitted on {error['steps']} steps: step {c['step_ms']:.3g} ms + prefill {c['prefill_token_ms']:.3g} "
               f"ms/token + decode {c['decode_token_ms']:.3g} ms/token + KV {c['kv_token_ms']:.3g} ms/position")
    if error["stalled_steps"]:
        typer.echo(f"left out {error['stalled_steps']} step(s) that took over {INTERFERENCE:g}x their prediction "
                   "(stalled by other work on the machine, or warming up)")
    typer.echo(f"fit error: median {100 * error['median_step_error']:.1f}% per step, "
               f"p90 {100 * error['p90_step_error']:.1f}%, total {100 * error['total_error']:.2f}%, R² {error['r2']:.3f}")
    kinds = [f"{kind} {k['steps']} steps, median {100 * k['median_step_error']:.1f}%, bias {100 * k['bias']:+.1f}%"
             if k["steps"] else f"{kind}: none (the profile extrapolates to them)"
             for kind, k in error["by_kind"].items()]
    typer.echo("by kind of step: " + "; ".join(kinds))
    typer.echo(f"profile: {out}   use: kvtrace record --engine sim --hardware {out} ...")
    if "spec_acceptance_rate" in error:   # the runs drafted (speculative decoding)
        rate = error["spec_acceptance_rate"]
        typer.echo(f"speculative decoding: a draft accepted with chance {rate:.3f} when the drafts before it were "
                   f"(fitted on {error['spec_verifications']:,} verifications)   use: --spec-acceptance-rate {rate:.3f}")
