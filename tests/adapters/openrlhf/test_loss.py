"""OpenRLHF 0.11.2's PolicyLoss, loaded from openrlhf/models/loss.py alone, through the loss
suite: every row fails exactly what it declares."""

from __future__ import annotations

import importlib.util
import sys

import pytest

if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("pip install --no-deps openrlhf==0.11.2", allow_module_level=True)

from posttrain.adapters.openrlhf.implementations import KNOWN, ROWS
from tests.outcomes import own_failures


@pytest.mark.parametrize("name", sorted(ROWS))
def test_openrlhf_row_fails_what_it_declares(name: str) -> None:
    assert set(own_failures(ROWS[name])) == set(KNOWN.get(name, frozenset()))


def test_the_loss_module_loads_without_openrlhfs_package_imports() -> None:
    from posttrain.adapters.openrlhf.loss import openrlhf_loss_module

    mod = openrlhf_loss_module()
    assert mod.PolicyLoss.__module__.endswith(".loss")
    assert "openrlhf.models" not in sys.modules  # its package (actor, flash_attn) never ran
    assert "deepspeed" not in sys.modules or sys.modules["deepspeed"].__spec__ is not None
