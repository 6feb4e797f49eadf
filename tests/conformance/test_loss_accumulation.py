"""One batch, k micro-batches and 2 or 4 data-parallel ranks give the same loss and gradient.

The reference loss under capability ``global_counts``: each micro-batch (or rank's shard) is
called with the whole batch's ``GlobalCounts``; micro-batch losses and gradients are summed,
ranks' gradients all-reduced by sum (real ``torch.distributed`` gloo processes on loopback).
Every aggregation, float32 and float64, on a batch whose answers have 3, 8, 6, 1, 0 and 5
assistant tokens (the row with 0 is no sequence). Tolerances are the spec's (LOSS-017):
1e-5 of the largest gradient entry in float32, 1e-10 in float64.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from posttrain.contracts import GlobalCounts
from posttrain.contracts.loss import AGGREGATIONS
from posttrain.reference_impls import PolicyGradientLoss
from tests.loss_dp import (
    ANSWERS,
    SHARDS,
    SPLITS,
    V,
    all_reduced,
    all_reduced_counts,
    batch,
    flat_grad,
    gloo_rank,
    rel,
    run_ranks,
)
from tests.paths import ROOT

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = (torch.float32, torch.float64)


class _Logits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _TinyLM(torch.nn.Module):
    """A seeded causal LM small enough for many processes, with no float32 inside (the tiny
    Llama normalizes in float32, which caps a float64 comparison at float32 precision):
    position t sees the mean embedding of tokens 0..t."""

    def __init__(self, dtype: torch.dtype, hidden: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(V, hidden, generator=g, dtype=dtype))
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g, dtype=dtype) / 4)
        self.head = torch.nn.Parameter(torch.randn(hidden, V, generator=g, dtype=dtype))

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> _Logits:
        h = self.emb[input_ids]
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        prefix = h.cumsum(1) / steps
        return _Logits((torch.tanh(prefix @ self.mix) + h) @ self.head)


def _policy(dtype: torch.dtype) -> Any:
    return _TinyLM(dtype)


def _loss(policy: Any, aggregation: str) -> PolicyGradientLoss:
    return PolicyGradientLoss(
        policy, aggregation=aggregation, clip_epsilon=(0.2, 0.28), kl_coef=0.05,
        entropy_coef=0.01, t_norm=16,
    )  # fmt: skip


def _step(
    policy: Any, aggregation: str, td: TensorDictBase, counts: GlobalCounts | None
) -> tuple[float, torch.Tensor]:
    """The summed ``loss_*`` terms and their parameter gradient (flat, float64)."""
    out = _loss(policy, aggregation)(td, counts=counts)
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    return float(total.detach()), flat_grad(total, list(policy.parameters()))


def _full(dtype: torch.dtype) -> dict[str, tuple[float, torch.Tensor]]:
    policy = _policy(dtype)
    td = batch(policy)
    return {agg: _step(policy, agg, td, None) for agg in AGGREGATIONS}


@pytest.fixture(scope="module")
def full() -> dict[torch.dtype, dict[str, tuple[float, torch.Tensor]]]:
    return {dtype: _full(dtype) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_with_global_counts_add_up(
    full: dict[torch.dtype, dict[str, tuple[float, torch.Tensor]]],
    aggregation: str,
    dtype: torch.dtype,
) -> None:
    policy = _policy(dtype)
    td = batch(policy)
    counts = GlobalCounts.of(td)
    assert counts == GlobalCounts(tokens=sum(ANSWERS), sequences=5)  # the empty row is none
    value, grad = full[dtype][aggregation]
    for split in SPLITS:
        parts = [_step(policy, aggregation, td[list(p)], counts) for p in split]
        got = sum(v for v, _ in parts)
        assert abs(got - value) <= TOL[dtype] * max(abs(value), 1.0)
        assert rel(torch.stack([g for _, g in parts]).sum(0), grad) <= TOL[dtype], split


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_accumulation_without_counts_depends_on_the_split(
    full: dict[torch.dtype, dict[str, tuple[float, torch.Tensor]]], aggregation: str
) -> None:
    # What the capability fixes: the mean of micro-batch losses, as users write it.
    policy = _policy(torch.float64)
    td = batch(policy)
    _, grad = full[torch.float64][aggregation]
    split = SPLITS[1]
    parts = [_step(policy, aggregation, td[list(p)], None) for p in split]
    naive = torch.stack([g for _, g in parts]).sum(0) / len(split)
    assert rel(naive, grad) > 0.05


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One data-parallel rank: its shard, the all-reduced counts, gradients all-reduced by sum."""
    with gloo_rank(rank, world, port):
        results: dict[str, Any] = {}
        for dtype in DTYPES:
            policy = _policy(dtype)
            shard = batch(policy)[list(SHARDS[world][rank])]
            counts = all_reduced_counts(shard)
            for agg in AGGREGATIONS:
                results[f"{agg}/{dtype}"] = all_reduced(*_step(policy, agg, shard, counts))
        if rank == 0:
            torch.save(results, out)


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_ranks_with_global_counts_equal_one_batch(
    full: dict[torch.dtype, dict[str, tuple[float, torch.Tensor]]], world: int, tmp_path: Path
) -> None:
    out = str(tmp_path / "ranks.pt")
    run_ranks(_rank, world, out, 120)
    got = torch.load(out)
    for dtype in DTYPES:
        for agg in AGGREGATIONS:
            value, grad = got[f"{agg}/{dtype}"]
            want_value, want_grad = full[dtype][agg]
            assert abs(value - want_value) <= TOL[dtype] * max(abs(want_value), 1.0), agg
            assert rel(grad, want_grad) <= TOL[dtype], (agg, dtype)


# --- docs/loss.md: its two examples run as written -----------------------------------------

_DOC = ROOT / "docs" / "loss.md"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _DOC.read_text(), flags=re.S)


def test_doc_gradient_accumulation_example_runs() -> None:
    ns: dict[str, Any] = {}
    exec(compile(_doc_blocks()[0], str(_DOC), "exec"), ns)
    assert ns["rel_err"] <= 1e-5


def test_doc_two_rank_example_runs(tmp_path: Path) -> None:
    # A module on sys.path, so that spawn's child processes can import the rank function.
    (tmp_path / "loss_doc_two_ranks.py").write_text(_doc_blocks()[1])
    sys.path.insert(0, str(tmp_path))  # spawn hands sys.path to its children
    try:
        import loss_doc_two_ranks  # type: ignore[import-not-found]

        assert loss_doc_two_ranks.main() <= 1e-5
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("loss_doc_two_ranks", None)
