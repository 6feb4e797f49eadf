"""One-bug variants of a supervised NLL loss (contract ``nll_loss`` v1), written from
``specs/nll_loss-v1.md`` alone, to measure the conformance kit's reach.

Each variant subclasses ``losses_sft_dpo.MaskedSumNLL`` (one batched call, log p = gathered
logit - logsumexp, one masked weighted sum; conforming) and plants one bug of a kind real
systems have shipped, naming the requirement whose sentence it breaks. ``demo_<name>()``
shows the bug without the kit (True: the sentence fails on the variant and holds on the base).

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> loss = ZLossInside(tiny_causal_lm(vocab_size=64))
    >>> float(loss(llm_batch(2, 9, vocab_size=64))["loss_nll"]) > 0
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from tests.independent import losses_sft_dpo as sd

__all__ = ["BASES", "DEMOS", "VARIANTS"]

_K = LLM_LAYOUT_V1.key


class Bf16CrossEntropy(sd.MaskedSumNLL):
    """BUG: the cross-entropy taken on the logits in bfloat16 (the model's dtype, no upcast):
    logsumexp and the gathered logit are rounded to 8 bits of mantissa, so -log p is off by
    up to |log p|·2^-8. transformers' ``ForCausalLMLoss`` upcasts (``logits.float()``) for this
    reason; TRL and Megatron users have reported losses that differ between bf16 and fp32
    for it. Breaks NLL-003 (within 1e-5 of the float64 formula)."""

    def logits(self, tok: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        return super().logits(tok, att).to(torch.bfloat16)

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        out = super().__call__(td, counts=counts)
        out["loss_nll"] = out["loss_nll"].float()
        return out


class ZLossInside(sd.MaskedSumNLL):
    """BUG: PaLM's z-loss, 1e-4·logsumexp(logits)², added to each token's -log p inside
    ``loss_nll`` (OLMo's and Megatron's ``z_loss`` option left on in an SFT config): it
    reaches the logits other than through the token's log-prob. Breaks NLL-004 ("a
    ``loss_nll`` that reaches the logits other than through the tokens' log-probs (label
    smoothing, a z-loss, a temperature) has no such gradient and fails")."""

    z_coef = 1e-4

    def per_token(self, lp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits[:, :-1], -1)
        z = torch.cat([lse.new_zeros(lse.shape[0], 1), lse], 1)
        return -lp + self.z_coef * z * z


class ChunkedDropsTail(sd.MaskedSumNLL):
    """BUG: the cross-entropy computed in chunks of 4 positions to save memory, with
    ``range(0, (T - 1) // 4 * 4, 4)``: the last partial chunk is never scored, while the
    token count still includes it. Plausible (chunked-loss code in Liger-style kernels and
    torchtune's chunked output loss handle the remainder explicitly). Breaks NLL-003."""

    chunk = 4

    def token_log_probs(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        lp = super().token_log_probs(logits, tok)
        n = (lp.shape[1] - 1) // self.chunk * self.chunk  # positions 1..n are scored
        keep = torch.arange(lp.shape[1]) <= n
        return torch.where(keep, lp, torch.zeros_like(lp))


class NoAttentionMask(sd.MaskedSumNLL):
    """BUG: the policy is called without ``attention_mask`` (``model(input_ids)``), so the
    real tokens attend to the padding. Invisible on right-padded batches (a causal model never
    looks ahead), wrong on left-padded ones (TRL's arrangement, which the layout allows): the
    pad tokens change the log-probs. Forgetting the mask is a common report (TRL reference
    log-probs, hand-written SFT loops). Breaks NLL-005 ("changing the tokens at padding
    positions, MUST NOT change any output")."""

    def logits(self, tok: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        ids = torch.where(att, tok, torch.zeros_like(tok))
        out: torch.Tensor = self.policy(input_ids=tok if self.raw_ids else ids).logits
        return out

    raw_ids = True  # the pad tokens as stored: whatever the producer wrote there


class MeanLengthForRows(sd.MaskedSumNLL):
    """BUG: ``seq_mean_token_mean`` divides each row's sum by the batch's mean length N / S
    instead of its own L_i (a per-row mean that cannot know other micro-batches' rows,
    "fixed" with the global average), which is a token mean in disguise: long answers weigh
    more. Plausible. Breaks NLL-003 (w = m/(S·L_i) for ``seq_mean_token_mean``)."""

    def weights(self, m: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        if self.aggregation != "seq_mean_token_mean":
            return super().weights(m, counts)
        n, s = max(counts.tokens, 1), max(counts.sequences, 1)
        return m.to(torch.float64) / (s * (n / s))


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------


def _decl(cls: type, name: str, aggregation: str = "token_mean") -> Implementation:
    return Implementation(
        "nll_loss",
        functools.partial(cls, aggregation=aggregation),
        name=f"nll-variants/{name}",
        capabilities={"global_counts"},
        options={"aggregation": aggregation},
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


BASES: dict[str, Implementation] = {}  # the base is losses_sft_dpo.CORRECT_NLL's MaskedSumNLL

VARIANTS: dict[str, tuple[str, Implementation]] = {
    "bf16_cross_entropy": ("NLL-003", _decl(Bf16CrossEntropy, "bf16-cross-entropy")),
    "z_loss_inside": ("NLL-004", _decl(ZLossInside, "z-loss-inside")),
    "chunked_drops_tail": ("NLL-003", _decl(ChunkedDropsTail, "chunked-drops-tail")),
    "no_attention_mask": ("NLL-005", _decl(NoAttentionMask, "no-attention-mask")),
    "mean_length_for_rows": (
        "NLL-003", _decl(MeanLengthForRows, "mean-length-for-rows", "seq_mean_token_mean")
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------------
# demos
# ------------------------------------------------------------------------------------------


def _value_ok(cls: type, td: TensorDictBase, aggregation: str = "token_mean") -> bool:
    """NLL-003: loss_nll equals the float64 formula within 1e-5 relative."""
    policy = sd._policy()
    got = float(cls(policy, aggregation=aggregation)(td)["loss_nll"].detach())
    return not sd._differs(got, sd._spec_nll(policy, td, aggregation))


def demo_bf16_cross_entropy() -> bool:
    td = sd._batch(3)
    return _value_ok(sd.MaskedSumNLL, td) and not _value_ok(Bf16CrossEntropy, td)


def demo_z_loss_inside() -> bool:
    # NLL-004: d loss / d log p_t = -w, i.e. the parameter gradient of Σ w·(-log p)
    policy, td = sd._policy(), sd._batch(3)
    m = td.get(_K("assistant_mask")) & td.get(_K("attention_mask"))
    m[:, 0] = False
    w = m.double() / m.sum()

    def grads_ok(cls: type) -> bool:
        tok, att = td.get(_K("tokens")), td.get(_K("attention_mask"))
        logits = policy(input_ids=tok, attention_mask=att.long()).logits.double()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tok[:, 1:, None])[..., 0]
        want = sd._param_grads((w[:, 1:] * -lp).sum(), policy)
        got = sd._param_grads(cls(policy)(td)["loss_nll"], policy)
        return float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())

    return grads_ok(sd.MaskedSumNLL) and not grads_ok(ZLossInside)


def demo_chunked_drops_tail() -> bool:
    td = sd._batch(4, t=11)  # T - 1 = 10: positions 9 and 10 fall in a partial chunk
    td.get(_K("attention_mask"))[0] = True
    td.get(_K("assistant_mask"))[0, 3:] = True  # row 0 reaches the last position
    return _value_ok(sd.MaskedSumNLL, td) and not _value_ok(ChunkedDropsTail, td)


def _left_padded() -> TensorDictBase:
    """Rows right-aligned (TRL's left padding); every token before the row's start is pad."""
    td = sd._batch(3, t=10)
    att, asst = td.get(_K("attention_mask")), td.get(_K("assistant_mask"))
    tok = td.get(_K("tokens"))
    for i in range(td.batch_size[0]):
        n = int(att[i].sum())
        for x in (att, asst, tok):
            x[i] = torch.roll(x[i], 10 - n)
    return td


def demo_no_attention_mask() -> bool:
    td = _left_padded()
    other = td.clone()
    tok = other.get(_K("tokens"))
    tok[~other.get(_K("attention_mask"))] = 7  # change only the padding tokens

    def unchanged(cls: type) -> bool:
        loss = cls(sd._policy())
        a, b = loss(td)["loss_nll"], loss(other)["loss_nll"]
        return not sd._differs(float(a.detach()), float(b.detach()), 1e-6)

    return unchanged(sd.MaskedSumNLL) and not unchanged(NoAttentionMask)


def demo_mean_length_for_rows() -> bool:
    td = sd._batch(4)
    agg = "seq_mean_token_mean"
    return _value_ok(sd.MaskedSumNLL, td, agg) and not _value_ok(MeanLengthForRows, td, agg)


DEMOS: dict[str, Callable[[], bool]] = {name: globals()[f"demo_{name}"] for name in VARIANTS}
