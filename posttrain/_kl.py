"""Schulman's KL estimators of a log-ratio, one function for every user (private).

The reference loss, the observability hooks and the adapters all estimate KL(pi || q) from
log r = log q - log pi at the sampled tokens; this is the one place the three formulas live.
It imports torch alone, so any layer above the contracts may use it.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
"""KL estimators of log r = log pi_ref - log pi (Schulman): k1 -log r, k2 (log r)^2 / 2,
k3 r - 1 - log r.

Example:
    >>> KL_ESTIMATORS[-1]
    'k3'
"""


def kl_estimate(log_r: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || q) from ``log_r = log q - log pi``.

    k1 is ``-log r`` (unbiased, may be negative), k2 ``(log r)^2 / 2`` (biased, low variance),
    k3 ``r - 1 - log r`` (unbiased and never negative).

    Example:
        >>> x = torch.tensor([0.0, 0.5])
        >>> [round(v, 4) for v in kl_estimate(x, "k3").tolist()]
        [0.0, 0.1487]
    """
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return log_r * log_r / 2
    if estimator == "k3":
        return log_r.exp() - 1 - log_r
    raise ValueError(f"kl estimator: expected one of {list(KL_ESTIMATORS)}, found {estimator!r}")
