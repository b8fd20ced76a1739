"""A kvtrace capture inside an unmodified vLLM V1 engine (docs/vllm.md; the words: docs/glossary.md).

This package runs in the user's vLLM environment, inside vLLM's EngineCore process: it imports only
the standard library and vLLM itself (no pyarrow, nothing else of kvtrace). Its parts, each one job:
- `scheduler.py`: the scheduler subclasses selected with vLLM's `scheduler_cls` option, which wrap the
  scheduler's own methods and call the recorder;
- `recorder.py`: one per scheduler, the parts below put together, and what each step hook does;
- `settings.py`: the options (environment variables) and the files that say who writes (servers/,
  capture.json, done.json);
- `aside.py`: a capture that cannot start steps aside (vLLM serves unrecorded) or, in strict mode,
  refuses; one that fails at runtime stops: what each says, in vLLM's log and error.json;
- `wraps.py`: the wraps of the KV cache manager's, block pool's and waiting queues' methods on the
  scheduler's instances, and the vLLM frames they read;
- `accounting.py`: what each step did (its row, the requests watched through their prefill);
- `pending.py`: the steps scheduled whose output is not processed yet (async scheduling);
- `columns.py`: rows into the sink's columns; `rows.py`: the named rows the parts hand one another;
- `self_check.py`: the pool replayed from the events against vLLM's own (KVTRACE_CAPTURE_SELF_CHECK);
- `sink.py`: the columnar buffers and their chunk files; `guard.py`: the check that vLLM still has
  every name the capture uses; `driver.py`: the offline replay that `kvtrace record --engine vllm`
  starts with vLLM's Python.
`kvtrace.vllm.importer` (in kvtrace's own environment) turns a capture folder into a run folder.
"""
