"""The conformance matrix of every registered implementation (``make report``).

``posttrain report --out reports`` (or ``python -m posttrain.conformance.matrix --out reports``)
runs each entry point of group ``posttrain.implementations`` through its contract's suite and
writes ``conformance.md``, ``conformance.html`` and ``conformance.json``.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from pathlib import Path

from posttrain.conformance import html_report
from posttrain.conformance.outcome import Report, Status, md_cell, reports_json
from posttrain.conformance.runner import run
from posttrain.conformance.target import ENTRY_POINT_GROUP, TargetError, discover
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.registry import CONTRACTS

_MARK = {
    Status.PASS: "PASS",
    Status.FAIL: "FAIL",
    Status.ERROR: "ERROR",
    Status.NOT_APPLICABLE: "n/a",
}


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


def implementations() -> dict[str, Implementation]:
    """Every registered implementation, by entry-point name, sorted (loads each entry point).

    Example:
        >>> implementations()["reference-buffer"].contract
        'buffer'
    """
    out: dict[str, Implementation] = {}
    for name, ep in sorted(discover().items()):
        obj = ep.load()
        if not isinstance(obj, Implementation):
            raise TypeError(f"entry point {name!r} ({ep.value}) is not a posttrain Implementation")
        out[name] = obj
    return out


def framework_of(target: str) -> str:
    """The framework a registered implementation (or a ``module:attr``) comes from.

    ``posttrain.adapters.<framework>`` names it; the reference implementations are
    ``posttrain``'s; a bundled sink is named after its backend (``mlflow-sink``); anything
    else is its top-level package.

    Example:
        >>> framework_of("torchrl-raw-lazy-tensor"), framework_of("reference-buffer")
        ('torchrl', 'posttrain')
        >>> framework_of("mlflow-sink"), framework_of("mypkg.buffers:MINE")
        ('mlflow', 'mypkg')
    """
    ep = discover().get(target)
    module = (ep.value if ep is not None else target).partition(":")[0]
    parts = module.split(".")
    if parts[:2] == ["posttrain", "adapters"] and len(parts) > 2:
        return parts[2]
    if parts[:2] == ["posttrain", "observability"] and ep is not None:
        return target.split("-")[0]
    if parts[0] == "posttrain" or not module:
        return "posttrain"
    return parts[0]


def select(contract: str | None = None, impl_glob: str | None = None) -> dict[str, Implementation]:
    """The registered implementations of ``contract`` whose names match the ``fnmatch`` glob.

    Raises ``ValueError`` naming what was given and the valid names when nothing is selected.

    Example:
        >>> sorted(select("buffer", "reference*"))
        ['reference-buffer']
        >>> select("bufer")
        Traceback (most recent call last):
        ...
        ValueError: unknown contract 'bufer'; valid: buffer, rollout, weight_sync, loss, ...
    """
    if contract is not None and contract not in CONTRACTS:
        raise ValueError(f"unknown contract {contract!r}; valid: {some_names(list(CONTRACTS))}")
    impls = {
        n: impl
        for n, impl in implementations().items()
        if contract is None or impl.contract == contract
    }
    chosen = {n: i for n, i in impls.items() if impl_glob is None or fnmatch.fnmatch(n, impl_glob)}
    if not chosen:
        where = f" of contract {contract!r}" if contract else ""
        raise TargetError(
            f"no implementation{where} matches {impl_glob!r} (entry points of group "
            f"{ENTRY_POINT_GROUP!r}); valid: {some_names(sorted(impls))}"
        )
    return chosen


def run_all(
    seed: int = 0, *, contract: str | None = None, impl_glob: str | None = None
) -> dict[str, Report]:
    """Run every registered implementation (or those :func:`select` picks); reports by name.

    Every entry point in group ``posttrain.implementations`` runs its contract's whole suite
    (twenty minutes on two cores for the bundled ones: Ray and process groups included).

    Example:
        >>> reports = run_all(seed=0, contract="buffer", impl_glob="reference*")
        >>> list(reports), exit_status(reports)
        (['reference-buffer'], 0)
    """
    out: dict[str, Report] = {}
    for name, obj in select(contract, impl_glob).items():
        start = time.perf_counter()
        rep = run(obj, target=name, seed=seed)
        rep.run["duration_s"] = round(time.perf_counter() - start, 2)
        out[name] = rep
    return out


def _verdict(rep: Report) -> str:
    base = "conforms" if rep.ok else "DOES NOT CONFORM"
    if rep.surprises():
        return f"{base}, UNEXPECTED"
    return base if rep.ok else f"{base} (as declared)"


def _rows(reports: dict[str, Report]) -> list[tuple[str, Report, str]]:
    return [(name, rep, _verdict(rep)) for name, rep in reports.items()]


def exit_status(reports: dict[str, Report]) -> int:
    """1 when any implementation's failures differ from its declared ``known_failures``.

    Example:
        >>> exit_status({"x": Report(run={"known_failures": ["BUF-009"]}, results=[])})
        1
    """
    return int(any(rep.surprises() for rep in reports.values()))


def _by_contract(reports: dict[str, Report]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, rep in reports.items():
        out.setdefault(str(rep.run.get("contract")), []).append(name)
    return out


def render_markdown(reports: dict[str, Report]) -> str:
    """The matrix as Markdown: a summary table, then one table of requirements per contract.

    Example:
        >>> from posttrain.conformance.outcome import Result
        >>> row = Result("BUF-013", "MUST", "empty sample raises", Status.PASS)
        >>> rep = Report(run={"contract": "buffer", "contract_version": "1.0"}, results=[row])
        >>> print(render_markdown({"mine": rep}).splitlines()[4])
        | mine | buffer v1.0 | 1 | 0 | 0 | 0 | conforms |  |
    """
    lines = [
        "# posttrain conformance matrix",
        "",
        "| implementation | contract | PASS | FAIL | ERROR | n/a | verdict | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rep, verdict in _rows(reports):
        c = rep.counts()
        lines.append(
            f"| {md_cell(name)} | {md_cell(rep.run.get('contract'))} v{md_cell(rep.run.get('contract_version', '?'))} | {c['PASS']} | {c['FAIL']} "
            f"| {c['ERROR']} | {c['NOT_APPLICABLE']} | {verdict} | {rep.run.get('duration_s', '')} |"
        )
    for contract, names in _by_contract(reports).items():
        lines += [
            "",
            f"## {md_cell(contract)}",
            "",
            "| requirement | " + " | ".join(md_cell(n) for n in names) + " |",
            "|---|" + "---|" * len(names),
        ]
        ids = [r.id for r in reports[names[0]].results]
        for i, rid in enumerate(ids):
            cells = []
            for n in names:
                r = reports[n].results[i]
                cells.append(
                    _MARK[r.status]
                    + (f" ({r.level})" if r.status in (Status.FAIL, Status.ERROR) else "")
                )
            lines.append(
                f"| {md_cell(rid)} {md_cell(reports[names[0]].results[i].title)} | "
                + " | ".join(cells)
                + " |"
            )
    failures = [
        (n, r)
        for n, rep in reports.items()
        for r in rep.results
        if r.status in (Status.FAIL, Status.ERROR)
    ]
    surprises = [(n, line) for n, rep in reports.items() for line in rep.surprises()]
    if surprises:
        lines += ["", "## Unexpected (failures that differ from the declared known failures)", ""]
        lines += [f"- **{md_cell(n)}** {md_cell(line)}" for n, line in surprises]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- **{md_cell(n)}** {md_cell(r.message.splitlines()[0])}" for n, r in failures]
    return "\n".join(lines) + "\n"


def render_html(reports: dict[str, Report], *, spec_base: str = "../") -> str:
    """The matrix as one self-contained HTML page (see :mod:`posttrain.conformance.html_report`).

    Frameworks come from :func:`framework_of`; ``spec_base`` leads from the page's folder to
    the folder that holds ``specs/``.

    Example:
        >>> from posttrain.conformance.outcome import Result
        >>> row = Result("BUF-013", "MUST", "empty sample raises", Status.FAIL, "BUF-013: no error")
        >>> page = render_html({"mine": Report(run={"contract": "buffer"}, results=[row])})
        >>> "does not conform" in page, "<pre class='message'>BUF-013: no error</pre>" in page
        (True, True)
    """
    frameworks = {n: framework_of(n) for n in reports}
    return html_report.render(reports, frameworks, spec_base=spec_base)


def main(
    argv: list[str] | None = None, prog: str = "python -m posttrain.conformance.matrix"
) -> int:
    """Run the matrix, print it, write the files; exit 1 if any row is UNEXPECTED.

    A raw upstream component that fails exactly its declared ``known_failures`` is expected;
    anything else (a new failure, or a declared one that now passes) is not.

    Example:
        >>> main(["--out", "reports"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--out", type=Path, default=Path("reports"), help="folder for the three files")
    p.add_argument("--seed", type=int, default=0, help="seed of every suite's random data")
    p.add_argument("--contract", default=None, help="only the implementations of this contract")
    p.add_argument(
        "--impl",
        default=None,
        metavar="GLOB",
        help="only the implementations whose entry-point name matches this fnmatch glob",
    )
    args = p.parse_args(argv)
    try:
        select(args.contract, args.impl)
    except ValueError as e:
        p.error(str(e))
    reports = run_all(args.seed, contract=args.contract, impl_glob=args.impl)
    md = render_markdown(reports)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conformance.md").write_text(md)
    # The page links each requirement to specs/ beside the current directory (a checkout).
    spec_base = Path(os.path.relpath(Path.cwd(), args.out.resolve())).as_posix() + "/"
    (args.out / "conformance.html").write_text(render_html(reports, spec_base=spec_base))
    (args.out / "conformance.json").write_text(reports_json(list(reports.values())))
    sys.stdout.write(md)
    print(
        f"\nwrote {args.out / 'conformance.md'}, {args.out / 'conformance.html'}, {args.out / 'conformance.json'}"
    )
    status = exit_status(reports)
    if status:
        print("UNEXPECTED rows: see '## Unexpected' above", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
