"""Checking a TensorDict against a layout: every violation at once, metadata first."""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._dtypes import DTYPES, dtype_name
from posttrain.contracts.keys import key_str, leaf_items, norm_key
from posttrain.contracts.requirements import Level, Requirement
from posttrain.errors import PosttrainError

LAYOUT_REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        id="LAY-001",
        level=Level.MUST,
        title="required keys present",
        text="A TensorDict MUST hold every field the consumer requires, under its (remapped) key.",
    ),
    Requirement(
        id="LAY-002",
        level=Level.MUST,
        title="exact dtype",
        text="Each field MUST have exactly its layout dtype (masks are bool); `Layout.validate_batch` "
        "casts nothing. Every consumer refuses an integer or bool field (tokens, masks, ids) in any "
        "other dtype; a consumer that casts float fields to its own precision MAY accept them "
        "in any floating dtype (float64, bfloat16, float16: `any_float=True`) and MUST then "
        "compute as with the same values in the layout dtype.",
    ),
    Requirement(
        id="LAY-003",
        level=Level.MUST,
        title="shape",
        text="Each field MUST have one of its symbolic shapes, 'B' being the TensorDict's batch "
        "dims and every other symbol ('T') agreeing across fields.",
    ),
    Requirement(
        id="LAY-004",
        level=Level.MUST,
        title="assistant mask within attention mask",
        text="The assistant mask MUST be True only where the attention mask is True.",
    ),
    Requirement(
        id="LAY-005",
        level=Level.MUST,
        title="data is detached",
        text="Fields MUST NOT require grad: they are data, not part of the consumer's graph.",
    ),
    Requirement(
        id="LAY-006",
        level=Level.MUST,
        title="no unexpected keys (strict)",
        text="Where a consumer is strict (a buffer's stored schema), a TensorDict MUST NOT hold "
        "keys outside the schema.",
    ),
    Requirement(
        id="LAY-007",
        level=Level.SHOULD,
        title="log-probs finite where read",
        text="Log-probs SHOULD be finite and <= 0 wherever their mask is True.",
    ),
)


@dataclass(frozen=True)
class Violation:
    """One broken rule: which key, what was expected, what was found, and the requirement id.

    Example:
        >>> v = Violation(("advantage",), "dtype float32", "dtype float64", "LAY-002")
        >>> str(v)
        "LAY-002 key 'advantage': expected dtype float32, found dtype float64"
    """

    key: tuple[str, ...]
    expected: str
    found: str
    requirement: str

    def __str__(self) -> str:
        where = f"key {key_str(self.key)}" if self.key else "the batch"
        return f"{self.requirement} {where}: expected {self.expected}, found {self.found}"


class ContractViolation(PosttrainError, ValueError):
    """Raised when data breaks a contract; the message lists every violation, one per line.

    Example:
        >>> from tensordict import TensorDict
        >>> from posttrain.contracts import LLM_LAYOUT_V1
        >>> try:
        ...     LLM_LAYOUT_V1.validate_batch(TensorDict({}, batch_size=[2]))
        ... except ContractViolation as e:
        ...     print(e.violations[0].requirement, e.violations[0].key)
        LAY-001 ('tokens', 'full')
    """

    def __init__(self, violations: list[Violation], context: str = "") -> None:
        self.violations = list(violations)
        self.context = context
        head = f"{context}: " if context else ""
        lines = [f"{head}{len(self.violations)} contract violation(s)"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled across processes (a Ray actor's error) it must rebuild from its violations,
        # not from the formatted message Exception would hand back to __init__.
        return (type(self), (self.violations, self.context))

    @property
    def requirement_ids(self) -> list[str]:
        """The ids of the violated requirements, in report order, without repeats."""
        return list(dict.fromkeys(v.requirement for v in self.violations))


class FieldSpec(Protocol):
    """What validation reads of a layout field (:class:`~posttrain.contracts.layout.LayoutField`)."""

    @property
    def name(self) -> str: ...
    @property
    def key(self) -> tuple[str, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shapes(self) -> tuple[tuple[str, ...], ...]: ...
    @property
    def required(self) -> bool: ...
    @property
    def read_where(self) -> str | None: ...


class LayoutSpec(Protocol):
    """What validation reads of a layout (:class:`~posttrain.contracts.layout.Layout`, which
    imports this module: the layout's methods run the checks written here)."""

    @property
    def fields(self) -> tuple[FieldSpec, ...]: ...
    @property
    def implies(self) -> tuple[tuple[str, str], ...]: ...
    def field(self, name: str) -> FieldSpec: ...


_RAGGED = -1


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("ragged" if d == _RAGGED else str(d) for d in shape) + "]"


def _fmt_symbolic(shape: tuple[str, ...]) -> str:
    return "[" + ", ".join("*B" if s == "B" else s for s in shape) + "]"


class _ItemsDiffer(PosttrainError):
    """A lazy stack's items disagree on a key: (requirement, expected suffix, found)."""


def _meta(td: TensorDictBase, key: tuple[str, ...]) -> tuple[torch.dtype, tuple[int, ...], bool]:
    """dtype, shape (ragged dims as -1) and requires_grad, without touching the values."""
    if isinstance(td, LazyStackedTensorDict):
        # Each item answers for itself: the stack's own view of a key is its first item's
        # dtype, and an item without the key is not noticed.
        parts = [x.get(key, None) for x in td.tensordicts]
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise _ItemsDiffer("LAY-001", "in every item", f"missing from items {missing}")
        dtypes = list(dict.fromkeys(p.dtype for p in parts))  # in the items' order
        if len(dtypes) > 1:
            by = {dtype_name(d): [i for i, p in enumerate(parts) if p.dtype == d] for d in dtypes}
            raise _ItemsDiffer("LAY-002", "in every item", f"dtypes {by} (by items)")
        # A lazy stack of unequal items cannot be densified; ask it for the shape instead.
        shape = tuple(int(d) for d in td.get_item_shape(key))
        return parts[0].dtype, shape, any(p.requires_grad for p in parts)
    return _tensor_meta(td.get(key))


def _tensor_meta(t: Any) -> tuple[torch.dtype, tuple[int, ...], bool]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{type(t).__name__}")
    if t.is_nested:
        shape = tuple(s if type(s) is int else _RAGGED for s in t.shape)
        return t.dtype, shape, t.requires_grad
    return t.dtype, tuple(t.shape), t.requires_grad


def layout_violations(
    td: TensorDictBase,
    layout: LayoutSpec,
    *,
    require: tuple[str, ...] = (),
    strict: bool = False,
    ragged: bool = False,
    deep: bool = False,
    any_float: bool = False,
) -> list[Violation]:
    """Every violation of ``layout`` by ``td`` (:meth:`Layout.violations`, which says more)."""
    plain = type(td) is TensorDict  # skips two abstract-class isinstance checks per call
    quick = (
        _flat_signature(td, layout, require, strict, ragged, any_float)
        if plain and not deep
        else None
    )
    if quick is not None and quick == _LAST_VALID[0][0]:
        return []  # the every-step case: shaped exactly like the batch validated last
    if not plain and not isinstance(td, TensorDictBase):
        raise TypeError(f"expected a TensorDict, found {type(td).__name__}")
    if td.batch_dims < 1:
        return [
            Violation(
                (), "at least one batch dim [B]", f"batch_size {list(td.batch_size)}", "LAY-003"
            )
        ]
    for name in require:
        layout.field(name)
    lazy = not plain and isinstance(td, LazyStackedTensorDict)
    leaves = None if lazy else leaf_items(td)
    memo = (
        (None if quick is None else tuple(quick))
        if plain
        else None
        if leaves is None or deep
        else _signature(leaves, layout, require, strict, ragged, any_float, td)
    )
    if memo is not None and memo in _VALID:
        if quick is not None:
            _LAST_VALID[0] = (quick, layout)
        return []
    present = _present_keys(td, leaves, lazy)
    required = set(require) | {f.name for f in layout.fields if f.required}
    out, ok_fields = _field_violations(
        td, leaves, layout, required, present, ragged=ragged, any_float=any_float
    )
    if strict:
        known = {f.key for f in layout.fields}
        for k in sorted(present - known):
            out.append(
                Violation(k, "no key outside the layout (strict)", "an unexpected key", "LAY-006")
            )
    if deep:
        out += _deep(td, layout, {f.name for f in ok_fields})
    if memo is not None and not out:
        _remember_valid(memo, quick, layout)
    return out


def _present_keys(
    td: TensorDictBase, leaves: dict[tuple[str, ...], Any] | None, lazy: bool
) -> set[tuple[str, ...]]:
    """Every leaf key of ``td``; of a lazy stack, every item's (a key some items lack is then
    named by :func:`_meta`)."""
    if leaves is not None:
        return set(leaves)
    if lazy:
        return {
            norm_key(k)
            for x in td.tensordicts
            for k in x.keys(include_nested=True, leaves_only=True)
        }
    return {norm_key(k) for k in td.keys(include_nested=True, leaves_only=True)}


def _field_violations(
    td: TensorDictBase,
    leaves: dict[tuple[str, ...], Any] | None,
    layout: LayoutSpec,
    required: set[str],
    present: set[tuple[str, ...]],
    *,
    ragged: bool,
    any_float: bool,
) -> tuple[list[Violation], list[FieldSpec]]:
    """Each field's presence (LAY-001), dtype (LAY-002), shape (LAY-003) and grad (LAY-005),
    in the layout's order; and the fields whose dtype and shape hold (what ``deep`` reads)."""
    batch = tuple(td.batch_size)
    out: list[Violation] = []
    bound: dict[str, tuple[int, tuple[str, ...]]] = {}  # symbol -> (size, key that fixed it)
    ok_fields: list[FieldSpec] = []
    for f in layout.fields:
        if f.key not in present:
            if f.name in required:
                out.append(
                    Violation(
                        f.key,
                        f"{f.name} ({f.dtype} {_fmt_symbolic(f.shapes[0])})",
                        "no such key",
                        "LAY-001",
                    )
                )
            continue
        try:
            dtype, shape, grad = _meta(td, f.key) if leaves is None else _tensor_meta(leaves[f.key])
        except TypeError as e:
            out.append(Violation(f.key, "a tensor", str(e), "LAY-003"))
            continue
        except _ItemsDiffer as e:
            rid, where, found = e.args
            expected = f"dtype {f.dtype}" if rid == "LAY-002" else f.name
            out.append(Violation(f.key, f"{expected} {where}", found, rid))
            continue
        found = _leaf_violations(f, dtype, shape, grad, batch, bound, ragged, any_float)
        out += found
        if not any(v.requirement in ("LAY-002", "LAY-003") for v in found):
            ok_fields.append(f)
    return out, ok_fields


def _leaf_violations(
    f: FieldSpec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    grad: bool,
    batch: tuple[int, ...],
    bound: dict[str, tuple[int, tuple[str, ...]]],
    ragged: bool,
    any_float: bool,
) -> list[Violation]:
    """One present field's dtype, shape and grad against the layout."""
    out: list[Violation] = []
    want = DTYPES[f.dtype]
    if dtype != want and not (any_float and dtype.is_floating_point and want.is_floating_point):
        out.append(Violation(f.key, f"dtype {f.dtype}", f"dtype {dtype_name(dtype)}", "LAY-002"))
    shape_problem = _match_shape(f, shape, batch, bound, ragged)
    if shape_problem is not None:
        out.append(Violation(f.key, shape_problem[0], shape_problem[1], "LAY-003"))
    if grad:
        out.append(
            Violation(
                f.key, "a detached tensor (requires_grad=False)", "requires_grad=True", "LAY-005"
            )
        )
    return out


def _remember_valid(memo: tuple[Any, ...], quick: list[Any] | None, layout: LayoutSpec) -> None:
    """Keep a valid batch's signature, so the next batch shaped like it skips the walk."""
    if len(_VALID) >= _VALID_MAX:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):  # another thread
            _VALID.pop(next(iter(_VALID)))
    _VALID[memo] = layout  # holding the layout keeps its id from being reused
    if quick is not None:
        _LAST_VALID[0] = (quick, layout)


# Metadata-only validation is a function of each leaf's dtype, shape and requires_grad, so
# a batch shaped like one already found valid needs no second look (the every-step case).
_VALID: dict[tuple[Any, ...], LayoutSpec] = {}
_VALID_MAX = 256


def _signature(
    leaves: dict[tuple[str, ...], Any],
    layout: LayoutSpec,
    require: tuple[str, ...],
    strict: bool,
    ragged: bool,
    any_float: bool,
    td: TensorDictBase,
) -> tuple[Any, ...] | None:
    sig: list[Any] = [id(layout), tuple(require), strict, ragged, any_float, type(td)]
    sig.append(td.batch_size)
    append = sig.append  # this runs on every extend: one append per leaf, no temporary lists
    for k, v in leaves.items():
        if type(v) is not torch.Tensor or v.is_nested:
            return None
        append((k, v.dtype, v.shape, v.requires_grad))
    return tuple(sig)


def _flat_signature(
    td: TensorDict,
    layout: LayoutSpec,
    require: tuple[str, ...],
    strict: bool,
    ragged: bool,
    any_float: bool = False,
) -> list[Any] | None:
    """What metadata validation of a plain TensorDict depends on, as one flat list.

    Keys, then for a tensor (dtype, shape, requires_grad), for a sub-TensorDict its entries
    and a closing ``None``: ~4 us for the LLM layout, ~6 us just after an extend evicted the
    leaves' metadata from the caches. ``None`` for anything else (a subclass, a non-tensor
    leaf, a nested tensor, whose ``shape`` raises), which takes the full path.
    """
    req = require if type(require) is tuple else tuple(require)
    sig: list[Any] = [id(layout), req, strict, ragged, any_float, td.batch_size]
    try:
        _flat_walk(td, sig)
    except (_NoSignature, AttributeError, RuntimeError):
        # AttributeError: tensordict's internals moved; RuntimeError: a nested tensor's shape
        return None
    return sig


class _NoSignature(PosttrainError):
    pass


# One C call reads a tensor's three attributes: ~0.1 us less per leaf than three reads from
# Python, most of it when the tensor's metadata is out of cache (as just after an extend).
_LEAF_META = operator.attrgetter("dtype", "shape", "requires_grad")
_TENSOR = torch.Tensor  # one global lookup, not a module attribute, per leaf


def _flat_walk(td: Any, out: list[Any]) -> None:
    for k, v in td._tensordict.items():
        t = type(v)
        if t is _TENSOR:
            out.append(k)
            out.append(_LEAF_META(v))
        elif t is TensorDict:
            out.append(k)
            _flat_walk(v, out)
            out.append(None)
        else:
            raise _NoSignature


# The signature validated last (with its layout, whose id it holds): compared first, as a
# list, which skips building and hashing a tuple of it on every step.
_LAST_VALID: list[tuple[list[Any] | None, LayoutSpec | None]] = [(None, None)]


def _match_shape(
    f: FieldSpec,
    shape: tuple[int, ...],
    batch: tuple[int, ...],
    bound: dict[str, tuple[int, tuple[str, ...]]],
    ragged: bool,
) -> tuple[str, str] | None:
    expected = " or ".join(_fmt_symbolic(s) for s in f.shapes)
    where = f"batch dims {list(batch)}"
    for sym in f.shapes:
        trailing = sym[1:]
        if len(shape) != len(batch) + len(trailing) or shape[: len(batch)] != batch:
            continue
        new: dict[str, tuple[int, tuple[str, ...]]] = {}
        for s, d in zip(trailing, shape[len(batch) :], strict=False):
            if d == _RAGGED:
                if not ragged:
                    return (f"{expected} with {s} fixed (not ragged)", f"shape {_fmt_shape(shape)}")
                continue
            prev = bound.get(s) or new.get(s)
            if prev is not None and prev[0] != d:
                return (
                    f"{expected} with {s}={prev[0]} as at key {key_str(prev[1])}",
                    f"shape {_fmt_shape(shape)} ({s}={d})",
                )
            if prev is None:
                new[s] = (d, f.key)
        bound.update(new)
        return None
    return (f"{expected} ({where})", f"shape {_fmt_shape(shape)}")


def _deep(td: TensorDictBase, layout: LayoutSpec, ok: set[str]) -> list[Violation]:
    out: list[Violation] = []
    if isinstance(td, LazyStackedTensorDict):
        items: list[TensorDictBase] = list(td.tensordicts)
    else:
        items = [td]
    for a, b in layout.implies:
        if a in ok and b in ok:
            fa, fb = layout.field(a), layout.field(b)
            bad = sum(int((t.get(fa.key) & ~t.get(fb.key)).sum()) for t in items)
            if bad:
                out.append(
                    Violation(
                        fa.key,
                        f"True only where {key_str(fb.key)} is True",
                        f"{bad} position(s) outside it",
                        "LAY-004",
                    )
                )
    for f in layout.fields:
        if (
            f.read_where is None
            or f.name not in ok
            or f.read_where not in ok
            or not f.dtype.startswith("float")
        ):
            continue
        mask_key = layout.field(f.read_where).key
        bad = 0
        for t in items:
            v = t.get(f.key)[t.get(mask_key)]
            bad += int((~torch.isfinite(v) | (v > 0)).sum())
        if bad:
            out.append(
                Violation(
                    f.key,
                    f"finite values <= 0 where {key_str(mask_key)}",
                    f"{bad} value(s) that are not",
                    "LAY-007",
                )
            )
    return out
