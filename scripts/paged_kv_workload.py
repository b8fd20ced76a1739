"""Write the 4,000-request backlog of ../shared/background/paged-kv-memory.txt as a kvtrace workload.

The lengths are that program's own draws (Python's `random.Random(3)`, log-normal prompts with a
median of ~665 tokens clipped to 16..6000, outputs with a median of ~120 capped at 2,048), so a
replay sees exactly the requests its table was computed from. Each request asks for `max_tokens`
2,048 (the cap the reservation policies reserve for) and stops at its drawn `output_tokens`.

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
    """(prompt tokens, output tokens) per request, drawn as paged_kv.py's workload() draws them."""
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
        f.write(f"# paged-kv-memory.txt's backlog: python scripts/paged_kv_workload.py --seed {args.seed} "
                f"--num-requests {args.num_requests}\n")
        for i, (prompt, output) in enumerate(lengths(args.seed, args.num_requests)):
            f.write(json.dumps({"id": str(i), "arrival_s": 0.0, "prompt_tokens": prompt, "max_tokens": MAX_TOKENS,
                                "output_tokens": output}) + "\n")


if __name__ == "__main__":
    main()
