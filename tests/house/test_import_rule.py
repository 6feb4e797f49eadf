"""The one-way import rule, checked on the source, and lazy optional dependencies."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

PKG = ROOT / "posttrain"
CONTRACT_DEPS = {"torch", "tensordict", "pydantic", "typing_extensions"}
OPTIONAL = {
    "torchrl",
    "trl",
    "transformers",
    "datasets",
    "accelerate",
    "tensorboard",
    "mlflow",
    "wandb",
    "ray",
    "matplotlib",
    "tokenizers",
}


def _imports(path: Path, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py")) if (PKG / sub).is_dir() else []


# The base every layer may import: the error classes and the private primitives (argument
# checks, dtype names, futures). They import nothing else from posttrain.
BASE = (
    "posttrain.errors",
    "posttrain._args",
    "posttrain._dtypes",
    "posttrain._futures",
)


def test_the_base_modules_import_only_each_other() -> None:
    bad = [
        f"{m}: {mod}"
        for m in BASE
        if (PKG.parent / (m.replace(".", "/") + ".py")).exists()
        for mod in _imports(PKG.parent / (m.replace(".", "/") + ".py"), top_level_only=False)
        if mod.startswith("posttrain") and mod not in BASE
    ]
    assert not bad


def test_contracts_import_only_contracts_and_core_deps() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for f in _files("contracts"):
        for mod in _imports(f, top_level_only=False):
            root = mod.split(".")[0]
            if (
                mod.startswith("posttrain.")
                and not mod.startswith("posttrain.contracts")
                and mod not in BASE
            ) or root not in stdlib | CONTRACT_DEPS | {"posttrain", "__future__"}:
                bad.append(f"{f.name}: {mod}")
    assert not bad


@pytest.mark.parametrize(
    ("sub", "forbidden"),
    [
        (
            "conformance",
            (
                "posttrain.adapters",
                "posttrain.reference_impls",
                "posttrain.observability",
                "posttrain.policy_loss",
            ),
        ),
        ("reference_impls", ("posttrain.conformance", "posttrain.adapters")),
        # The configurable policy loss sits between the contracts and the adapters.
        (
            "policy_loss",
            (
                "posttrain.conformance",
                "posttrain.adapters",
                "posttrain.reference_impls",
                "posttrain.observability",
            ),
        ),
        # The test data builders sit below the kit: the suites and implementers import them.
        (
            "testing",
            (
                "posttrain.conformance",
                "posttrain.adapters",
                "posttrain.reference_impls",
                "posttrain.observability",
            ),
        ),
        ("adapters", ("posttrain.conformance",)),
    ],
)
def test_no_upward_or_sideways_imports(sub: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{f.relative_to(PKG)}: {m}"
        for f in _files(sub)
        for m in _imports(f, False)
        if m.startswith(forbidden)
    ]
    assert not bad


REPROS = PKG.parent / "tests" / "torchrl_repros"
# What a TorchRL maintainer has after `pip install 'posttrain[torchrl]'`: the public test data
# builders, the TorchRL adapter, and the rollout suite's scripted weights.
REPRO_MAY_IMPORT = (
    "posttrain.testing",
    "posttrain.adapters.torchrl",
    "posttrain.conformance.suites.rollout",
)


@pytest.mark.parametrize(
    "path", sorted(set(REPROS.glob("[a-z]*.py")) - {REPROS / "conftest.py"}), ids=lambda p: p.stem
)
def test_torchrl_repros_import_posttrain_through_public_modules_only(path: Path) -> None:
    bad = [
        m
        for m in _imports(path, False)
        if m.split(".")[0] == "posttrain" and not m.startswith(REPRO_MAY_IMPORT)
    ]
    assert bad == [], (
        f"{path.name}: expected posttrain imports from {REPRO_MAY_IMPORT}, found {bad}"
    )


def test_adapters_never_import_each_other() -> None:
    bad = []
    for d in (
        sorted(p for p in (PKG / "adapters").glob("*") if p.is_dir())
        if (PKG / "adapters").is_dir()
        else []
    ):
        for f in d.rglob("*.py"):
            if f.name == "implementations.py":
                # Conformance rows (declarations, not adapter code) may compose two adapters
                # inside a row's factory: docs/architecture.md, the one-way import rule.
                continue
            for m in _imports(f, False):
                # posttrain.adapters._* modules are framework-neutral helpers they may share.
                if (
                    m.startswith("posttrain.adapters.")
                    and not m.startswith(f"posttrain.adapters.{d.name}")
                    and not m.startswith("posttrain.adapters._")
                ):
                    bad.append(f"{f.relative_to(PKG)}: {m}")
    assert not bad


def test_optional_dependencies_are_imported_lazily() -> None:
    bad = [
        f"{f.relative_to(PKG)}: {m}"
        for f in sorted(PKG.rglob("*.py"))
        for m in _imports(f, True)
        if m.split(".")[0] in OPTIONAL
    ]
    assert not bad, "optional dependencies must be imported inside functions"


def test_importing_posttrain_pulls_no_optional_dependency() -> None:
    code = (
        "import sys, posttrain, posttrain.contracts, posttrain.conformance, posttrain.reference_impls, posttrain.specgen, posttrain.testing;"
        f"print(sorted(m for m in {sorted(OPTIONAL)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_lazy_optional_import_says_what_to_install() -> None:
    # Read from the source: an import of an optional dependency inside a function sits in
    # `with optional_deps():` or in a try that turns its failure into an install hint.
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        tree = ast.parse(f.read_text())
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or node in tree.body:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            mod = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
            if not {m.split(".")[0] for m in [*names, *([mod] if mod else [])]} & OPTIONAL:
                continue
            p = parents.get(node)
            while p is not None and not isinstance(p, ast.With | ast.Try):
                p = parents.get(p)
            if p is None or (
                isinstance(p, ast.With) and "optional_deps" not in ast.unparse(p.items[0])
            ):
                bad.append(f"{f.relative_to(PKG)}:{node.lineno}")
            elif isinstance(p, ast.Try) and not any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in p.handlers
            ):
                bad.append(f"{f.relative_to(PKG)}:{node.lineno} (its try catches no ImportError)")
    assert not bad


@pytest.mark.parametrize(
    ("missing", "call", "extra"),
    [
        (
            "torchrl",
            "from posttrain.adapters.torchrl.loggers import csv_logger; csv_logger('.')",
            "torchrl",
        ),
        (
            "tensorboard",
            # an event file to read: a folder without one needs no reader
            "import pathlib, tempfile; d = tempfile.mkdtemp(); "
            "pathlib.Path(d, 'events.out.tfevents.0').write_bytes(b'')\n"
            "from posttrain.adapters.torchrl.loggers import read_tensorboard; read_tensorboard(d)",
            "observability",
        ),
        (
            "datasets",
            "from posttrain.adapters.trl.dataset import prompt_dataset; prompt_dataset(None, None, 1)",
            "trl",
        ),
        (
            "mlflow",
            "from posttrain.observability.sinks import read_mlflow; read_mlflow('.', 'x')",
            "observability",
        ),
    ],
)
def test_a_missing_optional_dependency_names_its_extra(missing: str, call: str, extra: str) -> None:
    code = f"import sys; sys.modules[{missing!r}] = None\n{call}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert (
        last == f"ModuleNotFoundError: {missing} is not installed: pip install 'posttrain[{extra}]'"
    )
