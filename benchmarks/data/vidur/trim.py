"""Regenerate the trimmed MLP tables here from a clone of github.com/microsoft/vidur.

    python benchmarks/data/vidur/trim.py VIDUR_CLONE [COMMIT]

Reads `data/profiling/compute/<device>/<model>/mlp.csv` at COMMIT (default HEAD) with `git show`, keeps
the rows of one GPU (`num_tensor_parallel_workers == 1`) and, of each operation's five statistics, the
median (ms), and writes `<device>/<model>/mlp.csv` beside this file. Standard library only.
"""
from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLES = [("a100", "meta-llama/Llama-2-7b-hf"), ("a100", "meta-llama/Meta-Llama-3-8B"),
          ("a100", "meta-llama/Llama-2-70b-hf"), ("a100", "meta-llama/Meta-Llama-3-70B"),
          ("h100", "meta-llama/Llama-2-7b-hf"), ("h100", "meta-llama/Llama-2-70b-hf")]
# one decoder layer's operations outside the attention kernel, in the order the layer runs them
OPERATIONS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
              "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def main(clone: str, commit: str = "HEAD") -> None:
    for device, model in TABLES:
        path = f"data/profiling/compute/{device}/{model}/mlp.csv"
        text = subprocess.run(["git", "-C", clone, "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        rows = [r for r in csv.DictReader(io.StringIO(text)) if r["num_tensor_parallel_workers"] == "1"]
        rows.sort(key=lambda r: int(r["num_tokens"]))
        out = HERE / device / model.split("/")[1] / "mlp.csv"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["num_tokens", *OPERATIONS])
            for r in rows:
                writer.writerow([r["num_tokens"], *(f"{float(r[f'time_stats.{op}.median']):.6g}" for op in OPERATIONS)])
        print(f"{out.relative_to(HERE)}: {len(rows)} rows")


if __name__ == "__main__":
    main(*sys.argv[1:])
