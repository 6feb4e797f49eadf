"""The loss suite's checks of declared options (LOSS-019 to LOSS-024, since loss 1.4): the KL
estimator and its gradient, the ratio and its clip, and the ``kl_approx`` diagnostic's estimate.
Each is checked where the implementation declares the option (``suites/loss.py`` imports this
module, so its checks register with the rest of the loss suite).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_kit import (
    ADV,
    ASST,
    RLP,
    SLP,
    TOK,
    clip_declaration,
    clipped_terms,
    deltas,
    expected_weights,
    logp_grads,
    loss_terms,
    make_batch,
    own_log_probs,
    ratio_option,
    scalars,
    setup,
    token_advantages,
    tol_factor,
)

_KL: dict[str, tuple[Callable[[float], float], Callable[[float], float]]] = {
    "k1": (lambda x: -x, lambda x: -1.0),
    "k2": (lambda x: x * x / 2, lambda x: x),
    "k3": (lambda x: math.exp(x) - 1 - x, lambda x: math.exp(x) - 1),
}


"""Each KL estimator k(log r) and its derivative k'(log r), log r = log pi_ref - log pi."""


def _declared(ctx: Context, option: str) -> str:
    """The option as declared, or its default where undeclared: an option chooses which
    variant is checked, never whether (since loss 1.8)."""
    return str(ctx.options[option])


def _kl_batch(
    policy: Any, ctx: Context, base: float, profile: tuple[float, ...] | None = None
) -> tuple[TensorDictBase, torch.Tensor]:
    """Off policy (sample log-probs = own - ε_t, inside the clip bounds), reference log-probs
    the policy's own + δ_t on assistant tokens: a KL term must read log pi_ref - log pi
    (never the sample log-probs) per token, without importance weights. δ_t is
    :func:`deltas`, or with ``profile`` the sign of ``base`` times ``profile`` cycled along
    each row."""
    td, eps = _ratio_batch(policy, ctx)
    if profile is None:
        delta = deltas(td, base)
    else:
        t = td.get(TOK).shape[1]
        cycle = torch.tensor(profile)[torch.arange(t) % len(profile)]
        delta = math.copysign(1.0, base) * cycle.expand(td.get(TOK).shape)
    own = td.get(SLP) + eps.to(td.get(SLP).dtype)  # NaN off assistant tokens
    td.set(RLP, own + delta.to(own.dtype))
    return td, delta.double()


def _k_sum(est: str, w: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor) -> float:
    k = _KL[est][0]
    d = delta[mask].tolist()
    return float(sum(float(x) * k(y) for x, y in zip(w[mask].tolist(), d, strict=True)))


_KL_PROFILES = ((0.9, 0.1), (0.05, 0.6, 1.5, 2.8, 4.0))
"""The δ_t that LOSS-019 tries first, cycled along each row: the suite's small pair, then a
spread from 0.05 to 4 nats (a policy that moved far from its reference: k3(4) is about 50)."""


@requirement("LOSS-019")
def declared_kl_estimator(ctx: Context) -> None:
    from hypothesis import strategies as st

    from posttrain.conformance.explore import for_all

    est = _declared(ctx, "kl_estimator")
    policy, loss = setup(ctx)
    size = st.floats(0.02, 4.5, allow_nan=False, allow_infinity=False)
    for_all(
        ctx,
        st.lists(size, min_size=2, max_size=6).map(tuple),
        lambda profile: _check_kl_estimator(ctx, est, policy, loss, profile),
        examples=4,
        boundaries=list(_KL_PROFILES),
    )


_LOGP_NOISE = 4e-6
"""How far a float32 log-prob computed by the loss may be from the suite's own (another order
of the same sums): log r_t differs by that much from the δ_t the suite set."""


def _kl_rounding(est: str, profile: tuple[float, ...]) -> float:
    """The relative error float32 allows in Σ k(δ_t) / Σ k(-δ_t) over the profile: each log r_t
    off by :data:`_LOGP_NOISE`, and k evaluated in float32 (k3 = e^x - 1 - x cancels to a few
    digits near 0). Negligible from δ of a few tenths; about 9e-3 with every δ at 0.0215, below
    what another estimator changes there (k2 against k3 moves the ratio by 2δ/3 = 1.4e-2).

    Example:
        >>> _kl_rounding("k3", (0.0215,)) > 1e-3 > _kl_rounding("k3", (0.5, 1.0))
        True
    """
    k, dk = _KL[est]
    eps = float(torch.finfo(torch.float32).eps)
    rel = 0.0
    for s in (1.0, -1.0):
        err = sum(_LOGP_NOISE * abs(dk(s * d)) + 4 * eps * (1 + math.exp(d)) for d in profile)
        rel += err / sum(abs(k(s * d)) for d in profile)
    return rel


def _check_kl_estimator(
    ctx: Context, est: str, policy: Any, loss: Any, profile: tuple[float, ...]
) -> None:
    k = _KL[est][0]
    vals, want_k = {}, {}
    for base in (1.0, -1.0):
        td, delta = _kl_batch(policy, ctx, base, profile)
        with torch.no_grad():
            terms = loss_terms(loss(td))
        if "loss_kl_to_ref" not in terms:
            raise _fail(f"kl_estimator {est!r} declared but no 'loss_kl_to_ref' in {sorted(terms)}")
        vals[base] = float(terms["loss_kl_to_ref"])
        mask = td.get(ASST)
        want_k[base] = _k_sum(est, expected_weights(ctx, mask).double(), delta, mask)
    want = want_k[1.0] / want_k[-1.0]
    got = vals[1.0] / vals[-1.0] if vals[-1.0] != 0 else math.inf
    rel = 1e-4 * tol_factor(ctx) + _kl_rounding(est, profile)
    if math.copysign(1.0, vals[1.0]) != math.copysign(1.0, k(0.5)) or not math.isclose(
        got, want, rel_tol=rel
    ):
        shown = ", ".join(f"{x:.3g}" for x in profile)
        raise _fail(
            f"kl_estimator {est!r}: off policy, with reference log-probs the policy's own + "
            f"δ_t and - δ_t (δ_t cycling {shown} along each row's assistant tokens), "
            f"loss_kl_to_ref is {vals[1.0]:.6g} and {vals[-1.0]:.6g} (ratio {got:.6g}); "
            f"expected the sign of k(0.5) = {k(0.5):.6g} and the ratio "
            f"Σ w·k(δ_t) / Σ w·k(-δ_t) = {want:.6g} (per token, of log pi_ref - log pi)"
        )


@requirement("LOSS-020")
def declared_kl_gradient(ctx: Context) -> None:
    form = _declared(ctx, "kl_gradient")
    est = str(ctx.options.get("kl_estimator", "k3"))
    policy, loss = setup(ctx)
    td, delta = _kl_batch(policy, ctx, 0.5)
    value, got = logp_grads(policy, loss, td, tol_factor(ctx), term="loss_kl_to_ref")
    k, dk = _KL[est]
    mask = td.get(ASST)
    w = expected_weights(ctx, mask).double()
    beta = float(value) / _k_sum(est, w, delta, mask)
    kd = delta.clone().apply_(k)
    dkd = delta.clone().apply_(dk)
    per = -dkd + (kd if form == "score" else 0.0)
    want = (w * beta * per * mask).float()
    if not torch.allclose(got, want, atol=1e-6 * tol_factor(ctx), rtol=1e-4 * tol_factor(ctx)):
        i, t = divmod(int((got - want).abs().argmax()), got.shape[1])
        other = -dkd + (0.0 if form == "score" else kd)
        raise _fail(
            f"kl_gradient {form!r} ({est}): off policy, with reference log-probs the policy's "
            f"own + δ_t on assistant tokens (δ_t alternating 0.9, 0.1), d loss_kl_to_ref / d "
            f"logp at row {i}, position {t} (δ = {float(delta[i, t]):.3g}) is "
            f"{float(got[i, t]):.6g}, expected {float(want[i, t]):.6g} "
            f"(the other form gives {float(w[i, t] * beta * other[i, t]):.6g})"
        )


def _ratio_batch(policy: Any, ctx: Context) -> tuple[TensorDictBase, torch.Tensor]:
    """Off policy inside the clip bounds: sample log-probs = own - ε_t, |ε_t| <= 0.1."""
    td = make_batch(policy, ctx)
    lo, hi = (0.2, 0.2)
    if "clip" in ctx.capabilities:
        lo, hi, _ = clip_declaration(ctx)
    below = -0.5 * math.log1p(-lo) if 0 < lo < 1 else (0.1 if lo == 1 else 0.0)
    cap = min(0.1, 0.5 * math.log1p(hi) if hi > 0 else 0.0, below)
    g = torch.Generator().manual_seed(ctx.seed + 11)
    eps = (torch.rand(td.get(TOK).shape, generator=g) * 2 - 1) * cap
    mask = td.get(ASST)
    eps = torch.where(mask, eps, 0.0)
    td.set(SLP, td.get(SLP) - eps)
    return td, eps.double()


@requirement("LOSS-021")
def declared_ratio(ctx: Context) -> None:
    kind = _declared(ctx, "ratio")
    policy, loss = setup(ctx)
    td, eps = _ratio_batch(policy, ctx)
    advantages = [("a [B] advantage", td.get(ADV))]
    if "per_token_advantage" in ctx.capabilities:
        # Varying along T: a sequence ratio's gradient mixes the row's advantages
        # (Σ_t' w_t' A_t' / L per token), which GSPO-token's sg(ρ)·exp(logp_t - sg(logp_t))
        # form does not; a [B] advantage cannot tell the two apart.
        advantages.append(("a [B, T] advantage", token_advantages(td, ctx.seed)))
    for what, adv in advantages:
        batch = td.clone()
        batch.set(ADV, adv)
        _check_ratio(ctx, kind, policy, loss, batch, eps, what)


def _check_ratio(
    ctx: Context,
    kind: str,
    policy: Any,
    loss: Any,
    td: TensorDictBase,
    eps: torch.Tensor,
    what: str,
) -> None:
    value, got = logp_grads(policy, loss, td, tol_factor(ctx))
    mask = td.get(ASST)
    m = mask.double()
    w = expected_weights(ctx, mask).double()
    adv = td.get(ADV).double()
    a = adv[:, None] if adv.ndim == 1 else adv
    logp = torch.where(mask, own_log_probs(policy, td).double(), 0.0)
    if kind == "token":
        rho = eps.exp()
        grad = -a * rho * w
    elif kind in ("sequence", "gspo_token"):
        n = m.sum(-1, keepdim=True).clamp_min(1)
        r = ((eps * m).sum(-1, keepdim=True) / n).exp()
        rho = r.expand_as(m)
        if kind == "sequence":
            grad = -r * (w * a * m).sum(-1, keepdim=True) / n * m
        else:  # sg(ρ)·exp(logp_t - sg(logp_t)): each token's own advantage (verl's gspo)
            grad = -a * rho * w
    elif kind == "cispo":  # -A·sg(r)·log pi inside the clip bounds
        rho, grad = eps.exp() * logp, -a * eps.exp() * w
    elif kind == "on_policy":
        rho, grad = torch.ones_like(m), -a * w
    else:
        rho, grad = logp, -a * w
    want_value = float((w * -a * rho * m).sum())
    tol = tol_factor(ctx)
    if not math.isclose(float(value), want_value, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"ratio {kind!r}: off policy (sample log-probs = own - ε, |ε| <= "
            f"{float(eps.abs().max()):.3g}) with {what}, loss_objective is {float(value):.6g}, "
            f"expected sum of w x (-A x ρ) = {want_value:.6g}"
        )
    grad = grad.float()
    if not torch.allclose(got, grad, atol=1e-6 * tol, rtol=1e-4 * tol):
        i, t = divmod(int((got - grad).abs().argmax()), got.shape[1])
        raise _fail(
            f"ratio {kind!r}: off policy with {what}, d loss_objective / d logp at row {i}, "
            f"position {t} is {float(got[i, t]):.6g}, expected {float(grad[i, t]):.6g}"
        )


@requirement("LOSS-022")
def sequence_ratio_clipped(ctx: Context) -> None:
    if ratio_option(ctx) not in ("sequence", "gspo_token"):
        raise NotApplicable(
            f"option ratio {ratio_option(ctx)!r}: LOSS-014 and LOSS-023 check a token ratio's clip"
        )
    eps_low, eps_high, dual = clip_declaration(ctx)
    lo, hi = 1 - eps_low, 1 + eps_high
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx, seed=22)
    asst = td.get(ASST)
    b, t = asst.shape
    # Row i's ratio: above 1 + ε_high or below 1 - ε_low, with A > 0 and A < 0 in turn (a
    # clipped term active in rows 0 and 1, the unclipped one in rows 2 and 3); log r
    # alternates ±0.05 around the row's mean, so clipping each token's ratio reads otherwise.
    # Without a lower bound (ε_low = 1), rows 1 and 3 hold 0.3, which no clip may touch.
    below = lo * 0.75 if lo > 0 else 0.3
    targets = [hi * 1.25, below, hi * 1.25, below]
    signs = [1.0, -1.0, -1.0, 1.0]
    rho = torch.tensor([targets[i % 4] for i in range(b)], dtype=torch.float64)
    a = torch.tensor([signs[i % 4] for i in range(b)], dtype=torch.float64)
    a = a * td.get(ADV).double().abs()
    wiggle = torch.where(torch.arange(t) % 2 == 0, 0.05, -0.05).expand(b, t).double()
    logp = own_log_probs(policy, td)
    slp = torch.where(asst, logp - (rho.log()[:, None] + wiggle).float(), float("nan"))
    td.set(SLP, slp)
    td.set(ADV, a.float())
    with torch.no_grad():
        m = asst.double()
        n = m.sum(-1).clamp_min(1)
        logr = torch.where(asst, logp.double() - slp.double(), 0.0)
        r = (logr.sum(-1) / n).exp()  # the rows' sequence ratios as the loss will see them
        a = td.get(ADV).double()
        per_row, active = clipped_terms(a, r, lo, hi, dual)
        w = expected_weights(ctx, asst).double()
        want_value = float((per_row[:, None] * w * m).sum())
        row_w = (w * m).sum(-1)
        want = torch.where(active, -a * r * row_w / n, 0.0)[:, None] * m
    tol = tol_factor(ctx)
    value, got = logp_grads(policy, loss, td, tol)
    bounds = f"clip bounds [{lo:.4g}, {hi:.4g}]{'' if dual is None else f', dual clip {dual:.4g}'}"
    what = f"ratio {ratio_option(ctx)!r}, {bounds}"

    def grad_fail(i: int, p: int) -> str:
        side = "unclipped" if bool(active[i]) else "clipped"
        return (
            f"{what}: at sequence ratio {float(r[i]):.4g} with advantage {float(a[i]):+.3g} "
            f"(row {i}, the {side} term active), d loss_objective / d logp at position {p} is "
            f"{float(got[i, p]):.6g}, expected {float(want[i, p]):.6g}"
        )

    _expect(
        (value, want_value, got, want, tol),
        f"{what}: with sequence ratios {', '.join(f'{x:.3g}' for x in r[:4].tolist())} and "
        f"advantages of both signs, loss_objective is {float(value):.6g}, expected "
        f"{want_value:.6g} (Σ w x max(-A ρ, -A clip(ρ)), ρ the row's sequence ratio; unclipped "
        f"it would be {float((-a[:, None] * r[:, None] * w * m).sum()):.6g})",
        grad_fail,
    )


def _expect(
    measured: tuple[Any, float, torch.Tensor, torch.Tensor, float],
    value_fail: str,
    grad_fail: Callable[[int, int], str],
) -> None:
    """FAIL when loss_objective or d loss_objective / d logp differs from its float64
    expectation: ``measured`` is (value, expected value, gradients, expected gradients,
    tolerance factor); the gradient's message names the token furthest off."""
    value, want_value, got, want, tol = measured
    if not math.isclose(float(value), want_value, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(value_fail)
    bad = ~torch.isclose(got.double(), want, atol=1e-6 * tol, rtol=1e-4 * tol)
    if bool(bad.any()):
        i, p = divmod(int(((got.double() - want).abs() * bad).argmax()), want.shape[1])
        raise _fail(grad_fail(i, p))


@requirement("LOSS-023")
def cispo_weight_clipped(ctx: Context) -> None:
    if ratio_option(ctx) != "cispo":
        raise NotApplicable(
            f"option ratio {ratio_option(ctx)!r}: LOSS-014 and LOSS-022 check its clip"
        )
    eps_low, eps_high, _ = clip_declaration(ctx)
    lo, hi = 1 - eps_low, 1 + eps_high
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx, seed=23)
    asst = td.get(ASST)
    b, t = asst.shape
    # Token ratios cycle through above the bounds, inside, below (0.3 where there is no lower
    # bound, which no clip may touch) and inside again, shifted by one per row, so every row
    # holds clipped and unclipped weights.
    targets = torch.tensor(
        [hi * 1.25, (1 + hi) / 2, lo * 0.75 if lo > 0 else 0.3, (lo + 1) / 2],
        dtype=torch.float64,
    )
    r_set = targets[(torch.arange(t)[None, :] + torch.arange(b)[:, None]) % 4]
    signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(b)], dtype=torch.float64)
    logp = own_log_probs(policy, td)
    slp = torch.where(asst, logp - r_set.log().float(), float("nan"))
    td.set(SLP, slp)
    td.set(ADV, (signs * td.get(ADV).double().abs()).float())
    with torch.no_grad():
        m = asst.double()
        r = torch.where(asst, (logp.double() - slp.double()).exp(), 1.0)
        c = r.clamp(lo, hi)
        a = td.get(ADV).double()[:, None]
        w = expected_weights(ctx, asst).double()
        lp = torch.where(asst, logp.double(), 0.0)
        want_value = float((-a * c * lp * w * m).sum())
        want = -a * c * w * m
    tol = tol_factor(ctx)
    value, got = logp_grads(policy, loss, td, tol)
    bounds = f"clip bounds [{lo:.4g}, {hi:.4g}]"

    def grad_fail(i: int, p: int) -> str:
        side = "clipped" if bool(c[i, p] != r[i, p]) else "unclipped"
        return (
            f"ratio 'cispo', {bounds}: at token ratio {float(r[i, p]):.4g} (row {i}, position "
            f"{p}, weight {side}) with advantage {float(a[i, 0]):+.3g}, d loss_objective / d logp "
            f"is {float(got[i, p]):.6g}, expected -A x clip(r) x w = {float(want[i, p]):.6g}"
        )

    _expect(
        (value, want_value, got, want, tol),
        f"ratio 'cispo', {bounds}: with token ratios on both sides of the bounds and "
        f"advantages of both signs, loss_objective is {float(value):.6g}, expected "
        f"{want_value:.6g} (Σ w x (-A x sg(clip(r)) x log pi); with the weight unclipped "
        f"it would be {float((-a * r * lp * w * m).sum()):.6g})",
        grad_fail,
    )


KL_APPROX_FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda y: -y,
    "k2": lambda y: y * y / 2,
    "k3": lambda y: torch.expm1(y) - y,
    "k1_reverse": lambda y: y,
    "k3_reverse": lambda y: torch.expm1(-y) + y,
}


"""The per-token estimates ``kl_approx`` may average, of y = log pi - sample_log_probs:
KL(pi_sample || pi) by Schulman's k1, k2, k3 (samples from the behaviour policy, r = e^y),
or KL(pi || pi_sample) by k1 and k3 (the ``kl_estimator`` convention with the behaviour policy
as the reference: log r = -y)."""


@requirement("LOSS-024")
def kl_approx_estimates_behaviour_kl(ctx: Context) -> None:
    declared = ctx.impl.extras.get("kl_approx")
    if declared is not None and declared not in KL_APPROX_FORMS:
        raise _fail(
            f"Implementation.extras['kl_approx'] is {declared!r}; expected one of "
            f"{sorted(KL_APPROX_FORMS)}"
        )
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx)
    mask = td.get(ASST).clone()
    mask[:, 0] = False
    t = td.get(TOK).shape[1]
    # Offsets of both signs and several sizes: every form gives another mean.
    y = torch.tensor([0.6, -0.3, 0.9, -0.5, 0.2, -0.8])[torch.arange(t) % 6].expand(mask.shape)
    td.set(SLP, td.get(SLP) - y.to(td.get(SLP).dtype))
    y = y.double()
    forms = {
        name: float(torch.where(mask, k(y), 0.0).sum() / mask.sum())
        for name, k in KL_APPROX_FORMS.items()
    }
    values = []
    for ref_shift in (0.0, 0.7):
        batch = td.clone()
        own = td.get(SLP) + y.to(td.get(SLP).dtype)
        batch.set(RLP, own + ref_shift)
        with torch.no_grad():
            out = scalars(loss(batch))
        if "kl_approx" not in out:
            raise _fail(f"capability diagnostics declared but no 'kl_approx' among {sorted(out)}")
        values.append(out["kl_approx"])
    tol = tol_factor(ctx)
    got = values[0]
    if not math.isclose(values[1], got, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"kl_approx went from {got:.6g} to {values[1]:.6g} when the reference log-probs "
            "moved by 0.7: it estimates the KL between the behaviour policy (sample_log_probs) "
            "and the policy, never to the reference (that is loss_kl_to_ref)"
        )
    allowed = [declared] if declared is not None else list(KL_APPROX_FORMS)
    if not any(
        math.isclose(got, forms[n], rel_tol=1e-4 * tol, abs_tol=1e-6 * tol) for n in allowed
    ):
        shown = ", ".join(f"{n} {v:.6g}" for n, v in forms.items())
        which = (
            f"the declared estimator {declared!r} gives {forms[declared]:.6g}"
            if declared is not None
            else "no estimator of the catalogue matches"
        )
        raise _fail(
            f"off policy (log pi - sample_log_probs = y_t, from -0.8 to 0.9 along each row), "
            f"kl_approx is {got:.6g}; {which}. The mean over the assistant tokens of each "
            f"estimator of y: {shown}"
        )
