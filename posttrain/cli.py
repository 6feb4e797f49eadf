"""The ``posttrain`` command: check, report, list, specs, plot.

Each subcommand hands over to the module that does the work; the ``python -m`` entry points
of those modules keep working. Exit status 0 on success, 1 when what was checked does not
conform (or the report has UNEXPECTED rows), 2 on a usage error.

The command answers at once: ``--help``, ``list`` and the usage errors of ``check`` import
neither torch nor any framework (see :mod:`posttrain._listing`). Third-party INFO logs (TorchRL,
Ray, ...) are off unless ``-v`` is given; the processes the command starts inherit the setting
through the environment (``POSTTRAIN_QUIET=1``, ``RL_LOGGING_LEVEL=WARNING``).

Example:
    >>> main(["list"])  # doctest: +ELLIPSIS
    contracts:
      buffer v...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence

_PROG = "posttrain"
_VERBOSE = ("-v", "--verbose")
_PASS_THROUGH = ("report", "specs", "plot")

_QUIET_ENV = {"POSTTRAIN_QUIET": "1", "RL_LOGGING_LEVEL": "WARNING"}
"""Set (where unset) while a quiet command runs, so that its child processes are quiet too:
TorchRL reads ``RL_LOGGING_LEVEL`` when imported; a spawned child of this command imports this
module (multiprocessing re-imports the main module), which reads ``POSTTRAIN_QUIET`` below."""

if os.environ.get("POSTTRAIN_QUIET") == "1" and __name__ != "__main__":
    # A process this command started (a report's worker): quiet like its parent.
    logging.disable(logging.INFO)


@contextlib.contextmanager
def quiet_logs(verbose: bool) -> Iterator[None]:
    """Third-party INFO (and DEBUG) log records dropped while the block runs, unless ``verbose``.

    ``logging.disable`` holds for every logger, whatever level a library sets on its own when
    imported (Ray and TorchRL set INFO); warnings and errors still show. Everything is restored
    on exit.

    Example:
        >>> with quiet_logs(verbose=False):
        ...     logging.getLogger("ray").isEnabledFor(logging.INFO)
        False
    """
    saved_env = {k: os.environ.get(k) for k in _QUIET_ENV}
    saved_disable = logging.root.manager.disable
    if verbose:
        os.environ["POSTTRAIN_QUIET"] = "0"
    else:
        for k, v in _QUIET_ENV.items():
            os.environ.setdefault(k, v)
        logging.disable(max(saved_disable, logging.INFO))
    try:
        yield
    finally:
        logging.disable(saved_disable)
        for k, old in saved_env.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")


def plain(text: str) -> str:
    """reStructuredText inline markup turned into plain text, for ``--help``.

    Example:
        >>> plain("Run ``make specs`` (:func:`derived_timeout`); for example::")
        'Run make specs (derived_timeout); for example:'
    """
    text = _ROLE.sub(r"\1", text)
    text = text.replace("``", "")
    text = re.sub(r"`([^`\n]+)`_?", r"\1", text)
    text = re.sub(r"\s*::(?=\s|$)", ":", text)
    return text


def _refill(help_text: str) -> str:
    """``help_text`` with each prose paragraph (unindented, not the usage) wrapped again: the
    markup ``plain`` took out leaves argparse's line breaks ragged."""
    width = max(shutil.get_terminal_size().columns - 2, 40)
    blocks = help_text.split("\n\n")
    for i, block in enumerate(blocks):
        lines = block.splitlines()
        if (
            len(lines) > 1
            and not block.startswith("usage:")
            and not any(line[:1].isspace() or line.endswith(":") for line in lines)
        ):
            blocks[i] = textwrap.fill(" ".join(lines), width)
    return "\n\n".join(blocks)


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from posttrain import _listing
    from posttrain._listing import some_names

    contract, target = args.contract, args.impl
    ids = [c.id for c in _listing.contracts()]
    if contract not in ids:
        p.error(f"unknown contract {contract!r}; valid: {some_names(ids)}")
    if ":" not in target:
        eps = _listing.entry_points()
        names = sorted(n for n, ep in eps.items() if _listing.contract_of(ep) == contract)
        if target not in names:
            what = (
                f"{target!r} implements {_listing.contract_of(eps[target])!r}, not {contract!r}"
                if target in eps
                else f"unknown implementation {target!r}"
            )
            p.error(
                f"{what}; implementations of {contract!r}: {some_names(names)} (or module:attr)"
            )
    # Like `python -m` and the pytest plugin: a module in the current folder is importable.
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return _run_check(p, args)
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def _run_check(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # Only now the heavy part: torch, the suite, the implementation's own imports.
    import torch

    from posttrain.conformance.html_report import failure_kind, verdict_of
    from posttrain.conformance.outcome import Status
    from posttrain.conformance.runner import DEFAULT_TIMEOUT_S, Session
    from posttrain.conformance.target import TargetError, resolve
    from posttrain.contracts.contract import DeclarationError

    # The suites' tensors are tiny: one intra-op thread runs them fastest, and OpenMP's others
    # would spin against whatever else the machine runs (make report's workers do the same).
    torch.set_num_threads(1)

    target = args.impl
    try:
        impl = resolve(target, args.contract)
    except (TargetError, ValueError) as e:
        p.error(str(e))
    timeout_s = DEFAULT_TIMEOUT_S if args.timeout is None else (args.timeout or None)
    try:
        session = Session(impl, target=target, seed=args.seed, timeout_s=timeout_s)
    except DeclarationError as e:
        p.error(str(e))
    c = session.contract
    who = impl.name if impl.name == target else f"{impl.name} ({target})"
    print(f"{who} against {c.id} v{c.version}, seed {args.seed}", flush=True)
    known = set(impl.known_failures)
    for r in session:
        if r.status not in (Status.FAIL, Status.ERROR):
            continue
        tag = failure_kind(r) + (", declared" if r.id in known else "")
        print(f"  {r.id} {r.level} {r.status.value} ({tag}): {r.message}")
        if r.repro:
            print(f"      repro: {r.repro}")
        sys.stdout.flush()
    rep = session.report()
    for line in rep.surprises():
        print(f"  UNEXPECTED: {line}")
    counts = ", ".join(f"{v} {k}" for k, v in rep.counts().items())
    verdict = verdict_of(rep)
    print(f"{counts}; verdict: {verdict}")
    # A SHOULD never fails a run: the verdict says it failed, the exit status stays 0.
    return (
        0
        if verdict in ("conforms", "conforms with declared deviations", "conforms, SHOULD failing")
        else 1
    )


def _report(argv: list[str]) -> int:
    from posttrain._commands import report_parser

    # --help and usage errors before the suites (and torch) are imported.
    report_parser(f"{_PROG} report").parse_args(argv)
    from posttrain.conformance import matrix

    return matrix.main(argv, prog=f"{_PROG} report")


def _list() -> int:
    from posttrain import _listing

    print("contracts:")
    for c in _listing.contracts():
        print(f"  {c.id} v{c.version} — {c.title}")
    rows = _listing.implementation_rows()
    width = max((len(r.name) for r in rows), default=0)
    print("implementations (entry point, contract, framework):")
    for r in rows:
        print(f"  {r.name:<{width}}  {r.contract:<11}  {r.framework}")
    return 0


def _specs(argv: list[str]) -> int:
    from posttrain._commands import specs_parser

    specs_parser(f"{_PROG} specs").parse_args(argv)
    from posttrain import specgen

    return specgen.main(argv, prog=f"{_PROG} specs")


def _plot(argv: list[str]) -> int:
    from posttrain._commands import plot_parser

    plot_parser(f"{_PROG} plot").parse_args(argv)
    from posttrain.observability import plot

    return plot.main(argv, prog=f"{_PROG} plot")


_HANDLERS: dict[str, Callable[[list[str]], int]] = {
    "report": _report,
    "specs": _specs,
    "plot": _plot,
}

_VERBOSE_HELP = "show third-party INFO logs (TorchRL, Ray, ...); off by default"


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="posttrain: versioned contracts for LLM RL post-training and the kit that "
        "checks implementations against them.",
        epilog=f"'{_PROG} COMMAND --help' describes each command.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    c = sub.add_parser(
        "check",
        help="run one contract's suite on one implementation; exit 0 if it conforms",
        description="Run CONTRACT's conformance suite on IMPL (an entry-point name in group "
        "'posttrain.implementations', or module:attr) and print each failure as it happens, "
        "then the verdict. A module:attr is imported as 'python -m' would: a module in the "
        "current folder is found. Exit 0 if it conforms, 1 if not, 2 on a usage error.",
    )
    c.add_argument("contract", help="contract id, e.g. buffer ('posttrain list' shows them)")
    c.add_argument("impl", help="implementation: entry-point name or module:attr")
    c.add_argument("--seed", type=int, default=0, help="seed of the suite's data (default 0)")
    c.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds one requirement's check may run before it is FAIL 'no answer' "
        "(default 120; 0: no limit)",
    )
    c.add_argument("-v", "--verbose", dest="sub_verbose", action="store_true", help=_VERBOSE_HELP)
    # These three own their options: everything after the command name passes through.
    for name, text in (
        ("report", "run the conformance matrix and write Markdown, HTML and JSON reports"),
        ("specs", "write specs/ from the contracts (--check: exit 1 on drift)"),
        ("plot", "draw the runs under directories as one dashboard PNG (overlaid, smoothed)"),
    ):
        sub.add_parser(name, help=text, add_help=False)
    ls = sub.add_parser(
        "list",
        help="list contracts with versions and registered implementations",
        description="List the contracts (id, version, title) and the implementations "
        "registered in entry-point group 'posttrain.implementations' (name, contract, "
        "framework). Loads no implementation that posttrain's own index already describes.",
    )
    ls.add_argument("-v", "--verbose", dest="sub_verbose", action="store_true", help=_VERBOSE_HELP)
    return p, c


def _pass_through(command: str, rest: list[str], verbose: bool) -> int:
    verbose = verbose or any(a in _VERBOSE for a in rest)
    rest = [a for a in rest if a not in _VERBOSE]
    handler = _HANDLERS[command]
    if "-h" not in rest and "--help" not in rest:
        with quiet_logs(verbose):
            return handler(rest)
    # The module's own parser prints its help (its docstring: reStructuredText); shown plain.
    out = io.StringIO()
    code: int | str | None = 0
    with quiet_logs(verbose), contextlib.redirect_stdout(out):
        try:
            code = handler(rest)
        except SystemExit as e:
            code = e.code
    text = _refill(plain(out.getvalue())).rstrip("\n")
    print(f"{text}\n\n{_PROG} options:\n  -v, --verbose  {_VERBOSE_HELP}")
    return code if isinstance(code, int) else 0 if code is None else 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``posttrain`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Example:
        >>> main(["check", "weight_sync", "reference-weight-sync"])  # doctest: +ELLIPSIS
        posttrain.in_process_weight_sync (reference-weight-sync) against weight_sync v...
        0
    """
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader left (| head): no traceback, and none at exit for the unflushed rest.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(args_in: list[str]) -> int:
    verbose = False
    while args_in and args_in[0] in _VERBOSE:
        verbose = True
        args_in.pop(0)
    # report/specs/plot: the module's own parser reads the rest (and prints its own --help).
    if args_in and args_in[0] in _PASS_THROUGH:
        return _pass_through(args_in[0], args_in[1:], verbose)
    p, check_parser = _parser()
    args = p.parse_args(args_in)
    with quiet_logs(verbose or args.verbose or args.sub_verbose):
        if args.command == "check":
            return _check(check_parser, args)
        return _list()


if __name__ == "__main__":
    raise SystemExit(main())
