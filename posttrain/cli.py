"""The ``posttrain`` command: check, report, list, specs, plot.

Each subcommand hands over to the module that does the work; the ``python -m`` entry points
of those modules keep working. Exit status 0 on success, 1 when what was checked does not
conform (or the report has UNEXPECTED rows), 2 on a usage error.

Example:
    >>> main(["list"])  # doctest: +ELLIPSIS
    contracts:
      buffer v...
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

_PROG = "posttrain"


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from posttrain.conformance.api import check
    from posttrain.conformance.html_report import failure_kind, verdict_of
    from posttrain.conformance.matrix import implementations, some_names
    from posttrain.conformance.outcome import Status
    from posttrain.conformance.target import TargetError, resolve
    from posttrain.contracts.registry import CONTRACTS

    contract, target = args.contract, args.impl
    if contract not in CONTRACTS:
        p.error(f"unknown contract {contract!r}; valid: {some_names(list(CONTRACTS))}")
    if ":" not in target:
        every = implementations()
        names = sorted(n for n, i in every.items() if i.contract == contract)
        if target not in names:
            what = (
                f"{target!r} implements {every[target].contract!r}, not {contract!r}"
                if target in every
                else f"unknown implementation {target!r}"
            )
            p.error(
                f"{what}; implementations of {contract!r}: {some_names(names)} (or module:attr)"
            )
    try:
        impl = resolve(target, contract)
    except (TargetError, ValueError) as e:
        p.error(str(e))
    rep = check(contract, target, seed=args.seed)
    run = rep.run
    print(
        f"{impl.name} ({target}) against {run['contract']} v{run['contract_version']}, "
        f"seed {args.seed}"
    )
    known = set(run.get("known_failures", []))
    for r in rep.results:
        if r.status not in (Status.FAIL, Status.ERROR):
            continue
        tag = failure_kind(r) + (", declared" if r.id in known else "")
        print(f"  {r.id} {r.level} {r.status.value} ({tag}): {r.message}")
        if r.repro:
            print(f"      repro: {r.repro}")
    for line in rep.surprises():
        print(f"  UNEXPECTED: {line}")
    counts = ", ".join(f"{v} {k}" for k, v in rep.counts().items())
    verdict = verdict_of(rep)
    print(f"{counts}; verdict: {verdict}")
    return 0 if verdict in ("conforms", "conforms with declared deviations") else 1


def _report(argv: list[str]) -> int:
    from posttrain.conformance import matrix

    return matrix.main(argv, prog=f"{_PROG} report")


def _list() -> int:
    from posttrain.conformance.matrix import framework_of, implementations
    from posttrain.contracts.registry import CONTRACTS

    print("contracts:")
    for c in CONTRACTS.values():
        print(f"  {c.id} v{c.version} — {c.title}")
    impls = implementations()
    width = max((len(n) for n in impls), default=0)
    print("implementations (entry point, contract, framework):")
    for name, impl in impls.items():
        print(f"  {name:<{width}}  {impl.contract:<11}  {framework_of(name)}")
    return 0


def _specs(argv: list[str]) -> int:
    from posttrain import specgen

    return specgen.main(argv, prog="posttrain specs")


def _plot(argv: list[str]) -> int:
    from posttrain.observability import plot

    return plot.main(argv, prog="posttrain plot")


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="posttrain: versioned contracts for LLM RL post-training and the kit that "
        "checks implementations against them.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    c = sub.add_parser(
        "check",
        help="run one contract's suite on one implementation; exit 0 if it conforms",
        description="Run CONTRACT's conformance suite on IMPL (an entry-point name in group "
        "'posttrain.implementations', or module:attr) and print the verdict and failures. "
        "Exit 0 if it conforms, 1 if not, 2 on a usage error.",
    )
    c.add_argument("contract", help="contract id, e.g. buffer")
    c.add_argument("impl", help="implementation: entry-point name or module:attr")
    c.add_argument("--seed", type=int, default=0, help="seed of the suite's data (default 0)")
    # These three own their options: everything after the command name passes through.
    for name, text in (
        ("report", "run the conformance matrix and write Markdown, HTML and JSON reports"),
        ("specs", "write specs/ from the contracts (--check: exit 1 on drift)"),
        ("plot", "draw the runs under directories as one dashboard PNG (overlaid, smoothed)"),
    ):
        sub.add_parser(name, help=text, add_help=False)
    sub.add_parser("list", help="list contracts with versions and registered implementations")
    return p, c


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``posttrain`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Example:
        >>> main(["check", "buffer", "reference-buffer"])  # doctest: +ELLIPSIS
        posttrain.RingBuffer (reference-buffer) against buffer v...
        0
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    p, check_parser = _parser()
    # report/specs/plot: the module's own parser reads the rest (and prints its own --help).
    if args_in and args_in[0] in ("report", "specs", "plot"):
        rest = args_in[1:]
        if args_in[0] == "report":
            return _report(rest)
        return _specs(rest) if args_in[0] == "specs" else _plot(rest)
    args = p.parse_args(args_in)
    if args.command == "check":
        return _check(check_parser, args)
    return _list()


if __name__ == "__main__":
    raise SystemExit(main())
