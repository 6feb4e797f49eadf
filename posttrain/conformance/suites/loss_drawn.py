"""The loss suite's drawn inputs (since loss 1.8): batches of any shape and mask, and ratios
on both sides of the clip bounds at several distances, instead of one example of each.

LOSS-001, LOSS-004 and LOSS-006 run on :data:`~loss_kit.LAYOUTS` and then on Hypothesis
draws of :func:`~loss_kit.layout_strategy` (1 to 8 rows of width 2 to 12, rows without an
assistant token anywhere, holes in the answer, advantages 0, tiny, large, of both signs);
LOSS-014 on the fixed probe ratios and then on drawn ratio sets and advantage magnitudes.
Every draw is deterministic under ``--conformance-seed`` and grows with
``--conformance-depth``; a failure names the shrunk input.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.explore import for_all
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_kit import (
    ADV,
    ASST,
    ATT,
    LAYOUTS,
    RLP,
    SLP,
    TOK,
    Layout,
    V,
    check_same,
    check_scalar_finite_terms,
    clipped_terms,
    expected_weights,
    layout_batch,
    layout_strategy,
    logp_grads,
    own_log_probs,
    scalars,
    token_advantages,
    tol_factor,
)
from posttrain.testing import llm_batch

FINITE_EXAMPLES, INERT_EXAMPLES, ORDER_EXAMPLES, CLIP_EXAMPLES = 8, 3, 5, 4
"""Draws at depth 1 (times ``--conformance-depth``), after the explicit boundaries."""


def shown(layout: Layout) -> str:
    """A layout in words: ``width 6, rows (length, answer from, hole, advantage) ...``."""
    width, rows = layout
    return f"a batch of {len(rows)} rows of width {width}, rows (length, answer from, hole, advantage) {list(rows)}"


def seeded(ctx: Context, loss: Any, td: TensorDictBase) -> Any:
    """``loss(td)`` with torch's global generator seeded by the run's seed: two calls compared
    draw the same random numbers (verl's Clip-Cov zeroes a randomly drawn token's term), so
    a difference is the inputs' alone and the verdict the seed's."""
    torch.manual_seed(ctx.seed)
    return loss(td)


def finite_on_layouts(ctx: Context, policy: Any, loss: Any) -> None:
    """LOSS-001 on every drawn layout."""

    def check(layout: Layout) -> None:
        with torch.no_grad():
            out = loss(layout_batch(policy, ctx, layout))
        try:
            check_scalar_finite_terms(out, "loss_objective")
        except ConformanceError as e:
            raise _fail(f"{shown(layout)}: {e}") from None

    for_all(ctx, layout_strategy(), check, examples=FINITE_EXAMPLES, boundaries=list(LAYOUTS))


def garbage(td: TensorDictBase, value: float) -> TensorDictBase:
    """``td`` with ``value`` at every log-prob and advantage outside the assistant mask (holes
    included, and where ``value`` is finite the [B] advantage of a row without an assistant
    token) and other tokens at padding positions; prompt and hole tokens stay (they
    condition the answer)."""
    outside = ~td.get(ASST)
    td.set(TOK, torch.where(~td.get(ATT), (td.get(TOK) + 17) % V, td.get(TOK)))
    for key in (SLP, RLP):
        td.set(key, torch.where(outside, torch.full_like(td.get(key), value), td.get(key)))
    adv = td.get(ADV)
    # A [B] advantage of a row without an assistant token gets finite values only: whether
    # such a row's NaN advantage may reach a mask-multiplied sum, the spec does not say
    # (TorchRL's sequence means let it through as NaN x 0).
    off = outside if adv.ndim == 2 else ~td.get(ASST)[:, 1:].any(-1) & math.isfinite(value)
    td.set(ADV, torch.where(off, torch.full_like(adv, value), adv), inplace=False)
    return td


def inert_on_layouts(ctx: Context, policy: Any, loss: Any) -> None:
    """LOSS-004 on every drawn layout, with a [B, T] advantage under per_token_advantage."""
    per_token = "per_token_advantage" in ctx.capabilities

    def check(layout: Layout) -> None:
        td = layout_batch(policy, ctx, layout)
        if per_token:
            a = token_advantages(td, ctx.seed) * td.get(ADV)[:, None].abs().clamp_min(1e-3)
            td.set(ADV, a, inplace=False)
        with torch.no_grad():
            base = scalars(seeded(ctx, loss, td.clone()))
            for value in (123.0, float("nan"), -1e30):
                check_same(
                    base,
                    scalars(seeded(ctx, loss, garbage(td.clone(), value))),
                    f"{shown(layout)}{', a [B, T] advantage' if per_token else ''}: "
                    f"log-probs and advantages {value} outside the assistant mask (holes "
                    "included), other tokens at padding positions",
                    1e-5 * tol_factor(ctx),
                )

    for_all(ctx, layout_strategy(), check, examples=INERT_EXAMPLES, boundaries=list(LAYOUTS))


def order_on_layouts(ctx: Context, policy: Any, loss: Any) -> None:
    """LOSS-006 on every drawn layout and row order."""
    from hypothesis import strategies as st

    def check(case: tuple[Layout, tuple[int, ...]]) -> None:
        layout, perm = case
        td = layout_batch(policy, ctx, layout)
        with torch.no_grad():
            base = scalars(seeded(ctx, loss, td.clone()))
            other = scalars(seeded(ctx, loss, td[list(perm)].clone()))
        check_same(
            base, other, f"{shown(layout)} in the order {list(perm)}", 1e-5 * tol_factor(ctx)
        )

    cases = layout_strategy().flatmap(
        lambda lay: st.tuples(st.just(lay), st.permutations(range(len(lay[1]))).map(tuple))
    )
    boundaries = [(LAYOUTS[1], (2, 0, 1)), (LAYOUTS[2], (1, 2, 0))]  # cycles: not self-inverse
    for_all(ctx, cases, check, examples=ORDER_EXAMPLES, boundaries=boundaries)


ClipCase = tuple[tuple[float, ...], tuple[float, float, float, float]]
"""LOSS-014's input: the ratios every row's assistant tokens cycle through, 4 advantages."""


def clip_cases(bounds: list[float], margin: float) -> Any:
    """Ratio sets (2 to 8 ratios: within 5% of a bound, none nearer than ``margin``, or
    anywhere in [0.05, 4]) and advantages of magnitude 0, 1e-3, 0.5, 1, 50 or any in
    [1e-3, 20], signs +, -, +, -."""
    from hypothesis import strategies as st

    def near(b: float) -> Any:
        d = st.floats(margin * 1.01, 0.05) | st.floats(-0.05, -margin * 1.01)
        return d.map(lambda x: b * (1 + x))

    def away(r: float) -> bool:
        return r > 0 and all(abs(r / b - 1) > margin for b in bounds)

    ratio = (st.sampled_from(bounds).flatmap(near) | st.floats(0.05, 4.0)).filter(away)
    mag = st.sampled_from([0.0, 1e-3, 0.5, 1.0, 50.0]) | st.floats(1e-3, 20.0)
    return st.tuples(
        st.lists(ratio, min_size=2, max_size=8).map(tuple),
        st.tuples(mag, mag, mag, mag).map(lambda m: (m[0], -m[1], m[2], -m[3])),
    )


def clip_batch(policy: Any, ctx: Context, case: ClipCase) -> tuple[TensorDictBase, torch.Tensor]:
    """4 rows of 3 prompt tokens and answers of n, n, n - 1 ... tokens, n the ratios: every
    row covers every ratio (shifted by row), rows differ in length; with the ratios as set."""
    ratios, advs = case
    n, prompt, b = len(ratios), 3, 4
    t = prompt + n + 2
    td = llm_batch(b, t, vocab_size=V, seed=ctx.seed * 7919 + 14)
    pos = torch.arange(t).expand(b, t)
    att = pos < torch.tensor([t, t - 1, t - 2, t])[:, None]
    asst = att & (pos >= prompt)
    td.set(ATT, att)
    td.set(ASST, asst)
    r = torch.ones(b, t, dtype=torch.float64)
    for i in range(b):
        for j, p in enumerate(asst[i].nonzero().flatten().tolist()):
            r[i, p] = ratios[(j + i) % n]
    td.set(ADV, torch.tensor(advs, dtype=torch.float32))
    logp = own_log_probs(policy, td)
    td.set(SLP, torch.where(asst, logp - r.log().float(), float("nan")))
    td.set(RLP, torch.where(asst, logp, float("nan")))
    return td, logp


def check_clip_case(
    ctx: Context, policy: Any, loss: Any, case: ClipCase, clip: tuple[float, float, float | None]
) -> None:
    """LOSS-014 on one case: value and per-token gradient against float64."""
    lo, hi, dual = clip
    td, logp = clip_batch(policy, ctx, case)
    asst, slp, adv = td.get(ASST), td.get(SLP), td.get(ADV)
    t = asst.shape[1]
    # The expected figures, in float64 from the ratios the loss will see (the float32 behaviour
    # log-probs against the same forward pass), away from every bound.
    with torch.no_grad():
        ratio = torch.where(asst, (logp.double() - slp.double()).exp(), 1.0)
        a = adv.double()[:, None].expand_as(ratio)
        per_token, active = clipped_terms(a, ratio, lo, hi, dual)
        w = expected_weights(ctx, asst).double()
        want_value = float((per_token * w).where(asst, 0.0).sum())
        want = torch.where(asst & active, -a * ratio * w, 0.0)
    tol = tol_factor(ctx)
    value, got = logp_grads(policy, loss, td, tol)
    bounds = f"clip bounds [{lo:.4g}, {hi:.4g}]{'' if dual is None else f', dual clip {dual:.4g}'}"
    bad = ~torch.isclose(got.double(), want, atol=1e-6 * tol, rtol=1e-4 * tol)
    if bool(bad.any()):
        i, p = divmod(int(((got.double() - want).abs() * bad).argmax()), t)
        unclipped_side = bool(active[i, p])
        term = "the unclipped term is" if unclipped_side else "a clipped term is"
        raise _fail(
            f"{bounds}: at ratio {float(ratio[i, p]):.6g} with advantage {float(adv[i]):+.3g} "
            f"(row {i}, position {p}; {term} active), d loss_objective / d logp is "
            f"{float(got[i, p]):.6g}, expected {float(want[i, p]):.6g}"
            f"{' (-A x r x weight)' if unclipped_side else ''}; "
            f"{int(bad.sum())} of {int(asst.sum())} assistant tokens differ"
        )
    if not math.isclose(float(value), want_value, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"{bounds}: loss_objective is {float(value):.6g} at ratios "
            f"{', '.join(f'{x:.4g}' for x in case[0])} with advantages "
            f"{', '.join(f'{x:+.3g}' for x in case[1])}, expected {want_value:.6g} (the "
            "weighted sum of max(-A r, -A clip(r)))"
        )


def clip_everywhere(
    ctx: Context, policy: Any, loss: Any, first: ClipCase, clip: tuple[float, float, float | None]
) -> None:
    """LOSS-014 on ``first`` (the fixed probes), on ratios 0.5% either side of every bound with
    advantages 50, -1e-3, 0, -50, then on drawn ratio sets and advantages: ratios no nearer a
    bound than 0.2% (1% in half precision, whose log-probs are coarser)."""
    lo, hi, dual = clip
    bounds = [x for x in (lo, hi, dual) if x is not None and x > 0]
    margin = 0.002 if tol_factor(ctx) == 1.0 else 0.01
    # Then every bound approached from both sides at 0.5% (twice the margin in half
    # precision), advantages 50, -1e-3, 0 and -50.
    d = max(0.005, 2 * margin)
    near: ClipCase = (
        tuple(sorted(b * (1 + s) for b in bounds for s in (-d, d))),
        (50.0, -1e-3, 0.0, -50.0),
    )
    for_all(
        ctx,
        clip_cases(bounds, margin),
        lambda case: check_clip_case(ctx, policy, loss, case, clip),
        examples=CLIP_EXAMPLES,
        boundaries=[first, near],
    )
