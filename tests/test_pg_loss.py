"""The reference loss's own checks beyond the suite: its options and an empty batch."""

from __future__ import annotations

import re

import pytest

from posttrain.conformance.data import llm_batch
from posttrain.conformance.policy import tiny_causal_lm
from posttrain.reference_impls import PolicyGradientLoss


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"clip_epsilon": "0.2"}, "clip_epsilon: expected a number or a (low, high) pair"),
        ({"clip_epsilon": (0.1, 0.2, 0.3)}, "found (0.1, 0.2, 0.3)"),
        ({"clip_epsilon": (1.5, 0.2)}, "with 0 <= low < 1 and high >= 0, found (1.5, 0.2)"),
        ({"kl_coef": -1.0}, "kl_coef: expected a number >= 0, found -1.0"),
        ({"kl_coef": float("nan")}, "kl_coef: expected a number >= 0, found nan"),
        ({"entropy_coef": float("inf")}, "entropy_coef: expected a finite number, found inf"),
    ],
)
def test_options_are_refused_by_name(option: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        PolicyGradientLoss(tiny_causal_lm(), **option)  # type: ignore[arg-type]


def test_an_empty_batch_is_refused_by_name() -> None:
    loss = PolicyGradientLoss(tiny_causal_lm())
    with pytest.raises(
        ValueError, match=re.escape("td: expected at least one item, found batch size [0]")
    ):
        loss(llm_batch(0, 8, vocab_size=64))
