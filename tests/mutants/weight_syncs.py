"""Deliberately broken weight syncs: each must fail the suite with its requirement's id."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.contracts import Implementation
from posttrain.reference_impls import InProcessReceiver, InProcessSender

__all__ = ["CORRECT", "EXTRA_MUTANTS", "MUTANTS"]


class SkipsLastTensor(InProcessReceiver):
    def receive(self, timeout: float | None = None) -> int | None:
        last = list(self.model.state_dict())[-1]
        keep = self.model.state_dict()[last].clone()
        v = super().receive(timeout)
        with torch.no_grad():
            self.model.state_dict()[last].copy_(keep)
        return v


class VersionStuck(InProcessReceiver):
    def receive(self, timeout: float | None = None) -> int | None:
        v = super().receive(timeout)
        self._version = 0
        return v


class Aliases(InProcessReceiver):
    """Assigns the sent tensors themselves (``load_state_dict(assign=True)`` without a copy)."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.validate_weights(weights)
        self._pending = (dict(weights), version)

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None:
            return None
        weights, version = self._pending
        self._pending = None
        self.model.load_state_dict(weights, assign=True)
        self._version = version
        self.last_sync_s = 0.0
        return version


class CopiesUntilItBreaks(InProcessReceiver):
    """No validation: copies tensor by tensor, so a bad one stops it half-way."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        pass

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None:
            return None
        weights, version = self._pending
        self._pending = None
        with torch.no_grad():
            for n, t in self.model.state_dict().items():
                t.copy_(weights[n]) if t.shape == weights[n].shape else t.copy_(
                    weights[n].reshape(t.shape)
                )
        self._version = version
        return version


class CastsDtypes(InProcessReceiver):
    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        super().validate_weights(
            {n: (t.to(own[n].dtype) if n in own else t) for n, t in weights.items()}
        )


class NonStrictNames(InProcessReceiver):
    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        super().validate_weights({**own, **{n: t for n, t in weights.items() if n in own}})

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None:
            return None
        weights, version = self._pending
        self._pending = None
        self.model.load_state_dict(
            {n: t for n, t in weights.items() if n in self.model.state_dict()}, strict=False
        )
        self._version = version
        self.last_sync_s = 0.0
        return version


class NoLatency(InProcessReceiver):
    def receive(self, timeout: float | None = None) -> int | None:
        v = super().receive(timeout)
        del self.last_sync_s
        return v


class LatencyInMilliseconds(InProcessReceiver):
    """Reports its timer's milliseconds under the seconds name ``last_sync_s``."""

    def receive(self, timeout: float | None = None) -> int | None:
        start = time.perf_counter()
        v = super().receive(timeout)
        self.last_sync_s = (time.perf_counter() - start) * 1000.0 + 1.0
        return v


class ClaimsAnotherProcess(InProcessReceiver):
    """Declares cross_process and reads back right, but the receiver is in this process."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


class QueueReceiver(InProcessReceiver):
    """A correct design: every send is queued and each receive applies the next in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._queue: list[tuple[dict[str, torch.Tensor], int]] = []

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        last = self._queue[-1][1] if self._queue else self._version
        if version <= last:
            raise ValueError(f"version: expected an int above {last}, found {version!r}")
        self.validate_weights(weights)
        self._queue.append(({n: t.detach().clone() for n, t in weights.items()}, version))

    def receive(self, timeout: float | None = None) -> int | None:
        if not self._queue:
            return None
        self._pending = self._queue.pop(0)
        return super().receive(timeout)


class NewestVersionOldestWeights(QueueReceiver):
    """Drains the queue in one receive but applies its oldest weights under its newest version."""

    def receive(self, timeout: float | None = None) -> int | None:
        if not self._queue:
            return None
        newest = self._queue[-1][1]
        self._pending = (self._queue[0][0], newest)
        self._queue = []
        return InProcessReceiver.receive(self, timeout)


class VersionAtSend(InProcessReceiver):
    """Adopts the version when the weights are sent, before receive() applies them."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        super()._post(weights, version)
        self._version = version


class ParametersOnly(InProcessReceiver):
    """Copies ``named_parameters()`` only: persistent buffers keep their old values."""

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None:
            return None
        weights, version = self._pending
        self._pending = None
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(weights[n])
        self._version = version
        self.last_sync_s = 0.0
        return version


class WritesOnSend(InProcessReceiver):
    """Writes the weights into the model at send, as TorchRL's in-process schemes do, without
    declaring applies_on_send: between send and receive it holds the new weights under the old
    version."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        super()._post(weights, version)  # checked and copied: the writes below cannot fail
        assert self._pending is not None
        with torch.no_grad():
            for n, t in self.model.state_dict().items():
                t.copy_(self._pending[0][n])


class HalfWrittenOnSend(InProcessReceiver):
    """Declares applies_on_send but writes only the first half of the tensors at send and the
    rest at receive: between the two the model is a mix of two versions."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        super()._post(weights, version)
        assert self._pending is not None
        own = list(self.model.state_dict().items())
        with torch.no_grad():
            for n, t in own[: len(own) // 2]:
                t.copy_(self._pending[0][n])


class _Copying(InProcessReceiver):
    """Applies pending weights through ``write(own, sent)``, one tensor at a time."""

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None:
            return None
        weights, version = self._pending
        self._pending = None
        with torch.no_grad():
            self.write(self.model.state_dict(), weights)
        self._version = version
        self.last_sync_s = 0.0
        return version


class CopiesInOrder(_Copying):
    """Copies the sent tensors in the order they come, onto the model's in its own order:
    right only while the sender lists the names as the receiver does."""

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for dst, src in zip(own.values(), weights.values(), strict=True):
            dst.copy_(src.reshape(dst.shape))


class ReadsStorage(InProcessReceiver):
    """Copies each sent tensor's storage from its start with the model's strides: right only
    for contiguous tensors that own their storage (not for views into a flat buffer)."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.validate_weights(weights)  # keeps references: the copy is made at receive
        self._pending = (dict(weights), version)

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None:
            return None
        weights, version = self._pending
        self._pending = None
        with torch.no_grad():
            for n, dst in self.model.state_dict().items():
                src = weights[n]
                dst.copy_(src.as_strided(dst.shape, dst.stride(), 0))
        self._version = version
        self.last_sync_s = 0.0
        return version


class SkipsSeenStorage(_Copying):
    """Skips a tensor whose storage it copied at the last sync (an "unchanged" cache keyed on
    ``data_ptr``, holding the last sent tensors so no new one can reuse their memory): a
    trainer that updates its parameters in place and sends its live ``state_dict()`` again is
    never synced."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.validate_weights(weights)  # keeps references (zero copy): the copy is made at receive
        self._pending = (dict(weights), version)

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        last: dict[str, torch.Tensor] = getattr(self, "_last", {})
        for n, src in weights.items():
            if n not in last or last[n].data_ptr() != src.data_ptr():
                own[n].copy_(src)
        self._last = dict(weights)


class AliasesAfterFirstSync(InProcessReceiver):
    """Copies at the first sync, then (shapes known good) loads later ones with ``assign=True``
    on the sent tensors themselves."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.validate_weights(weights)  # keeps references: the first receive copies them
        self._pending = (dict(weights), version)

    def receive(self, timeout: float | None = None) -> int | None:
        if self._pending is None or self._version == 0:
            return super().receive(timeout)
        weights, version = self._pending
        self._pending = None
        self.model.load_state_dict(dict(weights), assign=True)
        self._version = version
        self.last_sync_s = 0.0
        return version


class ComparesNumel(_Copying):
    """Checks names, dtypes and element counts, not shapes; copies through ``reshape``."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        super().validate_weights(
            {
                n: (t.reshape(own[n].shape) if n in own and t.numel() == own[n].numel() else t)
                for n, t in weights.items()
            }
        )

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for n, src in weights.items():
            own[n].copy_(src.reshape(own[n].shape))


class ComparesItemsize(_Copying):
    """Checks element sizes, not dtypes (int32 passes for float32); ``copy_`` casts."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        same = {
            n: (
                t.view(own[n].dtype)
                if n in own and t.element_size() == own[n].element_size()
                else t
            )
            for n, t in weights.items()
        }
        super().validate_weights(same)

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for n, src in weights.items():
            own[n].copy_(src)


class CountsNames(_Copying):
    """Checks that as many names came as the model has, and each known one's fit; a renamed
    tensor passes and is skipped."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        if len(weights) != len(own):
            missing = [n for n in own if n not in weights] or [n for n in weights if n not in own]
            raise ValueError(f"expected {len(own)} tensors, found {len(weights)}: {missing}")
        super().validate_weights({**own, **{n: t for n, t in weights.items() if n in own}})

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for n, src in weights.items():
            if n in own:
                own[n].copy_(src)


class SkipsEqualTensors(_Copying):
    """A delta sync: skips a tensor that compares equal to the one it holds, so a -0.0 sent
    over a +0.0 (equal under ``==``, other bits) is never written."""

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for n, src in weights.items():
            if not torch.equal(own[n], src):
                own[n].copy_(src)


class NewestByText(QueueReceiver):
    """Applies the newest pending send, choosing it by its version as text: with 8, 9 and 10
    pending, "9" wins."""

    def receive(self, timeout: float | None = None) -> int | None:
        if not self._queue:
            return None
        self._pending = max(self._queue, key=lambda wv: str(wv[1]))
        self._queue = []
        return InProcessReceiver.receive(self, timeout)


class DemandsEveryBuffer(InProcessReceiver):
    """Checks the weights against ``named_buffers()``, non-persistent ones included: a full
    ``state_dict()`` is refused as missing a buffer it never holds."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        for n, _b in self.model.named_buffers():
            if n not in weights:
                raise ValueError(f"weights: {n!r} is missing")
        super().validate_weights(weights)


class StagesReferences(InProcessReceiver):
    """Checks the weights at send but stages the sent tensors themselves, copying them at
    receive: a trainer stepping in place after send returns changes what arrives."""

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.validate_weights(weights)
        self._pending = (dict(weights), version)


class SumsLatency(InProcessReceiver):
    """Reports the running total of its syncs' times as ``last_sync_s``."""

    def receive(self, timeout: float | None = None) -> int | None:
        total = getattr(self, "_total", 0.0)
        v = super().receive(timeout)
        if v is not None and self.last_sync_s is not None:
            self._total = total + self.last_sync_s
            self.last_sync_s = self._total
        return v


class ComparesFloatWidth(_Copying):
    """Takes any float of a tensor's width for its dtype (float16 for bfloat16, and back);
    ``copy_`` casts."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = self.model.state_dict()

        def same(t: torch.Tensor, o: torch.Tensor) -> bool:
            return (
                t.is_floating_point()
                and o.is_floating_point()
                and (t.element_size() == o.element_size())
            )

        super().validate_weights(
            {
                n: (t.to(own[n].dtype) if n in own and same(t, own[n]) else t)
                for n, t in weights.items()
            }
        )

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for n, src in weights.items():
            own[n].copy_(src)


_WRAPPERS = ("module.", "_orig_mod.")


def _unwrapped(name: str) -> str:
    while name.startswith(_WRAPPERS):
        name = name.split(".", 1)[1]
    return name


class StripsWrapperPrefixes(_Copying):
    """Matches names with DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes taken
    off both sides: a trainer's ``module.head.weight`` lands in the receiver's ``head.weight``,
    and a name sent both with and without a prefix is taken once."""

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        by = {_unwrapped(n): n for n in self.model.state_dict()}
        super().validate_weights({by.get(_unwrapped(n), n): t for n, t in weights.items()})

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        by = {_unwrapped(n): n for n in own}
        for n, src in weights.items():
            own[by[_unwrapped(n)]].copy_(src)


class FloatsOnly(_Copying):
    """Copies the floating tensors only (as a sync that skips what it cannot average): an int64
    step counter and a bool mask keep their old values."""

    def write(self, own: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        for n, src in weights.items():
            if src.is_floating_point():
                own[n].copy_(src)


def _factory(cls: type[InProcessReceiver]) -> Any:
    def make(model: torch.nn.Module) -> tuple[InProcessSender, InProcessReceiver]:
        r = cls(model)
        return InProcessSender(r), r

    make.__name__ = cls.__name__
    return make


def _impl(req: str, cls: type[InProcessReceiver], **kw: Any) -> Implementation:
    return Implementation("weight_sync", _factory(cls), name=f"mutant-{req}-{cls.__name__}", **kw)


MUTANTS: dict[str, Implementation] = {
    "WS-001": _impl("WS-001", SkipsLastTensor),
    "WS-002": _impl("WS-002", VersionStuck),
    "WS-003": _impl("WS-003", Aliases),
    "WS-004": _impl("WS-004", CopiesUntilItBreaks),
    "WS-005": _impl("WS-005", CastsDtypes),
    "WS-006": _impl("WS-006", NonStrictNames),
    "WS-007": _impl("WS-007", NoLatency),
    "WS-008": _impl("WS-008", ClaimsAnotherProcess, capabilities={"cross_process"}),
    "WS-009": _impl("WS-009", InProcessReceiver, capabilities={"cuda"}),
}
"""Requirement id -> a weight sync that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("WS-002", _impl("WS-002", NewestVersionOldestWeights)),
    ("WS-002", _impl("WS-002", VersionAtSend)),
    ("WS-001", _impl("WS-001", ParametersOnly)),
    ("WS-002", _impl("WS-002", WritesOnSend)),
    ("WS-002", _impl("WS-002", HalfWrittenOnSend, capabilities={"applies_on_send"})),
    ("WS-001", _impl("WS-001", CopiesInOrder)),
    ("WS-001", _impl("WS-001", ReadsStorage)),
    ("WS-002", _impl("WS-002", SkipsSeenStorage)),
    ("WS-003", _impl("WS-003", AliasesAfterFirstSync)),
    ("WS-004", _impl("WS-004", ComparesNumel)),
    ("WS-005", _impl("WS-005", ComparesItemsize)),
    ("WS-006", _impl("WS-006", CountsNames)),
    ("WS-007", _impl("WS-007", LatencyInMilliseconds)),
    ("WS-001", _impl("WS-001", SkipsEqualTensors)),
    ("WS-002", _impl("WS-002", NewestByText)),
    ("WS-001", _impl("WS-001", DemandsEveryBuffer)),
    ("WS-002", _impl("WS-002", StagesReferences)),
    ("WS-007", _impl("WS-007", SumsLatency)),
    ("WS-005", _impl("WS-005", ComparesFloatWidth)),
    ("WS-006", _impl("WS-006", StripsWrapperPrefixes)),
    ("WS-001", _impl("WS-001", FloatsOnly)),
]
"""Further bugs one requirement must catch beyond its main mutant: (requirement id, mutant)."""

CORRECT: list[Implementation] = [
    Implementation("weight_sync", _factory(QueueReceiver), name="queue-semantics-weight-sync"),
    # TorchRL's design, declared: the weights land at send, receive() adopts the version.
    Implementation(
        "weight_sync",
        _factory(WritesOnSend),
        name="applies-on-send-weight-sync",
        capabilities={"applies_on_send"},
    ),
]
"""Correct designs other than the reference's (latest-wins): each must pass every requirement."""
