"""The reference weight sync: in-process, validate-then-copy, versioned."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from posttrain._dtypes import dtype_name
from posttrain.errors import PosttrainError


class WeightMismatch(PosttrainError, ValueError):
    """Sent weights do not fit the receiver's model (names, tensors, layouts, shapes, dtypes)."""


class InProcessReceiver:
    """Applies published weights to ``model``; conforms to ``WeightReceiverV1``.

    Weights are checked against the model's ``state_dict`` (names, tensors, layouts, shapes,
    dtypes) before a single byte is copied, so a rejected sync leaves the model and ``version``
    unchanged; versions only rise, pending ones included.

    Example:
        >>> import torch
        >>> src, dst = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sender, receiver = in_process_weight_sync(dst)
        >>> sender.send(src.state_dict(), version=3)
        >>> receiver.receive()
        3
        >>> torch.equal(dst.weight, src.weight), receiver.version
        (True, 3)
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._version = 0
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._cond = threading.Condition()
        self.last_sync_s: float | None = None

    @property
    def version(self) -> int:
        """The version of the weights the model holds now (0 before any sync)."""
        return self._version

    def validate_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`WeightMismatch` naming every parameter that does not fit."""
        if not isinstance(weights, Mapping):
            raise WeightMismatch(
                "weights rejected, receiver unchanged: expected a mapping of names to tensors, "
                f"found {type(weights).__name__}"
            )
        own = self.model.state_dict()
        problems = [
            f"{n!r}: missing (expected {dtype_name(t.dtype)} {list(t.shape)})"
            for n, t in own.items()
            if n not in weights
        ]
        problems += [f"{n!r}: unknown to the receiver's model" for n in weights if n not in own]
        for n, t in weights.items():
            if n in own:
                problem = _misfit(t, own[n])
                if problem is not None:
                    problems.append(f"{n!r}: {problem}")
        if problems:
            raise WeightMismatch("weights rejected, receiver unchanged: " + "; ".join(problems))

    def _check_version(self, version: int) -> None:
        # Against the pending version too: a lower one sent after it would replace it, and the
        # newer weights would be dropped without a word.
        pending = self._pending[1] if self._pending is not None else None
        floor = self._version if pending is None else max(self._version, pending)
        if not isinstance(version, int) or version <= floor:
            held = f"the model holds {self._version}"
            held += f", {pending} is pending" if pending is not None else ""
            raise ValueError(f"version: expected an int above {floor} ({held}), found {version!r}")

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._cond:
            self._check_version(version)
        self.validate_weights(weights)
        # Copy now: the sender may change its tensors as soon as send returns.
        snapshot = {n: t.detach().clone() for n, t in weights.items()}
        with self._cond:
            self._check_version(version)  # another send may have landed while we copied
            self._pending = (snapshot, version)
            self._cond.notify_all()

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the pending weights, waiting up to ``timeout`` s; return their version or None.

        Weights that no longer fit the model (cast or resized since they were sent) raise and
        stay pending, the model unchanged.
        """
        start = time.perf_counter()
        with self._cond:
            if self._pending is None and timeout:
                self._cond.wait(timeout)
            pending = self._pending
            if pending is None:
                return None
            # The model may have been cast or resized since send checked it.
            self.validate_weights(pending[0])
            self._pending = None
        weights, version = pending
        # Checked just above: same names, layouts, shapes and dtypes, so a copy can fail only
        # on an interrupt or a device error. No undo copy is kept for that: it would double
        # the model's memory on every sync.
        with torch.no_grad():
            for n, t in self.model.state_dict().items():
                t.copy_(weights[n])
        self._version = version
        self.last_sync_s = time.perf_counter() - start
        return version


def _misfit(t: object, own: torch.Tensor) -> str | None:
    """Why ``t`` cannot be copied into ``own`` as it is, or None when it can."""
    if not isinstance(t, torch.Tensor):
        return f"expected a tensor, found {type(t).__name__}"
    if t.layout != own.layout or t.is_nested:
        found = "nested" if t.is_nested else dtype_name(t.layout)
        return f"expected layout {dtype_name(own.layout)}, found {found}"
    if t.is_meta and not own.is_meta:
        return "expected a tensor with data, found one on device meta"
    if t.shape != own.shape:
        return f"expected shape {list(own.shape)}, found {list(t.shape)}"
    if t.dtype != own.dtype:
        return f"expected dtype {dtype_name(own.dtype)}, found {dtype_name(t.dtype)}"
    return None


class InProcessSender:
    """Publishes weights to an :class:`InProcessReceiver`; conforms to ``WeightSenderV1``.

    Example:
        >>> import torch
        >>> sender, receiver = in_process_weight_sync(torch.nn.Linear(2, 2))
        >>> sender.send({"weight": torch.zeros(3, 2)}, version=1)
        Traceback (most recent call last):
        ...
        posttrain.reference_impls.weight_sync.WeightMismatch: weights rejected, receiver unchanged: 'bias': missing (expected float32 [2]); 'weight': expected shape [2, 2], found [3, 2]
    """

    def __init__(self, receiver: InProcessReceiver) -> None:
        self._receiver = receiver

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Validate and publish ``weights`` as ``version``.

        ``version`` must exceed both the receiver's and any version still pending.
        """
        self._receiver._post(weights, version)


def in_process_weight_sync(model: torch.nn.Module) -> tuple[InProcessSender, InProcessReceiver]:
    """The weight-sync factory: ``factory(receiver_model) -> (sender, receiver)``.

    Example:
        >>> import torch
        >>> s, r = in_process_weight_sync(torch.nn.Linear(2, 2))
        >>> r.version
        0
    """
    receiver = InProcessReceiver(model)
    return InProcessSender(receiver), receiver
