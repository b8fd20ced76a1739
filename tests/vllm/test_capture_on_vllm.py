"""kvtrace's capture on vLLM's own scheduler classes: the events it writes are vLLM's decisions.

The differential's driver (tests/vllm_sched/vllm_driver.py --capture) builds kvtrace's
`KvtraceCaptureScheduler` (which becomes the capture's subclass of vLLM's `Scheduler` or
`AsyncScheduler`) in each vLLM venv the differential gets (KVTRACE_VLLM_PYTHON, the 0.32.0 CPU build,
and KVTRACE_VLLM_SCHED_PYTHONS, e.g. scripts/vllm_sched_env.sh's 0.33.0), with
KVTRACE_CAPTURE_SELF_CHECK=1, steps generated workloads with placeholder model outputs, and records
vLLM's own decisions every step. Checked here, on kvtrace's side, for every workload:
- the capture's self-check (the pool replayed from its events against the pool's own) found nothing,
  and its writer had no error;
- one steps row per `schedule()`: free and cached blocks and the preemption count are vLLM's;
- per step, the admissions (new or resumed, prefix-hit tokens, every block given) and their order,
  the victims in order, the new blocks of running requests and the requests freed are vLLM's;
- block accounting balances: a block allocated is held by no request, a freed block was the
  request's, nothing is held at the end, the pool is whole again, and every request has its row;
- the capture's tables are kvtrace's own trace of the same workload (its simulator, which makes vLLM's
  decisions: test_sched_differential.py): every steps row (tokens by kind, queues, pool, KV tokens,
  why admission stopped), every kv_events row (kind, request, blocks, tokens, reason, cached and
  recomputed positions, a preemption's requester and victim reason), the step each token was
  emitted in, every request's row; and an arrivals row per request with its prompt and limits.

KVTRACE_CAPTURE_WORKLOADS sets the workloads per scheduler class and version (default 30). The last
test runs `python -m benchmarks vllm-capture-cost` at 8 requests, on the last vLLM Python given.

KVTRACE_CAPTURE_DRIVERS (socket paths, os.pathsep between them) sends the first test to drivers
already running (`tests/vllm_sched/vllm_driver.py --serve`, one per vLLM venv), a session each, in
which the capture is this checkout's kvtrace/vllm/capture package loaded from its files: the test
then starts no vLLM (it is not marked `vllm`), and scripts/mutation.py runs it with the capture's
other tests that need no vLLM, a mutant planted in a scratch copy, one vLLM import for the whole run
rather than one per mutant. A failing workload is then not shrunk (a mutant needs only to fail).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from engine.config import VLLM_VERSIONS
from engine.events import with_evictions
from tests.helpers.vllm_runs import VLLM_MARKS
from tests.vllm_sched import kvtrace_side
from tests.vllm_sched.differential import VllmScheduler
from tests.vllm_sched.test_sched_differential import PYTHONS, venv_name
from tests.vllm_sched.workloads import workloads

NUM_WORKLOADS = int(os.environ.get("KVTRACE_CAPTURE_WORKLOADS", "30"))
DRIVERS = [p for p in os.environ.get("KVTRACE_CAPTURE_DRIVERS", "").split(os.pathsep) if p]
# a mutant needs only to fail: no shrinking of its failing workload
PHASES = (Phase.explicit, Phase.generate) if DRIVERS else tuple(Phase)


def starts_vllm(unless: bool = False):
    """A test's `vllm` marks (and their skip without a vLLM venv), unless it starts no vLLM."""
    def mark(test):
        for marker in [] if unless else VLLM_MARKS:
            test = marker(test)
        return test
    return mark


@pytest.fixture(scope="module", params=DRIVERS or PYTHONS or ["none"],
                ids=lambda p: f"driver{DRIVERS.index(p)}" if p in DRIVERS else venv_name(p))
def vllm(request):
    from kvtrace.vllm.record import model_folder

    if DRIVERS:
        scheduler = VllmScheduler("", "", capture=True, socket=request.param)
    else:
        scheduler = VllmScheduler(request.param, str(model_folder("smollm2-135m")), capture=True)
    yield scheduler
    scheduler.close()


def capture_differences(workload: dict, records: list[dict], answer: dict) -> list[str]:
    """What the capture of one workload says otherwise than vLLM's own records (empty: nothing)."""
    from kvtrace.vllm.importer import read_chunks

    folder = Path(answer["capture"])
    problems: list[str] = []
    done = json.loads((folder / "done.json").read_text())
    if answer["vllm_shutdown"] != [True]:
        problems.append(f"vLLM's own Scheduler.shutdown ran {len(answer['vllm_shutdown'])} times, not once")
    if done["self_check_errors"] or done["writer_error"]:
        problems.append(f"self-check: {done['self_check_errors']} errors {done['self_check_examples'][:3]}, "
                        f"writer {done['writer_error']}")
    if done["self_check_steps"] == 0 and workload.get("env", {}).get("KVTRACE_CAPTURE_SELF_CHECK") != "0":   # (unchecked's)
        problems.append("the self-check never ran")
    columns = read_chunks(folder)
    for table, cols in columns.items():   # a row is one value in every column
        lengths = {name: len(values) for name, values in cols.items()}
        if len(set(lengths.values())) > 1:
            problems.append(f"{table}: columns of different lengths {lengths}")
    s = columns["steps"]
    order = sorted(range(len(s["step"])), key=lambda i: s["step"][i])
    if [s["step"][i] for i in order] != list(range(len(records))):
        problems.append(f"steps rows {sorted(s['step'])}, vLLM scheduled {len(records)} times")
        return problems
    asynchronous = workload["config"]["async"]
    events: dict[int, list] = defaultdict(list)
    k = columns["kv_events"]
    for i in sorted(range(len(k["seq"])), key=lambda i: k["seq"][i]):
        events[k["step"][i]].append((k["kind"][i], k["req_id"][i], k["blocks"][i] or [], k["num_tokens"][i],
                                     k["reason"][i], k["kv_group"][i], k["kv_group_blocks"][i]))
    groups = len(workload["config"].get("kv_cache_groups", ["full"]))
    # async: a step's output is processed (its requests freed) in the driver's next step, after that step's
    # scheduling; a request that scheduling gave blocks or dropped blocks of (speculative decoding schedules
    # one whose last tokens are in flight) and that the output then finished has its finish filed with the
    # later step, after those events, as the pool saw them. (Given blocks and then preempted, vLLM's records
    # do not say: the capture's alloc says, and the balance below checks the preemption's blocks.) One it
    # only preempted keeps its finish in the output's step, before the preemption
    finished_at: dict[int, list[str]] = defaultdict(list)
    for n, rec in enumerate(records):
        touched = {e[0] for e in rec["grown"] + rec.get("dropped", [])}
        touched |= {e[1] for e in events.get(n, []) if e[0] == "alloc" and e[1] in rec["preempted"]}
        late = [rid for rid in rec["finished"] if asynchronous and rid in touched]
        finished_at[n - asynchronous] += [rid for rid in rec["finished"] if rid not in late]
        finished_at[n] = late + finished_at[n]
    held: dict[str, set[int]] = {}
    released: dict[str, set[int]] = {}   # a victim's blocks, from its preempt event
    ended: dict[str, set[int]] = {}      # a finished request's blocks
    for n, i in enumerate(order):
        rec = records[n]
        got = {"num_free": s["free_blocks"][i], "num_cached": s["cached_blocks"][i], "preemptions": s["preemptions"][i]}
        want = {"num_free": rec["num_free"], "num_cached": rec["num_cached"], "preemptions": len(rec["preempted"])}
        if got != want:
            problems.append(f"step {n}: steps row {got}, vLLM {want}")
        step = events.get(n, [])
        # each request's blocks given this step, group by group as vLLM's tables hold them (a hybrid
        # model's: a prefix hit's blocks are every group's, each alloc's one group's)
        admitted, hits, given = [], {}, defaultdict(lambda: [[] for _ in range(groups)])
        for kind, rid, ids, num, reason, group, group_blocks in step:
            if kind == "admit":
                admitted.append(rid)
            elif kind == "prefix_hit":
                hits[rid] = num
                at = 0
                for g, count in enumerate(group_blocks or [len(ids)]):
                    given[rid][g] += ids[at:at + count]
                    at += count
            elif kind == "alloc":
                given[rid][group or 0] += ids
        blocks = {rid: [b for ids in per_group for b in ids] for rid, per_group in given.items()}
        mine = [[rid, "resumed" if any(e[0] == "admit" and e[1] == rid and e[4] == "resume-recompute"
                                       for e in step) else "new", hits.get(rid, 0), blocks.get(rid, [])] for rid in admitted]
        theirs = rec["admitted"]
        if mine != theirs:
            problems.append(f"step {n}: admissions {mine}, vLLM {theirs}")
        scheduled = {rid for rid, _ in rec["scheduled"]}   # a request can get blocks, then be preempted
        grown = sorted([rid, ids] for rid, ids in blocks.items() if rid not in admitted and ids and rid in scheduled)
        if grown != sorted(rec["grown"]):
            problems.append(f"step {n}: new blocks {grown}, vLLM {sorted(rec['grown'])}")
        if "given" in rec:   # several KV-cache groups: what each window dropped, and what each group gave
            windows = sorted([rid, group or 0, sorted(ids)] for kind, rid, ids, _, reason, group, _ in step
                             if kind == "free" and reason in ("window", "state"))
            if windows != rec["dropped"]:
                problems.append(f"step {n}: dropped out of windows {windows}, vLLM {rec['dropped']}")
            kept = defaultdict(lambda: [[] for _ in range(groups)])   # vLLM's tables after the step hold
            for kind, rid, ids, _, reason, group, group_blocks in step:   # what was given and not dropped since
                if kind in ("prefix_hit", "alloc"):
                    at = 0
                    for g, count in ([(group or 0, len(ids))] if kind == "alloc"
                                     else enumerate(group_blocks or [len(ids)])):
                        kept[rid][g] += ids[at:at + count]
                        at += count
                elif kind == "free" and reason in ("window", "state"):
                    kept[rid][group or 0] = [b for b in kept[rid][group or 0] if b not in ids]
            mine_given = sorted([rid, per_group] for rid, per_group in kept.items() if rid in scheduled)
            mine_given = [[rid, per_group] for rid, per_group in mine_given if any(per_group)]
            if mine_given != rec["given"]:
                problems.append(f"step {n}: blocks given per group {mine_given}, vLLM {rec['given']}")
        victims = [e[1] for e in step if e[0] == "preempt"]
        if victims != rec["preempted"]:
            problems.append(f"step {n}: victims {victims}, vLLM {rec['preempted']}")
        finished = [e[1] for e in step if e[0] == "finish"]
        if n + asynchronous < len(records) and finished != finished_at[n]:
            problems.append(f"step {n}: finished {finished}, vLLM {finished_at[n]}")
        for kind, rid, ids, _, reason, group, _ in step:   # the balance
            if kind == "alloc":
                taken = [b for b in ids if any(b in h for h in held.values())]
                if taken:
                    problems.append(f"step {n}: {rid} allocated {taken}, still held")
                held.setdefault(rid, set()).update(ids)
            elif kind == "prefix_hit":
                held.setdefault(rid, set()).update(ids)
            elif kind == "free" and (reason in ("window", "state") or reason == "other" and rid):
                # a hybrid model's, mid-request; or a request's given back otherwise (a failed load, vLLM 0.34)
                stray = set(ids) - held.get(rid, set())
                if stray:
                    problems.append(f"step {n}: {rid} dropped {sorted(stray)} out of its window, not its own")
                held.get(rid, set()).difference_update(ids)
            elif kind == "free" and reason in ("finish", "preempt"):
                # a preemption's event comes before the frees it causes, a finish's after its frees
                own = released.get(rid, set()) if reason == "preempt" else held.get(rid, set())
                stray = set(ids) - own
                if stray:
                    problems.append(f"step {n}: {rid} freed {sorted(stray)}, not its own")
            elif kind == "preempt":
                # async: a request whose last token is in flight can be preempted by the next step's
                # scheduling, which runs before that token's output frees it: its finish, filed under its
                # own step, then comes first
                released[rid] = held.pop(rid, None) or ended.pop(rid, set())
                if set(ids) != released[rid]:
                    problems.append(f"step {n}: {rid} preempted holding {sorted(ids)}, the events gave it "
                                    f"{sorted(released[rid])}")
            elif kind == "finish":
                ended[rid] = held.pop(rid, set())
    if any(held.values()):
        problems.append(f"held at the end: {held}")
    if answer["final_free"] != workload["config"]["num_blocks"]:
        problems.append(f"{answer['final_free']} blocks free at the end of {workload['config']['num_blocks']}")
    samples = {f"{r['id']}:{i}" for r in workload["requests"] for i in range(r.get("n", 1))}
    if set(columns["requests"]["req_id"]) != samples or len(columns["requests"]["req_id"]) != len(samples):
        problems.append(f"request rows {sorted(columns['requests']['req_id'])}, vLLM ran {sorted(samples)}")
    problems += token_differences(columns, records, answer)
    return problems


def token_differences(columns: dict, records: list[dict], answer: dict) -> list[str]:
    """The capture's tokens against what vLLM's update_from_output delivered (the driver's
    "delivered": step, request, new tokens): as many rows per step and request, each request's
    numbered 0, 1, ... in the order delivered, its row's output count the sum; and each steps row's
    prefill and decode tokens add up to what vLLM scheduled."""
    problems: list[str] = []
    t = columns["tokens"]
    got: dict[tuple, list[int]] = defaultdict(list)
    for step, rid, idx in sorted(zip(t["step"], t["req_id"], t["idx"])):
        got[step, rid].append(idx)
    want: dict[tuple, int] = defaultdict(int)
    for step, rid, k in answer["delivered"]:
        if k:
            want[step, rid] += k
    counts = {key: len(v) for key, v in got.items()}
    if counts != want:
        wrong = sorted(set(counts.items()) ^ set(want.items()))[:6]
        problems.append(f"tokens rows per (step, request) differ from vLLM's outputs at {wrong}")
    numbered: dict[str, list[int]] = defaultdict(list)
    for (_, rid), idx in sorted(got.items()):
        numbered[rid] += idx
    for rid, idx in numbered.items():
        if idx != list(range(len(idx))):
            problems.append(f"{rid}'s tokens numbered {idx[:12]}, not 0, 1, ...")
    q = columns["requests"]
    outputs = {rid: n for rid, n in zip(q["req_id"], q["output_tokens"])}
    delivered = defaultdict(int)
    for _, rid, k in answer["delivered"]:
        delivered[rid] += k
    wrong = {rid: (outputs.get(rid), n) for rid, n in delivered.items() if outputs.get(rid) != n}
    if wrong:
        problems.append(f"request rows' output tokens (capture, vLLM): {dict(list(wrong.items())[:6])}")
    s = columns["steps"]
    for step, prefill, decode in zip(s["step"], s["prefill_tokens"], s["decode_tokens"]):
        scheduled = sum(n for _, n in records[step]["scheduled"])
        if prefill + decode != scheduled:
            problems.append(f"step {step}: {prefill} prefill + {decode} decode tokens, vLLM scheduled {scheduled}")
    return problems


STEP_COLUMNS = ["step", "prefill_tokens", "decode_tokens", "recompute_tokens", "running", "waiting", "preemptions",
                "free_blocks", "used_blocks", "cached_blocks", "total_blocks", "kv_tokens", "admission_stop"]
EVENT_COLUMNS = ["step", "kind", "req_id", "blocks", "num_tokens", "reason", "num_cached_tokens",
                 "num_recomputed_tokens", "requester_req_id", "victim_reason"]
REQUEST_COLUMNS = ["req_id", "prompt_tokens", "max_tokens", "priority", "output_tokens", "finish_reason", "preemptions",
                   "recomputed_tokens", "prefix_hit_tokens"]


class KeepSteps:
    """kvtrace's engine's tracer: every step record."""

    def __init__(self) -> None:
        self.records: list = []

    def on_step(self, record) -> None:
        self.records.append(record)


def kvtrace_tables(records: list) -> dict[str, list]:
    """kvtrace's own trace of a workload, as the rows compared with the capture's (request ids as the
    driver names vLLM's requests, "id:sample")."""
    def rid(req_id, sample):
        return f"{req_id}:{sample}" if req_id else (req_id or "")
    tables: dict[str, list] = {"steps": [], "kv_events": [], "tokens": [], "requests": []}
    for r in records:
        tables["steps"].append((r.step, r.num_prefill_tokens, r.num_decode_tokens, r.num_recompute_tokens,
                                r.num_running, r.num_waiting, r.num_preemptions, r.num_free_blocks, r.num_used_blocks,
                                r.num_cached_blocks, r.num_total_blocks, r.num_kv_tokens, r.admission_stop))
        for e in with_evictions(sorted(r.events, key=lambda e: e.seq)):
            tables["kv_events"].append((r.step, e.kind, rid(e.req_id, e.sample), list(e.blocks or []), e.num_tokens,
                                        e.reason, e.num_cached_tokens, e.num_recomputed_tokens,
                                        rid(e.requester_req_id, e.requester_sample) or None, e.victim_reason))
        tables["tokens"] += [(rid(q, s), i, r.step) for q, s, i in zip(r.token_req_ids, r.token_samples, r.token_idx)]
        tables["requests"] += [(rid(q.req_id, q.sample), q.prompt_tokens, q.max_tokens, q.priority, q.output_tokens,
                                q.finish_reason, q.preemptions, q.recomputed_tokens, q.prefix_hit_tokens)
                               for q in r.finished]
    return tables


def capture_tables(columns: dict) -> dict[str, list]:
    """The capture's tables as the same rows."""
    def rows(table: str, names: list[str]) -> list[tuple]:
        c = columns[table]
        return [tuple(list(v or []) if n == "blocks" else v for n, v in zip(names, row))
                for row in zip(*(c[n] for n in names))]
    k = columns["kv_events"]
    order = sorted(range(len(k["seq"])), key=lambda i: k["seq"][i])
    events = rows("kv_events", EVENT_COLUMNS)
    return {"steps": sorted(rows("steps", STEP_COLUMNS)), "kv_events": [events[i] for i in order],
            "tokens": rows("tokens", ["req_id", "idx", "step"]), "requests": rows("requests", REQUEST_COLUMNS)}


def trace_differences(workload: dict, records: list[dict], answer: dict, vllm_version: str) -> list[str]:
    """Where the capture's tables are not kvtrace's own trace of the workload (empty: nowhere).

    One difference is the driver's own, not the capture's: the driver takes the cached blocks of a
    victim scheduled earlier in its step out of the prefix cache just before vLLM preempts it (the
    Recorder's "uncached"), with evict events kvtrace's engine does not write in the same places: evict
    events are compared (as a set) only in workloads where that never happens, the others in order."""
    from kvtrace.vllm.importer import read_chunks

    keep = KeepSteps()
    kvtrace_side.run(workload, vllm_version=vllm_version, tracer=keep)
    mine, theirs = kvtrace_tables(keep.records), capture_tables(read_chunks(Path(answer["capture"])))
    for tables in (mine, theirs):
        evicts = sorted((e for e in tables["kv_events"] if e[1] == "evict"), key=repr)
        tables["kv_events"] = [e for e in tables["kv_events"] if e[1] != "evict"]
        if not any(r["uncached"] for r in records):
            tables["evict events"] = evicts
        tables["tokens"].sort()
        tables["requests"].sort()
    problems = []
    for table, rows in mine.items():
        if rows != theirs[table]:
            at = next((i for i, (a, b) in enumerate(zip(rows, theirs[table])) if a != b), min(len(rows), len(theirs[table])))
            problems.append(f"{table}: {len(rows)} rows in kvtrace's trace, {len(theirs[table])} captured; the first "
                            f"differing, row {at}: kvtrace {rows[at:at + 1]}, captured {theirs[table][at:at + 1]}")
    arrivals = read_chunks(Path(answer["capture"]))["arrivals"]
    samples = [(f"{r['id']}:{i}", len(r["prompt"]), r["max_tokens"], r.get("priority", 0), len(r["prompt"])
                // workload["config"]["block_size"] if workload["config"]["enable_prefix_caching"] else None)
               for r in workload["requests"] for i in range(r.get("n", 1))]
    got = [(q, p, m, pr, len(h) if workload["config"]["enable_prefix_caching"] else None) for q, p, m, pr, h in
           zip(*(arrivals[c] for c in ("req_id", "prompt_tokens", "max_tokens", "priority", "block_hashes")))]
    if sorted(got) != sorted(samples):
        problems.append(f"arrivals {sorted(got)}, the workload's {sorted(samples)}")
    beyond = [h for hashes in arrivals["block_hashes"] for h in hashes if not 0 <= h < 2**63]
    if beyond:   # the run's tables hold them as BIGINT
        problems.append(f"block hashes beyond 63 bits: {beyond[:3]}")
    return problems


def table_differences(workload: dict, records: list[dict], answer: dict) -> list[str]:
    """What the capture's own columns say otherwise than they must (empty: nothing): the clock (every
    event and token stamped with its step's end, a request's first scheduling, first token and finish
    with theirs, arrivals as vLLM's request stamped them), the columns a vLLM capture fills with
    constants, token ids only when asked for (KVTRACE_CAPTURE_TOKEN_IDS, the workload's "token_ids"),
    and the server's identity and summary (capture.json, done.json) as the workload configured it."""
    from kvtrace.vllm.importer import read_chunks

    folder = Path(answer["capture"])
    c = read_chunks(folder)
    cfg = workload["config"]
    server = json.loads((folder / "capture.json").read_text())
    done = json.loads((folder / "done.json").read_text())
    problems: list[str] = []

    def expect(what: str, got, want) -> None:
        if got != want:
            problems.append(f"{what}: {got!r}, expected {want!r}")

    s, k, t, q, a = c["steps"], c["kv_events"], c["tokens"], c["requests"], c["arrivals"]
    end = dict(zip(s["step"], s["end_s"]))
    start = dict(zip(s["step"], s["start_s"]))
    expect("steps rows whose start is after their end", [n for n, b, e in zip(s["step"], s["start_s"], s["end_s"]) if b > e], [])
    expect("steps rows out of order", s["step"], sorted(s["step"]))
    expect("steps start times out of order", [start[n] for n in sorted(start)], sorted(start.values()))
    last = max(s["step"], default=-1)
    no_output = [n for n, ms in zip(s["step"], s["device_ms"]) if ms is None]
    # async: the driver's engine loop processes no output of a step that scheduled nothing, nor the
    # last step's (vLLM's engine stops first): those rows have no device time, every other's is >= 0
    unprocessed = sorted({n for n, r in enumerate(records) if not r["scheduled"]} | {last}) if cfg["async"] else []
    expect("steps without a device time", no_output, unprocessed)
    expect("negative device times", [ms for ms in s["device_ms"] if ms is not None and ms < 0], [])
    expect("swapped", set(s["swapped"]) - {0}, set())
    expect("total_blocks", set(s["total_blocks"]), {cfg["num_blocks"]} if s["step"] else set())
    expect("used_blocks", [u for u, f in zip(s["used_blocks"], s["free_blocks"]) if u + f != cfg["num_blocks"]], [])
    expect("events not stamped at their step's end", [i for i, (n, ts) in enumerate(zip(k["step"], k["ts_s"]))
                                                       if ts != end[n]], [])
    expect("event seq", k["seq"], list(range(len(k["seq"]))))
    expect("event num_blocks", k["num_blocks"], [len(b) if b else 0 for b in k["blocks"]])
    expect("event constant columns", {(x, y, z, w) for x, y, z, w in zip(k["sample"], k["bytes"], k["duration_ms"],
                                                                        k["src_blocks"])}, {(0, 0, None, None)} if k["seq"] else set())
    expect("requester_sample", [rs for r, rs in zip(k["requester_req_id"], k["requester_sample"]) if rs != (0 if r else None)], [])
    expect("tokens not stamped at their step's end", [i for i, (n, ts) in enumerate(zip(t["step"], t["ts_s"]))
                                                       if ts != end[n]], [])
    expect("token samples", set(t["sample"]) - {0}, set())
    want_ids = {-1} if workload.get("token_ids") else {None}
    expect("token ids", set(t["token_id"]), want_ids if t["token_id"] else set())
    first_token = {r: ts for r, i, ts in zip(t["req_id"], t["idx"], t["ts_s"]) if i == 0}
    admitted = {}
    finished = {}
    for n, kind, r, ts in sorted(zip(k["seq"], k["kind"], k["req_id"], k["ts_s"])):
        step = k["step"][n]
        if kind == "admit":
            admitted.setdefault(r, start[step])
        elif kind == "finish":
            finished[r] = ts
    offset = server["wall_minus_monotonic"]
    pending = sorted(workload["requests"], key=lambda r: r["arrival_step"])
    # vLLM's arrival time (the driver's: its step, plus a microsecond per request before it) on the
    # capture's clock; an arrival time of 0 is none: the request row has none, the arrivals row the
    # time the scheduler took it
    stamped = {f"{r['id']}:{i}": r["arrival_step"] + index * 1e-6
               for index, r in enumerate(pending) for i in range(r.get("n", 1))}
    arrival = {r: ts - offset if ts else None for r, ts in stamped.items()}
    for name, rids, got, want in [
            ("first_scheduled_s", q["req_id"], q["first_scheduled_s"], [admitted.get(r) for r in q["req_id"]]),
            ("first_token_s", q["req_id"], q["first_token_s"], [first_token.get(r) for r in q["req_id"]]),
            ("finish_s", q["req_id"], q["finish_s"], [finished.get(r) for r in q["req_id"]]),
            ("arrival_s", q["req_id"], q["arrival_s"], [arrival[r] for r in q["req_id"]]),
            ("arrivals' arrival_s", a["req_id"], a["arrival_s"],
             [arrival[r] if arrival[r] is not None else min(start.values(), default=g) - 1e-3
              for r, g in zip(a["req_id"], a["arrival_s"])])]:
        if name.startswith("arrivals"):   # one taken at time 0: before the first step began
            off = [(r, g, w) for r, g, w in zip(rids, got, want)
                   if abs(g - w) > 1e-6 and not (arrival[r] is None and w - 60 <= g <= w + 1e-3)]
        else:
            off = [(r, g, w) for r, g, w in zip(rids, got, want)
                   if (g is None) != (w is None) or g is not None and abs(g - w) > 1e-6]
        expect(f"requests' {name}", off, [])
    expect("request constant columns", {(x, y, z) for x, y, z in zip(q["sample"], q["n"], q["swaps"])},
           {(0, 1, 0)} if q["req_id"] else set())
    checked = workload.get("env", {}).get("KVTRACE_CAPTURE_SELF_CHECK") != "0"   # (unchecked's)
    identity = {key: server[key] for key in ("block_size", "num_gpu_blocks", "null_block", "enable_prefix_caching",
                                             "max_num_seqs", "max_num_batched_tokens", "max_model_len", "policy",
                                             "async_scheduling", "scheduler", "self_check", "token_ids")}
    expect("capture.json", identity, {
        "block_size": cfg["block_size"], "num_gpu_blocks": cfg["num_blocks"] + 1, "null_block": 0,
        "enable_prefix_caching": cfg["enable_prefix_caching"], "max_num_seqs": cfg["max_num_seqs"],
        "max_num_batched_tokens": cfg["max_num_batched_tokens"], "max_model_len": cfg["max_model_len"],
        "policy": cfg["policy"], "async_scheduling": cfg["async"],
        "scheduler": "KvtraceAsyncScheduler" if cfg["async"] else "KvtraceScheduler", "self_check": checked,
        "token_ids": bool(workload.get("token_ids"))})
    servers = json.loads((folder / "servers" / f"{server['server_id']}.json").read_text())
    expect("servers/ID.json", servers, server)
    expect("done.json", {key: done[key] for key in ("server_id", "steps", "events", "self_check_steps")},
           {"server_id": server["server_id"], "steps": len(s["step"]), "events": len(k["seq"]),
            "self_check_steps": len(s["step"]) - len(unprocessed) if checked else 0})
    expect("done.json's hook time", done["hook_s"] > 0, bool(s["step"]))
    # a server that exits without shutdown() (EngineCore killed by its parent) still writes done.json
    expect("the capture's close registered to run at exit", answer["close_at_exit"], True)
    return problems


def unchecked(workload: dict, n: int) -> dict:
    """Every other workload (`n` odd) captured without the self-check, as a production server is: the
    self-check reads each step's events on the engine's thread, so the running loop's allocs get their
    requests there at once; without it, on the sink's builder thread (accounting.py's Attribution),
    which these workloads compare with vLLM's decisions all the same."""
    if n % 2 == 0:
        return workload
    return {**workload, "env": {**workload.get("env", {}), "KVTRACE_CAPTURE_SELF_CHECK": "0"}}


def for_each_workload(check_one, strategy, *, examples=(), max_examples: int = NUM_WORKLOADS) -> int:
    """`check_one(folder, n, *drawn)` on each of `max_examples` generated workloads (Hypothesis, the same
    ones every run) and the `examples` first: `drawn` is what `strategy` (a tuple strategy) drew, `folder` a
    capture folder of its own under a temporary root (every other one made already: the capture makes its
    folder, parents too, or takes one that is there), `n` its number. Each folder is removed once
    checked, the root at the end; returns how many were checked."""
    root = Path(tempfile.mkdtemp(prefix="kvtrace-capture-on-vllm-"))
    made = [0]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=PHASES)
    @given(strategy)
    def check(drawn):
        n = made[0]
        made[0] += 1
        folder = root / f"w{n}" / "capture"
        if n % 2:
            folder.mkdir(parents=True)
        check_one(folder, n, *drawn)
        shutil.rmtree(folder.parent, ignore_errors=True)

    for drawn in examples:
        check = example(drawn)(check)
    try:
        check()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return made[0]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
@starts_vllm(unless=bool(DRIVERS))
def test_capture_records_what_vllm_decided(vllm, asynchronous):
    counts = {"workloads": 0, "preempting": 0, "hitting": 0}

    def check(folder, n, workload):
        counts["workloads"] += 1
        workload = unchecked({**workload, "capture_dir": str(folder), "token_ids": counts["workloads"] % 3 == 0}, n)
        answer = vllm.answer(workload)
        records = answer["steps"]
        problems = capture_differences(workload, records, answer)
        problems += table_differences(workload, records, answer)
        if vllm.version in VLLM_VERSIONS:   # the versions kvtrace's scheduler follows
            problems += trace_differences(workload, records, answer, vllm.version)
        assert not problems, (f"vLLM {vllm.version}, workload:\n{json.dumps(workload)}\n" + "\n".join(problems[:10]))
        counts["preempting"] += any(r["preempted"] for r in records)
        counts["hitting"] += any(a[2] for r in records for a in r["admitted"])

    for_each_workload(check, st.tuples(workloads(asynchronous)))
    print(f"vLLM {vllm.version} {'AsyncScheduler' if asynchronous else 'Scheduler'} captured: {counts}")
    if not DRIVERS:   # the mutation check's few workloads per mutant are chosen (and known) to be these
        assert counts["preempting"] and counts["hitting"], counts   # not vacuous


# Generated workloads (tests.vllm_sched.workloads) that told a planted bug apart from the capture where
# the first workloads did not, kept whole: why each matters, and its workload
FOUND = {
    "two-re-prefills-complete-in-one-step": (
        "r02 and r01:1 complete their re-prefills in one step, in the watch's order otherwise than the "
        "step scheduled them: their reprefill events are in the scheduler's order",
        {"config": {"block_size": 1, "num_blocks": 35, "max_num_seqs": 3, "max_num_batched_tokens": 8,
                    "max_model_len": 36, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                    "enable_prefix_caching": False},
         "requests": [{"id": "r00", "prompt": [2, 1, 2, 3, 2, 2, 2, 2, 2, 3, 1, 3, 1, 2, 1, 1, 3, 2, 3, 3, 3, 1, 2, 1, 3,
                                               1, 3, 2, 2, 3, 1, 2, 2, 2, 3], "max_tokens": 1, "arrival_step": 0},
                      {"id": "r01", "prompt": [3, 1, 3, 2, 2, 3, 2, 1, 3, 1, 1, 3, 2, 3, 3], "max_tokens": 5, "n": 2,
                       "arrival_step": 0},
                      {"id": "r02", "prompt": [3], "max_tokens": 2, "arrival_step": 0},
                      {"id": "r03", "prompt": [1], "max_tokens": 1, "arrival_step": 0}]}),
    "one-position-recomputed": (
        "r00 is preempted with two positions computed and recomputes exactly one of them (the other a "
        "prefix hit): a recompute of one position counts",
        {"config": {"block_size": 1, "num_blocks": 2, "max_num_seqs": 2, "max_num_batched_tokens": 4,
                    "max_model_len": 3, "long_prefill_token_threshold": 1, "policy": "priority", "async": False,
                    "enable_prefix_caching": True},
         "requests": [{"id": "r00", "prompt": [2], "max_tokens": 2, "priority": 1, "arrival_step": 0},
                      {"id": "r01", "prompt": [1, 2], "max_tokens": 1, "priority": 0, "arrival_step": 0}]}),
    "re-prefill-chunk-two-short-of-its-end": (
        "r06:0, resumed with outputs, recomputes in chunks, one of which ends two positions short of its "
        "tokens: the next chunk's blocks are a prefill's (num_computed_tokens < num_tokens - 1), not a decode's",
        {"config": {"block_size": 1, "num_blocks": 98, "max_num_seqs": 4, "max_num_batched_tokens": 4,
                    "max_model_len": 99, "long_prefill_token_threshold": 0, "policy": "priority", "async": False,
                    "enable_prefix_caching": True},
         "requests": [{"id": "r00", "prompt": [3, 1, 3, 1, 2, 1, 1, 3, 2, 3, 3, 3, 1, 2, 1, 3, 1, 3, 2, 2, 3, 1, 2, 2, 2,
                                               3, 3, 1, 3, 2, 2, 3, 2, 1, 3, 1, 1, 3, 2, 3, 3, 3, 1, 3, 2, 2, 1, 3, 2, 3,
                                               1, 1, 3, 1, 1, 1, 3, 2, 1, 1, 2, 3, 2, 1, 2, 3, 2, 3, 1, 3, 2, 3, 1, 3, 3,
                                               3, 2, 2, 1, 3, 2, 2, 3, 1, 2, 1, 1, 1, 1, 3, 3, 2, 2, 1, 1, 3, 1, 1],
                       "max_tokens": 1, "priority": 0, "arrival_step": 0},
                      {"id": "r01", "prompt": [1, 1, 3, 3, 3, 2, 3, 3, 2, 3, 1, 1, 3, 3, 2, 3, 2, 2, 2, 3, 3, 3, 2, 1, 2,
                                               3, 1, 2, 3, 3, 2, 1, 1, 1, 3, 2, 1, 3, 1, 2, 1, 2, 2, 1, 1, 1, 3, 1, 1, 3,
                                               3, 3, 3, 3, 1, 1, 1, 3, 1, 3, 3, 1, 2, 1, 2, 1, 1, 3],
                       "max_tokens": 19, "n": 2, "priority": 1, "arrival_step": 0},
                      *[{"id": f"r0{i}", "prompt": [t], "max_tokens": 1, "priority": 0, "arrival_step": 0}
                        for i, t in [(2, 1), (3, 1), (4, 1), (5, 3)]],
                      {"id": "r06", "prompt": [2, 2, 1, 2, 3, 2, 2, 1, 2, 1, 3, 1], "max_tokens": 3, "priority": 1,
                       "arrival_step": 0},
                      *[{"id": f"r0{i}", "prompt": [t], "max_tokens": 1, "priority": 0, "arrival_step": 0}
                        for i, t in [(7, 3), (8, 1), (9, 3)]]],
         "token_ids": True}),
    "async-resumed-with-one-output": (
        "async: r01 resumes with one output delivered and, after its re-prefill, decodes with two "
        "placeholders (the step before's token not yet delivered): that step's token is a decode's",
        {"config": {"block_size": 1, "num_blocks": 3, "max_num_seqs": 2, "max_num_batched_tokens": 4,
                    "max_model_len": 4, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": True,
                    "enable_prefix_caching": True},
         "requests": [{"id": "r00", "prompt": [2], "max_tokens": 3, "arrival_step": 0},
                      {"id": "r01", "prompt": [1], "max_tokens": 3, "arrival_step": 0},
                      {"id": "r02", "prompt": [2], "max_tokens": 1, "arrival_step": 0}],
         "token_ids": True}),
}


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("name", sorted(FOUND))
def test_workloads_that_told_a_planted_bug_apart_still_match(vllm, name, tmp_path):
    """Each of FOUND's workloads, captured, is kvtrace's own trace of it (and vLLM's decisions)."""
    why, workload = FOUND[name]
    answer, problems = every_difference(vllm, {**workload, "capture_dir": str(tmp_path / "capture")})
    assert not problems, f"{name} ({why}):\n" + "\n".join(problems[:10])


def every_difference(vllm, workload: dict) -> tuple[dict, list[str]]:
    """One workload's answer, and everything capture_differences, table_differences and (on a version
    kvtrace's scheduler follows) trace_differences find in its capture."""
    answer = vllm.answer(workload)
    records = answer["steps"]
    problems = capture_differences(workload, records, answer) + table_differences(workload, records, answer)
    if vllm.version in VLLM_VERSIONS:
        problems += trace_differences(workload, records, answer, vllm.version)
    return answer, problems


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_request_that_finishes_while_another_holds_all_its_blocks_frees_none(vllm, asynchronous, tmp_path):
    """r00's two full prompt blocks are prefix hits of r01, admitted in the same step; r00 finishes
    first, and vLLM's free_blocks then drops two references but frees no block: the capture writes
    no free event (an empty one would say r00 freed nothing in a row kvtrace never writes), and r01's
    finish frees them with its own two."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous},
                "requests": [{"id": "r00", "prompt": list(range(1, 9)), "max_tokens": 1, "arrival_step": 0},
                             {"id": "r01", "prompt": list(range(1, 10)), "max_tokens": 6, "arrival_step": 0}],
                "capture_dir": str(tmp_path / "capture")}
    answer, problems = every_difference(vllm, workload)
    assert not problems, "\n".join(problems[:10])
    assert [a[:3] for a in answer["steps"][0]["admitted"]] == [["r00:0", "new", 0], ["r01:0", "new", 8]]
    from kvtrace.vllm.importer import read_chunks
    k = read_chunks(Path(answer["capture"]))["kv_events"]
    frees = [(rid, list(blocks)) for kind, rid, blocks in zip(k["kind"], k["req_id"], k["blocks"]) if kind == "free"]
    assert [rid for rid, _ in frees] == ["r01:0"] and len(frees[0][1]) == 4, frees   # two hits, two its own


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_the_capture_leaves_allocate_slots_as_it_found_it_after_every_step(vllm, asynchronous, tmp_path):
    """The capture puts its admission wrapper on the KV-cache manager's instance from the waiting loop's
    first look to the end of the step, and takes it off again, also in steps with nobody waiting (no
    waiting loop) and after a preemption. Here nothing else is on the instance (the driver's own
    wrapper is off, "bare"): after every step vLLM's own method is what the running loop calls.
    Nor is anything between vLLM's schedule() and its _preempt_request (the driver counts the
    victims where their blocks are freed), as in a server: each preemption's requester, which the
    capture finds in the frame that calls _preempt_request, is kvtrace's."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 4},
                "requests": [{"id": f"r{i:02d}", "prompt": list(range(10 * i + 1, 10 * i + 6)), "max_tokens": 6,
                              "arrival_step": 3 * i} for i in range(4)],
                "capture_dir": str(tmp_path / "capture"), "bare": True}
    answer, problems = every_difference(vllm, workload)
    assert "error" not in answer, answer.get("traceback")
    assert any(step["preempted"] for step in answer["steps"]) and any(not step["admitted"] for step in answer["steps"])
    assert answer.get("left_on_allocate_slots", []) == []
    assert not problems, "\n".join(problems[:10])
    from kvtrace.vllm.importer import read_chunks
    k = read_chunks(Path(answer["capture"]))["kv_events"]
    requesters = [r for kind, r in zip(k["kind"], k["requester_req_id"]) if kind == "preempt"]
    assert requesters and None not in requesters, requesters


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("windowed", [False, True], ids=["full", "full+sliding"])
def test_the_capture_leaves_the_attributes_of_vllms_instances_inline(vllm, windowed, tmp_path):
    """The capture's wrappers go onto the KV-cache manager's and the block pool's instances, and the
    admission wrapper on and off the manager's every step, without turning their attributes into a
    dict: on CPython 3.11 and 3.12 every attribute read of vLLM's code on them would then be a dict
    lookup instead of a specialized read, millions of instructions a step at 1,024 running
    (instance_wraps.py). Three requests crowd a pool that holds two: they wait, are admitted and
    preempted (and, with a window, drop blocks), so that every wrapper is put on, called and, for
    admissions, taken off again."""
    groups = ["full", "sliding"] if windowed else ["full"]
    workload = {**hybrid(CROWDED, groups, 2), "capture_dir": str(tmp_path / "capture"), "bare": True}
    answer = vllm.answer(workload)
    assert "error" not in answer, answer.get("traceback")
    records = answer["steps"]
    assert any(r["preempted"] for r in records) and (not windowed or any(r["dropped"] for r in records))
    problems = capture_differences(workload, records, answer)
    assert not problems, "\n".join(problems[:10])
    inline = answer["attributes_inline"]
    if None in inline.values():
        pytest.skip("this Python keeps an instance's attributes inline whatever is read (3.13+), or is not CPython")
    assert inline == {"kv_cache_manager": True, "block_pool": True}


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_steps_device_time_runs_from_the_end_of_its_scheduling_to_its_output(vllm, asynchronous, tmp_path):
    """device_ms is the time from the end of a step's schedule() to the start of its
    update_from_output: the model's run (and, async, the next step's scheduling, which runs
    meanwhile). Step 1's model runs 0.4 s longer and step 2's schedule() takes 0.4 s longer: every
    step's device_ms is at least the driver's own time from schedule() returning to calling
    update_from_output, and more by no more than the capture's hooks (never the scheduling itself)."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous},
                "requests": [{"id": "r00", "prompt": list(range(1, 9)), "max_tokens": 6, "arrival_step": 0}],
                "capture_dir": str(tmp_path / "capture"), "gap": [[1, 0.4]], "slow_schedule": [[2, 0.4]]}
    answer, problems = every_difference(vllm, workload)
    assert not problems, "\n".join(problems[:10])
    from kvtrace.vllm.importer import read_chunks
    s = read_chunks(Path(answer["capture"]))["steps"]
    timing = answer["timing"]
    assert len(s["step"]) == len(timing) >= 4, (s["step"], timing)
    for step, ms in zip(s["step"], s["device_ms"]):
        if len(timing[step]) == 1:   # async: the last step's output, never processed
            assert ms is None, (step, ms)
            continue
        returned, called = timing[step]
        low = (called - returned) * 1e3
        assert low <= ms <= low + 150, (step, ms, low)
    assert s["device_ms"][1] >= 400, s["device_ms"]


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_steps_whose_output_is_never_processed_are_written_as_they_are_and_not_kept(vllm, asynchronous, tmp_path):
    """A caller that stops processing outputs (from step 3 on, then 40 more schedule() calls): the
    capture keeps at most 16 steps waiting for their output (MAX_PENDING; vLLM's batch queue holds
    2) and writes the older ones as they are, each its steps row without a device time; every step
    has its row once the scheduler shuts down. r00, aborted meanwhile, is filed with the oldest step
    still waiting, and written with it."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous},
                "requests": [{"id": "r00", "prompt": [1, 2, 3, 4, 5], "max_tokens": 20, "arrival_step": 0},
                             {"id": "r01", "prompt": [6, 7, 8], "max_tokens": 20, "arrival_step": 0}],
                "capture_dir": str(tmp_path / "capture"), "outputs_dropped_from": 3, "aborts": [[5, ["r00:0"]]]}
    answer = vllm.answer(workload)
    assert "error" not in answer, answer.get("traceback")
    assert len(answer["steps"]) == 43
    assert answer["capture_held"]["pending"] <= 16, answer["capture_held"]
    from kvtrace.vllm.importer import read_chunks
    columns = read_chunks(Path(answer["capture"]))
    s = columns["steps"]
    assert sorted(s["step"]) == list(range(43))
    unprocessed = sorted(step for step, ms in zip(s["step"], s["device_ms"]) if ms is None)
    assert unprocessed == list(range(2 if asynchronous else 3, 43)), unprocessed
    # r00, aborted before step 5, is filed with the oldest step still waiting for its output then
    k, q = columns["kv_events"], columns["requests"]
    finish = [(step, reason) for step, kind, rid, reason in zip(k["step"], k["kind"], k["req_id"], k["reason"])
              if kind == "finish"]
    assert finish == [(unprocessed[0], "aborted")] and q["finish_reason"] == ["aborted"], (finish, q)


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
@pytest.mark.parametrize("left", [["r00:0"], ["r00:0", "r01:0"]], ids=["one-left", "two-left"])
def test_aborted_requests_and_a_shutdown_with_requests_in_flight_are_captured_whole(vllm, asynchronous, left, tmp_path):
    """Clients that go away: before step 3 the frontend aborts r03 (waiting for blocks: it holds none),
    before step 4 r01 (running) unless it is left; before step 9 (7 with r01 left) the server shuts
    down and aborts what is left. Every request has its row (the aborted ones `aborted`, with the tokens they had, finished
    when their finish event says), every block given is freed by an event (the last ones by the
    capture's close, after the last step: async, with the last step, whose output is never
    processed), and the self-check finds nothing."""
    aborts = [[3, ["r03:0"]]] + ([[4, ["r01:0"]]] if "r01:0" not in left else [])
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 6, "max_num_seqs": 3,
                           "max_model_len": 32},
                "requests": [{"id": f"r{i:02d}", "prompt": list(range(10 * i + 1, 10 * i + 7)), "max_tokens": m,
                              "arrival_step": 0} for i, m in enumerate([20, 20, 2, 20])],
                "capture_dir": str(tmp_path / "capture"), "aborts": aborts,
                "stop_at": 9 if len(left) == 1 else 7}   # r01 left: before it runs out of blocks
    answer = vllm.answer(workload)
    assert "error" not in answer, answer.get("traceback")
    assert sorted(answer["aborted_at_stop"]) == left, answer["aborted_at_stop"]
    problems = capture_differences(workload, answer["steps"], answer)
    problems += table_differences(workload, answer["steps"], answer)
    assert not problems, "\n".join(problems[:10])
    from kvtrace.vllm.importer import read_chunks
    columns = read_chunks(Path(answer["capture"]))
    q = columns["requests"]
    reasons = dict(zip(q["req_id"], q["finish_reason"]))
    assert reasons == {"r00:0": "aborted", "r01:0": "aborted", "r02:0": "length", "r03:0": "aborted"}, reasons
    k = columns["kv_events"]
    last = max(columns["steps"]["step"])
    closing = [(kind, rid) for step, kind, rid in zip(k["step"], k["kind"], k["req_id"]) if step == last]
    assert all(("finish", r) in closing and ("free", r) in closing for r in left), closing
    given, freed = defaultdict(list), defaultdict(list)   # no prefix is shared: each block is one request's
    for kind, rid, blocks in zip(k["kind"], k["req_id"], k["blocks"]):
        if kind in ("alloc", "prefix_hit"):
            given[rid] += blocks
        elif kind == "free":
            freed[rid] += blocks
    assert {r: sorted(b) for r, b in given.items()} == {r: sorted(b) for r, b in freed.items()}, (given, freed)


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_preempted_requests_history_recomputed_in_chunks_is_prefill_with_its_blocks(vllm, asynchronous, tmp_path):
    """r01 is preempted with tokens generated, then resumes and recomputes its prompt and output in
    chunks of 8 tokens (the step's budget): the blocks it takes for the second chunk are a prefill's,
    not a decode's (it is RUNNING again, with outputs, so only its computed-token count says so),
    and every event and step row is as kvtrace's own trace of the workload has it."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 10, "max_model_len": 48,
                           "max_num_batched_tokens": 8, "long_prefill_token_threshold": 8,
                           "enable_prefix_caching": False},
                "requests": [{"id": "r00", "prompt": list(range(1, 21)), "max_tokens": 20, "arrival_step": 0},
                             {"id": "r01", "prompt": list(range(31, 43)), "max_tokens": 20, "arrival_step": 0}],
                "capture_dir": str(tmp_path / "capture")}
    answer, problems = every_difference(vllm, workload)
    assert not problems, "\n".join(problems[:10])
    from kvtrace.vllm.importer import read_chunks
    k = read_chunks(Path(answer["capture"]))["kv_events"]
    order = sorted(range(len(k["seq"])), key=lambda i: k["seq"][i])
    events = [(k["kind"][i], k["req_id"][i], k["reason"][i]) for i in order]
    resumed = events.index(("admit", "r01:0", "resume-recompute"))
    regrown = [reason for kind, rid, reason in events[resumed:] if kind == "alloc" and rid == "r01:0"]
    # the admission's blocks for its first 8 tokens, then the second chunk's (RUNNING, with outputs)
    assert regrown[:2] == ["prefill", "prefill"], regrown


@starts_vllm(unless=bool(DRIVERS))
def test_without_the_self_check_none_runs(vllm, tmp_path):
    """KVTRACE_CAPTURE_SELF_CHECK unset or 0 (a production server): the capture checks nothing, and
    done.json says so (no steps checked, no errors)."""
    answer = vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture"),
                          "env": {"KVTRACE_CAPTURE_SELF_CHECK": "0"}})
    done = json.loads((Path(answer["capture"]) / "done.json").read_text())
    server = json.loads((Path(answer["capture"]) / "capture.json").read_text())
    assert (server["self_check"], done["self_check_steps"], done["self_check_errors"]) == (False, 0, 0), done


@starts_vllm(unless=bool(DRIVERS))
def test_the_self_check_keeps_its_first_20_examples(vllm, tmp_path):
    """A record made wrong early finds two errors at every later check: done.json counts them all and
    keeps the first 20 as examples, in order."""
    workload = {"config": {**WORKLOAD["config"], "max_model_len": 32},
                "requests": [{"id": "r00", "prompt": [1, 2, 3], "max_tokens": 20, "arrival_step": 0}],
                "capture_dir": str(tmp_path / "capture"), "corrupt": "held"}
    done = json.loads((Path(vllm.answer(workload)["capture"]) / "done.json").read_text())
    assert done["self_check_errors"] > 20 and len(done["self_check_examples"]) == 20, done
    assert done["self_check_examples"][:2] == ["step 2: r00:0 holds [1, 2] but the events say [1, 2, 1000000]",
                                               "step 2: 2 blocks in use but the events account for 3"], done
    assert done["self_check_examples"][-1].startswith("step 11: "), done


@starts_vllm(unless=bool(DRIVERS))
def test_a_second_close_writes_nothing(vllm, tmp_path):
    """shutdown() closes the capture; its exit hook calls close() again when the process ends: the
    second changes no file (no second last chunk, no done.json rewritten)."""
    answer = vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture"), "close_twice": True})
    assert answer["changed_by_second_close"] is False


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("when, remade", [("mid-run", False), ("mid-run", True), ("at-shutdown", False)],
                         ids=["removed", "removed-and-remade", "removed-after-the-last-chunk"])
def test_a_capture_folder_removed_mid_run_stops_the_capture_and_vllm_serves_on(vllm, tmp_path, when, remade):
    """An operator removes the capture's folder while the server runs: the next chunk cannot be written,
    the capture stops (vLLM schedules on, every request served), and the folder is not made again
    with a done.json that would look like a capture, nor when it goes after the last chunk was
    written (an idle server's), just before the shutdown. Made again by someone before the shutdown,
    it gets the done.json that says the writer failed."""
    folder = tmp_path / "capture"
    workload = {**WORKLOAD, "requests": [{"id": f"r{i:02d}", "prompt": [1, 2, 3], "max_tokens": 4,
                                          "arrival_step": 6 * i} for i in range(3)],
                "capture_dir": str(folder), "remake_capture_before_shutdown": remade}
    if when == "mid-run":
        workload["remove_capture_at"] = 7
    else:
        workload["remove_capture_before_shutdown"] = True
    answer = vllm.answer(workload)
    assert "error" not in answer, answer.get("traceback")
    assert sum(len(step["finished"]) for step in answer["steps"]) == 3
    if not remade:
        assert not folder.exists(), sorted(p.name for p in folder.rglob("*"))
    else:
        done = json.loads((folder / "done.json").read_text())
        assert "FileNotFoundError" in done["writer_error"], done
        assert sorted(p.name for p in folder.iterdir()) == ["done.json"]


@starts_vllm(unless=bool(DRIVERS))
def test_a_chunk_that_cannot_be_written_stops_the_capture_and_error_json_says_so(vllm, tmp_path):
    """The capture's chunks/ goes mid-run (a write fails as on a full disk; the folder stays): the
    capture stops, vLLM schedules on, and error.json says `stopped`, reason `disk`, with the disk's
    error, which `capture ls` and the exporter's kvtrace_capture_up read."""
    folder = tmp_path / "capture"
    workload = {**WORKLOAD, "requests": [{"id": f"r{i:02d}", "prompt": [1, 2, 3], "max_tokens": 4,
                                          "arrival_step": 6 * i} for i in range(3)],
                "capture_dir": str(folder), "remove_chunks_at": 7, "env": {"KVTRACE_CAPTURE_FLUSH_EVERY": "0"}}
    answer = vllm.answer(workload)
    assert "error" not in answer, answer.get("traceback")
    assert sum(len(step["finished"]) for step in answer["steps"]) == 3
    error = json.loads((folder / "error.json").read_text())
    assert (error["status"], error["reason"], error["exception"]) == ("stopped", "disk", "FileNotFoundError"), error
    assert json.loads((folder / "servers" / f"{error['server_id']}.error.json").read_text()) == error
    assert "FileNotFoundError" in json.loads((folder / "done.json").read_text())["writer_error"]


@starts_vllm(unless=bool(DRIVERS))
def test_one_token_prefill_chunks_on_the_async_scheduler_are_prefill(vllm, tmp_path):
    """long_prefill_token_threshold 1: every prompt is computed a token a step, and the chunk before
    the last (position num_tokens - 2) samples nothing, so nothing is in flight: the capture counts
    each chunk as prefill, as kvtrace's trace of the workload does, on the async scheduler too."""
    workload = {"config": {**WORKLOAD["config"], "async": True, "long_prefill_token_threshold": 1},
                "requests": [{"id": "r00", "prompt": [1, 2, 3, 4], "max_tokens": 3, "arrival_step": 0},
                             {"id": "r01", "prompt": [5, 6, 7, 8], "max_tokens": 2, "arrival_step": 1}],
                "capture_dir": str(tmp_path / "capture")}
    answer, problems = every_difference(vllm, workload)
    assert not problems, "\n".join(problems[:10])
    from kvtrace.vllm.importer import read_chunks
    s = read_chunks(Path(answer["capture"]))["steps"]
    assert sum(s["prefill_tokens"]) == 8, s["prefill_tokens"]


@starts_vllm(unless=bool(DRIVERS))
def test_a_busy_server_writes_a_chunk_every_flush_interval(vllm, tmp_path):
    """KVTRACE_CAPTURE_FLUSH_EVERY (default 2 s, what a crash can lose) set to 0: every processed step
    of a busy server is written at once, before the engine runs out of requests, each chunk whole."""
    answer = vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture"),
                          "env": {"KVTRACE_CAPTURE_FLUSH_EVERY": "0"}})
    chunks = answer["chunks_before_shutdown"]
    assert len(chunks) == len(answer["steps"]) and set(chunks) == {1}, chunks
    server = json.loads((tmp_path / "capture" / "capture.json").read_text())
    assert server["flush_s"] == 0


SPECULATIVE = {"config": {"block_size": 4, "num_blocks": 16, "max_num_seqs": 4, "max_num_batched_tokens": 64,
                          "max_model_len": 64, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                          "enable_prefix_caching": True},
               "requests": [{"id": "r00", "prompt": [1, 2, 3, 4, 5], "max_tokens": 12, "arrival_step": 0},
                            {"id": "r01", "prompt": [6, 7, 8, 9, 10, 11], "max_tokens": 6, "arrival_step": 3}]}


def spec_differences(answer: dict, columns: dict) -> list[str]:
    """The capture's drafts (schema 5) against vLLM's (the driver's "drafts": per step, request, drafts
    scheduled and accepted): a spec_decode row per request and step that scheduled drafts, each with
    vLLM's lookahead slots; each steps row's totals; each request's."""
    problems = []
    records = answer["steps"]
    d = columns["spec_decode"]
    got = sorted([step, rid, n, a] for step, rid, n, a in zip(d["step"], d["req_id"], d["draft_tokens"],
                                                               d["accepted_tokens"]))
    asynchronous = bool(records) and "placeholders" in records[0]
    # async: a request finished by the output before (freed as this step's output was processed) has a
    # stale output, which vLLM ignores: no drafts accepted, or rejected
    want = sorted([n, rid, k, None if asynchronous and rid in r["finished"] else a]
                  for n, r in enumerate(records) for rid, k, a in r.get("drafts", ()))
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        problems.append(f"spec_decode rows (step, request, drafts, accepted) {got[at:at + 3]}, vLLM {want[at:at + 3]} "
                        f"({len(got)} rows, vLLM {len(want)})")
    if set(d["lookahead_slots"]) - {answer["lookahead"]}:
        problems.append(f"lookahead slots {sorted(set(d['lookahead_slots']))}, vLLM's {answer['lookahead']}")
    s = columns["steps"]
    per_step = defaultdict(list)
    for n, rid, k, a in want:
        per_step[n].append((k, a))
    for step, drafts, accepted in zip(s["step"], s["draft_tokens"], s["accepted_tokens"]):
        rows = per_step[step]
        if (drafts, accepted) != (sum(k for k, _ in rows), sum(a or 0 for _, a in rows)):
            problems.append(f"step {step}: {drafts} drafts, {accepted} accepted; vLLM {rows}")
    q = columns["requests"]
    totals = defaultdict(lambda: [0, 0])
    for _, rid, k, a in want:
        if a is not None:   # (a request whose output came after it was freed: not its)
            totals[rid][0] += k
            totals[rid][1] += a
    wrong = {rid: (n, a, totals[rid]) for rid, n, a in zip(q["req_id"], q["draft_tokens"], q["accepted_tokens"])
             if [n, a] != totals[rid]}
    if wrong:
        problems.append(f"requests' drafts and accepted (capture, vLLM): {dict(list(wrong.items())[:4])}")
    return problems


@pytest.mark.parametrize("mode", ["Scheduler", "Scheduler-draft-model", "AsyncScheduler-draft-model"])
@starts_vllm(unless=bool(DRIVERS))
def test_speculative_steps_deliver_several_tokens_and_the_capture_numbers_each(vllm, mode):
    """Speculative decoding: each step's drafts (the sync driver proposes them for every running request,
    vLLM's update_draft_token_ids; the AsyncScheduler schedules its configured count as placeholders),
    scheduled with the next token and given slots, and the placeholder model accepts some (0 to all, a
    fixed pattern), so one output carries several tokens and vLLM rolls back the rejected drafts'
    positions. With a draft model's config ("draft-model") vLLM also reserves lookahead slots past each
    request's tokens. The capture follows vLLM's decisions as everywhere (capture_differences: admissions,
    new blocks, victims, finishes, the balance, the self-check), writes a tokens row for every token
    delivered, numbered in order, counts no rejected draft as recompute, and records the drafts
    (spec_differences: per request and step the drafts, the accepted, the lookahead; per step and per
    request the totals). kvtrace's own engine drafts nothing (docs/scheduling.md), so there is no trace of
    its to compare."""
    asynchronous, method = mode.startswith("Async"), "draft_model" if mode.endswith("draft-model") else None
    counts = {"workloads": 0, "several": 0, "preempting": 0, "rejecting": 0}

    def check(folder, n, workload, drafts):
        counts["workloads"] += 1
        if method:   # a request also needs its drafts' and lookahead's slots to run alone in the pool, and a
            # step's token budget must hold its next token, drafts and lookahead (a scheduler built with
            # less never schedules the request); a long-prefill threshold below that trips an assertion of
            # vLLM's on a new decode padded to 1 + drafts rows (scheduler.py, `pad_spec_decode`): none
            cfg = workload["config"]
            threshold = cfg["long_prefill_token_threshold"]
            workload = {**workload, "config": {**cfg, "num_blocks": cfg["num_blocks"]
                                                + -(-(2 * drafts + 1) // cfg["block_size"]),
                                                "max_num_batched_tokens": max(cfg["max_num_batched_tokens"],
                                                                              2 * drafts + 1),
                                                "long_prefill_token_threshold": 0 if threshold < 2 * drafts + 1
                                                else threshold}}
        workload = unchecked({**workload, "capture_dir": str(folder), "spec_tokens": drafts, "spec_method": method,
                              "token_ids": counts["workloads"] % 2 == 0}, n)
        answer = vllm.answer(workload)
        problems = capture_differences(workload, answer["steps"], answer)
        problems += table_differences(workload, answer["steps"], answer)
        # rejected drafts' positions are computed again, but no KV was lost: not recompute, which only a
        # preemption causes (kvtrace's meaning); a request never preempted recomputes nothing
        from kvtrace.vllm.importer import read_chunks
        columns = read_chunks(Path(answer["capture"]))
        problems += spec_differences(answer, columns)
        if (answer["lookahead"] > 0) != bool(method):
            problems.append(f"vLLM reserved {answer['lookahead']} lookahead slots with spec_method {method}")
        q = columns["requests"]
        recomputed = {r: n for r, n, p in zip(q["req_id"], q["recomputed_tokens"], q["preemptions"]) if n and not p}
        if recomputed:
            problems.append(f"requests never preempted with recomputed tokens: {recomputed}")
        if not any(r["preempted"] for r in answer["steps"]) and any(columns["steps"]["recompute_tokens"]):
            problems.append(f"recompute tokens without a preemption: {columns['steps']['recompute_tokens']}")
        t = columns["tokens"]   # a request's first token time is its token 0's, however many came after
        first = {rid: ts for rid, idx, ts in zip(t["req_id"], t["idx"], t["ts_s"]) if idx == 0}
        late = {r: (f, first.get(r)) for r, f in zip(q["req_id"], q["first_token_s"]) if f != first.get(r)}
        if late:
            problems.append(f"first_token_s is not token 0's time: {late}")
        assert not problems, (f"vLLM {vllm.version}, workload:\n{json.dumps(workload)}\n" + "\n".join(problems[:10]))
        counts["several"] += any(k > 1 for _, _, k in answer["delivered"])
        counts["preempting"] += any(r["preempted"] for r in answer["steps"])
        counts["rejecting"] += any(a is not None and a < k for r in answer["steps"] for _, k, a in r.get("drafts", ()))

    # r01's first token comes in a step where r00's output carries two
    for_each_workload(check, st.tuples(workloads(asynchronous), st.integers(1, 4)),
                      examples=[({**SPECULATIVE, "config": {**SPECULATIVE["config"], "async": asynchronous}}, 2)],
                      max_examples=max(6, NUM_WORKLOADS // 2))
    print(f"vLLM {vllm.version} {mode} speculative steps captured: {counts}")
    assert counts["several"] and counts["rejecting"], counts   # not vacuous: drafts accepted and rolled back


# Async speculative decoding: the step scheduled while r03:0's last tokens are in flight preempts r03:1,
# and gives r03:0 a block that preemption freed; that output then finishes r03:0. r03:0's finish goes with
# the later step, after its events (recorder._finish_after_later_steps); filed with its finish instead,
# r03:0's new block came before r03:1's preemption that freed it, held twice (found when the generated
# workloads' draws changed).
FINISHED_AFTER_A_PREEMPTION = {
    "config": {'block_size': 2, 'num_blocks': 15, 'max_num_seqs': 2, 'max_num_batched_tokens': 8, 'max_model_len': 24, 'long_prefill_token_threshold': 0, 'policy': 'fcfs', 'async': True, 'enable_prefix_caching': True},
    "requests": [
        {'id': 'r00', 'prompt': [2, 1, 2, 3, 2, 2, 2, 2, 2, 3, 1, 3, 1, 2, 1, 1, 3, 2, 3, 3, 3], 'max_tokens': 3, 'n': 1, 'priority': 0, 'arrival_step': 0},
        {'id': 'r01', 'prompt': [1], 'max_tokens': 1, 'n': 1, 'priority': 0, 'arrival_step': 0},
        {'id': 'r02', 'prompt': [2], 'max_tokens': 1, 'n': 1, 'priority': 0, 'arrival_step': 0},
        {'id': 'r03', 'prompt': [1], 'max_tokens': 17, 'n': 2, 'priority': 0, 'arrival_step': 0},
        {'id': 'r04', 'prompt': [3], 'max_tokens': 1, 'n': 1, 'priority': 0, 'arrival_step': 0},
        {'id': 'r05', 'prompt': [1], 'max_tokens': 1, 'n': 1, 'priority': 0, 'arrival_step': 0},
        {'id': 'r06', 'prompt': [3], 'max_tokens': 1, 'n': 1, 'priority': 0, 'arrival_step': 0}],
    "spec_tokens": 2, "spec_method": "draft_model", "token_ids": False}


@starts_vllm(unless=bool(DRIVERS))
def test_a_finishing_requests_later_block_freed_by_that_steps_preemption(vllm, tmp_path):
    workload = {**FINISHED_AFTER_A_PREEMPTION, "capture_dir": str(tmp_path / "capture")}
    answer = vllm.answer(workload)
    problems = capture_differences(workload, answer["steps"], answer)
    assert not problems, problems


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
@pytest.mark.parametrize("corrupt, found", [
    ("held", ["r00:0 holds [1, 3] but the events say [1, 3, 1000000]", "4 blocks in use but the events account for 5"]),
    ("lost", ["r00:0 holds [1, 3] but the events say [3]", "4 blocks in use but the events account for 3"]),
    ("cached", ["0 cached free blocks but the capture counted 1"])])
def test_the_self_check_finds_a_pool_the_events_do_not_describe(vllm, asynchronous, corrupt, found, tmp_path):
    """KVTRACE_CAPTURE_SELF_CHECK compares, every step, the blocks each request holds by the captured
    events with the pool's own, the blocks in use, and the cached free blocks: the driver makes the
    capture's record wrong once, after its second step, and the self-check must say how, at the next
    check."""
    workload = {"config": {"block_size": 4, "num_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 16,
                           "max_model_len": 16, "long_prefill_token_threshold": 0, "policy": "fcfs",
                           "async": asynchronous, "enable_prefix_caching": True},
                "requests": [{"id": "r00", "prompt": [1, 2, 3], "max_tokens": 4, "arrival_step": 0},
                             {"id": "r01", "prompt": [4, 5, 6], "max_tokens": 4, "arrival_step": 0}],
                "capture_dir": str(tmp_path / "capture"), "corrupt": corrupt}
    done = json.loads((Path(vllm.answer(workload)["capture"]) / "done.json").read_text())
    # the same error at every later step
    assert done["self_check_errors"] >= len(found) and not done["writer_error"], done
    # made wrong after the driver's second step: sync, step 1's check has run (in its update), step 2's finds
    # it; async, the second step processed step 0's output, and step 1's check finds it
    step = 1 if asynchronous else 2
    assert done["self_check_examples"][:len(found)] == [f"step {step}: {f}" for f in found], done


WORKLOAD = {"config": {"block_size": 4, "num_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 16,
                       "max_model_len": 16, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                       "enable_prefix_caching": True},
            "requests": [{"id": "r00", "prompt": [1, 2, 3], "max_tokens": 4, "arrival_step": 0}]}


STRICT = {"KVTRACE_CAPTURE_STRICT": "1"}


def stepped_aside(answer: dict, capture: Path, reason: str) -> dict:
    """A capture that did not start, by default: vLLM's scheduler ran the workload unrecorded, the
    folder says why (servers/<id>.error.json and error.json, the same), and nothing in it looks like a
    capture of that server. Returns what error.json says."""
    assert "error" not in answer, answer.get("traceback")
    assert answer["capture_started"] is False and answer["steps"]
    error = json.loads((capture / "error.json").read_text())
    assert (error["status"], error["reason"], error["strict"]) == ("stepped_aside", reason, False), error
    assert error["server_id"] and error["pid"] > 0 and error["vllm_version"] and error["at"], error
    assert json.loads((capture / "servers" / f"{error['server_id']}.error.json").read_text()) == error
    assert not (capture / "capture.json").exists() and not (capture / "servers" / f"{error['server_id']}.json").exists()
    assert not list(capture.rglob("*.kvtc")) and not (capture / "done.json").exists()
    return error


def refused(vllm, workload: dict, capture: Path, reason: str, match: str) -> dict:
    """The same with KVTRACE_CAPTURE_STRICT=1: the scheduler is not built, and error.json says why."""
    with pytest.raises(RuntimeError, match=match):
        vllm.answer({**workload, "capture_dir": str(capture), "env": {**workload.get("env", {}), **STRICT}})
    error = json.loads((capture / "error.json").read_text())
    assert (error["status"], error["reason"], error["strict"]) == ("refused", reason, True), error
    return error


@starts_vllm(unless=bool(DRIVERS))
def test_without_its_folder_the_capture_steps_aside_and_strict_mode_refuses(vllm):
    """No KVTRACE_CAPTURE_DIR: by default the scheduler runs unrecorded (there is no folder to say why
    in: vLLM's log line says it); in strict mode it is not built, with an error that names the variable."""
    answer = vllm.answer({**WORKLOAD, "capture_dir": None})
    assert "error" not in answer and answer["capture_started"] is False and answer["steps"], answer.get("traceback")
    with pytest.raises(RuntimeError, match="set KVTRACE_CAPTURE_DIR to the capture folder"):
        vllm.answer({**WORKLOAD, "capture_dir": None, "env": STRICT})


@starts_vllm(unless=bool(DRIVERS))
def test_an_option_the_capture_cannot_parse_makes_it_step_aside_and_says_which(vllm, tmp_path):
    error = stepped_aside(vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture"),
                                       "env": {"KVTRACE_CAPTURE_MAX_BYTES": "lots"}}), tmp_path / "capture", "settings")
    assert "KVTRACE_CAPTURE_MAX_BYTES='lots'" in error["error"], error


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("served", ["chat-a", ["chat-a", "chat-b"]], ids=["one", "several"])
def test_the_capture_takes_its_options_and_names_the_served_model(vllm, tmp_path, served):
    """KVTRACE_CAPTURE_MAX_BYTES and KVTRACE_CAPTURE_MAX_AGE set the retention capture.json records;
    the model is vLLM's served model name (the first, where it serves under several)."""
    env = {"KVTRACE_CAPTURE_MAX_BYTES": "3MiB", "KVTRACE_CAPTURE_MAX_AGE": "2h"}
    vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture"), "env": env, "served_model_name": served})
    server = json.loads((tmp_path / "capture" / "capture.json").read_text())
    assert (server["max_bytes"], server["max_age_s"], server["model"]) == (3 * 1024**2, 7200, "chat-a"), server


@starts_vllm(unless=bool(DRIVERS))
def test_a_vllm_version_the_capture_was_not_tested_on_makes_it_step_aside_or_refuse(vllm, tmp_path):
    """A vLLM the capture was not tested on: vLLM serves unrecorded and error.json in the capture folder
    says why (vLLM's EngineCore keeps the exception in its own log); strict mode refuses it."""
    # the version check on, whatever the environment says (scripts/vllm_release_check.sh sets it aside)
    from kvtrace.vllm.capture import guard

    major, minor = min(guard.SUPPORTED)
    older = f"{major}.{minor - 1}.0"   # the release before the oldest supported
    workload = {**WORKLOAD, "vllm_version": older, "env": {"KVTRACE_VLLM_ANY_VERSION": "0"}}
    error = stepped_aside(vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")}), tmp_path / "capture",
                          "vllm_version")
    assert error["vllm_version"] == older and f"vLLM {older} is outside" in error["error"], error
    error = refused(vllm, workload, tmp_path / "strict", "vllm_version", "VllmChanged")
    assert error["vllm_version"] == older and f"vLLM {older} is outside" in error["error"], error


@starts_vllm(unless=bool(DRIVERS))
def test_a_vllm_version_left_out_of_kvtrace_vllm_versions_is_refused(vllm, tmp_path):
    """KVTRACE_VLLM_VERSIONS narrows the versions the capture starts on to those an operator has
    validated: the vLLM this test runs, left out, steps the capture aside."""
    from kvtrace.vllm.capture import guard

    other = next(f"{a}.{b}" for a, b in guard.SUPPORTED if (a, b) != guard.version_tuple(vllm.version))
    error = stepped_aside(vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture"),
                                       "env": {"KVTRACE_VLLM_VERSIONS": other, "KVTRACE_VLLM_ANY_VERSION": "0"}}),
                          tmp_path / "capture", "vllm_version")
    assert f"outside the versions KVTRACE_VLLM_VERSIONS lets the capture start on ({other};" in error["error"], error


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("hidden, named", [
    ("vllm.v1.core.kv_cache_manager:KVCacheManager.get_block_ids", "KVCacheManager.get_block_ids is gone"),
    ("vllm.v1.core.block_pool:BlockPool.touch", "BlockPool.touch is gone"),
    ("vllm.v1.core.sched.request_queue:FCFSRequestQueue.peek_request", "has no peek_request"),
], ids=["a-class-method", "a-pool-method", "an-instances-method"])
def test_a_vllm_without_a_name_the_capture_uses_makes_it_step_aside_or_refuse(vllm, tmp_path, hidden, named):
    """A vLLM whose classes or scheduler lack a method the capture wraps or reads: the capture steps
    aside, or in strict mode the scheduler is not built, and error.json names what is missing (rather
    than a capture that breaks mid-serve)."""
    workload = {**WORKLOAD, "hide": [hidden]}
    error = stepped_aside(vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")}), tmp_path / "capture",
                          "vllm_changed")
    assert named in error["error"], error
    assert named in refused(vllm, workload, tmp_path / "strict", "vllm_changed", "VllmChanged")["error"]
    vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "again")})   # put back: the next one starts


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("groups, named", [
    (["rswa"], "1 group(s) (RSWAManager)"),
    (["full", "rswa"], "2 group(s) (FullAttentionManager, RSWAManager)")], ids=["alone", "hybrid"])
def test_a_model_whose_kv_cache_the_capture_does_not_follow_makes_it_step_aside_or_refuse(vllm, tmp_path,
                                                                                            groups, named):
    """A KV cache of a kind the capture does not follow: full attention's R-SWA variant, which frees a
    gap in the middle of a request's blocks (so do circular buffers, sinks and sparse attention in their
    own ways). The capture steps aside (strict mode: the scheduler is not built), and error.json names
    the group it cannot follow; a dense model's next one starts."""
    workload = {**WORKLOAD, "config": {**WORKLOAD["config"], "kv_cache_groups": groups}}
    error = stepped_aside(vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")}), tmp_path / "capture",
                          "model")
    assert named in error["error"] and "not RSWAManager" in error["error"], error
    error = refused(vllm, workload, tmp_path / "strict", "model", "VllmChanged")
    assert named in error["error"] and "not RSWAManager" in error["error"], error
    assert not (tmp_path / "strict" / "capture.json").exists()   # nothing that looks like a capture
    vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "again")})


@st.composite
def hybrid_workloads(draw, asynchronous: bool, groups: list[str]) -> dict:
    """A generated workload (tests.vllm_sched.workloads) on a model of these KV-cache groups, a window
    (or chunk) of 1 to 4 blocks: the pool is the same blocks per group, so every request still fits
    alone, and vLLM runs as it is (no victim's hashes taken out: there is no kvtrace trace to compare)."""
    return hybrid(draw(workloads(asynchronous)), groups, draw(st.integers(1, 4)))


def hybrid(workload: dict, groups: list[str], window_blocks: int) -> dict:
    cfg = workload["config"]
    return {**workload, "keep_victim_hashes": True,
            "config": {**cfg, "num_blocks": cfg["num_blocks"] * len(groups), "kv_cache_groups": groups,
                       "window_blocks": window_blocks}}


# three requests whose windows drop blocks while they grow into a pool that holds two of them: preemptions
CROWDED = {"config": {"block_size": 2, "num_blocks": 24, "max_num_seqs": 3, "max_num_batched_tokens": 32,
                      "max_model_len": 40, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                      "enable_prefix_caching": True},
           "requests": [{"id": f"r0{i}", "prompt": [i + 1] * 10 + [7, 8], "max_tokens": 20, "arrival_step": 0}
                        for i in range(3)]}


HYBRID_GROUPS = {"sliding": ["sliding"], "full+sliding": ["full", "sliding"], "full+chunked": ["full", "chunked"],
                 "full+mamba": ["full", "mamba"], "sliding+full+sliding": ["sliding", "full", "sliding"]}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
@pytest.mark.parametrize("kinds", sorted(HYBRID_GROUPS))
@starts_vllm(unless=bool(DRIVERS))
def test_the_capture_follows_a_hybrid_models_kv_cache_groups(vllm, asynchronous, kinds):
    """A hybrid model's KV cache on vLLM's own hybrid coordinator: full attention beside sliding-window
    (Gemma 3, gpt-oss), chunked local (Llama 4) or Mamba layers (Granite 4, Nemotron-H), and a window on
    every layer (Mistral). Per step, on generated workloads, sync and async, with the capture's self-check
    (every request's blocks in every group replayed from the events against vLLM's tables): everything
    capture_differences checks of a dense model, and per group the blocks each scheduled request was given
    (an event's kv_group, a prefix hit's kv_group_blocks) and the blocks each window dropped mid-request
    (`free` events, reason `window`, or `state` for Mamba) are vLLM's."""
    groups = HYBRID_GROUPS[kinds]
    counts = {"workloads": 0, "dropping": 0, "preempting": 0, "hitting": 0}

    def check(folder, n, workload):
        counts["workloads"] += 1
        workload = unchecked(workload, n)
        answer = vllm.answer({**workload, "capture_dir": str(folder)})
        records = answer["steps"]
        problems = capture_differences(workload, records, answer) + table_differences(workload, records, answer)
        identity = json.loads((folder / "capture.json").read_text())
        kinds_written = [g["kind"] for g in identity["kv_cache_groups"]]
        want = [{"full": "full_attention", "sliding": "sliding_window", "chunked": "chunked_local",
                 "mamba": "mamba"}[g] for g in groups]
        if kinds_written != want:
            problems.append(f"capture.json's kv_cache_groups {kinds_written}, the model's {want}")
        assert not problems, (f"vLLM {vllm.version}, workload:\n{json.dumps(workload)}\n" + "\n".join(problems[:10]))
        counts["dropping"] += any(r["dropped"] for r in records)
        counts["preempting"] += any(r["preempted"] for r in records)
        counts["hitting"] += any(a[2] for r in records for a in r["admitted"])

    # (a window on every layer holds a few blocks a request: a pool of 8, or 6 with async scheduling's
    # placeholders, is crowded)
    crowded = hybrid({**CROWDED, "config": {**CROWDED["config"], "async": asynchronous,
                                            "num_blocks": 24 if "full" in groups else 6 if asynchronous else 8}},
                     groups, 2)
    for_each_workload(check, st.tuples(hybrid_workloads(asynchronous, groups)), examples=[(crowded,)])
    print(f"vLLM {vllm.version} {kinds} {'AsyncScheduler' if asynchronous else 'Scheduler'} captured: {counts}")
    if not DRIVERS:
        assert counts["dropping"] and counts["preempting"], counts   # not vacuous


# errors planted in a copy of the capture package, each where the KVTRACE_PLANTED_FAULT its scheduler was
# built with names: in a hook of the recorder's own (after vLLM's schedule), in a wrapper that vLLM's
# schedule calls (mid-admission, its block-pool call made), and on the sink's builder thread (a step's row)
PLANTS = {
    "recorder.py": ("        end = time.monotonic()\n",
                    "        end = time.monotonic()\n"
                    "        if self.planted == 'hook' and self.steps.step == 3:\n"
                    "            raise RuntimeError('planted in after_schedule')\n"),
    "wraps.py": ("                request = self.current or self.allocating()\n                if request is None:\n",
                 "                if self.planted == 'wrap' and self.steps.step >= 3:\n"
                 "                    raise RuntimeError('planted in get_new_blocks')\n"
                 "                request = self.current or self.allocating()\n                if request is None:\n"),
    "columns.py": ("        s = self.sink.columns[\"steps\"]\n",
                   "        if self.planted == 'build' and row.step >= 3:\n"
                   "            raise RuntimeError('planted in the builder')\n"
                   "        s = self.sink.columns[\"steps\"]\n"),
}
PLANTED_AT_BUILD = {"recorder.py": "        folder = settings.folder\n", "wraps.py": "        kvm = scheduler.kv_cache_manager\n",
                    "columns.py": "        self.sink = sink\n"}


def _planted_package(root: Path) -> Path:
    """kvtrace's package root with the capture package only, copied with PLANTS; its capture folder."""
    import kvtrace

    source = Path(kvtrace.__file__).resolve().parent
    capture = root / "kvtrace" / "vllm" / "capture"
    capture.mkdir(parents=True)
    shutil.copy2(source / "__init__.py", root / "kvtrace" / "__init__.py")
    shutil.copy2(source / "vllm" / "__init__.py", root / "kvtrace" / "vllm" / "__init__.py")
    for path in (source / "vllm" / "capture").glob("*.py"):
        text = path.read_text()
        if path.name in PLANTS:
            at, planted = PLANTS[path.name]
            build = PLANTED_AT_BUILD[path.name]
            assert text.count(at) == 1 and text.count(build) == 1, path.name   # the plant still fits the code
            text = text.replace(at, planted).replace(
                build, build + "        self.planted = __import__('os').environ.get('KVTRACE_PLANTED_FAULT')\n")
        (capture / path.name).write_text(text)
    return capture


@starts_vllm()
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_an_error_of_the_capture_at_runtime_stops_it_and_vllm_decides_on(vllm, asynchronous, tmp_path, monkeypatch):
    """An error of the capture's own, in a hook after vLLM's schedule, in a wrapper inside it, or in building a
    step's row on the sink's builder thread (the recorder stops at its next hook, or at shutdown): the
    capture stops (its wraps off), vLLM's scheduler makes every decision it makes with the capture
    working (the same steps, victims and allocate_slots calls) and finishes every request, and
    error.json says the capture stopped and where."""
    if DRIVERS:
        pytest.skip("a session of a driver someone else started loads this checkout's capture, not a planted copy")
    from kvtrace.vllm.record import model_folder
    from tests.vllm_sched import differential

    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 4},
                "requests": [{"id": f"r{i:02d}", "prompt": list(range(10 * i + 1, 10 * i + 6)), "max_tokens": 6,
                              "arrival_step": 0} for i in range(4)]}
    working = vllm.answer({**workload, "capture_dir": str(tmp_path / "working")})
    assert working["capture_started"] and any(step["preempted"] for step in working["steps"])
    package = _planted_package(tmp_path / "planted")
    monkeypatch.setattr(differential, "capture_package", lambda: package)
    planted = VllmScheduler(vllm.python, str(model_folder("smollm2-135m")), capture=True)
    try:
        for fault, where in (("hook", "planted in after_schedule"), ("wrap", "planted in get_new_blocks"),
                             ("build", "planted in the builder")):
            capture = tmp_path / fault
            answer = planted.answer({**workload, "capture_dir": str(capture), "env": {"KVTRACE_PLANTED_FAULT": fault}})
            assert "error" not in answer, answer.get("traceback")
            assert answer["capture_started"] is False   # stopped: the scheduler's _kvtrace is None at the end
            assert answer["steps"] == working["steps"] and answer["allocate_calls"] == working["allocate_calls"]
            error = json.loads((capture / "error.json").read_text())
            assert (error["status"], error["reason"], error["error"]) == ("stopped", "error", where), error
            assert where in error["traceback"] and (capture / "servers" / f"{error['server_id']}.json").exists()
            assert not (capture / "done.json").exists()   # a stopped capture writes no summary at shutdown
    finally:
        planted.close()


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_capture_that_cannot_start_leaves_vllms_scheduler_deciding_as_its_own(vllm, asynchronous, tmp_path):
    """A capture folder that cannot be made (here: under a regular file): the capture does not start,
    and the scheduler, kvtrace's class still, makes every decision vLLM's own makes: the same steps,
    preemptions and frees as with the capture on, the same calls of allocate_slots, and no folder
    written."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 4},
                "requests": [{"id": f"r{i:02d}", "prompt": list(range(10 * i + 1, 10 * i + 6)), "max_tokens": 6,
                              "arrival_step": 0} for i in range(4)],
                "reset_prefix_cache_at": [0]}   # an idle pool's reset succeeds, with or without a capture
    recorded = vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")})
    (tmp_path / "a-file").write_text("")
    unrecorded = vllm.answer({**workload, "capture_dir": str(tmp_path / "a-file" / "capture")})
    assert "error" not in unrecorded, unrecorded.get("traceback")
    assert (recorded["capture_started"], unrecorded["capture_started"]) == (True, False)
    assert any(step["preempted"] for step in recorded["steps"])          # it has something to decide
    assert unrecorded["steps"] == recorded["steps"]
    assert unrecorded["resets"] == recorded["resets"] == [[0, True]]
    # the driver's own wrapper of allocate_slots, put on after the capture's start, sees every call
    # with the capture on too: the capture's admission wrapper calls what it finds, not vLLM's method
    assert recorded["allocate_calls"] == unrecorded["allocate_calls"] > 0


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_prefix_cache_reset_is_followed_by_the_capture_whether_it_succeeds_or_not(vllm, asynchronous, tmp_path):
    """reset_prefix_cache while requests hold blocks fails and changes nothing; once the pool is idle
    it empties the prefix cache: the capture's count of cached free blocks follows both (its self-check
    compares it with the pool's at every later step), and vLLM's answer reaches the caller."""
    shared = list(range(1, 9))   # two blocks of 4 that the second burst finds cached
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 12, "max_model_len": 32},
                "requests": [{"id": "a", "prompt": shared + [20], "max_tokens": 3, "arrival_step": 0},
                             {"id": "d", "prompt": [30, 31, 32, 33], "max_tokens": 14, "arrival_step": 0},
                             {"id": "b", "prompt": shared + [21], "max_tokens": 3, "arrival_step": 40},
                             {"id": "c", "prompt": shared + [22], "max_tokens": 3, "arrival_step": 80}],
                # at 8, "a" is done (its blocks cached and free) and "d" still runs: the reset fails
                "reset_prefix_cache_at": [8, 40, 80]}
    answer = vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")})
    assert "error" not in answer, answer.get("traceback")
    assert answer["resets"] == [[8, False], [40, True], [80, True]], answer["resets"]
    assert answer["steps"][9]["num_cached"] > 0   # what a wrong count would have lost
    done = json.loads((tmp_path / "capture" / "done.json").read_text())
    assert done["self_check_steps"] > 3 and done["self_check_errors"] == 0, done
    hits = [a for step in answer["steps"] for a in step["admitted"] if a[2]]
    assert not hits, hits   # the reset emptied the cache: "b" and "c" found nothing


@starts_vllm(unless=bool(DRIVERS))
@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_a_server_running_for_hours_keeps_nothing_of_its_finished_requests(vllm, asynchronous, tmp_path):
    """Once every request is done (preempted ones among them), the capture holds no state or count of
    delivered tokens of any request, and no step waiting for its output but an empty last one (async):
    its memory is bounded by what is in flight; and what it captured is on disk as soon as it idles."""
    workload = {"config": {**WORKLOAD["config"], "async": asynchronous, "num_blocks": 4},
                "requests": [{"id": f"r{i:02d}", "prompt": list(range(10 * i + 1, 10 * i + 6)), "max_tokens": 6,
                              "arrival_step": 0} for i in range(4)]
                # and one done at its first token, while its prefill is still being watched
                + [{"id": "r04", "prompt": [7, 8, 9], "max_tokens": 1, "arrival_step": 0}]}
    answer = vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")})
    assert any(step["preempted"] for step in answer["steps"])
    held = answer["capture_held"]
    # the engine ran out of requests: what it captured is on disk at once, in one chunk (a busy
    # server's every 2 s), not held back until the next request or the shutdown (but the empty
    # async step below, which only the shutdown writes)
    from kvtrace.vllm.importer import read_chunks

    written = len(read_chunks(tmp_path / "capture")["steps"]["step"])
    assert answer["chunks_before_shutdown"] == [written - held["pending"]], (answer["chunks_before_shutdown"], written)
    # async: the last step, scheduled with nothing in it, is never processed (vLLM's batch queue skips
    # empty steps); the next one written replaces it, and MAX_PENDING bounds such steps
    assert (held["states"], held["watched"], held["emitted"]) == (0, 0, 0) and held["pending"] <= asynchronous, held


@starts_vllm(unless=bool(DRIVERS))
def test_the_capture_clock_is_the_monotonic_clock_and_its_offset_the_wall_clocks(vllm, tmp_path):
    """Every time the capture writes is on the machine's monotonic clock (the same in every process),
    and capture.json's wall_minus_monotonic turns it into wall-clock time."""
    import time

    before = time.monotonic()
    answer = vllm.answer({**WORKLOAD, "capture_dir": str(tmp_path / "capture")})
    after = time.monotonic()
    from kvtrace.vllm.importer import read_chunks

    server = json.loads((tmp_path / "capture" / "capture.json").read_text())
    assert abs(server["wall_minus_monotonic"] - (time.time() - time.monotonic())) < 1.0, server
    assert before <= server["started_monotonic"] <= after, server
    steps = read_chunks(Path(answer["capture"]))["steps"]
    assert steps["step"] and all(before <= t <= after for t in steps["start_s"] + steps["end_s"]), steps
    done = json.loads((tmp_path / "capture" / "done.json").read_text())
    assert 0 < done["hook_s"] < after - before, done   # the time in its step hooks, within the run


@starts_vllm()
def test_the_capture_cost_suite_runs_on_8_requests(capsys):
    """`python -m benchmarks vllm-capture-cost` at a tiny size (the full suite is for a quiet machine)."""
    import argparse

    from benchmarks import vllm_capture_cost

    if not PYTHONS:
        pytest.skip("no vLLM Python")
    parser = argparse.ArgumentParser()
    vllm_capture_cost.add_arguments(parser)
    vllm_capture_cost.run(parser.parse_args(["--vllm-python", PYTHONS[-1], "--sizes", "8", "--steps", "4",
                                             "--warmup", "1", "--no-write"]))
    out = capsys.readouterr().out
    assert "| 8 |" in out and "bytes per generated token" in out and "ms per step at 8 running" in out, out
