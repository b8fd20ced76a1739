"""Refuse to capture when vLLM's internals moved: every name, parameter and field the capture uses.

vLLM says its scheduler interface is not public, so each release may rename what the capture
wraps. Rather than a broken engine or a silently partial trace, the capture checks at start-up that
every method it wraps exists with the parameters it passes or reads, and every field it reads is
there; the first thing missing stops the engine with a message naming it.
"""
from __future__ import annotations

import dataclasses
import inspect
import os

# vLLM minor versions the capture is tested on, exactly: tests/vllm/test_capture_on_vllm.py runs it
# on 0.31.0, 0.32.0, 0.33.0 and 0.34.0's own Scheduler and AsyncScheduler (docs/vllm.md's support table)
SUPPORTED = ((0, 31), (0, 32), (0, 33), (0, 34))

# (method, parameters the capture relies on)
SCHEDULER_METHODS = {
    "schedule": (),
    "update_from_output": ("scheduler_output", "model_runner_output"),
    "_preempt_request": ("request",),
    "_free_request": ("request",),
    "add_request": ("request",),
    "reset_prefix_cache": (),
    "has_unfinished_requests": (),
    "shutdown": (),
}
KV_CACHE_MANAGER_METHODS = {
    "allocate_slots": ("request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks"),
    "free": ("request",),
    "get_block_ids": ("request_id",),
}
BLOCK_POOL_METHODS = {
    "get_new_blocks": ("num_blocks",),
    "free_blocks": ("ordered_blocks",),
    "touch": ("blocks",),
    "_maybe_evict_cached_block": ("block",),
    "get_num_free_blocks": (),
}
# locals the capture reads in vLLM's frames (wraps.py's `allocating` and `requester`): the request
# of a running request's allocate_slots, and the running request the schedule loop preempts for
FRAME_LOCALS = {("Scheduler", "schedule"): ("request",), ("KVCacheManager", "allocate_slots"): ("request",)}
BLOCK_FIELDS = ("block_id", "ref_cnt", "block_hash", "is_null")
REQUEST_FIELDS = ("request_id", "status", "num_computed_tokens", "num_tokens", "num_prompt_tokens", "max_tokens",
                  "num_output_tokens", "arrival_time", "priority", "num_output_placeholders", "is_prefill_chunk")
STATUSES = ("WAITING", "RUNNING", "PREEMPTED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED",
            "FINISHED_IGNORED")
# what the capture reads of a step's SchedulerOutput and of each request's EngineCoreOutput
SCHEDULER_OUTPUT_FIELDS = ("num_scheduled_tokens", "scheduled_new_reqs", "scheduled_cached_reqs",
                           "scheduled_spec_decode_tokens")
CACHED_REQUEST_DATA_FIELDS = ("req_ids", "new_block_ids")   # whose the running loop's new blocks are
ENGINE_CORE_OUTPUT_FIELDS = ("request_id", "new_token_ids")
MODEL_RUNNER_OUTPUT_FIELDS = ("req_ids", "sampled_token_ids")   # a speculative step's accepted drafts
SCHEDULER_FIELDS = ("running", "waiting", "requests", "kv_cache_manager", "block_size", "policy",
                    "max_num_running_reqs")


class VllmChanged(RuntimeError):
    """vLLM lacks something the capture needs; the message names it. `reason` says which kind of thing, in a
    word (error.json's and the exporter's `kvtrace_capture_up`): `vllm_version` (a release the capture does
    not accept), `model` (a KV cache it cannot follow), `vllm_changed` (a name it uses is gone)."""

    def __init__(self, message: str, reason: str = "vllm_changed") -> None:
        super().__init__(message)
        self.reason = reason


# the managers vLLM chooses per KV-cache group that the capture follows (exactly these classes: a
# subclass, such as full attention's R-SWA, circular-buffer, sink or sparse variants, frees or shares
# blocks in ways the capture does not follow), by the kind of group written into meta.json
FOLLOWED_MANAGERS = {"FullAttentionManager": "full_attention", "SlidingWindowManager": "sliding_window",
                     "ChunkedLocalAttentionManager": "chunked_local", "MambaManager": "mamba"}
# locals read in the managers' frames where a request's blocks leave its window mid-request (wraps.py)
SKIPPING_LOCALS = {"SingleTypeKVCacheManager": ("_remove_blocks_in_range", ("self", "request_id")),
                   "MambaManager": ("remove_skipped_blocks", ("self", "request_id"))}


# a KV connector's scheduler side (KVConnectorBase_V1; connector.py wraps the instance's methods), what
# allocate_slots is told of its hit, and what a worker output says of its copies
CONNECTOR_METHODS = {
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request",),
}
CONNECTOR_ALLOCATE_SLOTS = ("num_external_computed_tokens", "delay_cache_blocks")
CONNECTOR_OUTPUT_FIELDS = ("finished_recving", "failed_recving", "kv_connector_worker_meta")


def check_connector(scheduler: object) -> None:
    """Where a KV connector is configured (a KV tier: `scheduler.connector`), the names connector.py uses:
    the connector's scheduler-side methods and their parameters, allocate_slots' parameters for the
    connector's hit, KVConnectorOutput's fields, and for vLLM's OffloadingConnector its scheduler side's
    jobs in flight, chunk size and manager's prepare_store (whose output names the chunks it evicted)."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return
    what = type(connector).__name__
    _check_methods(type(connector), what, CONNECTOR_METHODS)
    _check_methods(type(scheduler.kv_cache_manager), "KVCacheManager", {"allocate_slots": CONNECTOR_ALLOCATE_SLOTS})
    try:
        from vllm.v1.outputs import KVConnectorOutput
    except ImportError as exc:
        raise VllmChanged(f"vLLM changed: {exc} (the capture reads KVConnectorOutput)") from exc
    fields = _fields_of(KVConnectorOutput)
    for name in CONNECTOR_OUTPUT_FIELDS:
        if name not in fields:
            raise VllmChanged(f"vLLM changed: KVConnectorOutput.{name} is gone (the capture reads it)")
    if what != "OffloadingConnector":
        return
    side = getattr(connector, "connector_scheduler", None)
    if not isinstance(getattr(side, "_jobs", None), dict):
        raise VllmChanged("vLLM changed: OffloadingConnector.connector_scheduler._jobs is gone (the capture reads it)")
    if not isinstance(getattr(getattr(side, "config", None), "blocks_per_chunk", None), int):
        raise VllmChanged("vLLM changed: the OffloadingConnector's config.blocks_per_chunk is gone (the capture reads it)")
    if not callable(getattr(getattr(side, "manager", None), "prepare_store", None)):
        raise VllmChanged("vLLM changed: the OffloadingConnector's manager.prepare_store is gone (the capture wraps it)")
    try:
        from vllm.v1.kv_offload.base import PrepareStoreOutput
    except ImportError as exc:
        raise VllmChanged(f"vLLM changed: {exc} (the capture reads PrepareStoreOutput)") from exc
    if "evicted_keys" not in _fields_of(PrepareStoreOutput):
        raise VllmChanged("vLLM changed: PrepareStoreOutput.evicted_keys is gone (the capture reads it)")


def check_kv_cache(scheduler: object) -> None:
    """Each KV-cache group's manager (vLLM's spec_manager_map's choice) one the capture follows: plain full
    attention (a dense model's, MLA's too), and beside it a hybrid model's sliding-window, chunked local
    or Mamba groups (Gemma 3, gpt-oss, Llama 4, Qwen3-Next, Granite 4). Full attention's variants (R-SWA,
    circular buffers, sinks, sparse attention) free or share blocks otherwise: the capture refuses them
    at start-up rather than write a trace that is wrong. For several groups, what the capture reads to
    tell them apart is checked too (each manager's group id, the frames of the mid-request frees,
    vLLM's group id in a prefix-cache key)."""
    from vllm.v1.core import single_type_kv_cache_manager as managers_module

    managers = getattr(getattr(scheduler.kv_cache_manager, "coordinator", None), "single_type_managers", None)
    if managers is None:
        raise VllmChanged("vLLM changed: KVCacheManager.coordinator.single_type_managers is gone")
    names = [type(m).__name__ for m in managers]
    unfollowed = [n for m, n in zip(managers, names)
                  if n not in FOLLOWED_MANAGERS or type(m) is not getattr(managers_module, n, None)]
    if unfollowed:
        kinds = ", ".join(f"'{k}'" for k in FOLLOWED_MANAGERS)
        raise VllmChanged(f"kvtrace capture: this model's KV cache is {len(managers)} group(s) "
                          f"({', '.join(names)}); the capture follows groups of {kinds} only, not "
                          f"{unfollowed[0]}: serve this model without kvtrace's scheduler_cls", reason="model")
    if len(managers) > 1:
        for m in managers:
            if not isinstance(getattr(m, "kv_cache_group_id", None), int):
                raise VllmChanged(f"vLLM changed: {type(m).__name__}.kv_cache_group_id is gone")
        for owner, (name, names_read) in SKIPPING_LOCALS.items():
            _check_locals(getattr(managers_module, owner, object), owner, name, names_read)
        from vllm.v1.core import kv_cache_utils
        if not callable(getattr(kv_cache_utils, "get_group_id", None)):
            raise VllmChanged("vLLM changed: kv_cache_utils.get_group_id is gone (the capture reads it)")


def kv_cache_groups(scheduler: object) -> list[dict]:
    """The KV-cache groups as meta.json describes them (docs/trace-format.md): per group, in vLLM's
    order, its kind, block size, layers, and its window or chunk where it has one."""
    groups = []
    for m in scheduler.kv_cache_manager.coordinator.single_type_managers:
        spec = m.kv_cache_spec
        group = {"kind": FOLLOWED_MANAGERS.get(type(m).__name__, type(m).__name__), "block_size": m.block_size}
        for field in ("sliding_window", "attention_chunk_size"):
            if getattr(spec, field, None):
                group[field] = getattr(spec, field)
        groups.append(group)
    config = getattr(scheduler, "kv_cache_config", None)
    for group, spec in zip(groups, getattr(config, "kv_cache_groups", ()) or ()):
        group["layers"] = len(getattr(spec, "layer_names", ()) or ())
    return groups


def version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def accepted_versions() -> tuple[tuple[int, int], ...]:
    """The versions the capture starts on: SUPPORTED, or those of them `KVTRACE_VLLM_VERSIONS` lists
    (`0.33`, `0.32,0.33`), for an operator who has validated fewer releases than kvtrace supports (and for
    the tests, which refuse the vLLM they serve this way). It only narrows: ValueError names an entry
    outside SUPPORTED."""
    text = os.environ.get("KVTRACE_VLLM_VERSIONS", "").strip()
    if not text:
        return SUPPORTED
    listed = [version_tuple(v) for v in text.split(",")]
    if not all(v in SUPPORTED for v in listed):
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise ValueError(f"KVTRACE_VLLM_VERSIONS={text!r}: expected some of the versions the capture supports "
                         f"({supported}), separated by commas")
    return tuple(v for v in SUPPORTED if v in listed)


def check_version(version: str) -> None:
    accepted = accepted_versions()
    if version_tuple(version) not in accepted:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        if accepted != SUPPORTED:
            raise VllmChanged(f"vLLM {version} is outside the versions KVTRACE_VLLM_VERSIONS lets the capture "
                              f"start on ({', '.join(f'{a}.{b}' for a, b in accepted)}; it supports {supported})",
                              reason="vllm_version")
        raise VllmChanged(f"vLLM {version} is outside the versions this capture supports ({supported}); "
                          f"set KVTRACE_VLLM_ANY_VERSION=1 to try it (the name check still runs)",
                          reason="vllm_version")


def _check_methods(owner: object, what: str, methods: dict[str, tuple[str, ...]]) -> None:
    for name, params in methods.items():
        method = getattr(owner, name, None)
        if not callable(method):
            raise VllmChanged(f"vLLM changed: {what}.{name} is gone (the capture wraps it)")
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue
        missing = [p for p in params if p not in signature.parameters]
        if missing:
            raise VllmChanged(f"vLLM changed: {what}.{name} has no parameter {missing[0]!r} "
                              f"(it takes {', '.join(signature.parameters)})")


def _check_locals(owner: type, what: str, name: str, names: tuple[str, ...]) -> None:
    # vLLM's own function, not a kvtrace subclass's wrapper of it
    function = next((k.__dict__[name] for k in getattr(owner, "__mro__", (owner,))
                     if name in k.__dict__ and not k.__module__.startswith("kvtrace.")), None)
    code = getattr(function, "__code__", None)
    if code is None:
        raise VllmChanged(f"vLLM changed: {what}.{name} is not a Python function (the capture reads its locals)")
    missing = [n for n in names if n not in code.co_varnames + code.co_cellvars]   # a cell: a closure reads it
    if missing:
        raise VllmChanged(f"vLLM changed: {what}.{name} has no local {missing[0]!r} (the capture reads it)")


def _fields_of(cls: type) -> set[str]:
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "__annotations__", {}))
    for base in getattr(cls, "__mro__", ()):
        names |= set(getattr(base, "__annotations__", {}))
        names |= set(getattr(base, "__slots__", ()) or ())
    return names


def check_classes(scheduler_cls: type, kv_cache_manager_cls: type, block_pool_cls: type, block_cls: type,
                  request_cls: type, status_cls: type, scheduler_output_cls: type | None = None,
                  engine_core_output_cls: type | None = None, model_runner_output_cls: type | None = None,
                  cached_request_data_cls: type | None = None) -> None:
    """Raise VllmChanged naming the first missing method, parameter or field."""
    _check_methods(scheduler_cls, "Scheduler", SCHEDULER_METHODS)
    _check_methods(kv_cache_manager_cls, "KVCacheManager", KV_CACHE_MANAGER_METHODS)
    _check_methods(block_pool_cls, "BlockPool", BLOCK_POOL_METHODS)
    owners = {"Scheduler": scheduler_cls, "KVCacheManager": kv_cache_manager_cls}
    for (what, name), names in FRAME_LOCALS.items():
        _check_locals(owners[what], what, name, names)
    fields = _fields_of(block_cls)
    for name in BLOCK_FIELDS:
        if name not in fields:
            raise VllmChanged(f"vLLM changed: KVCacheBlock.{name} is gone")
    fields = _fields_of(request_cls)
    try:   # Request sets most of its fields in __init__, not as annotations
        source = inspect.getsource(request_cls)
    except (OSError, TypeError):   # no source (a .pyc-only install): the annotations must do
        source = ""
    for name in REQUEST_FIELDS:
        if name not in fields and f"self.{name}" not in source:
            raise VllmChanged(f"vLLM changed: Request.{name} is gone")
    for name in STATUSES:
        if not hasattr(status_cls, name):
            raise VllmChanged(f"vLLM changed: RequestStatus.{name} is gone")
    for cls, what, names in ((scheduler_output_cls, "SchedulerOutput", SCHEDULER_OUTPUT_FIELDS),
                             (engine_core_output_cls, "EngineCoreOutput", ENGINE_CORE_OUTPUT_FIELDS),
                             (model_runner_output_cls, "ModelRunnerOutput", MODEL_RUNNER_OUTPUT_FIELDS),
                             (cached_request_data_cls, "CachedRequestData", CACHED_REQUEST_DATA_FIELDS)):
        if cls is not None:
            fields = _fields_of(cls)
            for name in names:
                if name not in fields:
                    raise VllmChanged(f"vLLM changed: {what}.{name} is gone (the capture reads it)")


def check_instance(scheduler: object) -> None:
    for name in SCHEDULER_FIELDS:
        if not hasattr(scheduler, name):
            raise VllmChanged(f"vLLM changed: Scheduler.{name} is gone")
    if not callable(getattr(scheduler.waiting, "peek_request", None)):
        raise VllmChanged("vLLM changed: Scheduler.waiting has no peek_request (the capture wraps it)")
    pool = getattr(scheduler.kv_cache_manager, "block_pool", None)
    for name in ("num_gpu_blocks", "null_block", "blocks"):
        if not hasattr(pool, name):
            raise VllmChanged(f"vLLM changed: BlockPool.{name} is gone")
