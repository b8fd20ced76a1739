"""`kvtrace calibrate`: fit the simulator's cost model (engine/sim/cost_model.py) to recorded runs.

The rows come from analyses/step_costs.sql: each step's composition and its period (start to next
start, host work included). A step costs

    period_ms - swap_ms  =  step_ms + prefill_token_ms * prefill + decode_token_ms * decode + kv_token_ms * kv

fitted by least squares on relative error (each step's row divided by its period, so a 30 ms decode
step weighs as much as a 600 ms prefill: latency percentiles are made of the many small steps) with
every coefficient kept >= 0 (a negative cost would make a bigger step cheaper); the roofline's weights term is folded into step_ms (weights_ms = 0) and prefill attention
into the per-token terms (attention_pair_ms = 0), since a trace records neither separately. Swaps are
fitted on their own, `swap_ms + bytes * swap_byte_ms`, from the steps that swapped.

Runs that draft (speculative decoding: a capture of a server that drafts) also give the simulator's
acceptance model its rate (`fit_acceptance_rate`, spec_decode.sql's acceptance_rate): the chance a
draft is accepted when the drafts before it were, fitted by maximum likelihood on every verification.

A step that took more than INTERFERENCE times what the fit predicts is left out and the fit redone
(until none is): on a shared machine another process can stall a step tenfold, and a least-squares
fit on relative error would spread those few stalls over every coefficient. No composition costs
twice what a linear fit of its neighbours says; a warm-up step or a neighbour's burst does. The
error is reported on the steps kept, by kind of step, with the number left out.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engine.sim.cost_model import COEFFICIENTS, HardwareProfile
from kvtrace.errors import KvtraceError
from kvtrace.trace import db

FEATURES = ("prefill_tokens", "decode_tokens", "kv_tokens")
FITTED = ("step_ms", "prefill_token_ms", "decode_token_ms", "kv_token_ms")
DEFAULT_SWAP_GB_S = 10.0   # when no calibration run swapped: a host copy at 10 GB/s, said so in the profile
INTERFERENCE = 2.0         # a step this many times slower than predicted was stalled by something else


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit until none is."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            return coef
        del active[int(np.argmin(solution))]
    return coef


def fit_error(predicted: np.ndarray, actual: np.ndarray, prefill: np.ndarray, decode: np.ndarray) -> dict:
    """How well predictions match: per step, in total, and per kind of step (decode only, prefill only,
    prefill + decode)."""
    signed = (predicted - actual) / np.maximum(actual, 1e-9)
    relative = np.abs(signed)
    residual = ((actual - predicted) ** 2).sum()
    spread = ((actual - actual.mean()) ** 2).sum()
    by_kind = {}
    for kind, member in (("decode only", prefill == 0), ("prefill only", (prefill > 0) & (decode == 0)),
                         ("prefill + decode", (prefill > 0) & (decode > 0))):
        # bias: the median signed error; a kind the fit over- or under-predicts as a whole
        by_kind[kind] = {"steps": int(member.sum()),
                         "median_step_error": float(np.median(relative[member])) if member.any() else None,
                         "bias": float(np.median(signed[member])) if member.any() else None}
    return {"steps": int(len(actual)),
            "median_step_error": float(np.median(relative)),
            "p90_step_error": float(np.quantile(relative, 0.9)),
            "total_error": float(abs(predicted.sum() - actual.sum()) / actual.sum()),
            "r2": float(1 - residual / spread) if spread > 0 else 1.0,
            "by_kind": by_kind}


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fit_acceptance_rate(runs: list[str | Path]) -> tuple[float, int] | None:
    """(the acceptance rate, the verifications it is fitted on) of the runs' drafts, every run's together;
    None if no run drafted (engine/spec_decode.py's model: a step accepts j of k drafts with chance
    rate^j (1 - rate), all k with rate^k; the likelihood's maximum is accepted / (accepted + rejections))."""
    con = db.connect(runs)
    accepted, rejections, verifications = con.sql(
        "SELECT sum(accepted_tokens), count(*) FILTER (WHERE accepted_tokens < draft_tokens), count(accepted_tokens) "
        "FROM spec_decode").fetchall()[0]
    if not verifications or not accepted and not rejections:
        return None
    return accepted / (accepted + rejections), verifications


def calibrate(runs: list[str | Path], name: str) -> tuple[HardwareProfile, dict]:
    """A profile fitted to the runs' steps, and its fit error."""
    con = db.connect(runs)
    info = con.sql("SELECT count(DISTINCT model), any_value(model), count(DISTINCT coalesce(dtype, '')), any_value(dtype), "
                   "any_value(device), any_value(device_type), list(run_id ORDER BY ordinal) FROM runs").fetchall()[0]
    num_models, model, num_dtypes, dtype, device, device_type, run_ids = info
    if num_models != 1 or num_dtypes != 1:
        raise KvtraceError("calibrate: the runs must share one model and dtype (a profile is fitted per model)")
    if device_type == "sim":
        raise KvtraceError("calibrate: these are simulated runs; calibrate on runs of a real engine")
    rows = db.run_analysis(con, "step_costs").to_pydict()
    period = np.array([p if p is not None else np.nan for p in rows["period_ms"]], dtype=float)
    swap_ms = np.array([m if m is not None else 0.0 for m in rows["swap_ms"]], dtype=float)
    usable = ~np.isnan(period)
    if usable.sum() < len(FITTED) * 3:
        raise KvtraceError(f"calibrate: {int(usable.sum())} steps with a measured period; need at least "
                           f"{len(FITTED) * 3} (record longer runs)")
    x = np.column_stack([np.ones(len(period))] + [np.array(rows[f], dtype=float) for f in FEATURES])[usable]
    y = (period - swap_ms)[usable]
    weight = 1.0 / np.maximum(y, 1e-3)[:, None]
    kept = np.ones(len(y), dtype=bool)
    while True:
        coef = nonnegative_lstsq(x[kept] * weight[kept], y[kept] * weight[kept, 0])
        stalled = y > INTERFERENCE * (x @ coef)
        if not (stalled & kept).any() or (~stalled).sum() < len(FITTED) * 3:
            break
        kept &= ~stalled
    error = fit_error(x[kept] @ coef, y[kept], x[kept, 1], x[kept, 2])   # columns 1, 2: prefill, decode tokens
    error["stalled_steps"] = int((~kept).sum())
    coefficients = dict(zip(FITTED, map(float, coef)))
    coefficients.update(weights_ms=0.0, attention_pair_ms=0.0)

    swap_bytes = np.array(rows["swap_bytes"], dtype=float)
    swapped = swap_bytes > 0
    swap_note = "fitted"
    if swapped.sum() >= 2:
        intercept, per_byte = nonnegative_lstsq(np.column_stack([np.ones(swapped.sum()), swap_bytes[swapped]]),
                                                swap_ms[swapped])
    else:
        intercept, per_byte = 0.0, 1e3 / (DEFAULT_SWAP_GB_S * 1e9)
        swap_note = f"not fitted (no calibration run swapped): {DEFAULT_SWAP_GB_S:g} GB/s assumed"
    coefficients.update(swap_ms=float(intercept), swap_byte_ms=float(per_byte))
    coefficients["copy_byte_ms"] = float(per_byte)   # a block copy at host-copy speed (CPU) — small either way
    assert set(coefficients) == set(COEFFICIENTS)
    profile = HardwareProfile(
        name=name, memory_bytes=host_memory_bytes() if device_type == "cpu" else 0, peak_flops={},
        memory_bytes_s=0.0, host_bytes_s=0.0, coefficients=coefficients,
        source=f"kvtrace calibrate on {len(run_ids)} run(s) of {model} ({dtype}) on {device}",
        fitted_on={"runs": run_ids, "model": model, "dtype": dtype, "device": device, "swap": swap_note,
                   "error": error})
    drafting = fit_acceptance_rate(runs)
    if drafting is not None:   # the traffic's, not the hardware's: reported beside the profile
        error["spec_acceptance_rate"], error["spec_verifications"] = drafting
    return profile, error
