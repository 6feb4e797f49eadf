"""docs/architecture.md names every package and contract; docs/extending.md's paths exist."""

from __future__ import annotations

import re

from posttrain.contracts import CONTRACTS
from tests.paths import ROOT


def test_architecture_names_every_package_and_contract() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(p.parent.name for p in (ROOT / "posttrain").glob("*/__init__.py"))
    assert [p for p in packages if f"posttrain/{p}/" not in text] == []
    assert [c for c in CONTRACTS if f"`{c}`" not in text and f"{c}.py" not in text] == []
    assert "future" not in text.lower(), "the generation contract exists"


def _instances(path: str) -> list[str]:
    """``path`` with ``<contract>``/``<id>`` as each contract id and ``<major>`` as 1; a path
    with any other placeholder stands for files the reader makes: none to check."""
    out = [path.replace("<major>", "1")]
    if "<contract>" in path or "<id>" in path:
        out = [out[0].replace("<contract>", c).replace("<id>", c) for c in CONTRACTS]
    return [p for p in out if "<" not in p and "*" not in p]


def test_paths_the_extending_guide_names_exist() -> None:
    text = (ROOT / "docs" / "extending.md").read_text()
    paths = set(re.findall(r"`((?:posttrain|tests|specs|scripts|docs)/[^`\s]+)`", text))
    assert paths, "the guide names no path"
    missing = sorted(p for path in paths for p in _instances(path) if not (ROOT / p).exists())
    assert missing == []
