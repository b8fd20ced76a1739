"""The offline replay `kvtrace record --engine vllm` runs with the Python of the user's vLLM environment.

    python -m kvtrace.vllm.capture.driver CONFIG.json

CONFIG names the model, vLLM's engine arguments, the capture folder, the requests file (one JSON
object a line: index, prompt_token_ids, arrival_s on the replay clock, sampling fields) and where to
write the results. The driver starts `vllm.LLM` with kvtrace's scheduler (unless `capture` is false:
the same replay without recording, for comparisons), then adds each request when its arrival time
comes and steps the engine, exactly as a serving loop would. Request ids are `kvt<index>`; vLLM adds
its random suffix, and `<k>_` for the k-th sample of n > 1.

Results (JSON): start-up and replay seconds, the replay's origin on the monotonic clock, every
request's token ids per sample and its `num_preemptions` from vLLM's own metrics, and vLLM's
engine-wide preemption counter. A start-up failure (the capture's version guard included) is written
there as `error` and the exit code is 3: the capture runs in strict mode (KVTRACE_CAPTURE_STRICT=1), so
a capture that cannot start stops vLLM's start rather than step aside (capture/aside.py).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

# the one class: it becomes the subclass of the scheduler vLLM's configuration chose (scheduler.py)
SCHEDULER = "kvtrace.vllm.capture.scheduler.KvtraceCaptureScheduler"


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def _write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _sampling(item: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_tokens = item["max_tokens"]
    ignore_eos = item.get("ignore_eos", False)
    if item.get("output_tokens") is not None:   # the length at which it really stopped: stop there
        max_tokens = min(max_tokens, item["output_tokens"])
        ignore_eos = True
    return SamplingParams(n=item.get("n", 1), temperature=item.get("temperature", 0.0),
                          top_p=item.get("top_p", 1.0), seed=item.get("seed"), max_tokens=max_tokens,
                          ignore_eos=ignore_eos, detokenize=False, output_kind=RequestOutputKind.DELTA)


def replay(llm, items: list[dict], results: dict) -> None:
    engine = llm.llm_engine
    tokens: dict[str, list[int]] = {}
    preemptions: dict[str, int] = {}
    pending = sorted(items, key=lambda item: item["arrival_s"])
    next_item = 0
    t0 = time.monotonic()
    results["origin_monotonic"] = t0
    while next_item < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while next_item < len(pending) and pending[next_item]["arrival_s"] <= now:
            item = pending[next_item]
            engine.add_request(f"kvt{item['index']}", {"prompt_token_ids": item["prompt_token_ids"]},
                               _sampling(item), priority=item.get("priority", 0))
            next_item += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(pending[next_item]["arrival_s"] - (time.monotonic() - t0), 0.05)))
            continue
        for out in engine.step():
            index = out.request_id.split("-", 1)[0].removeprefix("kvt")
            for completion in out.outputs:
                tokens.setdefault(f"{index}/{completion.index}", []).extend(completion.token_ids)
            if out.finished and out.metrics is not None:
                preemptions[index] = int(getattr(out.metrics, "num_preemptions", 0) or 0)
    results["duration_s"] = time.monotonic() - t0
    results["tokens"] = tokens
    results["preemptions_per_request"] = preemptions


def main() -> int:
    config = json.loads(open(sys.argv[1]).read())
    results: dict = {"error": None}
    out = None
    if config.get("interactive"):   # stdout carries only the answers; vLLM's prints go to stderr
        out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")   # its AOT cache fails to reload in 0.32
    if config.get("capture", True):
        os.environ["KVTRACE_CAPTURE_DIR"] = config["capture_dir"]
        # a replay whose capture cannot start records nothing: refuse, rather than step aside (aside.py)
        os.environ["KVTRACE_CAPTURE_STRICT"] = "1"
        if config.get("self_check"):
            os.environ["KVTRACE_CAPTURE_SELF_CHECK"] = "1"
        if config.get("token_ids", True):   # a replay of a workload is not users' content
            os.environ["KVTRACE_CAPTURE_TOKEN_IDS"] = "1"
    try:
        import vllm
        from vllm import LLM

        results["vllm_version"] = vllm.__version__
        args = dict(config["engine_args"])
        if args.get("async_scheduling"):
            _keep_async_scheduling()
        if config.get("capture", True):
            args["scheduler_cls"] = SCHEDULER
        start = time.monotonic()
        llm = LLM(model=config["model"], disable_log_stats=False, **args)
        results["startup_s"] = time.monotonic() - start
    except BaseException as exc:   # the guard's refusal among them: say it, write nothing else
        results["error"] = _root_cause(exc)
        results["traceback"] = traceback.format_exc()
        _write(config["results"], results)
        return 3
    with open(config["requests"]) as f:
        items = [json.loads(line) for line in f]
    if config.get("interactive"):
        return interactive(llm, items, results, out)
    before = _counter(llm, "vllm:num_preemptions")
    try:
        replay(llm, items, results)
    except KeyboardInterrupt:
        results["interrupted"] = True
    results["num_preemptions"] = int(_counter(llm, "vllm:num_preemptions") - before)
    _write(config["results"], results)
    del llm   # shuts EngineCore down: the capture closes its last chunk
    return 130 if results.get("interrupted") else 0


def interactive(llm, items: list[dict], results: dict, out) -> int:
    """For benchmarks: say `ready` on stdout, then replay the workload once per line read on stdin,
    from a cold prefix cache, answering each with one JSON line (duration, tokens, preemptions)."""
    out.write(json.dumps({"event": "ready", "startup_s": results["startup_s"]}) + "\n")
    for _ in sys.stdin:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache")
        before = _counter(llm, "vllm:num_preemptions")
        answer: dict = {}
        replay(llm, items, answer)
        out.write(json.dumps({"duration_s": answer["duration_s"],
                              "output_tokens": sum(len(t) for t in answer["tokens"].values()),
                              "num_preemptions": int(_counter(llm, "vllm:num_preemptions") - before)}) + "\n")
    del llm
    return 0


def _keep_async_scheduling() -> None:
    """Asked for async scheduling, keep it: vLLM's CPU platform turns it off ("not required on CPU")
    after the engine arguments are read. Its AsyncScheduler and two-batch queue run as they are; only
    that platform default is undone, so a CPU can record what a GPU server schedules."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    check = platform.check_and_update_config

    def check_and_keep(vllm_config) -> None:
        check(vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    platform.check_and_update_config = staticmethod(check_and_keep)


def _root_cause(exc: BaseException) -> str:
    """vLLM wraps an EngineCore start-up failure; the capture's own message is the useful one."""
    seen = exc
    while seen.__cause__ is not None or seen.__context__ is not None:
        seen = seen.__cause__ or seen.__context__
    return f"{type(seen).__name__}: {seen}" if seen is not exc else f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    sys.exit(main())
