"""Weight syncs (contract ``weight_sync`` v1) written from ``specs/weight_sync-v1.md`` alone.

Two correct designs:

* :class:`QueueSender` / :class:`QueueReceiver`: every ``send`` is validated, *copied* and
  queued; each ``receive`` applies the next pending send, in order (``copy_`` per tensor).
* :class:`MailboxSender` / :class:`MailboxReceiver`: latest wins. ``send`` validates and drops
  a copy in a one-slot mailbox (the sender may step its tensors as soon as ``send`` returns,
  WS-002), replacing anything pending; ``receive`` applies the newest, cloning it first, so
  the model never shares storage with the sender.

Then one-bug variants, each naming the requirement id it breaks (our reading of the spec).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.contracts import Implementation

__all__ = [
    "BUGGY_WEIGHT_SYNC",
    "CORRECT_WEIGHT_SYNC",
    "MailboxReceiver",
    "MailboxSender",
    "QueueReceiver",
    "QueueSender",
    "weights_problem",
]

_Weights = Mapping[str, torch.Tensor]


def weights_problem(
    model: torch.nn.Module, weights: _Weights, *, dtypes: bool = True
) -> str | None:
    """What keeps ``weights`` from loading into ``model`` exactly (naming the tensor), or None.

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> weights_problem(m, {"weight": torch.zeros(1, 2)})
        "weights: 'bias' is missing"
        >>> weights_problem(m, {"weight": torch.zeros(1, 2), "bias": torch.zeros(1, dtype=torch.float64)})
        "weights: 'bias' expected dtype torch.float32, found torch.float64"
    """
    own = model.state_dict()
    for name in own:
        if name not in weights:
            return f"weights: {name!r} is missing"
    for name, w in weights.items():
        if name not in own:
            return f"weights: {name!r} is not a tensor of the receiver's model"
        if not isinstance(w, torch.Tensor):
            return f"weights: {name!r} expected a tensor, found {type(w).__name__}"
        if w.shape != own[name].shape:
            return (
                f"weights: {name!r} expected shape {list(own[name].shape)}, found {list(w.shape)}"
            )
        if dtypes and w.dtype != own[name].dtype:
            return f"weights: {name!r} expected dtype {own[name].dtype}, found {w.dtype}"
    return None


class WeightsRejected(ValueError):
    """A send whose weights do not fit the receiver's model; nothing was changed."""


# --------------------------------------------------------------------------------------------
# Design 1: a queue, copied at send, applied in order
# --------------------------------------------------------------------------------------------


class QueueReceiver:
    """Applies pending sends one per ``receive``, in the order sent.

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> tx, rx = queue_pair(m)
        >>> tx.send({"weight": torch.ones(1, 2), "bias": torch.ones(1)}, version=3)
        >>> rx.receive(timeout=1.0); rx.version, m.bias.item()
        (3, 1.0)
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._pending: queue.SimpleQueue[tuple[int, dict[str, torch.Tensor]]] = queue.SimpleQueue()
        self._version = 0
        self.last_sync_s = 0.0

    @property
    def version(self) -> int:
        return self._version

    def receive(self, timeout: float | None = None) -> None:
        try:
            version, weights = self._pending.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"receive: no weights were sent within {timeout} s") from None
        t0 = time.perf_counter()
        self._apply(weights)
        self._set_version(version)
        self.last_sync_s = time.perf_counter() - t0

    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, w in weights.items():  # validated at send: every copy succeeds
                own[name].copy_(w)

    def _set_version(self, version: int) -> None:
        self._version = version


class QueueSender:
    """Validates against the receiver's model, copies, and queues (see :class:`QueueReceiver`).

    Example:
        >>> tx, rx = queue_pair(torch.nn.Linear(2, 1))
        >>> tx.send({"weight": torch.ones(2, 2), "bias": torch.ones(1)}, version=1)
        Traceback (most recent call last):
        ...
        tests.independent.weight_syncs.WeightsRejected: weights: 'weight' expected shape [1, 2], found [2, 2]
    """

    def __init__(self, receiver: QueueReceiver) -> None:
        self._rx = receiver
        self._last: int | None = None

    def send(self, weights: _Weights, /, *, version: int) -> None:
        problem = self._problem(weights)
        if problem is not None:
            raise WeightsRejected(problem)
        if self._last is not None and version <= self._last:
            raise ValueError(f"send: version {version} is not above the last sent, {self._last}")
        self._last = version
        self._rx._pending.put((version, self._payload(weights)))

    def _problem(self, weights: _Weights) -> str | None:
        return weights_problem(self._rx.model, weights)

    def _payload(self, weights: _Weights) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in weights.items()}


def queue_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """A queue-semantics sender and receiver for ``model`` (the conformance factory)."""
    rx = QueueReceiver(model)
    return QueueSender(rx), rx


# --------------------------------------------------------------------------------------------
# Design 2: latest wins, zero-copy mailbox, cloned at receive
# --------------------------------------------------------------------------------------------


class _Mailbox:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.slot: tuple[int, _Weights] | None = None
        self.version = 0  # the version the receiver's model holds


class MailboxReceiver:
    """Applies the newest pending send; older ones it never saw are skipped (latest wins).

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> tx, rx = mailbox_pair(m)
        >>> for v in (1, 2):
        ...     tx.send({"weight": torch.full((1, 2), float(v)), "bias": torch.zeros(1)}, version=v)
        >>> rx.receive(timeout=1.0), rx.version, m.weight[0, 0].item()
        (True, 2, 2.0)
    """

    def __init__(self, model: torch.nn.Module, box: _Mailbox) -> None:
        self.model = model
        self._box = box
        self.last_sync_s = 0.0

    @property
    def version(self) -> int:
        return self._box.version

    def receive(self, timeout: float | None = None) -> bool:
        """Apply the newest pending weights; ``False`` if none came within ``timeout``."""
        with self._box.cond:
            if not self._box.cond.wait_for(lambda: self._box.slot is not None, timeout):
                return False
            assert self._box.slot is not None
            version, weights = self._box.slot
            self._box.slot = None
            t0 = time.perf_counter()
            self._apply(weights)
            self._box.version = version
            self.last_sync_s = time.perf_counter() - t0
        return True

    def _apply(self, weights: _Weights) -> None:
        fresh = {k: v.detach().clone() for k, v in weights.items()}  # no storage shared
        self.model.load_state_dict(fresh, strict=True)


class MailboxSender:
    """Validates, then leaves a copy in the mailbox (see :class:`MailboxReceiver`)."""

    def __init__(self, receiver: MailboxReceiver, box: _Mailbox) -> None:
        self._rx = receiver
        self._box = box

    def send(self, weights: _Weights, /, *, version: int) -> None:
        with self._box.cond:
            problem = self._problem(weights)
            if problem is not None:
                raise WeightsRejected(problem)
            self._box.slot = (version, {k: v.detach().clone() for k, v in weights.items()})
            self._box.cond.notify_all()

    def _problem(self, weights: _Weights) -> str | None:
        return weights_problem(self._rx.model, weights)


def mailbox_pair(model: torch.nn.Module) -> tuple[MailboxSender, MailboxReceiver]:
    """A latest-wins sender and receiver for ``model`` (the conformance factory)."""
    box = _Mailbox()
    rx = MailboxReceiver(model, box)
    return MailboxSender(rx, box), rx


class _TrustingSender(QueueSender):
    def _problem(self, weights: _Weights) -> str | None:
        return None  # the receiver checks: a remote sender may not know the model


class _CheckingReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        problem = weights_problem(self.model, weights)  # all of it, before the first write
        if problem is not None:
            raise WeightsRejected(problem)
        super()._apply(weights)


def receiver_checked_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """Queue semantics with the check on the receiving side: ``send`` copies and queues
    anything, ``receive`` checks the whole set against its model before writing, and raises
    naming the tensor with model and version untouched (for transports whose sender cannot
    see the receiver's model).

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> tx, rx = receiver_checked_pair(m)
        >>> tx.send({"weight": torch.ones(1, 2)}, version=1)
        >>> rx.receive(timeout=1.0)
        Traceback (most recent call last):
        ...
        tests.independent.weight_syncs.WeightsRejected: weights: 'bias' is missing
        >>> rx.version
        0
    """
    rx = _CheckingReceiver(model)
    return _TrustingSender(rx), rx


# --------------------------------------------------------------------------------------------
# One-bug variants
# --------------------------------------------------------------------------------------------


class _AssignReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(weights, strict=True, assign=True)


class _NoCopySender(QueueSender):
    def _payload(self, weights: _Weights) -> dict[str, torch.Tensor]:
        return dict(weights)


def aliasing_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-003): zero-copy end to end. The sender queues its own tensors and the
    receiver loads them with ``load_state_dict(..., assign=True)``, so the model's parameters
    *are* the trainer's tensors and the next optimizer step changes the generator's weights."""
    rx = _AssignReceiver(model)
    return _NoCopySender(rx), rx


class _ForgetfulReceiver(QueueReceiver):
    def _set_version(self, version: int) -> None:
        self._applied = version  # stored under another name: ``version`` never moves


def version_not_bumped_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-002): the weights are applied but the version the receiver reports is
    never bumped, so the generator stamps rollouts with the old version."""
    rx = _ForgetfulReceiver(model)
    return QueueSender(rx), rx


class _EagerVersionSender(MailboxSender):
    def send(self, weights: _Weights, /, *, version: int) -> None:
        with self._box.cond:
            self._box.version = version  # published before the weights are even validated
            super().send(weights, version=version)


def version_at_send_pair(model: torch.nn.Module) -> tuple[MailboxSender, MailboxReceiver]:
    """BUG (breaks WS-004): the version is advanced at ``send``, before validation and before
    any weights reach the model, so a rejected send still changes the receiver's version.
    prime-rl's review caught this very order: "policy.version now advances on publish, before
    engines pause in update_weights" (https://github.com/PrimeIntellect-ai/prime-rl/pull/3050).
    """
    box = _Mailbox()
    rx = MailboxReceiver(model, box)
    return _EagerVersionSender(rx, box), rx


class _NoDtypeCheckSender(MailboxSender):
    def _problem(self, weights: _Weights) -> str | None:
        return weights_problem(self._rx.model, weights, dtypes=False)


def casting_pair(model: torch.nn.Module) -> tuple[MailboxSender, MailboxReceiver]:
    """BUG (breaks WS-005): names and shapes are checked but not dtypes, and
    ``load_state_dict`` (``copy_``) silently casts, so float64 or bf16 weights are accepted."""
    box = _Mailbox()
    rx = MailboxReceiver(model, box)
    return _NoDtypeCheckSender(rx, box), rx


class _LazyCheckSender(QueueSender):
    def _problem(self, weights: _Weights) -> str | None:
        return None


class _HalfApplyingReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, w in weights.items():  # checked one by one, while writing
                problem = weights_problem_one(own, name, w)
                if problem is not None:
                    raise WeightsRejected(problem)
                own[name].copy_(w)


def weights_problem_one(own: Mapping[str, torch.Tensor], name: str, w: torch.Tensor) -> str | None:
    """One tensor's problem against the model's state dict, or None.

    Example:
        >>> weights_problem_one({"a": torch.zeros(2)}, "a", torch.zeros(3))
        "weights: 'a' expected shape [2], found [3]"
    """
    if name not in own:
        return f"weights: {name!r} is not a tensor of the receiver's model"
    if w.shape != own[name].shape:
        return f"weights: {name!r} expected shape {list(own[name].shape)}, found {list(w.shape)}"
    if w.dtype != own[name].dtype:
        return f"weights: {name!r} expected dtype {own[name].dtype}, found {w.dtype}"
    return None


def half_applied_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-004): nothing is checked at ``send``; the receiver checks each tensor as
    it copies it, so a bad tensor raises after the ones before it were written: the model is
    left half-updated (the receiver's version does stay put)."""
    rx = _HalfApplyingReceiver(model)
    return _LazyCheckSender(rx), rx


class _ParamsOnlyReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():  # buffers are never copied
                p.copy_(weights[name])


def params_only_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-001): the receiver copies ``named_parameters()`` only, so persistent
    buffers (BatchNorm statistics, a learned scale registered as a buffer, quantization scales)
    keep their old values although the send was validated against the full state dict."""
    rx = _ParamsOnlyReceiver(model)
    return QueueSender(rx), rx


class _FirstVersionMailbox(_Mailbox):
    def __init__(self) -> None:
        super().__init__()
        self.first_pending: int | None = None


class _FirstVersionSender(MailboxSender):
    def send(self, weights: _Weights, /, *, version: int) -> None:
        box = self._box
        assert isinstance(box, _FirstVersionMailbox)
        with box.cond:
            super().send(weights, version=version)
            if box.first_pending is None:
                box.first_pending = version


class _FirstVersionReceiver(MailboxReceiver):
    def receive(self, timeout: float | None = None) -> bool:
        box = self._box
        assert isinstance(box, _FirstVersionMailbox)
        with box.cond:
            first = box.first_pending
            box.first_pending = None
            if not super().receive(timeout):
                return False
            if first is not None:
                box.version = first  # the version of the oldest pending send, not the applied
        return True


def first_version_pair(model: torch.nn.Module) -> tuple[MailboxSender, MailboxReceiver]:
    """BUG (breaks WS-002): latest wins for the weights but not for the version: after two
    sends and one receive the model holds the second send's weights and reports the first's
    version."""
    box = _FirstVersionMailbox()
    rx = _FirstVersionReceiver(model, box)
    return _FirstVersionSender(rx, box), rx


class _SkipUnknownSender(QueueSender):
    def _problem(self, weights: _Weights) -> str | None:
        own = self._rx.model.state_dict()
        return weights_problem(self._rx.model, {k: v for k, v in weights.items() if k in own})


class _SkipUnknownReceiver(QueueReceiver):
    def _apply(self, weights: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        super()._apply({k: v for k, v in weights.items() if k in own})


def skip_unknown_pair(model: torch.nn.Module) -> tuple[QueueSender, QueueReceiver]:
    """BUG (breaks WS-006): names the model does not have are skipped silently, as vLLM's
    ``load_weights`` loops do for unexpected checkpoint keys, so a renamed or misspelled tensor
    is accepted (missing names are still caught)."""
    rx = _SkipUnknownReceiver(model)
    return _SkipUnknownSender(rx), rx


def _impl(factory: Any) -> Implementation:
    return Implementation("weight_sync", factory, name=f"independent.{factory.__name__}")


CORRECT_WEIGHT_SYNC: dict[str, Implementation] = {
    "queue": _impl(queue_pair),
    "latest_wins": _impl(mailbox_pair),
    "receiver_checked": _impl(receiver_checked_pair),
}

# name -> (implementation, requirement id the bug breaks)
BUGGY_WEIGHT_SYNC: dict[str, tuple[Implementation, str]] = {
    "aliasing": (_impl(aliasing_pair), "WS-003"),
    "version_not_bumped": (_impl(version_not_bumped_pair), "WS-002"),
    "version_at_send": (_impl(version_at_send_pair), "WS-004"),
    "casting": (_impl(casting_pair), "WS-005"),
    "half_applied": (_impl(half_applied_pair), "WS-004"),
    "params_only": (_impl(params_only_pair), "WS-001"),
    "first_version": (_impl(first_version_pair), "WS-002"),
    "skip_unknown": (_impl(skip_unknown_pair), "WS-006"),
}
