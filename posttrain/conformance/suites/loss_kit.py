"""The loss kit: what the loss, NLL and DPO suites share.

The suite's policy and batches (``setup``, ``make_batch``, ``counted_batch``, ``live_batch``),
the reading of a loss's outputs (``scalars``, ``loss_term``, ``check_same``) and of the
gradient of a loss term with respect to each token's log-prob (``logp_grads``, through a probe
on the logits of every policy call), the declared aggregation's weights and global counts
(``expected_weights``, ``weights_for``, ``counts_of``, ``call_counted``), micro-batch splits
(``SPLITS``, ``split_strategy``, ``trimmed``, ``ragged_form``, ``value_and_grads``), drawn
batch layouts (``LAYOUTS``, ``layout_strategy``, ``layout_batch``: any shape, rows without an
assistant token, holes in an answer) and the refusal checks (``must_refuse``,
``refuse_each``). The checks themselves live in the suites.
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.suites._compare import leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.keys import key_str
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import llm_batch, tiny_causal_lm

V, B, T = 64, 4, 10


K = LLM_LAYOUT_V1.key


TOK, ATT, ASST = K("tokens"), K("attention_mask"), K("assistant_mask")


SLP, RLP, ADV = K("sample_log_probs"), K("ref_log_probs"), K("advantage")


def setup(ctx: Context, *, peaked: bool = False) -> tuple[Any, Any]:
    """The suite's policy and the loss built on it.

    ``peaked``: the output head scaled up, so next-token distributions are far from uniform
    and differ from position to position (the seeded model's are all near log V in entropy,
    which hides an entropy read at the wrong position).
    """
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    if peaked:
        with torch.no_grad():
            policy.get_output_embeddings().weight.mul_(PEAK)
    dtype = declared_precision(ctx)[0]
    if dtype != torch.float32:
        policy.to(dtype)  # the policy's weights in the declared precision, as users train
    # The declared options reach the factory by name (a factory not pre-bound to them is
    # built as declared); a factory declaring none gets no keyword (LOSS-008 says why).
    return policy, ctx.make(policy, **ctx.impl.options)


PEAK = 30.0


def declared_precision(ctx: Context) -> tuple[torch.dtype, float, float]:
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


def tol_factor(ctx: Context) -> float:
    """The factor every float32 tolerance is multiplied by in the declared precision."""
    return declared_precision(ctx)[1]


def own_log_probs(policy: Any, td: TensorDictBase) -> torch.Tensor:
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    return token_log_probs(logits, td.get(TOK))


def make_batch(
    policy: Any, ctx: Context, *, b: int = B, t: int = T, seed: int = 0
) -> TensorDictBase:
    """A batch at ratio 1: behaviour and reference log-probs are the policy's own (NaN elsewhere);
    [B] advantages drawn by the seed, half of them negative, none within 0.1 of 0."""
    td = llm_batch(b, t, vocab_size=V, seed=ctx.seed * 7919 + seed)
    lp = torch.where(td.get(ASST), own_log_probs(policy, td), float("nan"))
    td.set(SLP, lp)
    td.set(RLP, lp.clone())
    g = torch.Generator().manual_seed(ctx.seed * 7919 + seed + 1)
    size = torch.randn(b, generator=g).abs()
    size = torch.where(size < 0.1, size + 0.5, size)  # no tiny advantages
    # Both signs in every batch, in an order drawn by the seed: a loss that drops a sign, or
    # treats one differently, cannot pass on advantages that all share one.
    signs = torch.tensor([1.0 - 2.0 * (i % 2) for i in range(b)])[torch.randperm(b, generator=g)]
    td.set(ADV, size * signs)
    return td


def as_dict(out: Any) -> dict[str, Any]:
    if isinstance(out, TensorDictBase):
        return {k: out.get(k) for k in out.keys()}  # noqa: SIM118
    if hasattr(out, "to_tensordict"):
        td = out.to_tensordict()
        return {k: td.get(k) for k in td.keys()}  # noqa: SIM118
    if hasattr(out, "items"):
        return dict(out.items())
    raise _fail(f"loss returned {type(out).__name__}, expected a TensorDict or a mapping")


def scalars(out: Any) -> dict[str, float]:
    """Every scalar floating-point output, by name (loss terms and diagnostics); a diagnostic
    may be a Python or NumPy float (what ``.item()`` gives a logger) as well as a tensor."""
    res = {}
    for k, v in as_dict(out).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == 1:
            res[str(k)] = float(v.detach().reshape(()))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool | int | numbers.Integral):
            res[str(k)] = float(v)
    return res


def check_same(a: dict[str, float], b: dict[str, float], what: str, tol: float = 1e-5) -> None:
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


def loss_terms(out: Any) -> dict[str, torch.Tensor]:
    return {str(k): v for k, v in as_dict(out).items() if str(k).startswith("loss_")}


def loss_term(out: Any, name: str) -> torch.Tensor:
    """The loss term ``name`` of a loss's output; fails naming the terms there are.

    >>> float(loss_term({"loss_nll": torch.tensor(2.0)}, "loss_nll"))
    2.0
    """
    terms = loss_terms(out)
    if name not in terms:
        raise _fail(f"no {name!r} among the loss terms {sorted(terms)}")
    return terms[name]


def check_scalar_finite_terms(out: Any, name: str) -> None:
    """Fail unless a loss's output holds the term ``name`` and every ``loss_*`` term is a
    finite scalar tensor (LOSS-001, NLL-001, DPO-001).

    >>> check_scalar_finite_terms({"loss_nll": torch.tensor(2.0)}, "loss_nll")
    """
    terms = loss_terms(out)
    if name not in terms:
        raise _fail(f"no {name!r} among the loss terms {sorted(terms)}")
    for k, v in terms.items():
        if not isinstance(v, torch.Tensor) or v.shape != torch.Size([]):
            shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise _fail(f"{k} has shape {shape}, expected a scalar (shape [])")
        if not torch.isfinite(v):
            raise _fail(f"{k} is {float(v)}, expected a finite value")


def expected_weights(ctx: Context, mask: torch.Tensor) -> torch.Tensor:
    m = mask.float()
    b = m.shape[0]
    agg = ctx.options["aggregation"]
    if agg == "token_mean":
        return m / m.sum()
    if agg == "seq_mean_token_mean":
        return m / (b * m.sum(-1, keepdim=True))
    if agg == "seq_mean_token_sum":
        return m / b
    return m / (b * declared_t_norm(ctx))


def declared_t_norm(ctx: Context) -> float:
    t_norm = ctx.impl.extras.get("t_norm")
    # The spec asks for "a declared constant": any positive number (16 or 16.0), not a bool.
    if isinstance(t_norm, bool) or not isinstance(t_norm, int | float) or not t_norm > 0:
        raise _fail(
            "seq_mean_token_sum_norm is declared but Implementation.extras['t_norm'] (a positive "
            f"number) is {t_norm!r}"
        )
    return float(t_norm)


def call_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The ``input_ids`` and ``attention_mask`` of one policy call, by keyword or position
    (TorchRL's wrapper passes both positionally)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    attn = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    return ids, attn


def match_row(
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


def logp_grads(
    policy: Any, loss: Any, td: TensorDictBase, tol: float = 1.0, term: str = "loss_objective"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_objective`` and its gradient with respect to each token's log-prob, [B, T].

    Read through a zero probe added to the logits of every policy call, however the loss
    slices the batch into calls (one batched call, one per sequence trimmed to its length, ...):
    each call's row is matched to the batch row it scores (:func:`match_row`), and for a term
    that sees the logits only through log p(token_t), d/d logit(token_t) is d/d log p(token_t)
    times (1 - p), p from that call's own logits. Calls scoring one token twice add up.
    A loss whose head never calls the output-embedding module (a fused or chunked head that
    projects the backbone's hidden states with the head's weight itself, as TRL's does) is
    read one step earlier, on the backbone's last hidden state h: there the gradient of such
    a term is d/d log p(token) times W^T (onehot - p). ``tol`` multiplies the float32
    tolerance of that reading (a half-precision policy's).
    """
    at_logits = True
    obj, calls = probed_call(policy, loss, td, term, at_head=True)
    if not any(p.grad is not None for _, _, p, _ in calls):
        backbone = getattr(policy, "base_model", None)
        if isinstance(backbone, torch.nn.Module) and backbone is not policy:
            at_logits = False
            obj, calls = probed_call(policy, loss, td, term, at_head=False)
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
            found = _batch_row_of(ids, mask, r, g_all.shape, tokens, att)
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
            g, off_by, scale = _read_logp_grad(
                g_all[r, q], probs[r, q], tokens[i, pos].cpu(), None if at_logits else weight
            )
            grad[i, pos] += g
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


def _batch_row_of(
    ids: Any,
    mask: Any,
    r: int,
    call_shape: torch.Size,
    tokens: torch.Tensor,
    att: torch.Tensor,
) -> tuple[int, int, int] | None:
    """:func:`match_row` of row ``r`` of a policy call whose probed output has ``call_shape``."""
    if isinstance(ids, torch.Tensor) and ids.ndim == 2:
        # A mask of another shape (a 4D attention mask) cannot say which are padding.
        flat = isinstance(mask, torch.Tensor) and mask.shape == ids.shape
        m = mask[r].cpu() if flat else None
        return match_row(ids[r].cpu(), m, tokens, att)
    # No input_ids to match (inputs_embeds): only the batch's own shape maps.
    return (r, 0, 1) if tuple(call_shape[:2]) == tuple(tokens.shape) else None


def _read_logp_grad(
    g_row: torch.Tensor, p_row: torch.Tensor, tok: torch.Tensor, weight: torch.Tensor | None
) -> tuple[torch.Tensor, float, float]:
    """The gradient with respect to each token's log-prob read from the gradient ``g_row`` on
    one call row's logits (``weight`` None) or on its backbone's hidden states (``weight`` the
    head's), with how far ``g_row`` is from that reading and its largest entry."""
    picked = torch.arange(len(tok))
    # A term that sees the logits only through log p(token) leaves g * (onehot - p)
    # on them (and W^T of that on h); anything else means the gradient with respect
    # to the log-prob cannot be read, whichever way the loss computed its log-probs.
    direction = -p_row
    direction[picked, tok] += 1.0
    if weight is not None:
        direction = direction @ weight
    norm = (direction * direction).sum(-1).clamp_min(1e-300)
    g = (g_row * direction).sum(-1) / norm
    implied = g[:, None] * direction
    off_by = float((g_row - implied).abs().max()) if len(tok) else 0.0
    scale = float((implied.abs().amax(-1)).max()) if len(tok) else 0.0
    return g, off_by, scale


def term_logp_grads(policy: Any, loss: Any, td: TensorDictBase, term: str) -> torch.Tensor:
    """:func:`logp_grads` of the loss term ``term``, its failures speaking of ``term``
    where they speak of loss_objective (the NLL and DPO suites' terms)."""
    try:
        return logp_grads(policy, loss, td, term=term)[1]
    except ConformanceError as e:
        raise _fail(str(e).replace("loss_objective", term)) from None


def probed_call(
    policy: Any, loss: Any, td: TensorDictBase, term: str, *, at_head: bool
) -> tuple[torch.Tensor, list[tuple[Any, Any, torch.Tensor, torch.Tensor]]]:
    """``term`` of ``loss(td)`` after its backward, and each probed call: (input_ids,
    attention_mask, the zero probe with its gradient, the probed output). The probe sits on
    the logits (``at_head``) or on the backbone's last hidden state."""
    inputs: list[tuple[Any, Any]] = []
    calls: list[tuple[Any, Any, torch.Tensor, torch.Tensor]] = []

    def enter(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.append(call_inputs(args, kwargs))

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
        obj = loss_term(loss(td), term)
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


def token_advantages(td: TensorDictBase, seed: int) -> torch.Tensor:
    """A [B, T] advantage with a different value at every position (none near 0), so a token
    that reads its neighbour's advantage gets another gradient."""
    b, t = td.get(TOK).shape
    g = torch.Generator().manual_seed(seed + 3)
    mag = 0.5 + torch.rand(b, t, generator=g)
    sign = torch.where(torch.rand(b, t, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


def pad_columns(td: TensorDictBase, extra: int = 3) -> TensorDictBase:
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


FIELD_OF = {TOK: "tokens", ATT: "attention_mask", ASST: "assistant_mask"}


FIELD_OF.update({SLP: "sample_log_probs", RLP: "ref_log_probs", ADV: "advantage"})


def names_key(message: str, key: tuple[str, ...]) -> bool:
    """Whether ``message`` names ``key``: its field name or its most specific part, as a word
    start (``'log_probs'`` must not be found inside ``'ref_log_probs'``)."""
    words = {FIELD_OF[key], max((p for p in key if p not in ("full", "next")), key=len)}
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}", message) for w in words)


def must_refuse(loss: Any, td: TensorDictBase, key: tuple[str, ...], what: str) -> str | None:
    """None if ``loss(td)`` raises naming ``key``, else what went wrong."""
    try:
        with torch.no_grad():
            loss(td)
    except Exception as e:
        if names_key(str(e), key):
            return None
        text = str(e).splitlines()[0] if str(e) else ""
        return (
            f"a batch with {what} raised {type(e).__name__} without naming {key_str(key)}: {text}"
        )
    return f"a batch with {what} was accepted"


def refuse_each(loss: Any, refused: list[tuple[TensorDictBase, tuple[str, ...], str]]) -> None:
    """Fail at the first (batch, key, what) that ``loss`` does not refuse naming its key."""
    for td, key, what in refused:
        problem = must_refuse(loss, td, key, what)
        if problem is not None:
            raise _fail(problem)


def with_value(td: TensorDictBase, key: tuple[str, ...], value: torch.Tensor) -> TensorDictBase:
    td.set(key, value, inplace=False)
    return td


def clip_declaration(ctx: Context) -> tuple[float, float, float | None]:
    """(ε_low, ε_high, dual-clip c or None) from ``Implementation.extras``."""
    eps = ctx.impl.extras.get("clip_epsilon")
    pair = (eps, eps) if isinstance(eps, int | float) else eps
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in pair)
        or not (0 <= pair[0] <= 1 and pair[1] >= 0)
    ):
        raise _fail(
            "capability clip is declared but Implementation.extras['clip_epsilon'] is "
            f"{eps!r}; expected a number or a (low, high) pair with 0 <= low <= 1 (1: no lower "
            "bound) and high >= 0"
        )
    dual = ctx.impl.extras.get("dual_clip")
    if dual is not None and (
        not isinstance(dual, int | float) or isinstance(dual, bool) or not dual > 1 + pair[1]
    ):
        raise _fail(
            f"Implementation.extras['dual_clip'] is {dual!r}; expected a number c > 1 + ε_high"
        )
    return float(pair[0]), float(pair[1]), None if dual is None else float(dual)


def clipped_terms(
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


EMPTY_ROW = 2  # the row of counted_batch without any assistant token


SPLITS = (
    ((0,), (1, 2, 3, 4)),  # one row, then the rest
    ((0, 1, 3), (2,), (4,)),  # uneven; a micro-batch without any assistant token
    ((3, 1), (4, 0, 2)),  # shuffled rows
)


def add_tol(ctx: Context) -> float:
    """LOSS-017/018's relative tolerance in the declared precision (in float64 tighter than
    float32's: the parts and the whole see the same float64 arithmetic)."""
    return declared_precision(ctx)[2]


def counted_batch(
    policy: Any, ctx: Context, *, from_zero: bool = True, rows: int = 5, seed: int = 16
) -> TensorDictBase:
    """A batch of ``rows`` (at least 3) rows at ratio 1 whose row 2 has no assistant token
    (prompt only), and whose row 0 is an answer from position 0 on: no logit predicts
    position 0, so it is no token of any count (a count of ``mask.sum()`` over every position
    is one too many). ``seed`` draws its tokens, lengths and advantages."""
    td = make_batch(policy, ctx, b=rows, seed=seed)
    asst = td.get(ASST).clone()
    asst[EMPTY_ROW] = False
    if from_zero:
        asst[0, : int(asst[0].nonzero().max()) + 1] = True
    td.set(ASST, asst)
    lp = torch.where(asst, own_log_probs(policy, td), float("nan"))
    td.set(SLP, lp)
    td.set(RLP, lp.clone())
    return td


def counts_of(mask: torch.Tensor) -> tuple[int, int]:
    m = mask[:, 1:]
    return int(m.sum()), int(m.any(-1).sum())


def weights_for(ctx: Context, mask: torch.Tensor, tokens: int, seqs: int) -> torch.Tensor:
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
    return m / (seqs * declared_t_norm(ctx))


def call_counted(loss: Any, td: TensorDictBase, counts: Any) -> Any:
    try:
        return loss(td, counts=counts)
    except TypeError as e:
        if "counts" in str(e) and "unexpected keyword" in str(e):
            raise _fail(
                f"capability global_counts declared, but loss(td, counts=...) raised: {e}"
            ) from None
        raise


def trimmed(td: TensorDictBase) -> TensorDictBase:
    """``td`` cut to its longest row (a micro-batch padded to its own width, as loaders do)."""
    n = max(int(td.get(ATT).sum(-1).max()), 2)
    out = td.empty()
    for key, v in leaves(td).items():
        out.set(key, v[:, :n] if v.ndim == 2 and v.shape[1] == td.get(TOK).shape[1] else v)
    return out


def value_and_grads(
    policy: Any, loss: Any, td: TensorDictBase, counts: Any
) -> tuple[dict[str, float], torch.Tensor]:
    out = loss(td) if counts is None else call_counted(loss, td, counts)
    terms = loss_terms(out)
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


def split_name(split: tuple[tuple[int, ...], ...]) -> str:
    return " + ".join("[" + ", ".join(map(str, part)) + "]" for part in split)


def live_batch(policy: Any, ctx: Context, *, rows: int = 5, seed: int = 16) -> TensorDictBase:
    """:func:`counted_batch` with every term live: off policy inside the clip bounds (sample
    log-probs the policy's own minus per-token offsets), reference log-probs off the policy's
    by δ_t on assistant tokens (a KL term that is not zero) and, under capability
    per_token_advantage, an advantage different at every position."""
    td = counted_batch(policy, ctx, rows=rows, seed=seed)
    asst = td.get(ASST)
    lo, hi = (0.2, 0.2)
    if "clip" in ctx.capabilities:
        lo, hi, _ = clip_declaration(ctx)
    cap = min(
        0.1, 0.5 * math.log1p(hi) if hi > 0 else 0.1, -0.5 * math.log1p(-lo) if 0 < lo < 1 else 0.1
    )
    g = torch.Generator().manual_seed(ctx.seed + 23 + (seed - 16))
    eps = torch.where(asst, (torch.rand(asst.shape, generator=g) * 2 - 1) * cap, 0.0)
    own = td.get(SLP)
    td.set(SLP, own - eps.to(own.dtype))
    td.set(RLP, own + deltas(td, 0.3).to(own.dtype))
    if "per_token_advantage" in ctx.capabilities:
        td.set(ADV, token_advantages(td, ctx.seed + 5 + (seed - 16)), inplace=False)
    return td


def ragged_form(td: TensorDictBase) -> TensorDictBase:
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


def split_strategy(rows: int) -> Any:
    """Any split of ``rows`` rows into micro-batches: an order of the rows, cut anywhere."""
    from hypothesis import strategies as st

    def cut(perm: list[int], cuts: set[int]) -> tuple[tuple[int, ...], ...]:
        edges = [0, *sorted(cuts), rows]
        return tuple(tuple(perm[a:b]) for a, b in itertools.pairwise(edges) if b > a)

    return st.builds(cut, st.permutations(list(range(rows))), st.sets(st.integers(1, rows - 1)))


def ratio_option(ctx: Context) -> str:
    """The declared ``ratio`` option, ``"token"`` where undeclared."""
    return str(ctx.impl.options.get("ratio", "token"))


def deltas(td: TensorDictBase, base: float) -> torch.Tensor:
    """δ_t = base x (1.8, 0.2, 1.8, ...) along each row: a per-token estimate and one of the
    row's mean log-ratio then differ for every estimator but k1 (linear)."""
    t = td.get(TOK).shape[1]
    return base * torch.where(torch.arange(t) % 2 == 0, 1.8, 0.2).expand(td.get(TOK).shape)


ADV_POINTS = (0.0, 1e-3, -1e-3, 0.7, -1.3, 50.0, -50.0)
"""Advantages every drawn batch may take besides any in [-5, 5]: zero, tiny, large, both signs."""

Layout = tuple[int, tuple[tuple[int, int, bool, float], ...]]
"""A drawn batch's layout: (width, rows), each row (attended length, first assistant position
(= the length: no assistant token), a hole one position into the answer, advantage)."""

LAYOUTS: tuple[Layout, ...] = (
    (2, ((2, 1, False, 0.7),)),  # one row of width 2: a single assistant token
    (6, ((4, 4, False, 0.7), (6, 1, True, -1.3), (5, 2, False, 0.0))),  # first row empty
    (7, ((7, 3, True, 50.0), (3, 1, False, -1e-3), (5, 5, False, -50.0))),  # last row empty
)
"""Layouts every check over drawn batches tries first: width 2, a first and a last row
without an assistant token, holes in the answer, advantages 0, tiny and large of both signs."""


def layout_strategy(max_rows: int = 8, max_width: int = 12) -> Any:
    """Any :data:`Layout` of 1 to ``max_rows`` rows of width 2 to ``max_width``, at least one
    assistant token in the batch (position 0 excluded: no logit predicts it)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d: Any) -> Layout:
        width = d(st.integers(2, max_width))
        rows = []
        for _ in range(d(st.integers(1, max_rows))):
            length = d(st.integers(2, width))
            start = d(st.integers(1, length))
            hole = length - start >= 3 and d(st.booleans())
            adv = d(st.sampled_from(ADV_POINTS) | st.floats(-5, 5, allow_subnormal=False))
            rows.append((length, start, hole, adv))
        if all(start >= length for length, start, _, _ in rows):
            length, _, _, adv = rows[0]
            rows[0] = (length, length - 1, False, adv)
        return (width, tuple(rows))

    return draw()


def layout_batch(policy: Any, ctx: Context, layout: Layout, *, seed: int = 31) -> TensorDictBase:
    """A batch at ratio 1 laid out as ``layout`` (a prompt, an answer from each row's start,
    a hole (attended, not assistant) where drawn, right padding); tokens drawn by the seed,
    behaviour and reference log-probs the policy's own on every attended position, NaN on
    padding."""
    width, rows = layout
    b = len(rows)
    full = llm_batch(b, max(width, 4), vocab_size=V, seed=ctx.seed * 7919 + seed)
    td = full.empty()
    for key, v in leaves(full).items():
        td.set(key, v[:, :width] if v.ndim == 2 else v)
    pos = torch.arange(width).expand(b, width)
    att = pos < torch.tensor([r[0] for r in rows])[:, None]
    asst = att & (pos >= torch.tensor([r[1] for r in rows])[:, None])
    for i, (_, start, hole, _) in enumerate(rows):
        if hole:
            asst[i, start + 1] = False
    td.set(ATT, att)
    td.set(ASST, asst)
    # Finite on every attended position (prompt and holes too, as a trainer that scores the
    # whole sequence writes them): a loss that reads one there is seen to (LOSS-004).
    lp = torch.where(att, own_log_probs(policy, td), float("nan"))
    td.set(SLP, lp)
    td.set(RLP, lp.clone())
    td.set(ADV, torch.tensor([float(r[3]) for r in rows]))
    return td
