"""posttrain: explicit, versioned contracts for the seams of LLM RL post-training.

The public API is what the package ``__init__`` modules export: ``posttrain`` (this one),
``posttrain.contracts``, ``posttrain.conformance``, ``posttrain.reference_impls``,
``posttrain.observability``, ``posttrain.testing`` and ``posttrain.adapters.{torchrl,trl,
nemo_rl,ray}``; docs/api.md lists them. Every other module is an implementation detail.

Example:
    >>> import posttrain
    >>> posttrain.__version__
    '0.1.0'
    >>> issubclass(posttrain.SourceClosed, posttrain.PosttrainError)
    True
"""

from posttrain.errors import PosttrainError, ServerClosed, SourceClosed

__version__ = "0.1.0"

__all__ = ["PosttrainError", "ServerClosed", "SourceClosed"]
