"""The vLLM side of `python -m benchmarks vllm-capture-cost`: runs in a vLLM venv (standard library,
vLLM and, on PYTHONPATH, kvtrace's capture package), one size per process.

    python vllm_capture_cost_driver.py MODEL_FOLDER '{"running": 1024, "steps": 60, "async": false, ...}'

Builds two schedulers of kvtrace's capture class the way the scheduler differential's driver does
(tests/vllm_sched/vllm_driver.py's `build`: vLLM's unit tests' configs, no model), one capturing and
one ("plain") whose capture stepped aside, so that it runs vLLM's own code (one class: see below),
freezes the heap as vLLM's engine core does once its scheduler is built, gives each the same
`running` requests (prompt tokens, a long max_tokens, a pool that holds them all), steps both until
every request runs, collects the heap once (a running server's steady state), then times
`warmup + steps` decode steps (schedule, the placeholder model output, update_from_output)
alternating plain, captured, plain, ... With "async" both are
(subclasses of) vLLM's AsyncScheduler and a step is the engine core's batch-queue step: schedule
this step, then process the previous step's output. Prints one JSON line: per-step seconds of each,
wall and CPU (this thread's: what other processes of a shared machine take is not in it), the cyclic
GC's time inside each one's timed steps, the capture's hook time, its builder thread's CPU time and
the bytes its chunks took over the timed steps, the chunks written and dropped. "forward_ms" stands
in for the model's forward: each step sleeps that long between its scheduling and its output (the
GIL released, as while a GPU computes), the time in which the capture's builder thread builds the
step's rows on a real server; 0 (the default): none, the builder's work then competing with the
steps it measures. "flush_s" sets how often the capture hands a chunk over;
"slow_write_s" makes every chunk's write take that long (a slow volume; the writer thread's wait);
"kv_cache_groups" makes the model hybrid (the driver's group kinds: ["full", "sliding"] is Gemma 3's
shape, a 4-block window); "spec_tokens" makes the server draft that many tokens a step with a draft
model's config (as many lookahead slots), the placeholder model accepting some of them; "offload_chunks"
gives each scheduler a host KV tier of that many chunks (a block each): vLLM's OffloadingConnector on
the scheduler, its worker side stood in for as the scheduler tests do (tests/vllm_sched/vllm_driver.py's
StandInWorker: every store and load completes in the next step's output).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# not this folder (Python puts a script's folder first): its kernels.py would shadow the `kernels`
# package transformers looks for; the differential's driver builds the scheduler as vLLM's unit
# tests do, reused, not copied
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent / "tests" / "vllm_sched"))


def main() -> int:
    model, opts = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import vllm_driver
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    vllm_driver.adapt_to_this_vllm()
    init_none_hash(sha256)
    n, prompt, steps, warmup, bs = opts["running"], opts["prompt"], opts["steps"], opts["warmup"], opts["block_size"]
    groups, drafts = opts.get("kv_cache_groups") or ["full"], opts.get("spec_tokens") or 0
    max_tokens = (warmup + steps + 16) * (1 + drafts)   # a speculative step delivers up to 1 + drafts tokens
    per_request = -(-(prompt + max_tokens + 2 * drafts + 1) // bs)   # its drafts' and lookahead's slots too
    cfg = {"block_size": bs, "num_blocks": (n * per_request + 16) * len(groups), "max_num_seqs": n,
           "max_num_batched_tokens": max(n * prompt, n * (1 + drafts), 2048),
           "max_model_len": prompt + max_tokens + 1, "long_prefill_token_threshold": 0, "policy": "fcfs",
           "async": bool(opts.get("async")), "enable_prefix_caching": True, "kv_cache_groups": groups,
           "offload": {"chunks": opts["offload_chunks"], "delay": 1} if opts.get("offload_chunks") else None}
    if drafts:   # a drafting server's config: the schedulers built below read it
        vllm_driver.CONFIGS["vllm_config"] = vllm_driver.fresh_config(model, cfg)
        object.__setattr__(vllm_driver.CONFIGS["vllm_config"], "speculative_config",
                           vllm_driver.speculative_config(model, drafts))
    folder = tempfile.mkdtemp(prefix="kvtrace-capture-cost-")
    os.environ["KVTRACE_CAPTURE_DIR"] = folder
    os.environ.pop("KVTRACE_CAPTURE_SELF_CHECK", None)
    if opts.get("flush_s"):
        os.environ["KVTRACE_CAPTURE_FLUSH_EVERY"] = str(opts["flush_s"])
    if opts.get("slow_write_s"):   # a slow volume: every chunk's write takes this long (the writer thread's)
        from kvtrace.vllm.capture.sink import Sink
        write = Sink._write_file

        def slow(sink, path, data):
            time.sleep(opts["slow_write_s"])
            return write(sink, path, data)
        Sink._write_file = slow
    schedulers, workers = {}, {}
    for name in ("plain", "captured"):
        # both of the capture class, "plain"'s capture stepped aside (no KVTRACE_CAPTURE_DIR: vLLM's own code
        # runs through the class), so that vLLM's code meets instances of one class, as in a server. With
        # vLLM's own class beside the capture's, CPython's specializing interpreter (3.11+), whose inline
        # caches key on the class, slowed one of them: the capture class with its capture never started
        # measured 0.3-0.6 ms a step slower than vLLM's own at 1,024 running, a cost no server pays. (Each
        # in a process of its own, the two differ by more than that from one pair of processes to the next.)
        vllm_driver.CAPTURE = True
        if name == "captured":
            os.environ["KVTRACE_CAPTURE_DIR"] = folder
        else:
            os.environ.pop("KVTRACE_CAPTURE_DIR")
        sched = schedulers[name] = vllm_driver.build(model, cfg)
        if (sched._kvtrace is not None) != (name == "captured"):
            raise SystemExit(f"vllm-capture-cost: the {name} scheduler's capture "
                             f"{'did not start' if name == 'captured' else 'started'}")
        if cfg["offload"]:   # the connector's worker side: its copies finish in the next step's output
            workers[name] = vllm_driver.StandInWorker(sched, cfg["offload"])
    # the heap as vLLM's engine core leaves it once its scheduler is built (vLLM 0.31-0.34's
    # EngineCore.__init__): frozen, so that no collection walks the pools' blocks; the requests come later
    from vllm.utils.gc_utils import freeze_gc_heap
    freeze_gc_heap()
    hasher = get_request_block_hasher(bs, sha256)
    for sched in schedulers.values():
        for i in range(n):   # distinct prompts: no prefix sharing between requests
            tokens = [(i * 7919 + j * 104729) % 49000 + 17 for j in range(prompt)]
            sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=tokens,
                                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      pooling_params=None, arrival_time=time.time(), block_hasher=hasher))
    times = {name: [] for name in schedulers}
    cpu_times = {name: [] for name in schedulers}
    # the cyclic GC's time inside each scheduler's timed steps: the capture's rows are allocations
    # that bring collections on, and a collection walks both schedulers' objects wherever it starts
    gc_s = dict.fromkeys(schedulers, 0.0)
    timing: list = [None, 0.0]   # the scheduler whose timed step runs, when the collection began

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            timing[1] = time.perf_counter()
        elif timing[0] is not None:
            gc_s[timing[0]] += time.perf_counter() - timing[1]
    previous = dict.fromkeys(schedulers)   # async: the step whose output the next step processes
    forward_s = (opts.get("forward_ms") or 0) / 1e3
    num_steps = dict.fromkeys(schedulers, 0)

    def step(name: str) -> tuple[float, float]:
        sched = schedulers[name]
        start, cpu_start = time.perf_counter(), time.thread_time()
        so = sched.schedule()
        executed = vllm_driver.output_for(sched, so)
        if forward_s:   # the model's forward, waited for with the GIL released (as a GPU's is)
            time.sleep(forward_s)
        if name in workers:   # the tier's copies this step issued, and those finishing in its output
            worker, index = workers[name], num_steps[name]
            worker.issued(so, index)
            executed.kv_connector_output, _ = worker.output(index)
        num_steps[name] += 1
        if cfg["async"]:   # (the AsyncScheduler schedules its configured drafts itself)
            if previous[name] is not None:
                sched.update_from_output(*previous[name])
            previous[name] = (so, executed)
        else:
            sched.update_from_output(so, executed)
            if drafts:   # the drafter's proposals for the next step
                sched.update_draft_token_ids(DraftTokenIds([r.request_id for r in sched.running],
                                                           [[7] * drafts for _ in sched.running]))
        return time.perf_counter() - start, time.thread_time() - cpu_start

    for name, sched in schedulers.items():   # every request admitted and past its prefill
        while len(sched.running) < n or any(r.num_output_tokens == 0 for r in sched.running):
            step(name)
    cap = schedulers["captured"]._kvtrace
    # the heap as a server has it minutes after its start: its first full collection since the freeze
    # done. Until then a full collection waits for a quarter of the heap vLLM froze to be promoted (the
    # collector's long_lived_total), and comes earlier the more a step promotes, so that timed steps
    # just after the freeze meet it early or late; after it, every eleventh collection of the middle
    # generation is a full one, at the rate the steps' allocations set, as in a running server
    gc.collect()
    gc.callbacks.append(on_gc)
    for i in range(warmup + steps):
        if i == warmup:
            cap.sink.flush()   # the sink's count of bytes written (retention, 4 GiB, is far off here)
            cap.sink.drain()
            bytes_before, hook_before, build_before = cap.sink.num_bytes, cap.hook_s, cap.sink.build_s
            chunks_before, dropped_before = cap.sink.num_written, cap.sink.num_dropped
        order = ("plain", "captured") if i % 2 == 0 else ("captured", "plain")
        for name in order:
            timing[0] = name if i >= warmup else None
            t, cpu = step(name)
            timing[0] = None
            if i >= warmup:
                times[name].append(t)
                cpu_times[name].append(cpu)
    gc.callbacks.remove(on_gc)
    dropped = cap.sink.num_dropped - dropped_before   # chunks handed over in the timed steps and dropped
    cap.sink.flush()
    cap.sink.drain()
    running = {name: len(s.running) for name, s in schedulers.items()}
    out.write(json.dumps({"running": running, "times": times, "cpu_times": cpu_times, "gc_s": gc_s,
                          "hook_s": cap.hook_s - hook_before, "build_s": cap.sink.build_s - build_before,
                          "bytes": cap.sink.num_bytes - bytes_before,
                          "chunks": cap.sink.num_written - chunks_before, "dropped": dropped,
                          "vllm_version": __import__("vllm").__version__}) + "\n")
    for sched in schedulers.values():
        sched.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
