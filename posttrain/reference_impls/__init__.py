"""Small, obviously-correct implementations of every contract.

Example:
    >>> from posttrain.reference_impls import RingBuffer
    >>> len(RingBuffer(capacity=8))
    0
"""

from posttrain.contracts import Implementation
from posttrain.reference_impls.ring_buffer import RingBuffer

__all__ = ["RING_BUFFER", "RingBuffer", "make_ring_buffer"]


def make_ring_buffer(capacity: int) -> RingBuffer:
    """The buffer factory the conformance suite calls: ``factory(capacity)``.

    Example:
        >>> make_ring_buffer(4).capacity
        4
    """
    return RingBuffer(capacity)


RING_BUFFER = Implementation(
    "buffer",
    make_ring_buffer,
    name="posttrain.RingBuffer",
    capabilities={"checkpoint", "thread_safe"},
    description="Reference FIFO ring buffer over one preallocated row-packed byte matrix.",
)
"""The reference buffer's declaration (entry point ``reference-buffer``)."""
