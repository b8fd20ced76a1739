"""What a sweep of a run's traffic takes from the run itself, and how its answer reads as vLLM flags.

`run_options` reads the run's meta.json: the model (a capture names it as served, `Llama-3.1-8B-Instruct`
or a path: mapped to a simulator model, or refused in one line that says what to pass), the KV pool and
the scheduler's limits, so that `kvtrace sweep --from-run RUN --set KNOB=...` needs no option copied by
hand. An option given on the command line, or swept, wins; of the options that size the pool (blocks,
bytes, a share of memory) none is taken from the run when any is given. A vLLM run (a capture, or
`record --engine vllm`) is swept through the simulator; a run of kvtrace's engine with the engine it ran.
A capture of a server that drafts (speculative decoding) is simulated drafting as it did: its method and
draft tokens, and the acceptance rate fitted on its own verifications (spec_decode.sql), so that the
what-if keeps the lookahead slots' pressure on the pool.

`VLLM_FLAGS` maps each knob to the vLLM engine argument an operator changes (docs/sweep.md shows the
table); `vllm_args` words a point's settings with them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from engine.config import PRESETS, SPEC_METHODS, parse_bytes
from kvtrace.errors import KvtraceError
from kvtrace.sweep.grid import flag_names

# kvtrace record's knob -> (vLLM's engine argument, a note); None: vLLM V1 has no such setting
VLLM_FLAGS: dict[str, tuple[str | None, str]] = {
    "num_gpu_blocks": ("--num-gpu-blocks-override", "the KV pool in blocks: kvtrace's usable blocks + 1, vLLM's "
                                                   "null block"),
    "kv_cache_memory": ("--kv-cache-memory-bytes", "the KV pool in bytes"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "the share of GPU memory vLLM may take, KV pool included"),
    "block_size": ("--block-size", "tokens per KV block"),
    "max_num_seqs": ("--max-num-seqs", "sequences in a step"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "tokens in a step"),
    "max_model_len": ("--max-model-len", "the longest prompt + output"),
    "enable_prefix_caching": ("--enable-prefix-caching", "--no-enable-prefix-caching turns it off"),
    "enable_chunked_prefill": ("--enable-chunked-prefill", "--no-enable-chunked-prefill turns it off"),
    "long_prefill_token_threshold": ("--long-prefill-token-threshold", "a long prompt's share of a step"),
    "async_scheduling": ("--async-scheduling", "schedule a step before the last one's output is processed"),
    "disable_hybrid_kv_cache_manager": ("--disable-hybrid-kv-cache-manager", "a model with sliding windows keeps "
                                        "every layer's KV as full attention's"),
    "preemption_policy": ("--scheduling-policy", "priority, or fcfs (which preempts the newest)"),
    "offload_size": ("--kv-offloading-size", "the host KV tier (native CPU offloading), vLLM's in GiB; 0: none"),
    "speculative_method": ("--speculative-config", "the drafting method, its JSON's \"method\""),
    "num_speculative_tokens": ("--speculative-config", "draft tokens a step, its JSON's \"num_speculative_tokens\""),
    "spec_acceptance_rate": (None, "the drafter's and the traffic's, not a setting"),
    "preemption_mode": (None, "vLLM V1 always recomputes a preempted request; its KV offloading is the modern swap"),
    "swap_space": (None, "vLLM V1 does not swap (V0's --swap-space)"),
    "num_cpu_blocks": (None, "vLLM V1 does not swap"),
    "watermark": (None, "vLLM V1 keeps no free-block watermark"),
}

# the options that size the KV pool: one of them, or none, is taken from the run
POOL = ("num_gpu_blocks", "kv_cache_memory", "gpu_memory_utilization")
# what is taken from a run's engine_config, in this order (the pool's size from kv_pool)
TAKEN = ("engine", "model", "hardware", "dtype", "device", "load_format", "block_size", "num_gpu_blocks",
         "kv_cache_memory", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
         "enable_prefix_caching", "enable_chunked_prefill", "long_prefill_token_threshold", "preemption_mode",
         "preemption_policy", "async_scheduling", "n_mode", "num_cpu_blocks", "swap_space", "watermark",
         "disable_hybrid_kv_cache_manager", "speculative_method", "num_speculative_tokens", "spec_acceptance_rate",
         "offload_size")
# a vLLM run's; its dtype where it says it (`record --engine vllm`: a live capture does not), as a block's bytes are
# the dtype's: a tier or a pool given in bytes holds as many blocks as in the served model
VLLM_ONLY_TAKEN = ("model", "dtype", "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                   "max_model_len", "enable_prefix_caching", "async_scheduling")

# a served model's name (lower case, its organisation and a chat/instruct suffix left out) -> the simulator's
# model of the same shape, where the name alone is not one
ALIASES = {"llama-3.1-8b": "llama-3-8b", "meta-llama-3-8b": "llama-3-8b", "meta-llama-3.1-8b": "llama-3-8b",
           "mistral-7b-v0.1": "mistral-7b", "mistral-7b-v0.2": "mistral-7b", "mistral-7b-v0.3": "mistral-7b",
           "qwen2.5-0.5b": "qwen2.5-0.5b", "smollm2-135m": "smollm2-135m", "llama-3.2-1b": "llama-3.2-1b"}


def simulator_model(served: str | None) -> tuple[str, str | None]:
    """(the model the simulator takes, a note on how it was found) for a run's model as it was served:
    a built-in name, a local folder with config.json, or a known name of the same shape. KvtraceError
    otherwise, saying what to pass."""
    if not served:
        raise KvtraceError("the run names no model: pass --model (a built-in: " + ", ".join(PRESETS) +
                           "; or a folder with the model's config.json)")
    if served in PRESETS:
        return served, None
    path = Path(served).expanduser()
    if (path / "config.json").is_file():
        return str(path), None
    name = re.sub(r"-(instruct|chat|hf|it)(?=-|$)", "", path.name.lower())
    name = ALIASES.get(name, name)
    if name in PRESETS:
        return name, f"served as {served!r}, the same shape"
    raise KvtraceError(f"the run's model {served!r} is no model the simulator knows: pass --model with a built-in "
                       f"of its shape ({', '.join(PRESETS)}) or a folder holding its config.json")


def given_knobs(shared: list[str], grid: dict, knobs: dict) -> set[str]:
    """The knobs the command line sets: swept, or shared (--flag, --flag=VALUE, --no-flag)."""
    flags = flag_names(knobs)
    return set(grid) | {flags[a.split("=", 1)[0]] for a in shared if a.split("=", 1)[0] in flags}


def run_options(run: Path, shared: list[str], grid: dict, knobs: dict) -> tuple[list[str], list[str]]:
    """(record options taken from the run and not given, the lines that say so)."""
    try:
        meta = json.loads((run / "meta.json").read_text())
    except (OSError, ValueError):
        return [], []   # workload_from_run has said what is wrong with the run
    config = dict(meta.get("engine_config") or {})
    pool = meta.get("kv_pool") or {}
    vllm = config.get("engine") == "vllm" or bool(meta.get("vllm"))
    given = given_knobs(shared, grid, knobs)
    values: dict[str, object] = {}
    notes = []
    for name in (VLLM_ONLY_TAKEN if vllm else TAKEN):
        values[name] = config.get(name)
    if pool.get("num_gpu_blocks") is not None:   # what the pool was, however it was asked for
        values.update(num_gpu_blocks=pool["num_gpu_blocks"], kv_cache_memory=None, gpu_memory_utilization=None)
    if any(name in given for name in POOL):
        for name in POOL:
            values.pop(name, None)
    if vllm:
        values["engine"] = "sim"
        if (config.get("num_speculative_tokens") or 0) > 0:
            notes += drafting(run, config, values, given)
        if "hardware" not in given:
            notes.append("the run does not say which GPU served it: the simulator models an h100-sxm "
                         "(--hardware says otherwise)")
        if "offload_size" not in given:
            values["offload_size"], said = host_tier(meta)
            notes += said
        if not values.get("dtype") and "dtype" not in given and given & {"offload_size", "kv_cache_memory"}:
            notes.append("the run does not say its KV cache's dtype: a size in bytes holds the blocks of the "
                         "simulator's bfloat16 (--dtype says otherwise)")
    if "model" not in given:
        values["model"], found = simulator_model(values.get("model") or (meta.get("model") or {}).get("source"))
        if found:
            notes.append(f"model {values['model']}: {found}")
    if vllm and not values.get("disable_hybrid_kv_cache_manager") and "disable_hybrid_kv_cache_manager" not in given:
        model = given_value(shared, "--model") if "model" in given else values.get("model")
        check_kv_cache_groups(pool.get("kv_cache_groups") or [], model)
    args = []
    for name, value in values.items():
        if name in given or value is None or name not in knobs:
            continue
        knob = knobs[name]
        if knob.is_flag:
            if value:
                args.append(knob.flag)
            elif knob.off_flag:
                args.append(knob.off_flag)
        else:
            args += [knob.flag, str(value)]
    said = [f"from the run: {' '.join(args)}"] if args else []
    return args, said + notes


def given_value(shared: list[str], flag: str) -> str | None:
    """The value a shared option gives `flag` (`--flag VALUE` or `--flag=VALUE`), None if it gives none."""
    for i, arg in enumerate(shared):
        if arg == flag and i + 1 < len(shared):
            return shared[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _group_names(groups) -> str:
    return " + ".join(sorted(f"sliding window {w} tok" if w else "full attention" for w in groups))


def check_kv_cache_groups(captured: list[dict], model: str | None) -> None:
    """KvtraceError where a vLLM capture's KV-cache groups are of other kinds than those the simulator makes
    of `model`'s config: vLLM reads some configs' windows otherwise than transformers, whose reading kvtrace
    keeps (a llama config's `layer_types`, which vLLM's Llama honours), and a what-if would model the wrong
    pool. Nothing is checked where the capture names no groups or the model cannot be read (the point's
    record says why)."""
    if not captured or not model:
        return
    from engine.model.loader import load_config

    try:
        model_config, _ = load_config(model)
    except (OSError, ValueError):
        return
    theirs = {g.get("sliding_window") if g.get("kind") == "sliding_window" else g.get("kind") for g in captured}
    theirs = {None if kind == "full_attention" else kind for kind in theirs}
    ours = {group.window for group in model_config.kv_cache_groups}
    if theirs != ours:
        served = " + ".join(sorted(str(k) if isinstance(k, str) else _group_names([k]) for k in theirs))
        raise KvtraceError(f"the run's KV cache is {served} (vLLM's reading of its model), but kvtrace reads model "
                           f"{model} as {_group_names(ours)}: pass --model with a config whose layers have the "
                           f"server's windows (kvtrace reads windows as transformers does: none for llama), or "
                           f"--disable-hybrid-kv-cache-manager to model every layer's KV as full attention's")


def host_tier(meta: dict) -> tuple[int | None, list[str]]:
    """A vLLM run's host KV tier as --offload-size (its bytes, from meta.json's kv_tiers) and the lines
    that say so; (None, []) without a tier. A connector's tier of unknown size (not vLLM's native
    offloading) is left out, and said."""
    tiers = meta.get("kv_tiers") or []
    if not tiers:
        return None, []
    tier = tiers[0]
    if tier.get("bytes") is None:
        return None, [f"the run's KV tier {tier.get('name')!r} has no size the simulator can model: simulated "
                      "without it (--offload-size gives one)"]
    return int(tier["bytes"]), [f"the run's host KV tier {tier.get('name')!r} of {int(tier['bytes']):,} bytes "
                                f"({tier.get('num_blocks')} blocks in vLLM) is simulated"]


def drafting(run: Path, config: dict, values: dict, given: set[str]) -> list[str]:
    """A capture of a server that drafts: its method (kvtrace's nearest where vLLM's is none of them) and
    draft tokens, the acceptance rate fitted on its verifications. Sets them in `values`; returns the
    lines that say so."""
    from kvtrace.calibrate import fit_acceptance_rate

    notes = []
    method, lookahead = config.get("speculative_method"), config.get("num_lookahead_tokens") or 0
    if method not in SPEC_METHODS:
        near = "eagle" if lookahead else "ngram"
        notes.append(f"drafting with {method or 'an unnamed method'}: simulated as {near} (the same lookahead slots, "
                     f"{lookahead} a request)")
        method = near
    values.update(speculative_method=method, num_speculative_tokens=config["num_speculative_tokens"])
    if "spec_acceptance_rate" not in given:
        fitted = fit_acceptance_rate([run])
        if fitted is not None:
            values["spec_acceptance_rate"] = round(fitted[0], 3)
            notes.append(f"drafts accepted at rate {fitted[0]:.3f}, fitted on the run's {fitted[1]:,} verifications")
    return notes


def vllm_args(settings: dict) -> str:
    """A point's settings as vLLM engine arguments: `--max-num-seqs 64 --no-enable-prefix-caching`,
    with what has no vLLM flag said in brackets."""
    words = []
    for name, value in settings.items():
        flag, note = VLLM_FLAGS.get(name, (None, "no vLLM setting"))
        if flag is None:
            words.append(f"({name} {value}: {note})")
        elif name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
            on = str(value).lower() in ("true", "1", "yes", "on")
            words.append(flag if on else flag.replace("--", "--no-", 1))
        elif name == "disable_hybrid_kv_cache_manager":   # vLLM's is a switch that is only ever turned on
            if str(value).lower() in ("true", "1", "yes", "on"):
                words.append(flag)
        elif name == "num_gpu_blocks":   # kvtrace counts usable blocks; vLLM's count holds its null block too
            words.append(f"{flag} {int(float(value)) + 1}")
        elif name == "offload_size":   # vLLM's size is in GiB; none is no tier
            size = parse_bytes(value)
            words.append(f"{flag} {size / 2**30:g}" if size else f"(no {flag})")
        elif name == "preemption_policy":
            words.append(f"{flag} {'priority' if value == 'priority' else 'fcfs'}")
        else:
            words.append(f"{flag} {value}")
    return " ".join(words)
