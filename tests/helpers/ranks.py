"""Two data-parallel ranks' captures in one folder, built by hand (no vLLM): what tests/vllm/test_capture_fleet.py
joins into one run and tests/cli/test_capture_live_servers.py follows live.

Two servers, ranks 0 and 1, wrote into one folder, each with requests a–e and steps 0–19: the same
request ids and step numbers. Their monotonic clocks differ (rank 0's is the wall clock less 1,000,000 s,
rank 1's less 995,000 s) and rank 1 runs a quarter of a second behind rank 0 on the wall clock. One step a
second from t = 100 to 119 (rank 0's wall 1,000,100 …):
    a: arrives 100, finishes 104;  b: 102–108;  c: 107–110;  d: 109–116;  e: arrives 118, never finishes
Rank 0 thrashes: its pool is full from step 8 on and d is preempted in each of the steps 10–14, re-prefilled
in the next (40 positions computed again each time). Rank 1 never preempts.
"""
from __future__ import annotations

import json

from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.sink import CHUNK_COLUMNS

WALL = 1_000_000.0                      # rank 0's wall clock less its monotonic clock
RANK0, RANK1 = "20261201T030000Z-4242", "20261201T030000Z-4343"
SERVERS = {RANK0: {"rank": 0, "mono": WALL, "late": 0.0, "thrash": True},
           RANK1: {"rank": 1, "mono": WALL - 5000, "late": 0.25, "thrash": False}}
REQUESTS = {"a": (100, 104), "b": (102, 108), "c": (107, 110), "d": (109, 116), "e": (118, None)}


def server_rows(lo: int, hi: int, thrash: bool, shift: float) -> dict[str, list[dict]]:
    """A server's rows of its seconds lo <= t < hi, its monotonic times `shift` after t."""
    rows: dict[str, list[dict]] = {t: [] for t in CHUNK_COLUMNS}
    for t in range(lo, hi):
        step, m = t - 100, t + shift
        preempted = thrash and 110 <= t <= 114
        reprefilled = thrash and 111 <= t <= 115
        rows["steps"].append({"step": step, "start_s": m, "end_s": m + 0.5, "running": 2, "waiting": 0, "swapped": 0,
                              "prefill_tokens": 40 if reprefilled else 0, "decode_tokens": 2,
                              "recompute_tokens": 40 if reprefilled else 0, "preemptions": int(preempted),
                              "free_blocks": 0 if thrash and t >= 108 else 10,
                              "used_blocks": 16 if thrash and t >= 108 else 6, "cached_blocks": 0,
                              "total_blocks": 16, "kv_tokens": 40,
                              "admission_stop": "preemption" if preempted else "nothing-waiting"})

        events = rows["kv_events"]

        def event(kind: str, rid: str, **values) -> None:   # a step's events numbered from 10 x its second
            seq = t * 10 + sum(e["step"] == step for e in events)
            events.append({"seq": seq, "step": step, "ts_s": m + 0.5, "kind": kind, "req_id": rid, "sample": 0,
                           **values})
        for rid, (arrival, finish) in REQUESTS.items():
            if arrival == t:
                rows["arrivals"].append({"req_id": rid, "arrival_s": m, "prompt_tokens": 40, "max_tokens": 16,
                                         "priority": 0, "block_hashes": [11, 22]})
                event("admit", rid, num_tokens=40, reason="new")
            if rid == "d" and preempted:
                event("preempt", rid, num_tokens=40, reason="recompute", requester_req_id="b",
                      requester_sample=0, victim_reason="newest")
            if rid == "d" and reprefilled:
                event("admit", rid, num_tokens=40, reason="resume-recompute")
                event("reprefill", rid, num_tokens=40, num_cached_tokens=0, num_recomputed_tokens=40)
            if arrival <= t and (finish is None or t < finish) and not (rid == "d" and preempted):
                rows["tokens"].append({"req_id": rid, "sample": 0, "idx": t - arrival, "token_id": None,
                                       "step": step, "ts_s": m + 0.5})
            if finish == t:
                rows["requests"].append({"req_id": rid, "sample": 0, "n": 1, "priority": 0,
                                         "arrival_s": arrival + shift,
                                         "prompt_tokens": 40, "max_tokens": 16, "output_tokens": finish - arrival,
                                         "first_scheduled_s": arrival + shift, "first_token_s": arrival + shift + 0.5,
                                         "finish_s": finish + shift, "finish_reason": "length",
                                         "preemptions": 5 if rid == "d" and thrash else 0, "swaps": 0,
                                         "recomputed_tokens": 200 if rid == "d" and thrash else 0,
                                         "prefix_hit_tokens": 0})
                event("finish", rid, num_tokens=finish - arrival, reason="length")
    return rows


def write_server(folder, server_id: str, rank: int | None, mono: float, late: float, thrash: bool,
                 host: str = "gpu-node-1") -> None:
    """One server's identity and chunks in `folder`: its monotonic clock is the wall clock less `mono`
    (its rows carry t - WALL + mono, t its wall second) and its steps start `late` s after rank 0's."""
    shift = WALL - mono + late
    (folder / "servers").mkdir(parents=True, exist_ok=True)
    identity = {"server_id": server_id, "started_at": "1970-01-12T13:48:19+00:00", "pid": int(server_id[-4:]),
                "vllm_version": "0.33.0", "model": "/models/smollm2-135m", "scheduler": "KvtraceScheduler",
                "async_scheduling": False, "salt_id": "abcd1234", "token_ids": False, "wall_minus_monotonic": mono,
                "block_size": 16, "num_gpu_blocks": 17, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                "max_model_len": 256, "enable_prefix_caching": True, "policy": "fcfs", "host": host,
                "vllm_instance_id": "a1b2c", "data_parallel_rank": rank, "data_parallel_size": 2}
    (folder / "servers" / f"{server_id}.json").write_text(json.dumps(identity))
    (folder / "chunks").mkdir(exist_ok=True)
    for part in range(10):   # two seconds a chunk
        rows = server_rows(100 + 2 * part, 102 + 2 * part, thrash, shift)
        cols = {t: {c: [r.get(c) for r in rows[t]] for c in cs} for t, cs in CHUNK_COLUMNS.items() if rows[t]}
        first, last = WALL + late + 100 + 2 * part, WALL + late + 101.5 + 2 * part
        (folder / "chunks" / f"{server_id}_{part:06d}_{first:.3f}_{last:.3f}_{len(rows['arrivals'])}.kvtc"
         ).write_bytes(chunk_format.encode(cols))


def write_ranks(folder) -> None:
    """Both ranks of SERVERS in one capture folder, as a data-parallel `vllm serve` writes them."""
    for server_id, s in SERVERS.items():
        write_server(folder, server_id, s["rank"], s["mono"], s["late"], s["thrash"])
