"""What a workload's header says about how to replay it: the vLLM version to follow.

A workload file may begin with `# ` comment lines (docs/workload-format.md). `kvtrace workload from-run`
writes one of them as `# follow_vllm: VERSION (...)`: the vLLM whose scheduling decisions the run made
(a vLLM capture's version, or the `--follow-vllm` a kvtrace run followed). `kvtrace record` follows it
unless `--follow-vllm` is given. It imports only engine.config and the standard library: `record`
reads it before the engine starts.
"""
from __future__ import annotations

import os
import re

from engine.config import VLLM_VERSION, VLLM_VERSIONS

FOLLOW_VLLM_KEY = "follow_vllm"
FOLLOW_NOTE = "vLLM version:"   # a from-run note about the version, where none is named to follow
_FOLLOW_LINE = re.compile(rf"#\s*{FOLLOW_VLLM_KEY}:\s*(\d\S*)")   # a version: digits first


def followable(version: str) -> str | None:
    """The version of VLLM_VERSIONS that `version` names (a local label such as `+cpu` aside), or None."""
    base = version.strip().split("+", 1)[0]
    return base if base in VLLM_VERSIONS else None


def follow_vllm_line(version: str, why: str) -> str:
    """The header comment (without `# `) that names the version to follow, and why."""
    return f"{FOLLOW_VLLM_KEY}: {version} ({why})"


def header_follow_vllm(path: str | os.PathLike) -> str | None:
    """The version a workload's leading comment lines name to follow, as written; None if none does."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.startswith("#"):
                    break
                match = _FOLLOW_LINE.match(line)
                if match:
                    return match.group(1)
    except (OSError, UnicodeDecodeError):
        return None   # load_workload reports a file it cannot read
    return None


def resolve_follow_vllm(given: str | None, workload: str | os.PathLike) -> tuple[str, str | None]:
    """(the version to follow, a note for the user or None): `given` wins; else the header's, if followable."""
    if given is not None:
        return given, None
    named = header_follow_vllm(workload)
    if named is None:
        return VLLM_VERSION, None
    version = followable(named)
    if version is None:
        return VLLM_VERSION, (f"the workload's header names vLLM {named}, which kvtrace cannot follow "
                              f"(it follows {', '.join(VLLM_VERSIONS)}): following the default {VLLM_VERSION}")
    return version, f"following vLLM {version}, as the workload's header says (--follow-vllm overrides)"
