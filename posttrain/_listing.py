"""What the command line says before anything runs, read without importing torch.

``posttrain list`` and the usage checks of ``posttrain check`` need the contracts (id, version,
title) and each registered implementation's contract and framework. Importing the contracts or
loading the entry points would import torch and every framework (seconds), so:

- the contracts are read from the source of ``posttrain/contracts`` (the ``CONTRACTS`` tuple
  of ``registry.py`` and each ``Contract(id=..., version=..., title=...)`` call), without
  running it; should that source ever stop being literal, the real registry is imported;
- an entry point's contract comes from :data:`posttrain._listing_index.CONTRACT_OF`, keyed by
  the entry point's ``module:attr`` (written by ``python -m posttrain._listing``); an entry
  point the index does not know (another package's, or one added since) is loaded;
- the framework comes from the entry point's module path.

tests/house/test_cli.py holds all three to the real registry.

Example:
    >>> [c.id for c in contracts()][:2]
    ['buffer', 'rollout']
    >>> row = next(r for r in implementation_rows() if r.name == "reference-buffer")
    >>> row.contract, row.framework
    ('buffer', 'posttrain')
"""

from __future__ import annotations

import ast
import json
import sys
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

ENTRY_POINT_GROUP = "posttrain.implementations"
_CONTRACTS_DIR = Path(__file__).resolve().parent / "contracts"
_INDEX_FILE = Path(__file__).resolve().parent / "_listing_index.py"
_DEFAULT_VERSION = "1.0"  # Contract.version's default (posttrain/contracts/contract.py)


class ContractInfo(NamedTuple):
    """A contract as ``posttrain list`` shows it."""

    id: str
    version: str
    title: str


class ImplementationRow(NamedTuple):
    """A registered implementation as ``posttrain list`` shows it."""

    name: str
    contract: str
    framework: str


def _literal_kwargs(call: ast.Call) -> dict[str, str]:
    return {
        k.arg: k.value.value
        for k in call.keywords
        if k.arg is not None
        and isinstance(k.value, ast.Constant)
        and isinstance(k.value.value, str)
    }


def _from_source() -> list[ContractInfo]:
    tree = ast.parse((_CONTRACTS_DIR / "registry.py").read_text())
    module_of: dict[str, str] = {}
    order: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                module_of[alias.asname or alias.name] = node.module
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "CONTRACTS":
            comp = node.value if isinstance(node, ast.AnnAssign) else None
            if not isinstance(comp, ast.DictComp) or not isinstance(
                comp.generators[0].iter, ast.Tuple
            ):
                raise ValueError("CONTRACTS is not a comprehension over a literal tuple")
            order = [e.id for e in comp.generators[0].iter.elts if isinstance(e, ast.Name)]
    if not order:
        raise ValueError("no CONTRACTS in registry.py")
    out: list[ContractInfo] = []
    for name in order:
        module = module_of[name]
        if not module.startswith("posttrain.contracts."):
            raise ValueError(f"{name} comes from {module}")
        source = _CONTRACTS_DIR / (module.rsplit(".", 1)[1] + ".py")
        found = None
        for node in ast.parse(source.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Call)
            ):
                kw = _literal_kwargs(node.value)
                if "id" in kw and "title" in kw:
                    found = ContractInfo(kw["id"], kw.get("version", _DEFAULT_VERSION), kw["title"])
        if found is None:
            raise ValueError(f"no literal Contract(id=..., title=...) for {name} in {source}")
        out.append(found)
    return out


@cache
def contracts() -> tuple[ContractInfo, ...]:
    """Every bundled contract, in the registry's order, read from source (no torch import).

    Example:
        >>> contracts()[0].id, contracts()[0].title
        ('buffer', 'Replay buffer')
    """
    try:
        return tuple(_from_source())
    except (OSError, SyntaxError, ValueError, KeyError):
        from posttrain.contracts.registry import CONTRACTS

        return tuple(ContractInfo(c.id, c.version, c.title) for c in CONTRACTS.values())


def entry_points() -> dict[str, metadata.EntryPoint]:
    """The entry points of group ``posttrain.implementations``, by name, sorted (none loaded).

    Example:
        >>> entry_points()["reference-buffer"].value
        'posttrain.reference_impls:RING_BUFFER'
    """
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep for ep in sorted(eps, key=lambda ep: ep.name)}


def framework_of(name: str, value: str) -> str:
    """The framework of entry point ``name`` whose target is ``value`` (``module:attr``).

    ``posttrain.adapters.<framework>`` names it; the reference implementations are
    ``posttrain``'s; a bundled sink is named after its backend (``mlflow-sink``); anything
    else is its top-level package.

    Example:
        >>> framework_of("torchrl-raw-lazy-tensor", "posttrain.adapters.torchrl.x:A")
        'torchrl'
        >>> framework_of("mine", "mypkg.buffers:MINE")
        'mypkg'
    """
    module = value.partition(":")[0]
    parts = module.split(".")
    if parts[:2] == ["posttrain", "adapters"] and len(parts) > 2:
        return parts[2]
    if parts[:2] == ["posttrain", "observability"]:
        return name.split("-")[0]
    if parts[0] == "posttrain" or not module:
        return "posttrain"
    return parts[0]


def some_names(names: list[str], limit: int = 10) -> str:
    """At most ``limit`` names, comma-separated, then how many more.

    Example:
        >>> some_names(["a", "b", "c"], limit=2)
        'a, b ... and 1 more'
    """
    if not names:
        return "(none)"
    head = ", ".join(names[:limit])
    return head + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


def _index() -> dict[str, str]:
    try:
        from posttrain._listing_index import CONTRACT_OF
    except ImportError:
        return {}
    return CONTRACT_OF


def contract_of(ep: metadata.EntryPoint) -> str:
    """The contract entry point ``ep`` implements: from the index, else by loading it.

    Example:
        >>> contract_of(entry_points()["reference-buffer"])
        'buffer'
    """
    known = _index().get(ep.value)
    if known is not None:
        return known
    obj = ep.load()
    contract = getattr(obj, "contract", None)
    if not isinstance(contract, str):
        raise TypeError(f"entry point {ep.name!r} ({ep.value}) is not a posttrain Implementation")
    return contract


def implementation_rows() -> list[ImplementationRow]:
    """Every registered implementation with its contract and framework, sorted by name.

    Example:
        >>> [r.framework for r in implementation_rows() if r.name == "torchrl-raw-lazy-tensor"]
        ['torchrl']
    """
    return [
        ImplementationRow(name, contract_of(ep), framework_of(name, ep.value))
        for name, ep in entry_points().items()
    ]


def index_source() -> str:
    """The text of ``posttrain/_listing_index.py`` for the entry points installed now (loads
    each of posttrain's own)."""
    rows = []
    for ep in entry_points().values():
        if ep.value.startswith("posttrain."):
            obj = ep.load()
            rows.append(f"    {json.dumps(ep.value)}: {json.dumps(obj.contract)},")
    body = "\n".join(sorted(rows))
    return (
        '"""Generated by ``python -m posttrain._listing``: the contract of each bundled entry\n'
        "point, by its ``module:attr``, so that ``posttrain list`` need not load it.\n"
        '"""\n\n'
        f"CONTRACT_OF: dict[str, str] = {{\n{body}\n}}\n"
    )


if __name__ == "__main__":
    _INDEX_FILE.write_text(index_source())
    print(f"wrote {_INDEX_FILE}", file=sys.stderr)
