"""What several test modules share (no test module imports another, nor conftest.py):

- engine_runs: ListTracer, run_checked (steps with the integrity check after each), probe_schedule,
  integrity_state, and the small scenarios several engine tests replay
- cli: `kvtrace record` on a workload (record, write_workload, sql) and one_line_error
- properties: examples (a property test's example count under the loaded Hypothesis profile)
- tracegen: the two hand-built golden runs and write_run; reference_model: a plain dense forward
- report: the chart specs of the HTML report; vllm_runs: capture chunks by hand, the CLI against vLLM
- strict_skips: the pytest plugin (loaded by tests/conftest.py) that fails CI on an unexpected skip
"""
