"""Checks a buffer's ``load_state_dict`` runs on a whole state before it changes anything.

A state may come from a file someone else wrote: every field is read against a closed set of
shapes and values (dtypes by name from a fixed table, never ``getattr(torch, name)``), and a
refusal is one ``ValueError`` naming the key, what was expected and what was found.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import Any

import torch

from posttrain._dtypes import DTYPES, STORABLE, dtype_name
from posttrain.contracts.keys import key_str
from posttrain.contracts.schema import RAGGED, Column, ItemSchema


def _short(found: object) -> str:
    text = repr(found)
    return text if len(text) <= 120 else text[:117] + "..."


def bad(where: str, expected: str, found: object) -> ValueError:
    """The refusal of one field: ``<where>: expected <expected>, found <found>``.

    Example:
        >>> str(bad("state_dict['len']", "an int in [0, 4]", 9))
        "state_dict['len']: expected an int in [0, 4], found 9"
    """
    return ValueError(f"{where}: expected {expected}, found {_short(found)}")


def checked_int(value: Any, where: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int within ``[lo, hi]`` (bools refused), or :func:`bad`.

    Example:
        >>> checked_int(3, "cursor", 0, 7)
        3
        >>> checked_int(-1, "cursor", 0, 7)
        Traceback (most recent call last):
        ...
        ValueError: cursor: expected an int in [0, 7], found -1
    """
    span = (
        f"an int in [{lo}, {hi}]"
        if lo is not None and hi is not None
        else f"an int >= {lo}"
        if lo is not None
        else "an int"
    )
    if isinstance(value, (bool, torch.Tensor)):
        raise bad(where, span, value)
    try:
        n = operator.index(value)
    except TypeError:
        raise bad(where, span, value) from None
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        raise bad(where, span, value)
    return n


def checked_tensor(value: Any, where: str) -> torch.Tensor:
    """``value`` if it is a plain dense tensor with data (not meta, sparse or grad-requiring).

    Example:
        >>> checked_tensor(torch.zeros(2, device="meta"), "rows")
        Traceback (most recent call last):
        ...
        ValueError: rows: expected a dense tensor holding data, found a tensor on the meta device
    """
    if not isinstance(value, torch.Tensor):
        raise bad(where, "a tensor", type(value).__name__)
    why = (
        "a tensor on the meta device"
        if value.device.type == "meta" or value.is_meta
        else f"a tensor of layout {value.layout}"
        if value.layout != torch.strided
        else "a nested tensor"
        if value.is_nested
        else "a tensor that requires grad"
        if value.requires_grad
        else None
    )
    if why is not None:
        raise ValueError(f"{where}: expected a dense tensor holding data, found {why}")
    return value


def unreal(t: torch.Tensor) -> str | None:
    """Why ``t`` holds no data a buffer could store (a FakeTensor, a meta tensor), or None.

    Only a tensor of a subclass is looked at closely: a plain ``torch.Tensor`` off ``meta``
    holds its data (the write path's case, one type test).

    Example:
        >>> unreal(torch.zeros(1)) is None, unreal(torch.zeros(1, device="meta"))
        (True, 'a tensor on the meta device')
    """
    if type(t) is not torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return f"a {type(t).__name__} (no data: made under a fake or tracing mode)"
    if t.is_meta:
        return "a tensor on the meta device"
    return None


def refuse_unreal(leaves: Iterable[tuple[tuple[str, ...], Any]], context: str) -> None:
    """Refuse a batch with a leaf that holds no data (:func:`unreal`), naming the key.

    ``leaves``: (tuple key, leaf) pairs; a key may come more than once (a stack's items).

    Example:
        >>> refuse_unreal([(("x",), torch.zeros(1, device="meta"))], "extend")
        Traceback (most recent call last):
        ...
        ValueError: extend: key 'x': expected a tensor holding data, found a tensor on the meta device
    """
    plain = torch.Tensor
    for k, t in leaves:
        # Every extend runs this: one type test per plain leaf, unreal() only for the others.
        if type(t) is plain and not t.is_meta:
            continue
        why = unreal(t) if isinstance(t, plain) else None
        if why is not None:
            raise ValueError(
                f"{context}: key {key_str(k)}: expected a tensor holding data, found {why}"
            )


def refuse_unstorable(leaves: Iterable[tuple[tuple[str, ...], Any]], context: str) -> None:
    """Refuse a first batch with a leaf of a dtype outside :data:`STORABLE` (what a load
    accepts) or one that holds no data, naming the key.

    Example:
        >>> refuse_unstorable([(("x",), torch.zeros(1, dtype=torch.uint16))], "extend")
        Traceback (most recent call last):
        ...
        ValueError: extend: key 'x': expected a dtype of bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, complex64, complex128 (what a checkpoint can hold), found uint16
    """
    leaves = list(leaves)
    refuse_unreal(leaves, context)
    for k, t in leaves:
        if isinstance(t, torch.Tensor) and t.dtype not in STORABLE:
            raise ValueError(
                f"{context}: key {key_str(k)}: expected a dtype of {', '.join(DTYPES)} (what a "
                f"checkpoint can hold), found {dtype_name(t.dtype)}"
            )


def distinct_indices(value: Any, where: str, length: int) -> list[int]:
    """``value`` (a list or 1-D integer tensor) as distinct ints in ``[0, length)``: the part of
    an epoch's permutation not drawn yet.

    Example:
        >>> distinct_indices([2, 0], "epoch", 3)
        [2, 0]
        >>> distinct_indices([0, 0, 1], "epoch", 3)
        Traceback (most recent call last):
        ...
        ValueError: epoch: expected a list of ints in [0, 3), each once (the rest of a permutation), found [0, 0, 1]
    """
    what = f"a list of ints in [0, {length}), each once (the rest of a permutation)"
    if isinstance(value, torch.Tensor):
        t = checked_tensor(value, where)
        if t.ndim != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise bad(where, what, f"a tensor of {t.dtype} {list(t.shape)}")
        items: list[Any] = t.tolist()
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise bad(where, what, type(value).__name__)
    out: list[int] = []
    for i in items:
        try:
            out.append(checked_int(i, where, 0, length - 1))
        except ValueError:
            raise bad(where, what, items) from None
    if len(set(out)) != len(out):
        raise bad(where, what, items)
    return out


def schema_from_state(state: Any, where: str) -> ItemSchema | None:
    """The ``ItemSchema`` a saved ``ItemSchema.to_state()`` describes, every field checked.

    Keys are non-empty tuples of strings, each once; dtypes come from :data:`DTYPES`; item
    dims are ints >= 0 (or ``RAGGED``). ``None`` stays ``None`` (nothing written yet).

    Example:
        >>> schema_from_state([(("x",), "float32", (3,))], "schema").columns
        {('x',): Column(dtype=torch.float32, shape=(3,))}
        >>> schema_from_state([(("x",), "manual_seed", ())], "schema")
        Traceback (most recent call last):
        ...
        ValueError: schema: expected ItemSchema.to_state()'s output, found entry 0 ('x',): expected a dtype name of bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, complex64, complex128, found 'manual_seed'
    """
    if state is None:
        return None
    try:
        return _schema(state)
    except ValueError as e:
        raise ValueError(f"{where}: expected ItemSchema.to_state()'s output, found {e}") from None


def _schema(state: Any) -> ItemSchema:
    where = "entry"
    if not isinstance(state, list | tuple) or not state:
        raise bad(where, "a non-empty list of (key, dtype name, item shape)", state)
    columns: dict[tuple[str, ...], Column] = {}
    for i, entry in enumerate(state):
        at = f"{where} {i}"
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise bad(at, "(key, dtype name, item shape)", entry)
        key, dtype, shape = entry
        if (
            not isinstance(key, list | tuple)
            or not key
            or not all(isinstance(p, str) and p for p in key)
        ):
            raise bad(at, "a key: a non-empty tuple of non-empty strings", key)
        k = tuple(key)
        at = f"{at} {k}"
        if k in columns:
            raise bad(at, "each key once", "a repeated key")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise bad(at, f"a dtype name of {', '.join(DTYPES)}", dtype)
        if not isinstance(shape, list | tuple):
            raise bad(at, "an item shape: a tuple of ints >= 0 or -1 (ragged)", shape)
        dims = tuple(checked_int(d, f"{at} item shape", RAGGED) for d in shape)
        columns[k] = Column(DTYPES[dtype], dims)
    flat = sorted(columns)
    for a, b in itertools.pairwise(flat):
        if b[: len(a)] == a:  # ('x',) and ('x', 'y'): a leaf cannot also be a sub-dict
            raise bad(f"key {b}", f"no key below the leaf {a}", b)
    return ItemSchema(columns)
