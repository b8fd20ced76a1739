"""The capture's options, read from the environment, and the files that say who is writing.

The options are environment variables because vLLM builds the scheduler itself, in EngineCore, from a
class name: `kvtrace vllm-env` prints them (docs/vllm.md). `KVTRACE_CAPTURE_DIR` is required; the
retention and flush interval are parsed as sink.py parses them.

A capture folder can hold several servers (restarts, replicas, the data-parallel ranks of one `vllm
serve`: an engine core and a scheduler each): each writes under its own id, `<UTC start>Z-<pid>`. Files
and folders are made with files.py's modes (owner and group only by default; `KVTRACE_CAPTURE_MODE`). The files beside the chunks:
- `servers/<server id>.json`, and `capture.json` (the newest server's, for `kvtrace record --endpoint`):
  the server's identity (vLLM version, model, scheduler, KV pool geometry, options, clock offset, and
  its place in the deployment: host, vLLM instance, data-parallel rank and size, `deployment()`);
- `servers/<server id>.error.json` and `error.json` (the newest's): why a server's capture stepped aside,
  refused to start or stopped (aside.py);
- `done.json`: the summary written at close;
- `servers/<server id>.dropped.json`: the chunks a slow disk made the sink drop (sink.py).
Each is written to a hidden name and renamed into place, so a reader never sees half of one.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy

import kvtrace
from kvtrace.vllm.capture import chunk_format, guard
from kvtrace.vllm.capture.connector import kv_tiers
from kvtrace.vllm.capture.files import FILE_MODE, parse_mode, write_json
from kvtrace.vllm.capture.sink import parse_age, parse_bytes


def capture_folder() -> Path:
    """KVTRACE_CAPTURE_DIR; a server with kvtrace's scheduler class and none set refuses to start
    rather than record nowhere."""
    folder = os.environ.get("KVTRACE_CAPTURE_DIR")
    if not folder:
        raise RuntimeError("kvtrace capture: set KVTRACE_CAPTURE_DIR to the capture folder "
                           "(kvtrace record --engine vllm does; see docs/vllm.md for vllm serve)")
    return Path(folder)


@dataclass(frozen=True, slots=True)
class Settings:
    """The capture's options (ValueError names a variable it cannot parse)."""

    folder: Path
    token_ids: bool      # KVTRACE_CAPTURE_TOKEN_IDS=1: live traffic's token ids are its users' text, kept only if asked
    self_check: bool     # KVTRACE_CAPTURE_SELF_CHECK=1: the pool replayed from the events, checked every step
    max_bytes: int       # KVTRACE_CAPTURE_MAX_BYTES and _MAX_AGE: the folder's retention (sink.py)
    max_age_s: float
    flush_s: float       # KVTRACE_CAPTURE_FLUSH_EVERY: how often a busy server writes a chunk (what a crash can lose)
    file_mode: int = FILE_MODE   # KVTRACE_CAPTURE_MODE: the files' mode (files.py)

    @classmethod
    def from_environment(cls, folder: Path) -> Settings:
        env = os.environ.get
        return cls(folder=folder, token_ids=env("KVTRACE_CAPTURE_TOKEN_IDS") == "1",
                   self_check=env("KVTRACE_CAPTURE_SELF_CHECK") == "1",
                   max_bytes=parse_bytes(env("KVTRACE_CAPTURE_MAX_BYTES") or "4GiB", "KVTRACE_CAPTURE_MAX_BYTES"),
                   max_age_s=parse_age(env("KVTRACE_CAPTURE_MAX_AGE") or "7d", "KVTRACE_CAPTURE_MAX_AGE"),
                   flush_s=parse_age(env("KVTRACE_CAPTURE_FLUSH_EVERY") or "2s", "KVTRACE_CAPTURE_FLUSH_EVERY"),
                   file_mode=parse_mode(env("KVTRACE_CAPTURE_MODE") or oct(FILE_MODE), "KVTRACE_CAPTURE_MODE"))


@dataclass(frozen=True, slots=True)
class Server:
    """This server's name in the folder, its salt and its clock."""

    server_id: str
    started: datetime
    # prefix structure without content: vLLM's block hashes (of token ids) hashed again with a key
    # that is never written, so they match within this capture and cannot be matched to any text
    salt: bytes
    salt_id: str
    wall_minus_monotonic: float   # the rows carry monotonic seconds; this puts them on the wall clock

    @classmethod
    def starting(cls) -> Server:
        started = datetime.now(timezone.utc)
        return cls(server_id=f"{started:%Y%m%dT%H%M%S}Z-{os.getpid()}", started=started,
                   salt=secrets.token_bytes(16), salt_id=secrets.token_hex(4),
                   wall_minus_monotonic=time.time() - time.monotonic())


def write_identity(settings: Settings, server: Server, scheduler, version: str, capture_module: str) -> None:
    """servers/<server id>.json and capture.json: who writes the chunks, with what options."""
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    model = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    identity = {
        "server_id": server.server_id, "started_at": server.started.isoformat(), "pid": os.getpid(),
        "vllm_version": version, "model": getattr(model, "served_model_name", None) or getattr(model, "model", None),
        "scheduler": type(scheduler).__name__, "async_scheduling": isinstance(scheduler, AsyncScheduler),
        "policy": "priority" if scheduler.policy == SchedulingPolicy.PRIORITY else "fcfs",
        "salt_id": server.salt_id, "token_ids": settings.token_ids, "capture_module": capture_module,
        "max_bytes": settings.max_bytes, "max_age_s": settings.max_age_s, "flush_s": settings.flush_s,
        "started_monotonic": time.monotonic(), "wall_minus_monotonic": server.wall_minus_monotonic,
        "block_size": scheduler.block_size, "num_gpu_blocks": pool.num_gpu_blocks,
        "null_block": pool.null_block.block_id,
        "enable_prefix_caching": bool(getattr(pool, "enable_caching", False)),
        "max_num_seqs": scheduler.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": scheduler.scheduler_config.max_num_batched_tokens,
        "max_model_len": getattr(scheduler, "max_model_len", None),
        "watermark_blocks": getattr(kvm, "watermark_blocks", None),
        "kv_cache_groups": guard.kv_cache_groups(scheduler),
        "kv_tiers": kv_tiers(scheduler),   # a KV connector's tier (connector.py), [] without one
        # speculative decoding: draft tokens per step, and the slots reserved past a request's tokens for them
        "num_spec_tokens": getattr(scheduler, "num_spec_tokens", 0) or 0,
        "num_lookahead_tokens": getattr(scheduler, "num_lookahead_tokens", 0) or 0,
        "spec_method": getattr(getattr(getattr(scheduler, "vllm_config", None), "speculative_config", None), "method", None),
        "self_check": settings.self_check,
        "kvtrace_version": kvtrace.__version__, "chunk_format": chunk_format.FORMAT,
        "file_mode": oct(settings.file_mode),
    }
    if isinstance(identity["model"], list):   # served under several names: the first
        identity["model"] = identity["model"][0]
    identity.update(deployment(getattr(scheduler, "vllm_config", None)))
    write_json(settings.folder, f"servers/{server.server_id}.json", identity, settings.file_mode)
    write_json(settings.folder, "capture.json", identity, settings.file_mode)


def deployment(vllm_config) -> dict:
    """Where this scheduler stands in its deployment: the host, vLLM's instance id (one per `vllm serve`:
    its ranks share it) and the data-parallel rank and size, as vLLM's configuration says them; a field
    this vLLM lacks is null (the capture runs on).

    vLLM runs one engine core, and so one scheduler, per data-parallel rank. For a mixture-of-experts
    model the ranks step together and its config keeps `data_parallel_rank` and `data_parallel_size`; a
    dense model's ranks are independent engines, whose config vLLM rewrites to a deployment of one
    (size 1, rank 0: ParallelConfig.reconfigure_for_independent_dp_rank), keeping the rank in
    `data_parallel_index`, which is therefore read first. The size is written where it is above 1 (null
    for a server without data parallelism, and for a dense model's ranks, whose size vLLM does not keep)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", None)
    rank = index if isinstance(index, int) else getattr(parallel, "data_parallel_rank", None)
    size = getattr(parallel, "data_parallel_size", None)
    return {"host": socket.gethostname(),
            "vllm_instance_id": getattr(vllm_config, "instance_id", None) or None,
            "data_parallel_rank": rank if isinstance(rank, int) else None,
            "data_parallel_size": size if isinstance(size, int) and size > 1 else None}
