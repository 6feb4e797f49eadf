"""Requirements: one normative sentence each, with an id, a level and a version."""

from __future__ import annotations

import enum
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_ID = re.compile(r"^[A-Z]+-[0-9]{3}$")


class Level(str, enum.Enum):
    """How binding a requirement is (RFC 2119 words).

    Example:
        >>> Level.MUST.value
        'MUST'
    """

    MUST = "MUST"
    SHOULD = "SHOULD"


class Requirement(BaseModel):
    """One checkable promise of a contract.

    ``capability`` names the optional capability the requirement needs (``None``: always
    applies); ``option`` restricts it to one declared option value, e.g.
    ``("eviction", "fifo")``. ``depends_on`` lists requirements that must pass before this one
    is meaningful: a conformance run reports "blocked by ..." instead of a cascade of failures.

    Example:
        >>> r = Requirement(id="BUF-001", level=Level.MUST, title="extend returns indices",
        ...                 text="`extend(data)` MUST return the written indices.")
        >>> r.id, r.level.value, r.since
        ('BUF-001', 'MUST', '1.0')
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(description="Stable identifier, PREFIX-NNN; never reused.")
    level: Level
    title: str = Field(description="A few words, for tables and reports.")
    text: str = Field(description="The one normative sentence.")
    since: str = Field(default="1.0", description="Contract version that introduced it.")
    tightened: tuple[str, ...] = Field(
        default=(),
        description=(
            "Contract versions whose check tests more of this same text (a tightening: it may "
            "fail an implementation that passed before, which already broke the sentence)."
        ),
    )
    capability: str | None = Field(default=None, description="Capability it needs, if any.")
    option: tuple[str, str] | None = Field(
        default=None, description="(option, value) it is restricted to, if any."
    )
    depends_on: tuple[str, ...] = Field(default=(), description="Foundational requirements.")
    domain: str = Field(
        default="",
        description=(
            "The inputs its check draws from: the domain the spec allows for each input, with "
            "the boundaries tried explicitly, so an implementer reads what will be tried."
        ),
    )

    @field_validator("id")
    @classmethod
    def _id_shape(cls, v: str) -> str:
        if not _ID.match(v):
            raise ValueError(f"requirement id must look like 'BUF-001', found {v!r}")
        return v

    @field_validator("text")
    @classmethod
    def _normative(cls, v: str) -> str:
        if "MUST" not in v and "SHOULD" not in v:
            raise ValueError(f"requirement text must contain MUST or SHOULD: {v!r}")
        return v
