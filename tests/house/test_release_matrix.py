"""`make matrix`'s logic on a fake list of cells: no venv is built and nothing is installed.

The real matrix (one venv per TorchRL/TRL release, minutes per cell) runs only under
``make matrix``; these checks take well under a second.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from tests.paths import ROOT

# By path: a third-party distribution in the venv installs a top-level package named `scripts`.
_PATH = ROOT / "scripts" / "release_matrix.py"
_SPEC = importlib.util.spec_from_file_location("release_matrix", _PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
rm = importlib.util.module_from_spec(_SPEC)
sys.modules["release_matrix"] = rm  # dataclasses look their module up while the class is made
_SPEC.loader.exec_module(rm)


def _cell(release: str, framework: str = "torchrl", **extra: Any) -> dict[str, Any]:
    return {
        "cell": f"{framework}-{release}",
        "framework": framework,
        "release": release,
        "pins": [f"{framework}=={release}.*"],
        "date": "2026-12-04 22:30 UTC",
        "python": "3.11.7",
        "install_s": 30.0,
        "run_s": 60.0,
        **extra,
    }


def test_the_scripts_doctests_pass() -> None:
    failed, attempted = doctest.testmod(rm, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert attempted >= 8
    assert failed == 0


def test_every_cell_is_one_line_of_a_known_framework_with_a_unique_name() -> None:
    names = [c.name for c in rm.CELLS]
    assert len(set(names)) == len(names), f"expected unique cell names, found {names}"
    for c in rm.CELLS:
        assert c.framework in rm.ROWS, c
        assert c.framework in rm.TESTS, c
        reqs = rm.requirements(c)
        assert reqs[0] == rm.TORCH, reqs
        assert set(c.pins) <= set(reqs), reqs


def test_a_pinned_requirement_replaces_the_frameworks_default() -> None:
    cell = rm.Cell("trl", "1.0-old", ("trl==1.0.*", "transformers==4.56.2", "torchrl==0.13.*"))
    reqs = rm.requirements(cell)
    assert "torchrl==0.13.*" in reqs, reqs
    assert "torchrl==0.14.*" not in reqs, reqs


def test_rows_of_a_framework_skip_what_the_cells_do_not_install() -> None:
    names = ["torchrl-raw-lazy-tensor", "torchrl-adapted-ray-weight-sync", "torchrl-wandb-logger"]
    chosen, skipped = rm.rows_of("torchrl", [*names, "trl-grpo-rollout", "reference-buffer"])
    assert chosen == ["torchrl-raw-lazy-tensor"]
    assert sorted(skipped) == ["torchrl-adapted-ray-weight-sync", "torchrl-wandb-logger"]
    assert rm.rows_of("trl", [*names, "trl-grpo-rollout"])[0] == ["trl-grpo-rollout"]


def test_the_page_orders_releases_links_deviations_and_names_every_outcome() -> None:
    declared = {
        "verdict": "does not conform (as declared)",
        "known_failures": ["BUF-009"],
        "failed": ["BUF-009"],
    }
    records = [
        _cell("0.12", versions={"torchrl": "0.12.0"}, rows={"torchrl-raw-lazy-tensor": declared}),
        _cell(
            "0.9",
            versions={"torchrl": "0.9.2"},
            rows={
                "torchrl-raw-lazy-tensor": {
                    "verdict": "unexpected",
                    "known_failures": ["BUF-009"],
                    "surprises": ["BUF-009 declared a known failure but did not fail"],
                },
                "torchrl-adapted-lazy-tensor": {
                    "verdict": "does not conform",
                    "failed": ["BUF-014"],
                    "messages": {"BUF-014": "BUF-014: extend then sample | rows lost"},
                },
            },
        ),
        _cell("0.8", install_error="No matching distribution found for torchrl==0.8.*"),
        _cell("0.7", import_error="OSError: undefined symbol _ZN3c10"),
    ]
    page = rm.render(records, ["torchrl-0.7", "torchrl-0.8", "torchrl-0.9", "torchrl-0.12", "x-1"])
    header = next(ln for ln in page.splitlines() if ln.startswith("| implementation |"))
    assert header.endswith("| 0.9 | 0.12 |"), header  # numeric order; failed cells have no column
    raw = next(ln for ln in page.splitlines() if ln.startswith("| torchrl-raw-lazy-tensor |"))
    assert "[BUF-009](../../tests/torchrl_repros/buf_009_missing_key.py)" in raw
    assert raw.endswith(
        "| **UNEXPECTED**: BUF-009 declared a known failure but did not fail | as declared |"
    )
    adapted = next(
        ln for ln in page.splitlines() if ln.startswith("| torchrl-adapted-lazy-tensor |")
    )
    assert "**does not conform**: BUF-014 fails" in adapted
    assert adapted.endswith("| (no row) |")
    assert (
        "- 0.9 BUF-014 (torchrl-adapted-lazy-tensor): BUF-014: extend then sample \\| rows lost"
        in page
    )
    assert "cannot install: No matching distribution found for torchrl==0.8.*" in page
    assert "cannot import torchrl: OSError: undefined symbol" in page
    assert page.rstrip().endswith("## Not run yet\n\nx-1")
    # Every existing link target is a real repro script.
    for target in {ln.split("](")[1].split(")")[0] for ln in page.splitlines() if "](../../" in ln}:
        assert (rm.ROOT / "docs" / "reports" / target).resolve().is_file(), target


def test_supported_bounds_are_the_oldest_and_newest_release_that_ran_as_expected() -> None:
    ok: dict[str, Any] = {"rows": {"r": {"verdict": "conforms"}}}
    bad: dict[str, Any] = {"rows": {"r": {"verdict": "unexpected", "surprises": ["x"]}}}
    records = [
        _cell("0.10", import_error="OSError"),
        _cell("0.11", **bad, versions={"torchrl": "0.11.1", "tensordict": "0.11.0"}),
        _cell("0.12", **ok, versions={"torchrl": "0.12.0", "tensordict": "0.12.4"}),
        _cell("0.14", **ok, versions={"torchrl": "0.14.1", "tensordict": "0.14.3"}),
        _cell("1.16-tf4.56", "trl", **ok, versions={"trl": "1.16.0", "transformers": "4.56.2"}),
        _cell("1.16-tf9", "trl", **bad, versions={"trl": "1.16.0", "transformers": "9.0"}),
        _cell("1.16", "trl", **ok, versions={"trl": "1.16.0", "torchrl": "0.14.1"}),
        _cell("1.12", "trl", **ok, versions={"trl": "1.12.0", "transformers": "5.25.0"}),
    ]
    # A failing variant cell ("1.16-tf9") narrows nothing but its companion's range.
    assert rm.supported(records) == {
        "torchrl": ("0.12.0", "0.14.1"),
        "trl": ("1.12.0", "1.16.0"),
        "tensordict": ("0.12.4", "0.14.3"),
        "transformers": ("4.56.2", "5.25.0"),
    }


def _norm(version: str) -> tuple[int, ...]:
    parts = [int(x) for x in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_declared_lower_bounds_are_the_pages_oldest_supported_releases() -> None:
    page = rm.ROOT / "docs" / "reports" / "compatibility.md"
    text = page.read_text()
    supported = text.split("## Supported releases", 1)[1].split("\n## ", 1)[0]
    found = dict(re.findall(r"^- (\S+) (\S+) to \S+$", supported, flags=re.M))
    assert set(found) >= {"torchrl", "tensordict"}, found
    # The quoted requirement strings of pyproject.toml (tomllib is not in Python 3.10).
    declared = re.findall(r'^\s*"([A-Za-z0-9_.-]+[<>=!~][^"]*)"', _pyproject(), flags=re.M)
    declared += [
        d
        for line in re.findall(r"^\w+ = \[(.*)\]$", _pyproject(), flags=re.M)
        for d in re.findall(r'"([^"]+)"', line)
    ]
    lower = dict(re.findall(r"^([a-z-]+)>=([0-9.]+)", "\n".join(declared), flags=re.M))
    for dist, oldest in found.items():
        assert dist in lower, f"expected a lower bound for {dist} in pyproject.toml"
        assert _norm(lower[dist]) == _norm(oldest), (
            f"{dist}: pyproject.toml declares >={lower[dist]}, the matrix's oldest supported is {oldest}"
        )


def _pyproject() -> str:
    root: Path = rm.ROOT
    return (root / "pyproject.toml").read_text()
