"""Ray-served buffers as conformance targets (entry points ``ray-served-*``).

The rows share one :class:`~posttrain.adapters.ray.buffer.BufferHost` actor per Ray session
(so do TorchRL's Ray-served rows, through :mod:`posttrain.adapters.ray.hosted`): a new actor
costs 2-3 s of start-up on 2 cores, and the buffer suite builds ~40 fresh buffers. Each
factory call still builds a new buffer under its own key, reached only through the handle it
returns; what is under test, the client-actor path, is the same as with a dedicated actor.
"""

from __future__ import annotations

from typing import Any

from posttrain.adapters._ray import ensure_cluster
from posttrain.adapters.ray.buffer import BufferHost, RemoteBuffer, _kill, serve_buffer
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import RingBuffer

_HOSTS: dict[str, Any] = {}


def shared_host() -> Any:
    """The :class:`BufferHost` actor this Ray session's conformance rows share.

    Example (not run by the doctests: tests/adapters/ray/test_ray.py owns the cluster's lifetime):
        >>> shared_host() is shared_host()  # doctest: +SKIP
        True
    """
    ray = ensure_cluster()
    # A new cluster (ray.shutdown, then ray.init) has a new node id: a host of an old one is dead.
    session = ray.get_runtime_context().get_node_id()
    if session not in _HOSTS:
        _HOSTS.clear()
        _HOSTS[session] = ray.remote(BufferHost).options(num_cpus=0).remote()
    return _HOSTS[session]


def close_shared_host() -> None:
    """Kill the shared host actor, if one was started, with every buffer it still holds.

    The next :func:`shared_host` starts a new one. Example (not run by the doctests):
        >>> close_shared_host()  # doctest: +SKIP
    """
    hosts = list(_HOSTS.values())
    _HOSTS.clear()
    for host in hosts:
        _kill(host)


def served_ring_buffer(capacity: int) -> RemoteBuffer:
    """The reference ``RingBuffer`` served from the shared host actor."""
    return serve_buffer(RingBuffer, capacity, host=shared_host())


SERVED_RING_BUFFER = Implementation(
    "buffer",
    served_ring_buffer,
    name="posttrain.adapters.ray.RemoteBuffer(RingBuffer)",
    capabilities={"checkpoint", "thread_safe", "read", "remote_writers"},
    description="The reference ring buffer in a Ray actor, reached through RemoteBuffer.",
)
"""The Ray adapter's row (entry point ``ray-served-reference-buffer``)."""
