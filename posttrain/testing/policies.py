"""The policies the suites control: tiny real Hugging Face models built from a config (no download)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain._deps import optional_deps


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
    return _seeded(LlamaForCausalLM, _config(LlamaConfig, vocab_size, hidden_size, layers), seed)


def _config(cls: Any, vocab_size: int, hidden_size: int, layers: int, **extra: Any) -> Any:
    """The tiny Llama every test policy shares: 2 heads, token ids pad 0, bos 1, eos 2."""
    return cls(
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
        **extra,
    )


def _seeded(cls: Any, cfg: Any, seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = cls(cfg)
    model.train(False)
    return model


def tiny_reward_model(*, vocab_size: int = 64, seed: int = 1, hidden_size: int = 32) -> Any:
    """A seeded one-label ``LlamaForSequenceClassification`` (a reward model, no download).

    Example:
        >>> rm = tiny_reward_model()
        >>> rm(input_ids=torch.tensor([[5, 6, 7]])).logits.shape
        torch.Size([1, 1])
    """
    with optional_deps():
        from transformers import LlamaConfig, LlamaForSequenceClassification

    # num_labels is a PretrainedConfig kwarg the stubs omit
    return _seeded(
        LlamaForSequenceClassification,
        _config(LlamaConfig, vocab_size, hidden_size, 1, num_labels=1),
        seed,
    )


def forced_token_weights(model: Any, token: int) -> dict[str, torch.Tensor]:
    """Weights for a tiny Llama that emits ``token`` after any input, whatever came before.

    The residual stream is the embedding alone (attention and MLP outputs zeroed), every
    embedding is the first unit vector, and only ``token``'s output row reads that unit: its
    logit beats every other by ~280. Used to see, through generated tokens alone, that new
    weights are in use.

    Example:
        >>> m = tiny_causal_lm(vocab_size=64)
        >>> _ = m.load_state_dict(forced_token_weights(m, 7))
        >>> m(input_ids=torch.tensor([[5, 9, 11]])).logits[0, -1].argmax().item()
        7
    """

    def embed(w: torch.Tensor) -> None:
        w[:, 0] = 1.0

    def head(w: torch.Tensor) -> None:
        w[token, 0] = 50.0

    return _residual_only(model, embed, head)


def next_token_weights(model: Any, table: dict[int, int]) -> dict[str, torch.Tensor]:
    """Weights under which the next token is ``table[last token]`` whatever came before.

    As in :func:`forced_token_weights`, the residual stream is the embedding alone; here each
    token of ``table`` embeds as its own unit vector and the output row of its successor reads
    that unit (a logit ~280 above every other). A token outside the table embeds as zero and
    is followed by token 0. Needs ``len(table)`` <= the hidden size.

    Example:
        >>> m = tiny_causal_lm(vocab_size=64)
        >>> _ = m.load_state_dict(next_token_weights(m, {5: 9, 9: 2}))
        >>> m(input_ids=torch.tensor([[3, 5]])).logits[0, -1].argmax().item()
        9
    """
    units = {tok: i for i, tok in enumerate(sorted(table))}

    def embed(w: torch.Tensor) -> None:
        for tok, i in units.items():
            w[tok, i] = 1.0

    def head(w: torch.Tensor) -> None:
        for tok, nxt in table.items():
            w[nxt, units[tok]] = 50.0

    return _residual_only(model, embed, head)


def _residual_only(
    model: Any, embed: Callable[[torch.Tensor], None], head: Callable[[torch.Tensor], None]
) -> dict[str, torch.Tensor]:
    """``model``'s weights with attention and MLP outputs zeroed and unit norms, so the last
    position's logits are ``head @ embed[last token]``; ``embed`` and ``head`` fill the zeroed
    embedding and LM-head matrices."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        w = t.detach().clone()
        if name.endswith("embed_tokens.weight"):
            w.zero_()
            embed(w)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
        elif name.endswith("norm.weight"):
            w.fill_(1.0)
        elif name == "lm_head.weight":
            w.zero_()
            head(w)
        out[name] = w
    return out
