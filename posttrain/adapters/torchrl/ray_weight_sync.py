"""TorchRL's ``RayWeightSyncScheme``: the sender here, the receiving model in a Ray actor.

The weights travel over a gloo process group between this process and the actor; Ray only
signals and hands over the address. TorchRL writes each received tensor straight into the
live parameters and checks nothing but byte sizes, so a bad set of weights aborts the actor
(wrong size), silently reinterprets bits (same size, other dtype) or leaves it half-updated
(a missing last tensor): tests/adapters/ray/test_weight_sync.py shows each. The adapted pair puts
:class:`~posttrain.adapters.torchrl.weight_sync.CheckedSender` in front, so nothing bad is sent.

The version travels with the weights through the scheme's own ``model_version`` argument
(``_set_model_version``, what TorchRL's Ray trainer calls), not beside the transport.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import time
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from posttrain._deps import optional_deps
from posttrain.adapters._ray import ensure_cluster, ray_get
from posttrain.adapters.torchrl.weight_sync import (
    SEND_TIMEOUT_S,
    CheckedSender,
    _call_with_timeout,
    _nested,
)

DIST_TIMEOUT_S = 30.0
"""TorchRL's gloo timeout for this scheme (its module default is 60 s), in both processes.

It also bounds connecting, which includes the cold start of TorchRL's ``ConnectionInfo``
actor on a loaded 2-core machine."""

CONNECT_TIMEOUT_S = 120.0
"""How long starting the actor and joining the process group may take."""


def _set_dist_timeout() -> None:
    with optional_deps():
        import torchrl.weight_update._ray as scheme_module

    # A module constant, not an argument, in TorchRL 0.14; lowered so a hung sync fails fast.
    scheme_module._DIST_TIMEOUT = timedelta(seconds=DIST_TIMEOUT_S)


class ReceiverActor:
    """The actor body: holds the receiving model and TorchRL's receiving end of the scheme.

    Example (the actor side of :func:`ray_weight_sync_pair`; run here without Ray):
        >>> ReceiverActor.__name__
        'ReceiverActor'
    """

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        import resource

        # A bad send aborts this process (SIGABRT in gloo), by TorchRL's design: no core file.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _set_dist_timeout()
        # Actors are started ahead of need (see _take_actor): import now what unpickling a
        # model and the scheme in attach() would otherwise import then (~3 s on 2 cores, and
        # ~0.9 s more for a tiny Llama's modeling module, which transformers loads lazily).
        for name in ("transformers", *preload):
            with contextlib.suppress(ImportError):  # a module this process lacks: none to warm
                importlib.import_module(name)
        self.model: torch.nn.Module | None = None
        self.scheme: Any = None
        self.version = 0

    def attach(self, model: torch.nn.Module, scheme: Any) -> None:
        """Take the receiving model and TorchRL's receiving end of the scheme."""
        self.model = model  # the scheme holds only a weak reference
        self.scheme = scheme
        scheme.init_on_receiver(model_id="policy", worker_idx=0, model=model)

    def connect(self) -> None:
        """Join the scheme's process group (collective with the sender's ``connect``)."""
        self.scheme.connect(worker_idx=0)

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:
        # The name is TorchRL's: RayTransport calls it on the actor for every send.
        self.scheme.receive()
        if model_version is not None:
            self.version = int(model_version)

    def state(self) -> tuple[dict[str, torch.Tensor], int]:
        """A copy of the model's weights and the version they came with."""
        assert self.model is not None, "attach() first"
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}, self.version

    def current_version(self) -> int:
        """The version of the weights the model holds."""
        return self.version

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


class RaySchemeSender:
    """The raw sending end: ``send(weights, version=v)`` mapped onto the scheme's ``send``.

    The receiving end expects every tensor of ``TensorDict.from_module(model)``, non-persistent
    buffers included (a tiny Llama's rotary ``inv_freq``), which no ``state_dict`` carries: sent
    a state dict alone, it waits for tensors that never come until the gloo timeout. The call
    shape is mapped by adding those buffers, as the receiving model holds them (``extras``).

    Example (not run by the doctests: tests/adapters/ray/test_weight_sync.py owns the cluster):
        >>> from posttrain.testing import tiny_causal_lm
        >>> sender, receiver = ray_weight_sync_pair(tiny_causal_lm(seed=0))  # doctest: +SKIP
        >>> sorted(sender.extras)  # doctest: +SKIP
        ['model.rotary_emb.inv_freq', 'model.rotary_emb.original_inv_freq']
        >>> sender.send(tiny_causal_lm(seed=1).state_dict(), version=2)  # doctest: +SKIP
        >>> receiver.receive(timeout=30); receiver.version  # doctest: +SKIP
        2
    """

    def __init__(self, scheme: Any, extras: Mapping[str, torch.Tensor]) -> None:
        self.scheme = scheme
        self.extras = dict(extras)
        self.last_sync_s: float | None = None

    def send(self, weights: Mapping[str, torch.Tensor], /, *, version: int) -> None:
        """Push ``weights`` with ``version``; returns once the actor applied them."""
        td = _nested({**self.extras, **weights})
        self.scheme._set_model_version(version)
        t0 = time.perf_counter()
        _call_with_timeout(
            lambda: self.scheme.send(weights=td),
            DIST_TIMEOUT_S + SEND_TIMEOUT_S,
            "RayWeightSyncScheme.send",
        )
        self.last_sync_s = time.perf_counter() - t0


class RayReceiver:
    """This process's view of the receiving actor: its version, weights and process.

    Example (not run by the doctests: tests/adapters/ray/test_weight_sync.py owns the cluster):
        >>> from posttrain.testing import tiny_causal_lm
        >>> trainer = tiny_causal_lm(seed=1)
        >>> sender, receiver = ray_weight_sync_pair(tiny_causal_lm(seed=0))  # doctest: +SKIP
        >>> sender.send(trainer.state_dict(), version=1)  # doctest: +SKIP
        >>> receiver.receive(timeout=30)  # doctest: +SKIP
        >>> got = receiver.state_dict()["lm_head.weight"]  # doctest: +SKIP
        >>> receiver.version, got.equal(trainer.lm_head.weight)  # doctest: +SKIP
        (1, True)
    """

    def __init__(self, actor: Any, sender: RaySchemeSender, scheme: Any) -> None:
        self.actor = actor
        self._sender = sender
        self._version = 0
        self.pid: int = ray_get(actor.pid.remote(), CONNECT_TIMEOUT_S)
        # The suite never closes what it makes: dropping the receiver frees actor and group.
        self._close = weakref.finalize(self, _shutdown, ensure_cluster(), scheme, actor)

    def receive(self, timeout: float | None = None) -> None:
        """Read the version the actor holds (TorchRL applied the weights during ``send``)."""
        self._version = ray_get(self.actor.current_version.remote(), timeout)

    @property
    def version(self) -> int:
        """The version of the weights the actor's model holds, as of the last :meth:`receive`."""
        return self._version

    @property
    def last_sync_s(self) -> float | None:
        """Wall time of the last send, applied on the actor included."""
        return self._sender.last_sync_s

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the actor's model weights."""
        out: dict[str, torch.Tensor] = ray_get(self.actor.state.remote(), CONNECT_TIMEOUT_S)[0]
        return out

    def close(self) -> None:
        """Shut the scheme down and kill the actor (idempotent)."""
        self._close()


def non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``TensorDict.from_module`` holds and ``state_dict`` leaves out (copies).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> sorted(non_persistent_buffers(tiny_causal_lm()))
        ['model.rotary_emb.inv_freq', 'model.rotary_emb.original_inv_freq']
    """
    from tensordict import TensorDict

    saved = model.state_dict()
    every = TensorDict.from_module(model).flatten_keys(".")
    return {str(k): v.detach().clone() for k, v in every.items() if k not in saved}


_spare: dict[str, Any] = {}
"""One receiver actor started ahead of need, by the cluster's job id it belongs to."""


def _model_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The modules defining ``model``'s classes, which unpickling it imports."""
    return tuple(sorted({type(m).__module__ for m in model.modules()}))


def _take_actor(ray: Any, *, start_next: bool, model: torch.nn.Module) -> Any:
    """A fresh, unattached receiver actor (one started ahead, if any); with ``start_next``,
    starts the next one in the background.

    Each pair gets an actor nothing else ever used. Its process spends seconds importing torch,
    TorchRL and transformers before it can answer; the conformance suite makes a pair per check,
    so the next pair's actor boots while this one is used, importing as it does the modules
    of this pair's ``model`` (the likeliest next one).
    """
    job = ray.get_runtime_context().get_job_id()
    preload = _model_modules(model)

    def start() -> Any:
        return ray.remote(ReceiverActor).options(num_cpus=0).remote(preload)

    actor = _spare.pop(job, None) or start()
    _spare.clear()  # after a ray.shutdown() an older cluster's actor is gone anyway
    if start_next:
        _spare[job] = start()
    return actor


def _shutdown(ray: Any, scheme: Any, actor: Any) -> None:
    with contextlib.suppress(Exception):
        scheme.shutdown()
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def ray_weight_sync_pair(
    receiver_model: torch.nn.Module, *, adapted: bool = False, start_next: bool = False
) -> tuple[Any, RayReceiver]:
    """A (sender, receiver) pair over ``RayWeightSyncScheme``; the receiver is a Ray actor.

    The actor gets a copy of ``receiver_model``; read its weights with
    ``receiver.state_dict()``. Joins the running Ray cluster or starts a local one. With
    ``start_next``, the next pair's receiver actor starts booting now (for a caller that makes
    pair after pair, as the conformance suite does); it stays idle until that next call.

    Example (not run by the doctests: tests/adapters/ray/test_weight_sync.py owns the cluster):
        >>> from posttrain.testing import tiny_causal_lm
        >>> sender, receiver = ray_weight_sync_pair(tiny_causal_lm(), adapted=True)  # doctest: +SKIP
        >>> sender.send(tiny_causal_lm(seed=1).state_dict(), version=3)  # doctest: +SKIP
        >>> receiver.receive(); receiver.version  # doctest: +SKIP
        3
    """
    with optional_deps():
        from torchrl.weight_update import RayWeightSyncScheme

    ray = ensure_cluster()
    _set_dist_timeout()
    scheme: Any = RayWeightSyncScheme(
        backend="gloo"
    )  # its init_on_sender overloads omit Ray's kwargs
    actor = _take_actor(ray, start_next=start_next, model=receiver_model)
    try:
        # Pickled now, before init_on_sender, as TorchRL's own receivers get the scheme.
        attached = actor.attach.remote(receiver_model, scheme)
        # TorchRL holds the sender's model by weak reference: this one is gone once the call
        # returns, so connect sends no initial weights and the receiver keeps its own.
        scheme.init_on_sender(
            model_id="policy",
            remote_collectors=[actor],
            num_workers=1,
            model=copy.deepcopy(receiver_model),
        )
        ray_get(attached, CONNECT_TIMEOUT_S)  # started: connect's timeout is short
        joined = actor.connect.remote()
        scheme.connect()
        ray_get(joined, CONNECT_TIMEOUT_S)
        raw = RaySchemeSender(scheme, non_persistent_buffers(receiver_model))
        receiver = RayReceiver(actor, raw, scheme)
    except BaseException:
        _shutdown(ray, scheme, actor)
        raise
    # CheckedSender only calls send() on what it wraps.
    return (CheckedSender(raw, receiver_model) if adapted else raw), receiver  # type: ignore[arg-type]
