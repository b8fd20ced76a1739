"""vLLM's own Scheduler / AsyncScheduler stepped without a model: the vLLM side of the scheduler-level
differential (tests/vllm_sched/test_sched_differential.py).

Runs inside a vLLM venv with the standard library and vLLM only. The scheduler is built as vLLM's
unit tests build it (tests/v1/core/utils.py, create_scheduler): configs by hand, a KVCacheConfig of
one full-attention group, no tokenizer, no workers. Each model output is a placeholder: one token
(-1, what kvtrace's simulator samples for a greedy sequence) for every scheduled request that is
not a prefill chunk; no EOS, so requests finish by max_tokens or max_model_len.

    python vllm_driver.py MODEL_FOLDER [--capture] < workloads.jsonl > records.jsonl

    python vllm_driver.py MODEL_FOLDER --serve SOCKET   (a session per connection, see serve())

With --capture (kvtrace's capture package on PYTHONPATH) the scheduler is kvtrace's capture class,
`KvtraceCaptureScheduler`, built the same way: each workload's capture goes to a fresh folder under
the workload's "capture_dir" (with KVTRACE_CAPTURE_SELF_CHECK=1, and KVTRACE_CAPTURE_TOKEN_IDS=1 where the workload says
"token_ids"), the scheduler is shut down at the
end (done.json), and the answer adds {"capture": FOLDER, "final_free": free blocks at the end}
(tests/vllm/test_capture_on_vllm.py checks the capture against these records). A workload's "env" (the
capture's options), "vllm_version" (the version vLLM says it is) and "served_model_name" hold while its
scheduler is built.

One workload a line in ({"config": {...}, "requests": [...]}, tests/vllm_sched/workloads.py says the
fields), one answer a line out: {"steps": [STEP, ...]} or {"error": "..."}. A STEP is
tests/vllm_sched/record.py's: kvtrace's side writes the same.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import sys
import time
import traceback

TOKEN = -1   # the placeholder every step samples (kvtrace's GREEDY_TOKEN)
HASH_FN = None   # the block hash function, set once vLLM is imported
CAPTURE = False  # --capture: kvtrace's capture scheduler class instead of vLLM's own
CAPTURE_CLASS = None   # --serve: the capture class of the session's package (loaded from its folder)


MODEL_RUNNER_OUTPUT_FIELDS: set = set()   # this vLLM's (main reads them)
CONFIGS: dict = {}   # the VllmConfig built once, and the config values each workload sets


def build(model: str, cfg: dict):
    """The scheduler for a workload's config. vLLM's config objects take tens of milliseconds to
    build and validate (more than most workloads take to run): they are built once, for the first
    workload, and each later workload sets the few fields it varies (the scheduler reads them when
    it is built; tests/vllm_sched/test_sched_differential.py checks this against fresh configs)."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        RSWASpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = cfg["block_size"]
    num_blocks = cfg["num_blocks"] + 1   # kvtrace counts usable blocks; vLLM's pool holds the null block too
    if "vllm_config" not in CONFIGS or os.environ.get("KVTRACE_SCHED_FRESH_CONFIGS"):
        CONFIGS["vllm_config"] = fresh_config(model, cfg)
    vllm_config = CONFIGS["vllm_config"]
    scheduler_config, cache_config = vllm_config.scheduler_config, vllm_config.cache_config
    for name, value in [("max_num_seqs", cfg["max_num_seqs"]), ("max_num_batched_tokens", cfg["max_num_batched_tokens"]),
                        ("max_model_len", cfg["max_model_len"]),
                        ("long_prefill_token_threshold", cfg["long_prefill_token_threshold"]),
                        ("policy", cfg["policy"]), ("async_scheduling", cfg["async"]),
                        # derived in SchedulerConfig.__post_init__
                        ("max_num_encoder_input_tokens", cfg["max_num_batched_tokens"]),
                        ("encoder_cache_size", cfg["max_num_batched_tokens"])]:
        object.__setattr__(scheduler_config, name, value)
    object.__setattr__(vllm_config.model_config, "max_model_len", cfg["max_model_len"])
    object.__setattr__(cache_config, "block_size", block_size)
    object.__setattr__(cache_config, "enable_prefix_caching", cfg["enable_prefix_caching"])
    cache_config.num_gpu_blocks = num_blocks
    # one full-attention group, as a dense model has; a workload's "kv_cache_groups" can name others, as a
    # hybrid model has: "sliding" (a sliding window of 4 blocks: Gemma 3, gpt-oss), "chunked" (chunked
    # local attention in chunks of 4 blocks: Llama 4), "mamba" (a Mamba layer's state: Granite 4,
    # Nemotron-H), each group's pages the size of a full-attention block as vLLM makes them
    window = cfg.get("window_blocks", 4) * block_size
    specs = {"full": lambda: FullAttentionSpec(block_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
             "sliding": lambda: SlidingWindowSpec(block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                                  sliding_window=window),
             "chunked": lambda: ChunkedLocalAttentionSpec(block_size, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32, attention_chunk_size=window),
             # (with prefix caching, a state kept at block boundaries: vLLM 0.33 on refuses any other mode)
             "mamba": lambda: MambaSpec(block_size, shapes=((2,),), dtypes=(torch.float32,),
                                        mamba_cache_mode="align" if cfg["enable_prefix_caching"] else "none"),
             # one the capture does not follow: full attention whose generated tokens keep a window (R-SWA)
             "rswa": lambda: RSWASpec(block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, rswa_window=window)}
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], specs[kind]())
                         for i, kind in enumerate(cfg.get("kv_cache_groups", ["full"]))])
    # a host KV tier: vLLM's native CPU offloading (the OffloadingConnector's scheduler side; StandInWorker
    # stands in for its worker), or none
    object.__setattr__(vllm_config, "kv_transfer_config", offloading_config(cfg["offload"]) if cfg.get("offload")
                       else None)
    resolve_hash_lookahead(vllm_config)   # from this workload's prefix caching and connector
    if CAPTURE_CLASS is not None:
        cls = CAPTURE_CLASS
    elif CAPTURE:
        from kvtrace.vllm.capture.scheduler import KvtraceCaptureScheduler as cls
    else:
        cls = AsyncScheduler if cfg["async"] else Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=False,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size)


def offloading_config(offload: dict):
    """vLLM's KV transfer config of `--kv-offloading-size` (native CPU offloading), sized in chunks: a chunk is
    a block here (blocks_per_chunk 1), each padded to a 4 KiB page (CPUOffloadingSpec), and a failed load
    computed instead ("recompute", unless the workload's "load_failure_policy" says "fail": vLLM's
    default, which ends the request with an error). "sync_load_bytes" (vLLM 0.33 on): loads of up to
    that many bytes a step run inside the step that admits their request (sync_load_budget_bytes)."""
    from vllm.config import KVTransferConfig

    policy = offload.get("load_failure_policy", "recompute")
    extra = {"cpu_bytes_to_use": 4096 * offload["chunks"]}
    if offload.get("sync_load_bytes"):
        extra["sync_load_budget_bytes"] = offload["sync_load_bytes"]
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_load_failure_policy=policy,
                            kv_connector_extra_config=extra)


class InsertionOrderedSet(set):
    """A set that iterates in the order its items were added. vLLM's scheduler keeps the requests finished
    since its last step in a set (finished_req_ids), which the offloading connector walks to store their
    last blocks and to re-rank their chunks: in hash order, a different one in every process. The driver
    gives the scheduler this set instead, so that a run is one run: the requests in the order they
    finished (as kvtrace's engine takes them)."""

    def __init__(self) -> None:
        super().__init__()
        self._order: dict = {}

    def add(self, item) -> None:
        super().add(item)
        self._order[item] = None

    def discard(self, item) -> None:
        super().discard(item)
        self._order.pop(item, None)

    def __iter__(self):
        return iter(list(self._order))


class StandInWorker:
    """The offloading connector's worker side, stood in for (as vLLM's own tests mock it): each transfer job
    the scheduler side issues (its SchedulerOutput's kv_connector_metadata) completes in the output of the
    step `delay` steps later, a job it flushes (or a sync load: its request runs in the step) in that
    step's own; on vLLM 0.34 every `fail_every`-th job
    fails (its failed_jobs; a load's request in failed_recving too). Records what the connector decided,
    independently of the capture: per step the jobs issued, those completed, and the tier's evictions."""

    def __init__(self, sched, offload: dict) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        self.sched = sched
        self.delay, self.fail_every = offload.get("delay", 1), offload.get("fail_every", 0)
        self.can_fail = "failed_jobs" in {f.name for f in dataclasses.fields(OffloadingWorkerMetadata)}
        self.jobs: dict[int, list] = {}   # job id -> [due step, request, is an async load, is a sync load]
        self.evicted = 0                   # chunks the tier evicted since the last step
        manager = sched.connector.connector_scheduler.manager
        prepare_store = manager.prepare_store

        def _prepare_store(*args, **kwargs):
            out = prepare_store(*args, **kwargs)
            if out is not None:
                self.evicted += len(out.evicted_keys)
            return out
        manager.prepare_store = _prepare_store

    def issued(self, so, index: int) -> dict:
        """What the connector decided in step `index`'s scheduling."""
        meta = so.kv_connector_metadata
        record = {"loads": [], "stores": [], "flushed": sorted(meta.jobs_to_flush or ()), "evicted": self.evicted}
        self.evicted = 0
        for kind, jobs in (("loads", meta.load_jobs), ("stores", meta.store_jobs)):
            for job_id, job in sorted(jobs.items()):
                spec = job.dst_spec if kind == "loads" else job.src_spec
                blocks = [int(b) for b in spec.block_ids]
                record[kind].append([job_id, job.req_id, blocks])
                sync = getattr(job, "sync", False)   # (vLLM 0.33 on: a load the step it admits waits for)
                self.jobs[job_id] = [index if sync else index + self.delay, job.req_id, kind == "loads" and not sync,
                                     sync]
                if kind == "loads":   # the request waits for it: its device hit, the connector's, its table
                    request = self.sched.requests[job.req_id]
                    table = [b.block_id for b in self.sched.kv_cache_manager.get_blocks(job.req_id).blocks[0]]
                    num_hit = self.sched.connector.connector_scheduler._req_status[job.req_id].num_locally_computed_tokens
                    # (a sync load's request is scheduled in the step: its computed positions before it)
                    num_computed = request.num_computed_tokens - so.num_scheduled_tokens.get(job.req_id, 0)
                    record[kind][-1] += [num_hit, num_computed - num_hit, request.num_tokens, table]
                    if sync:
                        record.setdefault("sync", []).append(job_id)
        for job_id in meta.jobs_to_flush or ():
            if job_id in self.jobs:
                self.jobs[job_id][0] = index
        return record

    def output(self, index: int):
        """The connector's part of step `index`'s model output, and the jobs it completes ([job, ok])."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        done = sorted(j for j, (due, *_) in self.jobs.items() if due <= index)
        # (a sync load does not fail here: vLLM's worker raises on one)
        failed = {j for j in done if self.can_fail and self.fail_every and j % self.fail_every == self.fail_every - 1
                  and not self.jobs[j][3]}
        finished = {self.jobs[j][1] for j in done if self.jobs[j][2]}
        failed_recving = {self.jobs[j][1] for j in failed if self.jobs[j][2]}
        for j in done:
            del self.jobs[j]
        if not done:
            return None, []
        meta = OffloadingWorkerMetadata(completed_jobs={j: 1 for j in done},
                                        **({"failed_jobs": failed} if self.can_fail else {}))
        return (KVConnectorOutput(finished_recving=finished or None, kv_connector_worker_meta=meta,
                                  failed_recving=failed_recving),
                [[j, j not in failed] for j in done])


def speculative_config(model: str, num_tokens: int, method: str = "draft_model"):
    """vLLM's config of a server drafting `num_tokens` a step with a draft model (the same model here: the
    scheduler reads only the counts): as many lookahead slots reserved past each request's tokens. For
    "eagle", the same config then named EAGLE's (no EAGLE head is at hand to validate one): what the
    scheduler reads of the method (use_eagle: up to 0.32 a prefix hit's last block dropped, 0.33 on
    lookahead block hashes; no drafting slot) is EAGLE's."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    key = ("speculative_config", num_tokens, method)
    if key not in CONFIGS:
        config = SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=num_tokens,
                                   target_model_config=CONFIGS["vllm_config"].model_config,
                                   target_parallel_config=ParallelConfig())
        if method != "draft_model":
            object.__setattr__(config, "method", method)
        CONFIGS[key] = config
    return CONFIGS[key]


def set_speculative_config(model: str, workload: dict) -> None:
    """The shared VllmConfig's speculative config: the workload's ("spec_method", "spec_tokens"), or none;
    and what vLLM 0.34 derives from it when the config is built (num_hash_lookahead_tokens: EAGLE's
    lookahead block hashes; 0.33 derives it as a property)."""
    vllm_config = CONFIGS["vllm_config"]
    config = speculative_config(model, workload["spec_tokens"], workload["spec_method"]) \
        if workload.get("spec_method") else None
    object.__setattr__(vllm_config, "speculative_config", config)
    resolve_hash_lookahead(vllm_config)


def resolve_hash_lookahead(vllm_config) -> None:
    """What vLLM 0.34 derives when a config is built, from the speculative config, prefix caching and the
    KV connector (0.33 derives it as a property): num_hash_lookahead_tokens, EAGLE's lookahead block hashes."""
    resolve = getattr(vllm_config, "_resolve_num_hash_lookahead_tokens", None)
    if resolve is not None:
        object.__setattr__(vllm_config, "num_hash_lookahead_tokens", resolve())


def fresh_config(model: str, cfg: dict):
    """vLLM's configs for one workload, built and validated as vLLM's unit tests build them."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], is_encoder_decoder=False,
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"], enable_chunked_prefill=True,
        policy=cfg["policy"], async_scheduling=cfg["async"])
    model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=cfg["max_model_len"])
    cache_config = CacheConfig(block_size=cfg["block_size"], gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=cfg["enable_prefix_caching"])
    return VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)


class Recorder:
    """Watches one scheduler: preemptions and frees in the order vLLM makes them.

    kvtrace's one deliberate difference in a step's decisions (docs/scheduling.md, "A victim
    scheduled earlier in the same step") is applied here, where it arises and nowhere else: a
    victim that vLLM had already scheduled in the step keeps the prefix-cache hashes of the blocks
    its scheduling cached, though their KV is never written; kvtrace takes them out of the cache
    before it frees the victim, and so does this driver (unless `keep_victim_hashes`, vLLM as it
    is). Both sides record which blocks that un-cached ("uncached"), so the case is compared too.
    """

    def __init__(self, sched, keep_victim_hashes: bool = False, wrap_allocate_slots: bool = True) -> None:
        self.sched = sched
        self.preempted: list[str] = []
        self.finished: list[str] = []
        self.uncached: list[list] = []
        self.num_hashed: dict[str, int] = {}   # request scheduled in this step -> its cached blocks before
        # calls of allocate_slots through this wrapper, which is put on the instance after the scheduler
        # (and its capture) is built: another's wrapper, which the capture must not bypass
        self.allocate_calls = 0
        preempt, free = sched._preempt_request, sched._free_request
        kvm = sched.kv_cache_manager
        allocate_slots = kvm.allocate_slots
        self.managers = kvm.coordinator.single_type_managers   # one per KV-cache group
        self.manager = manager = self.managers[0]
        pool = kvm.block_pool

        def _allocate_slots(request, *args, **kwargs):
            self.allocate_calls += 1
            num_hashed = manager.num_cached_block.get(request.request_id, 0)
            blocks = allocate_slots(request, *args, **kwargs)
            if blocks is not None and request.status.name == "RUNNING":
                self.num_hashed[request.request_id] = num_hashed
            return blocks

        def _preempt_request(request, *args, **kwargs):
            rid = request.request_id
            self.preempted.append(rid)
            if rid in self.num_hashed and not keep_victim_hashes:   # scheduled earlier in this step
                num_hashed = self.num_hashed.pop(rid)   # every group's tables: each caches as far
                taken = [b for m in self.managers
                         for b in m.req_to_blocks[rid][num_hashed:m.num_cached_block.get(rid, 0)]
                         if not b.is_null and b.ref_cnt == 1 and b.block_hash is not None]
                for block in taken:
                    pool._maybe_evict_cached_block(block)
                if taken:
                    self.uncached.append([rid, [b.block_id for b in taken]])
            return preempt(request, *args, **kwargs)

        def _free_request(request, *args, **kwargs):
            self.finished.append(request.request_id)
            return free(request, *args, **kwargs)

        def _free_request_blocks(request, *args, **kwargs):
            if request.status.name == "RUNNING":   # a preemption's (a finished request's status says so)
                self.preempted.append(request.request_id)
            return free_request_blocks(request, *args, **kwargs)

        if wrap_allocate_slots:   # without it ("bare"): no victim's hashes are taken out, no calls counted
            kvm.allocate_slots = _allocate_slots
            sched._preempt_request = _preempt_request
        else:   # and nothing between vLLM's schedule and its _preempt_request, as in a server
            free_request_blocks = sched._free_request_blocks
            sched._free_request_blocks = _free_request_blocks
        sched._free_request = _free_request
        self.dropped: list[list] = []   # [request, group, blocks] a window dropped, in the order vLLM did

        def dropping(manager):
            remove = manager.remove_skipped_blocks

            def remove_skipped_blocks(request_id, *args, **kwargs):
                table = list(manager.req_to_blocks.get(request_id, ()))
                done = remove(request_id, *args, **kwargs)
                gone = [a.block_id for a, b in zip(table, manager.req_to_blocks.get(request_id, ()))
                        if not a.is_null and b.is_null]
                if gone:
                    self.dropped.append([request_id, manager.kv_cache_group_id, sorted(gone)])
                return done
            manager.remove_skipped_blocks = remove_skipped_blocks

        if len(self.managers) > 1 or type(manager).__name__ != "FullAttentionManager":
            for m in self.managers:
                dropping(m)

    def table(self, rid: str, since: tuple[int, ...] | None = None) -> list[int]:
        """A request's blocks, group by group (a hybrid model's), from each group's `since`-th on (its
        whole table): the null block, where a window has dropped blocks, left out."""
        since = since or (0,) * len(self.managers)
        return [b.block_id for m, start in zip(self.managers, since) for b in m.req_to_blocks.get(rid, ())[start:]
                if not b.is_null]

    def group_tables(self, rid: str) -> list[list[int | None]]:
        """A request's table in each group, None where the null block is (a window has dropped a block)."""
        return [[None if b.is_null else b.block_id for b in m.req_to_blocks.get(rid, ())] for m in self.managers]

    def lengths(self, rid: str) -> tuple[int, ...]:
        """How many entries each group's table of a request has (its null blocks included)."""
        return tuple(len(m.req_to_blocks.get(rid, ())) for m in self.managers)

    def pool(self) -> tuple[int, int, list[int]]:
        free = self.sched.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()
        return len(free), sum(1 for b in free if b.block_hash is not None), [b.block_id for b in free]


def accepted(rid: str, index: int, drafts: int) -> int:
    """How many of a request's drafts the placeholder model accepts in step `index` (0 to `drafts`,
    a fixed pattern of the request and the step)."""
    return (sum(map(ord, rid)) + index) % (drafts + 1)


def output_for(sched, so, index: int = 0):
    """The model runner's output for one scheduled step: no tokens for a prefill chunk, else the one
    sampled token, and after a request's scheduled drafts the ones `accepted` says (speculative
    decoding: vLLM rolls back the rest)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    spec = so.scheduled_spec_decode_tokens
    for rid in req_ids:
        request = sched.requests.get(rid)
        drafts = len(spec.get(rid, ()))
        sampled.append([] if request is None or request.is_prefill_chunk
                       else [TOKEN] * (1 + accepted(rid, index, drafts)))
    if "req_id_to_index" in MODEL_RUNNER_OUTPUT_FIELDS:   # vLLM before 0.34: the scheduler reads it
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)   # 0.34: indices follow req_ids


def corrupt(cap, how: str) -> None:
    """Make the capture's own record of the pool wrong once (the workload's "corrupt"), so that its
    self-check has something to find: "held" gives a request a block it does not hold, "lost" forgets
    a request's blocks, "cached" miscounts the cached free blocks."""
    held = cap.self_check.held
    rid = next(iter(held))
    if how == "held":
        held[rid].add(10**6)
    elif how == "lost":
        del held[rid]
    elif how == "cached":
        cap.wraps.cached_free += 1
    else:
        raise ValueError(f"no such corruption {how!r}")


class _Hidden:
    """A class attribute made to look gone while a scheduler is built (workload "hide", a test of the
    capture's guard): reading it raises AttributeError; an instance's assignment is kept aside."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(self.name)

    def __set__(self, obj, value) -> None:
        obj.__dict__["_hidden_" + self.name] = value


def _hide(names: list[str]) -> list:
    """Hide each "module:Class.attribute" of `names`; the undo list for _unhide."""
    import importlib
    undo = []
    for name in names:
        module, _, path = name.partition(":")
        cls_name, _, attr = path.partition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        undo.append((cls, attr, cls.__dict__.get(attr)))
        setattr(cls, attr, _Hidden(attr))
    return undo


def _unhide(undo: list) -> None:
    for cls, attr, original in reversed(undo):
        if original is None:
            delattr(cls, attr)
        else:
            setattr(cls, attr, original)


def on_instance(obj, name: str) -> bool:
    """Whether `obj` holds `name` itself (a wrapper put on it), not its class's method; read without
    `obj.__dict__`, which would turn its attributes into a dict (attributes_inline). The capture's
    instance_wraps.own_attribute asks the same, written here again on purpose: the check of a
    capture (a mutant among them) does not run the capture's own code."""
    value = getattr(obj, name)
    return not (getattr(value, "__self__", None) is obj and getattr(value, "__func__", None) is getattr(type(obj), name))


def attributes_inline(obj) -> bool | None:
    """Whether CPython 3.11 or 3.12 still keeps `obj`'s attributes as inline values laid out by its
    class's shared keys, on which each attribute read of vLLM's code is specialized
    (LOAD_ATTR_INSTANCE_VALUE), rather than in a dict (None on other Pythons, where a dict made from
    them keeps them inline: 3.13+). Read from the object's header: 3.11 keeps the dict's pointer three
    words before the object (NULL while the values are inline); 3.12 keeps there either the values'
    pointer, tagged with the low bit, or the dict's."""
    import ctypes
    if sys.implementation.name != "cpython" or sys.version_info[:2] not in ((3, 11), (3, 12)):
        return None
    slot = ctypes.c_void_p.from_address(id(obj) - 3 * ctypes.sizeof(ctypes.c_void_p)).value
    if sys.version_info[:2] == (3, 11):
        return slot is None
    return slot is not None and slot & 1 == 1


def remove_folder(path):
    """As `rm -rf` would, while the capture's writer thread renames and writes files in it: a file gone
    between the listing and its unlink is not an error, and one written meanwhile is removed too."""
    def written_meanwhile(function, name, exc_info):
        error = exc_info[1]
        if not (isinstance(error, FileNotFoundError) or getattr(error, "errno", None) == errno.ENOTEMPTY):
            raise error

    for _ in range(100):
        if not os.path.lexists(path):
            return
        shutil.rmtree(path, onerror=written_meanwhile)
    raise RuntimeError(f"{path} kept being written to")


def run(model: str, workload: dict, answer: dict | None = None) -> list[dict]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request, RequestStatus

    cfg = workload["config"]
    if CAPTURE:   # every workload its own capture folder, self-checked every step
        answer["capture"] = workload["capture_dir"]
        if workload["capture_dir"] is None:   # none given: the capture must refuse to start
            os.environ.pop("KVTRACE_CAPTURE_DIR", None)
        else:
            os.environ["KVTRACE_CAPTURE_DIR"] = workload["capture_dir"]
        os.environ["KVTRACE_CAPTURE_SELF_CHECK"] = "1"
        os.environ["KVTRACE_CAPTURE_TOKEN_IDS"] = "1" if workload.get("token_ids") else "0"   # kept, or not
    saved = {k: os.environ.get(k) for k in workload.get("env", {})}
    os.environ.update(workload.get("env", {}))   # the capture's options for this workload only
    import vllm
    version, vllm.__version__ = vllm.__version__, workload.get("vllm_version", vllm.__version__)
    model_config = CONFIGS["vllm_config"].model_config
    served = model_config.served_model_name
    object.__setattr__(model_config, "served_model_name", workload.get("served_model_name", served))
    hidden = _hide(workload.get("hide", []))
    import atexit
    at_exit, register = [], atexit.register   # what building the scheduler registers to run at exit

    def _register(func, *args, **kwargs):
        at_exit.append(func)
        return register(func, *args, **kwargs)
    atexit.register = _register
    try:
        # a speculative-decoding server's config ("spec_method"), or none (drafts are still scheduled)
        set_speculative_config(model, workload)
        sched = build(model, cfg)
    finally:   # what the scheduler was built with, for this workload only
        set_speculative_config(model, {})
        atexit.register = register
        _unhide(hidden)
        vllm.__version__ = version
        object.__setattr__(model_config, "served_model_name", served)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # the scheduler reads the speculative config while it schedules too (its drafting slots): the workload's
    # for this run (the next workload's build sets its own)
    set_speculative_config(model, workload)
    rec = Recorder(sched, workload.get("keep_victim_hashes", False), not workload.get("bare"))
    worker = StandInWorker(sched, cfg["offload"]) if cfg.get("offload") else None
    drafts = workload.get("spec_tokens", 0)   # speculative decoding: draft tokens proposed each step
    if drafts and cfg["async"] and not workload.get("spec_method"):
        raise ValueError("spec_tokens: the AsyncScheduler drafts with a spec_method only")
    delivered = answer.setdefault("delivered", []) if CAPTURE else None

    def deliver(index: int, outputs) -> None:
        """What update_from_output returned for step `index`, with --capture: [index, request, new
        tokens] per output."""
        if delivered is not None:
            delivered.extend([index, o.request_id, len(o.new_token_ids)]
                             for engine_outputs in outputs.values() for o in engine_outputs.outputs)
    # as the engine core makes it: with EAGLE on 0.33+, each block hashed with the token after it
    lookahead = getattr(sched, "num_hash_lookahead_tokens", 0)
    hasher = get_request_block_hasher(cfg["block_size"], HASH_FN, *([lookahead] if lookahead else []))
    pending = sorted(workload["requests"], key=lambda r: r["arrival_step"])   # stable: file order within a step
    steps: list[dict] = []
    prev = None
    step = 0
    max_steps = workload.get("max_steps", 3000)
    dropped_from = workload.get("outputs_dropped_from")   # the step from which no output is processed (40 more)
    aborts = {index: ids for index, ids in workload.get("aborts", [])}   # [[step, [request ids]], ...]
    stop_at = workload.get("stop_at")   # the step before which everything left is aborted, and the run ends
    # vLLM's frontend stamps each request with its own arrival time (a request's samples share it):
    # requests arriving in one step keep their order, as kvtrace's arrival order does
    for index, r in enumerate(pending):
        r["arrival_time"] = r["arrival_step"] + index * 1e-6
    gaps = dict(workload.get("gap", ()))   # {step: seconds} between its schedule() and its update_from_output
    slow = dict(workload.get("slow_schedule", ()))   # {step: seconds} vLLM's schedule() takes longer
    timing: list[list[float]] = []
    if gaps or slow:
        answer["timing"] = timing
    while pending or sched.has_unfinished_requests() or prev is not None:
        if not sched.has_unfinished_requests() and pending and prev is None:
            step = max(step, pending[0]["arrival_step"])   # idle until the next arrival
        while pending and pending[0]["arrival_step"] <= step:
            r = pending.pop(0)
            for sample in range(r.get("n", 1)):
                params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
                sched.add_request(Request(request_id=f"{r['id']}:{sample}", prompt_token_ids=list(r["prompt"]),
                                          sampling_params=params, pooling_params=None,
                                          arrival_time=r["arrival_time"], priority=r.get("priority", 0),
                                          block_hasher=hasher))
        if not sched.has_unfinished_requests() and prev is None:
            continue
        if step in workload.get("reset_prefix_cache_at", ()):   # as an operator's /reset_prefix_cache would
            answer.setdefault("resets", []).append([step, bool(sched.reset_prefix_cache())])
        before = {r.request_id: rec.lengths(r.request_id) for r in sched.running}
        # several KV-cache groups, or a window: what each group gave and each window dropped is recorded
        hybrid = len(rec.managers) > 1 or type(rec.manager).__name__ != "FullAttentionManager"
        rec.preempted, rec.finished, rec.uncached, rec.dropped = [], [], [], []
        rec.num_hashed.clear()
        if len(steps) == workload.get("remove_capture_at"):   # an operator removes the capture's folder
            remove_folder(workload["capture_dir"])
        if len(steps) == workload.get("remove_chunks_at"):    # or its chunks/ (a write fails, the folder stays)
            remove_folder(os.path.join(workload["capture_dir"], "chunks"))
        if len(steps) in aborts:   # clients gone before this step: the frontend aborts their requests
            sched.finish_requests(aborts[len(steps)], RequestStatus.FINISHED_ABORTED)
        if len(steps) == stop_at:   # the server shuts down with requests in flight, aborted first
            sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
            answer["aborted_at_stop"] = list(rec.finished)
            if steps and not cfg["async"]:   # freed after the last step, which the capture files them with
                steps[-1]["finished"] += rec.finished
            break
        if len(steps) in slow:
            after_schedule = sched._update_after_schedule   # called inside schedule(), at its end

            def _update_after_schedule(*args, seconds=slow[len(steps)], **kwargs):
                time.sleep(seconds)
                return after_schedule(*args, **kwargs)
            sched._update_after_schedule = _update_after_schedule
        so = sched.schedule()
        sched.__dict__.pop("_update_after_schedule", None)
        if worker is not None:   # those finishing before the next schedule(), in the order they finish
            sched.finished_req_ids = InsertionOrderedSet()
        scheduled_at = time.monotonic()
        if workload.get("bare") and on_instance(sched.kv_cache_manager, "allocate_slots"):
            # nothing of the driver's on the instance: anything there is a wrapper left behind
            answer.setdefault("left_on_allocate_slots", []).append(len(steps))
        num_free, num_cached, _ = rec.pool()
        scheduled = [[rid, n] for rid, n in so.num_scheduled_tokens.items()]
        admitted, grown = [], []
        for rid, n in scheduled:
            if rid in before:
                if rec.table(rid, before[rid]):
                    grown.append([rid, rec.table(rid, before[rid])])
            else:   # admitted: it was waiting (its preemption count is from before the step)
                request = sched.requests[rid]
                kind = "resumed" if request.num_preemptions > 0 else "new"
                admitted.append([rid, kind, request.num_computed_tokens - n, rec.table(rid)])
        preempted, uncached = list(rec.preempted), list(rec.uncached)
        if hybrid:   # per group: the blocks each scheduled request was given, and those its window dropped
            given, dropped = [], sorted(rec.dropped)
            for rid, _ in scheduled:
                now = rec.group_tables(rid)
                since = before.get(rid, (0,) * len(now))
                new = [[b for b in table[start:] if b is not None] for table, start in zip(now, since)]
                if any(new):
                    given.append([rid, new])
        index = len(steps)
        timing.append([scheduled_at])   # when schedule() returned, then when update_from_output was called
        executed = output_for(sched, so, index)   # what the model runner returns for this step, run now
        if worker is not None:   # and the connector's worker side, for this step's transfers
            tier = worker.issued(so, index)
            executed.kv_connector_output, tier["done"] = worker.output(index)
        # per request: drafts scheduled, and how many the output accepts (before vLLM cuts a stopped one short)
        sampled = dict(zip(executed.req_ids, executed.sampled_token_ids))
        drafted = sorted([rid, len(ids), len(sampled[rid]) - 1 if sampled.get(rid) else None]
                         for rid, ids in so.scheduled_spec_decode_tokens.items() if ids)
        if dropped_from is not None and index >= dropped_from:
            pass   # a caller that stops processing outputs: vLLM then schedules nothing new, step after step
        elif cfg["async"]:   # the engine core's batch queue: this step's output is processed next step
            if prev is not None:
                time.sleep(gaps.get(prev[2], 0))
                timing[prev[2]].append(time.monotonic())
                deliver(prev[2], sched.update_from_output(*prev[:2]))
            # (with a connector, a step that scheduled nothing still has an output while transfers finish in it)
            transfers = worker is not None and (worker.jobs or executed.kv_connector_output is not None)
            prev = (so, executed, index) if so.total_num_scheduled_tokens or transfers else None
        else:
            time.sleep(gaps.get(index, 0))   # the model runs longer
            timing[index].append(time.monotonic())
            deliver(index, sched.update_from_output(so, executed))
        if drafts and not cfg["async"]:   # the drafter's proposals for the next step: every decoding request
            # gets `drafts` (the AsyncScheduler schedules its configured drafts itself, as placeholders)
            sched.update_draft_token_ids(DraftTokenIds(
                [r.request_id for r in sched.running], [[TOKEN] * drafts for _ in sched.running]))
        if CAPTURE and workload.get("corrupt") and step == 1:
            corrupt(sched._kvtrace, workload["corrupt"])
        _, _, queue = rec.pool()
        record = {"step": step, "scheduled": scheduled, "preempted": preempted, "admitted": admitted,
                  "grown": grown, "uncached": uncached, "num_free": num_free, "num_cached": num_cached,
                  "finished": list(rec.finished), "free_queue": queue}
        if hybrid:
            record.update(given=sorted(given), dropped=sorted(dropped))
        if drafted:
            record["drafts"] = drafted
        if worker is not None:
            record["tier"] = tier
        if cfg["async"]:
            record["placeholders"] = sorted([rid, req.num_output_placeholders] for rid, req in sched.requests.items()
                                            if req.num_output_placeholders)
        steps.append(record)
        step += 1
        if dropped_from is not None and len(steps) >= dropped_from + 40:
            break
        if len(steps) > max_steps:
            raise RuntimeError(f"no end after {max_steps} steps")
    if CAPTURE:
        answer["final_free"] = rec.pool()[0]
        answer["allocate_calls"] = rec.allocate_calls
        answer["lookahead"] = sched.num_lookahead_tokens   # speculative decoding's reserved slots a request
        cap = sched._kvtrace   # None: the capture did not start (vLLM's scheduler as its own)
        answer["capture_started"] = cap is not None
        kvm = sched.kv_cache_manager
        answer["attributes_inline"] = {"kv_cache_manager": attributes_inline(kvm),
                                       "block_pool": attributes_inline(kvm.block_pool)}
        if cap is not None:   # what is on disk before shutdown, and what it still holds per request
            from kvtrace.vllm.capture import chunk_format
            cap.sink.drain()   # what the writer thread was handed has been written
            answer["chunks_before_shutdown"] = [
                len(chunk_format.decode(c.read_bytes()).get("steps", {}).get("step", ()))
                for c in sorted(cap.folder.rglob(f"*{chunk_format.SUFFIX}"))]
            answer["capture_held"] = {"states": len(cap.steps.states), "watched": len(cap.steps.watched),
                                      "emitted": len(cap.columns.emitted), "pending": len(cap.pending)}
        if workload.get("remove_capture_before_shutdown"):   # after the last chunk: no write fails
            remove_folder(workload["capture_dir"])
        if workload.get("remake_capture_before_shutdown"):   # and makes it again, empty
            os.makedirs(workload["capture_dir"], exist_ok=True)
        shut = answer.setdefault("vllm_shutdown", [])   # vLLM's own shutdown ran (its KV-event publisher's)
        publisher = getattr(sched, "kv_event_publisher", None)
        if publisher is not None:
            publisher_shutdown = publisher.shutdown
            publisher.shutdown = lambda: (shut.append(True), publisher_shutdown())[1]
        sched.shutdown()   # the capture's last chunk and done.json
        if cap is not None and workload.get("close_twice"):   # atexit after shutdown(): nothing more
            def written():
                return sorted((p.name, p.read_bytes()) for p in cap.folder.rglob("*") if p.is_file())
            before = written()
            cap.close()
            answer["changed_by_second_close"] = before != written()
        if cap is not None:
            import atexit
            # closed: a long session keeps no finished capture alive. Whether the capture registered its
            # close to run at exit (a process that ends without shutdown() still writes done.json)
            atexit.unregister(cap.close)
            answer["close_at_exit"] = any(f == cap.close for f in at_exit)
    return steps


def answer_all(model: str, lines, out) -> None:
    """One answer a line out for each workload a line in."""
    for line in lines:
        if not line.strip():
            continue
        try:
            answer = {}
            answer["steps"] = run(model, json.loads(line), answer)
        except Exception as exc:   # say it and carry on: one workload's failure is the test's report
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def load_capture(folder: str):
    """The capture package (kvtrace.vllm.capture, every module of it) compiled from the source files in
    `folder`, and its scheduler module returned. No bytecode is read or written: a mutant can share its
    file's size and mtime with the original, so a cached .pyc could be the original's. The rest of
    kvtrace (the parent packages) comes from this process's path."""
    import importlib
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    package, folder = "kvtrace.vllm.capture", Path(folder)

    class SourceOnly(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):
            return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)

    class CaptureFinder:
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == package:
                source = folder / "__init__.py"
            elif fullname.startswith(package + "."):
                source = folder / (fullname[len(package) + 1:].replace(".", "/") + ".py")
            else:
                return None
            if not source.is_file():
                return None
            return importlib.util.spec_from_file_location(
                fullname, source, loader=SourceOnly(fullname, str(source)),
                submodule_search_locations=[str(folder)] if fullname == package else None)

    sys.meta_path.insert(0, CaptureFinder)
    return importlib.import_module(package + ".scheduler")


def serve(model: str, socket_path: str, ready) -> None:
    """Sessions on a Unix socket, one at a time, each in a child forked from this process (vLLM and its
    configs imported and built once, here): the session's first line names the capture's package folder
    ({"capture_package": PATH}), the child loads the package from it (load_capture), answers
    {"ready": ..., "vllm_version": ...} and then one answer per workload, as on stdin. A new connection
    ends the session still running (a client killed mid-workload leaves its child behind, maybe in a
    loop): sessions are for one client at a time (scripts/mutation.py's runs, one mutant a session).
    The socket's folder is the caller's own: nothing else connects."""
    import signal
    import socket

    import vllm

    global CAPTURE, CAPTURE_CLASS
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(4)
    ready.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    ready.flush()
    child = 0
    while True:
        conn, _ = server.accept()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(child, 0)
        child = os.fork()
        if child == 0:
            code = 1
            try:
                server.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                inp, out = conn.makefile("r"), conn.makefile("w")
                hello = json.loads(inp.readline() or "{}")
                CAPTURE = "capture_package" in hello
                if CAPTURE:
                    CAPTURE_CLASS = load_capture(hello["capture_package"]).KvtraceCaptureScheduler
                out.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
                out.flush()
                answer_all(model, inp, out)
                code = 0
            except Exception:   # noqa: BLE001 - the client sees the connection close
                traceback.print_exc()
            finally:
                os._exit(code)
        conn.close()


def adapt_to_this_vllm() -> None:
    """What differs between the vLLM releases the driver builds schedulers of (before `build`)."""
    # vLLM 0.34's CPU platform refuses to build a config on x86 without Triton's CPU backend, which its
    # kernels need; the scheduler runs none, so the driver says Triton is there (0.32's CPU build has no
    # such check). check_and_update_config reads the flag when it is called.
    import dataclasses

    import vllm.triton_utils
    from vllm.v1.outputs import ModelRunnerOutput
    vllm.triton_utils.HAS_TRITON = True
    global MODEL_RUNNER_OUTPUT_FIELDS
    MODEL_RUNNER_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}   # output_for's


def main() -> int:
    model = sys.argv[1]
    global CAPTURE
    CAPTURE = "--capture" in sys.argv[2:]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # no model runs: vLLM's CPU platform, also for a GPU wheel on a machine without one (its
    # scheduler is the same Python; scripts/vllm_sched_env.sh's 0.33 venv is such a wheel)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out = os.fdopen(os.dup(1), "w", buffering=1)   # stdout carries only the answers
    os.dup2(2, 1)
    import vllm
    adapt_to_this_vllm()
    from vllm.v1.core.kv_cache_utils import init_none_hash
    global HASH_FN
    from vllm.utils.hashing import sha256
    HASH_FN = sha256   # what vLLM's prefix cache hashes with by default (bytes: the pool appends a group id)
    init_none_hash(HASH_FN)
    CONFIGS["vllm_config"] = fresh_config(model, {   # once, before the first workload (seconds)
        "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64, "long_prefill_token_threshold": 0,
        "policy": "fcfs", "async": False, "block_size": 16, "enable_prefix_caching": True})
    if "--serve" in sys.argv[2:]:
        serve(model, sys.argv[sys.argv.index("--serve") + 1], out)
        return 0
    out.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    answer_all(model, sys.stdin, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
