"""Greedy decoding with a Hugging Face causal LM, shared by the independent generators.

Written from the specs alone: left-padded batches, positions counted over real tokens only,
the whole sequence re-run each step (no KV cache: the models are tiny and it keeps a batched
row bit-close to the same row decoded alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Decoded", "eos_id", "greedy_decode"]


@dataclass
class Decoded:
    """One prompt's greedy continuation: the tokens and log p of each under the weights used."""

    tokens: list[int]
    log_probs: list[float]


def eos_id(model: Any) -> int | None:
    """The model's EOS id, or ``None``.

    Example:
        >>> class M: config = type("C", (), {"eos_token_id": [2, 3]})()
        >>> eos_id(M())
        2
    """
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)


@torch.no_grad()
def greedy_decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    stop: Callable[[], bool] | None = None,
    trim_at_eos: bool = True,
) -> list[Decoded]:
    """Greedy continuations of ``prompts`` (a batch), each ending at EOS (kept) or the budget.

    ``stop`` is polled before each step; when it says so, decoding raises ``RuntimeError``.
    ``trim_at_eos=False`` pads a finished row while the batch's longest still runs, and keeps
    the padding in its response (a bug the tests plant: HF ``generate``'s output, untrimmed).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> out = greedy_decode(tiny_causal_lm(), [[5, 6], [7]], 3)
        >>> [1 <= len(d.tokens) <= 3 for d in out]
        [True, True]
    """
    n = len(prompts)
    eos = eos_id(model)
    pad = 0
    seqs = [list(map(int, p)) for p in prompts]
    out = [Decoded([], []) for _ in range(n)]
    done = [False] * n
    for _ in range(max_new_tokens):
        if stop is not None and stop():
            raise RuntimeError("generation aborted: the server is shutting down")
        live = [i for i in range(n) if not done[i]]
        if not live:
            break
        width = max(len(seqs[i]) for i in live)
        ids = torch.full((len(live), width), pad, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for r, i in enumerate(live):
            s = seqs[i]
            ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[r, width - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = lp.argmax(-1)
        if not trim_at_eos:  # the planted bug: finished rows are padded while others run
            for i in range(n):
                if done[i]:
                    out[i].tokens.append(pad)
                    out[i].log_probs.append(0.0)
        for r, i in enumerate(live):
            t = int(nxt[r])
            out[i].tokens.append(t)
            out[i].log_probs.append(float(lp[r, t]))
            seqs[i].append(t)
            if eos is not None and t == eos:
                done[i] = True
    return out
