"""The kit's mutation table, as docs/conformance.md carries it (kept in step by a test).

``python -m tests.mutants.table`` rewrites the block between the markers in the docs.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from posttrain.contracts import CONTRACTS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "conformance.md"
START, END = "<!-- mutation-table:start -->", "<!-- mutation-table:end -->"
MODULES = {
    "buffer": "buffers",
    "loss": "losses",
    "rollout": "rollouts",
    "weight_sync": "weight_syncs",
    "metrics": "sinks",
    "generation": "generation",
    "nll_loss": "nll_losses",
    "dpo_loss": "dpo_losses",
}


def _what(module: object, name: str) -> str:
    """The mutant's own docstring's first paragraph, or its name said in words."""
    obj = getattr(module, name, None)
    if getattr(obj, "__module__", "").startswith("posttrain."):
        return f"The bundled `{name}` declared with a capability or option it does not meet"
    doc = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    first = " ".join((doc or "").strip().split("\n\n")[0].split())
    if first:
        return first
    words = re.sub(r"(?<!^)(?=[A-Z])", " ", name.lstrip("_")).replace("_", " ").lower()
    return words[:1].upper() + words[1:]


def render() -> str:
    """Markdown: one table per contract, every mutant with the requirement that kills it."""
    out: list[str] = []
    for contract, modname in MODULES.items():
        mod = importlib.import_module(f"tests.mutants.{modname}")
        rows = [(rid, impl, "main") for rid, impl in mod.MUTANTS.items()]
        rows += [(rid, impl, "extra") for rid, impl in getattr(mod, "EXTRA_MUTANTS", [])]
        rows.sort(key=lambda r: (r[0], r[2] != "main"))
        c = CONTRACTS[contract]
        out += [
            f"### {contract} v{c.version}: {len(c.requirements)} requirements, {len(rows)} mutants",
            "",
            "| killed by | mutant | what it gets wrong |",
            "|---|---|---|",
        ]
        for rid, impl, kind in rows:
            name = impl.name.removeprefix(f"mutant-{rid}-")
            mark = "" if kind == "main" else " (extra)"
            out.append(f"| {rid}{mark} | `{name}` | {_what(mod, name)} |")
        out.append("")
    return "\n".join(out)


def in_docs() -> str:
    """The block the docs hold now."""
    text = DOCS.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip("\n")


def main() -> int:
    """Rewrite the docs' block from the mutant modules."""
    text = DOCS.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    DOCS.write_text(f"{head}{START}\n{render()}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
