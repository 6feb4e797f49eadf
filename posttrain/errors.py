"""The one base of every error posttrain raises, and the errors shared by several modules.

Every exception class posttrain defines derives from :class:`PosttrainError`; each keeps the
built-in base it always had (``ValueError``, ``RuntimeError``, ``KeyError``...), so code that
catches those keeps working. This module imports nothing from posttrain, so any module may
import it.

Example:
    >>> from posttrain.errors import PosttrainError, SourceClosed
    >>> issubclass(SourceClosed, PosttrainError) and issubclass(SourceClosed, RuntimeError)
    True
"""

from __future__ import annotations


class PosttrainError(Exception):
    """Base of every exception posttrain defines: ``except PosttrainError`` catches them all.

    Example:
        >>> from posttrain.contracts import ContractViolation
        >>> issubclass(ContractViolation, PosttrainError)
        True
    """


class SourceClosed(PosttrainError, RuntimeError):
    """Iterating or updating a rollout source after its ``shutdown()``.

    Raised by every bundled rollout source (the reference HF source, the TorchRL collector
    adapter and the TRL source).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.reference_impls import HFRolloutSource
        >>> src = HFRolloutSource(tiny_causal_lm(), [[5, 6, 7]], num_samples=1)
        >>> src.shutdown()
        >>> next(iter(src))
        Traceback (most recent call last):
        ...
        posttrain.errors.SourceClosed: ...
    """


class ServerClosed(PosttrainError, RuntimeError):
    """A request reached a generation server after its ``shutdown()``.

    Raised by the reference ``ThreadGenerationServer`` and the TorchRL inference-server adapter.

    Example:
        >>> str(ServerClosed("submit after shutdown(): this server serves no more requests"))
        'submit after shutdown(): this server serves no more requests'
    """
