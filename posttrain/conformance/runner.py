"""Run a contract's suite against one implementation, requirement by requirement."""

from __future__ import annotations

import datetime
import platform
import time
import traceback
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import torch

from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.outcome import Report, Result, Status
from posttrain.conformance.registry import checks_for
from posttrain.contracts.contract import Contract
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.registry import get_contract
from posttrain.contracts.requirements import Requirement

__all__ = ["Session", "run"]


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

    def __init__(self, impl: Implementation, *, target: str = "", seed: int = 0) -> None:
        self.impl = impl
        self.target = target or impl.name
        self.seed = seed
        self.contract: Contract = get_contract(impl.contract)
        self.checks = checks_for(impl.contract)
        self.applicable = {r.id for r in self.contract.applicable(impl.capabilities, impl.options)}
        self.results: dict[str, Result] = {}

    def requirements(self) -> list[Requirement]:
        """The catalogue, in run order."""
        return list(self.contract.requirements)

    def repro(self, req: Requirement) -> str:
        """A command that reruns just this requirement."""
        return (
            f"pytest -p no:cacheprovider --conformance={self.contract.id} "
            f"--conformance-impl={self.target} --conformance-seed={self.seed} -k {req.id}"
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

    def run_one(self, req: Requirement) -> Result:
        """Run (or skip, or block) one requirement and remember its result."""
        res = Result(req.id, req.level.value, req.title, Status.PASS, repro=self.repro(req))
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
            ctx = Context(self.impl, seed=self.seed)
            try:
                check(ctx)
            except NotApplicable as e:
                res.status, res.message = Status.NOT_APPLICABLE, str(e)
            except ConformanceError as e:
                res.status, res.message = Status.FAIL, f"{req.id}: {e}"
            except Exception as e:
                tb = traceback.extract_tb(e.__traceback__)[-1]
                res.status = Status.ERROR
                res.message = (
                    f"{req.id}: raised {type(e).__name__}: {e} "
                    f"(at {tb.filename.rsplit('/', 1)[-1]}:{tb.lineno})"
                )
        res.duration_s = round(time.perf_counter() - start, 4)
        self.results[req.id] = res
        return res

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


def run(impl: Implementation, *, target: str = "", seed: int = 0) -> Report:
    """Run the whole suite of ``impl``'s contract; return the report.

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> run(RING_BUFFER).ok
        True
    """
    s = Session(impl, target=target, seed=seed)
    for _ in s:
        pass
    return s.report()
