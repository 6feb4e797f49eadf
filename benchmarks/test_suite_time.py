"""The conformance suite's own wall time, per bundled implementation (one run each)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.conftest import SUITE_TIMES
from posttrain.conformance.runner import run
from posttrain.conformance.target import discover

TARGETS = sorted(discover())


@pytest.mark.parametrize("name", TARGETS)
def test_suite_wall_time(benchmark: Any, name: str) -> None:
    impl = discover()[name].load()
    benchmark.pedantic(run, args=(impl,), kwargs={"target": name}, rounds=1, iterations=1)
    SUITE_TIMES[name] = float(benchmark.stats.stats.median)
