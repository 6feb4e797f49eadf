"""The contract record: id, version, Protocol, capabilities, options and requirements."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.contracts.requirements import Requirement
from posttrain.errors import PosttrainError


class DeclarationError(PosttrainError, ValueError):
    """An implementation declared a capability or option value the contract does not have.

    Example:
        >>> from posttrain.contracts import get_contract
        >>> BUFFER = get_contract("buffer")
        >>> try:
        ...     BUFFER.resolve_declaration(capabilities=["teleport"])
        ... except DeclarationError as e:
        ...     print(str(e).splitlines()[0])
        buffer v1.6: unknown capability 'teleport'; the closed set is: checkpoint, cuda, priority, ragged, read, remote_writers, thread_safe
    """


class Capability(BaseModel):
    """An optional feature an implementation may declare; declared ones are verified.

    Example:
        >>> Capability(name="ragged", text="Stores items whose T differs.").name
        'ragged'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    text: str
    methods: tuple[str, ...] = Field(
        default=(),
        description="Methods an implementation declaring it must have, checked before a run.",
    )
    undeclared: str = Field(
        default="",
        description=(
            "What is checked when the capability is not declared: a capability chooses which "
            "variant of a behaviour the spec defines is checked, never whether."
        ),
    )


class Option(BaseModel):
    """A declared behaviour choice with a closed set of values and a default.

    Example:
        >>> o = Option(name="eviction", values=("fifo",), default="fifo", text="Which item goes.")
        >>> o.default
        'fifo'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    values: tuple[str, ...]
    default: str
    text: str

    @model_validator(mode="after")
    def _default_is_a_value(self) -> Option:
        if self.default not in self.values:
            raise ValueError(f"option {self.name!r}: default {self.default!r} not in {self.values}")
        return self


class Contract(BaseModel):
    """One versioned seam: a Protocol plus the catalogue that says what conforming means.

    The catalogue (``requirements``) is the single source: the Markdown spec, the JSON Schema
    and the conformance suite's ids all come from it.

    Example:
        >>> from posttrain.contracts import get_contract
        >>> BUFFER = get_contract("buffer")
        >>> BUFFER.id, BUFFER.version, BUFFER.requirement("BUF-001").level.value
        ('buffer', '1.6', 'MUST')
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: str
    version: str = "1.0"
    title: str
    purpose: str
    protocol: type = Field(exclude=True)
    extra_protocols: tuple[type, ...] = Field(default=(), exclude=True)
    factory: str = Field(description="The factory signature the conformance suite calls.")
    uses_layout: bool = False
    capabilities: tuple[Capability, ...] = ()
    options: tuple[Option, ...] = ()
    requirements: tuple[Requirement, ...]

    @model_validator(mode="after")
    def _consistent(self) -> Contract:
        ids = [r.id for r in self.requirements]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"contract {self.id!r}: duplicate requirement ids {dupes}")
        caps = {c.name for c in self.capabilities}
        opts = {o.name: o for o in self.options}
        for r in self.requirements:
            if r.capability is not None and r.capability not in caps:
                raise ValueError(f"{r.id}: unknown capability {r.capability!r}")
            if r.option is not None:
                name, value = r.option
                if name not in opts or value not in opts[name].values:
                    raise ValueError(f"{r.id}: unknown option value {r.option!r}")
            for dep in r.depends_on:
                if dep not in ids or ids.index(dep) >= ids.index(r.id):
                    raise ValueError(f"{r.id}: depends_on {dep!r} must be an earlier requirement")
        return self

    @property
    def major(self) -> int:
        """The major version: breaking changes make a new major (``v2``)."""
        return int(self.version.split(".")[0])

    @property
    def capability_names(self) -> frozenset[str]:
        """The closed set of capability names."""
        return frozenset(c.name for c in self.capabilities)

    def requirement(self, req_id: str) -> Requirement:
        """Return the requirement with this id; ``KeyError`` naming the contract if absent."""
        for r in self.requirements:
            if r.id == req_id:
                return r
        raise KeyError(f"{self.id} v{self.version} has no requirement {req_id!r}")

    def default_options(self) -> dict[str, str]:
        """Every option at its default value."""
        return {o.name: o.default for o in self.options}

    def resolve_declaration(
        self,
        capabilities: Iterable[str] = (),
        options: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """Validate a declaration; return the full option mapping (defaults filled in).

        Raises :class:`DeclarationError` listing every unknown capability, option or value.
        """
        problems: list[str] = []
        known = sorted(self.capability_names)
        for cap in capabilities:
            if cap not in self.capability_names:
                problems.append(
                    f"unknown capability {cap!r}; the closed set is: {', '.join(known) or '(none)'}"
                )
        resolved = self.default_options()
        by_name = {o.name: o for o in self.options}
        for name, value in (options or {}).items():
            opt = by_name.get(name)
            if opt is None:
                problems.append(
                    f"unknown option {name!r}; declared options are: "
                    f"{', '.join(sorted(by_name)) or '(none)'}"
                )
            elif value not in opt.values:
                problems.append(
                    f"option {name!r}: expected one of {list(opt.values)}, found {value!r}"
                )
            else:
                resolved[name] = value
        if problems:
            raise DeclarationError("\n".join(f"{self.id} v{self.version}: {p}" for p in problems))
        return resolved

    def applicable(
        self, capabilities: Iterable[str] = (), options: Mapping[str, str] | None = None
    ) -> list[Requirement]:
        """The requirements that apply to a declaration (others are NOT_APPLICABLE)."""
        caps = set(capabilities)
        opts = self.resolve_declaration(caps, options)
        return [
            r
            for r in self.requirements
            if (r.capability is None or r.capability in caps)
            and (r.option is None or opts.get(r.option[0]) == r.option[1])
        ]
