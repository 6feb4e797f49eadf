"""The NLL (SFT) loss suite: one check per NLL requirement (specs/nll_loss-v1.md).

Built on the policy-gradient loss suite's machinery (its tiny policy, its gradient probe on
the logits of every policy call, its global-count splits): the NLL is the policy-gradient
objective at ratio 1 with advantage 1 where the term is -log p itself, so the gradient with
respect to each token's log-prob is minus the aggregation's weight, and the value is the
float64 sum of w·(-log p) computed here from the same policy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_kit import ASST, ATT, TOK, V
from posttrain.conformance.suites.loss_kit import EMPTY_ROW as _EMPTY_ROW
from posttrain.conformance.suites.loss_kit import SPLITS as _SPLITS
from posttrain.conformance.suites.loss_kit import call_counted as _call_counted
from posttrain.conformance.suites.loss_kit import check_same as _same
from posttrain.conformance.suites.loss_kit import (
    check_scalar_finite_terms as _check_scalar_finite_terms,
)
from posttrain.conformance.suites.loss_kit import counts_of as _counts_of
from posttrain.conformance.suites.loss_kit import loss_term as _loss_term
from posttrain.conformance.suites.loss_kit import pad_columns as _pad
from posttrain.conformance.suites.loss_kit import refuse_each as _refuse_each
from posttrain.conformance.suites.loss_kit import scalars as _scalars
from posttrain.conformance.suites.loss_kit import setup as _setup
from posttrain.conformance.suites.loss_kit import split_name as _split_name
from posttrain.conformance.suites.loss_kit import term_logp_grads as _term_logp_grads
from posttrain.conformance.suites.loss_kit import trimmed as _trimmed
from posttrain.conformance.suites.loss_kit import value_and_grads as _value_and_grads
from posttrain.conformance.suites.loss_kit import weights_for as _weights_for
from posttrain.conformance.suites.loss_kit import with_value as _with
from posttrain.testing import llm_batch

B, T = 4, 10


def batch(ctx: Context, *, b: int = B, seed: int = 0) -> TensorDictBase:
    """A batch whose row 0 is an answer from position 0 on: no logit predicts position 0, so
    it weighs nothing (a loss that counts ``mask.sum()`` over every position is one off)."""
    td = llm_batch(b, T, vocab_size=V, seed=ctx.seed * 7919 + seed)
    asst = td.get(ASST).clone()
    asst[0, : int(asst[0].nonzero().max()) + 1] = True
    td.set(ASST, asst)
    return td


def log_probs64(policy: Any, td: TensorDictBase) -> torch.Tensor:
    """log p(token_t) from the logits at t - 1, in float64 ([B, T]; position 0 is 0)."""
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    picked = lp.gather(-1, td.get(TOK)[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def _nll_want(ctx: Context, policy: Any, td: TensorDictBase, tokens: int, seqs: int) -> float:
    w = _weights_for(ctx, td.get(ASST) & td.get(ATT), tokens, seqs)
    return float((w * -log_probs64(policy, td)).sum())


@requirement("NLL-001")
def scalar_finite_terms(ctx: Context) -> None:
    _, loss = _setup(ctx)
    _check_scalar_finite_terms(loss(batch(ctx)), "loss_nll")


def gradient_reaches(policy: Any, term: torch.Tensor, name: str) -> None:
    """Fail unless ``term`` has a non-zero finite gradient on the policy's parameters."""
    if not term.requires_grad:
        raise _fail(f"{name} does not require grad: no gradient can reach the policy")
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = torch.autograd.grad(term, params, allow_unused=True)
    found = [g for g in grads if g is not None]
    if not found or all(float(g.abs().sum()) == 0 for g in found):
        raise _fail(f"backward of {name} left every policy parameter without a (non-zero) gradient")
    if not all(bool(torch.isfinite(g).all()) for g in found):
        raise _fail(f"backward of {name} gave non-finite parameter gradients")


@requirement("NLL-002")
def gradients_reach_policy(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    gradient_reaches(policy, _loss_term(loss(batch(ctx)), "loss_nll"), "loss_nll")


@requirement("NLL-003")
def loss_value(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = batch(ctx)
    with torch.no_grad():
        got = float(_loss_term(loss(td), "loss_nll"))
    want = _nll_want(ctx, policy, td, *_counts_of(td.get(ASST)))
    if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7):
        lp = log_probs64(policy, td)
        attended = td.get(ATT).clone()
        attended[:, 0] = False
        every = float(-(lp * attended).sum() / attended.sum())
        hint = ""
        if math.isclose(got, every, rel_tol=1e-5):
            hint = " (it is the token mean over every attended token, the prompt's included)"
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}: loss_nll of a batch of {B} rows is "
            f"{got:.6g}, expected {want:.6g} (sum of w x -log p over the assistant tokens, "
            f"log p from the logits one position earlier, in float64){hint}"
        )


@requirement("NLL-004")
def gradient_through_log_probs(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = batch(ctx)
    mask = td.get(ASST) & td.get(ATT)
    got = _term_logp_grads(policy, loss, td, "loss_nll")
    want = (-_weights_for(ctx, mask, *_counts_of(mask))).float()
    if not torch.allclose(got, want, atol=1e-6, rtol=1e-4):
        i, t = divmod(int((got - want).abs().argmax()), T)
        where = (
            "an assistant token" if mask[i, t] and t else "a position outside the assistant mask"
        )
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}: d loss_nll / d logp at row {i}, "
            f"position {t} ({where}) is {float(got[i, t]):.6g}, expected -weight = "
            f"{float(want[i, t]):.6g}"
        )


@requirement("NLL-005")
def padding_inert(ctx: Context) -> None:
    _, loss = _setup(ctx)
    td = batch(ctx)

    def scramble(td: TensorDictBase) -> TensorDictBase:
        pad = ~td.get(ATT)
        return _with(td, TOK, torch.where(pad, (td.get(TOK) + 17) % V, td.get(TOK)))

    with torch.no_grad():
        base = _scalars(loss(td.clone()))
        for change, what in ((_pad, "appending 3 padding columns"),
                             (scramble, "changing the tokens at padding positions")):  # fmt: skip
            _same(base, _scalars(loss(change(td.clone()))), what)


@requirement("NLL-006")
def bad_layout_rejected(ctx: Context) -> None:
    _, loss = _setup(ctx)
    td0 = batch(ctx)
    asst, att = td0.get(ASST), td0.get(ATT)
    refused = [
        (td0.clone().exclude(TOK), TOK, "the tokens missing"),
        (td0.clone().exclude(ASST), ASST, "the assistant mask missing"),
        (td0.clone().exclude(ATT), ATT, "the attention mask missing"),
        (_with(td0.clone(), ASST, asst.float()), ASST, "a float32 assistant mask (0/1)"),
        (_with(td0.clone(), ASST, asst.long()), ASST, "an int64 assistant mask (0/1)"),
        (_with(td0.clone(), ATT, att.long()), ATT, "an int64 attention mask (0/1)"),
    ]
    _refuse_each(loss, refused)


def counted_batch(ctx: Context) -> TensorDictBase:
    """5 rows: row 0 an answer from position 0 on, row 2 without any assistant token."""
    td = batch(ctx, b=5, seed=16)
    asst = td.get(ASST).clone()
    asst[_EMPTY_ROW] = False
    td.set(ASST, asst)
    return td


@requirement("NLL-007")
def global_counts_normalize(ctx: Context) -> None:
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = _setup(ctx)
    td = counted_batch(ctx)
    n, s = _counts_of(td.get(ASST))
    for tokens, seqs in ((n, s), (3 * n + 5, 2 * s + 3)):
        with torch.no_grad():
            got = float(_loss_term(_call_counted(loss, td, GlobalCounts(tokens, seqs)), "loss_nll"))
        want = _nll_want(ctx, policy, td, tokens, seqs)
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7):
            raise _fail(
                f"aggregation {ctx.options['aggregation']!r}, a batch of {n} assistant tokens "
                f"in {s} rows called with counts=GlobalCounts({tokens}, {seqs}): loss_nll is "
                f"{got:.6g}, expected {want:.6g} (normalized by {tokens} tokens and {seqs} "
                f"sequences)"
            )


def check_parts_add_up(
    policy: Any,
    loss: Any,
    td: TensorDictBase,
    counts: Any,
    splits: tuple[tuple[tuple[int, ...], ...], ...],
    where: str,
    metrics: tuple[str, ...] = (),
) -> None:
    """Fail unless every split's micro-batches, called with ``counts``, sum to ``loss(td)``:
    its ``loss_*`` terms and ``metrics``, and the policy-parameter gradients of the terms."""
    full, g_full = _value_and_grads(policy, loss, td, None)
    with torch.no_grad():
        full_m = _scalars(loss(td))
    g_tol = 1e-5 * max(float(g_full.abs().max()), 1e-12)
    for split in splits:
        parts, parts_m = [], []
        for p in split:
            part = _trimmed(td[list(p)])
            parts.append(_value_and_grads(policy, loss, part, counts))
            with torch.no_grad():
                parts_m.append(_scalars(_call_counted(loss, part, counts)))
        at = f"{where} split into micro-batches {_split_name(split)}, each called with {counts}"
        names = set(full).union(*(set(t) for t, _ in parts))
        sums = {n: (sum(t.get(n, 0.0) for t, _ in parts), full.get(n, 0.0)) for n in names}
        for m in metrics:
            if m in full_m:
                sums[m] = (sum(pm.get(m, 0.0) for pm in parts_m), full_m[m])
        for name, (got, want) in sorted(sums.items()):
            if not abs(got - want) <= 1e-5 * max(abs(want), 1e-6):  # NaN fails too
                raise _fail(
                    f"{at}: the micro-batches' {name} sum to {got:.6g}, the whole batch's is "
                    f"{want:.6g}"
                )
        err = float((torch.stack([g for _, g in parts]).sum(0) - g_full).abs().max())
        if not err <= g_tol:
            raise _fail(
                f"{at}: the sum of the micro-batches' parameter gradients differs from the "
                f"whole batch's by up to {err:.3g} (largest entry {float(g_full.abs().max()):.3g})"
            )


@requirement("NLL-008")
def micro_batches_add_up(ctx: Context) -> None:
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = _setup(ctx)
    td = counted_batch(ctx)
    where = (
        f"aggregation {ctx.options['aggregation']!r}, a batch of 5 rows (row {_EMPTY_ROW} "
        f"without assistant tokens)"
    )
    check_parts_add_up(policy, loss, td, GlobalCounts.of(td), _SPLITS, where)
