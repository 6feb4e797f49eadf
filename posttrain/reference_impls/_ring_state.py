"""The reference ring's saved state, checked whole before the buffer changes: every key
``RingBuffer.state_dict()`` writes, consistent with the others, or ``ValueError`` naming the
first key that is off (what was expected, what was found)."""

from __future__ import annotations

from typing import Any

import torch

from posttrain._state_checks import (
    bad,
    checked_int,
    checked_tensor,
    distinct_indices,
    schema_from_state,
)
from posttrain.reference_impls._ring_rows import layout, new_rows, row_bytes, used_bytes

STATE_KEYS = (
    "capacity",
    "sampling",
    "schema",
    "rows",
    "cursor",
    "len",
    "write_count",
    "rng",
    "epoch",
)
"""The keys of ``RingBuffer.state_dict()``, every one required."""


def checked_state(state: Any, capacity: int) -> dict[str, Any]:
    """``state`` checked whole, its ints as ints and its schema parsed, or ``ValueError`` naming
    the first key that is off (what was expected, what was found)."""
    if not isinstance(state, dict):
        raise bad("state_dict", "a dict (RingBuffer.state_dict()'s output)", type(state).__name__)
    missing = [k for k in STATE_KEYS if k not in state]
    extra = sorted(str(k) for k in state if k not in STATE_KEYS)
    if missing or extra:
        raise ValueError(
            f"state_dict: expected keys {list(STATE_KEYS)} (RingBuffer.state_dict()'s output), "
            f"found {'missing ' + str(missing) if missing else ''}"
            f"{' and ' if missing and extra else ''}{'extra ' + str(extra) if extra else ''}"
        )
    out = dict(state)
    if isinstance(out["capacity"], bool) or out["capacity"] != capacity:
        raise bad("state_dict['capacity']", str(capacity), out["capacity"])
    if out["sampling"] not in ("with_replacement", "without_replacement"):
        raise bad(
            "state_dict['sampling']", "'with_replacement' or 'without_replacement'", out["sampling"]
        )
    wc = out["write_count"] = checked_int(out["write_count"], "state_dict['write_count']", 0)
    n = out["len"] = checked_int(out["len"], "state_dict['len']", 0, capacity)
    if n != min(capacity, wc):
        raise bad("state_dict['len']", f"min(capacity, write_count) = {min(capacity, wc)}", n)
    cursor = out["cursor"] = checked_int(out["cursor"], "state_dict['cursor']", 0, capacity - 1)
    if cursor != wc % capacity:
        raise bad(
            "state_dict['cursor']",
            f"len ({n}) while the ring is not full"
            if n < capacity
            else f"write_count % capacity = {wc % capacity}",
            cursor,
        )
    out["schema"] = schema_from_state(out["schema"], "state_dict['schema']")
    if out["rows"] is not None:
        checked_tensor(out["rows"], "state_dict['rows']")
    _check_rng(out["rng"])
    out["epoch"] = distinct_indices(out["epoch"], "state_dict['epoch']", n)
    return out


def _check_rng(rng: Any) -> None:
    try:
        if not isinstance(rng, torch.Tensor):
            raise TypeError
        checked_tensor(rng, "state_dict['rng']")
        torch.Generator(device="cpu").set_state(rng)
    except (TypeError, RuntimeError, ValueError):
        found = (
            f"a tensor of {rng.dtype} {list(rng.shape)}" if isinstance(rng, torch.Tensor) else rng
        )
        raise bad("state_dict['rng']", "a CPU torch.Generator state", found) from None


def restored_ring(st: dict[str, Any], capacity: int, device: torch.device) -> torch.Tensor | None:
    """A new ring of ``capacity`` rows holding the rows of ``st`` (:func:`checked_state`'s
    output), its padding zero; ``None`` for a state without a schema (and so without rows)."""
    schema = st["schema"]
    if schema is None:
        if st["len"] or st["rows"] is not None:
            raise ValueError(
                f"state_dict['rows']: expected none without a schema, found len {st['len']}"
            )
        return None
    want = (st["len"], row_bytes(layout(schema)))
    rows = st["rows"]
    if rows is None or tuple(rows.shape) != want or rows.dtype != torch.uint8:
        found = "None" if rows is None else f"{rows.dtype} {list(rows.shape)}"
        raise ValueError(
            f"state_dict['rows']: expected uint8 {list(want)} (len x the schema's row "
            f"bytes), found {found}"
        )
    columns = layout(schema)
    ring = new_rows(capacity, columns, device)
    ring[: st["len"]].copy_(rows)
    # A row's padding is zero, whatever a file written elsewhere holds there.
    ring[:, used_bytes(columns) :].zero_()
    return ring
