"""Validate-then-write around a TorchRL replay buffer: no copy, metadata checks only."""

from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts.buffer import sample_size, storage_indices
from posttrain.contracts.schema import ItemSchema, batch_violations
from posttrain.contracts.validation import ContractViolation

__all__ = ["ValidatedReplayBuffer"]

_SCHEMA_FILE = "posttrain_schema.json"
_STATE_FILE = "posttrain_state.pt"


class ValidatedReplayBuffer:
    """Makes a TorchRL ``ReplayBuffer`` conform to ``ReplayBufferV1``.

    TorchRL 0.14's ``extend`` is not atomic and accepts batches that do not match what is
    stored (a missing key is left uninitialised or zero-filled, an extra key is added or
    dropped, a wrong dtype or shape fails half-way). This adapter fixes the schema at the first
    write and checks every later batch against it (keys, dtypes, item shapes: metadata only)
    before handing it, untouched, to the wrapped buffer. Everything else is delegated.

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

    def __init__(self, rb: Any, *, ragged: bool = False) -> None:
        self.rb = rb
        self.ragged = ragged
        self._schema: ItemSchema | None = None
        self._lock = threading.Lock()
        self._copy_in = _keeps_references(rb)

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Check ``data`` against the stored schema, then extend the wrapped buffer."""
        with self._lock:
            if self._schema is None:
                problems = batch_violations(data)
                if problems:
                    raise ContractViolation(problems, "extend (buffer unchanged)")
                if int(data.batch_size[0]) == 0:
                    return torch.empty(0, dtype=torch.int64)
                schema = ItemSchema.of(data, ragged=self.ragged)
            else:
                schema = self._schema
                schema.check(data)
            if self._copy_in:  # a list storage keeps the caller's rows: copy them (BUF-006)
                data = data.clone()
            idx: torch.Tensor = self.rb.extend(data)
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
        """
        out = self.rb[storage_indices(indices, len(self.rb))]
        return out.clone() if self._copy_in and isinstance(out, TensorDictBase) else out

    def __len__(self) -> int:
        return len(self.rb)

    def state_dict(self) -> dict[str, Any]:
        """A copy of the wrapped buffer's state, plus the stored schema.

        TorchRL's tensor storages return their live tensors (as ``nn.Module.state_dict``
        does): a snapshot would change with every later write (BUF-014).
        """
        return {
            "rb": _copied(self.rb.state_dict()),
            "schema": None if self._schema is None else self._schema.to_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore :meth:`state_dict`'s output.

        The schema is read first: a state without one, or with one that does not parse, raises
        ``ValueError`` before the wrapped buffer is touched (a storage restored under the old
        schema would accept batches that do not match what it holds).
        """
        if not isinstance(state_dict, dict) or {"rb", "schema"} - state_dict.keys():
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict)
            raise ValueError(
                f"state_dict: expected keys ['rb', 'schema'] (ValidatedReplayBuffer.state_dict()), "
                f"found {found}"
            )
        schema = _schema_from_state(state_dict["schema"], "state_dict['schema']")
        self.rb.load_state_dict(state_dict["rb"])
        self._schema = schema

    def dumps(self, path: str | os.PathLike[str], /) -> None:
        """The wrapped buffer's ``dumps``, plus the schema beside it.

        TorchRL's list-backed storages (``LazyStackStorage``) refuse ``dumps``; for those the
        adapter saves ``state_dict()`` with ``torch.save`` instead.
        """
        Path(path).mkdir(parents=True, exist_ok=True)
        try:
            self.rb.dumps(path)
        except NotImplementedError:
            torch.save(self.rb.state_dict(), Path(path, _STATE_FILE))
        state = None if self._schema is None else self._schema.to_state()
        Path(path, _SCHEMA_FILE).write_text(json.dumps(state))

    def loads(self, path: str | os.PathLike[str], /) -> None:
        """The wrapped buffer's ``loads`` (or the saved ``state_dict``), plus the schema."""
        schema_file = Path(path, _SCHEMA_FILE)
        if not schema_file.is_file():
            raise FileNotFoundError(f"loads: expected {schema_file} (written by dumps), found none")
        schema = _schema_from_state(json.loads(schema_file.read_text()), str(schema_file))
        fallback = Path(path, _STATE_FILE)
        if fallback.exists():
            self.rb.load_state_dict(torch.load(fallback, weights_only=True))
        else:
            self.rb.loads(path)
        self._schema = schema

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
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ValidatedReplayBuffer({self.rb!r})"


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


def _copied(state: Any) -> Any:
    """``state`` with every tensor and TensorDict in it copied (containers rebuilt)."""
    if isinstance(state, torch.Tensor | TensorDictBase):
        return state.clone()
    if isinstance(state, dict):
        out = copy.copy(state)  # keeps what rides on the dict (an OrderedDict's _metadata)
        for k, v in state.items():
            out[k] = _copied(v)
        return out
    if isinstance(state, list | tuple) and type(state) in (list, tuple):
        return type(state)(_copied(v) for v in state)
    return state


def _schema_from_state(state: Any, where: str) -> ItemSchema | None:
    try:
        return None if state is None else ItemSchema.from_state(state)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: expected ItemSchema.to_state()'s output, found {e}") from e
