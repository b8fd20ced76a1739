"""Workloads: the JSONL format, a production-like generator, and importers for public traces."""
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
from kvtrace.workload.importers import FORMATS, ImportOptions, ImportResult, import_trace
from kvtrace.workload.synth import PRESETS, SynthConfig, generate

__all__ = [
    "FIELDS", "FORMATS", "PRESETS", "ImportOptions", "ImportResult", "SynthConfig", "WorkloadRequest",
    "generate", "import_trace", "load_workload", "resolve_prompt_ids", "save_workload",
    "synthetic_ids", "validate_lengths", "workload_sha256",
]
