"""Old public names keep working for one minor version, each with a DeprecationWarning."""

from __future__ import annotations

import importlib
import warnings

import pytest

from posttrain.testing import llm_batch

# (module, old name, the object it must still give)
OLD = [
    ("posttrain.contracts", "check", "posttrain.contracts.validation:check"),
    ("posttrain.contracts", "validate", "posttrain.contracts.validation:validate"),
    ("posttrain.contracts", "BUFFER", "posttrain.contracts.buffer:BUFFER"),
    (
        "posttrain.contracts",
        "LAYOUT_REQUIREMENTS",
        "posttrain.contracts.validation:LAYOUT_REQUIREMENTS",
    ),
    ("posttrain.contracts.mapping", "FRAMEWORKS", "posttrain.contracts.mapping:KEY_MAP_FRAMEWORKS"),
    ("posttrain.conformance", "run", "posttrain.conformance.runner:run"),
    ("posttrain.conformance", "Implementation", "posttrain.contracts:Implementation"),
    (
        "posttrain.observability.check",
        "check_policy_hook",
        "posttrain.observability:compare_policy_hook",
    ),
    ("posttrain.adapters.trl", "SourceClosed", "posttrain:SourceClosed"),
    ("posttrain.adapters.trl", "to_padded", "posttrain.adapters.trl.dataset:to_padded"),
    (
        "posttrain.adapters.nemo_rl",
        "flatten_message_logs",
        "posttrain.adapters.nemo_rl.batching:flatten_message_logs",
    ),
]


def _get(target: str) -> object:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize(("module", "name", "target"), OLD)
def test_old_name_warns_and_answers(module: str, name: str, target: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is deprecated .* 0\.2"):
        got = getattr(importlib.import_module(module), name)
    assert got is _get(target)


def test_the_warning_points_at_the_caller() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from posttrain.contracts import validate  # noqa: F401
    assert caught[0].filename == __file__


def test_layout_check_and_violations_replace_the_old_functions() -> None:
    from posttrain.contracts import LLM_LAYOUT_V1, ContractViolation

    td = llm_batch(2)
    assert LLM_LAYOUT_V1.violations(td) == []
    LLM_LAYOUT_V1.check(td)
    del td["advantage"]
    [v] = LLM_LAYOUT_V1.violations(td, require=("advantage",))
    assert v.requirement == "LAY-001"
    with pytest.raises(ContractViolation, match="LAY-001 key 'advantage'"):
        LLM_LAYOUT_V1.check(td, require=("advantage",), context="ctx")


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import posttrain.contracts

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        posttrain.contracts.nope  # noqa: B018
