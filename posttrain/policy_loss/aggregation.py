"""The aggregations' per-token weights over the global batch's counts."""

from __future__ import annotations

import torch

from posttrain.contracts.loss import GlobalCounts


def token_weights(
    mask: torch.Tensor, counts: GlobalCounts, aggregation: str, t_norm: int | None = None
) -> torch.Tensor:
    """Each token's weight w under ``aggregation`` (float64; the caller casts it).

    N and B come from ``counts`` (the global batch's); a sequence's own length L_i is always
    this micro-batch's ``mask`` row sum. token_mean m/N, seq_mean_token_mean m/(B·L_i),
    seq_mean_token_sum m/B, seq_mean_token_sum_norm m/(B·t_norm).

    Example:
        >>> m = torch.tensor([[False, True, True], [False, True, False]])
        >>> token_weights(m, GlobalCounts(3, 2), "seq_mean_token_mean").tolist()
        [[0.0, 0.25, 0.25], [0.0, 0.5, 0.0]]
    """
    m = mask.double()
    n, b = max(counts.tokens, 1), max(counts.sequences, 1)
    if aggregation == "token_mean":
        return m / n
    if aggregation == "seq_mean_token_mean":
        return m / (b * m.sum(-1, keepdim=True).clamp_min(1))
    if aggregation == "seq_mean_token_sum":
        return m / b
    if aggregation == "seq_mean_token_sum_norm" and t_norm is not None:
        return m / (b * t_norm)
    raise ValueError(
        f"aggregation: expected a known aggregation (and t_norm), found {aggregation!r}"
    )
