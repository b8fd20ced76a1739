"""`python -m benchmarks <suite> [options]`: run one suite, print its report, log it, update RESULTS.md."""
from __future__ import annotations

import argparse
import importlib
import sys

# suite name -> module in this package with add_arguments(parser) and run(args)
SUITES = {
    "vllm": "benchmarks.vs_vllm",
    "transformers": "benchmarks.vs_transformers",
    "roofline": "benchmarks.roofline",
    "tracing": "benchmarks.tracing_cost",
    "trace-scale": "benchmarks.trace_scale_suite",
    "perfetto-export": "benchmarks.perfetto_export",
    "model-ab": "benchmarks.model_ab",
    "kernels": "benchmarks.kernels",
    "sim-speed": "benchmarks.sim_speed",
    "sim-accuracy": "benchmarks.sim_accuracy",
    "sim-gpu-accuracy": "benchmarks.sim_gpu_accuracy",
    "vllm-capture": "benchmarks.vllm_capture",
    "vllm-capture-cost": "benchmarks.vllm_capture_cost",
    "process": "benchmarks.process_tricks",
}


def _escape(text: str) -> str:
    """argparse formats help with %: a literal one in a docstring must be doubled."""
    return text.replace("%", "%%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    subparsers = parser.add_subparsers(dest="suite", required=True, metavar="suite")
    modules = {}
    for name, module_name in SUITES.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        sub = subparsers.add_parser(name, help=_escape((module.__doc__ or "").strip().splitlines()[0]),
                                    description=_escape(module.__doc__ or ""), formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    return modules[args.suite].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
