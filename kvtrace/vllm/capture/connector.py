"""The wraps of a KV connector's scheduler side: a KV tier behind the pool (schema 6's tier events).

vLLM's KV connector interface (KVConnectorBase_V1, the scheduler's `connector`) is how a tier joins the
scheduler: vLLM's native CPU offloading (`--kv-offloading-size`, the OffloadingConnector), LMCache, P/D
disaggregation's connectors. On admission the scheduler asks the connector how many positions past the
device's prefix hit it holds (`get_num_new_matched_tokens`), allocates blocks for both hits and tells the
connector which blocks to fill (`update_state_after_alloc`); the request waits (WAITING_FOR_REMOTE_KVS)
until the worker reports the load finished (`update_connector_output`: `finished_recving`, or
`failed_recving`), and is admitted then with those positions computed. What a connector stores is its
own: the OffloadingConnector issues store jobs in its metadata (`build_connector_meta`: `store_jobs`,
each a request's device blocks) and completes them when its workers report them (`completed_jobs`,
`failed_jobs` on 0.34); its manager's `prepare_store` evicts the tier's own chunks to make room.

What the capture writes of it (docs/trace-format.md, "KV tiers"): a `lookup` per admission (wraps.py's
admission wrapper asks `lookup`), a `load` when its request's load finishes (reason `failed` where it
failed), an `offload` when a store job completes (or fails), a `tier_evict` per prepare_store that
evicted, each with the tier's name ("cpu" for the native offloading, else the connector's class name)
and the bytes it moved where the pool's block size in bytes is known. As wraps.py's: instance
attributes only, vLLM's call made as it is, the capture's own work in a `try` whose error goes to
`on_error`; guard.py's `check_connector` checks every name used here.
"""
from __future__ import annotations

from kvtrace.vllm.capture.accounting import StepAccounting
from kvtrace.vllm.capture.instance_wraps import InstanceWraps
from kvtrace.vllm.capture.rows import KvEvent, copy_event

OFFLOADING = "OffloadingConnector"   # vLLM's native offloading: its store jobs and evictions are followed too


def tier_name(connector) -> str:
    """The tier's name in the trace: "cpu" for vLLM's native CPU offloading, else the connector's class."""
    return "cpu" if type(connector).__name__ == OFFLOADING else type(connector).__name__


def bytes_per_block(scheduler) -> int:
    """A device block's bytes over the layers of the first KV-cache group (0 where unknown)."""
    try:
        group = scheduler.kv_cache_config.kv_cache_groups[0]
        return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    except (AttributeError, IndexError, TypeError):
        return 0


def kv_tiers(scheduler) -> list[dict]:
    """The tier behind the pool as meta.json's kv_tiers describes one (docs/trace-format.md), for the
    server's identity: its name, size in device blocks and bytes (the native offloading's; null where the
    connector does not say), the tokens a block holds, how it makes room; [] without a connector."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return []
    config = getattr(getattr(scheduler, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(config, "kv_connector_extra_config", None) or {}
    tier = {"name": tier_name(connector), "num_blocks": None, "bytes": None, "block_size": scheduler.block_size,
            "policy": None, "link_gb_s": None}
    if type(connector).__name__ == OFFLOADING:
        side = getattr(connector, "connector_scheduler", None)
        num_chunks = getattr(getattr(side, "manager", None), "_num_chunks", None)
        chunk_blocks = getattr(getattr(side, "config", None), "blocks_per_chunk", 1)
        tier.update(num_blocks=num_chunks * chunk_blocks if isinstance(num_chunks, int) else None,
                    bytes=extra.get("cpu_bytes_to_use"), policy=extra.get("eviction_policy", "lru"))
    return [tier]


class TierWraps:
    """The wrappers on one scheduler's KV connector (and the OffloadingConnector's manager), and the copies
    in flight."""

    def __init__(self, scheduler, steps: StepAccounting, on_error) -> None:
        connector = scheduler.connector
        self.steps, self.on_error = steps, on_error
        self.name = tier_name(connector)
        self.block_size = scheduler.block_size
        self.bytes_per_block = bytes_per_block(scheduler)
        self._put = InstanceWraps()                        # what this put on vLLM's instances
        # request -> (its load's device blocks, the positions credited to it): waiting for its load
        self.loading: dict[str, tuple[list[int], int]] = {}
        self.stores: dict[int, tuple[str, list[int]]] = {}   # store job -> (request, device blocks)
        # the admission just looked up, with a hit in the tier: (request, device hit, positions credited)
        self.looked_up: tuple[str, int, int] | None = None
        self._after_alloc = connector.update_state_after_alloc
        self._build_meta = connector.build_connector_meta
        self._update_output = connector.update_connector_output
        self._request_finished = connector.request_finished
        self.jobs = None          # the OffloadingConnector's jobs in flight (its scheduler side's `_jobs`)
        self.chunk_blocks = 1     # device blocks a tier chunk holds
        try:
            self._put(connector, "update_state_after_alloc", self.update_state_after_alloc)
            self._put(connector, "build_connector_meta", self.build_connector_meta)
            self._put(connector, "update_connector_output", self.update_connector_output)
            self._put(connector, "request_finished", self.request_finished)
            if type(connector).__name__ == OFFLOADING:
                side = connector.connector_scheduler
                self.jobs = side._jobs
                self.chunk_blocks = side.config.blocks_per_chunk
                self._prepare_store = side.manager.prepare_store
                self._put(side.manager, "prepare_store", self.prepare_store)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Take the wrappers off (as wraps.py's `remove`)."""
        self._put.remove()
        self.steps = None

    def event(self, kind: str, rid: str, blocks: list[int] | None, num_tokens: int, reason: str | None,
              **fields) -> KvEvent:
        return KvEvent(kind, rid, blocks, num_tokens, reason, tier=self.name, **fields)

    # ---- admission (wraps.py's admission wrapper calls this) ---------------------------------------------------
    def lookup(self, request, num_hit: int, allocation: dict) -> tuple[KvEvent, bool]:
        """A request admitted after the connector was asked (it had computed nothing): its lookup event (the
        admission's reason is set by the accounting), and whether it now waits for a load. `num_hit`: the
        device's prefix hit; `allocation`: allocate_slots' keyword arguments (the connector's hit the
        scheduler took, and whether the load is asynchronous). A hit of every position gives its last one
        back to compute (vLLM's _update_waiting_for_remote_kv): the lookup credits the tier with the rest."""
        num_external = allocation.get("num_external_computed_tokens", 0) or 0
        loading = bool(allocation.get("delay_cache_blocks")) and num_external > 0
        credited = min(num_external, request.num_tokens - 1 - num_hit) if loading else num_external
        self.looked_up = (request.request_id, num_hit, credited, loading) if num_external else None
        return self.event("lookup", request.request_id, None, request.num_tokens, None, num_cached_tokens=num_hit,
                          tier_tokens=credited), loading

    # ---- the connector's scheduler side ---------------------------------------------------------------------
    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        done = self._after_alloc(request, blocks, num_external_tokens, *args, **kwargs)
        try:
            looked_up, self.looked_up = self.looked_up, None
            if num_external_tokens and looked_up is not None and looked_up[0] == request.request_id:
                # the blocks the load fills: past the device's hit up to the last position loaded, from the
                # first that holds no KV yet (a block the prefix cache has is not loaded again)
                rid, num_hit, credited, loading = looked_up
                bs = self.block_size
                span = blocks.blocks[0][num_hit // bs:-(-(num_hit + num_external_tokens) // bs)]
                if loading:
                    start = next((i for i, b in enumerate(span) if not b.is_null and b.block_hash is None),
                                 len(span))
                    self.loading[rid] = ([b.block_id for b in span[start:]], credited)
                else:   # a sync load (vLLM 0.33's sync_load_budget_bytes, a connector that loads in the
                    # forward): done before this step's forward, which computes the rest; its blocks are
                    # cached at allocation already
                    loaded = [b.block_id for b in span if not b.is_null]
                    self.steps.events.append(self.event("load", rid, loaded, credited, None,
                                                        bytes=len(loaded) * self.bytes_per_block))
                    self.steps.state(rid).tier_hits += credited
        except Exception as exc:  # noqa: BLE001 (the capture's own error: it stops, vLLM's call stands)
            self.on_error(exc)
        return done

    def build_connector_meta(self, scheduler_output, *args, **kwargs):
        meta = self._build_meta(scheduler_output, *args, **kwargs)
        if self.jobs is not None:
            try:
                for job_id, job in meta.store_jobs.items():
                    ids = job.src_spec.block_ids   # (vLLM's: a numpy array; its tolist is Python's ints, in C)
                    self.stores[job_id] = (job.req_id,
                                           ids.tolist() if hasattr(ids, "tolist") else [int(b) for b in ids])
            except Exception as exc:  # noqa: BLE001 (as above)
                self.on_error(exc)
        return meta

    def update_connector_output(self, connector_output, *args, **kwargs):
        done = self._update_output(connector_output, *args, **kwargs)
        try:
            self.finished(connector_output)
        except Exception as exc:  # noqa: BLE001 (as above)
            self.on_error(exc)
        return done

    def finished(self, output) -> None:
        """The copies a worker output finished: loads by request (finished_recving, failed_recving: any
        connector's), the OffloadingConnector's stores by job, once vLLM counts them complete."""
        events = self.steps.events
        failed = output.failed_recving or ()
        for rid in output.finished_recving or ():
            load = self.loading.pop(rid, None)
            if load is None:
                continue
            blocks, credited = load
            ok = rid not in failed
            events.append(self.event("load", rid, blocks, credited, None if ok else "failed",
                                     bytes=len(blocks) * self.bytes_per_block))
            if ok:
                self.steps.state(rid).tier_hits += credited
        meta = output.kv_connector_worker_meta
        if self.stores and meta is not None:
            failed_jobs = getattr(meta, "failed_jobs", ())
            for job_id in meta.completed_jobs:
                if job_id in self.stores and job_id not in self.jobs:
                    rid, blocks = self.stores.pop(job_id)
                    events.append(copy_event("offload", rid, blocks, len(blocks) * self.block_size,
                                             "failed" if job_id in failed_jobs else None, self.name,
                                             len(blocks) * self.bytes_per_block))

    def request_finished(self, request, *args, **kwargs):
        delay_free, params = done = self._request_finished(request, *args, **kwargs)
        if delay_free:   # its blocks stay held until the connector says: frees the capture does not follow
            self.on_error(RuntimeError(f"the KV connector {self.name} holds a finished request's blocks "
                                       f"(request_finished): the capture does not follow such frees"))
        self.loading.pop(request.request_id, None)
        return done

    # ---- the OffloadingConnector's manager --------------------------------------------------------------------
    def prepare_store(self, *args, **kwargs):
        out = self._prepare_store(*args, **kwargs)
        if out is not None and out.evicted_keys:
            try:
                self.steps.events.append(self.event("tier_evict", "", None, 0, None,
                                                    num_tier_blocks=len(out.evicted_keys) * self.chunk_blocks))
            except Exception as exc:  # noqa: BLE001 (as above)
                self.on_error(exc)
        return out
