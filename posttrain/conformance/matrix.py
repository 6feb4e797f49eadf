"""The conformance matrix of every registered implementation (``make report``).

``python -m posttrain.conformance.matrix --out reports`` runs each entry point of group
``posttrain.implementations`` through its contract's suite and writes ``conformance.md``,
``conformance.html`` and ``conformance.json``.
"""

from __future__ import annotations

import argparse
import html
import sys
import time
from pathlib import Path

from posttrain.conformance.outcome import Report, Status, md_cell, reports_json
from posttrain.conformance.runner import run
from posttrain.conformance.target import discover
from posttrain.contracts.implementation import Implementation

__all__ = ["main", "render_html", "render_markdown", "run_all"]

_MARK = {
    Status.PASS: "PASS",
    Status.FAIL: "FAIL",
    Status.ERROR: "ERROR",
    Status.NOT_APPLICABLE: "n/a",
}


def run_all(seed: int = 0) -> dict[str, Report]:
    """Run every registered implementation; reports by entry-point name.

    Every entry point in group ``posttrain.implementations`` runs its contract's whole suite
    (twenty minutes on two cores for the bundled ones: Ray and process groups included).

    Example:
        >>> reports = run_all(seed=0)  # doctest: +SKIP
        >>> exit_status(reports)  # doctest: +SKIP
        0
    """
    out: dict[str, Report] = {}
    for name, ep in sorted(discover().items()):
        obj = ep.load()
        if not isinstance(obj, Implementation):
            raise TypeError(f"entry point {name!r} ({ep.value}) is not a posttrain Implementation")
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


def render_html(reports: dict[str, Report]) -> str:
    """The matrix as a standalone HTML page (one table per contract, coloured cells).

    Example:
        >>> from posttrain.conformance.outcome import Result
        >>> row = Result("BUF-013", "MUST", "empty sample raises", Status.FAIL, "BUF-013: no error")
        >>> page = render_html({"mine": Report(run={"contract": "buffer"}, results=[row])})
        >>> "<h2>buffer</h2>" in page, "title='BUF-013: no error'>FAIL</td>" in page
        (True, True)
    """
    colour = {
        Status.PASS: "#c8f7c5",
        Status.FAIL: "#f7c5c5",
        Status.ERROR: "#f7dcc5",
        Status.NOT_APPLICABLE: "#eeeeee",
    }
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>posttrain conformance matrix</title>",
        "<style>body{font-family:sans-serif}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #999;padding:3px 8px;text-align:left}</style></head><body>",
        "<h1>posttrain conformance matrix</h1>",
    ]
    for contract, names in _by_contract(reports).items():
        parts.append(f"<h2>{html.escape(contract)}</h2><table><tr><th>requirement</th>")
        parts += [f"<th>{html.escape(n)}</th>" for n in names]
        parts.append("</tr>")
        first = reports[names[0]].results
        for i, head in enumerate(first):
            parts.append(f"<tr><td>{html.escape(head.id)} {html.escape(head.title)}</td>")
            for n in names:
                r = reports[n].results[i]
                tip = html.escape(r.message, quote=True)
                parts.append(
                    f"<td style='background:{colour[r.status]}' title='{tip}'>{_MARK[r.status]}</td>"
                )
            parts.append("</tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the matrix, print it, write the files; exit 1 if any row is UNEXPECTED.

    A raw upstream component that fails exactly its declared ``known_failures`` is expected;
    anything else (a new failure, or a declared one that now passes) is not.

    Example:
        >>> main(["--out", "reports"])  # doctest: +SKIP
        0
    """
    p = argparse.ArgumentParser(prog="python -m posttrain.conformance.matrix", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("reports"), help="folder for the three files")
    p.add_argument("--seed", type=int, default=0, help="seed of every suite's random data")
    args = p.parse_args(argv)
    reports = run_all(args.seed)
    md = render_markdown(reports)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conformance.md").write_text(md)
    (args.out / "conformance.html").write_text(render_html(reports))
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
