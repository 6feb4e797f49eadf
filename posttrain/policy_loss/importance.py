"""Off-policy importance weights pi_old / pi_gen, truncated as declared."""

from __future__ import annotations

import torch


def importance_weights(
    prox: torch.Tensor,
    gen: torch.Tensor,
    fm: torch.Tensor,
    correction: str | None,
    bounds: tuple[float, float] | None,
    per_sequence: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and where the untruncated weight lay outside ``bounds``.

    The weight is pi_prox / pi_gen per token ([B, T], 1 off the float mask ``fm``) or, with
    ``per_sequence``, per row ([B, 1]: the product over the row's tokens); both log-prob
    tensors are detached. ``tis`` clamps it to ``bounds``, ``icepop`` zeroes it outside them,
    ``seq_mask_tis`` zeroes a row whose geometric-mean weight is outside them (its outside
    mask is then [B, 1]); ``None`` and ``plain`` leave it as is (outside: all False).

    Example:
        >>> fm = torch.tensor([[0.0, 1.0, 1.0]])
        >>> prox, gen = torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3)
        >>> w, out = importance_weights(prox, gen, fm, "tis", (0.0, 2.0), False)
        >>> [round(v, 4) for v in w[0].tolist()], out[0].tolist()
        ([1.0, 1.0, 2.0], [False, False, True])
    """
    mask = fm > 0
    diff = torch.where(mask, prox.detach() - gen.detach(), 0.0)
    w = diff.sum(-1, keepdim=True).exp() if per_sequence else torch.where(mask, diff.exp(), 1.0)
    outside = torch.zeros_like(w, dtype=torch.bool)
    if correction in ("tis", "icepop"):
        assert bounds is not None
        lo, hi = bounds
        outside = (w > hi) | (w < lo)
        w = w.clamp(lo, hi) if correction == "tis" else torch.where(outside, 0.0, w)
    elif correction == "seq_mask_tis":
        assert bounds is not None
        lo, hi = bounds
        geo = (diff.sum(-1, keepdim=True) / fm.sum(-1, keepdim=True).clamp_min(1)).exp()
        outside = (geo < lo) | (geo > hi)
        w = w * (~outside).to(w.dtype)
    return w, outside
