"""kvtrace's scheduler makes vLLM V1's decisions step for step, on generated workloads.

vLLM's own `Scheduler` and `AsyncScheduler` (from the vLLM venv the tests build, KVTRACE_VLLM_PYTHON,
and every other vLLM Python in KVTRACE_VLLM_SCHED_PYTHONS, e.g. scripts/vllm_sched_env.sh's 0.33),
built as vLLM's unit tests build them and stepped with placeholder model outputs, against kvtrace's
simulator driving engine/'s scheduler and block manager, on the same step clock. Compared every
step: scheduled requests and token counts in order, victims in order, admissions (new or resumed,
prefix-hit tokens, block ids), new blocks, free and cached blocks, the requests freed and in which
order, the free queue's order, and async scheduling's placeholders (tests/vllm_sched/kvtrace_side.py
lists the fields). A failure shows the shrunk workload and the first differing step on each side.

KVTRACE_SCHED_WORKLOADS sets the workloads per scheduler class and version (default 600);
`--hypothesis-profile thorough` runs ten times as many.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.errors import NoSuchExample

from engine.config import VLLM_VERSION
from tests.helpers.vllm_runs import VLLM_MARKS, VLLM_PYTHON
from tests.vllm_sched import kvtrace_side
from tests.vllm_sched.differential import VllmScheduler, first_difference
from tests.vllm_sched.workloads import tally, workloads

pytestmark = VLLM_MARKS

PYTHONS = [p for p in [VLLM_PYTHON, *os.environ.get("KVTRACE_VLLM_SCHED_PYTHONS", "").split(os.pathsep)] if p]
NUM_WORKLOADS = int(os.environ.get("KVTRACE_SCHED_WORKLOADS", "600")) * max(1, settings.default.max_examples // 100)
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                   HealthCheck.filter_too_much])


def venv_name(python: str) -> str:
    return Path(python).parent.parent.name   # .../vllm-venv-0.32.0/bin/python: vllm-venv-0.32.0


@pytest.fixture(scope="module", params=PYTHONS or ["none"], ids=venv_name)
def vllm(request):
    from kvtrace.vllm.record import model_folder

    scheduler = VllmScheduler(request.param, str(model_folder("smollm2-135m")))
    yield scheduler
    scheduler.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_schedules_as_vllm(vllm, asynchronous):
    totals: Counter = Counter()
    followed = vllm.version == VLLM_VERSION   # another version's differences are reported, not failed
    differing: list[str] = []

    # another version's differences are only reported: a quarter of the workloads finds them
    @settings(max_examples=NUM_WORKLOADS if followed else max(NUM_WORKLOADS // 4, 50), **FAST)
    @given(workloads(asynchronous))
    def check(workload):
        theirs = vllm.run(workload)
        difference = first_difference(kvtrace_side.run(workload), theirs)
        if difference:
            differing.append(f"vLLM {vllm.version}, workload:\n{json.dumps(workload)}\n{difference}")
        totals.update(tally(theirs))

    check()
    print(f"vLLM {vllm.version} {'AsyncScheduler' if asynchronous else 'Scheduler'}: {dict(totals)}")
    shortest = min(differing, key=len) if differing else ""
    if followed:
        # known open differences (issue #30, docs/scheduling.md: Scheduler, a growth's blocks taken from
        # the free queue in another order, 1 of 600; AsyncScheduler, the cached-block count with n > 1
        # samples, 13 of 600): reported, not failed, while they stay rare; a regression that changes
        # decisions broadly fails here, and the planted schedulers below must each be caught
        assert len(differing) <= max(1, totals["workloads"] // 20), (
            f"{len(differing)} of {totals['workloads']} workloads schedule otherwise, the shortest:\n{shortest}")
        if differing:
            pytest.xfail(f"known open differences: {len(differing)} of {totals['workloads']} workloads, "
                         f"the shortest:\n{shortest}")
    elif differing:
        pytest.xfail(f"kvtrace follows vLLM {VLLM_VERSION}; vLLM {vllm.version} schedules {len(differing)} of "
                     f"{totals['workloads']} workloads otherwise, the shortest:\n{shortest}")
    # not vacuous: one workload in twenty at least preempts, hits the prefix cache, resumes a preempted request
    assert min(totals["preempting"], totals["hitting"], totals["resuming"]) >= totals["workloads"] // 20, totals


@pytest.mark.parametrize("bug", kvtrace_side.PLANTS)
def test_a_planted_wrong_scheduler_is_caught(vllm, bug):
    if vllm.version != VLLM_VERSION:
        pytest.xfail(f"planted against the vLLM kvtrace follows ({VLLM_VERSION}) only")
    def caught(workload) -> bool:
        return first_difference(kvtrace_side.run(workload, bug), vllm.run(workload)) is not None

    try:
        find(workloads(asynchronous=bug == "head-first-free"), caught,
             settings=settings(max_examples=300, phases=[Phase.generate], database=None, derandomize=True, **FAST))
    except NoSuchExample:
        pytest.fail(f"kvtrace's scheduler planted with {bug!r} agreed with vLLM {vllm.version} on 300 workloads")
