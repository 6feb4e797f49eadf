"""The per-token KL estimate to the reference, clamped and differentiated as declared."""

from __future__ import annotations

import torch

from posttrain._kl import kl_estimate


def kl_to_reference(
    logp: torch.Tensor,
    ref: torch.Tensor,
    gen: torch.Tensor,
    estimator: str = "k3",
    gradient: str = "pathwise",
    clamps: tuple[float | None, float | None] = (None, None),
) -> torch.Tensor:
    """k(log pi_ref - log pi) per token: clamped to ±``clamps[0]`` on the way in and
    ±``clamps[1]`` on the way out, and weighted as ``gradient`` says (the weight's value is 1
    under ``score``; its gradient is the score-function term, dropped where the input clamp is
    active). ``gen`` is the sampler's log-probs (the ``behaviour`` weight's denominator).

    Example:
        >>> lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
        >>> round(float(kl_to_reference(lp, ref, lp, "k3", "score", (None, None))), 4)
        0.1065
    """
    logr = ref - logp
    weight = None
    if gradient == "score":
        weight = (logp - logp.detach()).exp()
    elif gradient == "behaviour":
        weight = (logp - gen.detach()).exp()
    clamp_in, clamp_out = clamps
    if clamp_in is not None:
        clamped = logr.clamp(-clamp_in, clamp_in)
        if weight is not None:
            weight = torch.where(logr == clamped, weight, weight.detach())
        logr = clamped
    kl = kl_estimate(logr, estimator)
    if weight is not None:
        kl = weight * kl
    if clamp_out is not None:
        kl = kl.clamp(-clamp_out, clamp_out)
    return kl
