"""The vLLM capture writes the engine's trace vocabulary: its event kinds and reason strings are the
values of engine/events.py's constants. The capture runs inside vLLM's environment and cannot import
the engine, so it spells them out; this reads its source and checks every spelling."""
from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path

from engine import events as ev

CAPTURE = Path(__file__).resolve().parents[2] / "kvtrace" / "vllm" / "capture"
EVENT_FIELDS = ("kind", "req_id", "blocks", "num_tokens", "reason")   # rows.py's KvEvent, as far as read here
BLOCK_EVENT_FIELDS = ("kind", "req_id", "blocks", "reason", "kv_group")   # rows.py's block_event (alloc, free, evict)
CAPTURE_ONLY = {"other"}   # a block vLLM allocates or frees outside any step the capture can attribute


def _strings(node: ast.AST | None) -> set[str]:
    """The string constants an expression can evaluate to (through conditional expressions)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body) | _strings(node.orelse)
    return set()


def _capture_vocabulary() -> dict[str, set[str]]:
    tree = ast.Module(body=[node for path in sorted(CAPTURE.glob("*.py")) for node in ast.parse(path.read_text()).body],
                      type_ignores=[])
    found: dict[str, set[str]] = {"kind": set(), "event reason": set(), "alloc_reason": set(),
                                  "free_reason": set(), "reason": set(), "finish": set(), "victim_reason": set(),
                                  "admission_stop": set()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("KvEvent", "block_event"):
            names = EVENT_FIELDS if node.func.id == "KvEvent" else BLOCK_EVENT_FIELDS
            fields = {**dict(zip(names, node.args)), **{k.arg: k.value for k in node.keywords}}
            found["kind"] |= _strings(fields.get("kind"))
            found["event reason"] |= _strings(fields.get("reason"))
        elif isinstance(node, ast.FunctionDef) and node.name == "admission_stop":
            found["admission_stop"] |= {s for r in ast.walk(node) if isinstance(r, ast.Return) for s in _strings(r.value)}
        elif isinstance(node, ast.FunctionDef) and node.name == "reason_for_alloc":
            found["alloc_reason"] |= {s for r in ast.walk(node) if isinstance(r, ast.Return) for s in _strings(r.value)}
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
                if name in ("alloc_reason", "free_reason", "reason", "victim_reason"):
                    found[name] |= _strings(node.value)
                if name == "FINISH_REASONS":
                    found["finish"] |= {s for v in node.value.values for s in _strings(v)}
    return found


def _values(enum: type[StrEnum]) -> set[str]:
    return {m.value for m in enum}


def test_the_capture_writes_the_engines_event_kinds_and_reasons():
    found = _capture_vocabulary()
    kinds = {v for k, v in vars(ev).items() if k.isupper() and isinstance(v, str) and not k.startswith("REPREFILL_")}
    assert found["kind"] and found["kind"] <= kinds, found["kind"] - kinds
    assert found["alloc_reason"] <= _values(ev.AllocReason) | CAPTURE_ONLY, found["alloc_reason"]
    assert found["free_reason"] <= _values(ev.FreeReason) | CAPTURE_ONLY, found["free_reason"]
    assert found["finish"] and found["finish"] <= _values(ev.FinishReason), found["finish"]
    assert found["reason"] <= _values(ev.AdmitReason), found["reason"]
    event_reasons = (_values(ev.PreemptReason) | _values(ev.AdmitReason) | {ev.REPREFILL_INTERRUPTED})
    assert found["event reason"] <= event_reasons, found["event reason"] - event_reasons
    # every hand-written spelling was seen: the walk above did not miss the capture's event tuples
    assert {"alloc", "free", "admit", "prefix_hit", "preempt", "reprefill", "finish"} <= found["kind"]
    assert {"prefill", "decode"} <= found["alloc_reason"] and {"preempt", "finish"} <= found["free_reason"]
    # schema 3's causes: vLLM's two victim policies, and every admission stop vLLM can show
    assert found["victim_reason"] == {"newest", "lowest-priority"} <= _values(ev.VictimReason)
    assert found["admission_stop"] == _values(ev.AdmissionStop) - {"watermark"}, found["admission_stop"]
