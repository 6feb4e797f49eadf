"""Results of a conformance run: one row per requirement, plus run info."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from posttrain.contracts.requirements import Level

# Characters that start Markdown formatting, links, HTML or a table cell inside running text.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&])")


def md_cell(text: object) -> str:
    r"""``text`` on one line with every character that Markdown would act on escaped.

    Implementation names and messages come from the implementation under test: a ``|`` would
    split a table row, ``<script>`` or ``[x](javascript:...)`` would render.

    Example:
        >>> print(md_cell("a|b <i>x</i> [y](z)"))
        a\|b \<i\>x\</i\> \[y\](z)
    """
    return _MD_SPECIAL.sub(r"\\\1", " ".join(str(text).splitlines()))


REPORT_FORMAT = "posttrain-conformance-report/1"
"""The ``format`` field of every JSON report file; its schema is ``specs/conformance-report-v1.schema.json``."""


class Status(str, enum.Enum):
    """A requirement's outcome.

    Example:
        >>> Status.NOT_APPLICABLE.value
        'NOT_APPLICABLE'
    """

    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"
    NOT_APPLICABLE = "NOT_APPLICABLE"


@dataclass
class Result:
    """One requirement's outcome; ``message`` starts with the id when it did not pass.

    Example:
        >>> r = Result("BUF-013", "MUST", "empty sample raises", Status.PASS)
        >>> r.passed, r.blocking
        (True, False)
    """

    id: str
    level: str
    title: str
    status: Status
    message: str = ""
    repro: str = ""
    duration_s: float = 0.0
    spec: str = ""

    @property
    def passed(self) -> bool:
        """True for PASS (NOT_APPLICABLE is neither a pass nor a failure)."""
        return self.status is Status.PASS

    @property
    def blocked(self) -> bool:
        """True when the check did not run: a requirement it builds on failed."""
        # The runner's wording for a dependant of a failed foundation (runner.Session.run_one).
        return self.message.startswith(f"{self.id}: blocked by ")

    @property
    def blocking(self) -> bool:
        """True when this result makes the run fail: a MUST that FAILed or ERRORed."""
        return self.level == Level.MUST.value and self.status in (Status.FAIL, Status.ERROR)


@dataclass
class Report:
    """A whole run: ``run`` info (implementation, versions, capabilities, seed...) and rows.

    Example:
        >>> rep = Report(run={"implementation": "x"}, results=[])
        >>> rep.ok, rep.counts()["PASS"]
        (True, 0)
    """

    run: dict[str, Any]
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No MUST requirement failed or errored."""
        return not any(r.blocking for r in self.results)

    def failed_ids(self) -> set[str]:
        """Requirements whose own check failed or errored (not those only blocked by another)."""
        return {
            r.id for r in self.results if r.status in (Status.FAIL, Status.ERROR) and not r.blocked
        }

    def surprises(self) -> list[str]:
        """How the failures differ from the implementation's declared ``known_failures``.

        Example:
            >>> rep = Report(run={"known_failures": ["BUF-009"]}, results=[])
            >>> rep.surprises()
            ['BUF-009 declared a known failure but did not fail']
        """
        known = set(self.run.get("known_failures", []))
        failed = self.failed_ids()
        unrun = {
            r.id: "blocked" if r.blocked else "not applicable"
            for r in self.results
            if r.id in known and (r.blocked or r.status is Status.NOT_APPLICABLE)
        }
        out = [f"{rid} failed (not a declared known failure)" for rid in sorted(failed - known)]
        out += [
            f"{rid} declared a known failure but did not run ({unrun[rid]})"
            if rid in unrun
            else f"{rid} declared a known failure but did not fail"
            for rid in sorted(known - failed)
        ]
        return out

    def verdict(self) -> str:
        """One phrase for the whole run, read against the declared ``known_failures``.

        ``conforms`` (every MUST holds), ``conforms, SHOULD failing`` (nothing declared, every
        MUST holds, a SHOULD failed: a SHOULD never fails a run, and the exit status of
        ``pytest --conformance`` and ``posttrain check`` stays 0), ``does not conform`` (a MUST
        failed and nothing was declared), ``does not conform (as declared)`` (exactly the
        declared failures: a raw upstream component with published deviations), or
        ``unexpected`` (the failures differ from the declaration either way: see
        :meth:`surprises`).

        Example:
            >>> Report(run={}, results=[]).verdict()
            'conforms'
            >>> r = Result("BUF-025", "SHOULD", "t", Status.FAIL, "BUF-025: torn")
            >>> Report(run={}, results=[r]).verdict()
            'conforms, SHOULD failing'
        """
        if self.surprises() and not self.run.get("known_failures") and self.ok:
            return "conforms, SHOULD failing"
        if self.surprises():
            # Nothing declared: a surprise is simply a failure.
            return "unexpected" if self.run.get("known_failures") else "does not conform"
        if self.ok:
            return "conforms"
        return "does not conform (as declared)"

    def counts(self) -> dict[str, int]:
        """How many rows have each status."""
        out = {s.value: 0 for s in Status}
        for r in self.results:
            out[r.status.value] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        """One implementation's report as plain data (see ``specs/conformance-report-v1.schema.json``).

        Example:
            >>> sorted(Report(run={}, results=[]).to_dict())
            ['results', 'run', 'summary', 'surprises', 'verdict']
        """
        return {
            "run": self.run,
            "verdict": self.verdict(),
            "surprises": self.surprises(),
            "summary": self.counts(),
            "results": [{**asdict(r), "status": r.status.value} for r in self.results],
        }

    def to_json(self) -> str:
        """The JSON report file of this run alone: :func:`reports_json` of ``[self]``."""
        return reports_json([self])

    def to_markdown(self) -> str:
        """A Markdown table of the rows, under a header naming target, contract and capabilities."""
        run = self.run
        caps = ", ".join(run.get("capabilities", [])) or "none"
        lines = [
            f"# Conformance: {md_cell(run.get('implementation', '?'))} — "
            f"{md_cell(run.get('contract', '?'))} v{md_cell(run.get('contract_version', '?'))}",
            "",
            f"Target {md_cell(run.get('target', '?'))}; capabilities: {md_cell(caps)}; options: "
            + md_cell(", ".join(f"{k}={v}" for k, v in run.get("options", {}).items()))
            + f"; seed {md_cell(run.get('seed', '?'))}.",
            "",
            " · ".join(f"{k}: {v}" for k, v in self.counts().items()),
            "",
            "| id | level | requirement | status | message |",
            "|---|---|---|---|---|",
        ]
        for r in self.results:
            msg = md_cell(r.message.splitlines()[0] if r.message else "")
            lines.append(
                f"| {md_cell(r.id)} | {r.level} | {md_cell(r.title)} | {r.status.value} | {msg} |"
            )
        return "\n".join(lines) + "\n"


def retry_note(rep: Report) -> str:
    """``""``, or how a row that ran twice fared the first time (every format shows it).

    Example:
        >>> rep = Report(run={"attempts": [{"verdict": "unexpected", "surprises": ["WS-004 failed"]},
        ...                                {"verdict": "conforms", "surprises": []}]})
        >>> retry_note(rep)
        'retried: attempt 1 of 2 was unexpected (WS-004 failed)'
    """
    attempts = rep.run.get("attempts") or []
    if len(attempts) < 2:
        return ""
    parts = [
        f"attempt {i} of {len(attempts)} was {a['verdict']}"
        + (f" ({'; '.join(a['surprises'])})" if a.get("surprises") else "")
        for i, a in enumerate(attempts[:-1], start=1)
    ]
    return "retried: " + ", ".join(parts)


def reports_json(reports: list[Report]) -> str:
    """A JSON report file: ``{"format": ..., "reports": [...]}``, one shape for any number of runs.

    Example:
        >>> import json
        >>> data = json.loads(reports_json([Report(run={"implementation": "x"}, results=[])]))
        >>> data["format"], data["reports"][0]["verdict"]
        ('posttrain-conformance-report/1', 'conforms')
    """
    payload = {"format": REPORT_FORMAT, "reports": [r.to_dict() for r in reports]}
    return json.dumps(payload, indent=2) + "\n"


def report_schema() -> dict[str, Any]:
    """The JSON Schema of a report file (written to ``specs/conformance-report-v1.schema.json``).

    Example:
        >>> report_schema()["properties"]["format"]["const"]
        'posttrain-conformance-report/1'
    """
    status = {"enum": [s.value for s in Status]}
    row = {
        "type": "object",
        "required": ["id", "level", "title", "status", "message", "repro", "duration_s", "spec"],
        "additionalProperties": False,
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]+-[0-9]{3}$"},
            "level": {"enum": ["MUST", "SHOULD"]},
            "title": {"type": "string"},
            "status": status,
            "message": {
                "type": "string",
                "description": "Empty on PASS; otherwise starts with '<id>: ' and, on FAIL or "
                "ERROR, ends with '(see <spec>)'.",
            },
            "repro": {"type": "string", "description": "A command that reruns this row alone."},
            "duration_s": {"type": "number", "minimum": 0},
            "spec": {"type": "string", "description": "specs/<contract>-v<major>.md#<id>"},
        },
    }
    one = {
        "type": "object",
        "required": ["run", "verdict", "surprises", "summary", "results"],
        "additionalProperties": False,
        "properties": {
            "run": {
                "type": "object",
                "description": "Who was checked against what: implementation, target, contract, "
                "contract_version, capabilities, unavailable, known_failures, options, seed, "
                "versions, python, device, started. A matrix row adds duration_s; a row that "
                "starts Ray or torch.distributed adds startup_s and timeout_s (its per-check "
                "timeout), and attempts (verdict, surprises, duration_s of each) when it ran "
                "more than once.",
                "required": ["implementation", "contract", "contract_version", "seed"],
            },
            "verdict": {
                "enum": [
                    "conforms",
                    "does not conform",
                    "does not conform (as declared)",
                    "unexpected",
                ]
            },
            "surprises": {"type": "array", "items": {"type": "string"}},
            "summary": {
                "type": "object",
                "required": [s.value for s in Status],
                "additionalProperties": False,
                "properties": {s.value: {"type": "integer", "minimum": 0} for s in Status},
            },
            "results": {"type": "array", "items": row},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:posttrain:conformance-report:v1",
        "title": "posttrain conformance report",
        "type": "object",
        "required": ["format", "reports"],
        "additionalProperties": False,
        "properties": {
            "format": {"const": REPORT_FORMAT},
            "reports": {"type": "array", "items": one, "description": "One per implementation."},
        },
    }
