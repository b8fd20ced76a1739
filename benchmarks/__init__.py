"""Benchmark suites: kvtrace's engine against vLLM and transformers, its roofline, tracing cost, trace scale.

Scripts, not tests: run them with `python -m benchmarks <suite>` (see benchmarks/README.md).
"""
