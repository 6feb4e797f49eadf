"""The DPO loss suite: one check per DPO requirement (specs/dpo_loss-v1.md).

Built on the policy-gradient loss suite's machinery (its tiny policy and its gradient probe on
the logits of every policy call) and the NLL suite's (float64 log-probs, micro-batch sums).
Pairs are consecutive rows (2i chosen, 2i + 1 rejected) sharing a prompt; the reference
log-probs are the policy's own minus per-token offsets, so every reward is off zero and both
signs of r_chosen - r_rejected occur. The expected loss, gradients and metrics are computed
here in float64 from the same policy.

Every check draws its pairs from the requirement's domain (:class:`Pairs`, the boundaries
first): 1 to 4 pairs, 2 to 20 columns, empty rows in any pair, ties, reference offsets up to
200 nats (margins β·Δ past ±100, where σ underflows in float32) and a policy whose output head
is scaled by 1 to 1000 (logits up to about 400; 30 at most where gradients are read). DPO-005
adds near-ties: a pair of two equal answers whose reference log-probs differ by a margin β·Δ of
either sign down to 1e-30, far below float32's resolution of σ around 1/2 (about 6e-8), its
answer the policy's own greedy continuation so that each log p is 0 or nearly, and every sum
of the rewards exact enough in float32 to keep Δ's sign. DPO-003 drives a live policy as
NLL-003 does (:func:`~posttrain.conformance.suites._live_policy.check_live`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.explore import for_all
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._live_policy import check_live
from posttrain.conformance.suites.loss_kit import ASST, ATT, PEAK, RLP, TOK, V
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
    BIG,
    SCALES,
    Case,
    Scaled,
    check_parts_add_up,
    gradient_reaches,
    log_probs64,
    nll_batch,
    peaks64,
    scales,
    with_split,
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


@dataclass(frozen=True)
class Pairs:
    """One batch of the DPO requirements' domain; its repr is the batch's recipe
    (``pairs_case(ctx, policy, Pairs(...))`` rebuilds it under the run's seed).

    ``empty``: per pair, which rows hold no assistant token (``""`` none, ``"rejected"``,
    ``"both"``, ``"chosen"``); ``offset``: the reference log-probs' largest per-token offset
    from the policy's own, in nats; ``margin``: ``"random"`` offsets of either sign,
    ``"against"`` the chosen answers' reference at 0 and the rejected ones' ``offset`` below
    the policy's (β·Δ far below 0), ``"for"`` the mirror; ``tie``: the last pair's rejected
    row a copy of its chosen one; ``full_pair``: pair 0 answered from position 0 to the last
    column; ``edges``: ids 0 and V - 1 on pair 0's answers; ``scale``: the factor on the
    output head; ``tiny``: when not 0, the last pair a near-tie of margin β·Δ = ``tiny``
    (or the smallest whose sign float32 keeps, where larger; a tie then goes to the pair
    before).
    """

    pairs: int
    width: int
    seed: int = 0
    empty: tuple[str, ...] = ()
    offset: float = 1.0
    margin: str = "random"
    tie: bool = False
    full_pair: bool = False
    edges: bool = False
    scale: float = 1.0
    tiny: float = 0.0


_EMPTY = ("", "rejected", "both", "chosen")


def tiny_margins() -> Any:
    """Margins β·Δ of either sign from 1e-30 to 1e-6 in magnitude (log-uniform), where σ(β·Δ)
    rounds to 1/2 in float32 below about 6e-8.

    Example:
        >>> 1e-30 <= abs(tiny_margins().example()) <= 1e-6
        True
    """
    from hypothesis import strategies as st

    return st.builds(
        lambda e, sign: sign * 10.0**e, st.floats(-30.0, -6.0), st.sampled_from((1.0, -1.0))
    )


def pair_cases(*, top: float = BIG, near_ties: bool = False) -> Any:
    """The domain's strategy: at least one counted pair (pair 0's chosen row holds a token);
    ``top`` the largest output-head factor, ``near_ties``: a near-tie drawn too (its policy's
    output head scaled by ``BIG``, where greedy tokens have log p 0 or nearly)."""
    from hypothesis import strategies as st

    def build(n: int) -> Any:
        return st.builds(
            Pairs,
            pairs=st.just(n),
            width=st.integers(2, 20),
            seed=st.integers(0, 2**16),
            empty=st.tuples(
                st.sampled_from(_EMPTY[:2]), *[st.sampled_from(_EMPTY) for _ in range(n - 1)]
            ),
            offset=st.sampled_from((1.0, 200.0)) | st.floats(0.01, 200.0),
            margin=st.sampled_from(("random", "against", "for")),
            tie=st.booleans(),
            full_pair=st.booleans(),
            edges=st.booleans(),
            scale=scales(top),
            tiny=(st.just(0.0) | tiny_margins()) if near_ties else st.just(0.0),
        )

    drawn = st.integers(1, 4).flatmap(build)
    return drawn.map(lambda c: replace(c, scale=BIG) if c.tiny else c)


PAIR_BOUNDARIES = (
    Pairs(1, 2),  # one pair, one scored position each
    Pairs(2, 16, 1, offset=200.0, margin="against", full_pair=True),  # β·Δ far below -100
    Pairs(3, 12, 2, ("", "", ""), tie=True, edges=True, scale=PEAK),
    Pairs(4, 14, 3, ("rejected", "both", "chosen", ""), offset=200.0, margin="for", scale=BIG),
)
NEAR_TIES = (
    Pairs(2, 9, 5, tiny=1e-9, scale=BIG),  # a win σ(β·Δ) rounds to 1/2
    Pairs(1, 2, 6, tiny=1e-30, scale=BIG),  # one pair, one token: β·Δ = 1e-30
    Pairs(3, 12, 7, tie=True, tiny=-3e-8, scale=BIG),  # a tie, then a near-tie lost
)
"""DPO-005's near-tie boundaries: margins β·Δ of either sign below float32's resolution of σ."""


def _near_tie(policy: Any, width: int, g: torch.Generator) -> tuple[torch.Tensor, int, int, float]:
    """A row for a near-tie: (tokens of its attended length n, n, its answer length L, the
    least |Σ log-ratio difference| whose sign float32 keeps). Of 8 random prompts, each
    answered by the policy's greedy continuation, the one whose log-probs are nearest 0."""
    n = int(torch.randint(2, width + 1, (1,), generator=g)) if width > 2 else 2
    answer = min(n - 1, int(torch.randint(1, 5, (1,), generator=g)))
    cand = torch.randint(1, V, (8, n), generator=g)
    with torch.no_grad():
        for pos in range(n - answer, n):
            logits = policy(input_ids=cand[:, :pos], attention_mask=torch.ones(8, pos).long())
            cand[:, pos] = logits.logits[:, -1].argmax(-1)
        logits = policy(input_ids=cand, attention_mask=torch.ones(8, n).long()).logits
    lsm = torch.log_softmax(logits[:, :-1].double(), -1)
    lp = lsm.gather(-1, cand[:, 1:, None])[..., 0][:, n - 1 - answer :].abs()
    top = logits[:, :-1].double().abs().amax(-1)[:, n - 1 - answer :]
    # A float32 log p is 0 where log(1 + tiny) and max + tiny round away; elsewhere it may be
    # off by the rounding of a logsumexp of logits of magnitude ``top``.
    mag = torch.where(lp < 2.0**-26 * top, lp, lp + 2.0**-22 * top).sum(-1)
    floor = 64 * 2.0**-24 * answer * mag + 1e-12 * lp.sum(-1)
    best = int(floor.argmin())
    return cand[best], n, answer, float(floor[best])


def pairs_case(ctx: Context, policy: Any, case: Pairs) -> TensorDictBase:
    """The batch ``case`` describes (rows 2i chosen, 2i + 1 rejected, sharing a prompt)."""
    b, t = 2 * case.pairs, case.width
    g = torch.Generator().manual_seed(ctx.seed * 7919 + case.seed + 3)
    td = nll_batch(ctx, Case(b, t, case.seed))
    tokens, att, asst = (td.get(k).clone() for k in (TOK, ATT, ASST))
    lengths = torch.randint(2, t + 1, (b,), generator=g) if t > 2 else torch.full((b,), 2)
    prompts = torch.rand(case.pairs, generator=g) * (lengths[0::2].clamp_max(lengths[1::2]) - 1)
    prompts = prompts.long().repeat_interleave(2)
    tokens[1::2] = torch.where(
        torch.arange(t) < prompts[1::2, None], tokens[0::2], tokens[1::2]
    )  # the rejected answer shares its pair's prompt
    if case.full_pair:
        lengths[:2], prompts[:2] = t, 0
    pos = torch.arange(t).expand(b, t)
    att = pos < lengths[:, None]
    asst = att & (pos >= prompts[:, None])
    if case.edges:  # in opposite orders: the two answers never the same tokens (not a tie)
        for i, (first, second) in enumerate(((V - 1, 0), (0, V - 1))):
            at = asst[i].nonzero().flatten()
            at = at[at > 0]
            tokens[i, at[0::2]] = first
            tokens[i, at[1::2]] = second
    near = None
    if case.tiny:  # the last pair two equal greedy answers
        row, n, answer, floor = _near_tie(policy, t, g)
        tokens[-2:, :n] = row
        att[-2:] = pos[-2:] < n
        asst[-2:] = att[-2:] & (pos[-2:] >= n - answer)
        near = (n, answer, floor)
    tie = case.tie and case.pairs > (2 if near else 1)
    tied = -3 if near else -1  # the tie's rejected row
    if tie:
        for x in (tokens, att, asst):
            x[tied] = x[tied - 1]
    for p, which in enumerate(case.empty):
        if near and p == case.pairs - 1:
            continue
        if which in ("chosen", "both"):
            asst[2 * p] = False
        if which in ("rejected", "both"):
            asst[2 * p + 1] = False
    td.set(TOK, tokens)
    td.set(ATT, att)
    td.set(ASST, asst)
    off = (2 * torch.rand(b, t, generator=g, dtype=torch.float64) - 1) * case.offset
    lp = log_probs64(policy, td)
    if case.margin != "random":
        mag = case.offset * (0.5 + 0.5 * torch.rand(b, t, generator=g, dtype=torch.float64))
        high = 0 if case.margin == "against" else 1  # the row whose reference sits at 0
        off = torch.zeros_like(off)
        off[high::2] = lp[high::2]  # its reference log-probs 0: r = Σ log p
        off[1 - high :: 2] = mag[1 - high :: 2]  # the other's offset below: r = Σ offset
    ref = (lp - off).float()
    if tie:
        ref[tied] = ref[tied - 1]
    if near:
        n, answer, floor = near
        # r_chosen = Σ log p (0 or nearly), r_rejected = that - δ: Δ = δ (δ/L under `mean`)
        length = answer if ctx.options["token_reduction"] == "mean" else 1
        delta = math.copysign(max(abs(case.tiny) / _beta(ctx) * length, floor), case.tiny)
        ref[-2:] = 0.0
        ref[-1, n - 1] = delta
    td.set(RLP, torch.where(asst, ref, float("nan")))
    return td


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
    ctx: Context,
    policy: Any,
    td: TensorDictBase,
    pairs: int | None = None,
    smoothing: float = 0.0,
) -> dict[str, Any]:
    """The loss, metrics and per-token gradient the contract asks for, in float64
    (``smoothing``: conservative DPO's ε)."""
    beta = _beta(ctx)
    m = _mask(td).double()
    ref = torch.where(_mask(td), td.get(RLP).double(), 0.0)
    lp, top = peaks64(policy, td)
    n_tok = m.sum(-1)
    scale = (1 / n_tok.clamp_min(1)) if ctx.options["token_reduction"] == "mean" else 1 + 0 * n_tok
    r = ((lp - ref) * m).sum(-1) * scale
    chosen, rejected = r[0::2], r[1::2]
    valid = (n_tok[0::2] > 0).double()
    p = float(valid.sum()) if pairs is None else float(pairs)
    # Δ token by token, the log-probs' difference before the reference's: exact for a tie or a
    # near-tie (two equal answers), whose Σ log p would otherwise swallow a Δ of 1e-30
    lpm, refm = lp * m * scale[:, None], ref * m * scale[:, None]
    delta = ((lpm[0::2] - lpm[1::2]) - (refm[0::2] - refm[1::2])).sum(-1)
    ls = torch.nn.functional.logsigmoid
    pair = -(1 - smoothing) * ls(beta * delta) - smoothing * ls(-beta * delta)
    loss = float((pair * valid).sum() / p)
    slope = (1 - smoothing) * torch.sigmoid(-beta * delta) - smoothing * torch.sigmoid(beta * delta)
    g_pair = -beta * slope * valid / p  # d loss / d r_chosen
    g_row = torch.stack([g_pair, -g_pair], -1).flatten() * scale
    return {
        "loss_preference": loss,
        "accuracy": float(((delta > 0).double() * valid).sum() / p),
        "rewards_chosen_mean": float((chosen * valid).sum() / p),
        "rewards_rejected_mean": float((rejected * valid).sum() / p),
        "plain": float((-ls(beta * delta) * valid).sum() / p),  # -log σ(β·Δ), averaged
        "mirror": float((-ls(-beta * delta) * valid).sum() / p),  # -log σ(-β·Δ), averaged
        "grad": g_row[:, None] * m,
        # 1e-6 absolute, or the float32 rounding of an answer's log-probs and reference
        # log-probs (2e-7 of Σ|log p| + |log p_ref|: a reward of two large sums cancels) and of
        # the logits they are read from (max_v |logit|: a logsumexp of logits of a few hundred)
        "atol": max(
            1e-6,
            2e-7 * float(((lp.abs() + ref.abs() + top) * m).sum(-1).max()) * max(1.0, beta),
        ),
        "delta": delta,
        "pairs": [(float(a), float(b)) for a, b in zip(chosen, rejected, strict=True)],
    }


def _compare(
    got: dict[str, float], want: dict[str, Any], names: tuple[str, ...], what: str
) -> None:
    for name in names:
        if name not in got:
            raise _fail(f"{what}: no {name!r} among the outputs {sorted(got)}")
        if not math.isclose(got[name], want[name], rel_tol=1e-5, abs_tol=want["atol"]):
            raise _fail(f"{what}: {name} is {got[name]:.6g}, expected {want[name]:.6g}")


def _declared(ctx: Context) -> str:
    return f"token_reduction {ctx.options['token_reduction']!r}, beta {_beta(ctx):g}"


def _pairs_shape(td: TensorDictBase, want: dict[str, Any]) -> str:
    m = _mask(td)
    counted = int(m[0::2].any(-1).sum())
    d = want["delta"]
    return (
        f"{m.shape[0] // 2} pairs x {m.shape[1]} columns ({counted} counted; β·Δ from "
        f"{float(d.min()) * _BETA_OF[0]:.4g} to {float(d.max()) * _BETA_OF[0]:.4g})"
    )


_BETA_OF = [1.0]  # the running check's β, for messages


def _maker(ctx: Context, smoothing: float = 0.0) -> Any:
    """The factory on a policy, the declared options and, under capability label_smoothing,
    ``label_smoothing`` by name."""
    kw: dict[str, Any] = dict(ctx.impl.options)
    if "label_smoothing" in ctx.capabilities:
        kw["label_smoothing"] = smoothing
    return lambda policy: ctx.make(policy, **kw)


class PairLosses(Scaled):
    """The suite's policy at each drawn output-head factor and the loss built on it, with
    ``label_smoothing`` passed by name under the capability."""

    def __init__(self, ctx: Context, smoothing: float = 0.0) -> None:
        _BETA_OF[0] = _beta(ctx)
        super().__init__(ctx, _maker(ctx, smoothing))


@requirement("DPO-001")
def scalar_finite_terms(ctx: Context) -> None:
    losses = PairLosses(ctx)

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        _check_scalar_finite_terms(loss(pairs_case(ctx, policy, case)), "loss_preference")

    for_all(ctx, pair_cases(), check, examples=6, boundaries=PAIR_BOUNDARIES)


@requirement("DPO-002")
def gradients_reach_policy(ctx: Context) -> None:
    losses = PairLosses(ctx)

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        term = _loss_term(loss(pairs_case(ctx, policy, case)), "loss_preference")
        gradient_reaches(policy, term, "loss_preference")

    # not at β·Δ far above 0: σ(-β·Δ) underflows and the gradient is 0, as it should be
    calm = st_calm(pair_cases())
    for_all(ctx, calm, check, examples=4, boundaries=(PAIR_BOUNDARIES[0], PAIR_BOUNDARIES[2]))


def untied(strategy: Any) -> Any:
    """``strategy``'s pairs without a tie: the gradient probe tells rows apart by their tokens,
    and a tie's two rows are one."""
    return strategy.map(lambda c: replace(c, tie=False, tiny=0.0, scale=min(c.scale, PEAK)))


_UNTIED = tuple(replace(c, tie=False, scale=min(c.scale, PEAK)) for c in (PAIR_BOUNDARIES[:3]))


def st_calm(strategy: Any) -> Any:
    """``strategy``'s pairs with small reference offsets and an output head scaled by 30 at
    most (every pair's gradient alive and readable)."""
    return strategy.map(
        lambda c: replace(
            c, offset=min(c.offset, 1.0), margin="random", scale=min(c.scale, PEAK), tiny=0.0
        )
    )


@requirement("DPO-003")
def preference_loss_value(ctx: Context) -> None:
    losses = PairLosses(ctx)

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        with torch.no_grad():
            got = _scalars(loss(td))
        want = expected(ctx, policy, td)
        what = f"{_declared(ctx)}, {_pairs_shape(td, want)} (rows 2i chosen, 2i + 1 rejected)"
        if "loss_preference" in got and not math.isclose(
            got["loss_preference"], want["loss_preference"], rel_tol=1e-5, abs_tol=want["atol"]
        ):
            swapped = expected(ctx, policy, td[torch.arange(td.batch_size[0]) ^ 1])
            hint = ""
            if math.isclose(got["loss_preference"], swapped["loss_preference"], rel_tol=1e-5):
                hint = " (it is the loss with chosen and rejected swapped)"
            a, b = want["plain"], want["mirror"]
            eps = (got["loss_preference"] - a) / (b - a) if b != a else 0.0
            if 1e-3 <= abs(eps) < 1 and abs(eps - round(eps, 3)) < 1e-4:
                hint = (
                    f" (it is conservative DPO's label smoothing with ε = {round(eps, 3):g}: "
                    f"-(1 - ε)·log σ(β·Δ) - ε·log σ(-β·Δ); undeclared, ε is 0)"
                )
            raise _fail(
                f"{what}: loss_preference is {got['loss_preference']:.6g}, expected "
                f"{want['loss_preference']:.6g} (mean over pairs of -log sigmoid(beta (r_chosen "
                f"- r_rejected)), in float64){hint}"
            )
        _compare(got, want, ("loss_preference",), what)

    for_all(ctx, pair_cases(), check, examples=10, boundaries=PAIR_BOUNDARIES)

    def live(policy: Any, loss: Any, td: TensorDictBase) -> dict[str, tuple[float, float, float]]:
        with torch.no_grad():
            got = _scalars(loss(td))
        want = expected(ctx, policy, td)
        names = ("loss_preference", *(m for m in _METRICS if m in got))
        return {n: (got.get(n, math.nan), want[n], want["atol"]) for n in names}

    check_live(
        ctx,
        _maker(ctx),
        lambda policy, case: pairs_case(ctx, policy, case),
        live,
        "loss_preference",
        what=_declared(ctx),
        formula="the mean over pairs of -log σ(β·Δ) and the metrics",
        in_place=(RLP,),
        recipes=pair_cases(top=PEAK),
        start=Pairs(2, 10, 9),
        scales=SCALES,
    )


@requirement("DPO-004")
def gradient_through_both_answers(ctx: Context) -> None:
    losses = PairLosses(ctx)

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        got = _term_logp_grads(policy, loss, td, "loss_preference")
        want_all = expected(ctx, policy, td)
        what = f"{_declared(ctx)}, {_pairs_shape(td, want_all)}"
        _expect_logp_grads(got, want_all["grad"].float(), what)

    for_all(ctx, untied(pair_cases()), check, examples=5, boundaries=_UNTIED)


def _expect_logp_grads(got: torch.Tensor, want: torch.Tensor, what: str, why: str = "") -> None:
    """FAIL naming the token whose d loss_preference / d logp is furthest from ``want``."""
    if not torch.allclose(got, want, atol=1e-6, rtol=1e-4):
        i, t = divmod(int((got - want).abs().argmax()), want.shape[1])
        row = "chosen" if i % 2 == 0 else "rejected"
        raise _fail(
            f"{what}: d loss_preference / d logp at row {i} (pair {i // 2}'s {row} answer), "
            f"position {t} is {float(got[i, t]):.6g}, expected {float(want[i, t]):.6g}{why}"
        )


@requirement("DPO-005")
def reward_metrics(ctx: Context) -> None:
    losses = PairLosses(ctx)

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        with torch.no_grad():
            got = _scalars(loss(td))
        want = expected(ctx, policy, td)
        tie = ""
        if case.tie and case.pairs > (2 if case.tiny else 1):
            tie = ", a pair of two equal answers (a tie, no win)"
        if case.tiny:
            near = float(want["delta"][-1]) * _beta(ctx)
            tie += (
                f", its last pair a near-tie of two equal answers whose reference log-probs "
                f"differ (β·Δ = {near:.3g}: {'a win' if near > 0 else 'no win'}, though "
                f"σ(β·Δ) rounds to 1/2 in float32 below about 6e-8)"
            )
        _compare(got, want, _METRICS, f"{_declared(ctx)}, {_pairs_shape(td, want)}{tie}")

    tied = pair_cases(near_ties=True).map(lambda c: replace(c, tie=c.pairs > 1))
    edge = (
        PAIR_BOUNDARIES[2],
        replace(PAIR_BOUNDARIES[3], tie=True),
        PAIR_BOUNDARIES[1],
        *NEAR_TIES,
    )
    for_all(ctx, tied, check, examples=6, boundaries=edge)


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
    from hypothesis import strategies as st

    losses = PairLosses(ctx)
    policy0, loss0 = losses(Pairs(1, 2))
    td = _sparse_pairs(ctx, policy0, 6, seed=9)
    with torch.no_grad():
        got = _scalars(loss0(td))
    want = expected(ctx, policy0, td)
    _compare(
        got,
        want,
        ("loss_preference", *_METRICS),
        f"{_declared(ctx)}, 6 pairs: pair 1's and pair 5's rejected rows, both rows of pair 2 "
        f"and pair 4's chosen row without assistant tokens (4 counted pairs)",
    )

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        with torch.no_grad():
            got = _scalars(loss(td))
        want = expected(ctx, policy, td)
        which = ", ".join(
            f"pair {i}: {e or 'both rows answered'}" for i, e in enumerate(case.empty)
        )
        what = f"{_declared(ctx)}, {_pairs_shape(td, want)}; empty rows by pair: {which}"
        _compare(got, want, ("loss_preference", *_METRICS), what)

    sparse = pair_cases().filter(lambda c: any(c.empty[1:]) or c.empty[0] == "rejected")
    for_all(ctx, sparse | st.just(PAIR_BOUNDARIES[3]), check, examples=5,
            boundaries=(PAIR_BOUNDARIES[3],))  # fmt: skip


def _dpo_counts(td: TensorDictBase) -> Any:
    from posttrain.contracts.loss import GlobalCounts

    m = _mask(td)
    return GlobalCounts(int(m.sum()), 2 * int(m[0::2].any(-1).sum()))


@requirement("DPO-007")
def global_counts_normalize(ctx: Context) -> None:
    from hypothesis import strategies as st

    from posttrain.contracts.loss import GlobalCounts

    losses = PairLosses(ctx)

    def check(drawn: tuple[Pairs, float, float]) -> None:
        case, more_tokens, more_pairs = drawn
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        own = _dpo_counts(td)
        counts = GlobalCounts(
            round(own.tokens * more_tokens), 2 * round(own.sequences // 2 * more_pairs)
        )
        with torch.no_grad():
            got = float(_loss_term(_call_counted(loss, td, counts), "loss_preference"))
        want = expected(ctx, policy, td, pairs=counts.sequences // 2)
        if not math.isclose(got, want["loss_preference"], rel_tol=1e-5, abs_tol=want["atol"]):
            raise _fail(
                f"{_declared(ctx)}, {_pairs_shape(td, want)}, called with counts={counts}: "
                f"loss_preference is {got:.6g}, expected {want['loss_preference']:.6g} (the "
                f"mean over {counts.sequences // 2} pairs)"
            )

    factor = st.sampled_from((1.0, 1000.0)) | st.floats(1.0, 1000.0)
    edge = [
        (PAIR_BOUNDARIES[3], 1.0, 1.0),
        (PAIR_BOUNDARIES[3], 3.4, 3.0),
        (PAIR_BOUNDARIES[0], 1000.0, 1000.0),
    ]
    for_all(ctx, st.tuples(pair_cases(), factor, factor), check, examples=4, boundaries=edge)


_PAIR_SPLITS = (((0,), (1, 2, 3)), ((0, 1, 3), (2,)), ((3, 1), (2, 0)))


def _rows(split: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r for p in part for r in (2 * p, 2 * p + 1)) for part in split)


@requirement("DPO-008")
def micro_batches_add_up(ctx: Context) -> None:
    losses = PairLosses(ctx)

    def check(drawn: tuple[Pairs, tuple[tuple[int, ...], ...]]) -> None:
        case, split = drawn
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        want = expected(ctx, policy, td)
        where = f"{_declared(ctx)}, {_pairs_shape(td, want)} as rows"
        splits = _PAIR_SPLITS if split == () else (split,)  # () marks the sparse batch's three
        rows = tuple(_rows(s) for s in splits)
        check_parts_add_up(policy, loss, td, _dpo_counts(td), rows, where, _METRICS)

    sparse = Pairs(4, 10, 17, ("", "rejected", "both", ""))
    edge = [(sparse, ()), (PAIR_BOUNDARIES[0], ((0,),))]
    calm = st_calm(pair_cases())
    for_all(ctx, with_split(calm, lambda c: c.pairs), check, examples=3, boundaries=edge)


_NOT_BOOL = (
    torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
)  # fmt: skip


@requirement("DPO-009")
def bad_layout_rejected(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td0 = pairs_batch(ctx, policy)
    refused = [(td0.clone().exclude(RLP), RLP, "the reference log-probs missing")]
    for key, name in ((ASST, "assistant"), (ATT, "attention")):
        for dtype in _NOT_BOOL:
            what = f"a {str(dtype).removeprefix('torch.')} {name} mask (0/1)"
            refused.append((_with(td0.clone(), key, td0.get(key).to(dtype)), key, what))
    _refuse_each(loss, refused)
    for rows in (2 * PAIRS - 1, 3, 1):
        try:
            with torch.no_grad():
                loss(td0[:rows])
        except Exception:
            continue
        raise _fail(f"a batch of {rows} rows (an odd number: a half pair) was accepted")


def _declared_smoothing(ctx: Context) -> float:
    eps = ctx.impl.extras.get("label_smoothing")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 0.5:
        raise _fail(
            "capability label_smoothing is declared but Implementation.extras['label_smoothing'] "
            f"(a number in (0, 1/2)) is {eps!r}"
        )
    return float(eps)


@requirement("DPO-010")
def label_smoothing_as_declared(ctx: Context) -> None:
    eps = _declared_smoothing(ctx)
    losses = PairLosses(ctx, eps)

    def check(case: Pairs) -> None:
        policy, loss = losses(case)
        td = pairs_case(ctx, policy, case)
        want = expected(ctx, policy, td, smoothing=eps)
        what = f"label smoothing ε = {eps:g}, {_declared(ctx)}, {_pairs_shape(td, want)}"
        with torch.no_grad():
            got = _scalars(loss(td))
        value = got.get("loss_preference")
        if value is not None and not math.isclose(
            value, want["loss_preference"], rel_tol=1e-5, abs_tol=want["atol"]
        ):
            hint = ""
            a, b = want["plain"], want["mirror"]
            for other, why in (
                (a, "the plain sigmoid loss: label_smoothing=ε did not reach it"),
                ((1 - eps) * a - eps * b, "conservative DPO with the ε term's sign flipped"),
                (eps * a + (1 - eps) * b, "conservative DPO with ε and 1 - ε swapped"),
            ):
                if math.isclose(value, other, rel_tol=1e-5):
                    hint = f" (it is {why})"
                    break
            raise _fail(
                f"{what}: loss_preference is {value:.6g}, expected "
                f"{want['loss_preference']:.6g} (mean over pairs of -(1 - ε)·log σ(β·Δ) - "
                f"ε·log σ(-β·Δ), in float64){hint}"
            )
        _compare(got, want, ("loss_preference",), what)
        grads = _term_logp_grads(policy, loss, td, "loss_preference")
        _expect_logp_grads(
            grads, want["grad"].float(), what, " (∓β·((1 - ε)·σ(-β·Δ) - ε·σ(β·Δ))·c/P)"
        )

    for_all(ctx, untied(pair_cases()), check, examples=5, boundaries=_UNTIED)
