"""Run a contract's suite against one implementation, requirement by requirement."""

from __future__ import annotations

import datetime
import platform
import random
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.outcome import Report, Result, Status
from posttrain.conformance.registry import checks_for
from posttrain.contracts.contract import Contract, DeclarationError
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.registry import get_contract
from posttrain.contracts.requirements import Requirement

DEFAULT_TIMEOUT_S = 120.0
"""How long the pytest plugin and ``check()`` let one requirement's check run before it is
FAIL "no answer in N s"."""

# A message is one reading, not a log: a long list in it is cut here at the latest.
_MAX_MESSAGE = 1200
_KIT_DIR = Path(__file__).resolve().parent


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def run_info(impl: Implementation, target: str, seed: int) -> dict[str, Any]:
    """Who was checked, against what, on which software: the report header."""
    c = get_contract(impl.contract)
    versions = {
        d: _version(d)
        for d in ("posttrain", "torch", "tensordict", "torchrl", "transformers", "trl")
    }
    return {
        "implementation": impl.name,
        "target": target,
        "contract": c.id,
        "contract_version": c.version,
        "capabilities": sorted(impl.capabilities),
        "unavailable": dict(impl.unavailable),
        "known_failures": sorted(impl.known_failures),
        "options": impl.resolved_options(),
        "seed": seed,
        "versions": {k: v for k, v in versions.items() if v is not None},
        "python": platform.python_version(),
        "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class Session:
    """One implementation's run: decides applicability and blocking, runs checks in order.

    Foundational requirements come first in the catalogue; a requirement whose foundation did
    not pass is reported as FAIL "blocked by ..." without running its check.

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> s = Session(RING_BUFFER, target="posttrain.reference_impls:RING_BUFFER", seed=0)
        >>> s.run_one(s.contract.requirement("BUF-013")).status.value
        'PASS'
    """

    def __init__(
        self,
        impl: Implementation,
        *,
        target: str = "",
        seed: int = 0,
        timeout_s: float | None = None,
        depth: int = 1,
    ) -> None:
        self.impl = impl
        found = target or target_of(impl)
        self.target = found or impl.name
        self.target_resolvable = bool(found)
        self.seed = seed
        self.depth = depth
        self.timeout_s = timeout_s
        self.contract: Contract = get_contract(impl.contract)
        self.checks = checks_for(impl.contract)
        self.applicable = {r.id for r in self.contract.applicable(impl.capabilities, impl.options)}
        self.results: dict[str, Result] = {}
        self._check_methods()

    def _check_methods(self) -> None:
        """A declared capability's methods exist: a false claim is a declaration error now,
        not an AttributeError in the middle of the suite."""
        wanted = {
            c.name: c.methods
            for c in self.contract.capabilities
            if c.methods and c.name in self.impl.capabilities
        }
        probe = _PROBES.get(self.contract.id)
        if not wanted or probe is None:
            return
        obj = probe(Context(self.impl, seed=self.seed))
        problems = [
            f"capability {cap!r} declared, but {type(obj).__name__} has no {m}()"
            for cap, methods in sorted(wanted.items())
            for m in methods
            if not callable(getattr(obj, m, None))
        ]
        if problems:
            raise DeclarationError(
                "\n".join(f"{self.impl.name} ({self.contract.id}): {p}" for p in problems)
            )

    def requirements(self) -> list[Requirement]:
        """The catalogue, in run order."""
        return list(self.contract.requirements)

    def repro(self, req: Requirement) -> str:
        """A command that reruns just this requirement (same seed, so the same data)."""
        if self.target_resolvable:
            return (
                f"pytest -p no:cacheprovider --conformance={self.contract.id} "
                f"--conformance-impl={self.target} --conformance-seed={self.seed} "
                + (f"--conformance-depth={self.depth} " if self.depth != 1 else "")
                + f"-k {req.id}"
            )
        return (
            f"no command: no module attribute holds this Implementation ({self.impl.name}); "
            "bind it to a module-level name and pass 'module:name' to get one"
        )

    def _na_reason(self, req: Requirement) -> str | None:
        if req.id in self.applicable:
            return None
        if req.capability is not None:
            why = self.impl.unavailable.get(req.capability)
            if why:
                return f"capability '{req.capability}' unavailable here: {why}"
            return f"capability '{req.capability}' not declared"
        assert req.option is not None
        return f"applies to {req.option[0]}={req.option[1]} only"

    def spec_anchor(self, req: Requirement) -> str:
        """Where the requirement's sentence is: ``specs/<contract>-v<major>.md#<id>``."""
        return f"specs/{self.contract.id}-v{self.contract.major}.md#{req.id}"

    def run_one(self, req: Requirement) -> Result:
        """Run (or skip, or block) one requirement and remember its result."""
        res = Result(
            req.id,
            req.level.value,
            req.title,
            Status.PASS,
            repro=self.repro(req),
            spec=self.spec_anchor(req),
        )
        na = self._na_reason(req)
        blocked = [
            d
            for d in req.depends_on
            if d in self.results and self.results[d].status in (Status.FAIL, Status.ERROR)
        ]
        check = self.checks.get(req.id)
        start = time.perf_counter()
        if na is not None:
            res.status, res.message = Status.NOT_APPLICABLE, na
        elif blocked:
            res.status, res.message = Status.FAIL, f"{req.id}: blocked by {', '.join(blocked)}"
        elif check is None:
            res.status, res.message = Status.ERROR, f"{req.id}: the suite has no check for it"
        else:
            res.status, res.message = self._call(req, check)
        res.message = clean_message(res.message)
        if res.status in (Status.FAIL, Status.ERROR):
            res.message = _shorten(res.message) + f" (see {res.spec})"
        res.duration_s = round(time.perf_counter() - start, 4)
        self.results[req.id] = res
        return res

    def _call(self, req: Requirement, check: Any) -> tuple[Status, str]:
        # Every check starts from the same global RNG state, so a rerun of one requirement
        # (pytest -k) draws what it drew inside the whole run.
        _seed_everything(self.seed)
        ctx = Context(self.impl, seed=self.seed, depth=self.depth)
        outcome: list[BaseException | None] = []

        def body() -> None:
            try:
                check(ctx)
            except BaseException as e:  # handed to the caller's thread below
                outcome.append(e)
            else:
                outcome.append(None)

        if self.timeout_s is None:
            body()
        else:
            # A thread, not a signal: a hang inside C code (a lock, a queue, a socket) cannot be
            # interrupted, only abandoned. The thread is a daemon, so it never holds up exit.
            worker = threading.Thread(target=body, name=f"posttrain-check-{req.id}", daemon=True)
            worker.start()
            worker.join(self.timeout_s)
            if not outcome:
                return Status.FAIL, (
                    f"{req.id}: no answer in {self.timeout_s:g} s (the check was abandoned "
                    "while it waited on the implementation)"
                )
        err = outcome[0]
        if err is None:
            return Status.PASS, ""
        if isinstance(err, NotApplicable):
            return Status.NOT_APPLICABLE, str(err)
        if isinstance(err, ConformanceError):
            return Status.FAIL, f"{req.id}: {err}"
        if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit: the user's, not ours
            raise err
        cause = remote_cause(err)
        remote = f"in {_remote_task(err)}, " if cause is not err else ""
        return Status.ERROR, (
            f"{req.id}: raised {type(cause).__name__}: {cause} "
            f"({remote}{self._where(err.__traceback__)})"
        )

    def _where(self, tb: TracebackType | None) -> str:
        """Where an unexpected exception came from, each frame said to be kit, implementation
        or library code: ``at torch/nn/modules/module.py:1 (library), from the implementation
        at ourpkg/port.py:42, called by the kit at posttrain/conformance/suites/buffer.py:405``.
        """
        frames = traceback.extract_tb(tb)
        if not frames:
            return "no traceback"
        impl_root = _package_root(self.impl.factory)
        kinds = [_kind(f.filename, impl_root) for f in frames]
        last = frames[-1]
        parts = [f"at {_show(last.filename)}:{last.lineno} ({kinds[-1]})"]
        if kinds[-1] != "implementation" and "implementation" in kinds:
            i = len(kinds) - 1 - kinds[::-1].index("implementation")
            parts.append(
                f"from the implementation at {_show(frames[i].filename)}:{frames[i].lineno}"
            )
        if kinds[-1] != "kit" and "kit" in kinds:
            i = len(kinds) - 1 - kinds[::-1].index("kit")
            parts.append(f"called by the kit at {_show(frames[i].filename)}:{frames[i].lineno}")
        return ", ".join(parts)

    def __iter__(self) -> Iterator[Result]:
        for req in self.requirements():
            yield self.run_one(req)

    def report(self) -> Report:
        """The report of what has run so far."""
        info = run_info(self.impl, self.target, self.seed)
        return Report(
            run=info,
            results=[self.results[r.id] for r in self.requirements() if r.id in self.results],
        )


def run(
    impl: Implementation,
    *,
    target: str = "",
    seed: int = 0,
    timeout_s: float | None = None,
    depth: int = 1,
) -> Report:
    """Run the whole suite of ``impl``'s contract; return the report.

    With ``timeout_s``, each requirement's check runs in a thread of its own for at most that
    many seconds (a hang is FAIL "no answer in N s"); ``None`` (the default here) runs every
    check in the calling thread, unbounded. The pytest plugin and ``check()`` bound each check
    at :data:`DEFAULT_TIMEOUT_S`. ``depth`` multiplies how many generated inputs and random call
    sequences each check explores (1: the default run, deterministic under ``seed``).

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> run(RING_BUFFER).ok
        True
    """
    s = Session(impl, target=target, seed=seed, timeout_s=timeout_s, depth=depth)
    for _ in s:
        pass
    return s.report()


def _probe_buffer(ctx: Context) -> Any:
    return ctx.make(8)


def _probe_sink(ctx: Context) -> Any:
    with ctx.tmpdir() as d:
        sink = ctx.make(d)
        close = getattr(sink, "close", None)
        if callable(close):
            close()
        return sink


# One object of each contract whose capabilities add methods, built as its suite builds them.
_PROBES = {"buffer": _probe_buffer, "metrics": _probe_sink}


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)


def target_of(impl: Implementation) -> str:
    """The ``module:attr`` that holds ``impl`` among imported modules, or ``""``.

    An implementation handed over as an object gets a repro command only if some importable
    module binds it to a name (its factory's module is looked at first).

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> target_of(RING_BUFFER)
        'posttrain.reference_impls:RING_BUFFER'
    """
    home = getattr(impl.factory, "__module__", None)
    modules = [sys.modules.get(home)] if isinstance(home, str) else []
    for m in [*modules, *list(sys.modules.values())]:
        name = getattr(m, "__name__", None)
        if not isinstance(name, str) or name == "__main__":
            continue
        try:
            items = list(vars(m).items())
        except TypeError:
            continue
        for attr, value in items:
            if value is impl:
                return f"{name}:{attr}"
    return ""


def _package_root(factory: Any) -> Path | None:
    mod = sys.modules.get(getattr(factory, "__module__", "") or "")
    file = getattr(mod, "__file__", None)
    if not file:
        return None
    top = sys.modules.get(mod.__name__.split(".")[0]) if mod is not None else None
    top_file = getattr(top, "__file__", None)
    path = Path(top_file or file).resolve()
    return path.parent if path.name == "__init__.py" else path


def _kind(filename: str, impl_root: Path | None) -> str:
    path = Path(filename).resolve()
    if path.is_relative_to(_KIT_DIR):
        return "kit"
    if impl_root is not None and (path == impl_root or path.is_relative_to(impl_root)):
        return "implementation"
    return "library"


def _show(filename: str) -> str:
    """A path short enough to read and long enough to find: from the package down."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


# CSI (colours, cursor), OSC (titles, links) and two-character escapes; then what other control
# characters remain, bar tab and newline.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# Ray's rendering of a task error: "ray::Actor.method() (pid=..., ip=...)", the remote traceback
# (indented lines), then "Type: message", which is what the caller needs.
_RAY_TRACE = re.compile(
    r"(?P<task>ray::[\w.<>]+\(\))[ \t]*\(pid=[^\n]*(?:\n[ \t][^\n]*)*\n[A-Za-z_][\w.]*: "
)
_RAY_TYPE = re.compile(r"\bRayTaskError\((?P<type>[A-Za-z_][\w.]*)\)")
# What is left of a rendering cut short (a check kept its first characters): the task is kept,
# the process details (pid, address, actor id: different on every run) are not.
_RAY_HEADER = re.compile(r"(?P<task>ray::[\w.<>]+\(\))[ \t]*\(pid=[^()\n;]*\)?")


def clean_message(message: str) -> str:
    r"""``message`` as reports show it: no terminal escapes or control characters, and a Ray
    task error's rendering reduced to the remote error's own type and text.

    Example:
        >>> ray_text = "\x1b[36mray::Host.call()\x1b[39m (pid=7)\n  File 'h.py'\nKeyError: 'x'"
        >>> clean_message("raised RayTaskError(KeyError): " + ray_text)
        "raised KeyError: 'x' (in ray::Host.call())"
        >>> clean_message("\x1b[31mred\x1b[0m")
        'red'
        >>> clean_message("raised RayTaskError(KeyError): ray::Host.call() (pid=7, ip=1; len 8")
        "raised KeyError: ray::Host.call() (the remote error's text was cut off); len 8"
    """
    text = _CONTROL.sub("", _ANSI.sub("", message))
    m = _RAY_TRACE.search(text)
    if m is not None:
        # The remote error's text runs to the end of the rendering: where it came from goes last.
        text = f"{text[: m.start()]}{text[m.end() :]} (in {m['task']})"
    text = _RAY_HEADER.sub(lambda t: f"{t['task']} (the remote error's text was cut off)", text)
    return _RAY_TYPE.sub(lambda t: t["type"], text)


def remote_cause(error: BaseException) -> BaseException:
    """The error a remote call raised, for an error Ray re-raised in the caller; else ``error``.

    Ray wraps an exception raised in an actor or task in ``RayTaskError`` (its ``cause`` is the
    original; its text is the remote traceback, coloured). A message built from the cause keeps
    the remote error's own type and text. Ray is never imported here.

    Example:
        >>> e = ValueError("bad key")
        >>> remote_cause(e) is e
        True
    """
    ray_exceptions = sys.modules.get("ray.exceptions")
    task_error = getattr(ray_exceptions, "RayTaskError", None)
    seen: set[int] = set()
    while (
        task_error is not None
        and isinstance(error, task_error)
        and isinstance(getattr(error, "cause", None), BaseException)
        and id(error) not in seen
    ):
        seen.add(id(error))
        error = error.cause
    return error


def _remote_task(error: BaseException) -> str:
    found = re.search(r"ray::[\w.<>]+\(\)", _ANSI.sub("", str(error)))
    return found.group(0) if found else "a Ray task"


def _shorten(message: str) -> str:
    if len(message) <= _MAX_MESSAGE:
        return message
    return (
        message[: _MAX_MESSAGE - 40] + f" ... ({len(message) - _MAX_MESSAGE + 40} more characters)"
    )
