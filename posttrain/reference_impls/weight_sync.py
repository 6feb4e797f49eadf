"""The reference weight sync: in-process, validate-then-copy, versioned."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

__all__ = ["InProcessReceiver", "InProcessSender", "in_process_weight_sync"]


class WeightMismatch(ValueError):
    """Sent weights do not fit the receiver's model (names, shapes or dtypes)."""


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class InProcessReceiver:
    """Applies published weights to ``model``; conforms to ``WeightReceiverV1``.

    Weights are checked against the model's ``state_dict`` (names, shapes, dtypes) before a
    single byte is copied, so a rejected sync leaves the model and ``version`` unchanged.

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

    def check(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`WeightMismatch` naming every parameter that does not fit."""
        own = self.model.state_dict()
        problems = [
            f"{n!r}: missing (expected {_dt(t.dtype)} {list(t.shape)})"
            for n, t in own.items()
            if n not in weights
        ]
        problems += [f"{n!r}: unknown to the receiver's model" for n in weights if n not in own]
        for n, t in weights.items():
            if n in own and not isinstance(t, torch.Tensor):
                problems.append(f"{n!r}: expected a tensor, found {type(t).__name__}")
            elif n in own and t.shape != own[n].shape:
                problems.append(
                    f"{n!r}: expected shape {list(own[n].shape)}, found {list(t.shape)}"
                )
            elif n in own and t.dtype != own[n].dtype:
                problems.append(f"{n!r}: expected dtype {_dt(own[n].dtype)}, found {_dt(t.dtype)}")
        if problems:
            raise WeightMismatch("weights rejected, receiver unchanged: " + "; ".join(problems))

    def _post(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.check(weights)
        # Copy now: the sender may change its tensors as soon as send returns.
        snapshot = {n: t.detach().clone() for n, t in weights.items()}
        with self._cond:
            self._pending = (snapshot, version)
            self._cond.notify_all()

    def receive(self, timeout: float | None = None) -> int | None:
        """Apply the pending weights, waiting up to ``timeout`` s; return their version or None."""
        start = time.perf_counter()
        with self._cond:
            if self._pending is None and timeout:
                self._cond.wait(timeout)
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        weights, version = pending
        with torch.no_grad():
            for n, t in self.model.state_dict().items():
                t.copy_(weights[n])
        self._version = version
        self.last_sync_s = time.perf_counter() - start
        return version


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
        """Validate and publish ``weights`` as ``version`` (must exceed the receiver's)."""
        if not isinstance(version, int) or version <= self._receiver.version:
            raise ValueError(
                f"version: expected an int above {self._receiver.version}, found {version!r}"
            )
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
