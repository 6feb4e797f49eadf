"""An implementation's declaration: which contract, how to build it, what it claims."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.contracts.registry import get_contract


@dataclass(frozen=True)
class Implementation:
    """A conformance target: contract id, factory, name, capabilities and declared options.

    ``unavailable`` maps a capability the component has but cannot use here to the reason
    (reported as NOT_APPLICABLE with that reason, never hidden). ``known_failures`` lists the
    requirement ids a component as it stands is known to fail (a raw upstream component's
    published deviations): ``make report`` fails when the failures differ from it either way,
    so a regression, or an upstream fix that makes an adapter's workaround stale, is seen.
    ``extras`` carries contract-specific hooks, e.g. a metrics sink's ``reader``.

    Example:
        >>> from posttrain.reference_impls import make_ring_buffer
        >>> impl = Implementation("buffer", make_ring_buffer, name="ring",
        ...                       capabilities={"checkpoint"})
        >>> impl.resolved_options()
        {'eviction': 'fifo', 'sampling': 'with_replacement'}
    """

    contract: str
    factory: Callable[..., Any]
    name: str = ""
    capabilities: frozenset[str] | set[str] | tuple[str, ...] = frozenset()
    options: Mapping[str, str] = field(default_factory=dict)
    unavailable: Mapping[str, str] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    known_failures: frozenset[str] | set[str] | tuple[str, ...] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        if isinstance(self.known_failures, str):
            raise TypeError(
                f"known_failures: expected a set of requirement ids, found the string "
                f"{self.known_failures!r}"
            )
        object.__setattr__(self, "known_failures", frozenset(self.known_failures))
        c = get_contract(self.contract)
        c.resolve_declaration(self.capabilities, self.options)
        c.resolve_declaration(self.unavailable)
        for rid in sorted(self.known_failures):
            c.requirement(rid)  # KeyError naming the contract for an unknown id
        if not self.name:
            object.__setattr__(
                self, "name", getattr(self.factory, "__qualname__", repr(self.factory))
            )

    def resolved_options(self) -> dict[str, str]:
        """Declared options with the contract's defaults filled in."""
        return get_contract(self.contract).resolve_declaration(self.capabilities, self.options)
