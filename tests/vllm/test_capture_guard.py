"""The capture's start-up guard (kvtrace/vllm/capture/guard.py) without vLLM: stand-in classes with
everything it checks pass; take one name away and the refusal names exactly that one. (With vLLM:
tests/vllm/test_vllm_capture.py removes a real method; tests/vllm/test_capture_on_vllm.py runs
the guard on the own classes of every vLLM the tests have, 0.31.0 to 0.34.0 in CI.)"""
from __future__ import annotations

import pytest

from kvtrace.vllm.capture import guard


def _methods(name: str, methods: dict[str, tuple[str, ...]], drop_local: str | None = None) -> type:
    namespace = {}
    for method, params in methods.items():
        args = ", ".join(["self", *params])
        local_names = [n for n in guard.FRAME_LOCALS.get((name, method), ()) if n not in params and n != drop_local]
        body = "; ".join(f"{n} = None" for n in local_names) or "pass"
        exec(f"def {method}({args}): {body}", namespace)   # exactly these parameters, and the locals read
    return type(name, (), {m: namespace[m] for m in methods})


def _fields(name: str, names: tuple[str, ...]) -> type:
    return type(name, (), {"__annotations__": dict.fromkeys(names, "object")})


def classes(drop: tuple[str, str] | None = None) -> list[type]:
    """Scheduler, KVCacheManager, BlockPool, KVCacheBlock, Request, RequestStatus, SchedulerOutput and
    EngineCoreOutput stand-ins, with `drop` = (class, name) left out."""
    def without(what, names):
        return {k: v for k, v in names.items() if (what, k) != drop} if isinstance(names, dict) else \
            tuple(n for n in names if (what, n) != drop)
    return [_methods("Scheduler", without("Scheduler", guard.SCHEDULER_METHODS),
                     drop_local=drop[1] if drop and drop[0] == "Scheduler.schedule" else None),
            _methods("KVCacheManager", without("KVCacheManager", guard.KV_CACHE_MANAGER_METHODS)),
            _methods("BlockPool", without("BlockPool", guard.BLOCK_POOL_METHODS)),
            _fields("KVCacheBlock", without("KVCacheBlock", guard.BLOCK_FIELDS)),
            _fields("Request", without("Request", guard.REQUEST_FIELDS)),
            type("RequestStatus", (), dict.fromkeys(without("RequestStatus", guard.STATUSES), 0)),
            _fields("SchedulerOutput", without("SchedulerOutput", guard.SCHEDULER_OUTPUT_FIELDS)),
            _fields("EngineCoreOutput", without("EngineCoreOutput", guard.ENGINE_CORE_OUTPUT_FIELDS))]


def test_everything_there_passes():
    guard.check_classes(*classes())


@pytest.mark.parametrize("what, name", [("Scheduler", "_preempt_request"), ("BlockPool", "touch"),
                                        ("KVCacheBlock", "block_hash"), ("Request", "num_output_placeholders"),
                                        ("RequestStatus", "PREEMPTED"), ("SchedulerOutput", "scheduled_new_reqs"),
                                        ("SchedulerOutput", "num_scheduled_tokens"),
                                        ("EngineCoreOutput", "new_token_ids")])
def test_the_refusal_names_what_is_gone(what, name):
    with pytest.raises(guard.VllmChanged, match=rf"^vLLM changed: {what}\.{name} is gone"):
        guard.check_classes(*classes(drop=(what, name)))


def test_a_renamed_parameter_is_named():
    methods = {**guard.KV_CACHE_MANAGER_METHODS, "allocate_slots": ("request", "num_new_tokens", "num_computed")}
    cls = classes()
    cls[1] = _methods("KVCacheManager", methods)
    with pytest.raises(guard.VllmChanged, match="KVCacheManager.allocate_slots has no parameter "
                                                "'num_new_computed_tokens'"):
        guard.check_classes(*cls)


def test_versions_outside_the_tested_ones_are_refused():
    for version in ("0.31.0", "0.32.0", "0.33.1", "0.34.0"):
        guard.check_version(version)
    for version in ("0.30.0", "0.35.0", "1.0.0"):
        with pytest.raises(guard.VllmChanged, match=f"vLLM {version} is outside the versions this capture supports"):
            guard.check_version(version)


def test_a_local_the_capture_reads_is_checked():
    """The running request a preemption serves is read in vLLM's schedule's frame (scheduler.py's
    `requester`): a schedule without that local is refused, by name."""
    with pytest.raises(guard.VllmChanged, match=r"^vLLM changed: Scheduler\.schedule has no local 'request'"):
        guard.check_classes(*classes(("Scheduler.schedule", "request")))


def test_kvtrace_vllm_versions_narrows_the_versions_the_capture_starts_on(monkeypatch):
    """An operator who has validated fewer releases than kvtrace supports lists them: the others are refused
    (reason vllm_version, as a release kvtrace does not support); a listed version kvtrace does not support
    is a bad setting, never a widening."""
    first, other = (f"{a}.{b}" for a, b in guard.SUPPORTED[:2])
    monkeypatch.setenv("KVTRACE_VLLM_VERSIONS", f" {other} ")
    assert guard.accepted_versions() == (guard.version_tuple(other),)
    guard.check_version(f"{other}.1")
    with pytest.raises(guard.VllmChanged, match=rf"vLLM {first}.0 is outside the versions KVTRACE_VLLM_VERSIONS "
                                                rf"lets the capture start on \({other};") as refused:
        guard.check_version(f"{first}.0")
    assert refused.value.reason == "vllm_version"
    for text in ("0.1", f"{other},9.9", "latest"):
        monkeypatch.setenv("KVTRACE_VLLM_VERSIONS", text)
        with pytest.raises(ValueError, match="KVTRACE_VLLM_VERSIONS=.*expected some of the versions"):
            guard.accepted_versions()
    monkeypatch.delenv("KVTRACE_VLLM_VERSIONS")
    assert guard.accepted_versions() == guard.SUPPORTED
    with pytest.raises(guard.VllmChanged, match="outside the versions this capture supports") as refused:
        guard.check_version("0.1.0")
    assert refused.value.reason == "vllm_version"
