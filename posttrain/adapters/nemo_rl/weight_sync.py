"""NeMo-RL's ``WeightSynchronizer`` over any ``WeightSyncV1`` sender/receiver pair.

NeMo-RL (``nemo_rl/weight_sync/interfaces.py``, commit 7ea279a) drives weight refits through an
abstract ``WeightSynchronizer``: ``init_communicator()`` once after the policy and the generator
exist, ``sync_weights(*, timer, kv_scales)`` at each refit (``refit_policy_generation`` in
``nemo_rl/algorithms/grpo.py`` calls it when ``policy_generation.weight_synchronizer`` is set
and logs what it returns under ``refit/``), ``is_stale`` (True until a sync succeeds) and
``shutdown()``. Refit info is ``{name: (shape, dtype)}`` (``prepare_refit_info``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


class NemoWeightSynchronizer:
    """A ``WeightSynchronizer``-shaped object that sends ``state()`` through posttrain's contract.

    ``state`` returns the trainer's current weights (``policy.state_dict`` usually);
    ``receiver.receive`` is called after each send when a receiver is given (in-process pairs;
    a receiver in another process pulls on its own). Each sync sends the next version. A
    failed sync leaves ``is_stale`` True and re-raises (the contract guarantees the receiver
    was not half-written). ``kv_scales`` (FP8 KV-cache scales) have no counterpart here and
    are refused.

    Example:
        >>> import torch
        >>> from posttrain.reference_impls import in_process_weight_sync
        >>> trainer, generator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sender, receiver = in_process_weight_sync(generator)
        >>> sync = NemoWeightSynchronizer(trainer.state_dict, sender, receiver)
        >>> sync.init_communicator(); sync.is_stale
        True
        >>> sorted(sync.sync_weights()), sync.is_stale, receiver.version
        (['weight_sync_s', 'weight_version'], False, 1)
    """

    def __init__(
        self,
        state: Callable[[], Mapping[str, torch.Tensor]],
        sender: Any,
        receiver: Any = None,
        *,
        receive_timeout: float | None = 30.0,
    ) -> None:
        self.state = state
        self.sender = sender
        self.receiver = receiver
        self.receive_timeout = receive_timeout
        self.version = 0
        self._stale = True
        self._refit_info: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self._closed = False

    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{name: (shape, dtype)}`` of the weights, as NeMo-RL's policy workers report it."""
        return {k: (v.shape, v.dtype) for k, v in self.state().items()}

    def init_communicator(self) -> None:
        """Record the refit info every later sync is checked against."""
        self._refit_info = self.prepare_refit_info()

    @property
    def is_stale(self) -> bool:
        """True until a sync succeeds, and again after one fails."""
        return self._stale

    def sync_weights(
        self, *, timer: Any = None, kv_scales: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Send the trainer's weights as the next version; metrics for NeMo-RL's ``refit/``."""
        if self._closed:
            raise RuntimeError("sync_weights after shutdown()")
        if self._refit_info is None:
            raise RuntimeError("call init_communicator() before sync_weights()")
        if kv_scales is not None:
            raise ValueError(
                "kv_scales: FP8 KV-cache scales have no posttrain counterpart; pass None"
            )
        weights = self.state()
        now = {k: (v.shape, v.dtype) for k, v in weights.items()}
        if now != self._refit_info:
            changed = sorted(set(now) ^ set(self._refit_info)) or sorted(
                k for k in now if now[k] != self._refit_info[k]
            )
            raise ValueError(
                f"weights changed since init_communicator() (refit info): {changed[:5]}"
            )
        version = self.version + 1
        start = time.perf_counter()
        self._stale = True
        with _timed(timer, "prepare_for_generation/transfer_and_update_weights"):
            self.sender.send(weights, version=version)
            if self.receiver is not None:
                self.receiver.receive(timeout=self.receive_timeout)
        self.version = version
        self._stale = False
        return {"weight_sync_s": time.perf_counter() - start, "weight_version": float(version)}

    def shutdown(self) -> None:
        """Close sender and receiver where they can be; idempotent."""
        if self._closed:
            return
        self._closed = True
        for end in (self.sender, self.receiver):
            close = getattr(end, "close", None) or getattr(end, "shutdown", None)
            if callable(close):
                close()


@contextlib.contextmanager
def _timed(timer: Any, label: str) -> Iterator[None]:
    # NeMo-RL's Timer: ``with timer.time(label):``.
    if timer is None:
        yield
        return
    with timer.time(label):
        yield
