"""The catalogue's distributions (reduction ``hist``): the values behind the length, reward and
advantage statistics, kept by the accumulator and concatenated exactly across micro-batches and
ranks, against a float64 reference written here with plain loops; written through MET-008
sinks (JSONL and TensorBoard read back)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.observability import Accumulator, rollout_metrics
from posttrain.observability.reduce import HIST_MAX_VALUES, _decode_state, _encode_state
from tests.observability.test_observability_numbers import _rows, _td

NAMES = ("rollout/response_len", "rollout/reward", "rollout/advantage")


def _reference(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The catalogue's formulas, in float64 Python: one value per sequence."""
    lens, rewards, advs = [], [], []
    for r in rows:
        on = [bool(a and b) for a, b in zip(r["asst"], r["attn"], strict=True)]
        lens.append(float(sum(on)))
        if math.isfinite(r["reward"]):
            rewards.append(float(r["reward"]))
        if any(on):  # a sequence without assistant tokens has no advantage
            vals = [x for x, m in zip(r["adv_tok"], on, strict=True) if m]
            advs.append(sum(vals) / len(vals))
    return {"rollout/response_len": lens, "rollout/reward": rewards, "rollout/advantage": advs}


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("case", ["padded", "ragged", "offset"])
def test_distributions_equal_a_float64_reference_whole_split_and_across_ranks(case: str) -> None:
    rows = _rows(case)
    want = _reference(rows)
    td = _td(rows, ragged=case == "ragged")
    whole = rollout_metrics(td, histograms=True).histograms()
    micro = Accumulator()  # two micro-batches into one accumulator
    rollout_metrics(td[0:2], micro, histograms=True)
    rollout_metrics(td[2:4], micro, histograms=True)
    # Two ranks, each with half the batch, combined as all_reduce combines them (the states
    # through the byte codec all_reduce sends).
    ranks = [rollout_metrics(td[sl], histograms=True) for sl in (slice(0, 2), slice(2, 4))]
    joined = Accumulator()
    joined.merge_ranks([_decode_state(_encode_state(r.state())) for r in ranks])
    for got in (whole, micro.histograms(), joined.histograms()):
        assert sorted(got) == sorted(NAMES)
        bad = {n: (got[n], want[n]) for n in NAMES if not _close(got[n], want[n])}
        assert not bad, bad
    # The statistics are the same values' (hist is their source, not a second computation).
    vals = micro.values()
    for name in NAMES:
        assert math.isclose(vals[f"{name}/max"], max(want[name]), rel_tol=1e-12)
        assert math.isclose(vals[f"{name}/mean"], sum(want[name]) / len(want[name]), rel_tol=1e-12)


def test_hist_refuses_non_finite_other_kinds_and_too_many_values() -> None:
    acc = Accumulator()
    with pytest.raises(ValueError, match=r"expected finite values.*1 non-finite of 2"):
        acc.add_hist("rollout/reward", [1.0, math.nan])
    with pytest.raises(ValueError, match="add_hist needs a distribution"):
        acc.add_hist("rollout/reward/mean", [1.0])
    with pytest.raises(ValueError, match="through add_hist"):
        acc.add("rollout/reward", 1.0)
    acc.add_hist("rollout/reward", torch.zeros(HIST_MAX_VALUES - 1))
    with pytest.raises(ValueError, match=f"at most {HIST_MAX_VALUES} values held"):
        acc.add_hist("rollout/reward", [1.0, 2.0])
    assert len(acc.histograms()["rollout/reward"]) == HIST_MAX_VALUES - 1  # nothing added
    assert acc.values() == {}


def test_log_to_writes_histograms_through_met008_sinks(tmp_path: Path) -> None:
    from posttrain.observability.sinks import TensorboardSink, read_tensorboard_histograms
    from posttrain.reference_impls import JsonlSink
    from posttrain.reference_impls.jsonl_sink import read_jsonl, read_jsonl_histograms

    rows = _rows("ragged")
    want = _reference(rows)
    acc = rollout_metrics(_td(rows, ragged=True), histograms=True)
    jsonl, tb = JsonlSink(tmp_path / "jsonl"), TensorboardSink(tmp_path / "tb")
    for sink in (jsonl, tb):
        acc.log_to(sink, step=3)
        sink.close()
    hist = read_jsonl_histograms(tmp_path / "jsonl")
    assert {n: v["values"] for n, ((step, v),) in hist.items() if step == 3} == want
    assert "rollout/reward/mean" in read_jsonl(tmp_path / "jsonl")
    for name, ((step, summary),) in read_tensorboard_histograms(tmp_path / "tb").items():
        assert step == 3
        assert summary["count"] == len(want[name])
        assert math.isclose(summary["min"], min(want[name]), rel_tol=1e-6)
        assert math.isclose(summary["max"], max(want[name]), rel_tol=1e-6)
        assert math.isclose(summary["sum"], sum(want[name]), rel_tol=1e-6, abs_tol=1e-6)

    class ScalarsOnly:
        def __init__(self) -> None:
            self.points: list[str] = []

        def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
            self.points.append(name)

    scalars = ScalarsOnly()
    with pytest.raises(TypeError, match="no log_histogram"):
        acc.log_to(scalars, step=3)
    assert scalars.points == []  # refused before anything was written


def test_merge_refuses_an_overflowing_distribution_before_folding_anything() -> None:
    acc, other = Accumulator(), Accumulator()
    acc.add_hist("rollout/reward", torch.zeros(HIST_MAX_VALUES - 1))
    other.add("rollout/reward/mean", 2.0, 1)
    other.add_hist("rollout/reward", [1.0, 2.0])
    with pytest.raises(ValueError, match=f"at most {HIST_MAX_VALUES} values held"):
        acc.merge(other)
    assert acc.values() == {}  # the scalar was not folded in either
    assert len(acc.histograms()["rollout/reward"]) == HIST_MAX_VALUES - 1
