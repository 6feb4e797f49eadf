"""Finding the implementation to check: an entry-point name or ``module:attr``."""

from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata

from posttrain.contracts.implementation import Implementation
from posttrain.contracts.registry import get_contract
from posttrain.errors import PosttrainError

ENTRY_POINT_GROUP = "posttrain.implementations"


class TargetError(PosttrainError, ValueError):
    """The target could not be found or is not an implementation.

    Example:
        >>> try:
        ...     resolve("no_such_module_xyz:make")
        ... except TargetError as e:
        ...     print(str(e).split(":")[0])
        cannot import module 'no_such_module_xyz' for target 'no_such_module_xyz
    """


def _load_attr(target: str) -> object:
    module_name, _, attr = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            hint = (
                f" (searched {os.getcwd()} and the installed packages)"
                if os.getcwd() in sys.path or "" in sys.path
                else " (the current folder is not searched from here: run pytest or "
                "'posttrain check' from the folder that holds it, or install it)"
            )
        raise TargetError(
            f"cannot import module {module_name!r} for target {target!r}: {e}{hint}"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(
                f"module {module_name!r} has no attribute {attr!r} (target {target!r})"
            ) from None
    return obj


def discover() -> dict[str, metadata.EntryPoint]:
    """Registered implementations, by entry-point name.

    Example:
        >>> "reference-buffer" in discover()
        True
    """
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def resolve(target: str, contract: str | None = None) -> Implementation:
    """Turn ``target`` into an :class:`Implementation`.

    ``target`` is ``module:attr`` or an entry-point name in group ``posttrain.implementations``.
    A plain factory callable becomes an implementation of ``contract`` with no capabilities and
    default options.

    Example:
        >>> resolve("posttrain.reference_impls:make_ring_buffer", "buffer").capabilities
        frozenset()
        >>> resolve("reference-buffer").name
        'posttrain.RingBuffer'
    """
    if ":" in target:
        obj = _load_attr(target)
    else:
        eps = discover()
        if target not in eps:
            known = ", ".join(sorted(eps)) or "(none installed)"
            raise TargetError(
                f"{target!r} is neither 'module:attr' nor an entry point in group "
                f"{ENTRY_POINT_GROUP!r}; registered: {known}"
            )
        obj = eps[target].load()
    if isinstance(obj, Implementation):
        if contract is not None and obj.contract != contract:
            raise TargetError(f"target {target!r} implements {obj.contract!r}, not {contract!r}")
        return obj
    if callable(obj):
        if contract is None:
            raise TargetError(
                f"target {target!r} is a plain factory: say which contract it implements "
                "(--conformance=<contract>)"
            )
        get_contract(contract)
        return Implementation(contract, obj, name=target)
    raise TargetError(
        f"target {target!r} is a {type(obj).__name__}; expected a posttrain Implementation "
        "or a factory callable"
    )
