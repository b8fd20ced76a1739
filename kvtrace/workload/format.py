"""The workload format: JSONL, one request per line (see docs/workload-format.md).

Loading checks every line and reports every problem at once, in one line; saving writes the same
format back. A prompt is text, explicit token ids, or a count whose ids are synthesised here,
deterministically, so that a workload file stays small and a replay stays reproducible.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import MISSING, dataclass
from dataclasses import fields as dataclass_fields
from types import SimpleNamespace
from typing import IO

import numpy as np

from kvtrace.atomic import atomic_write
from kvtrace.errors import KvtraceError

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "prompt_tokens")
FIELDS = ("id", "arrival_s", *PROMPT_FIELDS, "max_tokens", "output_tokens", "ignore_eos", "n", "priority",
          "temperature", "top_p", "seed", "prefix_group", "prefix_tokens", "hash_ids", "hash_block_size")
NUM_SPECIAL_IDS = 17   # SmolLM2's ids 0..16 are special tokens; synthetic prompts avoid that range
MAX_LISTED = 10        # problems listed in one error message before "and N more"


@dataclass(kw_only=True)
class WorkloadRequest:
    """One request of a workload, every default filled in."""

    id: str                                  # unique in the workload; default: its 1-based line number
    arrival_s: float                         # seconds after the replay starts
    prompt: str | None = None                # text; needs the model's tokenizer
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None         # a count (whole prompt, prefix included); ids synthesised
    max_tokens: int                          # output cap
    output_tokens: int | None = None         # where the request really stopped (<= max_tokens); stop there
    ignore_eos: bool | None = None           # None -> True for a count prompt or with output_tokens, else False
    n: int = 1                               # samples
    priority: int = 0                        # lower value = more important
    temperature: float = 0.0                 # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None                  # sampling seed
    prefix_group: str | None = None          # requests of a group share their first prefix_tokens ids
    prefix_tokens: int | None = None
    hash_ids: list[int] | None = None        # one per full block of a count prompt: equal ids, equal blocks
    hash_block_size: int | None = None       # tokens per hash id; comes with hash_ids
    line: int = 0                            # line in the file it came from (0: not from a file)

    def __post_init__(self) -> None:
        if self.ignore_eos is None:
            self.ignore_eos = self.prompt_tokens is not None or self.output_tokens is not None
        problems = _value_problems(self)
        if problems:
            raise ValueError(f"request {self.id!r}: {problems[0]}")

    def to_json(self) -> dict:
        """The JSON object of this request; defaults are left out except `ignore_eos`."""
        out: dict = {"id": self.id, "arrival_s": round(self.arrival_s, 6)}
        for name in (*PROMPT_FIELDS, "max_tokens", "output_tokens", "ignore_eos"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for name, default in (("n", 1), ("priority", 0), ("temperature", 0.0), ("top_p", 1.0),
                              ("seed", None), ("prefix_group", None), ("prefix_tokens", None),
                              ("hash_ids", None), ("hash_block_size", None)):
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# field -> (type check, what the field must be)
_TYPES = {
    "id": (lambda v: isinstance(v, str) or _is_int(v), "a string or an integer"),
    "arrival_s": (_is_number, "a number"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "prompt_token_ids": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
    "prompt_tokens": (_is_int, "an integer"),
    "max_tokens": (_is_int, "an integer"),
    "output_tokens": (_is_int, "an integer"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "n": (_is_int, "an integer"),
    "priority": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "seed": (_is_int, "an integer"),
    "prefix_group": (lambda v: isinstance(v, str), "a string"),
    "prefix_tokens": (_is_int, "an integer"),
    "hash_ids": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
    "hash_block_size": (_is_int, "an integer"),
}


_DEFAULTS = {f.name: f.default for f in dataclass_fields(WorkloadRequest) if f.default is not MISSING}


def _value_problems(req: WorkloadRequest | SimpleNamespace) -> list[str]:
    """What is wrong with a request whose fields have the right types."""
    problems = []
    prompts = [name for name in PROMPT_FIELDS if getattr(req, name) is not None]
    if not prompts:
        problems.append("needs a prompt: one of prompt, prompt_token_ids, prompt_tokens")
    elif len(prompts) > 1:
        problems.append(f"give only one of prompt, prompt_token_ids, prompt_tokens (got {', '.join(prompts)})")
    if req.id == "":
        problems.append("id must not be empty")
    if not math.isfinite(req.arrival_s) or req.arrival_s < 0:
        problems.append(f"arrival_s must be a finite number >= 0, got {req.arrival_s}")
    if req.prompt == "":
        problems.append("prompt must not be empty")
    if req.prompt_token_ids is not None:
        if not req.prompt_token_ids:
            problems.append("prompt_token_ids must not be empty")
        elif min(req.prompt_token_ids) < 0:
            problems.append(f"prompt_token_ids must be >= 0, got {min(req.prompt_token_ids)}")
    for name in ("prompt_tokens", "max_tokens", "output_tokens", "n", "prefix_tokens", "hash_block_size"):
        value = getattr(req, name)
        if value is not None and value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    if req.output_tokens is not None and req.max_tokens is not None and req.output_tokens > req.max_tokens:
        problems.append(f"output_tokens {req.output_tokens} exceeds max_tokens {req.max_tokens} "
                        "(max_tokens is the cap, output_tokens where the request stopped)")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        problems.append(f"temperature must be >= 0, got {req.temperature}")
    if not 0 < req.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {req.top_p}")
    if (req.prefix_group is None) != (req.prefix_tokens is None):
        problems.append("prefix_group and prefix_tokens go together")
    elif req.prefix_group is not None:
        if req.prompt_tokens is None:
            problems.append("prefix_group needs a prompt_tokens count "
                            "(with prompt or prompt_token_ids, write the shared prefix into the prompt)")
        elif req.prefix_tokens is not None and req.prefix_tokens > req.prompt_tokens:
            problems.append(f"prefix_tokens {req.prefix_tokens} exceeds prompt_tokens {req.prompt_tokens} "
                            "(prompt_tokens counts the whole prompt, prefix included)")
    problems += _hash_problems(req)
    return problems


def _hash_problems(req: WorkloadRequest | SimpleNamespace) -> list[str]:
    """What is wrong with a request's hash_ids (the prefix structure of a count prompt, block by block)."""
    if (req.hash_ids is None) != (req.hash_block_size is None):
        return ["hash_ids and hash_block_size go together (hash_block_size: the tokens each hash id stands for)"]
    if req.hash_ids is None:
        return []
    if req.prompt_tokens is None:
        return ["hash_ids needs a prompt_tokens count (the prompt's ids are synthesised from the hashes)"]
    if req.prefix_group is not None:
        return ["give prefix_group or hash_ids, not both"]
    if req.hash_block_size is not None and req.hash_block_size >= 1:
        num_full_blocks = req.prompt_tokens // req.hash_block_size
        if len(req.hash_ids) > num_full_blocks:
            return [f"hash_ids has {len(req.hash_ids)} ids but prompt_tokens {req.prompt_tokens} holds only "
                    f"{num_full_blocks} full blocks of {req.hash_block_size} tokens (one id per full block)"]
    return []


def _parse_line(text: str, line: int) -> tuple[WorkloadRequest | None, list[str]]:
    """One line of JSON -> a request, or the problems that stop it being one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [f"not valid JSON ({exc.msg} at column {exc.colno})"]
    if not isinstance(obj, dict):
        return None, [f"expected a JSON object, got {type(obj).__name__}"]
    unknown = []
    for name in obj:
        if name not in _TYPES:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            unknown.append(f"unknown field {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    problems = []
    for name, (check, kind) in _TYPES.items():
        value = obj.get(name)
        if value is not None and not check(value):
            problems.append(f"{name} must be {kind}, got {json.dumps(value)[:40]}")
    for name in ("arrival_s", "max_tokens"):
        if obj.get(name) is None:
            problems.append(f"{name} is missing")
    if problems:  # values are checked only once every type is right
        return None, unknown + problems
    fields = {name: obj[name] for name in _TYPES if obj.get(name) is not None}
    fields["id"] = str(fields.get("id", line))
    if not unknown:   # the usual line: the request checks its values itself (the first problem only)
        try:
            return WorkloadRequest(**_as_floats(fields), line=line), []
        except ValueError:
            pass
    return None, unknown + _value_problems(SimpleNamespace(**{**_DEFAULTS, **fields}))   # every problem


def _as_floats(fields: dict) -> dict:
    """The fields with the float ones as floats (a JSON integer where a number goes)."""
    return fields | {name: float(fields[name]) for name in ("arrival_s", "temperature", "top_p") if name in fields}


def one_line_error(head: str, problems: list[tuple[int, str]]) -> KvtraceError:
    """`head: line 2: ...` for one problem, else `head: 3 bad lines: line 2: ...; line 5: ...; and N more`."""
    listed = "; ".join(f"line {line}: {message}" for line, message in problems[:MAX_LISTED])
    if len(problems) > MAX_LISTED:
        listed += f"; and {len(problems) - MAX_LISTED} more"
    if len(problems) == 1:
        return KvtraceError(f"{head}: {listed}")
    num_lines = len({line for line, _ in problems})
    return KvtraceError(f"{head}: {num_lines} bad line{'s' if num_lines != 1 else ''}: {listed}")


def load_workload(path: str | os.PathLike) -> list[WorkloadRequest]:
    """Read and check a workload file; the requests come back sorted by arrival (stable)."""
    requests: list[WorkloadRequest] = []
    problems: list[tuple[int, str]] = []
    first_line_of_id: dict[str, int] = {}
    group_prefix: dict[str, tuple[int, int]] = {}   # prefix_group -> (prefix_tokens, line)
    try:
        with open(path, "rb") as f:
            for line, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    problems.append((line, "not UTF-8 text"))
                    continue
                if not text or text.startswith("#"):
                    continue
                req, line_problems = _parse_line(text, line)
                problems += [(line, message) for message in line_problems]
                if req is None:
                    continue
                if req.id in first_line_of_id:
                    problems.append((line, f"id {req.id!r} repeats line {first_line_of_id[req.id]}"))
                first_line_of_id.setdefault(req.id, line)
                if req.prefix_group is not None:
                    tokens, first = group_prefix.setdefault(req.prefix_group, (req.prefix_tokens, line))
                    if tokens != req.prefix_tokens:
                        problems.append((line, f"prefix_tokens {req.prefix_tokens} differs from {tokens} "
                                               f"of group {req.prefix_group!r} (line {first})"))
                requests.append(req)
    except FileNotFoundError:
        raise KvtraceError(f"workload file not found: {path}") from None
    except IsADirectoryError:
        raise KvtraceError(f"workload path is a folder, not a file: {path}") from None
    if problems:
        raise one_line_error(str(path), problems)
    if not requests:
        raise KvtraceError(f"{path}: no requests (the file is empty or holds only comments)")
    requests.sort(key=lambda req: req.arrival_s)
    return requests


def synthetic_ids(key: str, num_tokens: int, *, vocab_size: int, seed: int = 0) -> list[int]:
    """`num_tokens` ids drawn from [min(17, vocab_size // 4), vocab_size), fixed by (seed, key)."""
    key_hash = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed % (1 << 64), key_hash])
    low = min(NUM_SPECIAL_IDS, vocab_size // 4)
    return rng.integers(low, vocab_size, size=num_tokens).tolist()


@functools.lru_cache(maxsize=1 << 16)   # a workload's shared blocks are synthesised once
def _hash_block_ids(hash_id: int, block_size: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    return tuple(synthetic_ids(f"block:{block_size}:{hash_id}", block_size, vocab_size=vocab_size, seed=seed))


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text`; takes a tokenizer whose encode() gives a list or an object with `.ids`."""
    encoded = tokenizer.encode(text)
    return list(getattr(encoded, "ids", encoded))


def _where(req: WorkloadRequest) -> str:
    return f"line {req.line} (id {req.id})" if req.line else f"request {req.id!r}"


def resolve_prompt_ids(req: WorkloadRequest, *, vocab_size: int, tokenizer=None, seed: int = 0) -> list[int]:
    """The prompt's token ids: text encoded, ids checked, counts synthesised from (seed, id). Every id
    returned is inside [0, vocab_size): an id given or encoded outside it is refused, and synthesised
    ids are drawn inside it (so the engine need not check them again).

    A count prompt in a prefix group is the group's shared prefix (synthesised from (seed, group))
    followed by the request's own `prompt_tokens - prefix_tokens` ids. A count prompt with hash_ids is
    one block of `hash_block_size` ids per hash (synthesised from (seed, block size, hash), so equal
    hashes give equal blocks) followed by the request's own ids:

      [ block of hash_ids[0] ][ block of hash_ids[1] ] ... [ own ids: the rest of prompt_tokens ]
    """
    where = _where(req)
    if req.prompt is not None:
        if tokenizer is None:
            raise KvtraceError(f"{where}: a text prompt needs the model's tokenizer and this model has none "
                               "(use prompt_token_ids or prompt_tokens)")
        ids = encode_text(tokenizer, req.prompt)
        if not ids:
            raise KvtraceError(f"{where}: the prompt encodes to no tokens")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise KvtraceError(f"{where}: the tokenizer encodes the prompt to id {bad[0]}, outside the model's "
                               f"vocabulary [0, {vocab_size})")
        return ids
    if req.prompt_token_ids is not None:
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise KvtraceError(f"{where}: prompt_token_ids holds {bad[0]}, outside the model's "
                               f"vocabulary [0, {vocab_size})")
        return list(req.prompt_token_ids)
    assert req.prompt_tokens is not None, "a validated request has a prompt"
    prefix: list[int] = []
    if req.prefix_group is not None:
        prefix = synthetic_ids(f"prefix:{req.prefix_group}", req.prefix_tokens, vocab_size=vocab_size, seed=seed)
    for hash_id in req.hash_ids or ():
        prefix += _hash_block_ids(hash_id, req.hash_block_size, vocab_size, seed)
    own = synthetic_ids(f"request:{req.id}", req.prompt_tokens - len(prefix), vocab_size=vocab_size, seed=seed)
    if not prefix:   # (a copy of a long prompt costs as much as drawing it)
        return own
    prefix += own
    return prefix


def validate_lengths(requests: list[WorkloadRequest], prompt_lengths: list[int], max_model_len: int) -> None:
    """Raise one KvtraceError naming every request whose prompt leaves no room for one output token."""
    too_long = [f"{_where(req)}: {length} tokens" for req, length in zip(requests, prompt_lengths, strict=True)
                if length + 1 > max_model_len]
    if not too_long:
        return
    listed = "; ".join(too_long[:MAX_LISTED])
    if len(too_long) > MAX_LISTED:
        listed += f"; and {len(too_long) - MAX_LISTED} more"
    prompts = "1 prompt leaves" if len(too_long) == 1 else f"{len(too_long)} prompts leave"
    raise KvtraceError(f"{prompts} no room for an output token within max_model_len {max_model_len}: {listed}")


def workload_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes (recorded in a run's meta.json)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_workload(requests: Iterable[WorkloadRequest], path_or_file: str | os.PathLike | IO[str], *,
                  comments: Iterable[str] = ()) -> int:
    """Write requests as JSONL, after `# comment` lines; a path is written atomically. Returns the count.

    `requests` may be a lazy iterator: it is written as it comes.
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        with atomic_write(path_or_file) as f:
            return save_workload(requests, f, comments=comments)
    for comment in comments:
        for text in comment.splitlines():
            path_or_file.write(f"# {text}\n")
    count = 0
    for req in requests:
        path_or_file.write(json.dumps(req.to_json()) + "\n")
        count += 1
    return count
