"""The kit's reach, as docs/conformance.md carries it (kept in step by a test).

Two measures per contract: the own mutants (``tests/mutants/``), written with the suite to show
that each requirement kills a bug of the kind it was written for; and the one-bug variants of
``tests/independent/<contract>_variants.py``, written from the specs alone by someone who had
not read the suites, of kinds no mutant names: what the kit was not built to catch. A variant
counts as caught when it FAILs the requirement whose sentence it breaks; ``KIT_DEFECTS`` of the
two test modules lists the rest (strict xfails), ``SPEC_DECISIONS`` the variants whose behaviour
the spec, asked, puts out of scope.

``python -m tests.independent.reach`` rewrites the block between the markers in the docs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tests.mutants.table import MODULES as MUTANT_MODULES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
START, END = "<!-- reach-table:start -->", "<!-- reach-table:end -->"
CONTRACTS = list(MUTANT_MODULES)
TESTS = (
    "tests.conformance.independent.test_buffer_weight_sync_metrics_generation_variants",
    "tests.conformance.independent.test_rollout_loss_nll_dpo_variants",
)


def _mutants(contract: str) -> int:
    m = importlib.import_module(f"tests.mutants.{MUTANT_MODULES[contract]}")
    extra = [r for r, i in getattr(m, "EXTRA_MUTANTS", []) if i.contract == contract]
    return len(m.MUTANTS) + len(extra)


def rows() -> list[tuple[str, int, int, int, int]]:
    """(contract, own mutants, variants, caught, put out of scope) per contract."""
    missed: dict[str, int] = {}
    decided: dict[str, int] = {}
    for name in TESTS:
        t = importlib.import_module(name)
        for key in getattr(t, "KIT_DEFECTS", {}):
            missed[key.split("/")[0]] = missed.get(key.split("/")[0], 0) + 1
        for key in getattr(t, "SPEC_DECISIONS", {}):
            decided[key.split("/")[0]] = decided.get(key.split("/")[0], 0) + 1
    out = []
    for c in CONTRACTS:
        variants = len(importlib.import_module(f"tests.independent.{c}_variants").VARIANTS)
        out.append(
            (
                c,
                _mutants(c),
                variants,
                variants - missed.get(c, 0) - decided.get(c, 0),
                decided.get(c, 0),
            )
        )
    return out


def render() -> str:
    """The Markdown table."""
    lines = [
        "| contract | own mutants killed | specs-only variants caught | put out of scope by the spec |",
        "|---|---|---|---|",
    ]
    total = [0, 0, 0, 0]
    for c, mutants, variants, caught, decided in rows():
        lines.append(
            f"| {c} | {mutants} of {mutants} | {caught} of {variants - decided} | {decided} |"
        )
        for i, v in enumerate((mutants, variants - decided, caught, decided)):
            total[i] += v
    lines.append(f"| all | {total[0]} of {total[0]} | {total[2]} of {total[1]} | {total[3]} |")
    return "\n".join(lines)


def rewrite(text: str) -> str:
    """``text`` with the block between the markers replaced by :func:`render`."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render()}\n{END}{tail}"


if __name__ == "__main__":
    DOCS.write_text(rewrite(DOCS.read_text()))
    sys.stdout.write(render() + "\n")
