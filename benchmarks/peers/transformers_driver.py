"""Run token-id workloads through Hugging Face transformers `generate`; runs in its own venv.

    /work/venvs/hf/bin/python benchmarks/peers/transformers_driver.py '{"model": DIR, "batch_size": 8}'

Loads the model once, then every line on stdin is one workload
    {"requests": [{"id": "0", "prompt_token_ids": [...], "max_tokens": 64}, ...]}
and every answer is one JSON line on stdout. Requests go in order, `batch_size` at a time, left
padded; a batch generates as many tokens as its longest request asks for, and each request keeps
its own `max_tokens` of them (the rest is the price of static batching). Tokens are stamped by a
streamer as `generate` hands each step's tokens over. This file imports nothing from the repository.
"""
from __future__ import annotations

import json
import os
import sys
import time

_RESULTS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)


def _emit(obj: dict) -> None:
    _RESULTS.write(json.dumps(obj) + "\n")
    _RESULTS.flush()


class _StepClock:
    """A transformers streamer that only notes when each generated step arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:  # the first call carries the prompt
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run(model, requests: list[dict], batch_size: int, pad_id: int) -> dict:
    import torch

    tokens: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"]
                                  for r in batch])
        attention_mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                                       for r in batch])
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=max(r["max_tokens"] for r in batch), pad_token_id=pad_id,
                                 eos_token_id=None, streamer=clock)
        for row, r in enumerate(batch):
            n = r["max_tokens"]
            tokens[r["id"]] = out[row, width:width + n].tolist()
            times[r["id"]] = [t - t0 for t in clock.times[:n]]
    return {"duration_s": time.perf_counter() - t0, "tokens": tokens, "token_times_s": times,
            "num_preemptions": None}


def main() -> None:
    config = json.loads(sys.argv[1])
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    model.eval()
    # generate() puts the model's own EOS back even when given None, then stops rows there and pads
    # them: clear it in the generation config too, so every row is generated to its length
    model.generation_config.eos_token_id = None
    pad_id = config.get("pad_token_id", 2)
    model.generation_config.pad_token_id = pad_id
    warm = [{"id": "warm", "prompt_token_ids": list(range(100, 132)), "max_tokens": 4}]
    run(model, warm, 1, pad_id)
    _emit({"event": "ready", "startup_s": time.perf_counter() - t0, "transformers": transformers.__version__,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "attn_implementation": getattr(model.config, "_attn_implementation", None)})
    for line in sys.stdin:
        if not line.strip():
            continue
        workload = json.loads(line)
        batch_size = workload.get("batch_size", config.get("batch_size", 8))
        _emit({"event": "result", **run(model, workload["requests"], batch_size, pad_id)})


if __name__ == "__main__":
    main()
