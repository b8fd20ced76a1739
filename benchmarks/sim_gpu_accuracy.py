"""Suite `sim-gpu-accuracy`: the simulator's GPU step times against Vidur's published GPU measurements.

Vidur (github.com/microsoft/vidur) publishes operator timings measured on A100 and H100 GPUs for
Llama-family models (benchmarks/data/vidur/, with source and licence): one decoder layer, fp16, one GPU,
in ms per layer. This suite prices the same work with kvtrace's cost model (engine/sim/cost_model.py)
on the matching shipped profile (`a100` → `a100-80gb`, `h100` → `h100-sxm`) and reports the relative
error by kind, with each kind's median and p90 of |predicted − measured| / measured and its bias (the
median signed error). What is compared, like with like:

- **layer, attention kernel excepted** (Vidur's MLP table): the sum of the layer's operations, as Vidur
  composes a block (norms, fused QKV projection, rope, output projection, gate/up projection, SiLU,
  down projection, one residual add), against the cost model's price of N tokens without attention,
  `forward_ms(N, 0, 0, 0)` less the host's overhead, of a model without embedding and LM head (which
  Vidur does not time), divided by the number of layers. N tokens cost the same whether they are a prefill chunk or a decode
  batch: the kinds are token-count ranges.
- **attention, decode** (A100, Llama-2-7B): `attn_decode` for a batch of B sequences with C cached tokens
  each, against `kv_token_ms · B · (C + 1)` per layer.
- **attention, prefill**: `attn_prefill` for a chunk of n tokens after s cached ones, against
  `kv_token_ms · (s + n) + attention_pair_ms · n · (s + (n + 1) / 2)` per layer.
- **step** (A100, Llama-2-7B): a whole forward's GPU time composed from the two tables, the layers' count
  times (the layer's MLP-table time for the step's tokens + its attention kernel), against
  `forward_ms` of that model less the host's overhead (the sum done by the cost model itself).

The host's overhead (`step_overhead_ms`: scheduling, launches, sampling) is left out of every
comparison: Vidur's tables time GPU kernels only. The rest of `step_ms`, `layer_overhead_ms` per layer,
is device time and stays in. `--fit` fits the profiles' factors to the same data (`fit`).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results import Section, markdown_table
from engine.config import PRESETS, ModelConfig
from engine.sim.cost_model import CostModel, HardwareProfile, load_profile

DATA = Path(__file__).resolve().parent / "data" / "vidur"
DTYPE = "float16"   # Vidur profiles in fp16
GOAL = 0.10         # median |error| of every kind, each shipped profile
PROFILES = {"a100": "a100-80gb", "h100": "h100-sxm"}
# Vidur's model folders -> the shape kvtrace prices (Hugging Face config.json figures)
MODELS: dict[str, ModelConfig] = {
    "Llama-2-7b-hf": ModelConfig(name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                 num_layers=32, num_heads=32, num_kv_heads=32),
    "Meta-Llama-3-8B": PRESETS["llama-3-8b"],
    "Llama-2-70b-hf": ModelConfig(name="llama-2-70b", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                                  num_layers=80, num_heads=64, num_kv_heads=8),
    "Meta-Llama-3-70B": ModelConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192,
                                    intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
}
# the kinds in the order the table shows them, and the token ranges of the layer comparison
LAYER_RANGES = ((1, 64, "layer, 1–64 tokens (decode-sized, weights-bound)"), (65, 512, "layer, 65–512 tokens"),
                (513, 4096, "layer, 513–4,096 tokens (prefill-sized)"), (4097, 1 << 30, "layer, 4,097–32,768 tokens"))
DECODE_FILLS = "attention, decode, ≥ 32 sequences of ≥ 128 tokens"
DECODE_SMALL = "attention, decode, fewer sequences or shorter"
PREFILL_SHORT, PREFILL_LONG = "attention, prefill, ≤ 128 tokens", "attention, prefill, > 128 tokens"
KINDS = [label for *_, label in LAYER_RANGES] + [DECODE_SMALL, DECODE_FILLS, PREFILL_SHORT, PREFILL_LONG,
                                                 "step, decode", "step, prefill"]
# known misses of the cost model's form, shown but left out of the goal (docs/simulation.md says why): the
# KV term is bandwidth-bound and the pair term compute-bound, and these kernels are neither
EXCEPTIONS = {
    DECODE_SMALL: "too few (sequence, head) blocks to fill the GPU: a fixed 0.01–0.1 ms per layer",
    PREFILL_SHORT: "a short chunk's kernel is launch-bound: 0.015 ms per layer for 96 tokens with no cache",
    PREFILL_LONG: "the kernel's time is not proportional to query-key pairs (1,920 tokens: 0.70 ms with no "
                  "cache, 0.95 ms after 1,280 cached, 2.3× the pairs)",
}


@dataclass(frozen=True)
class Comparison:
    device: str        # Vidur's folder: a100, h100
    model: str         # Vidur's model folder
    kind: str
    what: str          # the measured point, e.g. "N=512" or "B=32 C=1024"
    measured_ms: float
    predicted_ms: float

    @property
    def error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def layers_only(mc: ModelConfig) -> ModelConfig:
    """The model without embedding and LM head (vocabulary 0): the part Vidur's tables time."""
    return dataclasses.replace(mc, vocab_size=0, tie_word_embeddings=True)


@functools.cache
def _read(path: Path) -> tuple[dict[str, str], ...]:
    with path.open() as f:
        return tuple(csv.DictReader(f))


def read_rows(path: Path, every: int = 1) -> list[dict[str, str]]:
    return list(_read(path))[::every]


def layer_ms(row: dict[str, str]) -> float:
    """One MLP-table row's layer time: the sum of its operations' medians."""
    return sum(float(v) for k, v in row.items() if k != "num_tokens")


def compare(device: str, model: str, every: int = 1, profile: HardwareProfile | None = None) -> list[Comparison]:
    """Every measured point of one device and model, predicted with `profile` (default: the shipped one).
    `every` keeps one MLP-table row in that many (a slice for the tests)."""
    mc = MODELS[model]
    cm = CostModel(profile or load_profile(PROFILES[device]), layers_only(mc), DTYPE)
    # host work between kernels, which Vidur's GPU timings leave out (the rest of step_ms is the layers')
    host_ms, layers = cm.profile.step_overhead_ms, mc.num_layers
    step_ms = cm.coefficients["step_ms"]
    folder = DATA / device / model
    out: list[Comparison] = []
    for row in read_rows(folder / "mlp.csv", every):
        n = int(row["num_tokens"])
        measured = layer_ms(row)
        predicted = (cm.forward_ms(n, 0, 0, 0) - host_ms) / layers
        kind = next(label for low, high, label in LAYER_RANGES if low <= n <= high)
        out.append(Comparison(device, model, kind, f"N={n}", measured, predicted))
    attention = folder / "attention.csv"
    if not attention.exists():
        return out
    # a step needs the layer's time at its token count (the last of a duplicated count)
    mlp_ms = {int(r["num_tokens"]): layer_ms(r) for r in read_rows(folder / "mlp.csv")}
    for row in read_rows(attention):   # 46 rows: never sliced
        batch, chunk, cached = int(row["batch_size"]), int(row["prefill_chunk_size"]), int(row["kv_cache_size"])
        measured = float(row["attn_median_ms"])
        if row["is_prefill"] == "True":
            num_kv, pairs, tokens = cached + chunk, chunk * (cached + (chunk + 1) / 2), chunk
            kind = PREFILL_SHORT if chunk <= 128 else PREFILL_LONG
            what = f"n={chunk} s={cached}"
            forward = cm.forward_ms(chunk, 0, num_kv, pairs)
        else:
            num_kv, pairs, tokens = batch * (cached + 1), 0.0, batch
            kind = DECODE_FILLS if batch >= 32 and cached >= 128 else DECODE_SMALL
            what = f"B={batch} C={cached}"
            forward = cm.forward_ms(0, batch, num_kv, 0)
        only_attention = cm.forward_ms(0, 0, num_kv, pairs) - step_ms - cm.coefficients["weights_ms"]
        out.append(Comparison(device, model, kind, what, measured, only_attention / layers))
        if tokens in mlp_ms:   # the step: every layer's MLP-table time plus its attention kernel
            step_kind = "step, prefill" if row["is_prefill"] == "True" else "step, decode"
            out.append(Comparison(device, model, step_kind, what, layers * (mlp_ms[tokens] + measured),
                                  forward - host_ms))
    return out


def summarize(comparisons: list[Comparison]) -> dict[tuple[str, str], dict]:
    """(profile, kind) -> points, median and p90 of |error|, bias (median signed error)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for c in comparisons:
        groups.setdefault((PROFILES[c.device], c.kind), []).append(c.error)
    out = {}
    for key, errors in groups.items():
        absolute = sorted(abs(e) for e in errors)
        p90 = absolute[min(len(absolute) - 1, int(0.9 * len(absolute)))]
        out[key] = {"points": len(errors), "median": statistics.median(absolute), "p90": p90,
                    "bias": statistics.median(errors)}
    return out


def all_comparisons(every: int = 1) -> list[Comparison]:
    return [c for device in PROFILES for model in MODELS if (DATA / device / model).is_dir()
            for c in compare(device, model, every)]


def misses(summary: dict[tuple[str, str], dict]) -> list[str]:
    """The (profile, kind) pairs whose median |error| is over the goal, exceptions aside."""
    return [f"{profile} {kind}" for (profile, kind), s in summary.items()
            if s["median"] > GOAL and kind not in EXCEPTIONS]


# the efficiency factors a profile derives its coefficients from, fitted together where they act together
# (the weights' read and the matrix units meet in the layer's roofline), and the kinds that measure them
FITTED_ON = {("layer_overhead_ms", "bandwidth_efficiency"): (LAYER_RANGES[0][2],),
             ("flops_efficiency",): tuple(label for *_, label in LAYER_RANGES),
             ("kv_bandwidth_efficiency",): (DECODE_FILLS,), ("attention_efficiency",): (PREFILL_LONG,)}


# the values each fitted field may take
GRIDS = {"layer_overhead_ms": [v / 1000 for v in range(61)]}
EFFICIENCY_GRID = [v / 100 for v in range(10, 101)]


def fit_error(device: str, profile: HardwareProfile, kinds: tuple[str, ...]) -> float:
    """The largest median |error| over `kinds` and the device's models; nan when nothing measures them."""
    errors: dict[tuple[str, str], list[float]] = {}
    for model in MODELS:
        if (DATA / device / model).is_dir():
            for c in compare(device, model, profile=profile):
                if c.kind in kinds:
                    errors.setdefault((model, c.kind), []).append(abs(c.error))
    return max(statistics.median(e) for e in errors.values()) if errors else float("nan")


def fit(device: str) -> dict[str, float]:
    """The profile's fields, in FITTED_ON's order, each group's values minimising `fit_error` over its
    kinds (on a grid; for two fields, every 5th value, then every value within 5 of the best); a group
    that `device` has no measurement of is left out."""
    profile = load_profile(PROFILES[device])
    fitted: dict[str, float] = {}
    for names, kinds in FITTED_ON.items():
        def cost(values: tuple[float, ...], names: tuple[str, ...] = names, kinds: tuple[str, ...] = kinds) -> float:
            return fit_error(device, dataclasses.replace(profile, **{**fitted, **dict(zip(names, values))}), kinds)
        grids = [GRIDS.get(name, EFFICIENCY_GRID) for name in names]
        middle = tuple(g[len(g) // 2] for g in grids)
        if cost(middle) != cost(middle):
            continue   # nan: nothing measures them here
        if len(names) == 1:   # one field: its whole grid
            fitted[names[0]] = min(grids[0], key=lambda v: cost((v,)))
            continue
        coarse = min(itertools.product(*[g[::5] for g in grids]), key=cost)
        fine = itertools.product(*[[v for v in g if abs(g.index(v) - g.index(x)) <= 5] for g, x in zip(grids, coarse)])
        fitted.update(zip(names, min(fine, key=cost)))
    return fitted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--every", type=int, default=1, help="keep one MLP-table row in this many (default: all)")
    parser.add_argument("--fit", action="store_true",
                        help="also fit each profile's efficiency factors to the data and print them")


def run(args: argparse.Namespace) -> None:
    section = Section("sim-gpu-accuracy")
    comparisons = all_comparisons(args.every)
    summary = summarize(comparisons)
    models = sorted({(c.device, c.model) for c in comparisons})
    section.add("Vidur's published operator timings (benchmarks/data/vidur/: one decoder layer, fp16, one GPU) "
                "against kvtrace's cost model on the matching shipped profile; the host's overhead per step left out. "
                f"Models: {', '.join(f'{d}/{m}' for d, m in models)}. Each row: measured points, median and p90 "
                "of |predicted − measured| / measured, bias (median signed error; + = predicted slower).")
    rows = []
    for (profile, kind), s in sorted(summary.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1]))):
        note = " (exception)" if kind in EXCEPTIONS else ""
        rows.append([profile, kind + note, s["points"], f"{100 * s['median']:.1f} %", f"{100 * s['p90']:.1f} %",
                     f"{100 * s['bias']:+.1f} %"])
    section.add(markdown_table(["profile", "kind", "points", "median |error|", "p90 |error|", "bias"], rows))
    missed = misses(summary)
    coefficients = []
    for device, model in models:
        cm = CostModel(load_profile(PROFILES[device]), layers_only(MODELS[model]), DTYPE)
        c = cm.coefficients
        layers = MODELS[model].num_layers
        coefficients.append([PROFILES[device], model, f"{cm.profile.layer_overhead_ms:.4g}",
                             f"{c['weights_ms'] / layers:.4g}",
                             f"{c['prefill_token_ms'] / layers * 1e3:.4g}", f"{c['kv_token_ms'] / layers * 1e6:.4g}",
                             f"{c['attention_pair_ms'] / layers * 1e9:.4g}"])
    section.add("Coefficients used, per layer: " + markdown_table(
        ["profile", "model", "fixed ms", "weights ms", "token µs", "KV token ns", "attention pair ps"], coefficients))
    if args.fit:
        fits = []
        for device, profile_name in PROFILES.items():
            shipped = load_profile(profile_name)
            for name, value in fit(device).items():
                kinds = next(k for names, k in FITTED_ON.items() if name in names)
                fits.append([profile_name, name, getattr(shipped, name), value, ", ".join(kinds)])
        section.add("Fitted efficiency factors (`--fit`: the values, to 0.01, that minimise the largest median "
                    "|error| of the kinds that measure them): " + markdown_table(["profile", "factor", "shipped", "fitted",
                                                                    "fitted on kinds"], fits))
    exceptions = "; ".join(f"{kind}: {why}" for kind, why in EXCEPTIONS.items())
    section.add(f"Goal: median |error| ≤ {100 * GOAL:.0f} % for every kind and shipped profile (exception: "
                f"{exceptions}): **{'met' if not missed else 'missed: ' + ', '.join(missed)}**.")
    worst = max((s["median"], f"{p} {k}") for (p, k), s in summary.items() if k not in EXCEPTIONS)
    section.write(f"{len(comparisons)} comparisons (A100, H100; Llama-2/3 7B–70B): worst median error "
                  f"{100 * worst[0]:.1f} % ({worst[1]}); goal ≤ {100 * GOAL:.0f} % per kind, 3 attention kernels "
                  f"excepted: {'met' if not missed else 'missed'}")
