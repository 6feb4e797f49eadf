"""Ray adapters: posttrain's contracts across processes on a Ray cluster (ray imported lazily).

Example:
    >>> from posttrain.adapters.ray import serve_buffer
    >>> serve_buffer.__name__
    'serve_buffer'
"""

from posttrain.adapters.ray.buffer import RemoteBuffer, serve_buffer

__all__ = ["RemoteBuffer", "serve_buffer"]
