"""The parsers of ``posttrain report``, ``specs`` and ``plot``, built without importing what they run.

``posttrain report --help`` and a usage error answer at once because nothing here imports
torch or an implementation: each parser's description is its command module's docstring, read
from the source file (never executed), and every default is computed from the standard library.
The command modules (:mod:`posttrain.conformance.matrix`, :mod:`posttrain.specgen`,
:mod:`posttrain.observability.plot`) build their parsers here too, so the two never differ.
"""

from __future__ import annotations

import argparse
import ast
import os
from functools import cache
from pathlib import Path

ROW_KINDS = ("all", "in-process", "distributed")
"""What ``report --rows`` selects: every row, the rows that stay in their own process, or those
that start Ray or torch.distributed."""

DEFAULT_SMOOTHING = 0.6
"""The EMA weight of the previous smoothed value (TensorBoard's slider): 0 draws the points."""


@cache
def module_doc(module: str) -> str:
    """The docstring of ``module`` read from its source file, without importing it.

    Example:
        >>> module_doc("posttrain.specgen").splitlines()[0]
        'Generate ``specs/``: one Markdown and one JSON Schema file per contract and per layout.'
    """
    # By path, not importlib.util.find_spec: finding posttrain.observability.plot would import
    # posttrain.observability, and with it torch.
    parts = module.split(".")
    if parts[0] != "posttrain":
        raise ValueError(f"module: expected a posttrain module, found {module!r}")
    path = Path(__file__).parent.joinpath(*parts[1:]).with_suffix(".py")
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def default_jobs() -> int:
    """Worker processes by default: the cores this process may run on.

    Example:
        >>> default_jobs() >= 1
        True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def report_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of ``posttrain report`` (:func:`posttrain.conformance.matrix.main`).

    Example:
        >>> report_parser("posttrain report").parse_args(["--rows", "in-process"]).rows
        'in-process'
    """
    p = argparse.ArgumentParser(prog=prog, description=module_doc("posttrain.conformance.matrix"))
    p.add_argument("--out", type=Path, default=Path("reports"), help="folder for the three files")
    p.add_argument("--seed", type=int, default=0, help="seed of every suite's random data")
    p.add_argument("--contract", default=None, help="only the implementations of this contract")
    p.add_argument(
        "--impl",
        default=None,
        metavar="GLOB",
        help="only the implementations whose entry-point name matches this fnmatch glob",
    )
    p.add_argument(
        "--rows",
        choices=ROW_KINDS,
        default="all",
        help="in-process: the rows that start neither Ray nor torch.distributed (make report); "
        "distributed: those that do (make report-distributed); default all",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        metavar="N",
        help="worker processes for the in-process rows (default: the cores, here %(default)s)",
    )
    return p


def specs_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of ``posttrain specs`` (:func:`posttrain.specgen.main`).

    Example:
        >>> specs_parser("posttrain specs").parse_args(["out", "--check"]).check
        True
    """
    p = argparse.ArgumentParser(prog=prog, description=module_doc("posttrain.specgen"))
    p.add_argument("out", type=Path, nargs="?", default=Path("specs"))
    p.add_argument("--check", action="store_true", help="exit 1 if committed files differ")
    return p


def plot_parser(prog: str) -> argparse.ArgumentParser:
    """The parser of ``posttrain plot`` (:func:`posttrain.observability.plot.main`).

    Example:
        >>> plot_parser("posttrain plot").parse_args(["runs"]).smoothing
        0.6
    """
    doc = module_doc("posttrain.observability.plot").split("\n\n")[0]
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run directories")
    p.add_argument("--out", type=Path, default=Path("dashboard.png"))
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="NAME",
        help="draw only runs whose label contains NAME (or matches it as a glob); repeatable",
    )
    p.add_argument(
        "--mlflow-run", default=None, help="draw only the MLflow run of exactly this name"
    )
    p.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        help=f"EMA weight in [0, 1), 0 draws the points (default {DEFAULT_SMOOTHING})",
    )
    p.add_argument("--title", default=None, help="figure title (default: the runs' labels)")
    p.add_argument("--list", action="store_true", help="list the runs found and exit")
    return p
