"""SFT (``nll_loss`` v1) and DPO (``dpo_loss`` v1) losses written from the specs alone.

Two designs per contract, sharing nothing but input validation:

- ``LoopNLL`` scores one row at a time (trimmed after its last attended token, one policy
  call per row) and adds -log p token by token in float64 Python loops.
- ``MaskedSumNLL`` is vectorised: one batched call, log p = gathered logit - logsumexp,
  reduced as one masked weighted sum.
- ``ConcatDPO`` splits the interleaved rows into chosen and rejected halves and scores them
  in one concatenated forward (TRL's ``concatenated_forward``), all pairs as tensors.
- ``PairLoopDPO`` walks the pairs: two policy calls per pair, rewards, margins and metrics
  in float64 Python scalars.

``CORRECT_NLL`` and ``CORRECT_DPO`` declare rows covering every aggregation, both token
reductions and capability ``global_counts``; ``VARIANTS`` maps each one-bug variant to
``(requirement id expected to catch it, Implementation)``; each variant has a
``demo_<name>() -> bool`` showing, in float64 without the kit, that it departs from the
spec's formula.

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> loss = MaskedSumNLL(tiny_causal_lm(vocab_size=64), aggregation="seq_mean_token_sum")
    >>> float(loss(llm_batch(3, 10, vocab_size=64))["loss_nll"]) > 0
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation

__all__ = [
    "CORRECT_DPO",
    "CORRECT_NLL",
    "VARIANTS",
    "ConcatDPO",
    "LoopNLL",
    "MaskedSumNLL",
    "PairLoopDPO",
]

NLL_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
TOKEN_REDUCTIONS = ("sum", "mean")
_BOOLS = ("attention_mask", "assistant_mask")
_Fields = dict[str, torch.Tensor]


def _pick(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"option {name}: expected one of {allowed}, found {value!r}")
    return value


def _read(td: TensorDictBase, names: tuple[str, ...], *, bool_masks: bool = True) -> _Fields:
    """The named layout fields, checked by name: present, dtype, [B, T] shapes."""
    k = LLM_LAYOUT_V1.key
    keys = {
        (x,) if isinstance(x, str) else tuple(x)
        for x in td.keys(include_nested=True, leaves_only=True)
    }
    got: dict[str, torch.Tensor] = {}
    for name in names:
        key = k(name)
        if key not in keys:
            raise KeyError(f"batch is missing field {name!r} at key {key}")
        v = td.get(key)
        if name == "tokens" and v.dtype != torch.int64:
            raise TypeError(f"field 'tokens' at {key}: expected int64, found {v.dtype}")
        if bool_masks and name in _BOOLS and v.dtype != torch.bool:
            raise TypeError(f"field {name!r} at {key}: expected bool, found {v.dtype}")
        if name == "ref_log_probs" and not v.is_floating_point():
            raise TypeError(f"field {name!r} at {key}: expected a float dtype, found {v.dtype}")
        got[name] = v
    tok = got["tokens"]
    if tok.dim() != 2:
        raise ValueError(f"field 'tokens' at {k('tokens')}: expected [B, T], found {tok.shape}")
    for name, v in got.items():
        if v.shape != tok.shape:
            raise ValueError(
                f"field {name!r} at {k(name)}: expected shape {tuple(tok.shape)}, "
                f"found {tuple(v.shape)}"
            )
    return got


def _trained(att: torch.Tensor, asst: torch.Tensor) -> torch.Tensor:
    """The assistant mask within the attention mask, position 0 dropped (no logit predicts it)."""
    m = (asst & att).clone()
    m[:, 0] = False
    return m


def _anchor(policy: Any) -> torch.Tensor:
    """A zero that reaches every parameter, so a loss with no trained token still has a graph."""
    total: torch.Tensor = torch.stack([p.sum() for p in policy.parameters()]).sum()
    return total * 0.0


# ------------------------------------------------------------------------------------------
# nll_loss v1
# ------------------------------------------------------------------------------------------


class LoopNLL:
    """Per-row float64 loop: one policy call per row, -log p summed token by token.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = LoopNLL(tiny_causal_lm(vocab_size=64), aggregation="seq_mean_token_mean")
        >>> float(loss(llm_batch(2, 9, vocab_size=64))["loss_nll"]) > 0
        True
    """

    def __init__(self, policy: Any, aggregation: str = "token_mean") -> None:
        self.policy = policy
        self.aggregation = _pick("aggregation", aggregation, NLL_AGGREGATIONS)

    def _row_logits(self, tokens: torch.Tensor, att: torch.Tensor) -> tuple[torch.Tensor, int]:
        (idx,) = att.nonzero(as_tuple=True)
        end = max(int(idx.max()) + 1, 2)
        ids = torch.where(att[:end], tokens[:end], torch.zeros_like(tokens[:end]))
        out = self.policy(input_ids=ids[None], attention_mask=att[None, :end].long()).logits[0]
        return torch.log_softmax(out.double(), -1), end

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        f = _read(td, ("tokens", *_BOOLS))
        tok, att, asst = f["tokens"], f["attention_mask"], f["assistant_mask"]
        rows: list[list[int]] = []
        for i in range(tok.shape[0]):
            rows.append([t for t in range(1, tok.shape[1]) if bool(asst[i, t]) and bool(att[i, t])])
        if counts is None:
            counts = GlobalCounts(sum(len(r) for r in rows), sum(1 for r in rows if r))
        n, s = max(counts.tokens, 1), max(counts.sequences, 1)
        total: torch.Tensor = _anchor(self.policy).double()
        dtype = next(self.policy.parameters()).dtype
        for i, ts in enumerate(rows):
            if not ts:
                continue
            logp, _ = self._row_logits(tok[i], att[i])
            if self.aggregation == "token_mean":
                w = 1.0 / n
            elif self.aggregation == "seq_mean_token_mean":
                w = 1.0 / (s * len(ts))
            else:
                w = 1.0 / s
            for t in ts:
                total = total - w * logp[t - 1, int(tok[i, t])]
        return {"loss_nll": total.to(dtype)}


class MaskedSumNLL:
    """Vectorised: one batched call, log p = logit[token] - logsumexp, one masked weighted sum.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = MaskedSumNLL(tiny_causal_lm(vocab_size=64))
        >>> out = loss(llm_batch(3, 10, vocab_size=64))
        >>> sorted(out)
        ['loss_nll', 'num_unmasked_tokens']
    """

    bool_masks = True

    def __init__(self, policy: Any, aggregation: str = "token_mean") -> None:
        self.policy = policy
        self.aggregation = _pick("aggregation", aggregation, NLL_AGGREGATIONS)

    def fields(self, td: TensorDictBase) -> _Fields:
        return _read(td, ("tokens", *_BOOLS), bool_masks=self.bool_masks)

    def mask(self, f: _Fields) -> torch.Tensor:
        """Where -log p is trained: [B, T] bool (or float weights in a variant)."""
        return _trained(f["attention_mask"], f["assistant_mask"])

    def logits(self, tok: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        ids = torch.where(att, tok, torch.zeros_like(tok))
        out: torch.Tensor = self.policy(input_ids=ids, attention_mask=att.long()).logits
        return out

    def token_log_probs(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """[B, T]: log p(token_t) from the logits at t - 1; 0 at position 0."""
        z = logits[:, :-1]
        picked = z.gather(-1, tok[:, 1:, None])[..., 0]
        lp = picked - torch.logsumexp(z, -1)
        return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)

    def own_counts(self, m: torch.Tensor, f: _Fields) -> GlobalCounts:
        per_row = m.sum(1)
        return GlobalCounts(int(per_row.sum()), int((per_row > 0).sum()))

    def weights(self, m: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
        mf = m.to(torch.float64)
        n, s = max(counts.tokens, 1), max(counts.sequences, 1)
        if self.aggregation == "token_mean":
            return mf / n
        if self.aggregation == "seq_mean_token_mean":
            return mf / (s * mf.sum(1, keepdim=True).clamp(min=1))
        return mf / s

    def per_token(self, lp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return -lp

    def resolve_counts(
        self, m: torch.Tensor, f: _Fields, counts: GlobalCounts | None
    ) -> GlobalCounts:
        return counts if counts is not None else self.own_counts(m, f)

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        f = self.fields(td)
        tok, att = f["tokens"], f["attention_mask"].bool()
        m = self.mask(f)
        logits = self.logits(tok, att)
        lp = self.token_log_probs(logits, tok)
        w = self.weights(m, self.resolve_counts(m, f, counts)).to(lp.dtype)
        per = self.per_token(lp, logits)
        trained = w != 0
        loss = torch.where(trained, w * per, torch.zeros_like(per)).sum()
        return {"loss_nll": loss, "num_unmasked_tokens": m.sum().to(torch.float32)}


# --- nll one-bug variants ---


class NllCountsIgnored(MaskedSumNLL):
    """Declares ``global_counts`` but normalizes every micro-batch by its own token count, so
    accumulated micro-batch means over-weight short micro-batches: the transformers Trainer
    gradient-accumulation loss bug (Oct 2024, huggingface/blog PR #2414 "Fixing gradient
    accumulation", ``num_items_in_batch``). Violates NLL-007 (also NLL-008)."""

    def resolve_counts(
        self, m: torch.Tensor, f: _Fields, counts: GlobalCounts | None
    ) -> GlobalCounts:
        return self.own_counts(m, f)


class NllLabelsShiftedTwice(MaskedSumNLL):
    """Labels shifted by the data collator and again by the loss, so token t is scored by the
    logits at t - 2 (the recurring "labels are shifted inside the model" mistake, e.g. custom
    collators feeding HF causal LMs pre-shifted ``labels``). Violates NLL-003."""

    def token_log_probs(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        z = logits[:, :-2]
        lp = z.gather(-1, tok[:, 2:, None])[..., 0] - torch.logsumexp(z, -1)
        return torch.cat([lp.new_zeros(lp.shape[0], 2), lp], 1)


class NllPromptTrained(MaskedSumNLL):
    """Trains on every attended token, prompt included (TRL's SFTTrainer without
    ``completion_only_loss``/``assistant_only_loss``, or DataCollatorForCompletionOnlyLM whose
    response template never matched). Violates NLL-003."""

    def mask(self, f: _Fields) -> torch.Tensor:
        return _trained(f["attention_mask"], f["attention_mask"])


class NllDetachedLogsumexp(MaskedSumNLL):
    """log p = logit[token] - logsumexp(logits) with the logsumexp taken in a no-grad pass (the
    memory-saving chunked cross-entropy shortcut): value right, but the gradient misses the
    softmax term, so d loss / d log p is not -w. Violates NLL-004."""

    def token_log_probs(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        z = logits[:, :-1]
        lp = z.gather(-1, tok[:, 1:, None])[..., 0] - torch.logsumexp(z, -1).detach()
        return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)


class NllLabelSmoothing(MaskedSumNLL):
    """Label smoothing 0.1 inside ``loss_nll`` (transformers Trainer's ``LabelSmoother``,
    ``label_smoothing_factor``, left on in an SFT config): mixes in -mean_v log p_v, which
    reaches the logits other than through the token's log-prob. Violates NLL-004 (the value is
    off too: NLL-003)."""

    eps = 0.1

    def per_token(self, lp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        z = torch.log_softmax(logits[:, :-1], -1).mean(-1)
        smooth = torch.cat([z.new_zeros(z.shape[0], 1), z], 1)
        return -(1 - self.eps) * lp - self.eps * smooth


class NllEmptyRowsCounted(MaskedSumNLL):
    """S taken as every attended row, a row without assistant tokens included (TRL's
    ``.mean()`` over rows, NeMo-RL's ``sample_mask`` sum), when no counts are given; with the
    whole batch's GlobalCounts micro-batches then do not add up to the whole batch. Violates
    NLL-008."""

    def own_counts(self, m: torch.Tensor, f: _Fields) -> GlobalCounts:
        rows = int(f["attention_mask"].any(1).sum())
        return GlobalCounts(int(m.sum()), rows)


class NllMaskAsWeights(MaskedSumNLL):
    """Accepts a float or int 0/1 mask and multiplies it in as weights (Megatron-LM's float
    ``loss_mask`` convention, ``(losses * loss_mask).sum() / loss_mask.sum()``) instead of
    refusing it by name. Violates NLL-006."""

    bool_masks = False

    def mask(self, f: _Fields) -> torch.Tensor:
        m = f["assistant_mask"].to(torch.float32) * f["attention_mask"].to(torch.float32)
        m[:, 0] = 0.0
        return m


class NllCountWithPosition0(MaskedSumNLL):
    """The token count taken from the unshifted mask, position 0 included, while the sum
    skips it: transformers counts ``num_items_in_batch`` as ``labels.ne(-100).sum()`` on the
    unshifted labels before the model shifts them. With an assistant token at position 0 the
    loss is divided by one token too many. Violates NLL-003 ("position 0 weigh nothing")."""

    def own_counts(self, m: torch.Tensor, f: _Fields) -> GlobalCounts:
        full = f["assistant_mask"] & f["attention_mask"]
        return GlobalCounts(int(full.sum()), int((m.sum(1) > 0).sum()))


# ------------------------------------------------------------------------------------------
# dpo_loss v1
# ------------------------------------------------------------------------------------------

_DPO_FIELDS = ("tokens", *_BOOLS, "ref_log_probs")


def _dpo_read(td: TensorDictBase) -> _Fields:
    f = _read(td, _DPO_FIELDS)
    b = f["tokens"].shape[0]
    if b % 2:
        raise ValueError(
            f"dpo_loss: batch of {b} rows is odd; pairs are rows (2i chosen, 2i + 1 rejected)"
        )
    return f


class ConcatDPO:
    """Chosen rows (0, 2, ...) and rejected rows (1, 3, ...) concatenated into one forward.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = ConcatDPO(tiny_causal_lm(vocab_size=64), token_reduction="mean", beta=0.2)
        >>> out = loss(llm_batch(4, 9, vocab_size=64))
        >>> 0.0 <= float(out["accuracy"]) <= 1.0
        True
    """

    def __init__(self, policy: Any, token_reduction: str = "sum", *, beta: float = 0.1) -> None:
        self.policy = policy
        self.token_reduction = _pick("token_reduction", token_reduction, TOKEN_REDUCTIONS)
        self.beta = float(beta)

    chosen_offset = 0

    def fields(self, td: TensorDictBase) -> _Fields:
        return _dpo_read(td)

    def log_ratios(self, f: _Fields) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] log p - log p_ref in the order chosen rows then rejected rows, and its mask."""
        c, r = self.chosen_offset, 1 - self.chosen_offset
        cat = {k: torch.cat([v[c::2], v[r::2]]) for k, v in f.items()}
        tok, att = cat["tokens"], cat["attention_mask"]
        m = _trained(att, cat["assistant_mask"])
        ids = torch.where(att, tok, torch.zeros_like(tok))
        logits = self.policy(input_ids=ids, attention_mask=att.long()).logits
        logp = torch.log_softmax(logits[:, :-1], -1)
        lp = logp.gather(-1, tok[:, 1:, None])[..., 0]
        lp = self.policy_log_probs(lp, m.shape[0] // 2)
        ref = cat["ref_log_probs"][:, 1:].to(lp.dtype)
        mm = m[:, 1:]
        return torch.where(mm, lp - ref, torch.zeros_like(lp)), mm

    def policy_log_probs(self, lp: torch.Tensor, pairs: int) -> torch.Tensor:
        return lp

    def rewards(self, lr: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        tot = lr.sum(1)
        if self.token_reduction == "mean":
            return tot / mm.sum(1).clamp(min=1)
        return tot

    def counted(self, mm: torch.Tensor, pairs: int) -> torch.Tensor:
        return mm[:pairs].any(1)

    def pair_loss(self, delta: torch.Tensor) -> torch.Tensor:
        return -torch.nn.functional.logsigmoid(self.beta * delta)

    def margin(self, rc: torch.Tensor, rr: torch.Tensor) -> torch.Tensor:
        return rc - rr

    def wins(self, delta: torch.Tensor) -> torch.Tensor:
        return delta > 0

    def divisors(self, counted: torch.Tensor, counts: GlobalCounts | None) -> tuple[float, float]:
        """(pairs the loss averages over, pairs the metrics average over)."""
        p = counts.sequences / 2 if counts is not None else float(counted.sum())
        p = p if p > 0 else 1.0
        return p, p

    def reward_mean(self, r: torch.Tensor, counted: torch.Tensor, p: float) -> torch.Tensor:
        return torch.where(counted, r, torch.zeros_like(r)).sum() / p

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        f = self.fields(td)
        pairs = f["tokens"].shape[0] // 2
        lr, mm = self.log_ratios(f)
        r = self.rewards(lr, mm)
        rc, rr = r[:pairs], r[pairs:]
        counted = self.counted(mm, pairs)
        delta = self.margin(rc, rr)
        p_loss, p_metric = self.divisors(counted, counts)
        per = self.pair_loss(delta)
        loss = torch.where(counted, per, torch.zeros_like(per)).sum() / p_loss
        with torch.no_grad():
            acc = (counted & self.wins(delta)).sum().to(delta.dtype) / p_metric
            rcm = self.reward_mean(rc, counted, p_metric)
            rrm = self.reward_mean(rr, counted, p_metric)
        return {
            "loss_preference": loss + _anchor(self.policy),
            "accuracy": acc,
            "rewards_chosen_mean": rcm,
            "rewards_rejected_mean": rrm,
        }


class PairLoopDPO:
    """Pair by pair, two policy calls each; rewards and margins as float64 Python scalars.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = PairLoopDPO(tiny_causal_lm(vocab_size=64), beta=0.5)
        >>> float(loss(llm_batch(2, 9, vocab_size=64))["loss_preference"]) > 0
        True
    """

    def __init__(self, policy: Any, token_reduction: str = "sum", *, beta: float = 0.1) -> None:
        self.policy = policy
        self.token_reduction = _pick("token_reduction", token_reduction, TOKEN_REDUCTIONS)
        self.beta = float(beta)

    def _reward(self, f: _Fields, i: int) -> tuple[torch.Tensor, int]:
        tok, att, asst = f["tokens"][i], f["attention_mask"][i], f["assistant_mask"][i]
        ts = [t for t in range(1, tok.shape[0]) if bool(asst[t]) and bool(att[t])]
        if not ts:
            return torch.zeros((), dtype=torch.float64), 0
        end = max(ts) + 1
        ids = torch.where(att[:end], tok[:end], torch.zeros_like(tok[:end]))
        logits = self.policy(input_ids=ids[None], attention_mask=att[None, :end].long()).logits
        logp = torch.log_softmax(logits[0].double(), -1)
        r = torch.zeros((), dtype=torch.float64)
        for t in ts:
            r = r + (logp[t - 1, int(tok[t])] - float(f["ref_log_probs"][i, t]))
        if self.token_reduction == "mean":
            r = r / len(ts)
        return r, len(ts)

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        f = _dpo_read(td)
        terms: list[torch.Tensor] = []
        wins = 0
        sum_c = sum_r = 0.0
        for i in range(f["tokens"].shape[0] // 2):
            rc, lc = self._reward(f, 2 * i)
            rr, _ = self._reward(f, 2 * i + 1)
            if lc == 0:
                continue
            delta = rc - rr
            terms.append(-torch.nn.functional.logsigmoid(self.beta * delta))
            wins += int(float(delta.detach()) > 0)
            sum_c += float(rc.detach())
            sum_r += float(rr.detach())
        p = counts.sequences / 2 if counts is not None else float(len(terms))
        p = p if p > 0 else 1.0
        loss: torch.Tensor = _anchor(self.policy).double()
        for term in terms:
            loss = loss + term / p
        dtype = next(self.policy.parameters()).dtype
        return {
            "loss_preference": loss.to(dtype),
            "accuracy": torch.tensor(wins / p, dtype=dtype),
            "rewards_chosen_mean": torch.tensor(sum_c / p, dtype=dtype),
            "rewards_rejected_mean": torch.tensor(sum_r / p, dtype=dtype),
        }


# --- dpo one-bug variants ---


class DpoSwapped(ConcatDPO):
    """Rows 2i taken as the rejected answer and 2i + 1 as the chosen one (preference dataset
    columns swapped, a recurring TRL/HF datasets report where the loss rises from log 2 as
    training "works"). Violates DPO-003."""

    chosen_offset = 1


class DpoRejectedNoGrad(ConcatDPO):
    """The rejected answers' policy log-probs computed in the no-grad block meant for the
    reference pass (both sides scored there, only the chosen re-run with grad): value right,
    the rejected answers get no gradient. Violates DPO-004."""

    def policy_log_probs(self, lp: torch.Tensor, pairs: int) -> torch.Tensor:
        return torch.cat([lp[:pairs], lp[pairs:].detach()])


class DpoBetaTwice(ConcatDPO):
    """β applied twice: the rewards already scaled by β (TRL's ``chosen_rewards = β·(...)``,
    the logged quantity) fed to a loss that multiplies by β again, -log σ(β²Δ). Violates
    DPO-003."""

    def margin(self, rc: torch.Tensor, rr: torch.Tensor) -> torch.Tensor:
        return self.beta * (rc - rr)


class DpoTiesWin(ConcatDPO):
    """Accuracy counts r_chosen >= r_rejected: every pair of identical answers (and every
    pair at step 0, policy = reference) reads as a win. Violates DPO-005."""

    def wins(self, delta: torch.Tensor) -> torch.Tensor:
        return delta >= 0


class DpoRewardMeansAllPairs(ConcatDPO):
    """``rewards_chosen_mean``/``rewards_rejected_mean`` as a plain ``.mean()`` over every
    pair of the batch (TRL logs ``chosen_rewards.mean()``), pairs that do not count included;
    the loss and accuracy average over counted pairs. Violates DPO-006."""

    def reward_mean(self, r: torch.Tensor, counted: torch.Tensor, p: float) -> torch.Tensor:
        return r.mean()


class DpoMeanDeclaredSummed(ConcatDPO):
    """Declares ``token_reduction='mean'`` but sums the log-ratios: TRL's IPO loss before
    huggingface/trl PR #1265 (Jan 2024, "average_log_prob when loss is IPO"), the
    length-normalised variant silently summing. Violates DPO-003."""

    def rewards(self, lr: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
        return lr.sum(1)


class DpoLabelSmoothingSign(ConcatDPO):
    """Conservative DPO's label smoothing (TRL's ``label_smoothing``, ε = 0.1) left on and
    with its sign flipped: -(1-ε)·log σ(βΔ) + ε·log σ(-βΔ) instead of a plain sigmoid loss
    (and instead of cDPO's - ε·log σ(-βΔ)). Violates DPO-003."""

    eps = 0.1

    def pair_loss(self, delta: torch.Tensor) -> torch.Tensor:
        ls = torch.nn.functional.logsigmoid
        return -(1 - self.eps) * ls(self.beta * delta) + self.eps * ls(-self.beta * delta)


class DpoMetricsPerMicroBatch(ConcatDPO):
    """The loss divided by the global pair count, but the metrics by the micro-batch's own
    counted pairs (per-micro-batch means, as trainers that log ``.mean()`` then average the
    logged values do): micro-batches' metrics sum to more than the whole batch's. Violates
    DPO-008."""

    def divisors(self, counted: torch.Tensor, counts: GlobalCounts | None) -> tuple[float, float]:
        p_loss, _ = super().divisors(counted, counts)
        own = float(counted.sum())
        return p_loss, own if own > 0 else 1.0


class DpoEitherRowCounts(ConcatDPO):
    """A pair counted when either answer holds an assistant token (a per-row sample mask
    OR-ed per pair), so a pair whose chosen row is empty but whose rejected row is not is
    averaged in, with chosen reward 0. The spec counts a pair only when its chosen row holds a
    token. Violates DPO-006 (whose sentence says "average over the pairs whose chosen row
    holds an assistant token")."""

    def counted(self, mm: torch.Tensor, pairs: int) -> torch.Tensor:
        return mm[:pairs].any(1) | mm[pairs:].any(1)


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------


def _nll(cls: type, name: str, aggregation: str) -> Implementation:
    return Implementation(
        "nll_loss",
        functools.partial(cls, aggregation=aggregation),
        name=name,
        capabilities={"global_counts"},
        options={"aggregation": aggregation},
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


def _dpo(cls: type, name: str, token_reduction: str, beta: float) -> Implementation:
    return Implementation(
        "dpo_loss",
        functools.partial(cls, token_reduction=token_reduction, beta=beta),
        name=name,
        capabilities={"global_counts"},
        options={"token_reduction": token_reduction},
        extras={"beta": beta},
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


CORRECT_NLL: dict[str, Implementation] = {
    "loop_token_mean": _nll(LoopNLL, "sft-dpo/loop-nll-token-mean", "token_mean"),
    "loop_seq_mean_token_mean": _nll(
        LoopNLL, "sft-dpo/loop-nll-seq-mean-token-mean", "seq_mean_token_mean"
    ),
    "loop_seq_mean_token_sum": _nll(
        LoopNLL, "sft-dpo/loop-nll-seq-mean-token-sum", "seq_mean_token_sum"
    ),
    "masked_token_mean": _nll(MaskedSumNLL, "sft-dpo/masked-nll-token-mean", "token_mean"),
    "masked_seq_mean_token_mean": _nll(
        MaskedSumNLL, "sft-dpo/masked-nll-seq-mean-token-mean", "seq_mean_token_mean"
    ),
    "masked_seq_mean_token_sum": _nll(
        MaskedSumNLL, "sft-dpo/masked-nll-seq-mean-token-sum", "seq_mean_token_sum"
    ),
}

CORRECT_DPO: dict[str, Implementation] = {
    "concat_sum": _dpo(ConcatDPO, "sft-dpo/concat-dpo-sum", "sum", 0.1),
    "concat_mean": _dpo(ConcatDPO, "sft-dpo/concat-dpo-mean", "mean", 0.5),
    "pair_loop_sum": _dpo(PairLoopDPO, "sft-dpo/pair-loop-dpo-sum", "sum", 0.3),
    "pair_loop_mean": _dpo(PairLoopDPO, "sft-dpo/pair-loop-dpo-mean", "mean", 0.1),
}

VARIANTS: dict[str, tuple[str, Implementation]] = {
    "nll_counts_ignored": ("NLL-007", _nll(NllCountsIgnored, "v/nll-counts-ignored", "token_mean")),
    "nll_labels_shifted_twice": (
        "NLL-003", _nll(NllLabelsShiftedTwice, "v/nll-labels-shifted-twice", "token_mean")
    ),
    "nll_prompt_trained": (
        "NLL-003", _nll(NllPromptTrained, "v/nll-prompt-trained", "seq_mean_token_mean")
    ),
    "nll_detached_logsumexp": (
        "NLL-004", _nll(NllDetachedLogsumexp, "v/nll-detached-logsumexp", "token_mean")
    ),
    "nll_label_smoothing": (
        "NLL-004", _nll(NllLabelSmoothing, "v/nll-label-smoothing", "token_mean")
    ),
    "nll_empty_rows_counted": (
        "NLL-008", _nll(NllEmptyRowsCounted, "v/nll-empty-rows-counted", "seq_mean_token_sum")
    ),
    "nll_mask_as_weights": (
        "NLL-006", _nll(NllMaskAsWeights, "v/nll-mask-as-weights", "token_mean")
    ),
    "nll_count_with_position0": (
        "NLL-003", _nll(NllCountWithPosition0, "v/nll-count-with-position0", "token_mean")
    ),
    "dpo_swapped": ("DPO-003", _dpo(DpoSwapped, "v/dpo-swapped", "sum", 0.1)),
    "dpo_rejected_no_grad": (
        "DPO-004", _dpo(DpoRejectedNoGrad, "v/dpo-rejected-no-grad", "sum", 0.1)
    ),
    "dpo_beta_twice": ("DPO-003", _dpo(DpoBetaTwice, "v/dpo-beta-twice", "sum", 0.5)),
    "dpo_ties_win": ("DPO-005", _dpo(DpoTiesWin, "v/dpo-ties-win", "sum", 0.1)),
    "dpo_reward_means_all_pairs": (
        "DPO-006", _dpo(DpoRewardMeansAllPairs, "v/dpo-reward-means-all-pairs", "sum", 0.1)
    ),
    "dpo_mean_declared_summed": (
        "DPO-003", _dpo(DpoMeanDeclaredSummed, "v/dpo-mean-declared-summed", "mean", 0.1)
    ),
    "dpo_label_smoothing_sign": (
        "DPO-003", _dpo(DpoLabelSmoothingSign, "v/dpo-label-smoothing-sign", "sum", 0.1)
    ),
    "dpo_metrics_per_micro_batch": (
        "DPO-008", _dpo(DpoMetricsPerMicroBatch, "v/dpo-metrics-per-micro-batch", "sum", 0.1)
    ),
    "dpo_either_row_counts": (
        "DPO-006", _dpo(DpoEitherRowCounts, "v/dpo-either-row-counts", "sum", 0.1)
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------------
# the spec's formulas in float64 (no kit), and the demos
# ------------------------------------------------------------------------------------------

_V = 32


def _policy() -> Any:
    from posttrain.testing import tiny_causal_lm

    return tiny_causal_lm(vocab_size=_V, seed=3).double()


def _batch(n: int, t: int = 10, seed: int = 0) -> TensorDictBase:
    from posttrain.testing import llm_batch

    return llm_batch(n, t, vocab_size=_V, seed=seed)


def _log_probs64(policy: Any, td: TensorDictBase) -> torch.Tensor:
    """[B, T] float64: log p(token_t | tokens before t) from the logits at t - 1, row by row."""
    k = LLM_LAYOUT_V1.key
    tok, att = td.get(k("tokens")), td.get(k("attention_mask"))
    out = torch.zeros(tok.shape, dtype=torch.float64)
    for i in range(tok.shape[0]):
        logits = policy(input_ids=tok[i : i + 1], attention_mask=att[i : i + 1].long()).logits
        logp = torch.log_softmax(logits[0].double(), -1)
        for t in range(1, tok.shape[1]):
            out[i, t] = logp[t - 1, tok[i, t]]
    return out


def _spec_nll(
    policy: Any, td: TensorDictBase, aggregation: str, counts: GlobalCounts | None = None
) -> float:
    """Σ w·(-log p) with the declared aggregation's weights (NLL-003 / NLL-007)."""
    k = LLM_LAYOUT_V1.key
    with torch.no_grad():
        lp = _log_probs64(policy, td)
    m = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
    m[:, 0] = False
    lengths = m.sum(1).tolist()
    n = counts.tokens if counts else sum(lengths)
    s = counts.sequences if counts else sum(1 for x in lengths if x > 0)
    total = 0.0
    for i, li in enumerate(lengths):
        for t in range(m.shape[1]):
            if m[i, t]:
                w = {
                    "token_mean": 1 / n,
                    "seq_mean_token_mean": 1 / (s * li),
                    "seq_mean_token_sum": 1 / s,
                }[aggregation]
                total += -w * float(lp[i, t])
    return total


def _spec_dpo(
    policy: Any,
    td: TensorDictBase,
    token_reduction: str,
    beta: float,
    counts: GlobalCounts | None = None,
) -> dict[str, float]:
    """The loss and metrics of the dpo_loss spec (DPO-003, DPO-005, DPO-006, DPO-007)."""
    k = LLM_LAYOUT_V1.key
    with torch.no_grad():
        lp = _log_probs64(policy, td)
    m = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
    m[:, 0] = False
    ref = td.get(k("ref_log_probs")).double()
    r = []
    for i in range(m.shape[0]):
        x = [float(lp[i, t] - ref[i, t]) for t in range(m.shape[1]) if m[i, t]]
        r.append((sum(x) / len(x) if x else 0.0) if token_reduction == "mean" else sum(x))
    pairs = [i for i in range(m.shape[0] // 2) if m[2 * i].any()]
    p = counts.sequences / 2 if counts else len(pairs)
    loss = wins = rc = rr = 0.0
    for i in pairs:
        d = r[2 * i] - r[2 * i + 1]
        loss += math.log1p(math.exp(-beta * d))
        wins += d > 0
        rc += r[2 * i]
        rr += r[2 * i + 1]
    return {
        "loss_preference": loss / p,
        "accuracy": wins / p,
        "rewards_chosen_mean": rc / p,
        "rewards_rejected_mean": rr / p,
    }


def _differs(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) > rel * max(abs(a), abs(b), 1e-12)


def _param_grads(loss: torch.Tensor, policy: Any) -> torch.Tensor:
    ps = [p for p in policy.parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, ps, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).flatten()
            for g, p in zip(gs, ps, strict=True)
        ]
    )


def _nll_value_demo(cls: type, aggregation: str, td: TensorDictBase, **kw: Any) -> bool:
    policy = _policy()
    got = float(cls(policy, aggregation=aggregation)(td, **kw)["loss_nll"].detach())
    return _differs(got, _spec_nll(policy, td, aggregation, kw.get("counts")))


def demo_nll_counts_ignored() -> bool:
    td = _batch(4)
    whole = GlobalCounts.of(td)
    counts = GlobalCounts(whole.tokens * 3, whole.sequences * 3)
    return _nll_value_demo(NllCountsIgnored, "token_mean", td, counts=counts)


def demo_nll_labels_shifted_twice() -> bool:
    return _nll_value_demo(NllLabelsShiftedTwice, "token_mean", _batch(3))


def demo_nll_prompt_trained() -> bool:
    return _nll_value_demo(NllPromptTrained, "seq_mean_token_mean", _batch(3))


def demo_nll_detached_logsumexp() -> bool:
    policy, td = _policy(), _batch(3)
    good = MaskedSumNLL(policy)(td)["loss_nll"]
    bad = NllDetachedLogsumexp(policy)(td)["loss_nll"]
    same_value = not _differs(float(bad.detach()), _spec_nll(policy, td, "token_mean"))
    g_good, g_bad = _param_grads(good, policy), _param_grads(bad, policy)
    return same_value and float((g_good - g_bad).abs().max()) > 1e-6 * float(g_good.abs().max())


def demo_nll_label_smoothing() -> bool:
    return _nll_value_demo(NllLabelSmoothing, "token_mean", _batch(3))


def demo_nll_empty_rows_counted() -> bool:
    td = _batch(4)
    td.get(("masks", "all_assistant_mask"))[1] = False  # a row holding no assistant token
    return _nll_value_demo(NllEmptyRowsCounted, "seq_mean_token_sum", td)


def demo_nll_mask_as_weights() -> bool:
    td = _batch(3)
    key = ("masks", "all_assistant_mask")
    td.set(key, td.get(key).to(torch.float32))
    try:
        NllMaskAsWeights(_policy())(td)
    except (KeyError, TypeError, ValueError):
        return False
    return True  # a float mask taken without an error naming the key


def demo_nll_count_with_position0() -> bool:
    td = _batch(3)
    td.get(("masks", "all_assistant_mask"))[:, 0] = True  # attended, and no logit predicts it
    return _nll_value_demo(NllCountWithPosition0, "token_mean", td)


def _dpo_demo(
    cls: type, td: TensorDictBase, key: str, token_reduction: str = "sum", beta: float = 0.5
) -> bool:
    policy = _policy()
    got = float(cls(policy, token_reduction=token_reduction, beta=beta)(td)[key].detach())
    return _differs(got, _spec_dpo(policy, td, token_reduction, beta)[key])


def demo_dpo_swapped() -> bool:
    return _dpo_demo(DpoSwapped, _batch(4), "loss_preference")


def demo_dpo_rejected_no_grad() -> bool:
    policy, td = _policy(), _batch(4)
    good = ConcatDPO(policy, beta=0.5)(td)["loss_preference"]
    bad = DpoRejectedNoGrad(policy, beta=0.5)(td)["loss_preference"]
    same_value = not _differs(
        float(bad.detach()), _spec_dpo(policy, td, "sum", 0.5)["loss_preference"]
    )
    g_good, g_bad = _param_grads(good, policy), _param_grads(bad, policy)
    return same_value and float((g_good - g_bad).abs().max()) > 1e-6 * float(g_good.abs().max())


def demo_dpo_beta_twice() -> bool:
    return _dpo_demo(DpoBetaTwice, _batch(4), "loss_preference")


def demo_dpo_ties_win() -> bool:
    td = _batch(4)
    td[1] = td[0]  # pair 0: two identical answers, a tie
    return _dpo_demo(DpoTiesWin, td, "accuracy")


def demo_dpo_reward_means_all_pairs() -> bool:
    td = _batch(6)
    td.get(("masks", "all_assistant_mask"))[2:4] = False  # pair 1 holds no assistant token
    return _dpo_demo(DpoRewardMeansAllPairs, td, "rewards_chosen_mean")


def demo_dpo_mean_declared_summed() -> bool:
    return _dpo_demo(DpoMeanDeclaredSummed, _batch(4), "loss_preference", "mean")


def demo_dpo_label_smoothing_sign() -> bool:
    return _dpo_demo(DpoLabelSmoothingSign, _batch(4), "loss_preference")


def demo_dpo_metrics_per_micro_batch() -> bool:
    policy, td = _policy(), _batch(6)
    counts = GlobalCounts(GlobalCounts.of(td).tokens, 6)  # 3 counted pairs
    loss = DpoMetricsPerMicroBatch(policy, beta=0.5)
    parts = [loss(mb, counts=counts) for mb in (td[:2], td[2:])]
    summed = sum(float(p["rewards_chosen_mean"]) for p in parts)
    return _differs(summed, _spec_dpo(policy, td, "sum", 0.5)["rewards_chosen_mean"])


def demo_dpo_either_row_counts() -> bool:
    td = _batch(6)
    td.get(("masks", "all_assistant_mask"))[2] = False  # pair 1: chosen empty, rejected not
    return _dpo_demo(DpoEitherRowCounts, td, "loss_preference")


DEMOS: dict[str, Callable[[], bool]] = {name: globals()[f"demo_{name}"] for name in VARIANTS}
