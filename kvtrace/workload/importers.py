"""Importers for public traces: Azure LLM inference (2023, 2024), BurstGPT, Mooncake, ShareGPT.

Every importer streams: rows are read one at a time and requests come out as they are read, so a
multi-million-row trace is never held in memory. A malformed row is skipped and counted under its
reason; a file with no usable row is an error.
"""
from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from pathlib import Path
from typing import IO

import numpy as np

from kvtrace.errors import KvtraceError
from kvtrace.workload.format import WorkloadRequest, encode_text, synthetic_ids
from kvtrace.workload.synth import next_gap

FORMATS = ("azure", "burstgpt", "mooncake", "sharegpt")
MOONCAKE_BLOCK_TOKENS = 512   # one Mooncake hash id stands for this many prompt tokens
CHARS_PER_TOKEN = 4           # the estimate used when ShareGPT text has no tokenizer


@dataclass
class ImportOptions:
    """What to take from a trace and how to shape it."""

    start_s: float = 0.0                 # skip the trace's first seconds
    duration_s: float | None = None      # then keep this many seconds
    sample: float | None = None          # keep each row with this probability (seeded)
    max_requests: int | None = None      # stop after this many requests
    seed: int = 0
    time_scale: float = 1.0              # arrivals this many times faster
    max_prompt_tokens: int | None = None  # clip (after scale)
    max_output_tokens: int | None = None  # clip (after scale)
    scale: float = 1.0                   # multiplies every length
    rate: float | None = None            # Poisson arrivals at this rate instead of the trace's times
    backlog: bool = False                # everything arrives at t = 0
    model: str | None = None             # ShareGPT: tokenise with this model's tokenizer
    vocab_size: int = 32000              # Mooncake: synthetic ids are drawn below this

    def __post_init__(self) -> None:
        if not self.start_s >= 0:
            raise ValueError(f"--start must be >= 0, got {self.start_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration_s}")
        if self.sample is not None and not 0 < self.sample <= 1:
            raise ValueError(f"--sample must be in (0, 1], got {self.sample}")
        for name in ("max_requests", "max_prompt_tokens", "max_output_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("time_scale", "scale", "rate"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.rate is not None and self.backlog:
            raise ValueError("give --rate or --backlog, not both")
        if self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be at least 2, got {self.vocab_size}")


class _Skip(str):
    """A skip reason among parsed JSON items (which may be strings themselves)."""


@dataclass
class _Row:
    """One usable row of a trace, before windowing and scaling."""

    key: str                             # becomes the request id (row number or the trace's own id)
    time_s: float | None                 # trace time; None where the trace has none (ShareGPT)
    prompt_tokens: int
    output_tokens: int
    hash_ids: list[int] | None = None    # Mooncake prefix blocks
    prompt_ids: list[int] | None = None  # ShareGPT, tokenised


@dataclass
class ImportResult:
    """An import in progress: `requests` is lazy, the counts fill in as it is consumed."""

    requests: Iterator[WorkloadRequest]
    comments: list[str] = field(default_factory=list)   # header lines for the output file
    num_requests: int = 0
    skipped: Counter = field(default_factory=Counter)   # reason -> rows
    num_clipped_prompts: int = 0
    num_clipped_outputs: int = 0

    def skipped_text(self) -> str:
        """'5: 3 bad timestamp, 2 zero output tokens'"""
        reasons = ", ".join(f"{count} {reason}" for reason, count in self.skipped.most_common())
        return f"{sum(self.skipped.values())}: {reasons}"

    def summary(self, source: str) -> str:
        """One line: what came in, what was skipped and clipped."""
        text = f"imported {self.num_requests} requests from {source}"
        if self.skipped:
            text += f"; skipped {self.skipped_text()}"
        if self.num_clipped_prompts or self.num_clipped_outputs:
            text += f"; clipped {self.num_clipped_prompts} prompts, {self.num_clipped_outputs} outputs"
        return text


def import_trace(fmt: str, path: str | Path, options: ImportOptions) -> ImportResult:
    """Open a trace of format `fmt` and return its requests (lazily) with the import's counts."""
    if fmt not in FORMATS:
        raise KvtraceError(f"unknown trace format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "sharegpt" and options.rate is None and not options.backlog:
        raise KvtraceError("sharegpt has no timestamps: give --rate (Poisson arrivals) or --backlog")
    if fmt == "sharegpt" and (options.start_s or options.duration_s):
        raise KvtraceError("sharegpt has no timestamps: --start and --duration do not apply (use --max-requests)")
    path = Path(path)
    if not path.is_file():
        raise KvtraceError(f"trace file not found: {path}")
    f = open(path, encoding="utf-8", errors="replace", newline="")
    try:
        result = _open_rows(fmt, f, path, options)
    except BaseException:
        f.close()
        raise
    return result


def _open_rows(fmt: str, f: IO, path: Path, options: ImportOptions) -> ImportResult:
    """Check the file's header and set up the lazy pipeline."""
    result = ImportResult(requests=iter(()))
    if fmt == "azure":
        rows = _csv_rows(f, path, "an Azure LLM inference trace", _azure_row,
                         ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    elif fmt == "burstgpt":
        rows = _csv_rows(f, path, "a BurstGPT trace", _burstgpt_row, ("Timestamp", "Request tokens", "Response tokens"))
    elif fmt == "mooncake":
        rows = _mooncake_rows(f)
    else:
        tokenizer, note = _sharegpt_tokenizer(options.model)
        if note:
            result.comments.append(note)
        rows = _sharegpt_rows(_json_array_items(f, path), tokenizer)
    result.requests = _requests(rows, options, result, f, path)
    return result


def _requests(rows: Iterator[_Row | str], opts: ImportOptions, result: ImportResult, f: IO, path: Path
              ) -> Iterator[WorkloadRequest]:
    """Window, sample, re-time, scale and clip rows into requests; a str row is a skip reason."""
    rng = np.random.default_rng(opts.seed)
    window_start = first_kept_s = None
    clock = 0.0

    def length(num_tokens: int, cap: int | None) -> tuple[int, bool]:
        scaled = max(1, round(num_tokens * opts.scale))
        return (scaled, False) if cap is None or scaled <= cap else (cap, True)

    with f:
        for row in rows:
            if isinstance(row, str):
                result.skipped[row] += 1
                continue
            if row.time_s is not None:
                if window_start is None:
                    window_start = row.time_s + opts.start_s
                if row.time_s < window_start and first_kept_s is None:
                    continue   # before --start
                if opts.duration_s is not None and row.time_s >= window_start + opts.duration_s:
                    break      # traces are sorted by time: nothing later is in the window
            if opts.sample is not None and rng.random() >= opts.sample:
                continue
            if opts.backlog:
                arrival_s = 0.0
            elif opts.rate is not None or row.time_s is None:
                arrival_s, clock = clock, clock + next_gap(rng, opts.rate, 1.0)
            else:
                first_kept_s = row.time_s if first_kept_s is None else first_kept_s
                arrival_s = (row.time_s - first_kept_s) / opts.time_scale
                if arrival_s < 0:
                    result.skipped["timestamp before the first kept row (trace not sorted)"] += 1
                    continue
            prompt_tokens, clipped_prompt = length(row.prompt_tokens, opts.max_prompt_tokens)
            max_tokens, clipped_output = length(row.output_tokens, opts.max_output_tokens)
            result.num_clipped_prompts += clipped_prompt
            result.num_clipped_outputs += clipped_output
            ids = None
            if row.hash_ids is not None:
                ids = _mooncake_ids(row, prompt_tokens, round(MOONCAKE_BLOCK_TOKENS * opts.scale) or 1, opts)
            elif row.prompt_ids is not None:
                ids = row.prompt_ids[:prompt_tokens]
            result.num_requests += 1
            # the trace records how many tokens were generated: that is where the request stopped
            # (the client's cap is not recorded, so max_tokens is the same count)
            if ids is None:
                yield WorkloadRequest(id=row.key, arrival_s=arrival_s, prompt_tokens=prompt_tokens,
                                      max_tokens=max_tokens, output_tokens=max_tokens, ignore_eos=True)
            else:
                yield WorkloadRequest(id=row.key, arrival_s=arrival_s, prompt_token_ids=ids,
                                      max_tokens=max_tokens, output_tokens=max_tokens, ignore_eos=True)
            if opts.max_requests is not None and result.num_requests >= opts.max_requests:
                break
    if not result.num_requests:
        skipped = f"skipped {result.skipped_text()}" if result.skipped else "nothing in the window or sample"
        raise KvtraceError(f"{path}: no request to import ({skipped})")


def _csv_rows(f: IO, path: Path, what: str, parse: Callable[[str, list[str], dict[str, int]], _Row | str],
              columns: tuple[str, ...]) -> Iterator[_Row | str]:
    """Rows of a CSV trace whose header must name `columns` (in any order, extra columns allowed)."""
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        raise KvtraceError(f"{path} is empty")
    index = {name.strip().lstrip("\ufeff"): i for i, name in enumerate(header)}
    missing = [name for name in columns if name not in index]
    if missing:
        raise KvtraceError(f"{path} is not {what}: its header lacks {', '.join(missing)} "
                           f"(expected {','.join(columns)})")

    def rows() -> Iterator[_Row | str]:
        for number, row in enumerate(reader, start=1):
            if not row:
                continue
            if len(row) != len(header):
                yield "wrong number of columns"
            else:
                yield parse(str(number), row, index)

    return rows()


_DATETIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(\.\d+)?\s*(Z|[+-]\d\d:?\d\d)?")


def parse_datetime(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (any number of fractional digits, optional zone) -> epoch seconds."""
    match = _DATETIME.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a date and time: {text!r}")
    moment = datetime(*map(int, match.groups()[:6]), tzinfo=timezone.utc)
    zone = match[8]
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        moment -= sign * timedelta(hours=int(zone[1:3]), minutes=int(zone[-2:]))
    return moment.timestamp() + float(match[7] or 0.0)


def _counted_row(key: str, time_s: float, row: list[str], index: dict[str, int], prompt: str, output: str,
                 zero_output: str = "zero output tokens") -> _Row | str:
    """The row with its token counts from columns `prompt` and `output`, or why it is skipped."""
    try:
        prompt_tokens, output_tokens = int(row[index[prompt]]), int(row[index[output]])
    except ValueError:
        return "token count not an integer"
    if min(prompt_tokens, output_tokens) < 0:
        return "negative token count"
    if output_tokens == 0:
        return zero_output
    return _Row(key, time_s, prompt_tokens, output_tokens) if prompt_tokens else "zero prompt tokens"


def _azure_row(key: str, row: list[str], index: dict[str, int]) -> _Row | str:
    try:
        time_s = parse_datetime(row[index["TIMESTAMP"]])
    except ValueError:
        return "bad timestamp"
    return _counted_row(key, time_s, row, index, "ContextTokens", "GeneratedTokens")


def _burstgpt_row(key: str, row: list[str], index: dict[str, int]) -> _Row | str:
    try:
        time_s = float(row[index["Timestamp"]])
    except ValueError:
        return "bad timestamp"
    # BurstGPT logs failed requests with 0 response tokens
    return _counted_row(key, time_s, row, index, "Request tokens", "Response tokens", "failed (0 response tokens)")


def _mooncake_rows(f: IO) -> Iterator[_Row | str]:
    """Mooncake JSONL: {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}."""
    for number, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            yield "not valid JSON"
            continue
        if not isinstance(obj, dict):
            yield "not a JSON object"
            continue
        values = [obj.get(name) for name in ("timestamp", "input_length", "output_length")]
        hash_ids = obj.get("hash_ids", [])
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            yield "missing or non-numeric timestamp, input_length or output_length"
        elif not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
            yield "hash_ids not a list of integers"
        elif values[1] < 1 or values[2] < 1:
            yield "zero or negative length"
        else:
            yield _Row(str(number), values[0] / 1000.0, int(values[1]), int(values[2]), hash_ids=hash_ids)


@lru_cache(maxsize=4096)
def _block_ids(hash_id: int, block_tokens: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    return tuple(synthetic_ids(f"mooncake-block:{hash_id}", block_tokens, vocab_size=vocab_size, seed=seed))


def _mooncake_ids(row: _Row, num_tokens: int, block_tokens: int, opts: ImportOptions) -> list[int]:
    """Prompt ids where equal hash ids give equal blocks, so shared prefixes hit the prefix cache.

      [block of hash_ids[0]][block of hash_ids[1]]...[last block, cut]  (each block_tokens long)
    Tokens beyond the listed blocks (rounding after scale) are unique to the request.
    """
    ids: list[int] = []
    for hash_id in row.hash_ids:
        if len(ids) >= num_tokens:
            break
        ids += _block_ids(hash_id, block_tokens, opts.vocab_size, opts.seed)
    if len(ids) < num_tokens:
        ids += synthetic_ids(f"mooncake-tail:{row.key}", num_tokens - len(ids), vocab_size=opts.vocab_size,
                             seed=opts.seed)
    return ids[:num_tokens]


_MAX_ITEM_CHARS = 64 << 20   # an item that does not parse within this much text is taken as invalid


def _json_array_items(f: IO, path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """The items of a JSON list, read a chunk at a time; an unfinished last item is a skip reason.

    ShareGPT copies are often cut off mid-item; every complete item before the cut is recovered.
    """
    decoder = json.JSONDecoder()
    buf = f.read(chunk_chars)
    if not buf.lstrip().startswith("["):
        raise KvtraceError(f"{path} is not a JSON list of conversations")
    pos = buf.index("[") + 1
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("no item", buf, pos)
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = f.read(chunk_chars) if len(buf) - pos < _MAX_ITEM_CHARS else ""
            if more:
                buf, pos = buf[pos:] + more, 0
                continue
            if buf.rstrip().endswith("]") or len(buf) - pos >= _MAX_ITEM_CHARS:
                yield _Skip("invalid JSON (the rest of the file was ignored)")
            elif pos < len(buf):
                yield _Skip("cut off at the end of the file")
            return
        yield item


def _sharegpt_tokenizer(model: str | None):
    """(tokenizer or None, a header note when lengths are estimated)."""
    estimate = f"lengths are estimated as characters / {CHARS_PER_TOKEN}"
    if model is None:
        return None, f"{estimate}: no --model given to tokenise with"
    from engine.model.tokenizer import load_tokenizer  # the engine's tokenizer stack is loaded only when needed

    tokenizer = load_tokenizer(model)  # a model that is not found is an error, not an estimate
    if tokenizer is None:
        return None, f"{estimate}: model {model!r} has no tokenizer"
    return tokenizer, None


_HUMAN = ("human", "user")
_ANSWER = ("gpt", "chatgpt", "bard", "assistant", "model")


def _sharegpt_rows(items: Iterator[object], tokenizer) -> Iterator[_Row | str]:
    """Prompt = the first human turn; output length = the answer that follows it."""
    seen_ids: set[str] = set()
    for number, item in enumerate(items, start=1):
        if isinstance(item, _Skip):
            yield str(item)
            continue
        if not isinstance(item, dict):
            yield "not a conversation"
            continue
        turns = item.get("conversations")
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            yield "no conversations list"
            continue
        roles = [t.get("from") for t in turns]
        human = next((i for i, role in enumerate(roles) if role in _HUMAN), None)
        answer = next((i for i in range(human + 1, len(turns)) if roles[i] in _ANSWER), None) if human is not None else None
        if human is None or answer is None:
            yield "no human turn with an answer"
            continue
        prompt, output = turns[human].get("value"), turns[answer].get("value")
        if not isinstance(prompt, str) or not isinstance(output, str) or not prompt.strip() or not output.strip():
            yield "empty or non-text turn"
            continue
        key = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else str(number)
        key = key if key not in seen_ids else f"{key}#{number}"
        seen_ids.add(key)
        if tokenizer is None:
            yield _Row(key, None, math.ceil(len(prompt) / CHARS_PER_TOKEN), math.ceil(len(output) / CHARS_PER_TOKEN))
            continue
        prompt_ids = encode_text(tokenizer, prompt)
        if not prompt_ids:
            yield "prompt encodes to no tokens"
            continue
        yield _Row(key, None, len(prompt_ids), max(1, len(encode_text(tokenizer, output))), prompt_ids=prompt_ids)
