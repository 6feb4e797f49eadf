"""Correct loss designs the loss suite must pass, beside the reference and the adapters."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.conformance import Implementation, Status, run
from posttrain.reference_impls import PolicyGradientLoss
from tests.mutants.losses import DUAL_CLIP


def _bad(impl: Implementation) -> dict[str, str]:
    rep = run(impl)
    return {r.id: r.message for r in rep.results if r.status in (Status.FAIL, Status.ERROR)}


def test_a_dual_clip_loss_conforms() -> None:
    assert _bad(DUAL_CLIP) == {}


def _no_keywords(policy: Any, **kwargs: Any) -> PolicyGradientLoss:
    if kwargs:
        raise TypeError(f"this loss takes no keyword arguments, found {sorted(kwargs)}")
    return PolicyGradientLoss(policy)


def _swallows(policy: Any, **kwargs: Any) -> PolicyGradientLoss:
    return PolicyGradientLoss(policy)


def test_a_factory_declaring_no_options_need_not_take_the_option_keyword() -> None:
    # It rejects aggregation= by name, as any keyword: LOSS-008 must not pass it one.
    impl = Implementation("loss", _no_keywords, name="no-options")
    assert _bad(impl) == {}


def test_a_factory_declaring_no_options_still_rejects_an_unknown_keyword() -> None:
    bad = _bad(Implementation("loss", _swallows, name="swallows-keywords"))
    assert list(bad) == ["LOSS-008"]
    assert "misspelt keyword 'aggregaton' was accepted" in bad["LOSS-008"]
    assert "token_meen" not in bad["LOSS-008"]  # no undeclared option's value was passed


@pytest.mark.parametrize(
    ("extras", "says"),
    [
        ({}, "Implementation.extras['clip_epsilon'] is None"),
        ({"clip_epsilon": (0.2,)}, "extras['clip_epsilon'] is (0.2,)"),
        ({"clip_epsilon": 0.2, "dual_clip": 1.1}, "extras['dual_clip'] is 1.1"),
    ],
)
def test_a_clip_declaration_without_usable_bounds_fails_by_name(
    extras: dict[str, Any], says: str
) -> None:
    impl = Implementation(
        "loss", PolicyGradientLoss, name="clip-undeclared", capabilities={"clip"}, extras=extras
    )
    bad = _bad(impl)
    assert list(bad) == ["LOSS-014"]
    assert says in bad["LOSS-014"]
