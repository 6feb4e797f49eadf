"""The conformance suite's own wall time, per bundled implementation (one run each)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from benchmarks.conftest import SUITE_TIMES
from posttrain.conformance.runner import run
from posttrain.conformance.target import discover

TARGETS = sorted(discover())


def _close_ray_hosts() -> None:
    # A row's shared host actor (and its start-up) is the row's own: the next row starts
    # another, and none outlives the run.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from posttrain.adapters.ray.implementations import close_shared_host

        close_shared_host()


@pytest.mark.parametrize("name", TARGETS)
def test_suite_wall_time(benchmark: Any, name: str) -> None:
    impl = discover()[name].load()
    try:
        benchmark.pedantic(run, args=(impl,), kwargs={"target": name}, rounds=1, iterations=1)
    finally:
        _close_ray_hosts()
    SUITE_TIMES[name] = float(benchmark.stats.stats.median)
