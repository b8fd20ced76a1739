"""Token-id workloads that every engine reads the same way: random ids, exact output lengths."""
from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ORDINARY_ID = 17   # ids 0..16 are SmolLM2's special tokens
VOCAB_SIZE = 49_152


@dataclass
class Request:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int          # generated exactly (ignore_eos)

    def to_json(self) -> dict:
        return {"id": self.id, "prompt_token_ids": self.prompt_token_ids, "max_tokens": self.max_tokens}


def random_requests(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    seed: int = 0) -> list[Request]:
    """Prompts of uniform random ids; lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt_len = rng.randint(*prompt_range)
        prompt = [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(prompt_len)]
        requests.append(Request(str(i), prompt, rng.randint(*output_range)))
    return requests


def longest(requests: list[Request]) -> int:
    """Prompt plus output of the longest request: every engine's max_model_len."""
    return max(len(r.prompt_token_ids) + r.max_tokens for r in requests)


def describe(requests: list[Request]) -> str:
    prompts = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    return (f"{len(requests)} requests of random token ids, prompts {min(prompts)}–{max(prompts)} "
            f"({sum(prompts):,} tokens), outputs {min(outputs)}–{max(outputs)} ({sum(outputs):,} tokens), "
            f"all arriving at t=0, greedy, ignore_eos")
