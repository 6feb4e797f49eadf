"""The release matrix: each supported TorchRL and TRL release in a virtual environment of its own.

``make matrix`` (``python scripts/release_matrix.py``) builds one venv per cell of :data:`CELLS`
from the package registry (torch 2.13 CPU, the cell's pins, posttrain installed editable with
``--no-deps``), runs the conformance rows of the framework the cell varies (and its test
files) with that venv's Python, keeps each cell's result as JSON, and writes
``docs/reports/compatibility.md`` from every result it holds. Adding a release is one line of
:data:`CELLS`.

    python scripts/release_matrix.py                      # every cell
    python scripts/release_matrix.py --cells torchrl-0.12 trl-1.0
    python scripts/release_matrix.py --render-only        # the page from the kept results

Environments and results lie under ``$POSTTRAIN_MATRIX_DIR`` (default /tmp/posttrain-matrix).
With ``POSTTRAIN_MATRIX_LOCK=<file>`` each cell's runs (not its install) hold that file's lock.
Lives outside the package: it joins the kit and the TorchRL adapter's deviation records.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import fnmatch
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
"""Every cell's torch: the CPU wheel the project's own venv holds."""


@dataclass(frozen=True)
class Cell:
    """One release of one framework and the pip requirements that install it.

    Example:
        >>> Cell("torchrl", "0.12", ("torchrl==0.12.*", "tensordict==0.12.*")).name
        'torchrl-0.12'
    """

    framework: str
    release: str
    pins: tuple[str, ...]
    note: str = ""
    """Why the cell differs from its neighbours (shown in the page's cell table)."""

    @property
    def name(self) -> str:
        """The cell's name: ``<framework>-<release>``."""
        return f"{self.framework}-{self.release}"


# One line per release. A TorchRL release runs with the tensordict of its own minor; a TRL
# release runs next to the newest TorchRL (tests/adapters/trl/ use its TRL interop) with the
# transformers pip resolves for it, and the newest once more with the oldest transformers it
# declares (transformers>=4.56.2 in every TRL 1.x). A tensordict release runs posttrain's core
# alone (no TorchRL, whose own pin would choose the tensordict): the bound in `dependencies`.
CELLS: tuple[Cell, ...] = (
    Cell("torchrl", "0.10", ("torchrl==0.10.*", "tensordict==0.10.*")),
    Cell("torchrl", "0.11", ("torchrl==0.11.*", "tensordict==0.11.*")),
    Cell("torchrl", "0.12", ("torchrl==0.12.*", "tensordict==0.12.*")),
    Cell("torchrl", "0.13", ("torchrl==0.13.*", "tensordict==0.13.*")),
    Cell("torchrl", "0.14", ("torchrl==0.14.*", "tensordict==0.14.*")),
    Cell("trl", "1.0", ("trl==1.0.*",)),
    Cell("trl", "1.2", ("trl==1.2.*",)),
    Cell("trl", "1.4", ("trl==1.4.*",)),
    Cell("trl", "1.6", ("trl==1.6.*",)),
    Cell("trl", "1.8", ("trl==1.8.*",)),
    Cell("trl", "1.10", ("trl==1.10.*",)),
    Cell("trl", "1.12", ("trl==1.12.*",)),
    Cell("trl", "1.13", ("trl==1.13.*",)),
    Cell("trl", "1.14", ("trl==1.14.*",)),
    Cell("trl", "1.15", ("trl==1.15.*",)),
    Cell("trl", "1.16", ("trl==1.16.*",)),
    Cell("trl", "1.16-tf4.56", ("trl==1.16.*", "transformers==4.56.2"), "oldest transformers"),
    Cell("tensordict", "0.13", ("tensordict==0.13.*",), "core only"),
    Cell("tensordict", "0.14", ("tensordict==0.14.*",), "core only"),
    Cell("tensordict", "0.15", ("tensordict==0.15.*",), "core only"),
)

BASE = ("pydantic>=2.6", "typing-extensions>=4.8", "pytest>=8", "hypothesis>=6.100")
"""posttrain's own runtime requirements (it is installed with ``--no-deps``)."""

FRAMEWORK_EXTRAS: dict[str, tuple[str, ...]] = {
    # TorchRL's LLM rows wrap a transformers model.
    "torchrl": ("transformers",),
    # TRL 1.0 to 1.8 import requests (trl/generation/vllm_client.py) without declaring it:
    # GRPOTrainer's import fails without it (measured: trl-1.0 and trl-1.8 cells).
    "trl": ("torchrl==0.14.*", "tensordict==0.14.*", "accelerate", "datasets", "requests"),
    # tests/conftest.py imports transformers; the HF rollout row wraps a transformers model.
    "tensordict": ("transformers",),
}
"""What a cell of each framework installs besides its pins."""

ROWS: dict[str, tuple[str, ...]] = {
    "torchrl": ("torchrl-*",),
    "trl": ("trl-*",),
    "tensordict": ("reference-*",),
}
"""Entry-point globs of the conformance rows a cell of each framework runs."""

SKIPPED_ROWS: dict[str, str] = {
    "*ray*": "needs Ray, which the cells do not install (make report runs it)",
    "*wandb*": "needs wandb, which the cells do not install (make report runs it)",
    "*tensorboard*": "needs tensorboard, which the cells do not install (make report runs it)",
}
"""Rows left out of every cell, by glob, with the reason the page prints."""

TESTS: dict[str, tuple[str, ...]] = {
    "torchrl": (),
    "trl": ("tests/adapters/trl/test_*.py",),
    "tensordict": (
        "tests/contracts/test_contracts.py",
        "tests/contracts/test_layout_validation.py",
        "tests/contracts/test_item_schema.py",
        "tests/reference_impls/test_ring_buffer.py",
        "tests/reference_impls/test_buffer_checkpoints.py",
        "tests/reference_impls/test_pg_loss.py",
    ),
}
"""Test files (globs) a cell of each framework runs with its own Python (the TRL round trips)."""

BAD = ("unexpected", "error", "does not conform")
"""Row verdicts that are not as expected (``as declared`` and ``conforms`` are)."""

COMPANIONS = ("tensordict", "transformers")
"""Packages whose versions the cells vary with a framework's (bounds in ``pyproject.toml``)."""

VERSIONS = ("torch", "torchrl", "tensordict", "trl", "transformers", "accelerate", "datasets")


def matrix_dir() -> Path:
    """Where the cells' venvs and results lie (``$POSTTRAIN_MATRIX_DIR``)."""
    return Path(os.environ.get("POSTTRAIN_MATRIX_DIR", "/tmp/posttrain-matrix"))


def requirements(cell: Cell) -> list[str]:
    """The pip requirements of ``cell``'s venv (posttrain itself comes after, ``--no-deps``).

    Example:
        >>> requirements(CELLS[2])[:3]
        ['torch==2.13.0', 'torchrl==0.12.*', 'tensordict==0.12.*']
    """
    pinned = {p.split("=")[0].split("<")[0].split(">")[0] for p in cell.pins}
    extras = [x for x in FRAMEWORK_EXTRAS.get(cell.framework, ()) if x.split("=")[0] not in pinned]
    return [TORCH, *cell.pins, *extras, *BASE]


def rows_of(framework: str, names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The entry points a cell of ``framework`` runs, and those it skips with the reason.

    Example:
        >>> rows_of("torchrl", ["torchrl-raw-vanilla", "torchrl-raw-ray-weight-sync", "trl-x"])
        (['torchrl-raw-vanilla'], {'torchrl-raw-ray-weight-sync': 'needs Ray, which the cells do not install (make report runs it)'})
    """
    chosen = [n for n in names if any(fnmatch.fnmatch(n, g) for g in ROWS[framework])]
    skipped = {n: why for n in chosen for g, why in SKIPPED_ROWS.items() if fnmatch.fnmatch(n, g)}
    return [n for n in chosen if n not in skipped], skipped


# --- inside a cell's venv --------------------------------------------------------------------


def run_cell(framework: str, out: Path) -> None:
    """Run ``framework``'s rows and test files with this Python; write the result to ``out``."""
    from importlib import metadata

    from posttrain.conformance.runner import run
    from posttrain.conformance.target import discover

    versions = {}
    for dist in VERSIONS:
        with suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    result: dict[str, Any] = {"versions": versions, "rows": {}, "tests": {}}
    try:
        __import__(framework)
    except Exception as e:  # an old release's import error is the finding
        result["import_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        out.write_text(json.dumps(result, indent=1))
        return
    eps = discover()
    names, skipped = rows_of(framework, sorted(eps))
    result["skipped"] = skipped
    for name in names:
        start = time.perf_counter()
        try:
            rep = run(eps[name].load(), target=name).to_dict()
            row: dict[str, Any] = {
                "verdict": rep["verdict"],
                "surprises": rep["surprises"],
                "known_failures": list(rep["run"].get("known_failures", [])),
                "failed": sorted(
                    r["id"] for r in rep["results"] if r["status"] in ("FAIL", "ERROR")
                ),
                "summary": rep["summary"],
                # What a new failure said, to tell a moved API from a changed behaviour.
                "messages": {
                    r["id"]: _said(r["message"])
                    for r in rep["results"]
                    if r["status"] in ("FAIL", "ERROR")
                    and r["id"] not in rep["run"].get("known_failures", [])
                    and ": blocked by " not in r["message"]
                },
            }
        except Exception as e:  # a row that cannot load is this cell's verdict
            row = {"verdict": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["seconds"] = round(time.perf_counter() - start, 1)
        result["rows"][name] = row
        out.write_text(json.dumps(result, indent=1))
    tests = [str(p.relative_to(ROOT)) for g in TESTS[framework] for p in sorted(ROOT.glob(g))]
    for test in tests:
        start = time.perf_counter()
        proc = _run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-rfE", test],
            TEST_TIMEOUT_S,
            cwd=ROOT,
            # Wide, so that each FAILED line keeps its error message (pytest cuts it to fit).
            env={**os.environ, "COLUMNS": "400"},
        )
        lines = proc.stdout.strip().splitlines()
        failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
        result["tests"][test] = {
            "ok": proc.returncode == 0,
            "summary": lines[-1] if lines else proc.stderr.strip()[-300:],
            "failed": [f[:300] for f in failed[:10]],
            "seconds": round(time.perf_counter() - start, 1),
        }
    out.write_text(json.dumps(result, indent=1))


def _said(message: str) -> str:
    """A check's message, first line, without where it was raised and the spec link.

    Example:
        >>> _said("GEN-001: raised AttributeError: no client (at a.py:1 (kit)) (see specs/x.md)")
        'GEN-001: raised AttributeError: no client'
    """
    first = (message.strip().splitlines() or [""])[0]
    return first.split(" (at ")[0].split(" (see specs/")[0][:240]


# --- the orchestrator ------------------------------------------------------------------------


@contextmanager
def held_lock() -> Iterator[None]:
    """Hold ``$POSTTRAIN_MATRIX_LOCK``'s lock (when set) while the block runs."""
    path = os.environ.get("POSTTRAIN_MATRIX_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


INSTALL_TIMEOUT_S = 1800
"""Longest one install step of a cell may take (venv, its pins, posttrain itself)."""
TEST_TIMEOUT_S = 1200
"""Longest one test file of a cell may run."""
CELL_TIMEOUT_S = 3600
"""Longest a whole cell run may take: every row's suite, then its test files."""


def _run(cmd: list[str], timeout: int, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``cmd``'s result; past ``timeout`` seconds it is killed and reads as exit status 124
    with a message saying so, so a hung install or run is one cell's error, not a hung matrix.

    Example:
        >>> slow = _run([sys.executable, "-c", "import time; time.sleep(5)"], 1)
        >>> slow.returncode, slow.stderr.startswith("timed out after 1 s: ")
        (124, True)
    """
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, check=False, timeout=timeout, **kw
        )
    except subprocess.TimeoutExpired:
        said = f"timed out after {timeout} s: {' '.join(cmd)}"
        return subprocess.CompletedProcess(cmd, 124, stdout="", stderr=said)


def _tail(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if not ln.startswith("WARNING: Location")]
    return " / ".join(lines[-n:])[-600:]


def build_and_run(cell: Cell, python: str, *, reuse: bool = False) -> dict[str, Any]:
    """Build ``cell``'s venv (``reuse``: keep one already built), run it, return its result.

    The result is also kept as JSON beside the venvs.
    """
    venv = matrix_dir() / cell.name
    results = matrix_dir() / "results"
    results.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "cell": cell.name,
        "framework": cell.framework,
        "release": cell.release,
        "pins": list(cell.pins),
        "note": cell.note,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
    }
    start = time.perf_counter()
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    kept = results / f"{cell.name}.json"
    if reuse and (venv / "bin" / "python").is_file() and kept.is_file():
        record["install_s"] = json.loads(kept.read_text()).get("install_s")
        # Only posttrain again: its entry points are read from pyproject.toml at install.
        proc = _run([*pip, "--no-deps", "-e", str(ROOT)], INSTALL_TIMEOUT_S)
    else:
        shutil.rmtree(venv, ignore_errors=True)
        proc = _run([python, "-m", "venv", str(venv)], INSTALL_TIMEOUT_S)
        if proc.returncode == 0:
            proc = _run([*pip, *requirements(cell)], INSTALL_TIMEOUT_S)
        if proc.returncode == 0:
            proc = _run([*pip, "--no-deps", "-e", str(ROOT)], INSTALL_TIMEOUT_S)
        record["install_s"] = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        record["install_error"] = _tail(proc.stderr or proc.stdout)
    else:
        out = results / f"{cell.name}.run.json"
        out.unlink(missing_ok=True)
        # One cell at a time holds the lock for all its runs: per row, it would queue behind
        # every other run between two rows.
        with held_lock():
            start = time.perf_counter()
            proc = _run(
                [str(venv / "bin" / "python"), __file__, "--run-cell", cell.framework,
                 "--json", str(out)],
                CELL_TIMEOUT_S, cwd=ROOT, env={**os.environ, "RL_WARNINGS": "0"},
            )  # fmt: skip
            record["run_s"] = round(time.perf_counter() - start, 1)
        if out.is_file():
            record.update(json.loads(out.read_text()))
        if proc.returncode != 0:
            record["run_error"] = _tail(proc.stderr or proc.stdout)
    (results / f"{cell.name}.json").write_text(json.dumps(record, indent=1))
    return record


# --- the page --------------------------------------------------------------------------------


def _deviation_links() -> dict[str, list[tuple[str, str]]]:
    """Each requirement's TorchRL repros: (component and title, path from docs/reports)."""
    from posttrain.adapters.torchrl import deviations as dev

    out: dict[str, list[tuple[str, str]]] = {}
    for d in (
        *dev.DEVIATIONS,
        *dev.LOSS_DEVIATIONS,
        *dev.ROLLOUT_DEVIATIONS,
        *dev.WEIGHT_SYNC_DEVIATIONS,
        *dev.GENERATION_DEVIATIONS,
        *dev.RAY_DEVIATIONS,
        *dev.LOGGER_DEVIATIONS,
    ):
        for rid in d.requirements:
            path = f"../../tests/torchrl_repros/{d.repro_name}.py"
            out.setdefault(rid, []).append((f"{d.component}: {d.title}", path))
    return out


def cell_verdict(row: dict[str, Any], repro: dict[str, list[tuple[str, str]]]) -> str:
    """One table cell: a row's verdict in one release.

    Only a declared failure is linked to its repro (in the row's second column); an unexpected
    one names its requirement, and the page lists what its check said.

    Example:
        >>> cell_verdict({"verdict": "conforms"}, {})
        'conforms'
        >>> row = {"verdict": "unexpected", "surprises": ["BUF-004 declared a known failure but did not fail"]}
        >>> cell_verdict(row, {})
        '**UNEXPECTED**: BUF-004 declared a known failure but did not fail'
        >>> row = {"verdict": "does not conform", "failed": ["LOSS-001", "LOSS-002"], "messages": {"LOSS-001": "x"}}
        >>> cell_verdict(row, {})
        '**does not conform**: LOSS-001 fails'
    """
    verdict = row.get("verdict", "?")
    if verdict == "error":
        return f"**cannot load**: {row.get('error', '')}".replace("|", "\\|")
    if verdict == "unexpected":
        said = row.get("surprises", [])
        return (
            "**UNEXPECTED**: "
            + "; ".join(said[:4])
            + (f" ... and {len(said) - 4} more" if len(said) > 4 else "")
        )
    if verdict == "does not conform":
        ids = sorted(row.get("messages") or row.get("failed", []))
        return "**does not conform**: " + ", ".join(ids) + " fails"
    if verdict == "does not conform (as declared)":
        return "as declared"
    return str(verdict)


REPRO_PAGES: dict[str, str] = {"trl": "losses.md"}
"""Where a framework's declared deviations are published, when not in TorchRL's repro scripts."""


def _repros(
    framework: str, ids: Sequence[str], torchrl: dict[str, list[tuple[str, str]]]
) -> dict[str, list[tuple[str, str]]]:
    """The repro links of ``framework``'s rows: TorchRL's scripts, or its report page.

    Example:
        >>> _repros("trl", ["LOSS-001"], {"LOSS-001": [("x", "t.py")]})
        {'LOSS-001': [('trl', 'losses.md')]}
    """
    if framework == "torchrl":
        return torchrl
    page = REPRO_PAGES.get(framework)
    return {i: [(framework, page)] for i in ids} if page else {}


def _linked(rid: str, repro: dict[str, list[tuple[str, str]]]) -> str:
    paths = repro.get(rid, [])
    if not paths:
        return rid
    return f"[{rid}]({paths[0][1]})" + "".join(f" [+]({p})" for _, p in paths[1:])


def _busy(record: dict[str, Any]) -> str:
    """Seconds the cell's rows and tests ran (its wall time also holds waits for the lock)."""
    parts = [*record.get("rows", {}).values(), *record.get("tests", {}).values()]
    return f"{sum(float(x.get('seconds', 0)) for x in parts):.0f}" if parts else ""


def _key(release: str) -> tuple[int, ...]:
    head, _, _ = release.partition("-")
    return tuple(int(x) for x in head.split(".") if x.isdigit())


def _release_key(cell: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    return _key(str(cell["release"])), str(cell["release"])


def render(records: Sequence[dict[str, Any]], order: Sequence[str]) -> str:
    """The compatibility page from the cells' results; ``order`` names every planned cell.

    Example:
        >>> rec = {"cell": "trl-1.0", "framework": "trl", "release": "1.0", "versions": {"trl": "1.0.0"},
        ...        "rows": {"trl-grpo-rollout": {"verdict": "conforms"}}, "tests": {}, "install_s": 1, "run_s": 2}
        >>> page = render([rec], ["trl-1.0", "trl-1.4"])
        >>> "| trl-grpo-rollout |  | conforms |" in page, "trl-1.4" in page.split("Not run yet")[1]
        (True, True)
    """
    repro = _deviation_links()
    by_name = {r["cell"]: r for r in records}
    dates = sorted({r["date"] for r in records if "date" in r})
    lines = [
        "# Release compatibility",
        "",
        "Release lines of TorchRL, TRL and tensordict, each in a virtual environment of its "
        f"own built from the package registry with {TORCH} (CPU) and Python "
        f"{', '.join(sorted({str(r.get('python')) for r in records})) or '?'}, through the "
        "conformance rows of that framework's bundled implementations (raw and adapted) and, "
        "for TRL, the round-trip tests `tests/adapters/trl/`. A tensordict cell installs "
        "posttrain's core without TorchRL and runs the reference rows and the contract, "
        "layout, item schema, buffer and policy-gradient loss tests.",
        "",
        "Generated by `make matrix` (`python scripts/release_matrix.py`; one cell: "
        "`python scripts/release_matrix.py --cells torchrl-0.12`), cells run "
        f"{dates[0] if dates else '?'} to {dates[-1] if dates else '?'}. A release is one line "
        "of `CELLS` in `scripts/release_matrix.py`.",
        "",
        "Verdicts: *conforms*; *as declared* (a raw upstream component fails exactly the "
        "requirements it declares in `known_failures`, each with a repro linked in the second "
        "column); **UNEXPECTED** (the failures differ from the declaration: a new deviation, or a "
        "declared one fixed in that release); **cannot load** (the row does not import).",
        "",
        "## Cells",
        "",
        "| cell | installed | install (s) | rows + tests (s) | run, wall (s) | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for name in order:
        r = by_name.get(name)
        if r is None:
            continue
        v = r.get("versions", {})
        shown = ", ".join(f"{k} {v[k]}" for k in VERSIONS if k in v) or ", ".join(r["pins"])
        if "install_error" in r:
            outcome = f"cannot install: {r['install_error']}"
        elif "import_error" in r:
            outcome = f"cannot import {r['framework']}: {r['import_error']}"
        else:
            rows = r.get("rows", {})
            tests = r.get("tests", {})
            bad = [n for n, x in rows.items() if x.get("verdict") in BAD]
            outcome = f"{len(rows) - len(bad)} of {len(rows)} rows as expected"
            if tests:
                red = sorted(Path(t).name for t, x in tests.items() if not x.get("ok"))
                outcome += f"; {len(tests) - len(red)} of {len(tests)} test files pass"
                outcome += f" (failing: {', '.join(red)})" if red else ""
            if r.get("run_error") and not rows:
                outcome += f"; run failed: {r['run_error']}"
        if r.get("note"):
            outcome = f"({r['note']}) {outcome}"
        lines.append(
            f"| {name} | {shown} | {r.get('install_s', '')} | {_busy(r)} | {r.get('run_s', '')} | "
            + outcome.replace("|", "\\|")
            + " |"
        )
    for framework in sorted({r["framework"] for r in records}):
        cells = sorted(
            (r for r in records if r["framework"] == framework and r.get("rows")),
            key=_release_key,
        )
        if not cells:
            continue
        impls = sorted({n for c in cells for n in c["rows"]})
        lines += [
            "",
            f"## {framework}",
            "",
            "| implementation | declared failures (repro) | "
            + " | ".join(c["release"] for c in cells)
            + " |",
            "|---|---|" + "---|" * len(cells),
        ]
        for impl in impls:
            declared = sorted(
                {i for c in cells for i in c["rows"].get(impl, {}).get("known_failures", [])}
            )
            lines.append(
                f"| {impl} | {', '.join(_linked(i, _repros(framework, declared, repro)) for i in declared)} | "
                + " | ".join(
                    cell_verdict(c["rows"][impl], repro) if impl in c["rows"] else "(no row)"
                    for c in cells
                )
                + " |"
            )
        why: dict[str, set[str]] = {}
        for c in cells:
            for n, w in c.get("skipped", {}).items():
                why.setdefault(w, set()).add(n)
        for w, ns in sorted(why.items()):
            lines += ["", f"Not run in the cells ({w}): {', '.join(sorted(ns))}."]
        said: dict[tuple[str, str, str], list[str]] = {}
        for c in cells:
            for n, x in c["rows"].items():
                for rid, msg in x.get("messages", {}).items():
                    said.setdefault((c["release"], rid, _said(msg)), []).append(n)
        if said:
            lines += [
                "",
                f"What the unexpected failures said ({framework} release, requirement). Repro: "
                "`python scripts/release_matrix.py --cells <cell>` builds the cell's venv, then "
                "`/tmp/posttrain-matrix/<cell>/bin/posttrain check <contract> <implementation>` "
                "runs one row there:",
                "",
            ]
            lines += [
                f"- {rel} {rid} ({', '.join(ns)}): {msg}".replace("|", "\\|")
                for (rel, rid, msg), ns in sorted(
                    said.items(), key=lambda kv: (_key(kv[0][0]), kv[0][1])
                )
            ]
        failing = [
            (c["release"], t, f)
            for c in cells
            for t, x in c.get("tests", {}).items()
            for f in x["failed"]
        ]
        if failing:
            lines += ["", "Failing tests:", ""]
            lines += [f"- {rel}: `{f}`" for rel, _, f in failing]
        since = works_from(cells)
        if since:
            lines += [
                "",
                f"Oldest {framework} release each row and test file works from (as expected in "
                "it and every newer cell):",
                "",
                "| works from | rows and test files |",
                "|---|---|",
            ]
            groups: dict[str, list[str]] = {}
            for part, rel in since.items():
                groups.setdefault(rel, []).append(part)
            lines += [
                f"| {rel} | {', '.join(sorted(parts))} |"
                for rel, parts in sorted(groups.items(), key=lambda kv: _key(kv[0]))
            ]
    bounds = supported(records)
    if bounds:
        lines += [
            "",
            "## Supported releases",
            "",
            "Each framework from the oldest cell from which every newer cell ran as expected "
            "to the newest checked, with the versions of tensordict and transformers those "
            "cells installed. `pyproject.toml`'s lower bounds are the oldest of each; its "
            "upper bounds exclude the next release line not yet checked (a TorchRL or "
            "tensordict 0.x minor, a TRL or transformers major):",
            "",
        ]
        lines += [f"- {name} {lo} to {hi}" for name, (lo, hi) in bounds.items()]
    missing = [n for n in order if n not in by_name]
    if missing:
        lines += ["", "## Not run yet", "", ", ".join(missing)]
    return "\n".join(lines) + "\n"


def works_from(cells: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Each row and test file: the oldest release from which it is as expected in every cell.

    ``cells`` are one framework's results; a part is absent when even the newest fails it.

    Example:
        >>> ok, bad = {"verdict": "conforms"}, {"verdict": "error"}
        >>> works_from([
        ...     {"release": "1.0", "rows": {"a": bad, "b": ok}, "tests": {"t.py": {"ok": False}}},
        ...     {"release": "1.12", "rows": {"a": ok, "b": ok}, "tests": {"t.py": {"ok": True}}},
        ... ])
        {'a': '1.12', 'b': '1.0', 't.py': '1.12'}
    """
    out: dict[str, str] = {}
    ordered = sorted((c for c in cells if c.get("rows")), key=_release_key, reverse=True)
    parts = sorted({n for c in ordered for n in c["rows"]}) + sorted(
        {Path(t).name for c in ordered for t in c.get("tests", {})}
    )
    for part in parts:
        for c in ordered:
            tests = {Path(t).name: x for t, x in c.get("tests", {}).items()}
            row, test = c["rows"].get(part), tests.get(part)
            good = (row is not None and row.get("verdict") not in BAD) or (
                test is not None and bool(test.get("ok"))
            )
            if not good:
                break
            out[part] = _key_release(c)
    return out


def _key_release(cell: dict[str, Any]) -> str:
    return str(cell["release"]).partition("-")[0]


def _ran_as_expected(record: dict[str, Any]) -> bool:
    if "install_error" in record or "import_error" in record or not record.get("rows"):
        return False
    rows_ok = all(x.get("verdict") not in BAD for x in record["rows"].values())
    return rows_ok and all(t.get("ok") for t in record.get("tests", {}).values())


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".") if x.isdigit())


def supported(records: Sequence[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Oldest and newest version of each framework and companion package the cells support.

    A framework's supported cells are its newest ones down to the first that did not run as
    expected (every row conforms or fails as declared, every test file passes); a framework's
    range spans the versions its own supported cells installed, a companion's (tensordict,
    transformers) the versions every supported cell installed. ``pyproject.toml``'s lower
    bounds are the oldest of each.

    Example:
        >>> ok = {"rows": {"r": {"verdict": "conforms"}}}
        >>> supported([
        ...     {"framework": "trl", "release": "1.0", "versions": {"trl": "1.0.0", "transformers": "4.56.2"}, **ok},
        ...     {"framework": "trl", "release": "1.1", "versions": {"trl": "1.1.0", "transformers": "5.0.0"}, **ok},
        ... ])
        {'trl': ('1.0.0', '1.1.0'), 'transformers': ('4.56.2', '5.0.0')}
    """
    seen: dict[str, set[str]] = {}
    frameworks = sorted({r["framework"] for r in records})
    for framework in frameworks:
        mine = [r for r in records if r["framework"] == framework]
        # A variant cell ("1.16-tf4.56") checks a companion, not a release line of its own.
        lines = sorted((r for r in mine if "-" not in str(r["release"])), key=_release_key)
        good: list[dict[str, Any]] = []
        for r in reversed(lines):
            if not _ran_as_expected(r):
                break
            good.append(r)
        lines_ok = {str(r["release"]) for r in good}
        good += [
            r
            for r in mine
            if "-" in str(r["release"])
            and str(r["release"]).partition("-")[0] in lines_ok
            and _ran_as_expected(r)
        ]
        for r in good:
            for dist, version in r.get("versions", {}).items():
                if dist in COMPANIONS or dist == framework:
                    seen.setdefault(dist, set()).add(version)
    order = [*frameworks, *COMPANIONS]
    return {
        d: (min(seen[d], key=_version_key), max(seen[d], key=_version_key))
        for d in sorted(seen, key=order.index)
    }


def load_records() -> list[dict[str, Any]]:
    """Every kept cell result (``<matrix dir>/results/<cell>.json``)."""
    folder = matrix_dir() / "results"
    return [
        json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if ".run." not in p.name
    ]


def main(argv: list[str] | None = None) -> int:
    """Build and run the chosen cells (all by default), then write the page; 1 on UNEXPECTED."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", nargs="*", default=None, help="cell names (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "reports" / "compatibility.md")
    p.add_argument("--python", default=sys.executable, help="the Python that creates the venvs")
    p.add_argument("--render-only", action="store_true", help="write the page from kept results")
    p.add_argument("--reuse", action="store_true", help="rerun in venvs already built")
    p.add_argument("--run-cell", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_cell:
        run_cell(args.run_cell, args.json)
        sys.stdout.flush()
        # Skip interpreter teardown, where process groups' threads have crashed the process.
        os._exit(0)
    known = {c.name: c for c in CELLS}
    chosen = [] if args.render_only else list(args.cells or known)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        p.error(f"unknown cells {unknown}; valid: {', '.join(known)}")
    for name in chosen:
        rec = build_and_run(known[name], args.python, reuse=args.reuse)
        print(
            f"{name}: install {rec.get('install_s')} s, runs {rec.get('run_s', '-')} s", flush=True
        )
    records = load_records()
    args.out.write_text(render(records, list(known)))
    print(f"wrote {args.out}")
    bad = [
        (r["cell"], n)
        for r in records
        for n, x in r.get("rows", {}).items()
        if x.get("verdict") in BAD
    ]
    return int(bool(bad))


if __name__ == "__main__":
    raise SystemExit(main())
