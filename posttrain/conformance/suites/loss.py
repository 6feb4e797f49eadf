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

import itertools
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain._dtypes import dtype_name
from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._compare import bits_equal, leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.keys import key_str
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import llm_batch, tiny_causal_lm

V, B, T = 64, 4, 10
K = LLM_LAYOUT_V1.key
TOK, ATT, ASST = K("tokens"), K("attention_mask"), K("assistant_mask")
SLP, RLP, ADV = K("sample_log_probs"), K("ref_log_probs"), K("advantage")


def _setup(ctx: Context, *, peaked: bool = False) -> tuple[Any, Any]:
    """The suite's policy and the loss built on it.

    ``peaked``: the output head scaled up, so next-token distributions are far from uniform
    and differ from position to position (the seeded model's are all near log V in entropy,
    which hides an entropy read at the wrong position).
    """
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    if peaked:
        with torch.no_grad():
            policy.get_output_embeddings().weight.mul_(_PEAK)
    dtype = _precision(ctx)[0]
    if dtype != torch.float32:
        policy.to(dtype)  # the policy's weights in the declared precision, as users train
    # The declared options reach the factory by name (a factory not pre-bound to them is
    # built as declared); a factory declaring none gets no keyword (LOSS-008 says why).
    return policy, ctx.make(policy, **ctx.impl.options)


_PEAK = 30.0


def _precision(ctx: Context) -> tuple[torch.dtype, float, float]:
    """The declared precision's dtype, the factor on every float32 tolerance, and LOSS-017/
    018's tolerance (the contract's precision table)."""
    from posttrain.contracts.loss import LOSS_PRECISIONS

    name = ctx.impl.extras.get("precision", "float32")
    if name not in LOSS_PRECISIONS:
        raise _fail(
            f"Implementation.extras['precision'] is {name!r}; expected one of "
            f"{sorted(LOSS_PRECISIONS)}"
        )
    factor, add = LOSS_PRECISIONS[name]
    return getattr(torch, name), factor, add


def _tol(ctx: Context) -> float:
    """The factor every float32 tolerance is multiplied by in the declared precision."""
    return _precision(ctx)[1]


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
    """Every scalar floating-point output, by name (loss terms and diagnostics); a diagnostic
    may be a Python or NumPy float (what ``.item()`` gives a logger) as well as a tensor."""
    res = {}
    for k, v in _as_dict(out).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == 1:
            res[str(k)] = float(v.detach().reshape(()))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool | int | numbers.Integral):
            res[str(k)] = float(v)
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


def _loss_term(out: Any, name: str) -> torch.Tensor:
    """The loss term ``name`` of a loss's output; fails naming the terms there are.

    >>> float(_loss_term({"loss_nll": torch.tensor(2.0)}, "loss_nll"))
    2.0
    """
    terms = _loss_terms(out)
    if name not in terms:
        raise _fail(f"no {name!r} among the loss terms {sorted(terms)}")
    return terms[name]


def _check_scalar_finite_terms(out: Any, name: str) -> None:
    """Fail unless a loss's output holds the term ``name`` and every ``loss_*`` term is a
    finite scalar tensor (LOSS-001, NLL-001, DPO-001).

    >>> _check_scalar_finite_terms({"loss_nll": torch.tensor(2.0)}, "loss_nll")
    """
    terms = _loss_terms(out)
    if name not in terms:
        raise _fail(f"no {name!r} among the loss terms {sorted(terms)}")
    for k, v in terms.items():
        if not isinstance(v, torch.Tensor) or v.shape != torch.Size([]):
            shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise _fail(f"{k} has shape {shape}, expected a scalar (shape [])")
        if not torch.isfinite(v):
            raise _fail(f"{k} is {float(v)}, expected a finite value")


@requirement("LOSS-001")
def scalar_finite_terms(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    _check_scalar_finite_terms(loss(_batch(policy, ctx)), "loss_objective")


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
    return m / (b * _t_norm(ctx))


def _t_norm(ctx: Context) -> float:
    t_norm = ctx.impl.extras.get("t_norm")
    # The spec asks for "a declared constant": any positive number (16 or 16.0), not a bool.
    if isinstance(t_norm, bool) or not isinstance(t_norm, int | float) or not t_norm > 0:
        raise _fail(
            "seq_mean_token_sum_norm is declared but Implementation.extras['t_norm'] (a positive "
            f"number) is {t_norm!r}"
        )
    return float(t_norm)


def _call_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The ``input_ids`` and ``attention_mask`` of one policy call, by keyword or position
    (TorchRL's wrapper passes both positionally)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    attn = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    return ids, attn


def _match_row(
    ids: torch.Tensor, attn: torch.Tensor | None, tokens: torch.Tensor, att: torch.Tensor
) -> tuple[int, int, int] | None:
    """The batch row a call's row scores and the offset of its positions, or None.

    A row is matched by its attended tokens: the batch row whose own attended tokens share the
    longest prefix with them (a call may trim, left-pad or re-pad a row, or hold only a part
    of the batch). Returns (batch row, call position minus batch position, shared length).
    """
    called = attn.bool() if attn is not None else torch.ones_like(ids, dtype=torch.bool)
    if not bool(called.any()):
        return None
    c_pos = called.nonzero().flatten()
    seq = ids[c_pos].tolist()
    best: tuple[int, int, int] | None = None
    for i in range(tokens.shape[0]):
        b_pos = att[i].nonzero().flatten()
        row = tokens[i, b_pos].tolist()
        n = 0
        while n < min(len(seq), len(row)) and seq[n] == row[n]:
            n += 1
        if n and (best is None or n > best[2]):
            best = (i, int(c_pos[0]) - int(b_pos[0]), n)
    return best


def _logp_grads(
    policy: Any, loss: Any, td: TensorDictBase, tol: float = 1.0, term: str = "loss_objective"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_objective`` and its gradient with respect to each token's log-prob, [B, T].

    Read through a zero probe added to the logits of every policy call, however the loss
    slices the batch into calls (one batched call, one per sequence trimmed to its length, ...):
    each call's row is matched to the batch row it scores (:func:`_match_row`), and for a term
    that sees the logits only through log p(token_t), d/d logit(token_t) is d/d log p(token_t)
    times (1 - p), p from that call's own logits. Calls scoring one token twice add up.
    A loss whose head never calls the output-embedding module (a fused or chunked head that
    projects the backbone's hidden states with the head's weight itself, as TRL's does) is
    read one step earlier, on the backbone's last hidden state h: there the gradient of such
    a term is d/d log p(token) times W^T (onehot - p). ``tol`` multiplies the float32
    tolerance of that reading (a half-precision policy's).
    """
    at_logits = True
    obj, calls = _probed_call(policy, loss, td, term, at_head=True)
    if not any(p.grad is not None for _, _, p, _ in calls):
        backbone = getattr(policy, "base_model", None)
        if isinstance(backbone, torch.nn.Module) and backbone is not policy:
            at_logits = False
            obj, calls = _probed_call(policy, loss, td, term, at_head=False)
    if not any(p.grad is not None for _, _, p, _ in calls):
        raise _fail(
            "d loss_objective / d logp could not be observed: no call of the policy's output "
            "embedding module or of its backbone carried a gradient (LOSS-002 says whether "
            "the loss reaches the policy at all)"
        )
    head = policy.get_output_embeddings()
    weight = head.weight.detach().cpu().double()
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().cpu().double()
    tokens, att = td.get(TOK), td.get(ATT)
    b, t = tokens.shape
    grad = torch.zeros(b, t, dtype=torch.float64)
    for n_call, (ids, mask, p, feats) in enumerate(calls):
        if p.grad is None:
            continue
        g_all = p.grad.detach().cpu().double()
        hidden = feats.cpu().double()
        logits = hidden if at_logits else hidden @ weight.T + (0.0 if bias is None else bias)
        probs = torch.softmax(logits, -1)
        for r in range(g_all.shape[0]):
            if isinstance(ids, torch.Tensor) and ids.ndim == 2:
                # A mask of another shape (a 4D attention mask) cannot say which are padding.
                flat = isinstance(mask, torch.Tensor) and mask.shape == ids.shape
                m = mask[r].cpu() if flat else None
                found = _match_row(ids[r].cpu(), m, tokens, att)
            else:  # no input_ids to match (inputs_embeds): only the batch's own shape maps
                found = (r, 0, 1) if g_all.shape[:2] == (b, t) else None
            if found is None:
                if float(g_all[r].abs().sum()) > 0:
                    raise _fail(
                        f"loss_objective has a gradient through row {r} of policy call "
                        f"{n_call + 1} of {len(calls)}, whose tokens match no row of the batch"
                    )
                continue
            i, off, _ = found
            pos = torch.arange(1, t)  # logits at s - 1 predict batch token s
            q = pos - 1 + off
            keep = (q >= 0) & (q < g_all.shape[1])
            pos, q = pos[keep], q[keep]
            tok = tokens[i, pos].cpu()
            p_row, g_row = probs[r, q], g_all[r, q]
            picked = torch.arange(len(pos))
            # A term that sees the logits only through log p(token) leaves g * (onehot - p)
            # on them (and W^T of that on h); anything else means the gradient with respect
            # to the log-prob cannot be read, whichever way the loss computed its log-probs.
            direction = -p_row
            direction[picked, tok] += 1.0
            if not at_logits:
                direction = direction @ weight
            norm = (direction * direction).sum(-1).clamp_min(1e-300)
            g = (g_row * direction).sum(-1) / norm
            grad[i, pos] += g
            implied = g[:, None] * direction
            off_by = float((g_row - implied).abs().max()) if len(pos) else 0.0
            scale = float((implied.abs().amax(-1)).max()) if len(pos) else 0.0
            if off_by > tol * (1e-4 * scale + 1e-8):
                where = "logits" if at_logits else "backbone's last hidden state"
                raise _fail(
                    f"d loss_objective / d logp could not be observed: the gradient on the "
                    f"{where} of batch row {i} (policy call {n_call + 1} of {len(calls)}) is "
                    f"not that of a function of the tokens' log-probs alone (off by "
                    f"{off_by:.3g}, largest {scale:.3g}): loss_objective reaches the logits "
                    f"another way (a temperature, an entropy or KL over the vocabulary inside it)"
                )
    return obj.detach(), grad.float()


def _term_logp_grads(policy: Any, loss: Any, td: TensorDictBase, term: str) -> torch.Tensor:
    """:func:`_logp_grads` of the loss term ``term``, its failures speaking of ``term``
    where they speak of loss_objective (the NLL and DPO suites' terms)."""
    try:
        return _logp_grads(policy, loss, td, term=term)[1]
    except ConformanceError as e:
        raise _fail(str(e).replace("loss_objective", term)) from None


def _probed_call(
    policy: Any, loss: Any, td: TensorDictBase, term: str, *, at_head: bool
) -> tuple[torch.Tensor, list[tuple[Any, Any, torch.Tensor, torch.Tensor]]]:
    """``term`` of ``loss(td)`` after its backward, and each probed call: (input_ids,
    attention_mask, the zero probe with its gradient, the probed output). The probe sits on
    the logits (``at_head``) or on the backbone's last hidden state."""
    inputs: list[tuple[Any, Any]] = []
    calls: list[tuple[Any, Any, torch.Tensor, torch.Tensor]] = []

    def enter(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.append(_call_inputs(args, kwargs))

    def leave(_m: Any, _args: Any, _out: Any) -> None:
        inputs.pop()

    def probe(_m: Any, _i: Any, out: Any) -> Any:
        if not at_head:
            h = getattr(out, "last_hidden_state", None)
            if not isinstance(h, torch.Tensor) or h.ndim != 3:
                return out
            p = torch.zeros(h.shape, dtype=h.dtype, device=h.device, requires_grad=True)
            ids, mask = inputs[-1] if inputs else (None, None)
            calls.append((ids, mask, p, h.detach()))
            out["last_hidden_state"] = h + p
            return out
        if not isinstance(out, torch.Tensor) or out.ndim != 3 or out.shape[-1] != V:
            return out
        p = torch.zeros(out.shape, dtype=out.dtype, device=out.device, requires_grad=True)
        ids, mask = inputs[-1] if inputs else (None, None)
        calls.append((ids, mask, p, out.detach()))
        return out + p

    probed = policy.get_output_embeddings() if at_head else policy.base_model
    watched = policy if at_head else policy.base_model
    # The probe before ``leave``: on the backbone both hook the same module, in this order.
    handles = [
        watched.register_forward_pre_hook(enter, with_kwargs=True),
        probed.register_forward_hook(probe),
        watched.register_forward_hook(leave, always_call=True),
    ]
    try:
        obj = _loss_term(loss(td), term)
        if not obj.requires_grad:
            raise _fail(
                f"{term} of loss(batch) has no gradient (requires_grad False, no grad_fn); "
                "expected a term computed from the policy's log-probs, differentiable"
            )
        torch.autograd.backward(obj)
    finally:
        for h in handles:
            h.remove()
    return obj, calls


def _token_advantages(td: TensorDictBase, seed: int) -> torch.Tensor:
    """A [B, T] advantage with a different value at every position (none near 0), so a token
    that reads its neighbour's advantage gets another gradient."""
    b, t = td.get(TOK).shape
    g = torch.Generator().manual_seed(seed + 3)
    mag = 0.5 + torch.rand(b, t, generator=g)
    sign = torch.where(torch.rand(b, t, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


@requirement("LOSS-003")
def aggregation_weights(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
    cases = [("a [B] advantage", td)]
    # A declared sequence ratio (GSPO) spreads a row's advantages over its tokens at ratio 1:
    # LOSS-021 checks it; the per-token reading below is the token ratio's.
    if "per_token_advantage" in ctx.capabilities and _ratio(ctx) != "sequence":
        per_token = td.clone()
        per_token.set(ADV, _token_advantages(td, ctx.seed), inplace=False)
        cases.append(("a [B, T] advantage, different at every position", per_token))
    # A row without assistant tokens weighs nothing whether or not capability global_counts
    # is declared (since 1.6); the capability pins B to the rows holding one (LOSS-016),
    # without it B may count every row (TRL's and TorchRL's means) or those rows.
    counted = _counted_batch(policy, ctx, from_zero=False)
    own = _own_log_probs(policy, counted)  # finite everywhere: counting here, NaN is LOSS-004's
    counted.set(SLP, own)
    counted.set(RLP, own.clone())
    empty = f"a batch of {counted.shape[0]} rows whose row {_EMPTY_ROW} has no assistant token"
    cases.append((empty, counted))
    every_row_ok = "global_counts" not in ctx.capabilities

    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return torch.allclose(x, y, atol=1e-6 * _tol(ctx), rtol=1e-4 * _tol(ctx))

    for what, batch in cases:
        mask = batch.get(ASST)
        n, s = _counts_of(mask)
        _, got = _logp_grads(policy, loss, batch, _tol(ctx))
        adv = batch.get(ADV)
        a = adv[:, None] if adv.ndim == 1 else adv
        want = -a * _weights_for(ctx, mask, n, s).float()
        every = -a * _weights_for(ctx, mask, n, mask.shape[0]).float()
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


def _variant_check(
    ctx: Context, change: Callable[[TensorDictBase], TensorDictBase], what: str, tol: float = 1e-5
) -> None:
    tol *= _tol(ctx)
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
                    1e-5 * _tol(ctx),
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
    # Only a declared option is passed by its name: a factory that declares none need not take
    # any keyword, and rejects this one by name like any other unknown keyword.
    attempts = [
        (
            {name: _unknown_value(name)},
            _unknown_value(name),
            f"an unknown {name} {_unknown_value(name)!r}",
        )
        for name in sorted(ctx.impl.options)
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


def _unknown_value(option: str) -> str:
    return "token_meen" if option == "aggregation" else f"no_such_{option}"


_FIELD_OF = {TOK: "tokens", ATT: "attention_mask", ASST: "assistant_mask"}
_FIELD_OF.update({SLP: "sample_log_probs", RLP: "ref_log_probs", ADV: "advantage"})


def _names_key(message: str, key: tuple[str, ...]) -> bool:
    """Whether ``message`` names ``key``: its field name or its most specific part, as a word
    start (``'log_probs'`` must not be found inside ``'ref_log_probs'``)."""
    words = {_FIELD_OF[key], max((p for p in key if p not in ("full", "next")), key=len)}
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}", message) for w in words)


def _must_refuse(loss: Any, td: TensorDictBase, key: tuple[str, ...], what: str) -> str | None:
    """None if ``loss(td)`` raises naming ``key``, else what went wrong."""
    try:
        with torch.no_grad():
            loss(td)
    except Exception as e:
        if _names_key(str(e), key):
            return None
        text = str(e).splitlines()[0] if str(e) else ""
        return (
            f"a batch with {what} raised {type(e).__name__} without naming {key_str(key)}: {text}"
        )
    return f"a batch with {what} was accepted"


def _refuse_each(loss: Any, refused: list[tuple[TensorDictBase, tuple[str, ...], str]]) -> None:
    """Fail at the first (batch, key, what) that ``loss`` does not refuse naming its key."""
    for td, key, what in refused:
        problem = _must_refuse(loss, td, key, what)
        if problem is not None:
            raise _fail(problem)


def _with(td: TensorDictBase, key: tuple[str, ...], value: torch.Tensor) -> TensorDictBase:
    td.set(key, value, inplace=False)
    return td


@requirement("LOSS-009")
def bad_layout_rejected(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td0 = _batch(policy, ctx)
    asst, att = td0.get(ASST), td0.get(ATT)
    refused: list[tuple[TensorDictBase, tuple[str, ...], str]] = [
        (td0.clone().exclude(ADV), ADV, "the advantage missing"),
        (td0.clone().exclude(SLP), SLP, "the behaviour log-probs missing"),
        (_with(td0.clone(), ASST, asst.float()), ASST, "a float32 assistant mask (0/1)"),
        (_with(td0.clone(), ASST, asst.long()), ASST, "an int64 assistant mask (0/1)"),
        (_with(td0.clone(), ATT, att.to(torch.uint8)), ATT, "a uint8 attention mask (0/1)"),
    ]
    _refuse_each(loss, refused)
    # Widened float fields: refused by name, or the outputs of the same values in float32.
    with torch.no_grad():
        for key in (SLP, ADV, RLP):
            for dtype in (torch.float64, torch.bfloat16, torch.float16):
                value = td0.get(key).to(dtype)
                want = _scalars(loss(_with(td0.clone(), key, value.float())))
                td = _with(td0.clone(), key, value)
                try:
                    got = _scalars(loss(td))
                except Exception as e:
                    if _names_key(str(e), key):
                        continue
                    raise _fail(
                        f"a batch with {dtype_name(dtype)} {key_str(key)} raised {type(e).__name__} "
                        f"without naming the key (refuse it by name, or compute as with float32): "
                        f"{str(e).splitlines()[0] if str(e) else ''}"
                    ) from None
                _same(
                    want,
                    got,
                    f"{dtype_name(dtype)} {key_str(key)} (against the same values in float32)",
                    1e-5 * _tol(ctx),
                )


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

    tol = _tol(ctx)
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
    padded = kl(_pad(inside))
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
    policy, loss = _setup(ctx, peaked=True)
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

    tol = _tol(ctx)
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
    clips = _ratio(ctx) in ("token", "sequence", "gspo_token", "cispo")
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
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
    lengths = td.get(ATT).sum(-1).tolist()
    items = [_trim(td[i], int(n)) for i, n in enumerate(lengths)]
    ragged = LazyStackedTensorDict.lazy_stack(items, 0)
    with torch.no_grad():
        _same(
            _scalars(loss(td)),
            _scalars(loss(ragged)),
            "the ragged form of the batch",
            1e-5 * _tol(ctx),
        )


def _trim(item: TensorDictBase, n: int) -> TensorDictBase:
    out = item.empty()
    for key, v in leaves(item).items():
        out.set(key, v[:n] if v.ndim == 1 and v.shape[0] == T else v)
    return out


def _clip_declaration(ctx: Context) -> tuple[float, float, float | None]:
    """(ε_low, ε_high, dual-clip c or None) from ``Implementation.extras``."""
    eps = ctx.impl.extras.get("clip_epsilon")
    pair = (eps, eps) if isinstance(eps, int | float) else eps
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in pair)
        or not (0 <= pair[0] < 1 and pair[1] >= 0)
    ):
        raise _fail(
            "capability clip is declared but Implementation.extras['clip_epsilon'] is "
            f"{eps!r}; expected a number or a (low, high) pair with 0 <= low < 1 and high >= 0"
        )
    dual = ctx.impl.extras.get("dual_clip")
    if dual is not None and (
        not isinstance(dual, int | float) or isinstance(dual, bool) or not dual > 1 + pair[1]
    ):
        raise _fail(
            f"Implementation.extras['dual_clip'] is {dual!r}; expected a number c > 1 + ε_high"
        )
    return float(pair[0]), float(pair[1]), None if dual is None else float(dual)


def _probe_ratios(lo: float, hi: float, dual: float | None) -> list[float]:
    """Ratios well inside and on both sides of every bound, none within 1% of one."""
    bounds = [lo, hi] + ([dual] if dual is not None else [])
    cands = [lo * 0.5, lo * 0.97, lo * 1.03, 1.0, hi * 0.97, hi * 1.03, hi * 2.0]
    if dual is not None:
        cands += [dual * 0.97, dual * 1.03, dual * 2.0]
    return sorted({r for r in cands if r > 0 and all(abs(r / b - 1) > 0.01 for b in bounds)})


def _clipped_surrogate(
    a: torch.Tensor, r: torch.Tensor, lo: float, hi: float, dual: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate max(-A r, -A clip(r, lo, hi)), with dual clip c its min with
    -A c where A < 0, and where the unclipped term -A r is the active one."""
    unclipped, clipped = -a * r, -a * r.clamp(lo, hi)
    value = torch.maximum(unclipped, clipped)
    active = unclipped >= clipped
    if dual is not None:
        cap = -a * dual
        dual_on = (a < 0) & (cap < value)
        value = torch.where(dual_on, cap, value)
        active &= ~dual_on
    return value, active


@requirement("LOSS-014")
def clipped_surrogate(ctx: Context) -> None:
    if _ratio(ctx) != "token":
        raise NotApplicable(f"option ratio {_ratio(ctx)!r} declared: LOSS-021 checks its surrogate")
    eps_low, eps_high, dual = _clip_declaration(ctx)
    lo, hi = 1 - eps_low, 1 + eps_high
    ratios = _probe_ratios(lo, hi, dual)
    n, prompt, b = len(ratios), 3, 4
    t = prompt + n + 2
    policy, loss = _setup(ctx)
    td = llm_batch(b, t, vocab_size=V, seed=ctx.seed * 7919 + 14)
    # Every row covers every ratio (one per assistant token, shifted by row) and rows differ in
    # length; advantages alternate in sign, so each ratio meets both signs.
    pos = torch.arange(t).expand(b, t)
    lengths = torch.tensor([t, t - 1, t - 2, t])[:b]
    att = pos < lengths[:, None]
    asst = att & (pos >= prompt)
    td.set(ATT, att)
    td.set(ASST, asst)
    r = torch.ones(b, t, dtype=torch.float64)
    for i in range(b):
        for j, p in enumerate(asst[i].nonzero().flatten().tolist()):
            r[i, p] = ratios[(j + i) % n]
    g = torch.Generator().manual_seed(ctx.seed + 14)
    adv = (0.5 + torch.rand(b, generator=g)) * torch.tensor([1.0, -1.0] * (b // 2))
    td.set(ADV, adv)
    logp = _own_log_probs(policy, td)
    slp = torch.where(asst, logp - r.log().float(), float("nan"))
    td.set(SLP, slp)
    td.set(RLP, torch.where(asst, logp, float("nan")))
    # The expected figures, in float64 from the ratios the loss will see (the float32 behaviour
    # log-probs against the same forward pass), away from every bound by 1% or more.
    with torch.no_grad():
        ratio = torch.where(asst, (logp.double() - slp.double()).exp(), 1.0)
        a = adv.double()[:, None].expand(b, t)
        per_token, active = _clipped_surrogate(a, ratio, lo, hi, dual)
        w = _expected_weights(ctx, asst).double()
        want_value = float((per_token * w).where(asst, 0.0).sum())
        want = torch.where(asst & active, -a * ratio * w, 0.0)
    tol = _tol(ctx)
    value, got = _logp_grads(policy, loss, td, tol)
    bad = ~torch.isclose(got.double(), want, atol=1e-6 * tol, rtol=1e-4 * tol)
    if bool(bad.any()):
        i, p = divmod(int(((got.double() - want).abs() * bad).argmax()), t)
        unclipped_side = bool(active[i, p])
        term = "the unclipped term is" if unclipped_side else "a clipped term is"
        raise _fail(
            f"clip bounds [{lo:.4g}, {hi:.4g}]{'' if dual is None else f', dual clip {dual:.4g}'}: "
            f"at ratio {float(ratio[i, p]):.4g} with advantage {float(adv[i]):+.3g} (row {i}, "
            f"position {p}; {term} active), d loss_objective / d logp is "
            f"{float(got[i, p]):.6g}, expected {float(want[i, p]):.6g}"
            f"{' (-A x r x weight)' if unclipped_side else ''}; "
            f"{int(bad.sum())} of {int(asst.sum())} assistant tokens differ"
        )
    if not math.isclose(float(value), want_value, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"clip bounds [{lo:.4g}, {hi:.4g}]: loss_objective is {float(value):.6g} at ratios "
            f"{', '.join(f'{x:.3g}' for x in ratios)} with advantages of both signs, expected "
            f"{want_value:.6g} (the weighted sum of max(-A r, -A clip(r)))"
        )


@requirement("LOSS-015")
def mis_shaped_fields_rejected(ctx: Context) -> None:
    policy, loss = _setup(ctx)
    td0 = _batch(policy, ctx)
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
        problem = _must_refuse(loss, _with(td0.clone(), key, value), key, what)
        if problem is not None:
            raise _fail(problem)


# --- global counts: micro-batches and data-parallel ranks (loss 1.3) ---------------------------

_EMPTY_ROW = 2  # the row of _counted_batch without any assistant token
_SPLITS = (
    ((0,), (1, 2, 3, 4)),  # one row, then the rest
    ((0, 1, 3), (2,), (4,)),  # uneven; a micro-batch without any assistant token
    ((3, 1), (4, 0, 2)),  # shuffled rows
)


def _add_tol(ctx: Context) -> float:
    """LOSS-017/018's relative tolerance in the declared precision (in float64 tighter than
    float32's: the parts and the whole see the same float64 arithmetic)."""
    return _precision(ctx)[2]


def _counted_batch(policy: Any, ctx: Context, *, from_zero: bool = True) -> TensorDictBase:
    """A batch of 5 rows at ratio 1 whose row 2 has no assistant token (prompt only), and
    whose row 0 is an answer from position 0 on: no logit predicts position 0, so it is no
    token of any count (a count of ``mask.sum()`` over every position is one too many)."""
    td = _batch(policy, ctx, b=5, seed=16)
    asst = td.get(ASST).clone()
    asst[_EMPTY_ROW] = False
    if from_zero:
        asst[0, : int(asst[0].nonzero().max()) + 1] = True
    td.set(ASST, asst)
    lp = torch.where(asst, _own_log_probs(policy, td), float("nan"))
    td.set(SLP, lp)
    td.set(RLP, lp.clone())
    return td


def _counts_of(mask: torch.Tensor) -> tuple[int, int]:
    m = mask[:, 1:]
    return int(m.sum()), int(m.any(-1).sum())


def _weights_for(ctx: Context, mask: torch.Tensor, tokens: int, seqs: int) -> torch.Tensor:
    """The declared aggregation's weights with sum(m) -> ``tokens`` and B -> ``seqs``
    (position 0 weighs nothing: no logit predicts it)."""
    m = mask.double()
    m[:, 0] = 0.0
    agg = ctx.options["aggregation"]
    if agg == "token_mean":
        return m / tokens
    if agg == "seq_mean_token_mean":
        return m / (seqs * m.sum(-1, keepdim=True).clamp_min(1))
    if agg == "seq_mean_token_sum":
        return m / seqs
    return m / (seqs * _t_norm(ctx))


def _call_counted(loss: Any, td: TensorDictBase, counts: Any) -> Any:
    try:
        return loss(td, counts=counts)
    except TypeError as e:
        if "counts" in str(e) and "unexpected keyword" in str(e):
            raise _fail(
                f"capability global_counts declared, but loss(td, counts=...) raised: {e}"
            ) from None
        raise


def _trimmed(td: TensorDictBase) -> TensorDictBase:
    """``td`` cut to its longest row (a micro-batch padded to its own width, as loaders do)."""
    n = max(int(td.get(ATT).sum(-1).max()), 2)
    out = td.empty()
    for key, v in leaves(td).items():
        out.set(key, v[:, :n] if v.ndim == 2 and v.shape[1] == td.get(TOK).shape[1] else v)
    return out


@requirement("LOSS-016")
def global_counts_normalize(ctx: Context) -> None:
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = _setup(ctx)
    td = _counted_batch(policy, ctx)
    mask, adv = td.get(ASST), td.get(ADV).double()
    n, s = _counts_of(mask)
    every_row = mask.shape[0]
    # At ratio 1 the surrogate is -A, or -A log pi under a declared ratio "none" or "cispo"
    # (LOSS-021: CISPO's weight sg(clip(1)) is 1).
    rho: Any = 1.0
    if _ratio(ctx) in ("none", "cispo"):
        rho = torch.where(mask, _own_log_probs(policy, td).double(), 0.0)
    cases = [
        ("loss(td), no counts", None, n, s),
        ("counts=GlobalCounts.of(td)", GlobalCounts.of(td), n, s),
        (f"counts of a larger global batch ({3 * n + 5} tokens, {2 * s + 3} sequences)",
         GlobalCounts(3 * n + 5, 2 * s + 3), 3 * n + 5, 2 * s + 3),
    ]  # fmt: skip
    for what, counts, tokens, seqs in cases:
        with torch.no_grad():
            out = loss(td) if counts is None else _call_counted(loss, td, counts)
        got = float(_loss_terms(out)["loss_objective"])
        want = float((-adv[:, None] * rho * _weights_for(ctx, mask, tokens, seqs)).sum())
        if math.isclose(got, want, rel_tol=1e-5 * _tol(ctx), abs_tol=1e-7 * _tol(ctx)):
            continue
        hint = ""
        if ctx.options["aggregation"] != "token_mean":
            all_rows = float((-adv[:, None] * _weights_for(ctx, mask, tokens, every_row)).sum())
            if counts is None and math.isclose(
                got, all_rows, rel_tol=1e-5 * _tol(ctx), abs_tol=1e-7 * _tol(ctx)
            ):
                hint = f" (it counted the row without an assistant token: {every_row} sequences)"
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}, a batch of {every_row} rows, one "
            f"without assistant tokens, {what}: loss_objective at ratio 1 is {got:.6g}, expected "
            f"{want:.6g} (normalized by {tokens} tokens and {seqs} sequences){hint}"
        )


def _value_and_grads(
    policy: Any, loss: Any, td: TensorDictBase, counts: Any
) -> tuple[dict[str, float], torch.Tensor]:
    out = loss(td) if counts is None else _call_counted(loss, td, counts)
    terms = _loss_terms(out)
    total = sum(terms.values())
    params = [p for p in policy.parameters() if p.requires_grad]
    grads: tuple[torch.Tensor | None, ...] = (None,) * len(params)
    if isinstance(total, torch.Tensor) and total.requires_grad:
        grads = torch.autograd.grad(total, params, allow_unused=True)
    flat = torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).detach().double().flatten()
            for g, p in zip(grads, params, strict=True)
        ]
    )
    return {k: float(v.detach().reshape(())) for k, v in terms.items()}, flat


def _split_name(split: tuple[tuple[int, ...], ...]) -> str:
    return " + ".join("[" + ", ".join(map(str, part)) + "]" for part in split)


def _live_batch(policy: Any, ctx: Context) -> TensorDictBase:
    """:func:`_counted_batch` with every term live: off policy inside the clip bounds (sample
    log-probs the policy's own minus per-token offsets), reference log-probs off the policy's
    by δ_t on assistant tokens (a KL term that is not zero) and, under capability
    per_token_advantage, an advantage different at every position."""
    td = _counted_batch(policy, ctx)
    asst = td.get(ASST)
    lo, hi = (0.2, 0.2)
    if "clip" in ctx.capabilities:
        lo, hi, _ = _clip_declaration(ctx)
    cap = min(
        0.1, 0.5 * math.log1p(hi) if hi > 0 else 0.1, -0.5 * math.log1p(-lo) if lo > 0 else 0.1
    )
    g = torch.Generator().manual_seed(ctx.seed + 23)
    eps = torch.where(asst, (torch.rand(asst.shape, generator=g) * 2 - 1) * cap, 0.0)
    own = td.get(SLP)
    td.set(SLP, own - eps.to(own.dtype))
    td.set(RLP, own + _deltas(td, 0.3).to(own.dtype))
    if "per_token_advantage" in ctx.capabilities:
        td.set(ADV, _token_advantages(td, ctx.seed + 5), inplace=False)
    return td


def _ragged(td: TensorDictBase) -> TensorDictBase:
    """``td`` as a lazy stack of its rows, each cut to its attended length."""
    lengths = td.get(ATT).sum(-1).tolist()
    width = td.get(TOK).shape[1]
    items = []
    for i, n in enumerate(lengths):
        item = td[i].empty()
        for key, v in leaves(td[i]).items():
            item.set(key, v[: max(int(n), 2)] if v.ndim == 1 and v.shape[0] == width else v)
        items.append(item)
    return LazyStackedTensorDict.lazy_stack(items, 0)


def _split_strategy(rows: int) -> Any:
    """Any split of ``rows`` rows into micro-batches: an order of the rows, cut anywhere."""
    from hypothesis import strategies as st

    def cut(perm: list[int], cuts: set[int]) -> tuple[tuple[int, ...], ...]:
        edges = [0, *sorted(cuts), rows]
        return tuple(tuple(perm[a:b]) for a, b in itertools.pairwise(edges) if b > a)

    return st.builds(cut, st.permutations(list(range(rows))), st.sets(st.integers(1, rows - 1)))


@requirement("LOSS-017")
def micro_batches_add_up(ctx: Context) -> None:
    if "global_counts" not in ctx.capabilities:
        raise NotApplicable(_micro_batch_dependence(ctx))
    from hypothesis import strategies as st

    from posttrain.conformance.explore import for_all
    from posttrain.contracts.loss import GlobalCounts

    policy, loss = _setup(ctx)
    # Every term live: a term at zero (a KL at ratio 1, reference = policy) adds up whatever
    # it is normalized by.
    td = _live_batch(policy, ctx)
    counts = GlobalCounts.of(td)
    full, g_full = _value_and_grads(policy, loss, td, None)
    add = _add_tol(ctx)
    agg = ctx.options["aggregation"]
    ragged = "ragged" in ctx.capabilities
    per_token = "per_token_advantage" in ctx.capabilities
    rows = td.shape[0]

    def check(case: tuple[tuple[tuple[int, ...], ...], bool]) -> None:
        split, as_ragged = case
        cut = [td[list(p)] for p in split]
        parts = [
            _value_and_grads(policy, loss, _ragged(c) if as_ragged else _trimmed(c), counts)
            for c in cut
        ]
        where = (
            f"aggregation {agg!r}, a batch of {rows} rows (row {_EMPTY_ROW} without assistant "
            f"tokens; off policy, reference log-probs off the policy's"
            f"{', a [B, T] advantage' if per_token else ''}) split into "
            f"{'ragged ' if as_ragged else ''}micro-batches {_split_name(split)}, each called "
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

    boundaries = [(s, False) for s in _SPLITS]
    if ragged:
        boundaries.append((_SPLITS[1], True))
    for_all(
        ctx,
        st.tuples(_split_strategy(rows), st.booleans() if ragged else st.just(False)),
        check,
        examples=4,
        boundaries=boundaries,
    )


def _micro_batch_dependence(ctx: Context) -> str:
    """What a loss without global counts does to one token of a short and of a long answer
    that land in different micro-batches, accumulated as the mean of the micro-batch losses."""
    head = (
        "capability global_counts not declared, so the loss cannot be told the whole batch's counts"
    )
    try:
        policy, loss = _setup(ctx)
        lengths, prompt = (2, 8, 5), 3
        t = prompt + max(lengths) + 1
        td = llm_batch(len(lengths), t, vocab_size=V, seed=ctx.seed * 7919 + 17)
        pos = torch.arange(t).expand(len(lengths), t)
        att = pos < (prompt + torch.tensor(lengths))[:, None]
        td.set(ATT, att)
        td.set(ASST, att & (pos >= prompt))
        lp = torch.where(td.get(ASST), _own_log_probs(policy, td), float("nan"))
        td.set(SLP, lp)
        td.set(RLP, lp.clone())
        td.set(ADV, torch.ones(len(lengths)))
        tol = _tol(ctx)
        _, g = _logp_grads(policy, loss, td, tol)
        one = (-float(g[0, prompt]), -float(g[1, prompt]))
        _, g_short = _logp_grads(policy, loss, td[[0]], tol)
        _, g_long = _logp_grads(policy, loss, td[[1, 2]], tol)
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

    policy, loss = _setup(ctx, peaked=True)
    add = _add_tol(ctx)
    td = _counted_batch(policy, ctx)
    td.set(ADV, td.get(ADV).abs())
    # Ratio e on rows 0 and 3 (all clipped, KL > 0), 1 elsewhere: per-row diagnostics differ.
    shift = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])[:, None]
    td.set(SLP, td.get(SLP) - shift)
    counts = GlobalCounts.of(td)
    with torch.no_grad():
        full = _scalars(loss(td))
    missing = [n for n in _DIAGNOSTICS if n not in full]
    if missing:
        raise _fail(f"capability diagnostics declared but {missing} missing from {sorted(full)}")
    for split in _SPLITS:
        with torch.no_grad():
            parts = [
                (_scalars(_call_counted(loss, _trimmed(td[list(p)]), counts)), p) for p in split
            ]
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
            if not math.isclose(got, want, rel_tol=add, abs_tol=1e-7 * _tol(ctx)):
                shown = ", ".join(f"{v[name]:.4g}" for v, _ in parts)
                raise _fail(
                    f"a batch split into micro-batches {_split_name(split)}, each called with the "
                    f"whole batch's counts ({counts.tokens} tokens): {name} came out {shown}, "
                    f"whose token-weighted reduction (value x {counts.tokens} over each "
                    f"micro-batch's tokens) is {got:.6g}; the whole batch's is {want:.6g} (each "
                    f"must be its sum over assistant tokens / counts.tokens)"
                )


# ---- declared options (since 1.4): checked only where the implementation declares them ----

_KL: dict[str, tuple[Callable[[float], float], Callable[[float], float]]] = {
    "k1": (lambda x: -x, lambda x: -1.0),
    "k2": (lambda x: x * x / 2, lambda x: x),
    "k3": (lambda x: math.exp(x) - 1 - x, lambda x: math.exp(x) - 1),
}
"""Each KL estimator k(log r) and its derivative k'(log r), log r = log pi_ref - log pi."""


def _ratio(ctx: Context) -> str:
    """The declared ``ratio`` option, ``"token"`` where undeclared."""
    return str(ctx.impl.options.get("ratio", "token"))


def _declared(ctx: Context, option: str) -> str:
    if option not in ctx.impl.options:
        raise NotApplicable(f"option {option!r} not declared")
    return str(ctx.options[option])


def _deltas(td: TensorDictBase, base: float) -> torch.Tensor:
    """δ_t = base x (1.8, 0.2, 1.8, ...) along each row: a per-token estimate and one of the
    row's mean log-ratio then differ for every estimator but k1 (linear)."""
    t = td.get(TOK).shape[1]
    return base * torch.where(torch.arange(t) % 2 == 0, 1.8, 0.2).expand(td.get(TOK).shape)


def _kl_batch(policy: Any, ctx: Context, base: float) -> tuple[TensorDictBase, torch.Tensor]:
    """Off policy (sample log-probs = own - ε_t, inside the clip bounds), reference log-probs
    the policy's own + δ_t on assistant tokens: a KL term must read log pi_ref - log pi
    (never the sample log-probs) per token, without importance weights."""
    td, eps = _ratio_batch(policy, ctx)
    delta = _deltas(td, base)
    own = td.get(SLP) + eps.to(td.get(SLP).dtype)  # NaN off assistant tokens
    td.set(RLP, own + delta.to(own.dtype))
    return td, delta.double()


def _k_sum(est: str, w: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor) -> float:
    k = _KL[est][0]
    d = delta[mask].tolist()
    return float(sum(float(x) * k(y) for x, y in zip(w[mask].tolist(), d, strict=True)))


@requirement("LOSS-019")
def declared_kl_estimator(ctx: Context) -> None:
    est = _declared(ctx, "kl_estimator")
    policy, loss = _setup(ctx)
    k = _KL[est][0]
    vals, want_k = {}, {}
    for base in (0.5, -0.5):
        td, delta = _kl_batch(policy, ctx, base)
        with torch.no_grad():
            terms = _loss_terms(loss(td))
        if "loss_kl_to_ref" not in terms:
            raise _fail(f"kl_estimator {est!r} declared but no 'loss_kl_to_ref' in {sorted(terms)}")
        vals[base] = float(terms["loss_kl_to_ref"])
        mask = td.get(ASST)
        want_k[base] = _k_sum(est, _expected_weights(ctx, mask).double(), delta, mask)
    want = want_k[0.5] / want_k[-0.5]
    got = vals[0.5] / vals[-0.5] if vals[-0.5] != 0 else math.inf
    if math.copysign(1.0, vals[0.5]) != math.copysign(1.0, k(0.5)) or not math.isclose(
        got, want, rel_tol=1e-4 * _tol(ctx)
    ):
        raise _fail(
            f"kl_estimator {est!r}: off policy, with reference log-probs the policy's own + "
            f"δ_t and - δ_t (δ_t alternating 0.9, 0.1 along each row's assistant tokens), "
            f"loss_kl_to_ref is {vals[0.5]:.6g} and {vals[-0.5]:.6g} (ratio {got:.6g}); "
            f"expected the sign of k(0.5) = {k(0.5):.6g} and the ratio "
            f"Σ w·k(δ_t) / Σ w·k(-δ_t) = {want:.6g} (per token, of log pi_ref - log pi)"
        )


@requirement("LOSS-020")
def declared_kl_gradient(ctx: Context) -> None:
    form = _declared(ctx, "kl_gradient")
    est = str(ctx.options.get("kl_estimator", "k3"))
    policy, loss = _setup(ctx)
    td, delta = _kl_batch(policy, ctx, 0.5)
    value, got = _logp_grads(policy, loss, td, _tol(ctx), term="loss_kl_to_ref")
    k, dk = _KL[est]
    mask = td.get(ASST)
    w = _expected_weights(ctx, mask).double()
    beta = float(value) / _k_sum(est, w, delta, mask)
    kd = delta.clone().apply_(k)
    dkd = delta.clone().apply_(dk)
    per = -dkd + (kd if form == "score" else 0.0)
    want = (w * beta * per * mask).float()
    if not torch.allclose(got, want, atol=1e-6 * _tol(ctx), rtol=1e-4 * _tol(ctx)):
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
    td = _batch(policy, ctx)
    lo, hi = (0.2, 0.2)
    if "clip" in ctx.capabilities:
        lo, hi, _ = _clip_declaration(ctx)
    cap = min(
        0.1, 0.5 * math.log1p(hi) if hi > 0 else 0.0, -0.5 * math.log1p(-lo) if lo > 0 else 0.0
    )
    g = torch.Generator().manual_seed(ctx.seed + 11)
    eps = (torch.rand(td.get(TOK).shape, generator=g) * 2 - 1) * cap
    mask = td.get(ASST)
    eps = torch.where(mask, eps, 0.0)
    td.set(SLP, td.get(SLP) - eps)
    return td, eps.double()


@requirement("LOSS-021")
def declared_ratio(ctx: Context) -> None:
    kind = _declared(ctx, "ratio")
    policy, loss = _setup(ctx)
    td, eps = _ratio_batch(policy, ctx)
    advantages = [("a [B] advantage", td.get(ADV))]
    if "per_token_advantage" in ctx.capabilities:
        # Varying along T: a sequence ratio's gradient mixes the row's advantages
        # (Σ_t' w_t' A_t' / L per token), which GSPO-token's sg(ρ)·exp(logp_t - sg(logp_t))
        # form does not; a [B] advantage cannot tell the two apart.
        advantages.append(("a [B, T] advantage", _token_advantages(td, ctx.seed)))
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
    value, got = _logp_grads(policy, loss, td, _tol(ctx))
    mask = td.get(ASST)
    m = mask.double()
    w = _expected_weights(ctx, mask).double()
    adv = td.get(ADV).double()
    a = adv[:, None] if adv.ndim == 1 else adv
    logp = torch.where(mask, _own_log_probs(policy, td).double(), 0.0)
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
    tol = _tol(ctx)
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
    if _ratio(ctx) not in ("sequence", "gspo_token"):
        raise NotApplicable(
            f"option ratio {_ratio(ctx)!r}: LOSS-014 and LOSS-023 check a token ratio's clip"
        )
    eps_low, eps_high, dual = _clip_declaration(ctx)
    lo, hi = 1 - eps_low, 1 + eps_high
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx, seed=22)
    asst = td.get(ASST)
    b, t = asst.shape
    # Row i's ratio: above 1 + ε_high or below 1 - ε_low, with A > 0 and A < 0 in turn (a
    # clipped term active in rows 0 and 1, the unclipped one in rows 2 and 3); log r
    # alternates ±0.05 around the row's mean, so clipping each token's ratio reads otherwise.
    targets = [hi * 1.25, lo * 0.75, hi * 1.25, lo * 0.75]
    signs = [1.0, -1.0, -1.0, 1.0]
    rho = torch.tensor([targets[i % 4] for i in range(b)], dtype=torch.float64)
    a = torch.tensor([signs[i % 4] for i in range(b)], dtype=torch.float64)
    a = a * td.get(ADV).double().abs()
    wiggle = torch.where(torch.arange(t) % 2 == 0, 0.05, -0.05).expand(b, t).double()
    logp = _own_log_probs(policy, td)
    slp = torch.where(asst, logp - (rho.log()[:, None] + wiggle).float(), float("nan"))
    td.set(SLP, slp)
    td.set(ADV, a.float())
    with torch.no_grad():
        m = asst.double()
        n = m.sum(-1).clamp_min(1)
        logr = torch.where(asst, logp.double() - slp.double(), 0.0)
        r = (logr.sum(-1) / n).exp()  # the rows' sequence ratios as the loss will see them
        a = td.get(ADV).double()
        per_row, active = _clipped_surrogate(a, r, lo, hi, dual)
        w = _expected_weights(ctx, asst).double()
        want_value = float((per_row[:, None] * w * m).sum())
        row_w = (w * m).sum(-1)
        want = torch.where(active, -a * r * row_w / n, 0.0)[:, None] * m
    tol = _tol(ctx)
    value, got = _logp_grads(policy, loss, td, tol)
    bounds = f"clip bounds [{lo:.4g}, {hi:.4g}]{'' if dual is None else f', dual clip {dual:.4g}'}"
    if not math.isclose(float(value), want_value, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"ratio {_ratio(ctx)!r}, {bounds}: with sequence ratios "
            f"{', '.join(f'{x:.3g}' for x in r[:4].tolist())} and advantages of both signs, "
            f"loss_objective is {float(value):.6g}, expected {want_value:.6g} (Σ w x max(-A ρ, "
            f"-A clip(ρ)), ρ the row's sequence ratio; unclipped it would be "
            f"{float((-a[:, None] * r[:, None] * w * m).sum()):.6g})"
        )
    bad = ~torch.isclose(got.double(), want, atol=1e-6 * tol, rtol=1e-4 * tol)
    if bool(bad.any()):
        i, p = divmod(int(((got.double() - want).abs() * bad).argmax()), t)
        side = "unclipped" if bool(active[i]) else "clipped"
        raise _fail(
            f"ratio {_ratio(ctx)!r}, {bounds}: at sequence ratio {float(r[i]):.4g} with advantage "
            f"{float(a[i]):+.3g} (row {i}, the {side} term active), d loss_objective / d logp at "
            f"position {p} is {float(got[i, p]):.6g}, expected {float(want[i, p]):.6g}"
        )


@requirement("LOSS-023")
def cispo_weight_clipped(ctx: Context) -> None:
    if _ratio(ctx) != "cispo":
        raise NotApplicable(f"option ratio {_ratio(ctx)!r}: LOSS-014 and LOSS-022 check its clip")
    eps_low, eps_high, _ = _clip_declaration(ctx)
    lo, hi = 1 - eps_low, 1 + eps_high
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx, seed=23)
    asst = td.get(ASST)
    b, t = asst.shape
    # Token ratios cycle through above the bounds, inside, below (where 1 - ε_low > 0) and
    # inside again, shifted by one per row, so every row holds clipped and unclipped weights.
    targets = torch.tensor(
        [hi * 1.25, (1 + hi) / 2, lo * 0.75 if lo > 0 else (1 + hi) / 2, (lo + 1) / 2],
        dtype=torch.float64,
    )
    r_set = targets[(torch.arange(t)[None, :] + torch.arange(b)[:, None]) % 4]
    signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(b)], dtype=torch.float64)
    logp = _own_log_probs(policy, td)
    slp = torch.where(asst, logp - r_set.log().float(), float("nan"))
    td.set(SLP, slp)
    td.set(ADV, (signs * td.get(ADV).double().abs()).float())
    with torch.no_grad():
        m = asst.double()
        r = torch.where(asst, (logp.double() - slp.double()).exp(), 1.0)
        c = r.clamp(lo, hi)
        a = td.get(ADV).double()[:, None]
        w = _expected_weights(ctx, asst).double()
        lp = torch.where(asst, logp.double(), 0.0)
        want_value = float((-a * c * lp * w * m).sum())
        want = -a * c * w * m
    tol = _tol(ctx)
    value, got = _logp_grads(policy, loss, td, tol)
    bounds = f"clip bounds [{lo:.4g}, {hi:.4g}]"
    if not math.isclose(float(value), want_value, rel_tol=1e-4 * tol, abs_tol=1e-6 * tol):
        raise _fail(
            f"ratio 'cispo', {bounds}: with token ratios on both sides of the bounds and "
            f"advantages of both signs, loss_objective is {float(value):.6g}, expected "
            f"{want_value:.6g} (Σ w x (-A x sg(clip(r)) x log pi); with the weight unclipped "
            f"it would be {float((-a * r * lp * w * m).sum()):.6g})"
        )
    bad = ~torch.isclose(got.double(), want, atol=1e-6 * tol, rtol=1e-4 * tol)
    if bool(bad.any()):
        i, p = divmod(int(((got.double() - want).abs() * bad).argmax()), t)
        side = "clipped" if bool(c[i, p] != r[i, p]) else "unclipped"
        raise _fail(
            f"ratio 'cispo', {bounds}: at token ratio {float(r[i, p]):.4g} (row {i}, position "
            f"{p}, weight {side}) with advantage {float(a[i, 0]):+.3g}, d loss_objective / d logp "
            f"is {float(got[i, p]):.6g}, expected -A x clip(r) x w = {float(want[i, p]):.6g}"
        )


# ---- kl_approx (since 1.6) ---------------------------------------------------------------------

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
    policy, loss = _setup(ctx)
    td = _batch(policy, ctx)
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
            out = _scalars(loss(batch))
        if "kl_approx" not in out:
            raise _fail(f"capability diagnostics declared but no 'kl_approx' among {sorted(out)}")
        values.append(out["kl_approx"])
    tol = _tol(ctx)
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
