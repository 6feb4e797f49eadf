"""TorchRL's Ray-served replay buffer with its buffer placed in a :class:`BufferHost` actor.

TorchRL's ``RayReplayBuffer`` starts one actor process per buffer (``replay_buffer_cls.as_remote``,
then ``.remote(...)``). A process costs 2-3 s of start-up on 2 cores (Python, Ray, torch,
torchrl), which a suite that builds ~40 fresh buffers pays ~40 times. :func:`hosted_torchrl_buffer`
hands ``RayReplayBuffer`` a placement whose ``as_remote(...).remote(...)`` builds the buffer in a
long-lived host actor instead and returns a stand-in for its handle. Everything on the client
side is TorchRL's own code (``RayReplayBuffer``, ``_RayReplayBufferClient``, ``ray.get`` of each
call); in the host each call runs on TorchRL's own buffer, one call at a time, as in TorchRL's
actor. What differs: the host dispatches the contract's methods only (:data:`TORCHRL_METHODS`),
and ``close()`` cannot ``ray.kill`` a stand-in, so the buffer is freed when its owner is dropped.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from posttrain._deps import optional_deps
from posttrain.adapters._ray import ensure_cluster, ray_get
from posttrain.adapters.ray.buffer import CALL_TIMEOUT_S, TORCHRL_METHODS, _drop


class ActorStandIn:
    """What one hosted buffer's callers hold instead of an actor handle.

    ``standin.extend.remote(td)`` returns the ``ObjectRef`` of ``host.call(key, "extend", (td,))``,
    as ``actor.extend.remote(td)`` would; names outside :data:`TORCHRL_METHODS` raise
    ``AttributeError`` here, and the host refuses them too. Picklable: a stand-in sent to a Ray
    task reaches the same buffer.

    Example:
        >>> s = ActorStandIn(None, "k")
        >>> s.key
        'k'
        >>> s.set_storage
        Traceback (most recent call last):
        ...
        AttributeError: set_storage: a hosted buffer serves only __getitem__, __len__, dumps, extend, load_state_dict, loads, sample, state_dict, update_priority
    """

    def __init__(self, host: Any, key: str) -> None:
        self._host = host
        self.key = key

    def __getattr__(self, name: str) -> _Method:
        # Reached only for names the instance lacks; pickle probes (__setstate__, ...) land here.
        if name not in TORCHRL_METHODS or "_host" not in self.__dict__:
            raise AttributeError(
                f"{name}: a hosted buffer serves only {', '.join(sorted(TORCHRL_METHODS))}"
            )
        return _Method(self._host, self.key, name)

    def __repr__(self) -> str:
        return f"ActorStandIn(key={self.key!r})"


class _Method:
    def __init__(self, host: Any, key: str, name: str) -> None:
        self._host, self._key, self._name = host, key, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._host.call.remote(self._key, self._name, args, kwargs)


class _Placement:
    """Stands for ``replay_buffer_cls`` in ``RayReplayBuffer``: places the buffer in ``host``."""

    def __init__(self, cls: type, host: Any, timeout: float | None) -> None:
        self.cls, self.host, self.timeout = cls, host, timeout
        self.placed: ActorStandIn | None = None

    def as_remote(self, remote_config: dict[str, Any] | None = None) -> _Placement:
        return self  # the host's own options were set when it started

    def remote(self, *args: Any, **kwargs: Any) -> ActorStandIn:
        key = uuid.uuid4().hex
        try:
            ray_get(
                self.host.create.remote(key, self.cls, args, kwargs, TORCHRL_METHODS), self.timeout
            )
        except BaseException:
            # A create that timed out may still run: the host runs its calls one after another,
            # so a drop queued now runs after it and frees what it built (drop is idempotent).
            _drop(self.host, key)
            raise
        self.placed = ActorStandIn(self.host, key)
        return self.placed


def hosted_torchrl_buffer(
    cls: type,
    /,
    host: Any,
    *,
    timeout: float | None = CALL_TIMEOUT_S,
    **kwargs: Any,
) -> Any:
    """TorchRL's ``RayReplayBuffer`` around a new ``cls(**kwargs)`` built in ``host``.

    ``cls`` is a TorchRL buffer class (``TensorDictReplayBuffer``); ``kwargs`` are what
    ``cls(..., service_backend="ray")`` takes (storage and sampler as constructors). ``host``
    is a :class:`BufferHost` actor. Each call builds a new, empty buffer under a key of its
    own: buffers in one host share the process, never state. Dropping the returned object
    drops the buffer from the host.

    Example (not run by the doctests: tests/adapters/ray/test_ray.py owns the cluster's lifetime):
        >>> from functools import partial
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> from posttrain.adapters.ray.implementations import shared_host
        >>> rb = hosted_torchrl_buffer(  # doctest: +SKIP
        ...     TensorDictReplayBuffer, shared_host(), storage=partial(LazyTensorStorage, 8)
        ... )
        >>> type(rb).__name__, len(rb)  # doctest: +SKIP
        ('RayReplayBuffer', 0)
    """
    with optional_deps():
        from torchrl.data import RayReplayBuffer

    ensure_cluster()  # joined, not owned, by TorchRL: its lease never shuts Ray down
    placement = _Placement(cls, host, timeout)
    # A config of our own (unused: Ray is up): without one TorchRL imports its default from
    # torchrl.collectors.distributed, whose import keeps a traceback, and with it the frames
    # building the first buffer: that buffer would never be freed.
    kwargs.setdefault("ray_init_config", {})
    try:
        rb = RayReplayBuffer(replay_buffer_cls=placement, **kwargs)  # type: ignore[arg-type]
    except BaseException:
        # TorchRL's cleanup ray.kill()s what it took for an actor; a stand-in is no actor, so
        # the buffer already built in the host is dropped here.
        if placement.placed is not None:
            _drop(host, placement.placed.key)
        raise
    assert placement.placed is not None  # RayReplayBuffer calls as_remote(...).remote(...)
    weakref.finalize(rb, _drop, host, placement.placed.key)
    return rb
