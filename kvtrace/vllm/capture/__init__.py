"""A kvtrace capture inside an unmodified vLLM V1 engine (docs/vllm.md).

This package runs in the user's vLLM environment, inside vLLM's EngineCore process: it imports only
the standard library and vLLM itself (no pyarrow, nothing else of kvtrace). `scheduler.py` holds the
scheduler subclasses selected with vLLM's `scheduler_cls` option, `sink.py` the columnar buffers and
their chunk files, `guard.py` the check that vLLM still has every name the capture uses, and
`driver.py` the offline replay that `kvtrace record --engine vllm` starts with vLLM's Python.
`kvtrace.vllm.importer` (in kvtrace's own environment) turns a capture folder into a run folder.
"""
