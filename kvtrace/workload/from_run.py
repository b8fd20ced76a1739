"""A run's traffic as a workload (`kvtrace workload from-run`): what arrived, how long, and which
prompts shared which blocks, with no token content.

What is read, and from where (a run from kvtrace's engine, the simulator or a vLLM capture):

- meta.json: the block size (`kv_pool.block_size`, else `engine_config.block_size`), the vocabulary
  and seed (`model.shape.vocab`, `seed`) and the workload replayed (`workload.path`, `.sha256`).
- the requests table, one row per sequence: `arrival_s` (made relative to the first), `prompt_tokens`,
  `max_tokens`, `n`, `priority`, and `output_tokens` where a sample finished (`stop` / `length`: where it
  really stopped; the longest sample for n > 1); a request that never finished keeps only its cap.
- the prefix structure, as `hash_ids` at the run's block size, from the first of these that the run has:
  1. `tokens`: the prompts' ids, from the workload the run replayed when that file is still there
     with the recorded sha256 (text prompts need a tokenizer: then 2 or 3); each full block's chained
     hash of its ids. Exact.
  2. `hashes`: block hashes the run recorded: `capture_requests.block_hashes` (a window of live
     traffic, `kvtrace capture run`: salted per capture), a list column `block_hashes` of kv_events aligned with
     `blocks` on `alloc` / `prefix_hit` rows (a content-free capture's salted hashes), or a list column
     `block_hashes` / `hash_ids` of requests (the prompt's full blocks, in order).
  3. `kv_events`: which physical block each prompt block was, from the events (a `prefix_hit` maps a
     block whose content is the block's current one; an `alloc` gives a new content, or the content the
     sequence had at that position before a preemption; an `evict` ends one). This is the sharing the
     run's cache *saw*: a prefix evicted before it was asked for again counts as two contents.
  4. none (a run with no kv_events): plain count prompts, no sharing.
  Whatever the source, the ids are renumbered 0, 1, 2, ... in order of first appearance, so the file
  carries neither tokens nor the run's hash values.
- sampling (`temperature`, `top_p`, `seed`) from the replayed workload, matched by id, when it is
  there; a capture of live traffic does not record it, so it is left at the defaults (greedy).
- the vLLM whose scheduling the run made: a vLLM run's `vllm.version`, else the `engine_config.follow_vllm`
  a kvtrace run followed. Written in the header as `# follow_vllm: VERSION (...)` (kvtrace/workload/header.py),
  which `kvtrace record` follows unless told otherwise; a version kvtrace cannot follow gets a note
  instead, and the replay follows the default.

Window edges (a run of a window of live traffic, `kvtrace capture run`, says which requests were in flight
at its start and end in `capture_requests`; any run may hold requests that never finished):
- a request that arrived before the window keeps its arrival, so the replay starts it then and the
  workload begins before the window: the replay's first `window_start_s` seconds (the header says how
  many) are warm-up, and run into an empty pool and an empty prefix cache, where the server's held the
  blocks of requests that finished before the window;
- a request that finished keeps its real output length;
- a request that never finished (in flight at the window's end, or aborted) gets its output length by
  a rule, `unfinished`: `typical` (the default) the median output of the run's finished requests, or
  what it had produced if more, capped at its max_tokens; `seen` what it had produced (an answer biased
  low: it ends too soon); `max-tokens` its cap (biased high: live traffic's caps are far above its
  lengths). The rule and its figures are written into the workload's header and said by `kvtrace sweep`.

Order: requests are written by arrival; ties (a backlog) keep the replayed workload's order, else the
order of first admission in kv_events, so that a backlog replays in the run's queue order.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import VLLM_VERSION, VLLM_VERSIONS
from kvtrace.errors import KvtraceError
from kvtrace.trace import db
from kvtrace.workload.format import WorkloadRequest, load_workload, resolve_prompt_ids, workload_sha256
from kvtrace.workload.header import FOLLOW_NOTE, follow_vllm_line, followable

FINISHED = ("stop", "length")      # finish reasons whose output_tokens is where the sample really stopped
UNFINISHED_RULES = ("typical", "seen", "max-tokens")
HASH_COLUMNS = ("block_hashes", "hash_ids")


@dataclass
class FromRunResult:
    requests: list[WorkloadRequest]
    block_size: int
    prefix_source: str                    # tokens | hashes | kv_events | none
    num_unfinished: int = 0               # requests no sample of which finished: output_tokens left out
    notes: list[str] = field(default_factory=list)
    follow_vllm: str | None = None        # the vLLM version a replay should follow (one kvtrace can follow)
    followed: str | None = None           # why: what the run followed, for the header line
    edges: list[str] = field(default_factory=list)   # the window's edges and the unfinished rule, in words
    warmup_s: float | None = None         # a window's: the replay's seconds before the window's start

    def comments(self, run: Path) -> list[str]:
        follow = [follow_vllm_line(self.follow_vllm, self.followed)] if self.follow_vllm else []
        return [f"from run {run}: prefix structure from {self.prefix_source}, "
                f"hash_ids at block size {self.block_size}", *follow, *self.notes, *self.edges]

    def summary(self, run: Path, out: str) -> str:
        num_blocks = len({h for r in self.requests for h in r.hash_ids or ()})
        shared = sum(len(r.hash_ids or ()) for r in self.requests) - num_blocks
        text = (f"wrote {len(self.requests)} requests from {run} to {out}: prefix structure from "
                f"{self.prefix_source}, {num_blocks} distinct blocks of {self.block_size} tokens, {shared} shared")
        for edge in self.edges:
            text += f"; {edge}"
        if self.follow_vllm:
            text += f"; a replay follows vLLM {self.follow_vllm} ({self.followed})"
        for note in self.notes:
            if note.startswith(FOLLOW_NOTE):
                text += f"; {note}"
        return text


def _refuse(run: Path, why: str) -> KvtraceError:
    return KvtraceError(f"{run}: cannot be turned into a workload: {why}")


def _meta_int(meta: dict, *paths: tuple[str, ...]) -> int | None:
    for path in paths:
        value: object = meta
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def workload_from_run(run: Path, unfinished: str = "typical") -> FromRunResult:
    """The run's requests as a workload; raise KvtraceError (one line) on a run that cannot be one.
    `unfinished`: the rule for the output length of a request that never finished (UNFINISHED_RULES)."""
    if unfinished not in UNFINISHED_RULES:
        raise KvtraceError(f"--unfinished {unfinished!r}: one of {', '.join(UNFINISHED_RULES)}")
    run = Path(run)
    if not run.is_dir():
        raise KvtraceError(f"run folder not found: {run}")
    if not (run / db.META_FILE).exists():
        raise _refuse(run, "no meta.json (not a run folder)")
    meta = db.read_meta(run)
    block_size = _meta_int(meta, ("kv_pool", "block_size"), ("engine_config", "block_size"))
    if block_size is None:
        raise _refuse(run, "meta.json gives no block size (kv_pool.block_size)")
    con = db.connect([run])
    # a fleet's traffic is no one engine's workload, and each server salts its prefix hashes its own way
    db.one_server_each(con, "a workload")
    columns = {row[0] for row in con.execute("DESCRIBE SELECT * FROM requests").fetchall()}
    rows = con.execute("""
        SELECT req_id, sample, n, priority, arrival_s, prompt_tokens, max_tokens, output_tokens, finish_reason
        FROM requests ORDER BY req_id, sample""").fetchall()
    if not rows:
        raise _refuse(run, "its requests table is empty")
    by_id: dict[str, list[tuple]] = defaultdict(list)
    for row in rows:
        by_id[row[0]].append(row)
    bad = [rid for rid, samples in by_id.items()
           if any(s[4] is None or not s[5] or s[5] < 1 or s[6] is None or s[6] < 1 for s in samples)]
    if bad:
        raise _refuse(run, f"{len(bad)} request(s) lack an arrival time, a prompt length or max_tokens "
                           f"(first: {bad[0]!r})")
    workload = _replayed_workload(run, meta)
    order = _queue_order(con, workload)
    ids = sorted(by_id, key=lambda rid: (min(s[4] for s in by_id[rid]), order.get(rid, len(order)), rid))
    prompt_tokens = {rid: by_id[rid][0][5] for rid in ids}
    sampled = set() if workload else _sampled_requests(con)
    source, hashes = _prefix_structure(con, columns, meta, workload, prompt_tokens, block_size)
    renumbered = _renumber([hashes.get(rid, []) for rid in ids])
    origin = min(s[4] for s in rows)
    finished = sorted(s[7] for s in rows if s[8] in FINISHED and s[7])
    typical = finished[len(finished) // 2] if finished else None
    requests, num_unfinished = [], 0
    for rid, hash_ids in zip(ids, renumbered):
        samples = by_id[rid]
        first = samples[0]
        max_tokens = max(s[6] for s in samples)
        stopped = [s[7] for s in samples if s[8] in FINISHED and s[7]]
        num_unfinished += not stopped
        output_tokens = min(max(stopped), max_tokens) if stopped else _unfinished_length(
            unfinished, max((s[7] or 0) for s in samples), typical, max_tokens)
        if output_tokens == max_tokens and any(s[8] == "length" for s in samples):
            output_tokens = None   # it ran to its cap: replayed the same, with reason `length`
        given = workload.get(rid) if workload else None
        if given is not None:
            sampling = {"temperature": given.temperature, "top_p": given.top_p, "seed": given.seed}
        else:
            sampling = {"temperature": 1.0} if rid in sampled else {}
        requests.append(WorkloadRequest(
            id=rid, arrival_s=max(0.0, min(s[4] for s in samples) - origin), prompt_tokens=first[5],
            max_tokens=max_tokens, output_tokens=output_tokens, n=max(first[2] or 1, len(samples)),
            priority=first[3] or 0, hash_ids=hash_ids if source != "none" else None,
            hash_block_size=block_size if source != "none" else None, **sampling))
    notes = [] if workload else [f"sampling: not in the run (no replayed workload file): greedy, except "
                                 f"temperature 1.0 for the {len(sampled)} request(s) whose samples' tokens differ"]
    follow_vllm, followed, note = run_follow_vllm(meta)
    if note:
        notes.append(note)
    edges, warmup_s = _edges(con, meta, origin, num_unfinished, unfinished, typical, len(finished))
    return FromRunResult(requests, block_size, source, num_unfinished, notes, follow_vllm, followed, edges, warmup_s)


def _unfinished_length(rule: str, seen: int, typical: int | None, max_tokens: int) -> int | None:
    """The output length a request that never finished is replayed with (None: to its max_tokens)."""
    if rule == "max-tokens" or (rule == "typical" and typical is None):
        return None
    length = max(seen, 1) if rule == "seen" else max(seen, typical)
    return None if length >= max_tokens else length


def _edges(con, meta: dict, origin: float, num_unfinished: int, rule: str, typical: int | None,
           num_finished: int) -> tuple[list[str], float | None]:
    """The window's edges and the unfinished rule in words (the header's lines), and a window's warm-up."""
    edges = []
    if num_unfinished:
        how = {"seen": "what each had produced (biased low: they end too soon)",
               "max-tokens": "each one's max_tokens (biased high: caps are far above real lengths)",
               "typical": (f"the median output of the {num_finished} finished requests, {typical} tokens, or what "
                           f"each had produced if more, capped at its max_tokens" if typical is not None else
                           "each one's max_tokens (no request finished, so there is no typical length)")}[rule]
        edges.append(f"unfinished: {num_unfinished} request(s) never finished in the run; their output length "
                     f"by rule {rule}: {how}")
    window = (meta.get("capture") or {}).get("window") if isinstance(meta.get("capture"), dict) else None
    if not isinstance(window, dict) or window.get("start_s") is None:
        return edges, None
    at_start, at_end = con.execute("SELECT count(*) FILTER (in_flight_at_start), count(*) FILTER (in_flight_at_end) "
                                   "FROM capture_requests").fetchone()
    warmup_s = max(0.0, float(window["start_s"]) - origin)
    edges.append(f"window: {at_start} request(s) were in flight at its start, {at_end} at its end; those "
                 f"before it are replayed from their arrivals, so a replay's first {warmup_s:.1f} s are warm-up, "
                 f"into an empty pool and an empty prefix cache (the server's held the blocks of requests "
                 f"finished before the window)")
    return edges, warmup_s


def run_follow_vllm(meta: dict) -> tuple[str | None, str | None, str | None]:
    """(version a replay should follow, what the run followed, a note): from a vLLM run's `vllm.version`,
    else a kvtrace run's `engine_config.follow_vllm`. A version kvtrace cannot follow gives no version
    and a note saying the replay follows the default; a run that names none gives (None, None, None)."""
    vllm = meta.get("vllm") if isinstance(meta.get("vllm"), dict) else {}
    config = meta.get("engine_config") if isinstance(meta.get("engine_config"), dict) else {}
    if isinstance(vllm.get("version"), str) and vllm["version"]:
        named, followed = vllm["version"], f"the run is vLLM {vllm['version']}'s"
    elif isinstance(config.get("follow_vllm"), str) and config["follow_vllm"]:
        named, followed = config["follow_vllm"], f"the run's engine followed vLLM {config['follow_vllm']}"
    else:
        return None, None, None
    version = followable(named)
    if version is None:
        return None, None, (f"{FOLLOW_NOTE} the run is vLLM {named}'s, which kvtrace cannot follow (it follows "
                            f"{', '.join(VLLM_VERSIONS)}): a replay follows the default {VLLM_VERSION} "
                            f"unless --follow-vllm says otherwise")
    return version, followed, None


def _replayed_workload(run: Path, meta: dict) -> dict[str, WorkloadRequest] | None:
    """The workload the run replayed, by id, when its file is still there unchanged; else None."""
    info = meta.get("workload") if isinstance(meta.get("workload"), dict) else {}
    path, sha256 = info.get("path"), info.get("sha256")
    if not isinstance(path, str) or not isinstance(sha256, str):
        return None
    candidates = [Path(path)] if Path(path).is_absolute() else [Path(path), run / path]
    for candidate in candidates:
        try:
            if candidate.is_file() and workload_sha256(candidate) == sha256:
                return {r.id: r for r in load_workload(candidate)}
        except (OSError, KvtraceError):
            continue
    return None


def _sampled_requests(con) -> set[str]:
    """Requests of n > 1 whose samples' recorded token ids differ (so they were not greedy)."""
    rows = con.execute("""
        WITH samples AS (
            SELECT req_id, list(token_id ORDER BY idx) AS ids FROM tokens
            WHERE token_id IS NOT NULL GROUP BY req_id, sample),
        cut AS (   -- each sample's ids up to the shortest sample's length
            SELECT req_id, ids[1:min(len(ids)) OVER (PARTITION BY req_id)] AS ids FROM samples)
        SELECT req_id FROM cut GROUP BY req_id HAVING count(DISTINCT ids) > 1""").fetchall()
    return {row[0] for row in rows}


def _queue_order(con, workload: dict[str, WorkloadRequest] | None) -> dict[str, int]:
    """Rank of each request among equal arrivals: the workload's order, else first admission."""
    if workload is not None:
        return {rid: i for i, rid in enumerate(workload)}
    admitted = con.execute("""
        SELECT req_id FROM kv_events WHERE kind = 'admit' AND req_id <> ''
        GROUP BY req_id ORDER BY min(seq)""").fetchall()
    return {row[0]: i for i, row in enumerate(admitted)}


def _prefix_structure(con, request_columns: set[str], meta: dict, workload: dict[str, WorkloadRequest] | None,
                      prompt_tokens: dict[str, int], block_size: int) -> tuple[str, dict[str, list]]:
    """(source, req_id -> one content key per full prompt block, in order)."""
    if workload is not None:
        hashes = _hashes_from_tokens(meta, workload, prompt_tokens, block_size)
        if hashes is not None:
            return "tokens", hashes
    event_columns = {row[0] for row in con.execute("DESCRIBE SELECT * FROM kv_events").fetchall()}
    # a window of live traffic (kvtrace capture run): the prompt's salted block hashes, per request
    captured = {rid: list(values[: prompt_tokens[rid] // block_size]) for rid, values in con.execute(
        "SELECT req_id, block_hashes FROM capture_requests WHERE block_hashes IS NOT NULL ORDER BY req_id"
    ).fetchall() if rid in prompt_tokens}
    if captured:
        return "hashes", captured
    recorded = next((c for c in HASH_COLUMNS if c in request_columns), None)
    if recorded is not None:
        hashes = {}
        for rid, values in con.execute(f'SELECT req_id, "{recorded}" FROM requests ORDER BY req_id, sample'):
            if isinstance(values, list) and rid not in hashes:
                hashes[rid] = list(values[: prompt_tokens[rid] // block_size])
        if hashes:
            return "hashes", hashes
    if con.execute("SELECT count(*) FROM kv_events").fetchone()[0] == 0:
        return "none", {}
    with_hashes = "block_hashes" in event_columns
    hashes = _hashes_from_events(con, prompt_tokens, block_size, with_hashes)
    return ("hashes" if with_hashes else "kv_events"), hashes


def _hashes_from_tokens(meta: dict, workload: dict[str, WorkloadRequest], prompt_tokens: dict[str, int],
                        block_size: int) -> dict[str, list] | None:
    """Chained hashes of each prompt's full blocks of ids; None if a prompt cannot be rebuilt as the run had it."""
    vocab = _meta_int(meta, ("model", "shape", "vocab"))
    seed = meta.get("seed") if isinstance(meta.get("seed"), int) else 0
    if vocab is None:
        return None
    hashes = {}
    for rid, num_tokens in prompt_tokens.items():
        req = workload.get(rid)
        if req is None:
            return None
        try:
            ids = resolve_prompt_ids(req, vocab_size=vocab, seed=seed)
        except KvtraceError:   # a text prompt: no tokenizer here
            return None
        if len(ids) != num_tokens:
            return None
        chain: list = []
        for start in range(0, num_tokens - block_size + 1, block_size):
            chain.append(hash((chain[-1] if chain else None, tuple(ids[start:start + block_size]))))
        hashes[rid] = chain
    return hashes


def _hashes_from_events(con, prompt_tokens: dict[str, int], block_size: int, with_hashes: bool) -> dict[str, list]:
    """A content key per full prompt block of each request, from the blocks its first sample was given.

    content[block]: what a physical block holds now. Per sequence, `known[position]` is the content it
    had at each block position (a re-prefill after a preemption recomputes the same content, so it is
    kept across preemptions; a swap-in restores it).
    """
    fresh = itertools.count()
    content: dict[int, object] = {}
    known: dict[tuple[str, int], dict[int, object]] = defaultdict(dict)
    position: dict[tuple[str, int], int] = defaultdict(int)
    hash_column = ", block_hashes" if with_hashes else ", NULL"
    query = f"""SELECT kind, req_id, sample, blocks, reason{hash_column} FROM kv_events
                WHERE kind IN ('alloc', 'prefix_hit', 'preempt', 'evict') ORDER BY seq"""
    cursor = con.execute(query)
    for kind, rid, sample, blocks, reason, recorded in itertools.chain.from_iterable(
            iter(lambda: cursor.fetchmany(1 << 16), [])):
        blocks = blocks or []
        key = (rid, sample)
        if kind == "preempt":
            position[key] = 0
            continue
        if kind == "evict":
            for block in blocks:
                content.pop(block, None)
            continue
        if kind == "alloc" and reason == "cow":   # a fork's copy of its last block: not a prompt block
            for block in blocks:
                content[block] = ("fresh", next(fresh))
            continue
        seen = known[key]
        for i, block in enumerate(blocks):
            pos = position[key]
            position[key] = pos + 1
            value = recorded[i] if isinstance(recorded, list) and i < len(recorded) else None
            if value is not None:        # the run's own hash of the block
                content[block] = ("hash", value)
            elif kind == "alloc":        # computed here: what this position held before, else new
                content[block] = seen.get(pos) or ("fresh", next(fresh))
            elif block not in content:   # a hit on a block whose content the events never showed
                content[block] = ("fresh", next(fresh))
            seen.setdefault(pos, content[block])
    first_sample: dict[str, int] = {}
    for rid, sample in known:
        first_sample[rid] = min(sample, first_sample.get(rid, sample))
    hashes = {}
    for rid, num_tokens in prompt_tokens.items():
        seen = known.get((rid, first_sample[rid]), {}) if rid in first_sample else {}
        hashes[rid] = [seen.get(pos) or ("fresh", next(fresh)) for pos in range(num_tokens // block_size)]
    return hashes


def _renumber(chains: list[list]) -> list[list[int]]:
    """Every content key as a small integer, in order of first appearance."""
    numbers: dict[object, int] = {}
    return [[numbers.setdefault(value, len(numbers)) for value in chain] for chain in chains]
