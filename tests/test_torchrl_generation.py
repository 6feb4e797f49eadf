"""TorchRL's InferenceServer through the generation suite: raw (published deviations) and adapted."""

from __future__ import annotations

import pytest

from posttrain.adapters.torchrl.deviations import GENERATION_DEVIATIONS, Deviation
from posttrain.adapters.torchrl.implementations import (
    ADAPTED_INFERENCE_SERVER,
    RAW_INFERENCE_SERVER,
)
from posttrain.conformance import Status, run


def test_adapted_inference_server_conforms() -> None:
    rep = run(ADAPTED_INFERENCE_SERVER)
    assert rep.ok, [r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)]


def test_raw_inference_server_fails_exactly_the_published_requirements() -> None:
    rep = run(RAW_INFERENCE_SERVER)
    failed = sorted(r.id for r in rep.results if r.status in (Status.FAIL, Status.ERROR))
    published = sorted({req for d in GENERATION_DEVIATIONS for req in d.requirements})
    assert failed == published


@pytest.mark.parametrize("deviation", GENERATION_DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_generation_repro_still_reproduces(deviation: Deviation) -> None:
    exec(compile(deviation.repro, f"<repro {deviation.title}>", "exec"), {})
