"""Workloads: the JSONL format, a production-like generator, and importers for public traces."""
import importlib

from kvtrace.workload.format import (
    FIELDS,
    WorkloadRequest,
    load_workload,
    resolve_prompt_ids,
    save_workload,
    synthetic_ids,
    validate_lengths,
    workload_sha256,
)

# the importers and the generator, imported when first asked for (a replay needs neither)
_LAZY = {"FORMATS": "importers", "ImportOptions": "importers", "ImportResult": "importers", "import_trace": "importers",
         "PRESETS": "synth", "SynthConfig": "synth", "generate": "synth"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"kvtrace.workload.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "FIELDS", "FORMATS", "PRESETS", "ImportOptions", "ImportResult", "SynthConfig", "WorkloadRequest",
    "generate", "import_trace", "load_workload", "resolve_prompt_ids", "save_workload",
    "synthetic_ids", "validate_lengths", "workload_sha256",
]
