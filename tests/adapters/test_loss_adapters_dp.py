"""The loss adapters under micro-batching and 2 and 4 data-parallel ranks.

Each adapted loss row that declares ``global_counts`` (NeMo-RL's loss both ways, TorchRL's
GRPO/DAPO/CISPO through ``ContractLoss``) is built as the conformance kit builds it, on the
tiny Llama, and called on micro-batches and on ranks' shards with the whole batch's
``GlobalCounts``; ranks are real ``torch.distributed`` gloo processes on loopback that
all-reduce the counts, then the loss values and gradients by sum. Both must equal the whole
batch in one call within the spec's float32 tolerance (LOSS-017: 1e-5 of the largest entry).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts
from posttrain.contracts.implementation import Implementation
from posttrain.testing import tiny_causal_lm
from tests import loss_dp as dp

K = LLM_LAYOUT_V1.key
TOL = 1e-5


def _rows() -> dict[str, Implementation]:
    """Every adapted loss row with capability global_counts, by a short name."""
    import posttrain.adapters.nemo_rl.implementations as nemo
    import posttrain.adapters.torchrl.implementations as trl

    rows = {}
    for prefix, module in (("nemo_rl", nemo), ("torchrl", trl)):
        for name, impl in vars(module).items():
            if (
                isinstance(impl, Implementation)
                and impl.contract == "loss"
                and not name.startswith("RAW_")
                and "global_counts" in impl.capabilities
            ):
                rows[f"{prefix}:{name}"] = impl
    return rows


def _trimmed(td: TensorDictBase) -> TensorDictBase:
    """A micro-batch padded to its own longest row, as loaders pad it."""
    n = max(int(td.get(K("attention_mask")).sum(-1).max()), 2)
    return td[:, :n] if td.batch_dims == 2 else td.apply(lambda v: v[:, :n] if v.ndim == 2 else v)


def _step(
    impl: Implementation, policy: Any, td: TensorDictBase, counts: GlobalCounts | None
) -> tuple[float, torch.Tensor]:
    """The summed ``loss_*`` terms and their parameter gradient (flat, float64)."""
    loss = impl.factory(policy, **impl.options)
    out = loss(td) if counts is None else loss(td, counts=counts)
    items = out.items() if hasattr(out, "items") else []
    total = sum(v for k, v in items if str(k).startswith("loss_"))
    return float(total), dp.flat_grad(total, list(policy.parameters()))


@pytest.fixture(scope="module")
def full() -> dict[str, tuple[float, torch.Tensor]]:
    policy = tiny_causal_lm(vocab_size=dp.V, seed=0)
    td = dp.batch(policy)
    return {name: _step(impl, policy, td, None) for name, impl in _rows().items()}


def test_every_adapter_row_is_covered() -> None:
    names = set(_rows())
    assert {"nemo_rl:LOSS_TOKEN_MEAN", "nemo_rl:LOSS_SEQ_MEAN_TOKEN_MEAN"} <= names
    assert sum(n.startswith("torchrl:") for n in names) >= 7


@pytest.mark.parametrize("row", sorted(_rows()))
def test_micro_batches_of_an_adapter_add_up(
    full: dict[str, tuple[float, torch.Tensor]], row: str
) -> None:
    impl = _rows()[row]
    policy = tiny_causal_lm(vocab_size=dp.V, seed=0)
    td = dp.batch(policy)
    counts = GlobalCounts.of(td)
    assert counts == GlobalCounts(tokens=sum(dp.ANSWERS), sequences=5)
    value, grad = full[row]
    for split in dp.SPLITS:
        parts = [_step(impl, policy, _trimmed(td[list(p)]), counts) for p in split]
        got = sum(v for v, _ in parts)
        assert abs(got - value) <= TOL * max(abs(value), 1.0), (split, got, value)
        assert dp.rel(torch.stack([g for _, g in parts]).sum(0), grad) <= TOL, split


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One data-parallel rank: its shard of the batch, every adapter row."""
    with dp.gloo_rank(rank, world, port):
        policy = tiny_causal_lm(vocab_size=dp.V, seed=0)
        shard = _trimmed(dp.batch(policy)[list(dp.SHARDS[world][rank])])
        counts = dp.all_reduced_counts(shard)
        results = {
            name: dp.all_reduced(*_step(impl, policy, shard, counts))
            for name, impl in _rows().items()
        }
        if rank == 0:
            torch.save(results, out)


@pytest.mark.parametrize("world", [2, 4])
def test_adapters_on_data_parallel_ranks_equal_one_batch(
    full: dict[str, tuple[float, torch.Tensor]], world: int, tmp_path: Path
) -> None:
    out = str(tmp_path / "ranks.pt")
    dp.run_ranks(_rank, world, out, 180)
    got = torch.load(out, weights_only=True)
    assert set(got) == set(full)
    for name, (value, grad) in got.items():
        want_value, want_grad = full[name]
        assert abs(value - want_value) <= TOL * max(abs(want_value), 1.0), name
        assert dp.rel(grad, want_grad) <= TOL, name
