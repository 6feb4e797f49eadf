"""The DPO loss suite: one check per DPO requirement (specs/dpo_loss-v1.md).

Built on the policy-gradient loss suite's machinery (its tiny policy and its gradient probe on
the logits of every policy call) and the NLL suite's (float64 log-probs, micro-batch sums).
Pairs are consecutive rows (2i chosen, 2i + 1 rejected) sharing a prompt; the reference
log-probs are the policy's own minus per-token offsets, so every reward is off zero and both
signs of r_chosen - r_rejected occur. The expected loss, gradients and metrics are computed
here in float64 from the same policy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_kit import ASST, ATT, RLP, TOK, V
from posttrain.conformance.suites.loss_kit import call_counted as _call_counted
from posttrain.conformance.suites.loss_kit import (
    check_scalar_finite_terms as _check_scalar_finite_terms,
)
from posttrain.conformance.suites.loss_kit import loss_term as _loss_term
from posttrain.conformance.suites.loss_kit import refuse_each as _refuse_each
from posttrain.conformance.suites.loss_kit import scalars as _scalars
from posttrain.conformance.suites.loss_kit import setup as _setup
from posttrain.conformance.suites.loss_kit import term_logp_grads as _term_logp_grads
from posttrain.conformance.suites.loss_kit import with_value as _with
from posttrain.conformance.suites.nll_loss import (
    check_parts_add_up,
    gradient_reaches,
    log_probs64,
)
from posttrain.testing import llm_batch

T = 10
PAIRS = 4
_METRICS = ("accuracy", "rewards_chosen_mean", "rewards_rejected_mean")


def _beta(ctx: Context) -> float:
    beta = ctx.impl.extras.get("beta")
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not beta > 0:
        raise _fail(f"Implementation.extras['beta'] (a positive number) is {beta!r}")
    return float(beta)


def pairs_batch(ctx: Context, policy: Any, *, pairs: int = PAIRS, seed: int = 0) -> TensorDictBase:
    """``pairs`` pairs: rows 2i and 2i + 1 share their prompt and differ in their answers; the
    reference log-probs are the policy's own minus offsets in [-1, 1] (NaN outside the
    assistant mask, as the layout writes log-probs)."""
    td = llm_batch(2 * pairs, T, vocab_size=V, seed=ctx.seed * 7919 + seed)
    tokens = td.get(TOK).clone()
    prompt = int((~td.get(ASST)[0] & td.get(ATT)[0]).sum())
    tokens[1::2, :prompt] = tokens[0::2, :prompt]
    td.set(TOK, tokens)
    return with_reference(td, policy, seed)


def with_reference(td: TensorDictBase, policy: Any, seed: int) -> TensorDictBase:
    """``td`` with reference log-probs off the policy's own on its assistant tokens."""
    g = torch.Generator().manual_seed(seed + 11)
    off = 2 * torch.rand(td.get(TOK).shape, generator=g, dtype=torch.float64) - 1
    ref = (log_probs64(policy, td) - off).float()
    td.set(RLP, torch.where(td.get(ASST), ref, float("nan")))
    return td


def _mask(td: TensorDictBase) -> torch.Tensor:
    m: torch.Tensor = td.get(ASST) & td.get(ATT)
    m[:, 0] = False
    return m


def expected(
    ctx: Context, policy: Any, td: TensorDictBase, pairs: int | None = None
) -> dict[str, Any]:
    """The loss, metrics and per-token gradient the contract asks for, in float64."""
    beta = _beta(ctx)
    m = _mask(td).double()
    ref = torch.where(_mask(td), td.get(RLP).double(), 0.0)
    lp = log_probs64(policy, td)
    n_tok = m.sum(-1)
    scale = (1 / n_tok.clamp_min(1)) if ctx.options["token_reduction"] == "mean" else 1 + 0 * n_tok
    r = ((lp - ref) * m).sum(-1) * scale
    chosen, rejected = r[0::2], r[1::2]
    valid = (n_tok[0::2] > 0).double()
    p = float(valid.sum()) if pairs is None else float(pairs)
    delta = chosen - rejected
    loss = float((-torch.nn.functional.logsigmoid(beta * delta) * valid).sum() / p)
    g_pair = -beta * torch.sigmoid(-beta * delta) * valid / p  # d loss / d r_chosen
    g_row = torch.stack([g_pair, -g_pair], -1).flatten() * scale
    return {
        "loss_preference": loss,
        "accuracy": float(((chosen > rejected).double() * valid).sum() / p),
        "rewards_chosen_mean": float((chosen * valid).sum() / p),
        "rewards_rejected_mean": float((rejected * valid).sum() / p),
        "grad": g_row[:, None] * m,
        "delta": delta,
    }


def _compare(
    got: dict[str, float], want: dict[str, Any], names: tuple[str, ...], what: str
) -> None:
    for name in names:
        if name not in got:
            raise _fail(f"{what}: no {name!r} among the outputs {sorted(got)}")
        if not math.isclose(got[name], want[name], rel_tol=1e-5, abs_tol=1e-6):
            raise _fail(f"{what}: {name} is {got[name]:.6g}, expected {want[name]:.6g}")


def _declared(ctx: Context) -> str:
    return f"token_reduction {ctx.options['token_reduction']!r}, beta {_beta(ctx):g}"


@requirement("DPO-001")
def scalar_finite_terms(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    _check_scalar_finite_terms(loss(pairs_batch(ctx, policy)), "loss_preference")


@requirement("DPO-002")
def gradients_reach_policy(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    gradient_reaches(
        policy, _loss_term(loss(pairs_batch(ctx, policy)), "loss_preference"), "loss_preference"
    )


@requirement("DPO-003")
def preference_loss_value(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = pairs_batch(ctx, policy)
    with torch.no_grad():
        got = _scalars(loss(td))
    want = expected(ctx, policy, td)
    what = f"{_declared(ctx)}, {PAIRS} pairs (rows 2i chosen, 2i + 1 rejected)"
    if "loss_preference" in got and not math.isclose(
        got["loss_preference"], want["loss_preference"], rel_tol=1e-5, abs_tol=1e-7
    ):
        swapped = expected(ctx, policy, td[torch.arange(2 * PAIRS) ^ 1])["loss_preference"]
        hint = ""
        if math.isclose(got["loss_preference"], swapped, rel_tol=1e-5):
            hint = " (it is the loss with chosen and rejected swapped)"
        raise _fail(
            f"{what}: loss_preference is {got['loss_preference']:.6g}, expected "
            f"{want['loss_preference']:.6g} (mean over pairs of -log sigmoid(beta (r_chosen - "
            f"r_rejected)), in float64){hint}"
        )
    _compare(got, want, ("loss_preference",), what)


@requirement("DPO-004")
def gradient_through_both_answers(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = pairs_batch(ctx, policy)
    got = _term_logp_grads(policy, loss, td, "loss_preference")
    want = expected(ctx, policy, td)["grad"].float()
    if not torch.allclose(got, want, atol=1e-6, rtol=1e-4):
        i, t = divmod(int((got - want).abs().argmax()), T)
        row = "chosen" if i % 2 == 0 else "rejected"
        raise _fail(
            f"{_declared(ctx)}: d loss_preference / d logp at row {i} (pair {i // 2}'s {row} "
            f"answer), position {t} is {float(got[i, t]):.6g}, expected {float(want[i, t]):.6g}"
        )


@requirement("DPO-005")
def reward_metrics(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = pairs_batch(ctx, policy, seed=5)
    # Pair 1's rejected answer is its chosen one: equal rewards, a tie.
    for key in (TOK, ATT, ASST, RLP):
        v = td.get(key).clone()
        v[3] = v[2]
        td.set(key, v)
    with torch.no_grad():
        got = _scalars(loss(td))
    want = expected(ctx, policy, td)
    _compare(
        got,
        want,
        _METRICS,
        f"{_declared(ctx)}, {PAIRS} pairs, pair 1's two answers equal (a tie, no win)",
    )


def _sparse_pairs(ctx: Context, policy: Any, pairs: int, seed: int) -> TensorDictBase:
    """Pairs whose pair 1 has an empty rejected row (a counted pair), with 4 pairs or more pair 2
    no assistant token at all, and with 5 pairs or more pair 4 an empty chosen row beside a
    rejected answer (not counted), and with 6 pairs pair 5 an empty rejected row again (so half
    the rows holding a token is not the count of pairs)."""
    td = pairs_batch(ctx, policy, pairs=pairs, seed=seed)
    asst = td.get(ASST).clone()
    asst[3] = False
    if pairs >= 4:
        asst[4:6] = False
    if pairs >= 5:
        asst[8] = False
    if pairs >= 6:
        asst[11] = False
    td.set(ASST, asst)
    return with_reference(td, policy, seed)


@requirement("DPO-006")
def pairs_counted(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _sparse_pairs(ctx, policy, 6, seed=9)
    with torch.no_grad():
        got = _scalars(loss(td))
    want = expected(ctx, policy, td)
    _compare(
        got,
        want,
        ("loss_preference", *_METRICS),
        f"{_declared(ctx)}, 6 pairs: pair 1's and pair 5's rejected rows, both rows of pair 2 "
        f"and pair 4's chosen row without assistant tokens (4 counted pairs)",
    )


def _dpo_counts(td: TensorDictBase) -> Any:
    from posttrain.contracts.loss import GlobalCounts

    m = _mask(td)
    return GlobalCounts(int(m.sum()), 2 * int(m[0::2].any(-1).sum()))


@requirement("DPO-007")
def global_counts_normalize(ctx: Context) -> None:
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = _setup(ctx)
    td = _sparse_pairs(ctx, policy, 3, seed=13)
    own = _dpo_counts(td)
    for counts in (own, GlobalCounts(3 * own.tokens + 5, own.sequences + 6)):
        with torch.no_grad():
            got = float(_loss_term(_call_counted(loss, td, counts), "loss_preference"))
        want = expected(ctx, policy, td, pairs=counts.sequences // 2)["loss_preference"]
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7):
            raise _fail(
                f"{_declared(ctx)}, 3 pairs (pair 1's rejected row empty) called with "
                f"counts={counts}: loss_preference is {got:.6g}, expected {want:.6g} (the mean "
                f"over {counts.sequences // 2} pairs)"
            )


_PAIR_SPLITS = (((0,), (1, 2, 3)), ((0, 1, 3), (2,)), ((3, 1), (2, 0)))


@requirement("DPO-008")
def micro_batches_add_up(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _sparse_pairs(ctx, policy, 4, seed=17)
    rows = tuple(
        tuple(tuple(r for p in part for r in (2 * p, 2 * p + 1)) for part in split)
        for split in _PAIR_SPLITS
    )
    where = f"{_declared(ctx)}, 4 pairs (pair 1's rejected row empty, pair 2 empty) as rows"
    check_parts_add_up(policy, loss, td, _dpo_counts(td), rows, where, _METRICS)


@requirement("DPO-009")
def bad_layout_rejected(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td0 = pairs_batch(ctx, policy)
    refused = [
        (td0.clone().exclude(RLP), RLP, "the reference log-probs missing"),
        (_with(td0.clone(), ASST, td0.get(ASST).float()), ASST, "a float32 assistant mask (0/1)"),
        (_with(td0.clone(), ATT, td0.get(ATT).long()), ATT, "an int64 attention mask (0/1)"),
    ]
    _refuse_each(loss, refused)
    try:
        with torch.no_grad():
            loss(td0[: 2 * PAIRS - 1])
    except Exception:
        return
    raise _fail(f"a batch of {2 * PAIRS - 1} rows (an odd number: a half pair) was accepted")
