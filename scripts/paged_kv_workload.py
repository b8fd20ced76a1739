"""Write a 4,000-request backlog, the allocation-policy scale test of docs/simulation.md, as a kvtrace workload.

Every request arrives at 0. Prompt lengths are log-normal (mu 6.5, sigma 1: a median of ~665
tokens) clipped to 16..6000; output lengths are log-normal (mu 4.8, sigma 1: a median of ~120)
capped at 2,048; both drawn in turn, per request, from Python's `random.Random(3)`. Each request
asks for `max_tokens` 2,048 (the cap the reservation policies reserve for) and stops at its drawn
`output_tokens`. Everything the workload is lies in this file: `lengths()` is the generator.

These are the draws of `paged_kv.py`, the program of the "Paged KV memory" lesson (a text outside
this repository) whose table of four allocation policies docs/simulation.md compares kvtrace's
replay with; a replay sees exactly the requests that table was computed from.

    python scripts/paged_kv_workload.py -o traces/paged-kv-4000.jsonl
    # then docs/simulation.md's four commands, one per allocation policy
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

NUM_REQUESTS = 4000
MAX_TOKENS = 2048


def lengths(seed: int = 3, num_requests: int = NUM_REQUESTS) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request, in arrival order."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt = min(max(int(math.exp(rng.gauss(6.5, 1.0))), 16), 6000)
        output = min(max(int(math.exp(rng.gauss(4.8, 1.0))), 1), MAX_TOKENS)
        out.append((prompt, output))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        f.write(f"# docs/simulation.md's 4,000-request backlog: python scripts/paged_kv_workload.py --seed {args.seed} "
                f"--num-requests {args.num_requests}\n")
        for i, (prompt, output) in enumerate(lengths(args.seed, args.num_requests)):
            f.write(json.dumps({"id": str(i), "arrival_s": 0.0, "prompt_tokens": prompt, "max_tokens": MAX_TOKENS,
                                "output_tokens": output}) + "\n")


if __name__ == "__main__":
    main()
