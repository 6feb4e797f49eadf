"""One verb per meaning across the API (docs/api.md, "Verbs"): ``check`` is the conformance
suite's run and nothing else; raising checks of data are ``validate``; reports of what is
wrong are ``violations``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Iterator

from tests.house.test_docstrings import PUBLIC_PACKAGES

# Public classes outside the packages' ``__all__`` whose methods users call all the same.
EXTRA = ("posttrain.contracts.schema:ItemSchema",)

CHECK = "posttrain.conformance.check"

# Methods that carry a framework's own name because the adapter implements its interface.
FRAMEWORK_NAMES = {"posttrain.adapters.nemo_rl.NemoDataPlaneClient.check_consumption_status"}


def _public_callables() -> Iterator[tuple[str, object]]:
    """``(dotted name, object)`` of each public name and each public attribute of a class."""
    objs = [
        (f"{pkg}.{name}", getattr(importlib.import_module(pkg), name))
        for pkg in PUBLIC_PACKAGES
        for name in importlib.import_module(pkg).__all__
    ]
    for target in EXTRA:
        module, name = target.split(":")
        objs.append((f"{module}.{name}", getattr(importlib.import_module(module), name)))
    for dotted, obj in objs:
        yield dotted, obj
        if inspect.isclass(obj):
            for attr in dir(obj):
                if not attr.startswith("_") and callable(getattr(obj, attr, None)):
                    yield f"{dotted}.{attr}", getattr(obj, attr)


def _verb(dotted: str) -> str:
    return dotted.rpartition(".")[2].split("_")[0]


def test_check_means_the_conformance_run_only() -> None:
    checks = sorted(
        d
        for d, _ in _public_callables()
        if _verb(d) in {"check", "checked"} and d not in FRAMEWORK_NAMES
    )
    assert checks == [CHECK], f"expected only {CHECK} to be named check, found {checks}"


def test_each_verb_of_the_glossary_names_something() -> None:
    verbs = {_verb(d) for d, _ in _public_callables()}
    assert {"check", "validate", "validated", "violations", "resolve", "compare"} <= verbs


def test_no_module_is_named_after_the_check_verb() -> None:
    assert importlib.util.find_spec("posttrain.observability.check") is None
    assert importlib.util.find_spec("posttrain.observability.hook_compare") is not None
