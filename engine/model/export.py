"""Any model kvtrace can load, written as a Hugging Face folder (config.json, fp32 safetensors, the
tokenizer, generation_config.json) that transformers and vLLM load as they are."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path


def export_hf_folder(model: str, folder: Path, load_format: str = "auto", seed: int = 0) -> None:
    """Build the whole folder under a temp name next to `folder`, then rename it: never half-written."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} already exists and is not an empty folder")
    import torch

    from engine.model.loader import load_weights, save_hf_weights
    from engine.model.tokenizer import load_tokenizer

    loaded = load_weights(model, load_format=load_format, dtype=torch.float32, seed=seed)
    tokenizer = load_tokenizer(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()
    try:
        save_hf_weights(tmp, loaded.config, loaded.weights)
        if tokenizer is not None:
            tokenizer.save(tmp)
        stops = list(loaded.config.stop_token_ids)
        generation = {"bos_token_id": loaded.config.bos_token_id,
                      "eos_token_id": stops if len(stops) > 1 else loaded.config.eos_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if folder.exists():
            folder.rmdir()  # checked empty above
        os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
