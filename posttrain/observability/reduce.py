"""Reductions by (numerator, denominator) pairs: microbatches, steps and ranks add up exactly.

A token mean over a global batch is ``sum(x * mask) / sum(mask)`` of the whole batch; averaging
the microbatches' means instead weights each microbatch equally, whatever its token count (the
"mean of means" the catalogue forbids). :class:`Accumulator` keeps the pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.contracts.catalogue import CATALOGUE_V1, Catalogue

_KINDS: dict[int, tuple[Catalogue, dict[str, str]]] = {}


def not_a_number(x: Any) -> str:
    """How an error names ``x`` that ``float()`` refused: a tensor by its shape."""
    return (
        f"a tensor of shape {list(x.shape)}"
        if isinstance(x, torch.Tensor)
        else f"{type(x).__name__} {x!r}"
    )


def one_number(where: str, x: Any, expected: str = "one number") -> float:
    """``x`` as one float, or a ``ValueError`` "``where``: expected ..., found ..."."""
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{where}: expected {expected}, found {not_a_number(x)}") from None


def _number(name: str, what: str, x: float | torch.Tensor) -> float:
    return one_number(f"metric {name!r}", x, f"{what} to be one number")


def _count(name: str, what: str, x: float | torch.Tensor) -> float:
    c = _number(name, what, x)
    if not (c >= 0 and math.isfinite(c)):  # NaN fails both
        raise ValueError(f"metric {name!r}: expected {what} to be finite and >= 0, found {c}")
    return c


class Accumulator:
    """Per metric: (sum, count) for ``tok``/``seq``/``rate``, a total for ``sum``, the
    extremum for ``min``/``max``, the latest value for ``last``; reductions from the catalogue.

    Example:
        >>> acc = Accumulator()
        >>> acc.add("policy/kl_ref/k3", 3.0, 2)   # a microbatch: 2 tokens summing to 3
        >>> acc.add("policy/kl_ref/k3", 1.0, 6)   # another: 6 tokens summing to 1
        >>> acc.values()["policy/kl_ref/k3"]      # 4 / 8, not (1.5 + 0.1667) / 2
        0.5
    """

    def __init__(self, catalogue: Catalogue = CATALOGUE_V1) -> None:
        self.catalogue = catalogue
        # Shared by every accumulator of this catalogue: a loop makes a new one each step, and
        # matching a name against the catalogue is most of what a step's hooks cost otherwise.
        held = _KINDS.get(id(catalogue))
        if held is None or held[0] is not catalogue:
            if len(_KINDS) >= 8:  # catalogues are few; a process making many keeps 8 at most
                _KINDS.clear()
            held = _KINDS[id(catalogue)] = (catalogue, {})
        self._kind: dict[str, str] = held[1]
        self._num: dict[str, float] = {}
        self._den: dict[str, float] = {}
        self._ext: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._mom: dict[str, list[float]] = {}  # std metrics: [sum, sum of squares, count]

    def reduction(self, name: str) -> str:
        """The catalogue's reduction of ``name`` (a ``<reward_fn>`` family member included)."""
        kind = self._kind.get(name)
        if kind is None:
            parts = name.split("/")
            for m in self.catalogue.metrics:
                pat = m.name.split("/")
                if len(pat) == len(parts) and all(
                    a == b or a == "<reward_fn>" for a, b in zip(pat, parts, strict=True)
                ):
                    kind = m.reduction
                    break
            else:
                raise KeyError(f"metric {name!r} is not in catalogue {self.catalogue.name}")
            self._kind[name] = kind
        return kind

    def add(self, name: str, value: float | torch.Tensor, count: float | torch.Tensor = 1) -> None:
        """Add a numerator and its denominator (``tok``/``seq``/``rate``), or one value.

        A value or count that is not one number, or a count that is negative or not finite,
        raises ``ValueError`` naming the metric, and the accumulator is left as it was.

        Example:
            >>> acc = Accumulator()
            >>> acc.add("policy/kl_ref/k3", 1.0, torch.tensor([3, 5]))  # a count per sequence
            Traceback (most recent call last):
            ...
            ValueError: metric 'policy/kl_ref/k3': expected count to be one number, found a tensor of shape [2]
            >>> acc.values()
            {}
        """
        kind = self.reduction(name)
        v = _number(name, "value", value)
        if kind in ("tok", "seq", "rate"):
            c = _count(name, "count", count)
            self._num[name] = self._num.get(name, 0.0) + v
            self._den[name] = self._den.get(name, 0.0) + c
        elif kind == "sum":
            self._num[name] = self._num.get(name, 0.0) + v
        elif kind == "min":
            self._ext[name] = min(self._ext.get(name, math.inf), v)
        elif kind == "max":
            self._ext[name] = max(self._ext.get(name, -math.inf), v)
        else:
            self._last[name] = v

    def add_moments(
        self, name: str, total: float | torch.Tensor, squares: float | torch.Tensor, count: float
    ) -> None:
        """A ``.../std`` metric: population std from sums of x and x^2 over ``count`` items."""
        if self.reduction(name) != "seq":
            raise ValueError(f"{name!r}: moments need a 'seq' reduction")
        a, b = _number(name, "total", total), _number(name, "squares", squares)
        c = _count(name, "count", count)
        m = self._mom.setdefault(name, [0.0, 0.0, 0.0])
        m[0] += a
        m[1] += b
        m[2] += c

    def merge(self, other: Accumulator) -> None:
        """Fold another accumulator (another microbatch, step or rank) into this one.

        Every name of ``other`` is looked up first: one this catalogue does not hold raises
        ``KeyError`` before anything is folded in.
        """
        for name in (*other._num, *other._ext, *other._last, *other._mom):
            self.reduction(name)
        for name, num in other._num.items():
            if name in other._den:
                self.add(name, num, other._den[name])
            else:
                self.add(name, num)
        for name, v in other._ext.items():
            self.add(name, v)
        for name, v in other._last.items():
            self.add(name, v)
        for name, (a, b, c) in other._mom.items():
            self.add_moments(name, a, b, c)

    def all_reduce(self, group: Any = None) -> None:
        """Reduce across ``torch.distributed`` ranks (sums, mins, maxes); no-op without it.

        Every rank must hold the same metric names.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        for name, (a, b, c) in sorted(self._mom.items()):  # as three sums
            self._num[f"{name}\0s"], self._den[f"{name}\0s"] = a, c
            self._num[f"{name}\0q"] = b
        sums = sorted(self._num)
        dens = sorted(self._den)
        mins = sorted(n for n in self._ext if self.reduction(n) == "min")
        maxs = sorted(n for n in self._ext if self.reduction(n) == "max")
        if sums or dens:
            t = torch.tensor(
                [self._num[n] for n in sums] + [self._den[n] for n in dens], dtype=torch.float64
            )
            dist.all_reduce(t, group=group)
            vals = t.tolist()
            self._num.update(zip(sums, vals[: len(sums)], strict=True))
            self._den.update(zip(dens, vals[len(sums) :], strict=True))
        for names, op in ((mins, dist.ReduceOp.MIN), (maxs, dist.ReduceOp.MAX)):
            if names:
                t = torch.tensor([self._ext[n] for n in names], dtype=torch.float64)
                dist.all_reduce(t, op=op, group=group)
                self._ext.update(zip(names, t.tolist(), strict=True))
        for name in self._mom:
            self._mom[name] = [
                self._num.pop(f"{name}\0s"),
                self._num.pop(f"{name}\0q"),
                self._den.pop(f"{name}\0s"),
            ]

    def values(self) -> dict[str, float]:
        """The reduced value of every metric added (NaN for a ratio with nothing counted)."""
        out: dict[str, float] = {}
        for name, num in self._num.items():
            if name in self._den:
                den = self._den[name]
                out[name] = num / den if den else math.nan
            else:
                out[name] = num
        out.update(self._ext)
        out.update(self._last)
        for name, (a, b, c) in self._mom.items():
            out[name] = math.sqrt(max(b / c - (a / c) ** 2, 0.0)) if c else math.nan
        return out

    def log_to(self, sink: Any, step: int) -> Mapping[str, float]:
        """Write every value to a ``MetricSinkV1`` at ``step``; return them."""
        vals = self.values()
        for name, v in vals.items():
            sink.log_scalar(name, v, step=step)
        return vals
