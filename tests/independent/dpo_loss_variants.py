"""One-bug variants of a DPO loss (contract ``dpo_loss`` v1), written from
``specs/dpo_loss-v1.md`` alone, to measure the conformance kit's reach.

Each variant subclasses ``losses_sft_dpo.ConcatDPO`` (chosen and rejected rows concatenated
into one forward, pairs as tensors; conforming) and plants one bug of a kind real systems have
shipped, naming the requirement whose sentence it breaks. ``demo_<name>()`` shows the bug
without the kit (True: the sentence fails on the variant and holds on the base).

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> loss = RpoNllInPreference(tiny_causal_lm(vocab_size=64), beta=0.1)
    >>> float(loss(llm_batch(4, 9, vocab_size=64))["loss_preference"]) > 0
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from tests.independent import losses_sft_dpo as sd

__all__ = ["BASES", "DEMOS", "VARIANTS"]

_K = LLM_LAYOUT_V1.key


class LogOfSigmoid(sd.ConcatDPO):
    """BUG: the pair loss written -log(sigmoid(β·Δ)) instead of -logsigmoid(β·Δ): sigmoid
    underflows to 0 in float32 below β·Δ ≈ -88 (-104 with denormals), and the loss is inf
    (early DPO code and many hand-written preference losses; TRL uses ``F.logsigmoid`` for
    this reason). Breaks DPO-001 ("``loss_*`` entries are finite scalar tensors")."""

    def pair_loss(self, delta: torch.Tensor) -> torch.Tensor:
        return -torch.log(torch.sigmoid(self.beta * delta))


class RpoNllInPreference(sd.ConcatDPO):
    """BUG: RPO's NLL term on the chosen answers (TRL's ``rpo_alpha``, NeMo-RL's
    ``sft_loss_weight``), α = 1, added into ``loss_preference`` itself instead of returned as
    its own ``loss_*`` term: TRL adds ``rpo_alpha * nll_loss`` to ``losses``. Breaks DPO-003
    (``loss_preference`` MUST equal the mean over counted pairs of -log σ(β·Δ))."""

    alpha = 1.0

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        out = super().__call__(td, counts=counts)
        f = self.fields(td)
        tok, att = f["tokens"][0::2], f["attention_mask"][0::2]
        m = (f["assistant_mask"][0::2] & att).clone()
        m[:, 0] = False
        ids = torch.where(att, tok, torch.zeros_like(tok))
        logits = self.policy(input_ids=ids, attention_mask=att.long()).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tok[:, 1:, None])[..., 0]
        nll = -(torch.where(m[:, 1:], lp, torch.zeros_like(lp))).sum() / m.sum().clamp(min=1)
        out["loss_preference"] = out["loss_preference"] + self.alpha * nll.to(
            out["loss_preference"].dtype
        )
        return out


class PairsNotHalved(sd.ConcatDPO):
    """BUG: under ``global_counts`` the loss and metrics divide by ``counts.sequences`` taken
    as the pair count, forgetting that it counts rows (2 per counted pair, NeMo-RL's
    ``global_valid_seqs``): every micro-batch's terms are halved. Breaks DPO-007 (averaged
    over P pairs when ``sequences`` = 2P)."""

    def divisors(self, counted: torch.Tensor, counts: GlobalCounts | None) -> tuple[float, float]:
        if counts is None:
            return super().divisors(counted, counts)
        p = float(counts.sequences) if counts.sequences > 0 else 1.0
        return p, p


class HalvesNotInterleaved(sd.ConcatDPO):
    """BUG: pairs read in TRL's concatenated layout, the first half of the rows chosen and the
    second half rejected (``concatenated_forward``'s ``[chosen..., rejected...]``), on a batch
    interleaved the layout's way (row 2i chosen, 2i + 1 rejected): answers are paired with
    the wrong partners and half the chosen ones are rejected ones. Breaks DPO-003 ("rows 2i
    chosen and 2i + 1 rejected")."""

    def fields(self, td: TensorDictBase) -> dict[str, torch.Tensor]:
        f = super().fields(td)
        out = {}
        for k, v in f.items():
            p = v.shape[0] // 2
            # re-interleave so that the base's [0::2] / [1::2] split yields the halves
            out[k] = torch.stack([v[:p], v[p:]], 1).reshape(v.shape)
        return out


class _Bf16Logits:
    """A policy whose logits come back in bfloat16, as a bf16 model's do."""

    def __init__(self, policy: Any) -> None:
        self.model = policy

    def __call__(self, **kw: Any) -> Any:
        return SimpleNamespace(logits=self.model(**kw).logits.to(torch.bfloat16))

    def parameters(self) -> Any:
        return self.model.parameters()


class Bf16LogSoftmax(sd.ConcatDPO):
    """BUG: the policy's log-probs taken with ``log_softmax`` on bfloat16 logits (no upcast):
    each is off by up to |log p|·2^-8, and the rewards sum those errors over the answer.
    TRL's DPO computed ``logits.log_softmax(-1)`` in the model dtype until
    ``selective_log_softmax`` upcast bf16 rows. Breaks DPO-003 (within 1e-5 of the float64
    formula)."""

    def __init__(self, policy: Any, token_reduction: str = "sum", *, beta: float = 0.1) -> None:
        super().__init__(_Bf16Logits(policy), token_reduction, beta=beta)

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        out = super().__call__(td, counts=counts)
        return {k: v.float() for k, v in out.items()}


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------


def _decl(cls: type, name: str, token_reduction: str = "sum", beta: float = 0.1) -> Implementation:
    return Implementation(
        "dpo_loss",
        functools.partial(cls, token_reduction=token_reduction, beta=beta),
        name=f"dpo-variants/{name}",
        capabilities={"global_counts"},
        options={"token_reduction": token_reduction},
        extras={"beta": beta},
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


BASES: dict[str, Implementation] = {}  # the base is losses_sft_dpo.CORRECT_DPO's ConcatDPO

VARIANTS: dict[str, tuple[str, Implementation]] = {
    "log_of_sigmoid": ("DPO-001", _decl(LogOfSigmoid, "log-of-sigmoid")),
    "rpo_nll_in_preference": ("DPO-003", _decl(RpoNllInPreference, "rpo-nll-in-preference")),
    "pairs_not_halved": ("DPO-007", _decl(PairsNotHalved, "pairs-not-halved")),
    "halves_not_interleaved": ("DPO-003", _decl(HalvesNotInterleaved, "halves-not-interleaved")),
    "bf16_log_softmax": ("DPO-003", _decl(Bf16LogSoftmax, "bf16-log-softmax", "mean", 0.5)),
}


# ------------------------------------------------------------------------------------------
# demos
# ------------------------------------------------------------------------------------------


def _value_ok(cls: type, td: TensorDictBase, key: str = "loss_preference", **kw: Any) -> bool:
    """DPO-003/005/007: the value equals the spec's float64 formula."""
    policy = sd._policy().float()
    red, beta = kw.pop("token_reduction", "sum"), kw.pop("beta", 0.5)
    got = float(cls(policy, token_reduction=red, beta=beta)(td, **kw)[key].detach())
    want = sd._spec_dpo(policy.double(), td, red, beta, kw.get("counts"))[key]
    return not sd._differs(got, want, 1e-5) or abs(got - want) <= 1e-6


def demo_log_of_sigmoid() -> bool:
    td = sd._batch(4)
    ref = td.get(_K("ref_log_probs"))
    ref[0::2] += 100.0  # the chosen answers far likelier under the reference: β·Δ << -88
    policy = sd._policy().float()

    def finite(cls: type) -> bool:
        return bool(torch.isfinite(cls(policy, beta=0.5)(td)["loss_preference"]).all())

    return finite(sd.ConcatDPO) and not finite(LogOfSigmoid)


def demo_rpo_nll_in_preference() -> bool:
    td = sd._batch(4)
    return _value_ok(sd.ConcatDPO, td) and not _value_ok(RpoNllInPreference, td)


def demo_pairs_not_halved() -> bool:
    td = sd._batch(4)
    whole = GlobalCounts.of(td)
    counts = GlobalCounts(whole.tokens, 2 * 5)  # 5 counted pairs in the global batch
    return _value_ok(sd.ConcatDPO, td, counts=counts) and not _value_ok(
        PairsNotHalved, td, counts=counts
    )


def demo_halves_not_interleaved() -> bool:
    td = sd._batch(4)
    return _value_ok(sd.ConcatDPO, td) and not _value_ok(HalvesNotInterleaved, td)


def demo_bf16_log_softmax() -> bool:
    td = sd._batch(4)
    good = _value_ok(sd.ConcatDPO, td, token_reduction="mean", beta=0.5)
    return good and not _value_ok(Bf16LogSoftmax, td, token_reduction="mean", beta=0.5)


DEMOS: dict[str, Callable[[], bool]] = {name: globals()[f"demo_{name}"] for name in VARIANTS}
