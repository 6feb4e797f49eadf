"""The policy the suites control: a tiny real Hugging Face causal LM, built from a config."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_causal_lm"]


def tiny_causal_lm(
    *, vocab_size: int = 64, seed: int = 0, hidden_size: int = 32, layers: int = 1
) -> Any:
    """A seeded ``LlamaForCausalLM`` with one layer and hidden size 32 (no download).

    ``policy(input_ids=..., attention_mask=...).logits`` is [B, T, V]; logits at t predict
    token t+1. Needs ``transformers`` (``pip install 'posttrain[trl]'``).

    Example:
        >>> m = tiny_causal_lm(vocab_size=64)
        >>> m(input_ids=torch.zeros(2, 5, dtype=torch.long)).logits.shape
        torch.Size([2, 5, 64])
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the loss and rollout suites build a tiny Hugging Face causal LM: "
            "install transformers with `pip install 'posttrain[trl]'`"
        ) from e
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(cfg)
    model.train(False)
    return model
