"""Ray-served buffers as conformance targets (entry points ``ray-served-*``).

The rows share one :class:`~posttrain.adapters.ray.buffer.BufferHost` actor per Ray session:
a new actor costs about 2 s of start-up on 2 cores, and the buffer suite builds dozens of
buffers. What is under test, the client-actor path, is the same as with a dedicated actor.
"""

from __future__ import annotations

from typing import Any

from posttrain.adapters._ray import ensure_cluster
from posttrain.adapters.ray.buffer import BufferHost, RemoteBuffer, serve_buffer
from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import RingBuffer

_HOSTS: dict[str, Any] = {}


def shared_host() -> Any:
    """The :class:`BufferHost` actor this Ray session's conformance rows share.

    Example (not run by the doctests: tests/test_ray.py owns the cluster's lifetime):
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
