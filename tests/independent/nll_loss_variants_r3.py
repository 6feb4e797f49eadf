"""Round-three blind one-bug variants of a supervised NLL loss (contract ``nll_loss`` v1),
written from ``specs/nll_loss-v1.md`` alone (the suites unread), to measure the kit's reach.

Each variant subclasses ``losses_sft_dpo.MaskedSumNLL`` (one batched call, log p = gathered
logit - logsumexp, one masked weighted sum; conforming) and changes one thing, a bug of a
kind not named in ``nll_loss_variants.py`` nor in ``losses_sft_dpo.py``: a clamped log, a
pad id taken as an ignore index, an off-by-one trim, a stale cache. ``DEMOS[name]()`` shows
the bug with plain code against the sentence (True when it shows).

Results (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; the base ``MaskedSumNLL`` passes each
id):

- ``log_prob_clamped`` breaks NLL-003: **caught** (NLL-003: aggregation 'token_mean':
  loss_nll of a batch of 5 rows x 24 columns (60 assistant tokens in 4 rows), output head x
  1000 (logits up to 421.3, assistant log p down to -554) is 98.9959, expected 294.653); nll_loss
  1.2 draws output heads scaled up to 1000 (missed under 1.1, whose logits stayed within ±12)
- ``pad_id_ignored`` breaks NLL-003: **caught** (NLL-003: aggregation 'seq_mean_token_mean':
  loss_nll of a batch of 5 rows x 24 columns (60 assistant tokens in 4 rows) is 9.10419,
  expected 9.59665 (sum of w x )
- ``trim_off_by_one`` breaks NLL-003: **caught** (NLL-003: aggregation 'token_mean':
  loss_nll of a batch of 1 rows x 2 columns (1 assistant tokens in 1 rows) is 0, expected
  4.28231 (sum of w x -log p over the a)
- ``stale_logits_cache`` breaks NLL-003: **caught** (NLL-003: aggregation 'token_mean', one
  loss object on a live policy (output head x 1), batch 0 scored again after a training step
  of the policy (lr 0.01 x the sign of d loss_nll / d weight): loss_nll is 4.2638, expected
  3.79384 (... it is the value this loss gave the same batch before ...)); nll_loss 1.2's
  NLL-003 drives a live policy statefully (missed under 1.1, which never scored one batch twice
  across a change of the policy's weights)

Base on the same ids and declarations (token_mean and seq_mean_token_mean): NLL-003 PASS.

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> loss = PadIdIgnored(tiny_causal_lm(vocab_size=64))
    >>> float(loss(llm_batch(2, 9, vocab_size=64))["loss_nll"]) > 0
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from tests.independent.losses_sft_dpo import MaskedSumNLL, _Fields

__all__ = ["BREAKS", "DEMOS", "VARIANTS"]


class LogProbClamped(MaskedSumNLL):
    """BUG: each token's log p clamped to [-100, 0] before the sum "to keep the loss finite",
    as PyTorch's ``BCELoss`` documents it clamps its log outputs to >= -100: with a sharp
    policy (logits of a few hundred) a confidently wrong token's -log p is well over 100, so
    the loss is capped there and that token gets no gradient. Plausible (the BCELoss clamp
    copied into a hand-written cross-entropy). Breaks NLL-003 (``loss_nll`` MUST equal
    Σ w·(-log p) ... within 1e-5 relative)."""

    def token_log_probs(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return super().token_log_probs(logits, tok).clamp(min=-100.0)


class PadIdIgnored(MaskedSumNLL):
    """BUG: labels equal to the tokenizer's pad id (0 here) are dropped as an ignore index,
    ``labels[labels == pad_token_id] = -100`` (the classic recipe, wrong when pad = eos: the
    model never learns to stop: huggingface/transformers#23530, "Incorrect handling of EOS
    tokens in DataCollatorForLanguageModeling when pad_token is set to eos_token", and
    huggingface/trl#6357, "Fix EOS being masked when pad_token_id equals eos_token_id in GKD
    and GOLD"), on top of the masks; the token count follows, so the mean is over the
    other tokens. Breaks NLL-003 ("no id is an ignore_index, the masks alone exclude":
    Σ w·(-log p) over every assistant token)."""

    PAD_ID = 0

    def mask(self, f: _Fields) -> torch.Tensor:
        return super().mask(f) & (f["tokens"] != self.PAD_ID)


class TrimOffByOne(MaskedSumNLL):
    """BUG: trailing all-padding columns trimmed before the forward to save compute, with
    ``end = last attended column`` used as an exclusive bound (``[:, :end]`` instead of
    ``[:, :end + 1]``): the batch's last attended column is never scored, and the token
    count is taken from the trimmed mask. Invisible whenever the widest row ends on prompt or
    the batch carries padding past every row. Plausible. Breaks NLL-003 (Σ w·(-log p) over
    the batch's assistant tokens)."""

    def fields(self, td: TensorDictBase) -> _Fields:
        f = super().fields(td)
        cols = f["attention_mask"].any(0).nonzero()
        end = max(int(cols.max()) if cols.numel() else 1, 1)
        return {k: v[:, :end] for k, v in f.items()}


class StaleLogitsCache(MaskedSumNLL):
    """BUG: log-probs memoised per batch, keyed by the token ids and the attention mask (a
    cache meant for the frozen reference model, reused for the policy), not by the policy's
    weights: once the policy changes (an optimizer step, a rescaled head) the same batch is
    scored with the old weights. Plausible (TRL's ``precompute_ref_log_probs`` caches the
    reference's, which is right only because the reference never changes). Breaks NLL-003
    (``loss_nll`` ... "computed in float64 from the same policy")."""

    def __init__(self, policy: Any, aggregation: str = "token_mean") -> None:
        super().__init__(policy, aggregation)
        self._cache: dict[tuple[bytes, bytes, tuple[int, ...]], torch.Tensor] = {}

    def logits(self, tok: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        key = (tok.numpy().tobytes(), att.numpy().tobytes(), tuple(tok.shape))
        hit = self._cache.get(key)
        if hit is None:
            hit = super().logits(tok, att)
            self._cache[key] = hit.detach()
            return hit
        # the cached values, re-attached to the current policy's graph for a gradient
        fresh = super().logits(tok, att)
        return fresh + (hit - fresh.detach())


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------


def _nll(cls: type, name: str, aggregation: str = "token_mean") -> Implementation:
    return Implementation(
        "nll_loss",
        functools.partial(cls, aggregation=aggregation),
        name=name,
        capabilities={"global_counts"},
        options={"aggregation": aggregation},
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


BASE = _nll(MaskedSumNLL, "r3/nll-base")
BASE_SEQ = _nll(MaskedSumNLL, "r3/nll-base-seq", "seq_mean_token_mean")

VARIANTS: dict[str, Implementation] = {
    "log_prob_clamped": _nll(LogProbClamped, "r3/nll-log-prob-clamped"),
    "pad_id_ignored": _nll(PadIdIgnored, "r3/nll-pad-id-ignored", "seq_mean_token_mean"),
    "trim_off_by_one": _nll(TrimOffByOne, "r3/nll-trim-off-by-one"),
    "stale_logits_cache": _nll(StaleLogitsCache, "r3/nll-stale-logits-cache"),
}

# Each variant's correct design (the same class without the bug, same aggregation), by variant.
BASES: dict[str, Implementation] = {
    "log_prob_clamped": BASE,
    "pad_id_ignored": BASE_SEQ,
    "trim_off_by_one": BASE,
    "stale_logits_cache": BASE,
}

BREAKS: dict[str, str] = {
    "log_prob_clamped": "NLL-003",
    "pad_id_ignored": "NLL-003",
    "trim_off_by_one": "NLL-003",
    "stale_logits_cache": "NLL-003",
}

# ------------------------------------------------------------------------------------------
# demos: the spec's formula in float64, without the kit
# ------------------------------------------------------------------------------------------

_V = 32


def _policy(scale: float = 1.0) -> Any:
    from posttrain.testing import tiny_causal_lm

    p = tiny_causal_lm(vocab_size=_V, seed=3)
    if scale != 1.0:
        with torch.no_grad():
            for q in p.parameters():
                q.mul_(scale)
    return p


def _batch(n: int, t: int = 10, seed: int = 0) -> TensorDictBase:
    from posttrain.testing import llm_batch

    return llm_batch(n, t, vocab_size=_V, seed=seed)


def _spec_token_mean(policy: Any, td: TensorDictBase) -> float:
    """Σ m·(-log p)/N in float64, row by row, log p from the logits at t - 1."""
    k = LLM_LAYOUT_V1.key
    tok, att = td.get(k("tokens")), td.get(k("attention_mask"))
    m = td.get(k("assistant_mask")) & att
    total, n = 0.0, 0
    for i in range(tok.shape[0]):
        ids = torch.where(att[i], tok[i], torch.zeros_like(tok[i]))[None]
        with torch.no_grad():
            z = policy(input_ids=ids, attention_mask=att[i][None].long()).logits[0].double()
        lp = torch.log_softmax(z, -1)
        for t in range(1, tok.shape[1]):
            if bool(m[i, t]):
                total -= float(lp[t - 1, int(tok[i, t])])
                n += 1
    return total / max(n, 1)


def _value(cls: type, policy: Any, td: TensorDictBase) -> float:
    return float(cls(policy)(td)["loss_nll"].detach())


def _departs(cls: type, policy: Any, td: TensorDictBase) -> bool:
    spec = _spec_token_mean(policy, td)
    ok = abs(_value(MaskedSumNLL, policy, td) - spec) <= 1e-5 * abs(spec)
    bad = abs(_value(cls, policy, td) - spec) > 1e-5 * abs(spec)
    return ok and bad


def demo_log_prob_clamped() -> bool:
    """A sharp policy (every weight x 30): some assistant token has -log p > 100."""
    return _departs(LogProbClamped, _policy(30.0), _batch(4, 12, seed=1))


def demo_pad_id_ignored() -> bool:
    """Token id 0 placed on an assistant token: the spec scores it, the variant drops it."""
    td = _batch(3, 10, seed=2)
    k = LLM_LAYOUT_V1.key
    m = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
    i, t = (int(x) for x in m[:, 1:].nonzero()[0])
    td.get(k("tokens"))[i, t + 1] = 0
    return _departs(PadIdIgnored, _policy(), td)


def demo_trim_off_by_one() -> bool:
    """A row answered up to the last column (no padding)."""
    k = LLM_LAYOUT_V1.key
    td = _batch(2, 8, seed=4)
    td.get(k("attention_mask"))[0] = True
    am = torch.zeros(8, dtype=torch.bool)
    am[3:] = True
    td.get(k("assistant_mask"))[0] = am
    return _departs(TrimOffByOne, _policy(), td)


def demo_stale_logits_cache() -> bool:
    """The same batch scored before and after the policy's weights change."""
    policy, td = _policy(), _batch(3, 10, seed=5)
    loss = StaleLogitsCache(policy)
    loss(td)
    with torch.no_grad():
        for q in policy.parameters():
            q.mul_(3.0)
    spec = _spec_token_mean(policy, td)
    return abs(float(loss(td)["loss_nll"].detach()) - spec) > 1e-5 * abs(spec)


DEMOS: dict[str, Callable[[], bool]] = {
    "log_prob_clamped": demo_log_prob_clamped,
    "pad_id_ignored": demo_pad_id_ignored,
    "trim_off_by_one": demo_trim_off_by_one,
    "stale_logits_cache": demo_stale_logits_cache,
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {}
