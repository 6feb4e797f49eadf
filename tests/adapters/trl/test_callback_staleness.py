"""The TRL callback's hooks on a stand-in trainer: staleness when its capture cannot count it
(no accumulator, or no generation of its own) is counted by the callback instead of dropped,
and counting micro-batches leaves TRL's metric keys as TRL wrote them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from posttrain.adapters.trl.callback import CatalogueCallback
from posttrain.adapters.trl.rollout import CaptureRollouts
from posttrain.reference_impls import RingBuffer


def _fake_trainer() -> Any:
    def prepare(*_: Any) -> dict[str, torch.Tensor]:
        return {"prompt_ids": torch.zeros(2, 1, dtype=torch.long)}

    return SimpleNamespace(
        _calculate_rewards=lambda *a: torch.zeros(2),
        _generate_and_score_completions=lambda *a: {},
        _prepare_inputs=prepare,
        _compute_loss=lambda *a: torch.zeros(()),
        model=SimpleNamespace(training=True),
        state=SimpleNamespace(global_step=3),
    )


@pytest.mark.parametrize("with_metrics", [False, True])
def test_staleness_counted_when_the_capture_cannot(with_metrics: bool) -> None:
    from posttrain.observability import Accumulator

    capture = CaptureRollouts(RingBuffer(8), metrics=Accumulator() if with_metrics else None)
    cb = CatalogueCallback(capture)
    trainer = _fake_trainer()
    cb.attach(trainer)
    cb._generated_at = 1  # TRL generated at step 1; the capture stamped nothing
    trainer._prepare_inputs()
    assert cb.acc.values() == {
        "staleness/mean": 2.0,
        "staleness/max": 2.0,
        "staleness/policy_version": 3.0,
    }


def test_the_capture_counts_in_its_own_version_when_it_can() -> None:
    from posttrain.observability import Accumulator

    capture = CaptureRollouts(RingBuffer(8), metrics=Accumulator())
    capture.stamped = 0
    cb = CatalogueCallback(capture)
    trainer = _fake_trainer()
    cb.attach(trainer)
    cb._generated_at = 3
    trainer._prepare_inputs()
    assert cb.acc.values() == {}
    assert capture.metrics.values()["staleness/max"] == 3.0


def test_counting_micro_batches_adds_no_keys_to_trl_metrics() -> None:
    from collections import defaultdict

    trainer = _fake_trainer()
    metrics: dict[str, defaultdict[str, list[float]]] = {"train": defaultdict(list)}

    def compute_loss(*_: Any) -> torch.Tensor:
        metrics["train"]["entropy"].append(0.5)  # TRL logs entropy; kl only with beta != 0
        return torch.zeros(())

    trainer._metrics = metrics
    trainer._compute_loss = compute_loss
    cb = CatalogueCallback()
    cb.attach(trainer)
    trainer._compute_loss(None, {"completion_mask": torch.ones(2, 3)})
    assert sorted(metrics["train"]) == ["entropy"]  # TRL would log any other key as None
    assert cb.acc.values() == {"policy/entropy": 0.5}
