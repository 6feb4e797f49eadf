"""TorchRL's InferenceServer through the generation suite: raw (published deviations) and adapted."""

from __future__ import annotations

import runpy
from typing import Any

import pytest

from posttrain.adapters.torchrl.deviations import GENERATION_DEVIATIONS, Deviation
from posttrain.adapters.torchrl.implementations import (
    ADAPTED_INFERENCE_SERVER,
    ADAPTED_INFERENCE_SERVER_MP,
    RAW_INFERENCE_SERVER,
)
from posttrain.conformance import Status
from posttrain.conformance.runner import run


@pytest.mark.parametrize(
    "impl", [ADAPTED_INFERENCE_SERVER, ADAPTED_INFERENCE_SERVER_MP], ids=["thread", "mp"]
)
def test_adapted_inference_server_conforms(impl: Any) -> None:
    rep = run(impl)
    assert rep.ok, [r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)]
    if "processes" in impl.capabilities:  # clients in spawned processes got their own answers
        assert {r.id: r.status for r in rep.results}["GEN-011"] is Status.PASS


def test_raw_inference_server_fails_exactly_the_published_requirements() -> None:
    rep = run(RAW_INFERENCE_SERVER)
    failed = sorted(r.id for r in rep.results if r.status in (Status.FAIL, Status.ERROR))
    published = sorted({req for d in GENERATION_DEVIATIONS for req in d.requirements})
    assert failed == published == sorted(RAW_INFERENCE_SERVER.known_failures)


@pytest.mark.parametrize("deviation", GENERATION_DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_generation_repro_still_reproduces(deviation: Deviation) -> None:
    runpy.run_path(str(deviation.path), run_name="__main__")  # as `python <repro>` runs it
