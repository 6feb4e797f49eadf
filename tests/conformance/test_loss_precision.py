"""The loss suite in each declared precision (the contract's precision table).

A loss declares ``Implementation.extras['precision']``; the suite runs the policy's weights in
that dtype and scales its tolerances by the table. Half-precision losses that compute
log-probs in float32 conform; in float64 LOSS-017 holds a loss to 1e-10, which a loss that
drops to float32 inside does not meet.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.loss import LOSS_PRECISIONS
from posttrain.reference_impls import (
    PG_LOSS_SEQ_MEAN_TOKEN_SUM,
    PG_LOSS_TOKEN_MEAN,
    PolicyGradientLoss,
)
from tests.paths import ROOT


def _in(impl: Implementation, precision: str) -> Implementation:
    return dataclasses.replace(impl, extras={**impl.extras, "precision": precision})


def _bad(impl: Implementation) -> dict[str, str]:
    rep = run(impl)
    return {r.id: r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)}


def test_the_table_covers_the_layouts_float_dtypes_and_float32_is_unscaled() -> None:
    assert set(LOSS_PRECISIONS) == {"float32", "float64", "float16", "bfloat16"}
    assert LOSS_PRECISIONS["float32"] == (1.0, 1e-5)
    assert LOSS_PRECISIONS["float64"][1] == 1e-10


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "impl", [PG_LOSS_TOKEN_MEAN, PG_LOSS_SEQ_MEAN_TOKEN_SUM], ids=lambda i: i.options["aggregation"]
)
def test_the_reference_loss_conforms_in_half_precision(
    impl: Implementation, precision: str
) -> None:
    assert _bad(_in(impl, precision)) == {}


def test_the_nemo_rl_loss_adapter_conforms_in_bfloat16() -> None:
    from posttrain.adapters.nemo_rl.implementations import LOSS_TOKEN_MEAN

    assert _bad(_in(LOSS_TOKEN_MEAN, "bfloat16")) == {}


def test_the_reference_loss_conforms_in_float64_at_1e_10() -> None:
    assert _bad(_in(PG_LOSS_TOKEN_MEAN, "float64")) == {}


class _Float32Logits(torch.nn.Module):
    """A policy seen through a float32 cast of its logits: a loss that computes in float32
    whatever the policy's precision."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, **kwargs: Any) -> Any:
        return SimpleNamespace(logits=self.policy(**kwargs).logits.float())


def _float32_inside(policy: Any, **kwargs: Any) -> PolicyGradientLoss:
    loss: PolicyGradientLoss = PG_LOSS_TOKEN_MEAN.factory(_Float32Logits(policy), **kwargs)
    return loss


def test_a_loss_computing_in_float32_does_not_pass_as_float64() -> None:
    impl = dataclasses.replace(
        PG_LOSS_TOKEN_MEAN,
        factory=_float32_inside,
        name="float32-inside",
        extras={**PG_LOSS_TOKEN_MEAN.extras, "precision": "float64"},
    )
    bad = _bad(impl)
    assert "LOSS-017" in bad, bad
    assert "differs from the whole batch's" in bad["LOSS-017"] or "sum to" in bad["LOSS-017"]
    # Declared float32, the same loss conforms: the tolerance, not the loss, changed.
    assert _bad(dataclasses.replace(impl, extras=PG_LOSS_TOKEN_MEAN.extras)) == {}


def test_an_unknown_precision_fails_naming_the_declaration() -> None:
    bad = _bad(_in(PG_LOSS_TOKEN_MEAN, "float8"))
    assert bad
    assert all("extras['precision'] is 'float8'" in m or "blocked by" in m for m in bad.values())


def test_doc_precision_example_runs() -> None:
    import re

    doc = ROOT / "docs" / "loss.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "precision" in b]
    exec(compile(block, str(doc), "exec"), {})
