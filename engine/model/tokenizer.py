"""Text <-> token ids: a `tokenizers.Tokenizer` from an HF folder or built from GGUF metadata, plus ChatML."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import PRESETS
from engine.model.loader import BUILTIN_WITH_WEIGHTS, builtin_gguf_path, gguf_cache_dir, write_atomic

if TYPE_CHECKING:   # imported where a tokenizer is made: a model without one (the simulator's) never pays for it
    import tokenizers

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_CONTROL_TOKEN = 3  # llama.cpp's token_type for special (control) tokens


class Tokenizer:
    """What the engine needs from a tokenizer: ids in, ids out, the stop token and the chat format."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template  # the checkpoint's Jinja template, kept for export only

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (`<|im_start|>`) still become their single ids.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """ChatML as SmolLM2 uses it, with its default system prompt and the assistant generation prompt."""
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *messages]
        turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(turns) + "<|im_start|>assistant\n"

    def save(self, folder: Path) -> None:
        """Write `tokenizer_config.json` and `tokenizer.json` (last), each atomically."""
        token = lambda i: None if i is None else self.tokenizer.id_to_token(i)  # noqa: E731
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(self.bos_token_id),
            "eos_token": token(self.eos_token_id),
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2) + "\n"
        write_atomic(folder / "tokenizer_config.json", lambda tmp: tmp.write_text(text))
        write_atomic(folder / "tokenizer.json", lambda tmp: self.tokenizer.save(str(tmp)))


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of a preset, HF folder or .gguf file; None where there is none (tiny, dummy presets)."""
    if model in PRESETS:
        path = builtin_gguf_path() if model == BUILTIN_WITH_WEIGHTS else None
        return None if path is None else _from_gguf(path)
    path = Path(model).expanduser()
    if path.is_dir():
        return _from_folder(path) if (path / "tokenizer.json").is_file() else None
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} not found: it is not a built-in name "
                                f"({', '.join(PRESETS)}) and there is no file or folder at {path}")
    raise ValueError(f"cannot load a tokenizer from {path}: expected a Hugging Face folder or a .gguf file")


def _from_folder(folder: Path) -> Tokenizer:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    model_path = folder / "config.json"
    model_config = json.loads(model_path.read_text()) if model_path.is_file() else {}

    def token_id(kind: str) -> int | None:
        token = config.get(f"{kind}_token")
        if isinstance(token, dict):  # older files store AddedToken dicts
            token = token.get("content")
        found = tokenizer.token_to_id(token) if token else None
        fallback = model_config.get(f"{kind}_token_id")
        return found if found is not None else (fallback[0] if isinstance(fallback, list) else fallback)

    return Tokenizer(tokenizer, token_id("bos"), token_id("eos"), config.get("chat_template"))


def _from_gguf(path: Path) -> Tokenizer:
    """Build once from GGUF metadata (slow to parse: ~2 s), then reuse the copy saved in the cache folder."""
    cache = gguf_cache_dir(path)
    if (cache / "tokenizer.json").is_file():
        return _from_folder(cache)
    import gguf
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(path)
    value = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    kind = value("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = value("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in value("tokenizer.ggml.merges")]
    tokenizer = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if value("tokenizer.ggml.pre") == "smollm":  # llama.cpp's smollm pre-tokenizer splits digits one by one
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    token_types = value("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(token_types) if kind == _CONTROL_TOKEN])
    result = Tokenizer(tokenizer, value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id"),
                       value("tokenizer.chat_template"))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        result.save(cache)
    except OSError:
        pass  # a read-only cache only costs speed
    return result
