"""Any ``ReplayBufferV1`` served from a Ray actor, behind the same Protocol."""

from __future__ import annotations

import contextlib
import os
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.adapters._ray import ensure_cluster, ray_get, ray_module
from posttrain.contracts.schema import leaf_violations
from posttrain.contracts.validation import ContractViolation

CALL_TIMEOUT_S = 120.0
"""How long a remote call may take before the client raises ``GetTimeoutError``."""


SERVED_METHODS = frozenset(
    {
        "extend",
        "sample",
        "__len__",
        "state_dict",
        "load_state_dict",
        "read",
        "update_priority",
        "dumps",
        "loads",
    }
)
"""What :meth:`BufferHost.call` dispatches: the buffer contract and its capabilities, nothing else."""

TORCHRL_METHODS = (SERVED_METHODS - {"read"}) | {"__getitem__"}
"""The same methods under a TorchRL buffer's names (``rb[indices]`` is its read): what the host
dispatches for a buffer TorchRL's ``RayReplayBuffer`` reaches (see ``posttrain.adapters.ray.hosted``)."""

_NAME_SETS = (SERVED_METHODS, TORCHRL_METHODS)


class BufferHost:
    """The actor body: buffers by key, one call at a time.

    Ray runs an actor's methods one after another (``max_concurrency=1``), so each ``extend``
    is atomic with respect to every other call, from every process, whatever the hosted
    buffer's own thread safety. One host may hold many independent buffers: each ``create``
    builds a new one under its own key, and nothing is shared between keys but the process
    (the conformance rows share one host to keep actor start-up, 2-3 s on 2 cores, out of
    every check).

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> host = BufferHost()
        >>> host.create("a", RingBuffer, (4,))
        ['dumps', 'loads', 'read']
        >>> host.call("a", "__len__", ())
        0
    """

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[Any, frozenset[str]]] = {}

    def create(
        self,
        key: str,
        factory: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        names: frozenset[str] = SERVED_METHODS,
    ) -> list[str]:
        """Build ``factory(*args, **kwargs)`` under ``key``; return which optional methods it has.

        ``names`` is what :meth:`call` will dispatch for it: :data:`SERVED_METHODS`, or
        :data:`TORCHRL_METHODS` for a TorchRL buffer.
        """
        known = next((n for n in _NAME_SETS if n == names), None)
        if known is None:  # the set arrives pickled: compare by value, keep the module's own
            raise ValueError(
                f"names: SERVED_METHODS or TORCHRL_METHODS, found {sorted(names)[:10]}"
            )
        if key in self._buffers:
            raise ValueError(f"key {key!r}: this host already holds a buffer under it")
        rb = factory(*args, **(kwargs or {}))
        self._buffers[key] = (rb, known)
        optional = ("dumps", "loads", "read", "update_priority")
        return [m for m in optional if callable(getattr(rb, m, None))]

    def call(
        self,
        key: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """``buffer.method(*args, **kwargs)`` on the buffer under ``key``: the contract's methods only."""
        rb, names = self._buffers.get(key, (None, SERVED_METHODS | TORCHRL_METHODS))
        if method not in names:
            raise ValueError(
                f"method {method!r}: a buffer host serves only the buffer contract's methods "
                f"({', '.join(sorted(names))})"
            )
        if rb is None:
            raise RuntimeError(f"no buffer {key!r} on this host: it was closed")
        out = getattr(rb, method)(*args, **(kwargs or {}))
        if names is SERVED_METHODS and isinstance(out, TensorDictBase):
            out = out.apply(_compact)
        return out

    def drop(self, key: str) -> None:
        """Forget the buffer under ``key`` (idempotent)."""
        self._buffers.pop(key, None)

    def held(self) -> int:
        """How many buffers the host holds (those not yet closed or dropped)."""
        return len(self._buffers)

    def pid(self) -> int:
        """The process the host runs in."""
        return os.getpid()


def _compact(t: torch.Tensor) -> torch.Tensor:
    # Pickling a view pickles its whole storage: a sample whose keys are views into one
    # gathered block (the reference RingBuffer's) would travel once per key.
    if t.is_nested:
        return t
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


# Finalizers: they may run at interpreter exit with Ray already down.
def _drop(host: Any, key: str) -> None:
    with contextlib.suppress(Exception):
        host.drop.remote(key)


def _kill(host: Any) -> None:
    with contextlib.suppress(Exception):
        ray_module().kill(host, no_restart=True)


class RemoteBuffer:
    """A ``ReplayBufferV1`` whose storage lives in a Ray actor (a :class:`BufferHost`).

    Every method is one actor call. Errors raised by the hosted buffer come back as
    themselves (a ``ContractViolation`` stays one), and since the actor runs one call at a
    time, a rejected ``extend`` leaves the buffer exactly as it was for every client.
    :meth:`client` (or pickling) gives a handle other Ray tasks and actors extend and sample
    through; only the handle :func:`serve_buffer` returned frees the buffer.

    Example (not run by the doctests: tests/adapters/ray/test_ray.py owns the cluster's lifetime):
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> rb = serve_buffer(RingBuffer, 8)  # doctest: +SKIP
        >>> rb.extend(TensorDict({"x": torch.arange(3)}, batch_size=[3])).tolist()  # doctest: +SKIP
        [0, 1, 2]
        >>> producer = rb.client()  # picklable: hand it to Ray tasks  # doctest: +SKIP
    """

    def __init__(
        self,
        host: Any,
        key: str,
        methods: frozenset[str],
        *,
        timeout: float | None = CALL_TIMEOUT_S,
        owner: bool = False,
        owns_host: bool = False,
    ) -> None:
        self._host = host
        self._key = key
        self._methods = methods
        self.timeout = timeout
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if owner and owns_host:
            self._finalizer = weakref.finalize(self, _kill, host)
        elif owner:
            self._finalizer = weakref.finalize(self, _drop, host, key)

    def _call(self, method: str, *args: Any) -> Any:
        if self._finalizer is not None and not self._finalizer.alive:
            raise RuntimeError(f"{method}: this served buffer was closed")
        return ray_get(self._host.call.remote(self._key, method, args), self.timeout)

    def _optional(self, method: str) -> None:
        if method not in self._methods:
            raise AttributeError(
                f"the served buffer has no {method}() (it declares {sorted(self._methods)})"
            )

    def extend(self, data: TensorDictBase, /) -> torch.Tensor:
        """Write every item of ``data`` in the actor; the storage indices written.

        A leaf no buffer stores (on ``meta``, sparse, requiring grad) is refused here, naming
        the key, before anything is sent: pickling would carry it across as something else.
        """
        bad = leaf_violations(data)
        if bad:
            raise ContractViolation(bad, "extend (buffer unchanged)")
        out: torch.Tensor = self._call("extend", data)
        return out

    def sample(self, batch_size: int, /) -> Any:
        """``batch_size`` stored items, drawn in the actor."""
        return self._call("sample", batch_size)

    def read(self, indices: torch.Tensor, /) -> Any:
        """The items at storage ``indices`` (capability ``read`` of the served buffer)."""
        self._optional("read")
        return self._call("read", indices)

    def update_priority(self, index: Any, priority: Any, /) -> None:
        """Set priorities (capability ``priority`` of the served buffer)."""
        self._optional("update_priority")
        self._call("update_priority", index, priority)

    def dumps(self, path: Any, /) -> Any:
        """Save under ``path``, written by the actor (a path on the actor's node)."""
        self._optional("dumps")
        return self._call("dumps", path)

    def loads(self, path: Any, /) -> Any:
        """Restore what :meth:`dumps` wrote under ``path`` (read by the actor)."""
        self._optional("loads")
        return self._call("loads", path)

    def __len__(self) -> int:
        n: int = self._call("__len__")
        return n

    def state_dict(self) -> dict[str, Any]:
        """The served buffer's state, copied to this process."""
        out: dict[str, Any] = self._call("state_dict")
        return out

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restore :meth:`state_dict`'s output into the served buffer."""
        self._call("load_state_dict", state_dict)

    @property
    def pid(self) -> int:
        """The process holding the storage."""
        out: int = ray_get(self._host.pid.remote(), self.timeout)
        return out

    def client(self) -> RemoteBuffer:
        """A handle to the same buffer for another process; closing it frees nothing."""
        return RemoteBuffer(self._host, self._key, self._methods, timeout=self.timeout)

    def close(self) -> None:
        """Free the served buffer (and its actor, if this handle started it); idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled handle is always a client: ownership never travels.
        return (_client, (self._host, self._key, self._methods, self.timeout))


def _client(host: Any, key: str, methods: frozenset[str], timeout: float | None) -> RemoteBuffer:
    return RemoteBuffer(host, key, methods, timeout=timeout)


def serve_buffer(
    factory: Callable[..., Any],
    *args: Any,
    host: Any = None,
    actor_options: dict[str, Any] | None = None,
    timeout: float | None = CALL_TIMEOUT_S,
) -> RemoteBuffer:
    """Build ``factory(*args)`` inside a Ray actor and return its owning handle.

    ``host`` is an existing :class:`BufferHost` actor to put the buffer in; by default a new
    one is started (``num_cpus=0``: it holds memory, not a core) and killed on :meth:`close`.
    Joins the running Ray cluster, or starts a local one (see ``ensure_cluster``).

    Example (not run by the doctests: tests/adapters/ray/test_ray.py owns the cluster's lifetime):
        >>> from posttrain.reference_impls import RingBuffer
        >>> rb = serve_buffer(RingBuffer, 1024)  # doctest: +SKIP
        >>> len(rb)  # doctest: +SKIP
        0
        >>> rb.close()  # doctest: +SKIP
    """
    ray = ensure_cluster()
    owns_host = host is None
    if owns_host:
        host = ray.remote(BufferHost).options(**{"num_cpus": 0, **(actor_options or {})}).remote()
    key = uuid.uuid4().hex
    try:
        methods = ray_get(host.create.remote(key, factory, args), timeout)
    except BaseException:
        if owns_host:
            _kill(host)
        raise
    return RemoteBuffer(
        host, key, frozenset(methods), timeout=timeout, owner=True, owns_host=owns_host
    )
