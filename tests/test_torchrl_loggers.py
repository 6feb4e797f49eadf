"""TorchRL's CSVLogger and TensorboardLogger as metric sinks, read back through their backends."""

from __future__ import annotations

import pytest

import posttrain.adapters.torchrl.implementations as trl_impls
from posttrain.conformance import Status, run


@pytest.mark.parametrize("name", ["CSV_LOGGER", "TENSORBOARD_LOGGER"])
def test_torchrl_loggers_conform(name: str) -> None:
    rep = run(getattr(trl_impls, name))
    assert [r.id for r in rep.results if r.status is Status.PASS] == [
        f"MET-00{i}" for i in range(1, 7)
    ]
