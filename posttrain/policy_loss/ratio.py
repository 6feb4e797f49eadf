"""The ratio the surrogate clips, its clipped value, and the PPO and CISPO surrogates."""

from __future__ import annotations

import torch


def ratios(logp: torch.Tensor, prox: torch.Tensor, fm: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token ratio of ``kind`` (see ``PolicyLossOptions.ratio``); 1 off the mask.

    ``prox`` is the ratio's denominator (``logp.detach()`` under ``on_policy``), ``fm`` the
    float mask; under ``none`` the "ratio" is log pi itself (REINFORCE's -A·log pi).

    Example:
        >>> lp, old = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[0.0, -1.0, -1.0]])
        >>> fm = torch.tensor([[0.0, 1.0, 1.0]])
        >>> [round(v, 4) for v in ratios(lp, old, fm, "sequence")[0].tolist()]
        [1.0, 0.6065, 0.6065]
    """
    mask = fm > 0
    if kind == "none":
        return logp
    if kind in ("sequence", "gspo_token"):  # GSPO: the row's geometric mean
        mean = ((logp - prox) * fm).sum(-1, keepdim=True) / fm.sum(-1, keepdim=True).clamp_min(1)
        if kind == "gspo_token":  # sg(ρ)·exp(logp_t - sg(logp_t)), verl's gspo
            return torch.where(mask, (mean.detach() + logp - logp.detach()).exp(), 1.0)
        return torch.where(mask, mean.exp().expand_as(logp), 1.0)
    return torch.where(mask, (logp - prox).exp(), 1.0)  # token, cispo, on_policy


def clamped(ratio: torch.Tensor, kind: str, clip: tuple[float, float]) -> torch.Tensor:
    """``ratio`` clipped to [1 - ε_low, 1 + ε_high]; unclipped where there is no PPO ratio
    (``none``: the log-prob itself; ``on_policy``: exactly 1).

    Example:
        >>> clamped(torch.tensor([0.5, 1.0, 2.0]), "token", (0.2, 0.28)).tolist()
        [0.800000011920929, 1.0, 1.2799999713897705]
    """
    if kind in ("none", "on_policy"):
        return ratio
    low, high = clip
    return ratio.clamp(1 - low, 1 + high)


def clipped_surrogate(
    adv: torch.Tensor, ratio: torch.Tensor, ratio_c: torch.Tensor, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A·r, -A·clip(r)) (and its min with -A·c where A < 0 under dual
    clip c), and where a clipped term is the active one.

    Example:
        >>> r = torch.tensor([2.0])
        >>> loss, active = clipped_surrogate(torch.tensor([1.0]), r, r.clamp(0.8, 1.2), None)
        >>> round(float(loss), 4), bool(active)
        (-1.2, True)
    """
    pg1, pg2 = -adv * ratio, -adv * ratio_c
    active = pg2 > pg1
    loss = torch.where(active, pg2, pg1)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        dual = (adv < 0) & (pg3 < loss)
        loss, active = torch.where(dual, pg3, loss), active | dual
    return loss, active


def cispo_surrogate(
    adv: torch.Tensor, ratio: torch.Tensor, ratio_c: torch.Tensor, logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss -A·sg(clip(r))·log pi (MiniMax-M1; verl's
    ``compute_policy_loss_cispo``) and where the weight is clipped: a clipped weight bounds
    the token's gradient, it does not zero it.

    Example:
        >>> r = torch.tensor([2.0])
        >>> loss, active = cispo_surrogate(torch.tensor([1.0]), r, r.clamp(0.8, 1.2), torch.tensor([-0.5]))
        >>> round(float(loss), 4), bool(active)
        (0.6, True)
    """
    return -adv * ratio_c.detach() * logp, ratio_c != ratio
