"""The loss suite: one check per LOSS requirement (specs/loss-v1.md).

The suite supplies the policy (a tiny real Hugging Face causal LM) and builds batches whose
behaviour log-probs are the policy's own (ratio 1), so the policy-gradient term's gradient has
a closed form: minus the advantage times the aggregation's weight, for every token. It is read
through a probe on the logits of every policy call, so a loss may call the policy once or per
sequence, on any slice of the rows. LOSS-014 moves each token's ratio r off 1 by setting its
behaviour log-prob to the policy's minus log r, and compares with the clipped surrogate computed
here in float64. LOSS-012 uses a policy with peaked next-token distributions, whose entropy
differs from position to position, so an entropy read at the wrong position shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain._dtypes import dtype_name
from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites import loss_options  # noqa: F401  (registers LOSS-019 to LOSS-024)
from posttrain.conformance.suites._compare import bits_equal, leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.loss_drawn import (
    clip_everywhere,
    finite_on_layouts,
    inert_on_layouts,
    order_on_layouts,
)
from posttrain.conformance.suites.loss_kit import (
    ADV,
    ASST,
    ATT,
    EMPTY_ROW,
    RLP,
    SLP,
    SPLITS,
    TOK,
    B,
    T,
    V,
    add_tol,
    as_dict,
    call_counted,
    check_same,
    check_scalar_finite_terms,
    clip_declaration,
    counted_batch,
    counts_of,
    live_batch,
    logp_grads,
    loss_terms,
    make_batch,
    must_refuse,
    names_key,
    own_log_probs,
    pad_columns,
    ragged_form,
    ratio_option,
    refuse_each,
    scalars,
    setup,
    split_name,
    split_strategy,
    token_advantages,
    tol_factor,
    trimmed,
    value_and_grads,
    weights_for,
    with_value,
)
from posttrain.conformance.suites.loss_live import check_live_weights
from posttrain.conformance.suites.loss_ranks import ranks_add_up
from posttrain.contracts.keys import key_str
from posttrain.testing import llm_batch, tiny_causal_lm


@requirement("LOSS-001")
def scalar_finite_terms(ctx: Context) -> None:
    policy, loss = setup(ctx)
    check_scalar_finite_terms(loss(make_batch(policy, ctx)), "loss_objective")
    finite_on_layouts(ctx, policy, loss)  # since 1.8: any shape, empty rows, holes


@requirement("LOSS-002")
def gradients_reach_policy(ctx: Context) -> None:
    policy, loss = setup(ctx)
    total = sum(loss_terms(loss(make_batch(policy, ctx))).values())
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        raise _fail(
            "the sum of the loss_* terms does not require grad: no gradient can reach the policy"
        )
    torch.autograd.backward(total)
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    if not grads or all(float(g.abs().sum()) == 0 for g in grads):
        raise _fail(
            "backward of the loss left every policy parameter without a (non-zero) gradient"
        )
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        raise _fail("backward of the loss gave non-finite parameter gradients")


@requirement("LOSS-003")
def aggregation_weights(ctx: Context) -> None:
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx)
    cases = [("a [B] advantage", td)]
    # A declared sequence ratio (GSPO) spreads a row's advantages over its tokens at ratio 1:
    # LOSS-021 checks it; the per-token reading below is the token ratio's.
    if "per_token_advantage" in ctx.capabilities and ratio_option(ctx) != "sequence":
        per_token = td.clone()
        per_token.set(ADV, token_advantages(td, ctx.seed), inplace=False)
        cases.append(("a [B, T] advantage, different at every position", per_token))
    # A row without assistant tokens weighs nothing whether or not capability global_counts
    # is declared (since 1.6); the capability pins B to the rows holding one (LOSS-016),
    # without it B may count every row (TRL's and TorchRL's means) or those rows.
    counted = counted_batch(policy, ctx, from_zero=False)
    own = own_log_probs(policy, counted)  # finite everywhere: counting here, NaN is LOSS-004's
    counted.set(SLP, own)
    counted.set(RLP, own.clone())
    empty = f"a batch of {counted.shape[0]} rows whose row {EMPTY_ROW} has no assistant token"
    cases.append((empty, counted))
    every_row_ok = "global_counts" not in ctx.capabilities

    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return torch.allclose(x, y, atol=1e-6 * tol_factor(ctx), rtol=1e-4 * tol_factor(ctx))

    for what, batch in cases:
        mask = batch.get(ASST)
        n, s = counts_of(mask)
        _, got = logp_grads(policy, loss, batch, tol_factor(ctx))
        adv = batch.get(ADV)
        a = adv[:, None] if adv.ndim == 1 else adv
        want = -a * weights_for(ctx, mask, n, s).float()
        every = -a * weights_for(ctx, mask, n, mask.shape[0]).float()
        if close(got, want):
            continue
        if what == empty and every_row_ok and close(got, every):
            continue
        i, t = divmod(int((got - want).abs().argmax()), got.shape[1])
        where = "an assistant token" if mask[i, t] else "a position outside the assistant mask"
        hint = ""
        if s < mask.shape[0] and close(got, every):
            hint = (
                f" (it counted the row without an assistant token: B = {mask.shape[0]} rows "
                f"instead of the {s} holding one, which capability global_counts rules out)"
            )
        elif what == empty and every_row_ok:
            hint = (
                f" (or, B counting every row, {float(every[i, t]):.6g}: a row without an "
                "assistant token weighs nothing)"
            )
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}, {what}: d loss_objective / d logp "
            f"at row {i}, position {t} ({where}) is {float(got[i, t]):.6g}, expected "
            f"-advantage x weight = {float(want[i, t]):.6g}{hint}"
        )
    check_live_weights(ctx)  # since 1.9: one loss object on a live policy


def _variant_check(
    ctx: Context, change: Callable[[TensorDictBase], TensorDictBase], what: str, tol: float = 1e-5
) -> None:
    tol *= tol_factor(ctx)
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx)
    with torch.no_grad():
        base = scalars(loss(td.clone()))
        other = scalars(loss(change(td.clone())))
    check_same(base, other, what, tol)


@requirement("LOSS-004")
def masked_positions_inert(ctx: Context) -> None:
    def garbage(value: float) -> Callable[[TensorDictBase], TensorDictBase]:
        def change(td: TensorDictBase) -> TensorDictBase:
            outside = ~td.get(ASST)
            pad = ~td.get(ATT)
            td.set(TOK, torch.where(pad, (td.get(TOK) + 17) % V, td.get(TOK)))
            for key in (SLP, RLP):
                td.set(key, torch.where(outside, torch.full_like(td.get(key), value), td.get(key)))
            adv = td.get(ADV)
            if adv.ndim == 2:
                td.set(ADV, torch.where(outside, torch.full_like(adv, value), adv))
            return td

        return change

    if "per_token_advantage" in ctx.capabilities:
        policy, loss = setup(ctx)
        td = make_batch(policy, ctx)
        td.set(ADV, td.get(ADV)[:, None].expand(B, T).clone(), inplace=False)
        with torch.no_grad():
            base = scalars(loss(td))
        for value in (123.0, float("nan")):
            with torch.no_grad():
                check_same(
                    base,
                    scalars(loss(garbage(value)(td.clone()))),
                    f"per-token values {value} outside the assistant mask",
                    1e-5 * tol_factor(ctx),
                )
    for value in (123.0, float("nan"), -1e30):
        _variant_check(
            ctx, garbage(value), f"padding tokens and log-probs {value} outside the assistant mask"
        )
    inert_on_layouts(ctx, *setup(ctx))  # since 1.8: holes, empty rows, any shape


@requirement("LOSS-005")
def padding_inert(ctx: Context) -> None:
    _variant_check(ctx, pad_columns, "appending 3 padding columns")


@requirement("LOSS-006")
def batch_order_inert(ctx: Context) -> None:
    perm = torch.tensor([2, 0, 3, 1])
    _variant_check(ctx, lambda td: td[perm], "permuting the batch rows")
    order_on_layouts(ctx, *setup(ctx))  # since 1.8: drawn batches and orders


@requirement("LOSS-007")
def input_not_mutated(ctx: Context) -> None:
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx)
    before = {k: v.clone() for k, v in leaves(td).items()}
    loss(td)
    after = leaves(td)
    problems = [f"key {key_str(k)} removed" for k in before if k not in after]
    problems += [f"key {key_str(k)} added" for k in after if k not in before]
    problems += [
        f"key {key_str(k)} changed"
        for k in before
        if k in after and not bits_equal(before[k], after[k])
    ]
    if problems:
        raise _fail("loss(td) mutated its input: " + "; ".join(problems))


@requirement("LOSS-008")
def unknown_options_rejected(ctx: Context) -> None:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    # Only a declared option is passed by its name: a factory that declares none need not take
    # any keyword, and rejects this one by name like any other unknown keyword.
    attempts = [
        ({name: value}, value or name, f"an unknown {name} {value!r}")
        for name in sorted(ctx.impl.options)
        for value in _unknown_values(name, str(ctx.options[name]))
    ]
    misspelt = {"aggregaton": ctx.options["aggregation"]}
    attempts.append((misspelt, "aggregaton", "a misspelt keyword 'aggregaton'"))
    problems = []
    for kwargs, name, what in attempts:
        try:
            ctx.make(policy, **kwargs)
        except Exception as e:
            if name not in str(e):
                problems.append(
                    f"constructing with {what} raised {type(e).__name__} without naming {name!r}: {e}"
                )
        else:
            problems.append(f"constructing with {what} was accepted")
    if problems:
        raise _fail("; ".join(problems))


def _unknown_values(option: str, declared: str) -> list[str]:
    """Values of ``option`` the spec does not define: a misspelling and, since 1.8, the
    declared value's near misses (another case, a suffix, a prefix, empty: a lenient parser's
    ``.lower()``, ``startswith`` or ``in`` accepts one of them)."""
    from posttrain.contracts.loss import LOSS

    known = {v for o in LOSS.options if o.name == option for v in o.values}
    first = "token_meen" if option == "aggregation" else f"no_such_{option}"
    out: list[str] = []
    for v in (first, declared.upper(), declared + "_x", declared[:-1], ""):
        if v not in known and v not in out:
            out.append(v)
    return out


@requirement("LOSS-009")
def bad_layout_rejected(ctx: Context) -> None:
    policy, loss = setup(ctx)
    td0 = make_batch(policy, ctx)
    asst, att = td0.get(ASST), td0.get(ATT)
    refused: list[tuple[TensorDictBase, tuple[str, ...], str]] = [
        (td0.clone().exclude(ADV), ADV, "the advantage missing"),
        (td0.clone().exclude(SLP), SLP, "the behaviour log-probs missing"),
        (with_value(td0.clone(), ASST, asst.float()), ASST, "a float32 assistant mask (0/1)"),
        (with_value(td0.clone(), ASST, asst.long()), ASST, "an int64 assistant mask (0/1)"),
        (with_value(td0.clone(), ATT, att.to(torch.uint8)), ATT, "a uint8 attention mask (0/1)"),
    ]
    refuse_each(loss, refused)
    # Widened float fields, one at a time and all at once (numpy-born arrays are float64):
    # refused by name, or the outputs of the same values in float32, in the same dtypes.
    with torch.no_grad():
        for dtype in (torch.float64, torch.bfloat16, torch.float16):
            for keys in ((SLP,), (ADV,), (RLP,), (SLP, ADV, RLP)):
                _check_widened(ctx, loss, td0, keys, dtype)


def _float_dtypes(out: Any) -> dict[str, torch.dtype]:
    """The dtype of every floating-point tensor output, by name."""
    return {
        str(k): v.dtype
        for k, v in as_dict(out).items()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    }


def _check_widened(
    ctx: Context, loss: Any, td0: TensorDictBase, keys: tuple[Any, ...], dtype: torch.dtype
) -> None:
    """LOSS-009 on ``keys`` given in ``dtype``: refused naming one of them, or the outputs
    (values and dtypes) of the same values in float32."""
    base, td = td0.clone(), td0.clone()
    for key in keys:
        value = td0.get(key).to(dtype)
        base = with_value(base, key, value.float())
        td = with_value(td, key, value)
    want_out = loss(base)
    what = f"{dtype_name(dtype)} {', '.join(key_str(k) for k in keys)}"
    try:
        got_out = loss(td)
    except Exception as e:
        if any(names_key(str(e), key) for key in keys):
            return
        raise _fail(
            f"a batch with {what} raised {type(e).__name__} without naming the key (refuse it "
            f"by name, or compute as with float32): {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    check_same(
        scalars(want_out),
        scalars(got_out),
        f"{what} (against the same values in float32)",
        1e-5 * tol_factor(ctx),
    )
    want, got = _float_dtypes(want_out), _float_dtypes(got_out)
    changed = {k: (want[k], got[k]) for k in want if k in got and want[k] != got[k]}
    if changed:
        shown = "; ".join(
            f"{k}: {dtype_name(a)} -> {dtype_name(b)}" for k, (a, b) in sorted(changed.items())
        )
        raise _fail(
            f"a float field in another floating dtype: the outputs of the same values in the "
            f"layout dtype (float32), in their dtypes, expected; with {what} the outputs "
            f"changed dtype ({shown}): a loss computes in its own precision"
        )


@requirement("LOSS-010")
def kl_to_reference(ctx: Context) -> None:
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx)

    def kl(batch: TensorDictBase) -> float:
        with torch.no_grad():
            terms = loss_terms(loss(batch))
        if "loss_kl_to_ref" not in terms:
            raise _fail(
                f"capability kl_to_ref declared but no 'loss_kl_to_ref' among {sorted(terms)}"
            )
        return float(terms["loss_kl_to_ref"])

    tol = tol_factor(ctx)
    same = kl(td.clone())
    if abs(same) > 1e-6 * tol:
        raise _fail(
            f"loss_kl_to_ref is {same:.6g} with reference log-probs equal to the policy's own; expected 0"
        )
    outside = td.clone()
    outside.set(RLP, torch.where(td.get(ASST), td.get(RLP), -3.0))
    if abs(kl(outside)) > 1e-6 * tol:
        raise _fail(
            f"loss_kl_to_ref is {kl(outside):.6g} when reference log-probs differ only outside the assistant mask; expected 0"
        )
    inside = td.clone()
    inside.set(RLP, td.get(RLP) - 0.5)
    base = kl(inside)
    if not base > 1e-6:
        raise _fail(
            f"loss_kl_to_ref is {base:.6g} when reference log-probs differ by 0.5 on assistant tokens; expected > 0"
        )
    padded = kl(pad_columns(inside))
    if not math.isclose(padded, base, rel_tol=1e-4 * tol, abs_tol=1e-7 * tol):
        raise _fail(
            f"loss_kl_to_ref went from {base:.6g} to {padded:.6g} when 3 padding columns were appended: it is reduced over positions, not assistant tokens"
        )


@requirement("LOSS-011")
def per_token_advantages(ctx: Context) -> None:
    def widen(td: TensorDictBase) -> TensorDictBase:
        td.set(ADV, td.get(ADV)[:, None].expand(B, T).clone(), inplace=False)
        return td

    _variant_check(ctx, widen, "a [B, T] advantage constant along T instead of [B]")


def _entropies(policy: Any, td: TensorDictBase, mask: torch.Tensor) -> tuple[float, float]:
    """Over ``mask``'s tokens, in float64: the mean full-vocabulary entropy of the distribution
    each token was drawn from (the logits one position earlier), and the sampled estimate,
    the mean of -log p(token)."""
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    h = torch.cat([torch.zeros(lp.shape[0], 1, dtype=torch.float64), -(lp.exp() * lp).sum(-1)], 1)
    return float(h[mask].mean()), float((-td.get(SLP).double())[mask].mean())


def _one_token_masks(mask: torch.Tensor) -> list[torch.Tensor]:
    """Assistant masks holding one token per row: each row's first, middle, then last one."""
    out = []
    for pick in (0, 1, 2):
        one = torch.zeros_like(mask)
        for i in range(mask.shape[0]):
            pos = mask[i].nonzero().flatten().tolist()
            if pos:
                one[i, pos[(len(pos) - 1) * pick // 2]] = True
        out.append(one)
    return out


@requirement("LOSS-012")
def diagnostics_over_assistant_tokens(ctx: Context) -> None:
    policy, loss = setup(ctx, peaked=True)
    td = make_batch(policy, ctx)
    td.set(ADV, td.get(ADV).abs())  # positive advantages: a high ratio is clipped under any rule

    def diag(batch: TensorDictBase) -> dict[str, float]:
        with torch.no_grad():
            out = scalars(loss(batch))
        missing = [n for n in ("clip_fraction", "kl_approx", "entropy") if n not in out]
        if missing:
            raise _fail(
                f"capability diagnostics declared but {missing} missing from the outputs {sorted(out)}"
            )
        return out

    tol = tol_factor(ctx)
    at_one = diag(td.clone())
    if abs(at_one["clip_fraction"]) > 1e-6 * tol or abs(at_one["kl_approx"]) > 1e-6 * tol:
        raise _fail(
            f"at ratio 1: clip_fraction {at_one['clip_fraction']:.6g} and kl_approx {at_one['kl_approx']:.6g}; expected 0 and 0"
        )
    mask = td.get(ASST)
    # The whole mask, then one token per row: a mean over many tokens hides an entropy read
    # one position off (the two sums share all but their ends), a single token does not.
    for what, m in [("", mask)] + [
        (" (one assistant token per row)", m) for m in _one_token_masks(mask)
    ]:
        batch = td.clone()
        batch.set(ASST, m)
        got = at_one["entropy"] if m is mask else diag(batch)["entropy"]
        full, sampled = _entropies(policy, batch, m)
        if not any(
            math.isclose(got, x, rel_tol=1e-4 * tol, abs_tol=1e-5 * tol) for x in (full, sampled)
        ):
            raise _fail(
                f"at ratio 1{what}, entropy is {got:.6g}; over the assistant tokens, of the "
                f"distributions they were drawn from (the logits one position earlier), the "
                f"full-vocabulary entropy is {full:.6g} and the sampled estimate {sampled:.6g}"
            )
    shifted = td.clone()
    shifted.set(SLP, td.get(SLP) - 1.0)  # ratio e on every assistant token: all clipped
    hi = diag(shifted)
    # A declared ratio "none" or "on_policy" has nothing to clip (LOSS-021).
    clips = ratio_option(ctx) in ("token", "sequence", "gspo_token", "cispo")
    if clips and not math.isclose(hi["clip_fraction"], 1.0, abs_tol=1e-6 * tol):
        raise _fail(
            f"with every assistant token's ratio at e (all clipped), clip_fraction is {hi['clip_fraction']:.6g}; expected 1 (a smaller value means prompt or padding positions are counted)"
        )
    fewer = shifted.clone()
    m2 = mask.clone()
    first = m2.float().argmax(-1)
    m2[torch.arange(B), first] = False  # one assistant token fewer per row: the same per-token KL
    fewer.set(ASST, m2)
    lo = diag(fewer)
    if not math.isclose(lo["kl_approx"], hi["kl_approx"], rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"with the same per-token KL on every assistant token, kl_approx went from {hi['kl_approx']:.6g} to {lo['kl_approx']:.6g} when assistant tokens became prompt: it is averaged over more than the assistant tokens"
        )


@requirement("LOSS-013")
def ragged_equals_padded(ctx: Context) -> None:
    policy, loss = setup(ctx)
    td = make_batch(policy, ctx)
    lengths = td.get(ATT).sum(-1).tolist()
    items = [_trim(td[i], int(n)) for i, n in enumerate(lengths)]
    ragged = LazyStackedTensorDict.lazy_stack(items, 0)
    with torch.no_grad():
        check_same(
            scalars(loss(td)),
            scalars(loss(ragged)),
            "the ragged form of the batch",
            1e-5 * tol_factor(ctx),
        )


def _trim(item: TensorDictBase, n: int) -> TensorDictBase:
    out = item.empty()
    for key, v in leaves(item).items():
        out.set(key, v[:n] if v.ndim == 1 and v.shape[0] == T else v)
    return out


def _probe_ratios(lo: float, hi: float, dual: float | None) -> list[float]:
    """Ratios well inside and on both sides of every bound above 0, none within 1% of one."""
    bounds = [b for b in (lo, hi, dual) if b is not None and b > 0]
    cands = [lo * 0.5, lo * 0.97, lo * 1.03, 1.0, hi * 0.97, hi * 1.03, hi * 2.0]
    if lo == 0:  # no lower bound declared: ratios far below 1, which none may clip
        cands += [0.02, 0.3]
    if dual is not None:
        cands += [dual * 0.97, dual * 1.03, dual * 2.0]
    return sorted({r for r in cands if r > 0 and all(abs(r / b - 1) > 0.01 for b in bounds)})


@requirement("LOSS-014")
def clipped_surrogate(ctx: Context) -> None:
    if ratio_option(ctx) != "token":
        raise NotApplicable(
            f"option ratio {ratio_option(ctx)!r} declared: LOSS-021 checks its surrogate"
        )
    eps_low, eps_high, dual = clip_declaration(ctx)
    lo, hi = 1 - eps_low, 1 + eps_high
    policy, loss = setup(ctx)
    # First the probes 3% either side of every bound, advantages in [0.5, 1.5) alternating in
    # sign (so each ratio meets both signs); since 1.8 drawn ratio sets and magnitudes.
    g = torch.Generator().manual_seed(ctx.seed + 14)
    adv = (0.5 + torch.rand(4, generator=g)) * torch.tensor([1.0, -1.0, 1.0, -1.0])
    first = (tuple(_probe_ratios(lo, hi, dual)), tuple(adv.tolist()))
    clip_everywhere(ctx, policy, loss, first, (lo, hi, dual))


@requirement("LOSS-015")
def mis_shaped_fields_rejected(ctx: Context) -> None:
    policy, loss = setup(ctx)
    td0 = make_batch(policy, ctx)
    adv, slp = td0.get(ADV), td0.get(SLP)
    nan = torch.full((B, 1), float("nan"))
    cases = [
        (ADV, adv[:, None], "an advantage of shape [B, 1]"),
        (ADV, adv[:, None].expand(B, T - 1).clone(), "an advantage of shape [B, T - 1]"),
        (SLP, slp[:, 1:], "behaviour log-probs one position short ([B, T - 1], next-token)"),
        (SLP, torch.cat([slp, nan], 1), "behaviour log-probs one position long ([B, T + 1])"),
    ]
    if "kl_to_ref" in ctx.capabilities:
        rlp = td0.get(RLP)
        cases.append((RLP, rlp[:, 1:], "reference log-probs one position short ([B, T - 1])"))
    for key, value, what in cases:
        problem = must_refuse(loss, with_value(td0.clone(), key, value), key, what)
        if problem is not None:
            raise _fail(problem)


@requirement("LOSS-016")
def global_counts_normalize(ctx: Context) -> None:
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = setup(ctx)
    td = counted_batch(policy, ctx)
    mask, adv = td.get(ASST), td.get(ADV).double()
    n, s = counts_of(mask)
    every_row = mask.shape[0]
    # At ratio 1 the surrogate is -A, or -A log pi under a declared ratio "none" or "cispo"
    # (LOSS-021: CISPO's weight sg(clip(1)) is 1).
    rho: Any = 1.0
    if ratio_option(ctx) in ("none", "cispo"):
        rho = torch.where(mask, own_log_probs(policy, td).double(), 0.0)
    cases = [
        ("loss(td), no counts", None, n, s),
        ("counts=GlobalCounts.of(td)", GlobalCounts.of(td), n, s),
        (f"counts of a larger global batch ({3 * n + 5} tokens, {2 * s + 3} sequences)",
         GlobalCounts(3 * n + 5, 2 * s + 3), 3 * n + 5, 2 * s + 3),
    ]  # fmt: skip
    for what, counts, tokens, seqs in cases:
        with torch.no_grad():
            out = loss(td) if counts is None else call_counted(loss, td, counts)
        got = float(loss_terms(out)["loss_objective"])
        want = float((-adv[:, None] * rho * weights_for(ctx, mask, tokens, seqs)).sum())
        if math.isclose(got, want, rel_tol=1e-5 * tol_factor(ctx), abs_tol=1e-7 * tol_factor(ctx)):
            continue
        hint = ""
        if ctx.options["aggregation"] != "token_mean":
            all_rows = float((-adv[:, None] * weights_for(ctx, mask, tokens, every_row)).sum())
            if counts is None and math.isclose(
                got, all_rows, rel_tol=1e-5 * tol_factor(ctx), abs_tol=1e-7 * tol_factor(ctx)
            ):
                hint = f" (it counted the row without an assistant token: {every_row} sequences)"
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}, a batch of {every_row} rows, one "
            f"without assistant tokens, {what}: loss_objective at ratio 1 is {got:.6g}, expected "
            f"{want:.6g} (normalized by {tokens} tokens and {seqs} sequences){hint}"
        )


@requirement("LOSS-017")
def micro_batches_add_up(ctx: Context) -> None:
    if "global_counts" not in ctx.capabilities:
        raise NotApplicable(_micro_batch_dependence(ctx))
    from hypothesis import strategies as st

    from posttrain.conformance.explore import for_all
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = setup(ctx)
    # Every term live: a term at zero (a KL at ratio 1, reference = policy) adds up whatever
    # it is normalized by.
    td = live_batch(policy, ctx)
    counts = GlobalCounts.of(td)
    full, g_full = value_and_grads(policy, loss, td, None)
    add = add_tol(ctx)
    agg = ctx.options["aggregation"]
    ragged = "ragged" in ctx.capabilities
    per_token = "per_token_advantage" in ctx.capabilities
    rows = td.shape[0]

    def check(case: tuple[tuple[tuple[int, ...], ...], bool]) -> None:
        split, as_ragged = case
        cut = [td[list(p)] for p in split]
        parts = [
            value_and_grads(policy, loss, ragged_form(c) if as_ragged else trimmed(c), counts)
            for c in cut
        ]
        where = (
            f"aggregation {agg!r}, a batch of {rows} rows (row {EMPTY_ROW} without assistant "
            f"tokens; off policy, reference log-probs off the policy's"
            f"{', a [B, T] advantage' if per_token else ''}) split into "
            f"{'ragged ' if as_ragged else ''}micro-batches {split_name(split)}, each called "
            f"with the whole batch's counts ({counts.tokens} tokens, {counts.sequences} "
            "sequences)"
        )
        names = set(full)
        for terms, _ in parts:
            names |= set(terms)
        for name in sorted(names, key=lambda n: (n != "loss_objective", n)):
            got = sum(terms.get(name, 0.0) for terms, _ in parts)
            want = full.get(name, 0.0)
            scale = max([abs(want)] + [abs(t.get(name, 0.0)) for t, _ in parts])
            if not abs(got - want) <= add * max(scale, 1e-6):  # NaN fails too
                raise _fail(
                    f"{where}: the micro-batches' {name} sum to {got:.6g}, the whole batch's "
                    f"is {want:.6g}"
                )
        g_sum = torch.stack([g for _, g in parts]).sum(0)
        err = float((g_sum - g_full).abs().max())
        if not err <= add * max(float(g_full.abs().max()), 1e-12):
            raise _fail(
                f"{where}: the sum of the micro-batches' parameter gradients differs from the "
                f"whole batch's by up to {err:.3g} (largest entry {float(g_full.abs().max()):.3g})"
            )

    boundaries = [(s, False) for s in SPLITS]
    if ragged:
        boundaries.append((SPLITS[1], True))
    for_all(
        ctx,
        st.tuples(split_strategy(rows), st.booleans() if ragged else st.just(False)),
        check,
        examples=4,
        boundaries=boundaries,
    )
    # The same sentence across data-parallel ranks, real gloo process groups of 4 and 2.
    ranks_add_up(ctx)


def _micro_batch_dependence(ctx: Context) -> str:
    """What a loss without global counts does to one token of a short and of a long answer
    that land in different micro-batches, accumulated as the mean of the micro-batch losses."""
    head = (
        "capability global_counts not declared, so the loss cannot be told the whole batch's counts"
    )
    try:
        policy, loss = setup(ctx)
        lengths, prompt = (2, 8, 5), 3
        t = prompt + max(lengths) + 1
        td = llm_batch(len(lengths), t, vocab_size=V, seed=ctx.seed * 7919 + 17)
        pos = torch.arange(t).expand(len(lengths), t)
        att = pos < (prompt + torch.tensor(lengths))[:, None]
        td.set(ATT, att)
        td.set(ASST, att & (pos >= prompt))
        lp = torch.where(td.get(ASST), own_log_probs(policy, td), float("nan"))
        td.set(SLP, lp)
        td.set(RLP, lp.clone())
        td.set(ADV, torch.ones(len(lengths)))
        tol = tol_factor(ctx)
        _, g = logp_grads(policy, loss, td, tol)
        one = (-float(g[0, prompt]), -float(g[1, prompt]))
        _, g_short = logp_grads(policy, loss, td[[0]], tol)
        _, g_long = logp_grads(policy, loss, td[[1, 2]], tol)
        acc = (-float(g_short[0, prompt]) / 2, -float(g_long[0, prompt]) / 2)
    except Exception as e:
        return f"{head}; its dependence on micro-batching could not be measured: {type(e).__name__}: {e}"
    same = all(
        math.isclose(a, b, rel_tol=1e-4 * tol, abs_tol=1e-8 * tol)
        for a, b in zip(one, acc, strict=True)
    )
    verdict = (
        "this split leaves its gradient unchanged (other splits may not)"
        if same
        else "its gradient depends on how the batch is split into micro-batches"
    )
    return (
        f"{head}. Measured with aggregation {ctx.options['aggregation']!r} on answers of 2, 8 and "
        f"5 tokens (advantage 1): in one batch a token of the 2-token answer gets gradient "
        f"weight {one[0]:.4g} and one of the 8-token answer {one[1]:.4g}; in micro-batches "
        f"[2-token] + [8-token, 5-token] accumulated as the mean of the 2 micro-batch losses, "
        f"{acc[0]:.4g} and {acc[1]:.4g}: {verdict}"
    )


_DIAGNOSTICS = ("clip_fraction", "kl_approx", "entropy")


@requirement("LOSS-018")
def diagnostics_add_up(ctx: Context) -> None:
    if "diagnostics" not in ctx.capabilities:
        raise NotApplicable("needs capability diagnostics as well as global_counts")
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = setup(ctx, peaked=True)
    add = add_tol(ctx)
    td = counted_batch(policy, ctx)
    td.set(ADV, td.get(ADV).abs())
    # Ratio e on rows 0 and 3 (all clipped, KL > 0), 1 elsewhere: per-row diagnostics differ.
    shift = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])[:, None]
    td.set(SLP, td.get(SLP) - shift)
    counts = GlobalCounts.of(td)
    with torch.no_grad():
        full = scalars(loss(td))
    missing = [n for n in _DIAGNOSTICS if n not in full]
    if missing:
        raise _fail(f"capability diagnostics declared but {missing} missing from {sorted(full)}")
    for split in SPLITS:
        with torch.no_grad():
            parts = [(scalars(call_counted(loss, trimmed(td[list(p)]), counts)), p) for p in split]
        for name in _DIAGNOSTICS:
            # The metric catalogue's tok reduction (observability.reduce.Accumulator, which
            # the kit does not import): sum of the (sum, count) pairs' sums / sum of counts.
            sums = counted = 0.0
            for values, rows in parts:
                if name not in values:
                    raise _fail(f"{name} missing from a micro-batch's outputs {sorted(values)}")
                sums += values[name] * counts.tokens
                counted += GlobalCounts.of(td[list(rows)]).tokens
            got, want = sums / max(counted, 1.0), full[name]
            if not math.isclose(got, want, rel_tol=add, abs_tol=1e-7 * tol_factor(ctx)):
                shown = ", ".join(f"{v[name]:.4g}" for v, _ in parts)
                raise _fail(
                    f"a batch split into micro-batches {split_name(split)}, each called with the "
                    f"whole batch's counts ({counts.tokens} tokens): {name} came out {shown}, "
                    f"whose token-weighted reduction (value x {counts.tokens} over each "
                    f"micro-batch's tokens) is {got:.6g}; the whole batch's is {want:.6g} (each "
                    f"must be its sum over assistant tokens / counts.tokens)"
                )
