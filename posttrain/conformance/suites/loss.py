"""The loss suite: one check per LOSS requirement (specs/loss-v1.md).

The suite supplies the policy (a tiny real Hugging Face causal LM) and builds batches whose
behaviour log-probs are the policy's own (ratio 1), so the policy-gradient term's gradient has
a closed form: minus the advantage times the aggregation's weight, for every token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.data import llm_batch
from posttrain.conformance.policy import tiny_causal_lm
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._compare import bits_equal, leaves
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1, key_str

V, B, T = 64, 4, 10
K = LLM_LAYOUT_V1.key
TOK, ATT, ASST = K("tokens"), K("attention_mask"), K("assistant_mask")
SLP, RLP, ADV = K("sample_log_probs"), K("ref_log_probs"), K("advantage")


def _fail(msg: str) -> ConformanceError:
    return ConformanceError(msg)


def _setup(ctx: Context) -> tuple[Any, Any]:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    return policy, ctx.make(policy)


def _own_log_probs(policy: Any, td: TensorDictBase) -> torch.Tensor:
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    return token_log_probs(logits, td.get(TOK))


def _batch(policy: Any, ctx: Context, *, b: int = B, t: int = T, seed: int = 0) -> TensorDictBase:
    """A batch at ratio 1: behaviour and reference log-probs are the policy's own (NaN elsewhere)."""
    td = llm_batch(b, t, vocab_size=V, seed=ctx.seed * 7919 + seed)
    lp = torch.where(td.get(ASST), _own_log_probs(policy, td), float("nan"))
    td.set(SLP, lp)
    td.set(RLP, lp.clone())
    g = torch.Generator().manual_seed(seed + 1)
    adv = torch.randn(b, generator=g)
    td.set(ADV, torch.where(adv.abs() < 0.1, adv.sign() * 0.5 + 0.1, adv))  # no tiny advantages
    return td


def _as_dict(out: Any) -> dict[str, Any]:
    if isinstance(out, TensorDictBase):
        return {k: out.get(k) for k in out.keys()}  # noqa: SIM118
    if hasattr(out, "to_tensordict"):
        td = out.to_tensordict()
        return {k: td.get(k) for k in td.keys()}  # noqa: SIM118
    if hasattr(out, "items"):
        return dict(out.items())
    raise _fail(f"loss returned {type(out).__name__}, expected a TensorDict or a mapping")


def _scalars(out: Any) -> dict[str, float]:
    """Every scalar floating-point output, by name (loss terms and diagnostics)."""
    res = {}
    for k, v in _as_dict(out).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == 1:
            res[str(k)] = float(v.detach().reshape(()))
    return res


def _same(a: dict[str, float], b: dict[str, float], what: str, tol: float = 1e-5) -> None:
    if set(a) != set(b):
        raise _fail(f"{what}: outputs {sorted(b)} instead of {sorted(a)}")
    diff = {
        k: (a[k], b[k])
        for k in a
        if not (
            math.isclose(a[k], b[k], rel_tol=tol, abs_tol=tol)
            or (math.isnan(a[k]) and math.isnan(b[k]))
        )
    }
    if diff:
        shown = "; ".join(f"{k}: {x:.6g} -> {y:.6g}" for k, (x, y) in sorted(diff.items()))
        raise _fail(f"{what} changed outputs: {shown}")


def _loss_terms(out: Any) -> dict[str, torch.Tensor]:
    return {str(k): v for k, v in _as_dict(out).items() if str(k).startswith("loss_")}


@requirement("LOSS-001")
def scalar_finite_terms(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    terms = _loss_terms(loss(_batch(policy, ctx)))
    if "loss_objective" not in terms:
        raise _fail(f"no 'loss_objective' among the loss terms {sorted(terms)}")
    for k, v in terms.items():
        if not isinstance(v, torch.Tensor) or v.shape != torch.Size([]):
            shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise _fail(f"{k} has shape {shape}, expected a scalar (shape [])")
        if not torch.isfinite(v):
            raise _fail(f"{k} is {float(v)}, expected a finite value")


@requirement("LOSS-002")
def gradients_reach_policy(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    total = sum(_loss_terms(loss(_batch(policy, ctx))).values())
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


def _expected_weights(ctx: Context, mask: torch.Tensor) -> torch.Tensor:
    m = mask.float()
    b = m.shape[0]
    agg = ctx.options["aggregation"]
    if agg == "token_mean":
        return m / m.sum()
    if agg == "seq_mean_token_mean":
        return m / (b * m.sum(-1, keepdim=True))
    if agg == "seq_mean_token_sum":
        return m / b
    t_norm = ctx.impl.extras.get("t_norm")
    if not isinstance(t_norm, int):
        raise _fail(
            "seq_mean_token_sum_norm is declared but Implementation.extras['t_norm'] (an int) is not"
        )
    return m / (b * t_norm)


@requirement("LOSS-003")
def aggregation_weights(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
    tokens = td.get(TOK)
    probe = torch.zeros(B, T, V, requires_grad=True)
    head = policy.get_output_embeddings()
    handle = head.register_forward_hook(
        lambda _m, _i, out: out + probe if out.shape == probe.shape else out
    )
    try:
        obj = _loss_terms(loss(td))["loss_objective"]
        torch.autograd.backward(obj)
    finally:
        handle.remove()
    if probe.grad is None:
        raise _fail("loss_objective has no gradient with respect to the policy's logits")
    with torch.no_grad():
        logits = policy(input_ids=tokens, attention_mask=td.get(ATT).long()).logits
        p = torch.softmax(logits.float(), -1)
    g_tok = probe.grad[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    p_tok = p[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    got = torch.cat([torch.zeros(B, 1), g_tok / (1 - p_tok)], dim=1)  # d loss / d log p(token_t)
    mask = td.get(ASST)
    want = -td.get(ADV)[:, None] * _expected_weights(ctx, mask)
    if not torch.allclose(got, want, atol=1e-6, rtol=1e-4):
        i, t = divmod(int((got - want).abs().argmax()), T)
        where = "an assistant token" if mask[i, t] else "a position outside the assistant mask"
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}: d loss_objective / d logp at row {i}, "
            f"position {t} ({where}) is {float(got[i, t]):.6g}, expected -advantage x weight = "
            f"{float(want[i, t]):.6g}"
        )


def _variant_check(
    ctx: Context, change: Callable[[TensorDictBase], TensorDictBase], what: str, tol: float = 1e-5
) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
    with torch.no_grad():
        base = _scalars(loss(td.clone()))
        other = _scalars(loss(change(td.clone())))
    _same(base, other, what, tol)


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
        policy, loss = _setup(ctx)
        td = _batch(policy, ctx)
        td.set(ADV, td.get(ADV)[:, None].expand(B, T).clone(), inplace=False)
        with torch.no_grad():
            base = _scalars(loss(td))
        for value in (123.0, float("nan")):
            with torch.no_grad():
                _same(
                    base,
                    _scalars(loss(garbage(value)(td.clone()))),
                    f"per-token values {value} outside the assistant mask",
                )
    for value in (123.0, float("nan"), -1e30):
        _variant_check(
            ctx, garbage(value), f"padding tokens and log-probs {value} outside the assistant mask"
        )


def _pad(td: TensorDictBase, extra: int = 3) -> TensorDictBase:
    """``td`` with ``extra`` padding columns appended (masks False, log-probs NaN, tokens 0)."""
    out = td.empty()
    for key, v in leaves(td).items():
        if v.ndim == 2 and v.shape[1] == T:
            fill = (
                False
                if v.dtype == torch.bool
                else (0 if not v.is_floating_point() else float("nan"))
            )
            v = torch.cat([v, torch.full((v.shape[0], extra), fill, dtype=v.dtype)], dim=1)
        out.set(key, v)
    return out


@requirement("LOSS-005")
def padding_inert(ctx: Context) -> None:
    _variant_check(ctx, _pad, "appending 3 padding columns")


@requirement("LOSS-006")
def batch_order_inert(ctx: Context) -> None:
    perm = torch.tensor([2, 0, 3, 1])
    _variant_check(ctx, lambda td: td[perm], "permuting the batch rows")


@requirement("LOSS-007")
def input_not_mutated(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
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
    attempts = [
        ({"aggregation": "token_meen"}, "token_meen", "an unknown aggregation 'token_meen'"),
        (
            {"aggregaton": ctx.options["aggregation"]},
            "aggregaton",
            "a misspelt keyword 'aggregaton'",
        ),
    ]
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


@requirement("LOSS-009")
def bad_layout_rejected(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    cases: list[tuple[Callable[[TensorDictBase], TensorDictBase], str, str]] = [
        (lambda td: td.exclude(ADV), "advantage", "the advantage missing"),
        (lambda td: td.set(SLP, td.get(SLP).double()), "log_probs", "float64 behaviour log-probs"),
    ]
    for change, name, what in cases:
        td = change(_batch(policy, ctx))
        try:
            loss(td)
        except Exception as e:
            if name not in str(e):
                raise _fail(
                    f"a batch with {what} raised {type(e).__name__} without naming {name!r}: {e}"
                ) from None
        else:
            raise _fail(f"a batch with {what} was accepted")


@requirement("LOSS-010")
def kl_to_reference(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)

    def kl(batch: TensorDictBase) -> float:
        with torch.no_grad():
            terms = _loss_terms(loss(batch))
        if "loss_kl_to_ref" not in terms:
            raise _fail(
                f"capability kl_to_ref declared but no 'loss_kl_to_ref' among {sorted(terms)}"
            )
        return float(terms["loss_kl_to_ref"])

    same = kl(td.clone())
    if abs(same) > 1e-6:
        raise _fail(
            f"loss_kl_to_ref is {same:.6g} with reference log-probs equal to the policy's own; expected 0"
        )
    outside = td.clone()
    outside.set(RLP, torch.where(td.get(ASST), td.get(RLP), -3.0))
    if abs(kl(outside)) > 1e-6:
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
    padded = kl(_pad(inside))
    if not math.isclose(padded, base, rel_tol=1e-4, abs_tol=1e-7):
        raise _fail(
            f"loss_kl_to_ref went from {base:.6g} to {padded:.6g} when 3 padding columns were appended: it is reduced over positions, not assistant tokens"
        )


@requirement("LOSS-011")
def per_token_advantages(ctx: Context) -> None:
    def widen(td: TensorDictBase) -> TensorDictBase:
        td.set(ADV, td.get(ADV)[:, None].expand(B, T).clone(), inplace=False)
        return td

    _variant_check(ctx, widen, "a [B, T] advantage constant along T instead of [B]")


@requirement("LOSS-012")
def diagnostics_over_assistant_tokens(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
    td.set(ADV, td.get(ADV).abs())  # positive advantages: a high ratio is clipped under any rule

    def diag(batch: TensorDictBase) -> dict[str, float]:
        with torch.no_grad():
            out = _scalars(loss(batch))
        missing = [n for n in ("clip_fraction", "kl_approx", "entropy") if n not in out]
        if missing:
            raise _fail(
                f"capability diagnostics declared but {missing} missing from the outputs {sorted(out)}"
            )
        return out

    at_one = diag(td.clone())
    if abs(at_one["clip_fraction"]) > 1e-6 or abs(at_one["kl_approx"]) > 1e-6:
        raise _fail(
            f"at ratio 1: clip_fraction {at_one['clip_fraction']:.6g} and kl_approx {at_one['kl_approx']:.6g}; expected 0 and 0"
        )
    mask = td.get(ASST)
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    full = torch.cat([torch.zeros(B, 1), -(lp.exp() * lp).sum(-1)], 1)[mask].mean()
    sampled = (-td.get(SLP)[mask]).mean()
    if not any(
        math.isclose(at_one["entropy"], float(x), rel_tol=1e-4, abs_tol=1e-5)
        for x in (full, sampled)
    ):
        raise _fail(
            f"entropy is {at_one['entropy']:.6g}; over assistant tokens the full-vocabulary entropy is "
            f"{float(full):.6g} and the sampled estimate {float(sampled):.6g}"
        )
    shifted = td.clone()
    shifted.set(SLP, td.get(SLP) - 1.0)  # ratio e on every assistant token: all clipped
    hi = diag(shifted)
    if not math.isclose(hi["clip_fraction"], 1.0, abs_tol=1e-6):
        raise _fail(
            f"with every assistant token's ratio at e (all clipped), clip_fraction is {hi['clip_fraction']:.6g}; expected 1 (a smaller value means prompt or padding positions are counted)"
        )
    fewer = shifted.clone()
    m2 = mask.clone()
    first = m2.float().argmax(-1)
    m2[torch.arange(B), first] = False  # one assistant token fewer per row: the same per-token KL
    fewer.set(ASST, m2)
    lo = diag(fewer)
    if not math.isclose(lo["kl_approx"], hi["kl_approx"], rel_tol=1e-4, abs_tol=1e-6):
        raise _fail(
            f"with the same per-token KL on every assistant token, kl_approx went from {hi['kl_approx']:.6g} to {lo['kl_approx']:.6g} when assistant tokens became prompt: it is averaged over more than the assistant tokens"
        )


@requirement("LOSS-013")
def ragged_equals_padded(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
    lengths = td.get(ATT).sum(-1).tolist()
    items = [_trim(td[i], int(n)) for i, n in enumerate(lengths)]
    ragged = LazyStackedTensorDict.lazy_stack(items, 0)
    with torch.no_grad():
        _same(_scalars(loss(td)), _scalars(loss(ragged)), "the ragged form of the batch")


def _trim(item: TensorDictBase, n: int) -> TensorDictBase:
    out = item.empty()
    for key, v in leaves(item).items():
        out.set(key, v[:n] if v.ndim == 1 and v.shape[0] == T else v)
    return out
