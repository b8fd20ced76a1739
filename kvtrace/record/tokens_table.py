"""The tokens table: how the trace writer buffers a chunk's tokens (`TokenGrids`, each token's
request as a number: `RequestNumbers`) and the builder that makes the table of each chunk in turn
(`TokensTable`), finding each token's predecessor (prev_step, prev_ts_s), which may be in an earlier
chunk. A token grid, a trace chunk, a leap: docs/glossary.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvtrace.record.arrays import from_numpy, take_strings
from kvtrace.record.tables import table


class RequestNumbers(dict):
    """req_id -> int: each request numbered as it is first looked up (0, 1, ...); `names` the req_ids
    in that order. The tokens are buffered with their request's number (one int a token), and the
    table's req_id column is taken from the names."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __missing__(self, key: str) -> int:
        self[key] = number = len(self.names)
        self.names.append(key)
        return number


@dataclass(slots=True)
class TokenGrids:
    """A chunk's tokens as grids: sequences that each emit one token a step over some steps, in the
    same batch order every step (a step's tokens, one step; or a leap's). The rows are made
    with the table (`TokensTable`): a grid's i-th sequence's token at its j-th step has idx
    `idx[i] + j`."""

    num: list[int] = field(default_factory=list)       # each grid's sequences
    steps: list[int] = field(default_factory=list)     # each grid's steps
    step: list[int] = field(default_factory=list)      # each grid's first step
    ts_s: list[float] = field(default_factory=list)    # each step's time, grid after grid
    req: list[int] = field(default_factory=list)       # each grid's sequences' requests (RequestNumbers)
    sample: list[int] = field(default_factory=list)
    idx: list[int] = field(default_factory=list)       # each sequence's token idx at its grid's first step
    # each sequence's token id, when recorded (empty when not): a one-step grid's; a leap's are None
    token_id: list[int | None] = field(default_factory=list)
    # (req_id, sample) of the sequences finished since the last tokens chunk: no later token follows theirs
    finished: list[tuple[str, int]] = field(default_factory=list)
    num_rows: int = 0                                  # the rows the grids make


class TokensTable:
    """Makes the tokens table of each chunk's TokenGrids, the chunks in order: a token's
    predecessor (prev_step, prev_ts_s: its sequence's token before it) may be in an earlier chunk,
    so it keeps each live sequence's last token written."""

    def __init__(self, numbers: RequestNumbers, run_id: str) -> None:
        self.numbers = numbers   # (the engine's thread may number more requests while a table is made)
        self.run_id = run_id
        self._names = pa.array([], pa.string())   # numbers.names as Arrow strings, as far as taken
        # (req_id, sample) -> (step, ts_s) of its last token in the chunks made so far
        self._last_token: dict[tuple[str, int], tuple[int, float]] = {}

    def make(self, buffer: TokenGrids) -> pa.Table:
        """The chunk's rows run grid by grid, step by step, each step's in its grid's batch
        order. A token's predecessor is its sequence's token of the step before inside a grid; at a
        grid's first step, its sequence's last token before the grid (`_first_predecessors`)."""
        num = np.array(buffer.num, dtype=np.int64)   # a grid's sequences
        first_step = np.array(buffer.step, dtype=np.int64)
        ts_s = np.array(buffer.ts_s, dtype=np.float64)   # each step's
        req, sample, idx = (np.array(values, dtype=np.int64) for values in (buffer.req, buffer.sample, buffer.idx))
        grid_of = np.repeat(np.arange(len(num)), num)   # each sequence's grid
        if len(ts_s) == len(num):   # every grid a single step (always so in a real engine's run)
            member = None
            width = num   # each step's tokens
            step_number = first_step
            last_step = grid_of   # each sequence's last step in its grid
            first_row = np.arange(len(req))   # each sequence's row at its grid's first step
        else:
            steps = np.array(buffer.steps, dtype=np.int64)
            grid = np.repeat(np.arange(len(num)), steps)   # each step's
            grid_first_step = np.cumsum(steps) - steps
            j = np.arange(len(ts_s)) - grid_first_step[grid]   # each step's place in its grid
            width = num[grid]
            step_first_row = np.cumsum(width) - width
            grid_first_member = np.cumsum(num) - num
            member = (np.arange(int(width.sum()))   # each row's sequence
                      - np.repeat(step_first_row - grid_first_member[grid], width))
            idx = idx[member] + np.repeat(j, width)
            step_number = first_step[grid] + j
            last_step = (grid_first_step + steps - 1)[grid_of]
            first_row = (step_first_row[grid_first_step][grid_of]
                         + np.arange(len(req)) - grid_first_member[grid_of])
        step = np.repeat(step_number, width)
        num_rows = len(step)
        prev_step = step - 1
        prev_ts_s = np.repeat(np.roll(ts_s, 1), width)
        missing = np.zeros(num_rows, dtype=bool)
        prev_step[first_row], prev_ts_s[first_row], missing[first_row] = self._first_predecessors(
            req, sample, step_number[last_step], ts_s[last_step])
        for key in buffer.finished:
            self._last_token.pop(key, None)
        ids = buffer.token_id
        if ids.count(None) == len(ids):   # none recorded, or the simulator's placeholders
            token_id = pa.nulls(num_rows, pa.int32())
        else:
            none = np.fromiter((i is None for i in ids), dtype=bool, count=len(ids))
            values = np.array([0 if i is None else i for i in ids] if none.any() else ids, dtype=np.int64)
            if member is not None:
                values, none = values[member], none[member]
            token_id = from_numpy(values, pa.int32(), none)
        if member is not None:
            req, sample = req[member], sample[member]
        names = self.numbers.names
        if len(self._names) < len(names):
            self._names = pa.concat_arrays([self._names, pa.array(names[len(self._names):], pa.string())])
        columns = {"req_id": take_strings(self._names, req), "sample": from_numpy(sample, pa.int32()),
                   "idx": from_numpy(idx, pa.int32()), "token_id": token_id, "step": from_numpy(step, pa.int64()),
                   "ts_s": from_numpy(np.repeat(ts_s, width), pa.float64()),
                   "prev_step": from_numpy(prev_step, pa.int64(), missing),
                   "prev_ts_s": from_numpy(prev_ts_s, pa.float64(), missing)}
        return table("tokens", columns, self.run_id)

    def _first_predecessors(self, reqs: np.ndarray, samples: np.ndarray, last_steps: np.ndarray,
                            last_times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The predecessor (step, ts_s, missing) of each grid's sequence's first token in a chunk,
        given each one's last token's step and ts_s: its sequence's last token in the grid before,
        or in an earlier chunk (`_last_token`, which this updates), or none (a first token). A stable
        sort by sequence puts each right after the grid before it (a sequence is in a step at most
        once, steps in order); only a sequence's first and last grid in the chunk is looked at
        on its own."""
        num = len(reqs)
        names = self.numbers.names
        codes = reqs * (int(samples.max()) + 1) + samples
        order = np.argsort(codes, kind="stable")
        codes = codes[order]
        steps = last_steps[order]
        times = last_times[order]
        first = np.empty(num, dtype=bool)   # a sequence's first grid in the chunk
        first[0] = True
        np.not_equal(codes[1:], codes[:-1], out=first[1:])
        prev_step = np.empty(num, dtype=np.int64)
        prev_ts = np.empty(num, dtype=np.float64)
        prev_step[1:], prev_ts[1:] = steps[:-1], times[:-1]
        known = ~first
        sorted_samples = samples[order]
        sorted_req = reqs[order]
        last = self._last_token
        starts = np.flatnonzero(first)
        for i, req, sample in zip(starts.tolist(), sorted_req[starts].tolist(), sorted_samples[starts].tolist()):
            before = last.get((names[req], sample))
            if before is not None:
                prev_step[i], prev_ts[i] = before
                known[i] = True
        ends = np.append(starts[1:] - 1, num - 1)   # a sequence's last grid in the chunk
        for req, sample, step, ts_s in zip(sorted_req[ends].tolist(), sorted_samples[ends].tolist(),
                                           steps[ends].tolist(), times[ends].tolist()):
            last[(names[req], sample)] = (step, ts_s)
        unsorted_step = np.empty_like(prev_step)
        unsorted_ts = np.empty_like(prev_ts)
        unsorted_known = np.empty_like(known)
        unsorted_step[order], unsorted_ts[order], unsorted_known[order] = prev_step, prev_ts, known
        return unsorted_step, unsorted_ts, ~unsorted_known
