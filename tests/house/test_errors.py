"""Every exception class posttrain defines derives from PosttrainError, and each is defined once."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import defaultdict

import pytest

import posttrain
from posttrain.errors import PosttrainError, ServerClosed, SourceClosed


def _exception_classes() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(posttrain.__path__, "posttrain."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_every_error_derives_from_posttrain_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 17
    outside = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, PosttrainError)
    ]
    assert outside == [], f"expected every error under PosttrainError, found outside: {outside}"


def test_each_error_is_defined_once() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for c in _exception_classes():
        where[c.__name__.lstrip("_")].append(c.__module__)
    twice = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert twice == {}, f"expected one definition per error class, found {twice}"


def test_closed_errors_are_shared_and_keep_their_builtin_base() -> None:
    from posttrain.adapters.torchrl import rollout as torchrl_rollout
    from posttrain.adapters.trl import source as trl_source
    from posttrain.reference_impls import hf_rollout

    assert vars(trl_source)["SourceClosed"] is SourceClosed
    assert vars(hf_rollout)["SourceClosed"] is SourceClosed
    assert vars(torchrl_rollout)["SourceClosed"] is SourceClosed
    assert issubclass(SourceClosed, RuntimeError)
    assert issubclass(ServerClosed, RuntimeError)


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("posttrain.contracts:ContractViolation", ValueError),
        ("posttrain.contracts:DeclarationError", ValueError),
        ("posttrain.adapters.trl.dataset:MissingKey", KeyError),
        ("posttrain.conformance:ConformanceError", AssertionError),
    ],
)
def test_second_bases_kept(name: str, builtin: type[BaseException]) -> None:
    module, attr = name.split(":")
    cls = getattr(importlib.import_module(module), attr)
    assert issubclass(cls, PosttrainError)
    assert issubclass(cls, builtin)
