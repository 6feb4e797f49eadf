"""A buffer's stored schema: keys, dtypes and per-item shapes fixed by the first write."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._dtypes import DTYPES, dtype_name
from posttrain.contracts.keys import leaf_items
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.validation import ContractViolation, Violation

RAGGED = -1
"""An item dimension whose size differs between items."""


@dataclass(frozen=True)
class Column:
    """One key of the schema: dtype and per-item shape (``RAGGED`` where sizes vary).

    Example:
        >>> Column(torch.int64, (8,)).describe()
        'int64 [8]'
    """

    dtype: torch.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        """``dtype [shape]`` as the error messages show it."""
        dims = ", ".join("ragged" if d == RAGGED else str(d) for d in self.shape)
        return f"{dtype_name(self.dtype)} [{dims}]"


def batch_violations(data: Any) -> list[Violation]:
    """A batch for a buffer is a TensorDict with one batch dim ``[N]``.

    Example:
        >>> from tensordict import TensorDict
        >>> [str(v) for v in batch_violations(TensorDict({}, batch_size=[2, 3]))]
        ['BUF-001 the batch: expected batch dims [N], found batch_size [2, 3]']
    """
    if not isinstance(data, TensorDictBase):
        return [Violation((), "a TensorDict", type(data).__name__, "BUF-001")]
    if data.batch_dims != 1:
        return [Violation((), "batch dims [N]", f"batch_size {list(data.batch_size)}", "BUF-001")]
    return []


def _free_token_dim(columns: dict[tuple[str, ...], Column]) -> dict[tuple[str, ...], Column]:
    """A ragged buffer's schema: the token dimension 'T' varies even if the first batch's
    items happen to share one length (the LLM layout's per-token fields lead with T; without
    a tokens key, every column's leading item dimension is taken as T)."""
    tok = columns.get(LLM_LAYOUT_V1.key("tokens"))
    if tok is None:
        return {
            k: Column(c.dtype, (RAGGED, *c.shape[1:])) if c.shape else c for k, c in columns.items()
        }
    if not tok.shape:
        return columns
    t = tok.shape[0]
    return {
        k: Column(c.dtype, (RAGGED, *c.shape[1:])) if c.shape and c.shape[0] in (t, RAGGED) else c
        for k, c in columns.items()
    }


_MIXED_DIMS = "items with different numbers of dims"

_STRIDED = torch.strided


def _faults(v: torch.Tensor) -> list[tuple[str, str, str]]:
    """(expected, found, requirement) for each way ``v`` cannot be stored, whatever the schema.

    A buffer copies a batch into storage it owns, on its own device: a leaf on any device
    that holds data is accepted (the write copies it across), ``meta`` holds none. Only dense
    strided tensors (and the nested tensors a ragged buffer takes) copy into rows; a view of
    any strides is fine. A leaf that requires grad would keep the caller's graph alive in
    storage, and the layout calls it invalid (LAY-005).
    """
    out = []
    if v.is_meta:
        out.append(("a tensor holding data (any device but meta)", "device meta", "BUF-011"))
    if v.layout is not _STRIDED and not v.is_nested:
        layout = dtype_name(v.layout)
        out.append(("a dense tensor (layout strided)", f"layout {layout}", "BUF-011"))
    if v.requires_grad:
        out.append(
            ("a tensor that does not require grad (data, LAY-005)", "requires_grad=True", "LAY-005")
        )
    return out


def _fault_violations(
    leaves: dict[tuple[str, ...], Any] | None, items: list[dict[tuple[str, ...], Any]]
) -> list[Violation]:
    """Every leaf's faults (:func:`_faults`), once per key and fault; a lazy stack's items are
    walked one by one and the items at fault named."""
    if leaves is not None:
        return [
            Violation(k, e, f, r)
            for k, v in leaves.items()
            if isinstance(v, torch.Tensor)
            for e, f, r in _faults(v)
        ]
    where: dict[tuple[tuple[str, ...], str, str, str], list[int]] = {}
    for i, it in enumerate(items):
        for k, v in it.items():
            if isinstance(v, torch.Tensor):
                for e, f, r in _faults(v):
                    where.setdefault((k, e, f, r), []).append(i)
    return [Violation(k, e, f"{f} in item(s) {_some(at)}", r) for (k, e, f, r), at in where.items()]


def _some(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:10]))
    return shown if len(ids) <= 10 else f"{shown} ... and {len(ids) - 10} more"


def leaf_violations(data: Any) -> list[Violation]:
    """What makes a batch unstorable whatever the schema: a leaf on ``meta``, a sparse (or
    other non-strided) leaf, a leaf that requires grad. Each names the key.

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"x": torch.zeros(2, 3, requires_grad=True)}, batch_size=[2])
        >>> [str(v) for v in leaf_violations(td)]
        ["LAY-005 key 'x': expected a tensor that does not require grad (data, LAY-005), found requires_grad=True"]
    """
    if batch_violations(data):
        return []
    if isinstance(data, LazyStackedTensorDict) and data.stack_dim == 0:
        return _fault_violations(None, [leaf_items(t) for t in data.tensordicts])
    return _fault_violations(leaf_items(data), [])


@dataclass(frozen=True)
class _Partial:
    """A key of a lazy stack held by some items only: ``missing`` lists the others."""

    missing: tuple[int, ...]

    def __str__(self) -> str:
        shown = ", ".join(map(str, self.missing[:8])) + (", ..." if len(self.missing) > 8 else "")
        return f"missing in item(s) {shown}"


def _columns(
    data: TensorDictBase,
    leaves: dict[tuple[str, ...], Any] | None = None,
    items_out: list[dict[tuple[str, ...], Any]] | None = None,
) -> dict[tuple[str, ...], Column | str | _Partial]:
    """Each leaf's column, the type name of a leaf that is not a tensor, or (lazy stacks) the
    items a key is missing from.

    For a lazy stack, ``items_out`` receives each item's leaves (walked once, reused).
    """
    out: dict[tuple[str, ...], Column | str | _Partial] = {}
    if not (isinstance(data, LazyStackedTensorDict) and data.stack_dim == 0):
        for key, v in (leaf_items(data) if leaves is None else leaves).items():
            if not isinstance(v, torch.Tensor):
                out[key] = type(v).__name__
            elif v.is_nested:
                out[key] = Column(
                    v.dtype, tuple(d if type(d) is int else RAGGED for d in v.shape[1:])
                )
            else:
                out[key] = Column(v.dtype, tuple(v.shape[1:]))
        return out
    # One pass per item (a direct walk), then per key: far cheaper than asking the lazy
    # stack for each key's parts and item shape.
    items = [leaf_items(t) for t in data.tensordicts]
    if items_out is not None:
        items_out.extend(items)
    if not items:
        return out
    every = dict.fromkeys(k for it in items for k in it)
    common = [k for k in every if all(k in it for it in items)]
    for key in every:
        if key not in common:
            missing = [i for i, it in enumerate(items) if key not in it]
            out[key] = _Partial(tuple(missing))
    for key in common:
        parts = [it[key] for it in items]
        if not all(isinstance(p, torch.Tensor) for p in parts):
            out[key] = next(type(p).__name__ for p in parts if not isinstance(p, torch.Tensor))
            continue
        if any(p.is_nested for p in parts):
            out[key] = "a nested tensor inside an item"
            continue
        if len({p.dtype for p in parts}) > 1:
            out[key] = "mixed dtypes"
            continue
        if len({p.ndim for p in parts}) > 1:
            out[key] = _MIXED_DIMS
            continue
        dims = zip(*(p.shape for p in parts), strict=True)
        shape = tuple(d[0] if all(x == d[0] for x in d) else RAGGED for d in dims)
        out[key] = Column(parts[0].dtype, shape)
    return out


class ItemSchema:
    """Keys, dtypes and item shapes a buffer accepts; ``violations`` says what a batch breaks.

    Example:
        >>> from tensordict import TensorDict
        >>> s = ItemSchema.of(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]))
        >>> [str(v) for v in s.violations(TensorDict({"x": torch.zeros(2, 4).long()}, batch_size=[2]))]
        ["BUF-011 key 'x': expected dtype float32, found dtype int64", "BUF-012 key 'x': expected item shape [3], found item shape [4]"]
    """

    def __init__(self, columns: dict[tuple[str, ...], Column]) -> None:
        self.columns = dict(columns)
        # The hot path of every extend: a batch that matches exactly is accepted after one
        # comparison per leaf; anything else takes the slow path that explains itself.
        self._exact: dict[tuple[str, ...], tuple[torch.dtype, tuple[int, ...]]] | None = (
            None
            if any(RAGGED in c.shape for c in self.columns.values())
            else {k: (c.dtype, c.shape) for k, c in self.columns.items()}
        )
        self._exact_by_n: dict[int, dict[tuple[str, ...], tuple[torch.dtype, torch.Size]]] = {}
        # Ragged per-token columns must match the tokens' length item by item.
        tok = LLM_LAYOUT_V1.key("tokens")
        tc = self.columns.get(tok)
        self._tok = tok if tc is not None and tc.shape[:1] == (RAGGED,) else None
        self._token_cols = [
            k for k, c in self.columns.items() if k != tok and c.shape[:1] == (RAGGED,)
        ]
        self._stack_plan = _StackPlan.of(self.columns, self._tok)

    @classmethod
    def of(cls, data: TensorDictBase, *, ragged: bool = False) -> ItemSchema:
        """The schema a first write fixes; raises :class:`ContractViolation` for bad leaves."""
        bad = batch_violations(data)
        cols: dict[tuple[str, ...], Column | str | _Partial] = {}
        if not bad:
            items: list[dict[tuple[str, ...], Any]] = []
            lazy = isinstance(data, LazyStackedTensorDict) and data.stack_dim == 0
            leaves = None if lazy else leaf_items(data)
            cols = _columns(data, leaves, items)
            bad += _fault_violations(leaves, items)
        bad += [
            Violation(k, "the key in every item", str(c), "BUF-009")
            for k, c in cols.items()
            if isinstance(c, _Partial)
        ]
        bad += [
            Violation(k, "one number of dims in every item", c, "BUF-012")
            if c == _MIXED_DIMS
            else Violation(k, "a tensor", c, "BUF-011")
            for k, c in cols.items()
            if isinstance(c, str)
        ]
        if not ragged:
            bad += [
                Violation(
                    k, "fixed item shapes (this buffer is not ragged)", c.describe(), "BUF-012"
                )
                for k, c in cols.items()
                if isinstance(c, Column) and RAGGED in c.shape
            ]
        if bad:
            raise ContractViolation(bad, "extend (buffer unchanged)")
        columns = {k: c for k, c in cols.items() if isinstance(c, Column)}
        if ragged:
            columns = _free_token_dim(columns)
        return cls(columns)

    def violations(
        self, data: Any, leaves: dict[tuple[str, ...], Any] | None = None
    ) -> list[Violation]:
        """Every way ``data`` differs from the schema (BUF-009 to BUF-012) or cannot be stored
        (:func:`leaf_violations`), without reading values."""
        bad = batch_violations(data)
        if bad:
            return bad
        per_item: list[dict[tuple[str, ...], Any]] = []
        lazy = isinstance(data, LazyStackedTensorDict) and data.stack_dim == 0
        if not lazy and leaves is None:
            leaves = leaf_items(data)
        got = _columns(data, None if lazy else leaves, per_item)
        out: list[Violation] = []
        for k, col in self.columns.items():
            c = got.get(k)
            if c is None or isinstance(c, _Partial):
                found = "no such key" if c is None else str(c)
                out.append(Violation(k, f"{col.describe()} (stored schema)", found, "BUF-009"))
            elif c == _MIXED_DIMS:
                out.append(
                    Violation(k, f"item shape {_dims(col.shape)} in every item", c, "BUF-012")
                )
            elif isinstance(c, str):
                out.append(Violation(k, f"a tensor of {col.describe()}", c, "BUF-011"))
            else:
                if c.dtype != col.dtype:
                    out.append(
                        Violation(
                            k,
                            f"dtype {dtype_name(col.dtype)}",
                            f"dtype {dtype_name(c.dtype)}",
                            "BUF-011",
                        )
                    )
                if not _shape_fits(c.shape, col.shape):
                    out.append(
                        Violation(
                            k,
                            f"item shape {_dims(col.shape)}",
                            f"item shape {_dims(c.shape)}",
                            "BUF-012",
                        )
                    )
        out += [
            Violation(
                k,
                "only keys of the stored schema",
                f"an extra key ({c}: held by the others)"
                if isinstance(c, _Partial)
                else "an extra key",
                "BUF-010",
            )
            for k, c in got.items()
            if k not in self.columns
        ]
        out += _fault_violations(None if lazy else leaves, per_item)
        if not out and self._tok is not None:
            out += self._token_length_violations(data, leaves, per_item)
        return out

    def _token_length_violations(
        self,
        data: Any,
        leaves: dict[tuple[str, ...], Any] | None,
        per_item: list[dict[tuple[str, ...], Any]],
    ) -> list[Violation]:
        tok = self._tok
        assert tok is not None
        if isinstance(data, LazyStackedTensorDict):
            items = per_item or [leaf_items(x) for x in data.tensordicts]
            where = [f"item {i} " for i in range(len(items))]
            dim = 0
        else:
            items = [leaves if leaves is not None else leaf_items(data)]
            where = [""]
            dim = 1
        out: list[Violation] = []
        toks = [li[tok].shape[dim] for li in items]
        for k in self._token_cols:
            lens = [li[k].shape[dim] for li in items]
            if lens == toks:  # the common case: one list comparison per column
                continue
            for w, t, n in zip(where, toks, lens, strict=True):
                if n != t:
                    out.append(
                        Violation(k, f"{w}length {t} (the tokens')", f"{w}length {n}", "BUF-012")
                    )
        return out

    def validated_leaves(
        self, data: Any, context: str = "extend (buffer unchanged)"
    ) -> dict[tuple[str, ...], Any]:
        """Raise one :class:`ContractViolation` listing every violation; return the leaves."""
        return self.validated_leaves_plain(data, context)[0]

    def validated_leaves_plain(
        self, data: Any, context: str = "extend (buffer unchanged)"
    ) -> tuple[dict[tuple[str, ...], Any], bool]:
        """:meth:`validated_leaves`, and whether ``data`` took the plain path: every leaf exactly a
        ``torch.Tensor`` (no subclass), dense, matching the schema at a glance.

        A buffer may write a plain batch without an undo copy: copying such leaves into
        storage of their dtype and shape cannot fail part-way.

        Example:
            >>> from tensordict import TensorDict
            >>> s = ItemSchema.of(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2]))
            >>> s.validated_leaves_plain(TensorDict({"x": torch.ones(4, 3)}, batch_size=[4]))[1]
            True
        """
        # A ragged lazy stack has no dense leaves: its columns are read item by item.
        lazy = isinstance(data, LazyStackedTensorDict)
        if lazy and self._stack_plan is not None and self._stack_plan.matches(data):
            return ({} if self._exact is None else leaf_items(data)), True
        leaves = leaf_items(data) if isinstance(data, TensorDictBase) and not lazy else {}
        if not lazy and self._matches_exactly(data, leaves):
            return leaves, True
        bad = self.violations(data, None if lazy else leaves)
        if bad:
            raise ContractViolation(bad, context)
        if lazy and self._exact is not None:  # fixed shapes: the stack densifies
            leaves = leaf_items(data)
        return leaves, False

    def _matches_exactly(self, data: Any, leaves: dict[tuple[str, ...], Any]) -> bool:
        exact = self._exact
        if (
            exact is None
            or len(leaves) != len(exact)
            or type(data) is LazyStackedTensorDict
            or data.batch_dims != 1
        ):
            return False
        n = data.batch_size[0]
        want = self._exact_by_n.get(n)
        if want is None:
            if len(self._exact_by_n) > 16:
                self._exact_by_n.clear()
            want = self._exact_by_n[n] = {
                k: (dt, torch.Size((n, *shape))) for k, (dt, shape) in exact.items()
            }
        for k, v in leaves.items():
            w = want.get(k)
            if (
                w is None
                or type(v) is not torch.Tensor
                or v.is_nested
                or v.dtype != w[0]
                or v.shape != w[1]
                or v.requires_grad
                or v.is_meta
                or v.layout is not _STRIDED
            ):
                return False
        return True

    def to_state(self) -> list[tuple[tuple[str, ...], str, tuple[int, ...]]]:
        """A picklable, ``weights_only``-loadable form."""
        return [(k, dtype_name(c.dtype), c.shape) for k, c in self.columns.items()]

    @classmethod
    def from_state(cls, state: list[Any]) -> ItemSchema:
        """Rebuild from :meth:`to_state`; a dtype is looked up by name in a closed set.

        Example:
            >>> ItemSchema.from_state([(("x",), "float32", (3,))]).columns[("x",)].dtype
            torch.float32
            >>> ItemSchema.from_state([(("x",), "manual_seed", (3,))])
            Traceback (most recent call last):
            ...
            ValueError: schema state key ('x',): expected a dtype name (bfloat16, bool, ...), found 'manual_seed'
        """
        cols = {}
        for k, d, s in state:
            dtype = DTYPES.get(d) if isinstance(d, str) else None
            if dtype is None:
                names = sorted(DTYPES)
                raise ValueError(
                    f"schema state key {tuple(k)}: expected a dtype name ({names[0]}, "
                    f"{names[1]}, ...), found {d!r}"
                )
            cols[tuple(k)] = Column(dtype, tuple(s))
        return cls(cols)


_FIXED, _SAME_AS_TOKENS, _RAGGED_FIRST, _SCALAR = 0, 1, 2, 3

_ENTRIES = attrgetter("_tensordict")
_DTYPE = attrgetter("dtype")
_REQUIRES_GRAD = attrgetter("requires_grad")
_IS_META = attrgetter("is_meta")
_LAYOUT = attrgetter("layout")
_SHAPE = attrgetter("shape")
_DIM = torch.Tensor.dim
_NUMEL = torch.Tensor.numel


@dataclass(frozen=True)
class _StackPlan:
    """The every-step check of a lazy stack of plain TensorDicts, column by column.

    Reading each column of all items at once (one ``map`` per key, then one per attribute)
    costs about a third of a walk item by item, and the stack is exactly what the schema says
    when every comparison holds. Any miss, or anything unusual (a subclass, a nested tensor, a
    non-tensor leaf), returns False and the full check explains it.

    Where the time goes: just after a TorchRL extend the items' metadata is out of the
    caches, and each attribute that lives on another cache line of a tensor costs a miss per
    leaf. ``requires_grad`` is the dearest (its own line) and is only read where the dtype
    can require grad at all: torch refuses ``requires_grad`` on integer and bool tensors,
    so a column whose dtype is checked first cannot hold one. Each sub-TensorDict's entries
    are fetched once, and its children read from them, rather than walking every key's path
    from the root.
    """

    nodes: tuple[tuple[tuple[str, ...], int], ...]  # (path of a sub-TensorDict, its entries)
    cols: tuple[tuple[tuple[str, ...], torch.dtype, int, Any, bool], ...]  # tokens first

    @classmethod
    def of(
        cls, columns: dict[tuple[str, ...], Column], tok: tuple[str, ...] | None
    ) -> _StackPlan | None:
        # Parents enter before their children (k[:i] for rising i): the walk relies on it.
        children: dict[tuple[str, ...], set[str]] = {(): set()}
        for k in columns:
            for i in range(len(k)):
                children.setdefault(k[:i], set()).add(k[i])
        cols: list[tuple[tuple[str, ...], torch.dtype, int, Any, bool]] = []
        for k, c in sorted(columns.items(), key=lambda kc: kc[0] != tok):
            grad = c.dtype.is_floating_point or c.dtype.is_complex
            if not c.shape:
                cols.append((k, c.dtype, _SCALAR, None, grad))
            elif RAGGED not in c.shape:
                cols.append((k, c.dtype, _FIXED, torch.Size(c.shape), grad))
            elif RAGGED in c.shape[1:]:
                return None  # a ragged inner dim: rare, left to the full check
            elif tok is not None and k != tok and c.shape == columns[tok].shape:
                cols.append((k, c.dtype, _SAME_AS_TOKENS, None, grad))
            elif tok is not None and k != tok:
                return None  # tied to the tokens' length with other inner dims: full check
            else:
                cols.append((k, c.dtype, _RAGGED_FIRST, torch.Size(c.shape[1:]), grad))
        return cls(tuple((p, len(ch)) for p, ch in children.items()), tuple(cols))

    def matches(self, data: LazyStackedTensorDict) -> bool:
        if type(data) is not LazyStackedTensorDict or data.stack_dim != 0 or data.batch_dims != 1:
            return False
        tds = data.tensordicts
        n = len(tds)
        try:
            entries: dict[tuple[str, ...], list[Any]] = {}
            for path, count in self.nodes:
                nodes = list(map(itemgetter(path[-1]), entries[path[:-1]])) if path else tds
                # list.count compares by identity first: cheaper than building a set.
                if list(map(type, nodes)).count(TensorDict) != n:
                    return False
                found = list(map(_ENTRIES, nodes))
                if list(map(len, found)).count(count) != n:
                    return False
                entries[path] = found
            tok_shapes: list[torch.Size] = []
            tok_lens: list[int] = []
            for key, dtype, kind, want, grad in self.cols:
                col = list(map(itemgetter(key[-1]), entries[key[:-1]]))
                if (
                    list(map(type, col)).count(torch.Tensor) != n
                    or list(map(_DTYPE, col)).count(dtype) != n
                ):
                    return False
                # What a leaf must be whatever the schema.
                if (
                    (grad and any(map(_REQUIRES_GRAD, col)))
                    or any(map(_IS_META, col))
                    or list(map(_LAYOUT, col)).count(_STRIDED) != n
                ):
                    return False
                if kind == _SCALAR:
                    if any(map(_DIM, col)):  # the method is read faster than shape or ndim
                        return False
                    continue
                if (kind == _RAGGED_FIRST and not want) or (kind == _SAME_AS_TOKENS and tok_lens):
                    # 1-D per-token columns: dim() and numel() are read ~2x faster than shape
                    # (no torch.Size built), and numel is the length where dim is 1.
                    if list(map(_DIM, col)).count(1) != n:
                        return False
                    lens = list(map(_NUMEL, col))
                    if kind == _SAME_AS_TOKENS and lens != tok_lens:
                        return False
                    if not tok_lens and not tok_shapes:
                        tok_lens = lens  # the first column is the tokens' where there are any
                    continue
                shapes = list(map(_SHAPE, col))  # raises RuntimeError for a nested tensor
                if kind == _FIXED:
                    if shapes.count(want) != n:
                        return False
                elif kind == _SAME_AS_TOKENS:
                    if shapes != tok_shapes:
                        return False
                elif set(map(len, shapes)) != {len(want) + 1} or {s[1:] for s in shapes} != {want}:
                    return False
                if not tok_shapes and not tok_lens:
                    tok_shapes = shapes  # the first column is the tokens' where there are any
        except (KeyError, AttributeError, RuntimeError, TypeError):
            return False
        return n > 0


def _shape_fits(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return len(got) == len(want) and all(
        w == RAGGED or g == w for g, w in zip(got, want, strict=True)
    )


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("ragged" if d == RAGGED else str(d) for d in shape) + "]"
