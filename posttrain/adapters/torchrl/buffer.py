"""Validate-then-write around a TorchRL replay buffer: metadata checks, a copy only where
TorchRL would keep the caller's tensors."""

from __future__ import annotations

import copy
import operator
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._checkpoint import CheckpointError, load_verified, save_state
from posttrain._state_checks import (
    bad,
    checked_int,
    checked_tensor,
    distinct_indices,
    refuse_unreal,
    refuse_unstorable,
    schema_from_state,
)
from posttrain.adapters.torchrl._state_keys import decode_columns, flat_columns, flat_name
from posttrain.contracts.buffer import sample_size, storage_indices
from posttrain.contracts.schema import RAGGED, ItemSchema, batch_violations
from posttrain.contracts.validation import ContractViolation
from posttrain.errors import PosttrainError

_STATE_FILE = "validated_replay_buffer.pt"


class ValidatedReplayBuffer:
    """Makes a TorchRL ``ReplayBuffer`` conform to ``ReplayBufferV1``.

    TorchRL 0.14's ``extend`` is not atomic and accepts batches that do not match what is
    stored (a missing key is left uninitialised or zero-filled, an extra key is added or
    dropped, a wrong dtype or shape fails half-way). This adapter fixes the schema at the first
    write and checks every later batch against it (keys, dtypes, item shapes: metadata only)
    before handing it, untouched, to the wrapped buffer. Everything else is delegated.

    TorchRL's list storages (``ListStorage``, ``LazyStackStorage``) keep the caller's tensors
    and hand the stored ones out on sample, so a caller writing into a batch after ``extend``,
    or into a sample, would change stored items. Over such a storage the adapter copies the
    batch before the write and every sample and read (the contract's promise). A caller that
    hands its batches over for good and never writes into a sample can pass ``copy=False``:
    the buffer then shares those tensors with its callers, as TorchRL's does (~3 ms saved
    per extend of 64 ragged items, see docs/benchmarks.md). Tensor storages always write into
    memory of their own, whatever ``copy`` says.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> rb = ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(8)))
        >>> rb.extend(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])).tolist()
        [0, 1]
        >>> rb.extend(TensorDict({"y": torch.zeros(2, 3)}, batch_size=[2]))
        Traceback (most recent call last):
        ...
        posttrain.contracts.validation.ContractViolation: extend (buffer unchanged): 2 contract violation(s)
          - BUF-009 key 'x': expected float32 [3] (stored schema), found no such key
          - BUF-010 key 'y': expected only keys of the stored schema, found an extra key
        >>> len(rb)
        2
    """

    def __init__(self, rb: Any, *, ragged: bool = False, copy: bool = True) -> None:
        self.rb = rb
        self.ragged = ragged
        self._schema: ItemSchema | None = None
        # (schema, flat signature) of the last batch that schema took down its plain path.
        self._plain: tuple[ItemSchema, list[Any]] | None = None
        self._lock = threading.Lock()
        self._copy_in = copy and _keeps_references(rb)
        # What undoes a failed write reads the write position as a round-robin cursor.
        self._undoable = _round_robin(rb)

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Check ``data`` against the stored schema, then extend the wrapped buffer.

        Besides keys, dtypes and item shapes, a leaf on ``meta``, a sparse (non-strided) leaf
        and one that requires grad are refused, naming the key; a leaf on another device than
        the storage's is copied across by TorchRL. Should TorchRL's write fail anyway, the
        writer's cursor and count, the storage's length (a first write: its allocation) and
        the stored schema are put back, and so are the items it overwrote: a list storage's
        (references, free to keep) always, a tensor storage's from a copy taken before a
        batch that is not plain (:meth:`ItemSchema.validated_leaves_plain`); a plain batch's copies into
        storage of its own dtypes and shapes cannot fail part-way, and copying the rows it
        overwrites would cost ~20% of the extend. That undo reads TorchRL's round-robin writers
        (the default); with another writer (``TensorDictMaxValueWriter`` places items by rank)
        a write that fails inside TorchRL is not put back, while every refusal above still
        leaves the buffer unchanged.
        """
        with self._lock:
            if self._schema is None:
                problems = batch_violations(data)
                if problems:
                    raise ContractViolation(problems, "extend (buffer unchanged)")
                if int(data.batch_size[0]) == 0:
                    return torch.empty(0, dtype=torch.int64)
                schema = ItemSchema.of(data, ragged=self.ragged)
                refuse_unstorable(_leaves(data), "extend (buffer unchanged)")
                plain = False
            else:
                schema = self._schema
                # The every-step case: shaped exactly like the last plain batch, which the
                # schema accepted from these same facts (one comparison instead of the check).
                sig = _plain_signature(data)
                last = self._plain
                if sig is not None and last is not None and last[0] is schema and last[1] == sig:
                    plain = True
                else:
                    plain = schema.validated_leaves_plain(data)[1]
                    if sig is None:  # not exact tensors: one may be a FakeTensor
                        refuse_unreal(_leaves(data), "extend (buffer unchanged)")
                    elif plain:
                        self._plain = (schema, sig)
            if self._copy_in:  # a list storage keeps the caller's rows: copy them (BUF-006)
                data = data.clone()
            rb = self.rb
            if not self._undoable:  # another writer places items its own way: see extend
                idx: torch.Tensor = rb.extend(data)
                self._schema = schema
                return idx
            mark = _scalar_mark(rb) if plain else None
            if mark is not None:  # the hot path: scalars only (see _scalar_mark)
                try:
                    idx = rb.extend(data)
                except BaseException:
                    _scalar_unwind(mark, int(data.batch_size[0]))
                    raise
                return idx
            undo = _Undo(rb, int(data.batch_size[0]), copy_rows=not plain)
            try:
                idx = rb.extend(data)
            except BaseException:
                undo.restore()
                raise
            self._schema = schema
            return idx

    def sample(self, batch_size: int, /) -> Any:
        """Exactly ``batch_size`` items from the wrapped buffer.

        TorchRL's ``SamplerWithoutReplacement`` returns only the rest of the current epoch when
        fewer items are left; the adapter tops the batch up from the next epoch, which keeps
        the every-item-once-per-epoch order.
        """
        batch_size = sample_size(batch_size)
        out = self.rb.sample(batch_size)
        if self._copy_in and isinstance(out, TensorDictBase):
            # A list storage's sample is a lazy stack of the stored items themselves: writing
            # into it would write into the buffer (BUF-008).
            out = out.clone()
        got = int(out.batch_size[0]) if isinstance(out, TensorDictBase) else batch_size
        if got >= batch_size:
            return out
        if batch_size > len(self.rb):
            raise ValueError(
                f"batch_size: without replacement at most len(buffer)={len(self.rb)}, found {batch_size}"
            )
        parts = [out]
        while got < batch_size:
            more = self.rb.sample(batch_size - got)
            parts.append(more)
            got += int(more.batch_size[0])
        return torch.cat(parts, 0)

    def read(self, indices: torch.Tensor, /) -> Any:
        """The items at storage ``indices`` (TorchRL's ``rb[indices]``), range-checked first.

        TorchRL's lazy storages hand back whatever memory sits at an index never written.
        Read under the lock writers take: no item is read half-overwritten.
        """
        with self._lock:
            out = self.rb[storage_indices(indices, len(self.rb))]
        return out.clone() if self._copy_in and isinstance(out, TensorDictBase) else out

    def __len__(self) -> int:
        return len(self.rb)

    def state_dict(self) -> dict[str, Any]:
        """A copy of the wrapped buffer's state, plus the stored schema, taken whole.

        TorchRL's tensor storages return their live tensors (as ``nn.Module.state_dict``
        does): a snapshot would change with every later write (BUF-014). Taken under the lock
        writers take, so no row in it is half of one write and half of another; a tensor
        storage's rows past the stored items are zeroed first, so the copy holds the stored
        items and zeros, nothing of the memory TorchRL allocated them from.
        """
        with self._lock:
            _clear_unused_rows(self.rb)
            return {
                "rb": _copied(_rb_state(self.rb)),
                "schema": None if self._schema is None else self._schema.to_state(),
            }

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore :meth:`state_dict`'s output, checked whole before anything changes.

        The schema must parse (dtypes from a closed set), the storage must hold exactly the
        schema's keys with its dtypes and item shapes (plus TorchRL's ``index``) and no more
        items than the capacity, the writer's cursor and count must agree with that length,
        and a without-replacement sampler's epoch must be the rest of a permutation. A state
        that breaks any of it raises ``ValueError`` naming the key, what was expected and what
        was found, and the buffer is unchanged. Should TorchRL still fail while loading a
        checked state, the previous state is put back before the error is raised.
        """
        with self._lock:
            schema, rb_state = self._checked(state_dict)
            before = _copied(_rb_state(self.rb))
            try:
                _load_rb(self.rb, rb_state)
            except Exception as e:
                _load_rb(self.rb, before)
                raise ValueError(
                    f"state_dict['rb']: TorchRL's load_state_dict raised {type(e).__name__}: "
                    f"{e} (the previous state was put back)"
                ) from e
            self._schema = schema

    def _checked(self, state: Any) -> tuple[ItemSchema | None, dict[str, Any]]:
        if not isinstance(state, Mapping) or set(state) != {"rb", "schema"}:
            found = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                "state_dict: expected keys ['rb', 'schema'] (ValidatedReplayBuffer.state_dict()), "
                f"found {found}"
            )
        schema = schema_from_state(state["schema"], "state_dict['schema']")
        if schema is not None and not self.ragged:
            for k, c in schema.columns.items():
                if RAGGED in c.shape:
                    raise bad(
                        f"state_dict['schema'] {k}",
                        "fixed item shapes (this buffer is not ragged)",
                        c.describe(),
                    )
        _check_torchrl_state(state["rb"], schema, self.rb)
        return schema, state["rb"]

    def dumps(self, path: str | os.PathLike[str], /) -> None:
        """Save :meth:`state_dict` as a posttrain checkpoint directory ``path``.

        Written whole or not at all (a temporary directory, fsynced, renamed into place) with
        a manifest of each file's size and SHA-256: ``validated_replay_buffer.pt``, tensors
        and plain data only. TorchRL's own ``dumps`` format (memmap files, JSON metadata, a
        pickled prefetch state) is never written, so :meth:`loads` never reads it.

        The storage is written from where it lies, not from a copy (a memmap storage larger
        than memory can be saved); writers wait until the file is written. A tensor storage's
        rows past the stored items are zeroed first: the file holds the stored items and
        zeros, nothing of the memory TorchRL allocated them from.
        """
        with self._lock:
            _clear_unused_rows(self.rb)
            state = {
                "rb": _plain(_rb_state(self.rb)),
                "schema": None if self._schema is None else self._schema.to_state(),
            }
            save_state(path, _STATE_FILE, state)

    def loads(self, path: str | os.PathLike[str], /) -> None:
        """Restore what :meth:`dumps` saved under ``path``, or refuse it with nothing changed.

        The manifest is checked before anything is read (``CheckpointError`` names a missing,
        extra, truncated or altered file), the state is read with ``weights_only=True`` (no
        code runs) and checked whole by :meth:`load_state_dict`.
        """
        state = load_verified(path, _STATE_FILE)
        try:
            self.load_state_dict(state)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e} (buffer unchanged)") from e

    def update_priority(self, index: Any, priority: Any, /) -> None:
        """Delegate to the wrapped buffer."""
        self.rb.update_priority(index, priority)

    def client(self) -> ValidatedReplayBuffer:
        """A picklable handle for producers in other processes, checking the same schema.

        Only for a served buffer (TorchRL's ``service_backend="ray"``), whose ``client()`` is
        the handle. Validation runs in the producer, before anything is sent, so the schema
        must be fixed first: write one batch here, then hand out clients. (A schema fixed
        independently by each producer could differ between them.)
        """
        make = getattr(self.rb, "client", None)
        if not callable(make):
            raise TypeError(
                f"client: {type(self.rb).__name__} is not a served buffer (no client())"
            )
        if self._schema is None:
            raise RuntimeError(
                "client: the schema is not fixed yet; extend this buffer once before handing "
                "out clients, so every producer checks against the same schema"
            )
        out = ValidatedReplayBuffer(make(), ragged=self.ragged)
        out._schema = self._schema
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_plain")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plain = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ValidatedReplayBuffer({self.rb!r})"


# One C call reads the five attributes ``ItemSchema.validated_leaves_plain``'s plain path reads per leaf.
_LEAF_META = operator.attrgetter("dtype", "shape", "requires_grad", "is_meta", "layout")
_TENSOR = torch.Tensor


class _NotPlain(PosttrainError):
    """A batch the signature fast path does not describe; never leaves this module."""


def _plain_signature(data: Any) -> list[Any] | None:
    """What ``ItemSchema.validated_leaves_plain``'s plain path reads of a plain ``TensorDict``, as one list.

    The batch size, then each entry's key and, for a tensor, its dtype, shape,
    ``requires_grad``, ``is_meta`` and layout; a sub-TensorDict's entries follow its key and
    end with ``None``. Two batches with equal lists take the same path through the check
    (~9 us for the LLM layout just after an extend, against ~17 us for the check). ``None``
    for anything else (a subclass, a lazy stack, a leaf that is not exactly a tensor, a
    nested tensor, whose ``shape`` raises): the full check handles those.
    """
    if type(data) is not TensorDict:
        return None
    out: list[Any] = [data.batch_size]
    try:
        _signature_walk(data._tensordict, out)
    except (_NotPlain, AttributeError, RuntimeError):
        return None
    return out


def _signature_walk(entries: dict[str, Any], out: list[Any]) -> None:
    for k, v in entries.items():
        t = type(v)
        if t is _TENSOR:
            out.append(k)
            out.append(_LEAF_META(v))
        elif t is TensorDict:
            out.append(k)
            _signature_walk(v._tensordict, out)
            out.append(None)
        else:
            raise _NotPlain


def _scalar_mark(rb: Any) -> tuple[Any, Any, Any] | None:
    """What undoes a failed write of a plain batch into an allocated tensor storage.

    TorchRL's storage replaces its ``_last_cursor`` as its write starts, after the writer
    moved its cursor and count by the batch and the storage its length; a failure after that
    moves them back (:func:`_scalar_unwind`). Rows need no copy: a plain batch's copies into
    storage of its own dtypes and shapes cannot fail part-way. (writer, storage, last cursor),
    or None where that does not hold (a first write, a list storage, a served buffer).
    """
    w, st = getattr(rb, "_writer", None), getattr(rb, "_storage", None)
    if w is None or st is None:
        return None
    attrs = vars(st)
    if attrs.get("initialized") is not True or "_len_value" not in attrs:
        return None
    last = attrs.get("_last_cursor", _UNSET)
    return None if last is _UNSET else (w, st, last)


def _scalar_unwind(mark: tuple[Any, Any, Any], n: int) -> None:
    w, st, last = mark
    if vars(st).get("_last_cursor") is last:
        return  # the storage's write never started: nothing moved
    cap = st.max_size
    count = w._write_count - n
    w._cursor = (w._cursor - n) % cap
    w._write_count = count
    now = st._len
    st._len = now - n if now < cap else min(cap, count)
    st._last_cursor = last


_UNSET = object()


class _Undo:
    """What a failed write into a local TorchRL buffer puts back (see ``extend``), where
    :func:`_scalar_mark` does not apply.

    The writer's and storage's state is read whole, with the items the write will overwrite
    (a list storage's references, sliced out) and, for a batch that is not plain, the
    sampler's attributes and a tensor storage's rows, copied. A served buffer (no local
    writer) is its service's business.
    """

    __slots__ = (
        "count",
        "cursor",
        "length",
        "n",
        "rows",
        "sampler",
        "slots",
        "storage",
        "writer",
    )

    def __init__(self, rb: Any, n: int, *, copy_rows: bool) -> None:
        self.writer: Any = None
        self.n = n
        self.rows: tuple[torch.Tensor, Any] | None = None
        self.slots: tuple[int, list[Any], list[Any]] | None = None
        self.sampler: tuple[Any, dict[str, Any]] | None = None
        self.storage: tuple[Any, dict[str, Any], Any] = (None, {}, None)
        w, st = getattr(rb, "_writer", None), getattr(rb, "_storage", None)
        if w is None or st is None:
            return
        attrs = vars(st)
        inner = attrs.get("_storage")
        try:
            cursor, count = w._cursor, w._write_count
        except AttributeError:
            return
        self.writer, self.cursor, self.count = w, cursor, count
        saved = dict(attrs)  # a first write's allocation, the last cursor
        # A tensor storage's length is a shared value TorchRL updates in place.
        self.storage = (st, saved, st._len if "_len_value" in saved else None)
        if isinstance(inner, list):  # a list storage: keep the items it will overwrite
            self.length = length = len(inner)
            cap = st.max_size
            if isinstance(cursor, int) and 0 <= cursor < cap:
                # The write covers cursor .. cursor+n-1 modulo the capacity: at most two
                # ranges, kept as slices (one C call each, not one per item).
                end = cursor + min(n, cap)
                head = inner[cursor : min(end, length)]
                wrap = inner[: min(end - cap, length)] if end > cap else []
                self.slots = (cursor, head, wrap)
            else:
                at = [(cursor + i) % cap for i in range(min(n, cap))]
                self.slots = (-1, [(i, inner[i]) for i in at if i < length], [])
        if not copy_rows:
            return
        sm = getattr(rb, "_sampler", None)
        if sm is not None:
            self.sampler = (sm, dict(vars(sm)))
        if inner is not None and not isinstance(inner, list) and isinstance(cursor, int):
            cap = st.max_size
            at = (torch.arange(min(n, cap), dtype=torch.int64) + cursor) % cap
            at = at[at < len(st)]
            if at.numel():
                self.rows = (at, inner[at.to(_device_of(inner))].clone())

    def restore(self) -> None:
        w = self.writer
        if w is None:
            return
        st, saved, length = self.storage
        w._cursor = self.cursor
        w._write_count = self.count
        inner = saved.get("_storage")
        if self.slots is not None and isinstance(inner, list):
            del inner[self.length :]
            start, head, wrap = self.slots
            if start < 0:
                for i, item in head:
                    inner[i] = item
            else:
                inner[start : start + len(head)] = head
                inner[: len(wrap)] = wrap
        if self.rows is not None and inner is not None:
            at, old = self.rows
            inner[at.to(_device_of(inner))] = old
        vars(st).clear()
        vars(st).update(saved)
        if length is not None:
            st._len = length
        if self.sampler is not None:
            sm, sampler_attrs = self.sampler
            vars(sm).clear()
            vars(sm).update(sampler_attrs)


def _device_of(inner: Any) -> torch.device:
    d = getattr(inner, "device", None)
    return torch.device("cpu") if d is None else torch.device(d)


def _round_robin(rb: Any) -> bool:
    """Whether ``rb`` writes with TorchRL's round-robin writers (the default), or has no local
    writer (a served buffer). Another writer, such as ``TensorDictMaxValueWriter``, places
    items by rank and keeps state of its own, which a cursor cannot put back."""
    w = getattr(rb, "_writer", None)
    if w is None:
        return True
    try:
        from torchrl.data.replay_buffers.writers import (
            RoundRobinWriter,
            TensorDictRoundRobinWriter,
        )
    except ImportError:  # pragma: no cover - only without the extra
        return False
    return type(w) in (RoundRobinWriter, TensorDictRoundRobinWriter)


def _keeps_references(rb: Any) -> bool:
    """Whether ``rb`` stores the caller's rows as given (TorchRL's list storages do)."""
    try:
        from torchrl.data import ListStorage
    except ImportError:  # pragma: no cover - only without the extra
        return False
    try:
        storage = rb.storage
    except Exception:  # a served buffer's storage lives elsewhere: what it gets is a copy
        return False
    return isinstance(storage, ListStorage)


def _rb_state(rb: Any) -> dict[str, Any]:
    """``rb.state_dict()`` with the writer's write count in it, and the stored columns under
    names that keep '.' inside a name apart from nesting (:mod:`._state_keys`).

    Per-release branch for TorchRL 0.12 and 0.13: their ``RoundRobinWriter.state_dict()``
    holds only ``_cursor`` (0.14 added ``_write_count``), and a length check needs the count,
    so it is read from the live writer; :func:`_restore_write_count` puts it back on load.
    Without it their adapted buffers fail BUF-014 and BUF-018 (docs/reports/compatibility.md).
    """
    state: dict[str, Any] = rb.state_dict()
    writer, w = state.get("_writer"), getattr(rb, "_writer", None)
    if isinstance(writer, dict) and "_cursor" in writer and "_write_count" not in writer:
        count = getattr(w, "_write_count", None)
        if isinstance(count, int):
            state["_writer"] = {**writer, "_write_count": count}
    storage, live = state.get("_storage"), _live_storage(rb)
    if isinstance(storage, dict) and "_storage" in storage:
        inner = storage["_storage"]
        if isinstance(inner, Mapping) and isinstance(live, TensorDictBase):
            state["_storage"] = {**storage, "_storage": flat_columns(live)}
        elif isinstance(inner, list) and isinstance(live, list) and len(live) == len(inner):
            state["_storage"] = {**storage, "_storage": [flat_columns(i) for i in live]}
    return state


def _live_storage(rb: Any) -> Any:
    """The wrapped buffer's stored columns (a TensorDict, or a list storage's items), or None."""
    st = _live_part(rb, "storage")
    return None if st is None else vars(st).get("_storage")


def _load_rb(rb: Any, state: Mapping[str, Any]) -> None:
    """``rb.load_state_dict(state)`` of a :func:`_rb_state`, the columns' names decoded."""
    rb.load_state_dict(state)
    _restore_write_count(rb, state)
    st = _live_part(rb, "storage")
    live = _live_storage(rb)
    if isinstance(live, TensorDictBase):
        vars(st)["_storage"] = decode_columns(live)
    elif isinstance(live, list):
        live[:] = [decode_columns(i) if isinstance(i, TensorDictBase) else i for i in live]


def _restore_write_count(rb: Any, state: Mapping[str, Any]) -> None:
    """After TorchRL 0.12/0.13's ``load_state_dict`` (which restores only ``_cursor``), the count."""
    w, saved = getattr(rb, "_writer", None), state.get("_writer")
    if (
        w is not None
        and isinstance(saved, Mapping)
        and "_write_count" in saved
        and "_write_count" not in w.state_dict()
    ):
        w._write_count = saved["_write_count"]


def _leaves(data: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """A batch's leaves by tuple key (its ``ItemSchema`` check has passed); a lazy stack's
    item by item (a ragged one has no stacked leaf to read)."""
    subs = getattr(data, "tensordicts", None)
    if isinstance(subs, list):
        for sub in subs:
            yield from _leaves(sub)
        return
    if not isinstance(data, TensorDictBase):
        return
    for k, v in data.items():
        key = (k,) if isinstance(k, str) else tuple(k)
        if isinstance(v, TensorDictBase):
            yield from (((*key, *kk), vv) for kk, vv in _leaves(v))
        else:
            yield key, v


def _clear_unused_rows(rb: Any) -> None:
    """Zero a local tensor storage's rows past its stored items.

    TorchRL allocates them with ``torch.empty``: until written they hold whatever memory the
    allocator handed back (bytes of buffers freed earlier), which a state or a checkpoint
    would otherwise carry. No read reaches past ``len`` (reads are range-checked), so zeroing
    them changes no item. A list storage holds only its items; a served buffer's storage is
    its host's.
    """
    st = _live_part(rb, "storage")
    inner = None if st is None else vars(st).get("_storage")
    if inner is None or isinstance(inner, list) or vars(st).get("initialized") is not True:
        return
    if getattr(st, "ndim", 1) != 1:
        return
    n, cap = len(st), st.max_size
    if not isinstance(cap, int) or n >= cap:
        return
    if isinstance(inner, torch.Tensor | TensorDictBase):
        inner[n:].zero_()
    elif isinstance(inner, Mapping):
        for v in inner.values():
            if isinstance(v, torch.Tensor | TensorDictBase):
                v[n:].zero_()


def _copied(state: Any) -> Any:
    """``state`` with every tensor and TensorDict in it copied (containers rebuilt)."""
    return _leaves_mapped(state, lambda t: t.clone())


def _plain(state: Any) -> Any:
    """``state`` with every tensor a plain ``torch.Tensor`` over the same memory (no copy).

    A memmap storage holds ``MemoryMappedTensor``s, a subclass ``torch.load(weights_only=True)``
    does not rebuild; viewed as plain tensors they save as bytes and load as tensors.
    """

    def plain(t: Any) -> Any:
        if isinstance(t, TensorDictBase):
            return t._fast_apply(plain, call_on_nested=False, propagate_lock=False)
        return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)

    return _leaves_mapped(state, plain)


def _leaves_mapped(state: Any, fn: Any) -> Any:
    """``state`` with ``fn`` applied to every tensor and TensorDict (containers rebuilt)."""
    if isinstance(state, torch.Tensor | TensorDictBase):
        return fn(state)
    if isinstance(state, dict):
        out = copy.copy(state)  # keeps what rides on the dict (an OrderedDict's _metadata)
        for k, v in state.items():
            out[k] = _leaves_mapped(v, fn)
        return out
    if isinstance(state, list | tuple) and type(state) in (list, tuple):
        return type(state)(_leaves_mapped(v, fn) for v in state)
    return state


def _capacity(rb: Any) -> int | None:
    """The wrapped storage's capacity, where this process can see it (not for a served one)."""
    try:
        n = rb.storage.max_size
    except Exception:
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _live_part(rb: Any, part: str) -> Any:
    """The wrapped buffer's own ``sampler`` or ``storage``, None for a served one."""
    try:
        return getattr(rb, part)
    except Exception:
        return None


_INDEX = "index"  # TorchRL's TensorDictReplayBuffer stores each item's index beside it


def _check_item(item: Any, schema: ItemSchema, where: str, fixed_rows: int | None) -> None:
    """One stored column set against the schema: flat 'a.b' keys, dtypes, item shapes.

    ``fixed_rows`` is the leading size of a tensor storage's columns; None for one item of a
    list storage (no leading dim)."""
    if not isinstance(item, Mapping):
        raise bad(where, "a dict of the stored columns", type(item).__name__)
    want = {flat_name(k): c for k, c in schema.columns.items()}
    keys = set(map(str, item)) - {_INDEX}
    if keys != set(want) or not all(isinstance(k, str) for k in item):
        missing, extra = sorted(set(want) - keys), sorted(keys - set(want))
        raise bad(
            where,
            f"the schema's keys {sorted(want)}",
            f"missing {missing}, extra {extra}" if missing or extra else sorted(item),
        )
    for k, v in item.items():
        at = f"{where}[{k!r}]"
        t = checked_tensor(v, at)
        lead = () if fixed_rows is None else (fixed_rows,)
        if k == _INDEX:
            if t.dtype != torch.int64 or tuple(t.shape) != lead:
                raise bad(at, f"int64 {list(lead)}", f"{t.dtype} {list(t.shape)}")
            continue
        col = want[k]
        dims = tuple(t.shape)[len(lead) :]
        fits = len(dims) == len(col.shape) and all(
            w in (RAGGED, d) for w, d in zip(col.shape, dims, strict=True)
        )
        if t.dtype != col.dtype or tuple(t.shape)[: len(lead)] != lead or not fits:
            raise bad(
                at, f"{col.describe()} per item, {list(lead)} items", f"{t.dtype} {list(t.shape)}"
            )


def _same_keys(part: Mapping[Any, Any], live: Any, where: str) -> None:
    """Refuse a state part whose keys differ from the wrapped buffer's own part's (if any)."""
    if live is None:
        return
    want = set(map(str, live.state_dict()))
    if set(map(str, part)) != want:
        raise bad(where, f"keys {sorted(want)}", sorted(map(str, part)))


def _check_top_level(state: Mapping[str, Any], rb: Any) -> None:
    """The parts beside storage, writer and sampler: the keys the wrapped buffer's own state
    has (where this process can see it), and each with its own type."""
    w = "state_dict['rb']"
    try:  # only a local buffer's: a served one's would copy its whole storage across
        live = rb.state_dict() if _live_part(rb, "storage") is not None else None
    except Exception:
        live = None
    if isinstance(live, Mapping) and set(map(str, state)) != set(map(str, live)):
        raise bad(w, f"keys {sorted(map(str, live))}", sorted(map(str, state)))
    if "_transforms" in state:
        t = state["_transforms"]
        want = live.get("_transforms") if isinstance(live, Mapping) else None
        if not isinstance(t, Mapping) or (
            isinstance(want, Mapping) and set(map(str, t)) != set(map(str, want))
        ):
            found = sorted(map(str, t)) if isinstance(t, Mapping) else t
            raise bad(f"{w}['_transforms']", "the wrapped buffer's transforms' state", found)
    for key in ("_batch_size", "_consume_after_n_samples"):
        if state.get(key) is not None:
            checked_int(state[key], f"{w}[{key!r}]", 1)
    rng = state.get("_rng")
    if rng is not None and not (
        isinstance(rng, list | tuple)
        and len(rng) == 2
        and isinstance(rng[0], torch.Tensor)
        and isinstance(rng[1], str)
    ):
        raise bad(f"{w}['_rng']", "None or (generator state, device)", rng)
    pre = state.get("_prefetch_state")
    if pre is not None and not (
        isinstance(pre, Mapping)
        and isinstance(pre.get("queue"), list | tuple)
        and not pre["queue"]  # the adapter never prefetches: a queued sample is not its own
    ):
        raise bad(f"{w}['_prefetch_state']", "None or an empty prefetch queue", pre)


def _check_torchrl_state(state: Any, schema: ItemSchema | None, rb: Any) -> None:
    """A TorchRL ``ReplayBuffer.state_dict()`` against the schema and the wrapped buffer:
    storage, writer and sampler parts present and consistent, or ``ValueError``."""
    w = "state_dict['rb']"
    if not isinstance(state, Mapping):
        raise bad(w, "TorchRL's ReplayBuffer.state_dict() (a dict)", type(state).__name__)
    for part in ("_storage", "_sampler", "_writer"):
        if not isinstance(state.get(part), Mapping):
            found = "no such key" if part not in state else type(state[part]).__name__
            raise bad(f"{w}[{part!r}]", "a dict", found)
    _check_top_level(state, rb)
    cap = _capacity(rb)
    storage = state["_storage"]
    if "_storage" not in storage:
        raise bad(f"{w}['_storage']", "a dict with key '_storage'", sorted(map(str, storage)))
    inner = storage["_storage"]
    live = _live_part(rb, "storage")
    _same_keys(storage, live, f"{w}['_storage']")
    if "initialized" in storage and not isinstance(storage["initialized"], bool):
        raise bad(f"{w}['_storage']['initialized']", "a bool", storage["initialized"])
    at = f"{w}['_storage']['_storage']"
    if isinstance(inner, list):
        if live is not None and not isinstance(live.state_dict().get("_storage"), list):
            raise bad(at, "a tensor storage's columns (a dict)", "a list storage's items")
        n = len(inner)
        if cap is not None and n > cap:
            raise bad(at, f"at most {cap} items (the capacity)", f"{n} items")
        if schema is None and n:
            raise bad(at, "no items (the state has no schema)", f"{n} items")
        for i, item in enumerate(inner):
            assert schema is not None
            _check_item(item, schema, f"{at}[{i}]", None)
    elif isinstance(inner, Mapping):
        if live is not None and isinstance(live.state_dict().get("_storage"), list):
            raise bad(at, "a list storage's items (a list)", "a tensor storage's columns")
        n = checked_int(storage.get("_len"), f"{w}['_storage']['_len']", 0, cap)
        if schema is None:
            if n or inner:
                raise bad(at, "no columns (the state has no schema)", f"len {n}, {sorted(inner)}")
        else:
            rows = {
                int(v.shape[0]) for v in inner.values() if isinstance(v, torch.Tensor) and v.ndim
            }
            lead = cap if cap is not None else (max(rows) if rows else 0)
            if lead < n:
                raise bad(f"{w}['_storage']['_len']", f"at most the {lead} rows stored", n)
            _check_item(inner, schema, at, lead)
    else:
        raise bad(at, "a dict of columns or a list of items", type(inner).__name__)
    writer = state["_writer"]
    wc = checked_int(writer.get("_write_count"), f"{w}['_writer']['_write_count']", n)
    cursor = checked_int(
        writer.get("_cursor"), f"{w}['_writer']['_cursor']", 0, None if cap is None else cap - 1
    )
    if cap is not None:
        if n != min(cap, wc):
            raise bad(f"{w}['_storage'] length", f"min(capacity, write count) = {min(cap, wc)}", n)
        if cursor != wc % cap:
            raise bad(f"{w}['_writer']['_cursor']", f"write count % capacity = {wc % cap}", cursor)
    sampler = state["_sampler"]
    _same_keys(sampler, _live_part(rb, "sampler"), f"{w}['_sampler']")
    for flag in ("drop_last", "_ran_out"):
        if flag in sampler and not isinstance(sampler[flag], bool):
            raise bad(f"{w}['_sampler'][{flag!r}]", "a bool", sampler[flag])
    if "_sample_list" in sampler:
        seen = checked_int(sampler.get("len_storage"), f"{w}['_sampler']['len_storage']", 0, n)
        if sampler["_sample_list"] is not None:
            distinct_indices(sampler["_sample_list"], f"{w}['_sampler']['_sample_list']", seen)
