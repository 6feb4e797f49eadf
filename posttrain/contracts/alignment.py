"""The layout's log-prob alignment, as a function: position t holds log p(token_t | before t)."""

from __future__ import annotations

import torch


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs aligned like ``("log_probs", "full")``; position 0 (never predicted) is 0.

    ``logits`` is [B, T, V] with logits at t predicting token t+1 (Hugging Face convention).

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
        >>> token_log_probs(logits, torch.tensor([[1, 2, 3]])).exp()
        tensor([[1.0000, 0.2500, 0.2500]])
    """
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
