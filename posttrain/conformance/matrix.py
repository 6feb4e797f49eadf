"""The conformance matrix of every registered implementation (``make report``).

``posttrain report --out reports`` (or ``python -m posttrain.conformance.matrix --out reports``)
runs each entry point of group ``posttrain.implementations`` through its contract's suite and
writes ``conformance.md``, ``conformance.html`` and ``conformance.json``.

Rows are independent, so they run in ``--jobs`` worker processes (default: one per core) and
are merged in name order. ``--rows in-process`` (``make report``) takes every row whose suite
stays in its own process; ``--rows distributed`` (``make report-distributed``) takes the rows
that start Ray or torch.distributed (:func:`is_distributed`). Those run one at a time, each in
a fresh process, with a per-check timeout derived from the measured start-up cost of such a
process (:func:`derived_timeout`), and a row whose failures differ from its declaration is run
once more: the report shows both attempts.
"""

from __future__ import annotations

import concurrent.futures as cf
import fnmatch
import multiprocessing
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from posttrain._commands import ROW_KINDS as ROW_KINDS
from posttrain._commands import default_jobs as default_jobs
from posttrain._commands import report_parser
from posttrain._listing import some_names as some_names
from posttrain.conformance import html_report
from posttrain.conformance._spawn import PER_STARTUP
from posttrain.conformance.outcome import Report, Result, md_cell, reports_json, retry_note
from posttrain.conformance.runner import DEFAULT_TIMEOUT_S, run
from posttrain.conformance.target import ENTRY_POINT_GROUP, TargetError, discover
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.registry import CONTRACTS

# The capability, per contract, whose checks start Ray or a torch.distributed group: a
# remote_writers buffer is written by Ray tasks; a cross_process weight sync joins a process group.
_DISTRIBUTED = {"buffer": "remote_writers", "weight_sync": "cross_process"}

MAX_ATTEMPTS = 2
"""A distributed row runs at most this many times: once more when its failures differ from its
declared ``known_failures`` (a process group or a Ray actor that did not come up in time)."""

TIMEOUT_PER_STARTUP = PER_STARTUP
"""A distributed row's per-check timeout is this many start-ups of a fresh worker process
(spawn, import, load the entry point), and never less than ``runner.DEFAULT_TIMEOUT_S``."""


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


def is_distributed(impl: Implementation) -> bool:
    """True when ``impl``'s suite starts Ray or a torch.distributed process group.

    That is a buffer with ``remote_writers`` (Ray tasks write into it) or a weight sync with
    ``cross_process`` (sender and receiver in two processes of one group).

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> is_distributed(RING_BUFFER)
        False
    """
    cap = _DISTRIBUTED.get(impl.contract)
    return cap is not None and cap in impl.capabilities


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


def select(
    contract: str | None = None, impl_glob: str | None = None, rows: str = "all"
) -> dict[str, Implementation]:
    """The registered implementations of ``contract`` whose names match the ``fnmatch`` glob.

    ``rows`` (one of :data:`ROW_KINDS`) keeps the in-process or the distributed rows only.
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
    if rows not in ROW_KINDS:
        raise ValueError(f"rows: expected one of {', '.join(ROW_KINDS)}, found {rows!r}")
    impls = {
        n: impl
        for n, impl in implementations().items()
        if (contract is None or impl.contract == contract)
        and (rows == "all" or is_distributed(impl) == (rows == "distributed"))
    }
    chosen = {n: i for n, i in impls.items() if impl_glob is None or fnmatch.fnmatch(n, impl_glob)}
    if not chosen:
        where = f" of contract {contract!r}" if contract else ""
        kind = "" if rows == "all" else f" {rows}"
        raise TargetError(
            f"no{kind} implementation{where} matches {impl_glob!r} (entry points of group "
            f"{ENTRY_POINT_GROUP!r}); valid: {some_names(sorted(impls))}"
        )
    return chosen


def _run_one(name: str, impl: Implementation, seed: int, timeout_s: float | None) -> Report:
    start = time.perf_counter()
    rep = run(impl, target=name, seed=seed, timeout_s=timeout_s)
    rep.run["duration_s"] = round(time.perf_counter() - start, 2)
    return rep


def _init_worker(threads: int) -> None:
    # Two workers on two cores: torch's own intra-op threads would only fight each other.
    import torch

    torch.set_num_threads(threads)


def _worker_row(name: str, seed: int, timeout_s: float | None) -> Report:
    """A row in a worker process: loaded there by entry-point name (nothing big is pickled)."""
    return _run_one(name, implementations_by_name([name])[name], seed, timeout_s)


def _worker_startup(name: str) -> None:
    """What a fresh worker does before its row's suite: load the entry point (and its imports)."""
    implementations_by_name([name])


def implementations_by_name(names: list[str]) -> dict[str, Implementation]:
    """The registered implementations of ``names`` (loads only those entry points).

    Example:
        >>> implementations_by_name(["reference-buffer"])["reference-buffer"].contract
        'buffer'
    """
    eps = discover()
    missing = [n for n in names if n not in eps]
    if missing:
        raise TargetError(
            f"no entry point {some_names(missing)} in group {ENTRY_POINT_GROUP!r}; "
            f"valid: {some_names(sorted(eps))}"
        )
    out: dict[str, Implementation] = {}
    for n in names:
        obj = eps[n].load()
        if not isinstance(obj, Implementation):
            raise TypeError(f"entry point {n!r} ({eps[n].value}) is not a posttrain Implementation")
        out[n] = obj
    return out


def _pool(jobs: int, *, fresh: bool = False) -> cf.ProcessPoolExecutor:
    # spawn, not fork: the parent has imported torch (and its thread pools); a forked child of
    # that can hang. fresh: one row per process, so no Ray or process group outlives its row.
    return cf.ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(max(1, default_jobs() // jobs),),
        max_tasks_per_child=1 if fresh else None,
    )


# Seconds a row of each contract takes on 2 cores, roughly (benchmarks/results/suite-times-*):
# the order of a first run, before a previous report's figures exist.
_CONTRACT_COST = {"metrics": 5.0, "generation": 5.0, "weight_sync": 4.0, "buffer": 1.3}


def _longest_first(impls: dict[str, Implementation], hints: dict[str, float]) -> list[str]:
    # Longest rows first keeps one worker from finishing a long row alone at the end.
    def cost(n: str) -> float:
        return hints.get(n, _CONTRACT_COST.get(impls[n].contract, 0.5))

    return sorted(impls, key=lambda n: -cost(n))


def previous_durations(folder: Path) -> dict[str, float]:
    """Each row's ``duration_s`` in ``folder/conformance.json`` from a previous run, if any.

    Example:
        >>> previous_durations(Path("/nonexistent"))
        {}
    """
    import json

    try:
        data = json.loads((folder / "conformance.json").read_text())
        return {
            str(r["run"]["target"]): float(r["run"]["duration_s"])
            for r in data["reports"]
            if "target" in r["run"] and "duration_s" in r["run"]
        }
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def derived_timeout(startup_s: float) -> float:
    """The per-check timeout of a distributed row whose worker took ``startup_s`` to start.

    Example:
        >>> derived_timeout(2.0), derived_timeout(9.0)
        (120.0, 180.0)
    """
    return round(max(DEFAULT_TIMEOUT_S, TIMEOUT_PER_STARTUP * startup_s), 1)


def _attempt_line(rep: Report) -> dict[str, Any]:
    return {
        "verdict": rep.verdict(),
        "surprises": rep.surprises(),
        "duration_s": rep.run.get("duration_s"),
    }


def run_with_retry(attempt: Callable[[], Report], max_attempts: int = MAX_ATTEMPTS) -> Report:
    """``attempt()``, again while its failures differ from the declaration, at most ``max_attempts``
    times; the last report, whose ``run["attempts"]`` lists every attempt when there were several.

    Example:
        >>> outcomes = iter([["BUF-001"], []])
        >>> rep = run_with_retry(lambda: Report(run={"known_failures": next(outcomes)}))
        >>> [a["verdict"] for a in rep.run["attempts"]]
        ['unexpected', 'conforms']
    """
    attempts: list[Report] = []
    while len(attempts) < max_attempts:
        attempts.append(attempt())
        if not attempts[-1].surprises():
            break
    rep = attempts[-1]
    if len(attempts) > 1:
        rep.run["attempts"] = [_attempt_line(a) for a in attempts]
    return rep


def _in_fresh_process(name: str, seed: int, timeout_s: float) -> Report:
    # One row at a time, each in a process of its own: a row's cluster or group is gone
    # before the next starts, and nothing else competes for the cores.
    with _pool(1, fresh=True) as pool:
        return pool.submit(_worker_row, name, seed, timeout_s).result()


def _run_distributed(selected: dict[str, Implementation], seed: int) -> dict[str, Report]:
    # The start-up cost this machine has now (spawn, imports, entry point): measured once, in a
    # fresh process like the ones the rows get.
    start = time.perf_counter()
    with _pool(1, fresh=True) as pool:
        pool.submit(_worker_startup, next(iter(selected))).result()
    startup_s = time.perf_counter() - start
    timeout_s = derived_timeout(startup_s)
    out: dict[str, Report] = {}
    for name in selected:
        rep = run_with_retry(partial(_in_fresh_process, name, seed, timeout_s))
        rep.run["startup_s"] = round(startup_s, 2)
        rep.run["timeout_s"] = timeout_s
        out[name] = rep
    return out


def run_all(
    seed: int = 0,
    *,
    contract: str | None = None,
    impl_glob: str | None = None,
    rows: str = "all",
    jobs: int = 1,
    hints: dict[str, float] | None = None,
) -> dict[str, Report]:
    """Run the implementations :func:`select` picks; reports by name, in name order.

    ``jobs`` > 1 runs the in-process rows in that many worker processes (spawned; each row is
    loaded there by its entry-point name), longest first by ``hints`` (seconds by name). The
    distributed rows always run one at a time in fresh processes (see the module doc).

    Example:
        >>> reports = run_all(seed=0, contract="buffer", impl_glob="reference*")
        >>> list(reports), exit_status(reports)
        (['reference-buffer'], 0)
    """
    chosen = select(contract, impl_glob, rows)
    local = {n: i for n, i in chosen.items() if not is_distributed(i)}
    remote = {n: i for n, i in chosen.items() if is_distributed(i)}
    out: dict[str, Report] = {}
    jobs = max(1, min(jobs, len(local)))
    if jobs == 1:
        for name, impl in local.items():
            out[name] = _run_one(name, impl, seed, None)
    else:
        with _pool(jobs) as pool:
            futures = {
                n: pool.submit(_worker_row, n, seed, None)
                for n in _longest_first(local, hints or {})
            }
            out.update({n: f.result() for n, f in futures.items()})
    if remote:
        out.update(_run_distributed(remote, seed))
    return {n: out[n] for n in sorted(out)}


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


def render_markdown(reports: dict[str, Report], *, left_out: list[str] | None = None) -> str:
    """The matrix as Markdown: a summary table, then one table of requirements per contract.

    Verdicts and cells read as the HTML page's (:func:`html_report.verdict_of`,
    :func:`html_report.cell_label`): a blocked check is ``blocked``. ``left_out`` names the
    rows another command runs (said under the title).

    Example:
        >>> from posttrain.conformance.outcome import Result, Status
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
    for name, rep in reports.items():
        c = rep.counts()
        note = retry_note(rep)
        verdict = html_report.verdict_of(rep) + (f"; {md_cell(note)}" if note else "")
        lines.append(
            f"| {md_cell(name)} | {md_cell(rep.run.get('contract'))} v{md_cell(rep.run.get('contract_version', '?'))} | {c['PASS']} | {c['FAIL']} "
            f"| {c['ERROR']} | {c['NOT_APPLICABLE']} | {verdict} | {rep.run.get('duration_s', '')} |"
        )
    if left_out:
        lines[1:1] = ["", html_report.left_out_sentence(left_out)]
    for contract, names in _by_contract(reports).items():
        lines += [
            "",
            f"## {md_cell(contract)}",
            "",
            "| requirement | " + " | ".join(md_cell(n) for n in names) + " |",
            "|---|" + "---|" * len(names),
        ]
        by_id = {n: {r.id: r for r in reports[n].results} for n in names}
        heads: dict[str, Result] = {}
        for n in names:
            for r in reports[n].results:
                heads.setdefault(r.id, r)
        for rid in heads:
            cells = [
                html_report.cell_label(by_id[n][rid]) if rid in by_id[n] else "" for n in names
            ]
            lines.append(
                f"| {md_cell(rid)} {md_cell(heads[rid].title)} | " + " | ".join(cells) + " |"
            )
    failures = [
        (n, r)
        for n, rep in reports.items()
        for r in rep.results
        if html_report.failure_kind(r) in ("must", "should", "error")
    ]
    surprises = [(n, line) for n, rep in reports.items() for line in rep.surprises()]
    if surprises:
        lines += ["", "## Unexpected (failures that differ from the declared known failures)", ""]
        lines += [f"- **{md_cell(n)}** {md_cell(line)}" for n, line in surprises]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- **{md_cell(n)}** {md_cell(r.message.splitlines()[0])}" for n, r in failures]
    return "\n".join(lines) + "\n"


def render_html(reports: dict[str, Report], *, left_out: list[str] | None = None) -> str:
    """The matrix as one self-contained HTML page (see :mod:`posttrain.conformance.html_report`).

    Frameworks come from :func:`framework_of`. Each requirement's text is on the page itself
    (from the contract objects), so every link resolves wherever the file is opened.

    Example:
        >>> from posttrain.conformance.outcome import Result, Status
        >>> row = Result("BUF-013", "MUST", "empty sample raises", Status.FAIL, "BUF-013: no error")
        >>> page = render_html({"mine": Report(run={"contract": "buffer"}, results=[row])})
        >>> "does not conform" in page, "<pre class='message'>BUF-013: no error</pre>" in page
        (True, True)
    """
    frameworks = {n: framework_of(n) for n in reports}
    return html_report.render(reports, frameworks, left_out=left_out)


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
    p = report_parser(prog)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs: expected a positive number of worker processes, found {args.jobs}")
    try:
        select(args.contract, args.impl, args.rows)
    except ValueError as e:
        p.error(str(e))
    left_out = (
        sorted(
            set(select(args.contract, None, "all")) - set(select(args.contract, None, args.rows))
        )
        if args.rows == "in-process" and args.impl is None
        else []
    )
    hints = previous_durations(args.out)
    start = time.perf_counter()
    reports = run_all(
        args.seed,
        contract=args.contract,
        impl_glob=args.impl,
        rows=args.rows,
        jobs=args.jobs,
        hints=hints,
    )
    wall_s = time.perf_counter() - start
    md = render_markdown(reports, left_out=left_out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conformance.md").write_text(md)
    (args.out / "conformance.html").write_text(render_html(reports, left_out=left_out))
    (args.out / "conformance.json").write_text(reports_json(list(reports.values())))
    sys.stdout.write(md)
    local = sum(not is_distributed(i) for i in select(args.contract, args.impl, args.rows).values())
    how = f"{args.jobs} worker processes" if local else "each in a fresh process"
    print(
        f"\n{len(reports)} row{'' if len(reports) == 1 else 's'} in {wall_s:.0f} s ({how}); wrote "
        f"{args.out / 'conformance.md'}, {args.out / 'conformance.html'}, {args.out / 'conformance.json'}"
    )
    status = exit_status(reports)
    if status:
        print("UNEXPECTED rows: see '## Unexpected' above", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
