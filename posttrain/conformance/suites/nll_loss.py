"""The NLL (SFT) loss suite: one check per NLL requirement (specs/nll_loss-v1.md).

Built on the policy-gradient loss suite's machinery (its tiny policy, its gradient probe on
the logits of every policy call, its global-count splits): the NLL is the policy-gradient
objective at ratio 1 with advantage 1 where the term is -log p itself, so the gradient with
respect to each token's log-prob is minus the aggregation's weight, and the value is the
float64 sum of w·(-log p) computed here from the same policy.

Every check draws its batches from the requirement's domain (:class:`Case`, the boundaries
first): 1 to 5 rows, 2 to 24 columns, empty and full rows, ids 0 and V - 1 on assistant
tokens, left padding where padding is the subject, and a policy whose output head is scaled by
any factor from 1 to 1000 (near-one-hot distributions, logits up to about 400 and log p down to
about -600, where a clamped or underflowing log shows), so a term that reaches the logits other
than through log p (a z-loss) leaves a visible gradient. The gradient checks stop at a factor of
30: past it the probe's d/d logit = d/d log p x (1 - p) of the likeliest tokens rounds to 0 in
float32.

NLL-003 also drives a live policy (:func:`check_live`): one loss object scores the same
batches again after training steps and weight loads on the policy it was built on, and after
the batch's tokens change in place; every value must be the formula's from the current weights
and contents (a cache keyed by the batch shows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.explore import for_all
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._compare import leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._live_policy import check_live, scaled_policy
from posttrain.conformance.suites.loss_kit import (
    ASST,
    ATT,
    PEAK,
    RLP,
    SLP,
    TOK,
    V,
    split_strategy,
)
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
from posttrain.testing import llm_batch, tiny_causal_lm

B, T = 4, 10
BIG = 1000.0
"""The largest output-head factor drawn: logits up to about 400, log p down to about -600."""
SCALES = (1.0, PEAK, BIG)


def scales(top: float = BIG) -> Any:
    """Output-head factors from 1 to ``top``: the listed ones and any between.

    Example:
        >>> scales(PEAK).example() <= PEAK
        True
    """
    from hypothesis import strategies as st

    return st.sampled_from(tuple(s for s in SCALES if s <= top)) | st.floats(1.0, top)


@dataclass(frozen=True)
class Case:
    """One batch of the NLL requirements' domain; its repr is the batch's recipe
    (``nll_batch(ctx, Case(...))`` rebuilds it under the run's seed).

    ``empty``: rows without an assistant token, none, ``"one"`` (row 1) or ``"all_but_one"``;
    ``full_row``: row 0 attended and answered from position 0 to the last column; ``edges``:
    ids 0 and V - 1 on row 0's and the last row's assistant tokens; ``scale``: the factor on
    the policy's output head (1000: logits up to about 400); ``left``: every row left-padded.
    """

    rows: int
    width: int
    seed: int = 0
    empty: str = "none"
    full_row: bool = False
    edges: bool = False
    scale: float = 1.0
    left: bool = False


def cases(*, left: bool = False, top: float = BIG) -> Any:
    """The domain's strategy (``left``: left padding drawn too; ``top``: the largest factor on
    the output head, ``PEAK`` where gradients are read)."""
    from hypothesis import strategies as st

    return st.builds(
        Case,
        rows=st.integers(1, 5),
        width=st.integers(2, 24),
        seed=st.integers(0, 2**16),
        empty=st.sampled_from(("none", "one", "all_but_one")),
        full_row=st.booleans(),
        edges=st.booleans(),
        scale=scales(top),
        left=st.booleans() if left else st.just(False),
    )


BOUNDARIES = (
    Case(1, 2),  # one row, one scored position
    Case(5, 24, 1, "one", full_row=True, edges=True, scale=BIG),  # log p far below -100
    Case(4, 11, 2, "all_but_one", full_row=True, scale=PEAK),
    Case(3, 9, 3, edges=True),
    Case(2, 16, 4, "one", scale=BIG / 3),
)
CALM = tuple(replace(c, scale=min(c.scale, PEAK)) for c in BOUNDARIES)
"""The boundaries with the output head scaled by 30 at most (where gradients are read)."""


def nll_batch(ctx: Context, case: Case) -> TensorDictBase:
    """The batch ``case`` describes: ragged right-padded rows (left-padded with ``left``),
    prompts of 0 to length - 2 tokens, each row's answer to its last attended column."""
    b, t = case.rows, case.width
    wide = llm_batch(b, max(t, 8), vocab_size=V, seed=ctx.seed * 7919 + case.seed)
    td = wide.empty()
    for key, v in leaves(wide).items():  # the layout's other fields, cut to T columns
        td.set(key, v[:, :t] if v.ndim == 2 else v)
    g = torch.Generator().manual_seed(ctx.seed * 7919 + case.seed + 1)
    tokens = torch.randint(0, V, (b, t), generator=g)
    # The tiny policy's id 0 is its padding id, whose embedding is zero: a row whose only
    # context is id 0 has no gradient to give. Position 0 is never scored, only context.
    tokens[:, 0] = torch.randint(1, V, (b,), generator=g)
    lengths = torch.randint(2, t + 1, (b,), generator=g) if t > 2 else torch.full((b,), 2)
    prompts = (torch.rand(b, generator=g) * (lengths - 1)).long()
    if case.left:  # the first attended token is a prompt token (no logit of the row predicts it)
        prompts = prompts.clamp_min(1)
    if case.full_row:
        lengths[0], prompts[0] = t, int(case.left)
    pos = torch.arange(t).expand(b, t)
    att = pos < lengths[:, None]
    asst = att & (pos >= prompts[:, None])
    if case.empty == "one" and b > 1:
        asst[1] = False
    elif case.empty == "all_but_one":
        asst[1:] = False
    if case.edges:
        for i in {0, b - 1}:
            at = asst[i].nonzero().flatten()
            at = at[at > 0]
            tokens[i, at[0::2]] = 0
            tokens[i, at[1::2]] = V - 1
    if case.left:
        for i in range(b):
            shift = t - int(lengths[i])
            tokens[i], att[i], asst[i] = (x[i].roll(shift) for x in (tokens, att, asst))
    td.set(TOK, tokens)
    td.set(ATT, att)
    td.set(ASST, asst)
    for key in (SLP, RLP):
        td.set(key, torch.where(asst, -0.5, float("nan")))
    return td


def batch(ctx: Context, *, b: int = B, seed: int = 0) -> TensorDictBase:
    """A batch whose row 0 is an answer from position 0 on: no logit predicts position 0, so
    it weighs nothing (a loss that counts ``mask.sum()`` over every position is one off)."""
    td = llm_batch(b, T, vocab_size=V, seed=ctx.seed * 7919 + seed)
    asst = td.get(ASST).clone()
    asst[0, : int(asst[0].nonzero().max()) + 1] = True
    td.set(ASST, asst)
    return td


class Scaled:
    """The suite's policy at each output-head factor a check draws, and the loss ``make``
    builds on it: each built once per check, on first use."""

    def __init__(self, ctx: Context, make: Callable[[Any], Any]) -> None:
        self.base = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
        self._make = make
        self._built: dict[float, tuple[Any, Any]] = {}

    def __call__(self, case: Any) -> tuple[Any, Any]:
        scale = float(case.scale)
        if scale not in self._built:
            policy = scaled_policy(self.base, scale)
            self._built[scale] = (policy, self._make(policy))
        return self._built[scale]


def build(ctx: Context, policy: Any, smoothing: float = 0.0) -> Any:
    """The loss on ``policy``, the declared options by name; under capability
    label_smoothing with ``label_smoothing=smoothing`` (0.0: the plain NLL of NLL-003 to 008)."""
    kw: dict[str, Any] = dict(ctx.impl.options)
    if "label_smoothing" in ctx.capabilities:
        kw["label_smoothing"] = smoothing
    return ctx.make(policy, **kw)


class Losses(Scaled):
    """The suite's policy at each drawn output-head factor and the loss built on it."""

    def __init__(self, ctx: Context, smoothing: float = 0.0) -> None:
        super().__init__(ctx, lambda policy: build(ctx, policy, smoothing))


def log_probs64(policy: Any, td: TensorDictBase) -> torch.Tensor:
    """log p(token_t) from the logits at t - 1, in float64 ([B, T]; position 0 is 0)."""
    return _log_softmax64(policy, td)[0]


def peaks64(policy: Any, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token_t) and max_v |logit_v| at t - 1, in float64 ([B, T]; position 0: 0): the
    second sizes the float32 rounding of a log-prob computed from those logits."""
    lp, _, top = _log_softmax64(policy, td)
    return lp, top


def _log_softmax64(
    policy: Any, td: TensorDictBase
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(token_t), mean_v log p(v) and max_v |logit_v| from the logits at t - 1, in float64
    (position 0: 0)."""
    with torch.no_grad():
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    picked = lp.gather(-1, td.get(TOK)[:, 1:, None]).squeeze(-1)
    zero = torch.zeros_like(picked[:, :1])
    top = logits[:, :-1].double().abs().amax(-1)
    return (
        torch.cat([zero, picked], dim=1),
        torch.cat([zero, lp.mean(-1)], dim=1),
        torch.cat([zero, top], dim=1),
    )


def value_tol(w: torch.Tensor, top: torch.Tensor) -> float:
    """NLL-003's absolute tolerance: 1e-7, or the float32 rounding of log-probs read from
    logits of magnitude ``top`` (5e-7 of Σ w·max_v |logit|), where larger.

    Example:
        >>> round(value_tol(torch.tensor([0.5, 0.5]), torch.tensor([400.0, 400.0])), 9)
        0.0002
    """
    return max(1e-7, 5e-7 * float((w * top).sum()))


def _nll_want(
    ctx: Context, policy: Any, td: TensorDictBase, tokens: int, seqs: int
) -> tuple[float, float]:
    """The float64 loss_nll of ``td`` normalized by ``tokens`` and ``seqs``, and its tolerance."""
    w = _weights_for(ctx, td.get(ASST) & td.get(ATT), tokens, seqs)
    lp, top = peaks64(policy, td)
    return float((w * -lp).sum()), value_tol(w, top)


def _shape(td: TensorDictBase) -> str:
    m = (td.get(ASST) & td.get(ATT))[:, 1:]
    return (
        f"a batch of {m.shape[0]} rows x {m.shape[1] + 1} columns ({int(m.sum())} assistant "
        f"tokens in {int(m.any(-1).sum())} rows)"
    )


def _smoothing_hint(got: float, plain: float, uniform: float) -> str:
    """Names a label smoothing ``got`` is: the ε with got = (1 - ε)·plain + ε·uniform, when
    it is a round one (a smoothing left on, or its sign flipped)."""
    if uniform == plain:
        return ""
    eps = (got - plain) / (uniform - plain)
    if 1e-3 <= abs(eps) < 1 and abs(eps - round(eps, 3)) < 1e-4:
        return (
            f" (it is the NLL label-smoothed with ε = {round(eps, 3):g}: (1 - ε)·NLL + ε·mean "
            f"over the vocabulary of -log p; undeclared, ε is 0)"
        )
    return ""


@requirement("NLL-001")
def scalar_finite_terms(ctx: Context) -> None:
    losses = Losses(ctx)

    def check(case: Case) -> None:
        _, loss = losses(case)
        _check_scalar_finite_terms(loss(nll_batch(ctx, case)), "loss_nll")

    for_all(ctx, cases(), check, examples=6, boundaries=BOUNDARIES[:2])


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
    losses = Losses(ctx)

    def check(case: Case) -> None:
        policy, loss = losses(case)
        gradient_reaches(policy, _loss_term(loss(nll_batch(ctx, case)), "loss_nll"), "loss_nll")

    for_all(ctx, cases(top=PEAK), check, examples=4, boundaries=BOUNDARIES[:2])


@requirement("NLL-003")
def loss_value(ctx: Context) -> None:
    losses = Losses(ctx)

    def check(case: Case) -> None:
        policy, loss = losses(case)
        td = nll_batch(ctx, case)
        with torch.no_grad():
            got = float(_loss_term(loss(td), "loss_nll"))
        want, tol = _nll_want(ctx, policy, td, *_counts_of(td.get(ASST) & td.get(ATT)))
        if math.isclose(got, want, rel_tol=1e-5, abs_tol=tol):
            return
        lp, mean_lp, top = _log_softmax64(policy, td)
        attended = td.get(ATT).clone()
        attended[:, 0] = False
        every = float(-(lp * attended).sum() / attended.sum())
        mask = td.get(ASST) & td.get(ATT)
        w = _weights_for(ctx, mask, *_counts_of(mask))
        hint = _smoothing_hint(got, want, float((w * -mean_lp).sum()))
        if math.isclose(got, every, rel_tol=1e-5):
            hint = " (it is the token mean over every attended token, the prompt's included)"
        low = float(torch.where(mask[:, 1:], lp[:, 1:], 0.0).min())
        raise _fail(
            f"aggregation {ctx.options['aggregation']!r}: loss_nll of {_shape(td)}, output "
            f"head x {case.scale:g} (logits up to {float(top.max()):.4g}, assistant log p down "
            f"to {low:.4g}) is {got:.6g}, expected {want:.6g} (sum of w x -log p over the "
            f"assistant tokens, log p from the logits one position earlier, in float64){hint}"
        )

    for_all(ctx, cases(), check, examples=12, boundaries=BOUNDARIES)

    def live(policy: Any, loss: Any, td: TensorDictBase) -> dict[str, tuple[float, float, float]]:
        with torch.no_grad():
            got = float(_loss_term(loss(td), "loss_nll"))
        want, tol = _nll_want(ctx, policy, td, *_counts_of(td.get(ASST) & td.get(ATT)))
        return {"loss_nll": (got, want, tol)}

    check_live(
        ctx,
        lambda policy: build(ctx, policy),
        lambda _policy, case: nll_batch(ctx, case),
        live,
        "loss_nll",
        what=f"aggregation {ctx.options['aggregation']!r}",
        formula="sum of w x -log p",
        recipes=cases(top=PEAK),
        start=BOUNDARIES[3],
        scales=SCALES,
    )


@requirement("NLL-004")
def gradient_through_log_probs(ctx: Context) -> None:
    losses = Losses(ctx)

    def check(case: Case) -> None:
        policy, loss = losses(case)
        td = nll_batch(ctx, case)
        mask = td.get(ASST) & td.get(ATT)
        got = _term_logp_grads(policy, loss, td, "loss_nll")
        want = (-_weights_for(ctx, mask, *_counts_of(mask))).float()
        if not torch.allclose(got, want, atol=1e-6, rtol=1e-4):
            i, t = divmod(int((got - want).abs().argmax()), want.shape[1])
            where = (
                "an assistant token"
                if mask[i, t] and t
                else "a position outside the assistant mask"
            )
            raise _fail(
                f"aggregation {ctx.options['aggregation']!r}, {_shape(td)}: d loss_nll / d logp "
                f"at row {i}, position {t} ({where}) is {float(got[i, t]):.6g}, expected "
                f"-weight = {float(want[i, t]):.6g}"
            )

    for_all(ctx, cases(top=PEAK), check, examples=6, boundaries=CALM[:3])


def _scramble(td: TensorDictBase, shift: int) -> TensorDictBase:
    pad = ~td.get(ATT)
    return _with(td, TOK, torch.where(pad, (td.get(TOK) + shift) % V, td.get(TOK)))


@requirement("NLL-005")
def padding_inert(ctx: Context) -> None:
    from hypothesis import strategies as st

    losses = Losses(ctx)

    def check(drawn: tuple[Case, int, int]) -> None:
        case, extra, shift = drawn
        policy, loss = losses(case)
        td = nll_batch(ctx, case)
        where = (
            f"{'left' if case.left else 'right'}-padded {_shape(td)}, output head x {case.scale:g}"
        )
        mask = td.get(ASST) & td.get(ATT)
        tol = max(
            1e-5, value_tol(_weights_for(ctx, mask, *_counts_of(mask)), peaks64(policy, td)[1])
        )
        with torch.no_grad():
            base = _scalars(loss(td.clone()))
            for changed, what in (
                (_pad(td.clone(), extra), f"appending {extra} padding columns"),
                (_scramble(td.clone(), shift), "changing the tokens at padding positions"),
            ):
                _same(base, _scalars(loss(changed)), f"{where}: {what}", tol)

    strategy = st.tuples(cases(left=True), st.integers(1, 5), st.integers(1, V - 1))
    edge = (
        (Case(3, 12, 4, left=True), 3, 17),
        (Case(2, 10, 5, "one", left=True, scale=PEAK), 1, 1),
        (Case(3, 14, 7, left=True, scale=BIG), 2, 9),
        (BOUNDARIES[2], 5, 30),
    )
    for_all(ctx, strategy, check, examples=5, boundaries=edge)


_NOT_BOOL = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int8, torch.uint8,
)  # fmt: skip


@requirement("NLL-006")
def bad_layout_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    _, loss = _setup(ctx)

    def check(rows: int) -> None:
        td0 = nll_batch(ctx, Case(rows, 10, 6))
        refused = [
            (td0.clone().exclude(TOK), TOK, "the tokens missing"),
            (td0.clone().exclude(ASST), ASST, "the assistant mask missing"),
            (td0.clone().exclude(ATT), ATT, "the attention mask missing"),
        ]
        for key, name in ((ASST, "assistant"), (ATT, "attention")):
            for dtype in _NOT_BOOL:
                value = td0.get(key).to(dtype)
                what = f"a {str(dtype).removeprefix('torch.')} {name} mask (0/1)"
                refused.append((_with(td0.clone(), key, value), key, f"{what}, {rows} rows"))
        _refuse_each(loss, refused)

    for_all(ctx, st.integers(1, 4), check, examples=1, boundaries=[4, 1])


def counted_batch(ctx: Context) -> TensorDictBase:
    """5 rows: row 0 an answer from position 0 on, row 2 without any assistant token."""
    td = batch(ctx, b=5, seed=16)
    asst = td.get(ASST).clone()
    asst[_EMPTY_ROW] = False
    td.set(ASST, asst)
    return td


@requirement("NLL-007")
def global_counts_normalize(ctx: Context) -> None:
    from hypothesis import strategies as st

    from posttrain.contracts.loss import GlobalCounts

    losses = Losses(ctx)

    def check(drawn: tuple[Case, float, float]) -> None:
        case, more_tokens, more_rows = drawn
        policy, loss = losses(case)
        td = nll_batch(ctx, case)
        n, s = _counts_of(td.get(ASST) & td.get(ATT))
        tokens, seqs = round(n * more_tokens), round(s * more_rows)
        with torch.no_grad():
            got = float(_loss_term(_call_counted(loss, td, GlobalCounts(tokens, seqs)), "loss_nll"))
        want, tol = _nll_want(ctx, policy, td, tokens, seqs)
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=tol):
            raise _fail(
                f"aggregation {ctx.options['aggregation']!r}, {_shape(td)} called with "
                f"counts=GlobalCounts({tokens}, {seqs}): loss_nll is {got:.6g}, expected "
                f"{want:.6g} (normalized by {tokens} tokens and {seqs} sequences)"
            )

    factor = st.sampled_from((1.0, 1000.0)) | st.floats(1.0, 1000.0)
    edge = [(BOUNDARIES[1], 1.0, 1.0), (BOUNDARIES[2], 3.4, 1000.0), (BOUNDARIES[0], 1000.0, 2.0)]
    for_all(ctx, st.tuples(cases(), factor, factor), check, examples=5, boundaries=edge)


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
        # 1e-5 of the largest magnitude among the whole's value and the parts': a sum of parts
        # that nearly cancel keeps their float32 rounding, not a share of the small total
        sums = {
            n: (
                sum(t.get(n, 0.0) for t, _ in parts),
                full.get(n, 0.0),
                [t.get(n, 0.0) for t, _ in parts],
            )
            for n in names
        }
        for m in metrics:
            if m in full_m:
                each = [pm.get(m, 0.0) for pm in parts_m]
                sums[m] = (sum(each), full_m[m], each)
        for name, (got, want, each) in sorted(sums.items()):
            largest = max([abs(want), 1e-6, *(abs(x) for x in each)])
            if not abs(got - want) <= 1e-5 * largest:  # NaN fails too
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


def with_split(strategy: Any, rows_of: Any) -> Any:
    """``strategy``'s draws paired with any split of their ``rows_of(draw)`` rows."""
    from hypothesis import strategies as st

    def pair(x: Any) -> Any:
        n = rows_of(x)
        split = split_strategy(n) if n > 1 else st.just(((0,),))
        return st.tuples(st.just(x), split)

    return strategy.flatmap(pair)


@requirement("NLL-008")
def micro_batches_add_up(ctx: Context) -> None:
    from posttrain.contracts.loss import GlobalCounts

    losses = Losses(ctx)

    def check(drawn: tuple[Case, tuple[tuple[int, ...], ...]]) -> None:
        case, split = drawn
        policy, loss = losses(case)
        td = nll_batch(ctx, case)
        where = f"aggregation {ctx.options['aggregation']!r}, {_shape(td)}"
        splits = _SPLITS if split == () else (split,)  # () marks the counted batch's three
        check_parts_add_up(policy, loss, td, GlobalCounts.of(td), splits, where)

    counted = Case(5, 10, 16, "one", full_row=True)
    edge = [(counted, ()), (BOUNDARIES[0], ((0,),))]
    for_all(ctx, with_split(cases(top=PEAK), lambda c: c.rows), check, examples=3, boundaries=edge)


def _declared_smoothing(ctx: Context) -> float:
    eps = ctx.impl.extras.get("label_smoothing")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise _fail(
            "capability label_smoothing is declared but Implementation.extras['label_smoothing'] "
            f"(a number in (0, 1)) is {eps!r}"
        )
    return float(eps)


def _param_grads(policy: Any, term: torch.Tensor) -> torch.Tensor:
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = torch.autograd.grad(term, params, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).detach().double().flatten()
            for g, p in zip(grads, params, strict=True)
        ]
    )


@requirement("NLL-009")
def label_smoothing_as_declared(ctx: Context) -> None:
    eps = _declared_smoothing(ctx)
    losses = Losses(ctx, eps)

    def check(case: Case) -> None:
        policy, loss = losses(case)
        td = nll_batch(ctx, case)
        mask = td.get(ASST) & td.get(ATT)
        w = _weights_for(ctx, mask, *_counts_of(mask))
        lp, mean_lp, _ = _log_softmax64(policy, td)
        plain, uniform = float((w * -lp).sum()), float((w * -mean_lp).sum())
        want = (1 - eps) * plain + eps * uniform
        term = _loss_term(loss(td), "loss_nll")
        got = float(term.detach())
        what = (
            f"label smoothing ε = {eps:g}, aggregation {ctx.options['aggregation']!r}, {_shape(td)}"
        )
        if not math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7):
            hint = ""
            for value, why in (
                (plain, "the NLL unsmoothed: label_smoothing=ε did not reach it"),
                ((1 - eps) * plain - eps * uniform, "the smoothing term with its sign flipped"),
                ((1 + eps) * plain - eps * uniform, "the smoothing term with its sign flipped"),
                (plain + eps * uniform, "the smoothing term added without (1 - ε)"),
            ):
                if math.isclose(got, value, rel_tol=1e-5):
                    hint = f" (it is {why})"
                    break
            raise _fail(
                f"{what}: loss_nll is {got:.6g}, expected {want:.6g} = (1 - ε)·{plain:.6g} + "
                f"ε·{uniform:.6g} (the NLL and the mean over the vocabulary of -log p, "
                f"float64){hint}"
            )
        logits = policy(input_ids=td.get(TOK), attention_mask=td.get(ATT).long()).logits
        lsm = torch.log_softmax(logits[:, :-1].double(), -1)
        per_token = -(1 - eps) * lsm.gather(-1, td.get(TOK)[:, 1:, None])[..., 0]
        per_token = per_token - eps * lsm.mean(-1)
        g_want = _param_grads(policy, (w[:, 1:] * per_token).sum())
        g_got = _param_grads(policy, term)
        err = float((g_got - g_want).abs().max())
        if not err <= 1e-4 * max(float(g_want.abs().max()), 1e-12):
            raise _fail(
                f"{what}: the policy-parameter gradients of loss_nll differ from those of "
                f"(1 - ε)·NLL + ε·mean over the vocabulary of -log p by up to {err:.3g} "
                f"(largest {float(g_want.abs().max()):.3g}): the smoothing does not reach the "
                f"logits as label smoothing does"
            )

    for_all(ctx, cases(top=PEAK), check, examples=6, boundaries=CALM[:3])
