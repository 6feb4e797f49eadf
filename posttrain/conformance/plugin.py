"""The pytest plugin: ``pytest --conformance=<contract> --conformance-impl=<target>``.

Registered through the ``pytest11`` entry point and inert unless ``--conformance`` or
``--conformance-list`` is given. With ``--conformance`` the run collects no test files: one
item per requirement of each named contract, in catalogue order (foundations first).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.errors import PosttrainError

# No __all__ (no public Python names): pytest finds the hooks below by name, and the
# interface is the command line above.


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the ``--conformance*`` options."""
    g = parser.getgroup("posttrain", "posttrain conformance kit")
    g.addoption(
        "--conformance",
        default=None,
        metavar="CONTRACT[,CONTRACT]",
        help="run the conformance suites of these contracts instead of collecting tests",
    )
    g.addoption(
        "--conformance-impl",
        action="append",
        default=[],
        metavar="TARGET",
        help="implementation to check: an entry-point name in group "
        "'posttrain.implementations' or module:attr (repeat for several contracts)",
    )
    g.addoption(
        "--conformance-report",
        default=None,
        metavar="PATH",
        help="write the JSON report to PATH and a Markdown table beside it",
    )
    g.addoption(
        "--conformance-seed", type=int, default=0, help="seed for the suites' data (default 0)"
    )
    g.addoption(
        "--conformance-depth",
        type=int,
        default=1,
        metavar="N",
        help="explore N times as many generated inputs and random call sequences per "
        "requirement (default 1; deterministic under --conformance-seed)",
    )
    g.addoption(
        "--conformance-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abandon a requirement's check after this long and report it as FAIL "
        "(default 120; 0 runs every check in pytest's own thread, unbounded)",
    )
    g.addoption(
        "--conformance-list",
        action="store_true",
        help="print the requirement catalogue (of --conformance contracts, or all) and exit",
    )


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--conformance-list``: print the catalogue and stop."""
    if not config.getoption("conformance_list"):
        return None
    from posttrain.contracts.registry import CONTRACTS, get_contract

    names = config.getoption("conformance")
    contracts = (
        [get_contract(n.strip()) for n in names.split(",")] if names else list(CONTRACTS.values())
    )
    for c in contracts:
        print(f"{c.id} v{c.version} — {c.title}")
        for r in c.requirements:
            when = (
                f" [capability {r.capability}]"
                if r.capability
                else f" [{r.option[0]}={r.option[1]}]"
                if r.option
                else ""
            )
            print(f"  {r.id} {r.level.value:<6} {r.title}{when}")
            print(f"      {r.text}")
    return 0


def pytest_configure(config: pytest.Config) -> None:
    """Activate the kit when ``--conformance`` is given."""
    config.addinivalue_line("markers", "conformance: a posttrain conformance requirement")
    if config.getoption("conformance") or config.getoption("conformance_impl"):
        config.pluginmanager.register(_Conformance(config), "posttrain-conformance")


class RequirementFailed(PosttrainError):
    """Raised by an item whose MUST requirement failed; carries the report row."""

    def __init__(self, message: str, repro: str) -> None:
        super().__init__(message)
        self.repro = repro


class RequirementItem(pytest.Item):
    """One requirement of one implementation's run."""

    def __init__(self, *, session_run: Any, requirement: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.session_run = session_run
        self.requirement = requirement
        self.add_marker(pytest.mark.conformance)

    def runtest(self) -> None:
        from posttrain.conformance.outcome import Status

        res = self.session_run.run_one(self.requirement)
        if res.status is Status.NOT_APPLICABLE:
            pytest.skip(f"{res.id} NOT_APPLICABLE: {res.message}")
        if res.status in (Status.FAIL, Status.ERROR):
            if res.level == "SHOULD":
                pytest.xfail(f"{res.message} (SHOULD)")
            raise RequirementFailed(f"{res.status.value} {res.message}", res.repro)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, RequirementFailed):
            return f"{excinfo.value}\n  repro: {excinfo.value.repro}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.requirement.id} {self.requirement.title}"


class SuiteCollector(pytest.Collector):
    """One implementation's suite."""

    def __init__(self, *, session_run: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.session_run = session_run

    def collect(self) -> list[pytest.Item]:
        return [
            RequirementItem.from_parent(
                self, name=r.id, session_run=self.session_run, requirement=r
            )
            for r in self.session_run.requirements()
        ]


class _Conformance:
    """The active kit: resolves targets, collects requirement items, writes reports."""

    def __init__(self, config: pytest.Config) -> None:
        from posttrain.conformance.runner import DEFAULT_TIMEOUT_S, Session
        from posttrain.conformance.target import TargetError, resolve
        from posttrain.contracts.contract import DeclarationError
        from posttrain.contracts.registry import get_contract

        self.config = config
        named: str | None = config.getoption("conformance")
        targets: list[str] = config.getoption("conformance_impl")
        if not targets:
            raise pytest.UsageError(
                "--conformance needs --conformance-impl=<entry point | module:attr>"
            )
        contracts: list[str] = []
        try:
            contracts = [get_contract(n.strip()).id for n in named.split(",")] if named else []
        except KeyError as e:
            raise pytest.UsageError(str(e.args[0])) from None
        seed = config.getoption("conformance_seed")
        depth = config.getoption("conformance_depth")
        if depth < 1:
            raise pytest.UsageError(f"--conformance-depth: expected an int >= 1, found {depth}")
        timeout = config.getoption("conformance_timeout")
        timeout_s = DEFAULT_TIMEOUT_S if timeout is None else (timeout or None)
        # Like `python -m`, a target module beside the invocation directory is importable.
        here = str(config.invocation_params.dir)
        if here not in sys.path:
            sys.path.insert(0, here)
        self.sessions: list[Session] = []
        for t in targets:
            try:
                # Without --conformance, a declaration says its contract (a plain factory
                # cannot: resolve() asks for --conformance then).
                impl = resolve(t, contracts[0] if len(contracts) == 1 else None)
            except (TargetError, DeclarationError) as e:
                raise pytest.UsageError(str(e)) from None
            if named and impl.contract not in contracts:
                raise pytest.UsageError(
                    f"target {t!r} implements {impl.contract!r}, which --conformance does not name"
                )
            try:
                self.sessions.append(
                    Session(impl, target=t, seed=seed, timeout_s=timeout_s, depth=depth)
                )
            except DeclarationError as e:
                raise pytest.UsageError(str(e)) from None
        contracts = contracts or [s.contract.id for s in self.sessions]
        seen = [s.contract.id for s in self.sessions]
        twice = sorted({c for c in seen if seen.count(c) > 1})
        if twice:
            raise pytest.UsageError(
                f"one --conformance-impl per contract and run; several for: {', '.join(twice)}"
            )
        missing = [c for c in contracts if c not in {s.contract.id for s in self.sessions}]
        if missing:
            raise pytest.UsageError(
                f"no --conformance-impl given for contract(s): {', '.join(missing)}"
            )

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        lines = []
        for s in self.sessions:
            caps = ", ".join(sorted(s.impl.capabilities)) or "none"
            opts = ", ".join(f"{k}={v}" for k, v in s.impl.resolved_options().items()) or "none"
            lines.append(
                f"posttrain conformance: {s.impl.name} ({s.target}) against {s.contract.id} "
                f"v{s.contract.version}; capabilities: {caps}; options: {opts}; seed {s.seed}"
            )
        return lines

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> bool:
        from _pytest.reports import CollectReport

        from posttrain.conformance.registry import suite_file

        hook = session.config.hook
        items: list[pytest.Item] = []
        for s in self.sessions:
            # Named by contract only: -k matches parent names too, and implementation names
            # may contain ids.
            col = SuiteCollector.from_parent(
                session,
                name=f"conformance-{s.contract.id}",
                session_run=s,
                path=suite_file(s.contract.id) or Path(str(session.config.rootpath)),
            )
            found: list[pytest.Item | pytest.Collector] = list(col.collect())
            hook.pytest_collectreport(report=CollectReport(col.nodeid, "passed", None, found))
            items.extend(i for i in found if isinstance(i, pytest.Item))
        session.items = items
        hook.pytest_collection_modifyitems(
            session=session, config=session.config, items=session.items
        )
        session.testscollected = len(session.items)
        hook.pytest_collection_finish(session=session)
        return True

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        for s in self.sessions:
            rep = s.report()
            tr.write_sep("=", f"conformance: {s.impl.name} — {s.contract.id} v{s.contract.version}")
            for r in rep.results:
                msg = r.message.splitlines()[0] if r.message else ""
                tr.write_line(
                    f"{r.id:<9} {r.level:<6} {r.status.value:<14} {r.title}"
                    + (f" — {msg}" if r.status.value != "PASS" else "")
                )
            counts = ", ".join(f"{v} {k}" for k, v in rep.counts().items())
            tr.write_line(f"{counts}; verdict: {rep.verdict()} (every MUST)")
        path = self.config.getoption("conformance_report")
        if path:
            written = self.write_reports(Path(path))
            tr.write_line("conformance report: " + ", ".join(str(p) for p in written))

    def write_reports(self, path: Path) -> list[Path]:
        """One JSON report (one shape for any number of implementations) and a Markdown twin."""
        from posttrain.conformance.outcome import reports_json

        reports = [s.report() for s in self.sessions]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(reports_json(reports))
        md = path.with_suffix(".md")
        md.write_text("\n".join(r.to_markdown() for r in reports))
        return [path, md]
