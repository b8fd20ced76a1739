"""The package list, the one thing pyproject.toml cannot say: every package setuptools finds under
kvtrace/ and engine/ (data folders such as engine/kernels/csrc/ count as namespace packages), plus
`kvtrace.analyses`, which is the top-level analyses/ folder (mapped in pyproject.toml's
[tool.setuptools.package-dir]). Everything else is in pyproject.toml."""
from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["kvtrace", "kvtrace.*", "engine", "engine.*"]) + ["kvtrace.analyses"])
