"""Greedy tokens of Hugging Face transformers, for tests that compare kvtrace's engine with it.

    $KVTRACE_VLLM_PYTHON tests/helpers/transformers_greedy.py < runs.json

Runs in the vLLM environment (transformers is not in kvtrace's own) and imports nothing from the
repository. stdin: `[{"model": FOLDER, "prompts": [[ids], ...], "max_tokens": N}, ...]`; stdout: one
JSON list, per run the generated ids of each prompt, exactly N of them (EOS does not stop a row).
"""
from __future__ import annotations

import json
import sys


def greedy(folder: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    # eager attention: the mask transformers builds for the model type (its sliding windows included) is
    # applied as it is, with no kernel of its own deciding the window
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # generate() restores the model's own EOS from its generation config even when given None
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:   # one at a time: no padding, no attention mask of our own
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                                 eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def main() -> None:
    runs = json.load(sys.stdin)
    print(json.dumps([greedy(r["model"], r["prompts"], r["max_tokens"]) for r in runs]))


if __name__ == "__main__":
    main()
