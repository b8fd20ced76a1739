"""The trace's tables as Arrow schemas: the one definition of docs/trace-format.md in code.

The recorder writes chunks with these schemas; `kvtrace.trace.db` reads them and falls back on them to
give a table with no chunk yet (or a column an older trace lacks) its proper type.
"""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 6                 # 2: tokens.prev_step and tokens.prev_ts_s; 3: the causes (steps.admission_stop,
                                   # kv_events.requester_req_id, requester_sample, victim_reason); 4: the server
                                   # column (SERVER_FIELD); 5: KV-cache groups (kv_events.kv_group, kv_group_blocks)
                                   # and speculative decoding (draft_tokens, accepted_tokens, the spec_decode
                                   # table); 6: KV tiers (kv_events kinds offload, load, tier_evict and lookup,
                                   # kv_events.tier and tier_tokens, steps.offload_bytes, load_bytes and
                                   # tier_transfer_ms, requests.tier_hit_tokens: TIER_ONLY); see docs/trace-format.md

# One row per sequence (a request with n samples has n rows), written when it finishes.
REQUESTS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("req_id", pa.string()),               # workload id
    ("sample", pa.int32()),                # 0..n-1
    ("n", pa.int32()),                     # samples the request asked for
    ("priority", pa.int32()),              # lower value = more important
    ("arrival_s", pa.float64()),
    ("prompt_tokens", pa.int32()),
    ("max_tokens", pa.int32()),
    ("output_tokens", pa.int32()),         # tokens delivered
    ("first_scheduled_s", pa.float64()),   # null if never scheduled
    ("first_token_s", pa.float64()),       # null if no token
    ("finish_s", pa.float64()),
    ("finish_reason", pa.string()),        # stop | length | rejected | capacity | aborted
    ("preemptions", pa.int32()),
    ("swaps", pa.int32()),                 # of those, preemptions by swap
    ("recomputed_tokens", pa.int64()),     # positions computed again after recompute (cache hits excluded)
    ("prefix_hit_tokens", pa.int64()),     # positions served from the prefix cache
    # speculative decoding (schema 5; null in a run without it): draft positions scheduled for it, and
    # of them those its outputs accepted (the rest were rolled back)
    ("draft_tokens", pa.int64()),
    ("accepted_tokens", pa.int64()),
    # KV tiers (schema 6; null in a run without one): positions loaded from a tier instead of computed
    # (every tier's; the sum of its loads' num_tokens but failed ones)
    ("tier_hit_tokens", pa.int64()),
])

# One row per engine step.
STEPS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("step", pa.int64()),
    ("start_s", pa.float64()),             # host wall times of the step
    ("end_s", pa.float64()),
    ("device_ms", pa.float64()),           # forward time on the device (host clock on CPU)
    ("running", pa.int32()),               # queue sizes after scheduling
    ("waiting", pa.int32()),
    ("swapped", pa.int32()),
    ("prefill_tokens", pa.int32()),        # prompt / history tokens computed (includes recompute)
    ("decode_tokens", pa.int32()),
    ("recompute_tokens", pa.int32()),      # of prefill_tokens, positions computed before (wasted)
    ("preemptions", pa.int32()),           # preemptions decided this step
    ("free_blocks", pa.int32()),           # device blocks free after scheduling (includes cached)
    ("used_blocks", pa.int32()),           # device blocks referenced by some sequence
    ("cached_blocks", pa.int32()),         # free blocks still holding reusable prefix-cache KV
    ("total_blocks", pa.int32()),          # the device pool's size
    ("kv_tokens", pa.int64()),             # KV positions stored in the used blocks (a shared block counts once)
    # why admission stopped in this step (schema 3; null in older traces): nothing-waiting | seats |
    # budget | blocks | watermark | preemption | other (engine/events.py AdmissionStop)
    ("admission_stop", pa.string()),
    # speculative decoding (schema 5; null in a run without it): draft positions scheduled this step
    # (of decode_tokens), and of them those the step's outputs accepted (null until processed)
    ("draft_tokens", pa.int32()),
    ("accepted_tokens", pa.int32()),
    # KV tiers (schema 6; null in a run without one): bytes stored device -> tier and loaded tier ->
    # device this step (its offload and load events' bytes), and the time its tier copies took where
    # the source knows it (null where it does not)
    ("offload_bytes", pa.int64()),
    ("load_bytes", pa.int64()),
    ("tier_transfer_ms", pa.float64()),
])

# One row per KV-cache event; which columns matter depends on `kind` (see the doc's table).
KV_EVENTS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("seq", pa.int64()),                   # global order of events within the run
    ("step", pa.int64()),
    ("ts_s", pa.float64()),
    ("kind", pa.string()),                 # admit alloc free preempt swap_out swap_in reprefill
                                           # prefix_hit evict cow finish; KV tiers (schema 6): offload
                                           # load tier_evict lookup
    ("req_id", pa.string()),               # empty for evict and tier_evict
    ("sample", pa.int32()),
    ("blocks", pa.list_(pa.int32())),      # physical device block ids concerned
    ("num_blocks", pa.int32()),            # len(blocks)
    ("num_tokens", pa.int32()),            # token positions concerned
    ("bytes", pa.int64()),                 # bytes copied (swap, cow, offload, load), else 0
    ("duration_ms", pa.float64()),         # copy duration (swap_out, swap_in, offload, load), else null
    ("reason", pa.string()),
    ("num_cached_tokens", pa.int32()),     # reprefill, lookup: positions served from the prefix cache
    ("num_recomputed_tokens", pa.int32()), # reprefill: positions computed again
    ("src_blocks", pa.list_(pa.int32())),  # swap: host block ids; cow: source device block
    # preempt (schema 3; null in older traces and for other kinds): the sequence whose allocation
    # could not be served, and why the policy chose this victim (newest | lowest-priority |
    # fewest-computed | only-candidate | swap-group)
    ("requester_req_id", pa.string()),
    ("requester_sample", pa.int32()),
    ("victim_reason", pa.string()),
    # KV-cache groups (schema 5; null in a run of one group, as every older run): a hybrid model keeps a
    # block table per group over one pool (meta.json's kv_pool.kv_cache_groups, in this order). An
    # alloc's, free's or evict's blocks are all of group `kv_group`; an event whose blocks are of
    # every group (prefix_hit, preempt) lists them group by group, `kv_group_blocks` of them in each.
    ("kv_group", pa.int32()),
    ("kv_group_blocks", pa.list_(pa.int32())),
    # KV tiers (schema 6; null for every other kind, and in older runs): the tier an offload, load,
    # tier_evict or lookup concerns (meta.json's kv_tiers names it), and a lookup's positions found in
    # that tier beyond those found before it (docs/trace-format.md, "KV tiers")
    ("tier", pa.string()),
    ("tier_tokens", pa.int32()),
])

# One row per emitted token.
TOKENS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("req_id", pa.string()),
    ("sample", pa.int32()),
    ("idx", pa.int32()),                   # 0-based position in the output
    ("token_id", pa.int32()),              # null with --no-token-ids
    ("step", pa.int64()),                  # step that produced it
    ("ts_s", pa.float64()),                # when it became available (end of that step)
    # the same sequence's previous token (idx - 1): null for idx 0. Schema 2; older traces lack
    # them and the analyses compute them (analyses/_itl.sql), so ITL is a scan, not a regrouping.
    ("prev_step", pa.int64()),
    ("prev_ts_s", pa.float64()),
])


# The server a row is of (schema 4), in the tables of SERVER_TABLES: in a run joined from several servers'
# captures (`kvtrace capture run` of several servers, data-parallel ranks or hosts), a short label of each
# (meta.json's capture.servers says which server it is); in a run of one server, '' (every run of kvtrace's
# engine, and a capture's run of one server). A writer of one server leaves the column out; the views
# (kvtrace/trace/db.py) read it as '' wherever a run lacks it, so that `USING (run_id, server, step)` joins
# every run alike. In a joined run a step is (server, step) and its request ids are `<label>/<vLLM's id>`.
SERVER_FIELD = pa.field("server", pa.string())
SERVER_TABLES = ("requests", "steps", "kv_events", "tokens", "spec_decode")


def write_parquet(table: pa.Table, path) -> None:
    """A chunk of a trace table as a Parquet file: zstd, the string columns dictionary-encoded and the
    numbers and lists plain. Parquet's default, a dictionary for every column, spends most of its time
    on times, seq numbers and counts that hardly repeat, and its fallback compresses worse: writing
    the tables of a 1,000-request simulated run took 150 ms with it and 80 ms without, for files a
    quarter smaller."""
    import pyarrow.parquet as pq   # not for every reader of the schemas

    strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
    pq.write_table(table, path, compression="zstd", use_dictionary=strings)


def token_predecessors(req_id: list, sample: list, idx: list, step: list, ts_s: list) -> tuple[list, list]:
    """prev_step and prev_ts_s of a table's tokens, for a writer that has them all at once: each
    token's predecessor is the previous token of its sequence by idx (None for the first), as
    analyses/_itl.sql computes it for traces without these columns."""
    order = sorted(range(len(idx)), key=lambda i: (req_id[i], sample[i], idx[i]))
    prev_step: list = [None] * len(idx)
    prev_ts_s: list = [None] * len(idx)
    for before, i in zip(order, order[1:]):
        if req_id[before] == req_id[i] and sample[before] == sample[i]:
            prev_step[i], prev_ts_s[i] = step[before], ts_s[before]
    return prev_step, prev_ts_s


# NVML samples at ~10 Hz (CUDA only).
GPU_SAMPLES_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("ts_s", pa.float64()),
    ("mem_used_bytes", pa.int64()),
    ("util_pct", pa.float64()),
    ("pcie_tx_bytes_s", pa.float64()),
    ("pcie_rx_bytes_s", pa.float64()),
    ("power_w", pa.float64()),
])

# table name -> schema; the folder of a run holding a table's chunks has the table's name.
TABLES: dict[str, pa.Schema] = {
    "requests": REQUESTS_SCHEMA,
    "steps": STEPS_SCHEMA,
    "kv_events": KV_EVENTS_SCHEMA,
    "tokens": TOKENS_SCHEMA,
    "gpu_samples": GPU_SAMPLES_SCHEMA,
}


# Tables only some runs have: a view over them exists for every run (empty where a run has none).
CLIENT_TOKENS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("req_id", pa.string()),
    ("sample", pa.int32()),
    ("idx", pa.int32()),                   # 0-based position in the output
    ("token_id", pa.int32()),
    ("ts_s", pa.float64()),                # when the client received it (same clock and origin as the trace)
])

# One row per request of a run cut from live traffic (kvtrace capture run; docs/vllm.md).
CAPTURE_REQUESTS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("req_id", pa.string()),               # vLLM's request id (live traffic has no workload)
    ("sample", pa.int32()),
    ("in_flight_at_start", pa.bool_()),    # arrived before the window (its arrival_s is negative)
    ("in_flight_at_end", pa.bool_()),      # not finished by the window's end (finish_reason 'in-flight')
    # the prompt's full blocks as vLLM hashed them (its prefix cache's keys), hashed again with a key
    # of this capture that is never written: equal prefixes have equal leading hashes within one
    # capture (servers/<id>.json's salt_id), and nothing can be matched to text. Null without
    # vLLM's prefix caching.
    ("block_hashes", pa.list_(pa.int64())),
])

# One row per request and step that scheduled draft tokens for it (speculative decoding, schema 5).
SPEC_DECODE_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("step", pa.int64()),
    ("ts_s", pa.float64()),                # when the step's output was processed (its tokens' time)
    ("req_id", pa.string()),
    ("sample", pa.int32()),
    ("draft_tokens", pa.int32()),          # draft positions scheduled for it in the step
    ("accepted_tokens", pa.int32()),       # of them accepted; the rest rolled back (null: output never processed)
    ("lookahead_slots", pa.int32()),       # KV slots reserved past its scheduled tokens for the next drafts
])

OPTIONAL_TABLES = {"client_tokens": CLIENT_TOKENS_SCHEMA,         # kvtrace record --endpoint (docs/vllm.md)
                   "capture_requests": CAPTURE_REQUESTS_SCHEMA,   # kvtrace capture run
                   "spec_decode": SPEC_DECODE_SCHEMA}             # a capture of a speculative-decoding server

# Columns of schema 5 that only a run that drafts fills (a capture of a speculative-decoding server, or
# kvtrace's simulator with --speculative-method): every other writer leaves them null.
DRAFT_ONLY = {"steps": ("draft_tokens", "accepted_tokens"),
                "requests": ("draft_tokens", "accepted_tokens")}

# Columns of schema 6 that only a run with a KV tier fills (kvtrace's engine or simulator with a tier, a
# capture of a server that offloads): every other writer leaves them null, and so do the kv_events
# columns for every kind but the tiers' own.
TIER_ONLY = {"steps": ("offload_bytes", "load_bytes", "tier_transfer_ms"),
             "requests": ("tier_hit_tokens",),
             "kv_events": ("tier", "tier_tokens")}
