"""What a check function receives: the implementation, a fresh-object factory, a seeded RNG."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.contracts.implementation import Implementation
from posttrain.errors import PosttrainError


class ConformanceError(PosttrainError, AssertionError):
    """A check found the implementation breaking its requirement (reported as FAIL).

    Example:
        >>> str(ConformanceError("len is 3, expected 2"))
        'len is 3, expected 2'
    """


class NotApplicable(PosttrainError):
    """A check cannot run here (e.g. a declared CUDA capability on a CPU-only machine).

    Example:
        >>> str(NotApplicable("no CUDA device on this machine"))
        'no CUDA device on this machine'
    """


@dataclass
class Context:
    """Everything a check needs; ``make`` builds a fresh implementation object per call.

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> ctx = Context(RING_BUFFER, seed=0)
        >>> len(ctx.make(4)), ctx.options["eviction"]
        (0, 'fifo')
    """

    impl: Implementation
    seed: int = 0
    depth: int = 1
    """How many times the default number of generated inputs and call sequences to try."""
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.options = self.impl.resolved_options()
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def capabilities(self) -> frozenset[str]:
        """The declared capabilities."""
        return frozenset(self.impl.capabilities)

    def make(self, *args: Any, **kwargs: Any) -> Any:
        """A fresh object from the implementation's factory."""
        return self.impl.factory(*args, **kwargs)

    @contextmanager
    def tmpdir(self) -> Iterator[Path]:
        """A temporary directory, removed afterwards."""
        with tempfile.TemporaryDirectory(prefix="posttrain-conformance-") as d:
            yield Path(d)
