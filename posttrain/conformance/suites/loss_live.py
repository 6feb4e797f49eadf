"""LOSS-003 on one loss object on a live policy (since loss 1.9), driven statefully.

The model is the requirement's own closed form: at ratio 1 the gradient of ``loss_objective``
with respect to each token's log-prob is minus its advantage times the declared aggregation's
weight, whatever the policy's weights are. :func:`~._live_policy.check_live` runs random
sequences on one loss object: new batches (drawn layouts, [B, T] advantages under capability
per_token_advantage), training steps through the loss itself, weight loads in place, in-place
changes of a batch's tokens and advantages. Before every scoring the batch's behaviour and
reference log-probs are rewritten, in its own tensors, to the policy's current ones (ratio 1
at the current weights) and, under capability global_counts, the loss is first called with
another batch's counts; the gradient must then be the closed form's for the batch's own counts.
A loss that keeps log-probs, advantages or counts from an earlier call, or a reference to
weights since replaced, shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.suites._live_policy import check_live
from posttrain.conformance.suites.loss_kit import (
    ADV,
    ASST,
    ATT,
    LAYOUTS,
    RLP,
    SLP,
    Layout,
    call_counted,
    counts_of,
    declared_precision,
    layout_batch,
    layout_strategy,
    logp_grads,
    own_log_probs,
    ratio_option,
    token_advantages,
    weights_for,
)
from posttrain.contracts.loss import GlobalCounts

SCALES = (1.0, 4.0)
"""Factors on the policy's output head a sequence starts from. Training steps sharpen the
distributions further, and the gradient probe reads d/d log p as d/d logit / (1 - p): past
these, a likely token's 1 - p keeps too few float32 digits for the 1e-4 comparison."""


@dataclass(frozen=True)
class LiveBatch:
    """One batch of a live sequence; its repr is its recipe (``layout_batch`` under the run's
    seed, with a [B, T] advantage different at every position where ``per_token``)."""

    layout: Layout
    seed: int = 0
    per_token: bool = False
    scale: float = 1.0


def live_batches(per_token: bool) -> Any:
    """Batches of 1 to 5 rows of width 2 to 10 (rows without an assistant token, holes)."""
    from hypothesis import strategies as st

    return st.builds(
        LiveBatch,
        layout=layout_strategy(max_rows=5, max_width=10),
        seed=st.integers(0, 2**16),
        per_token=st.booleans() if per_token else st.just(False),
    )


def check_live_weights(ctx: Context, *, examples: int = 2, steps: int = 5) -> None:
    """LOSS-003's closed form on every call of one loss object on a live policy."""
    per_token = "per_token_advantage" in ctx.capabilities and ratio_option(ctx) != "sequence"
    counted = "global_counts" in ctx.capabilities
    dtype, tol, _ = declared_precision(ctx)

    def make(policy: Any) -> Any:
        if dtype != torch.float32:
            policy.to(dtype)
        return ctx.make(policy, **ctx.impl.options)

    def batch_of(policy: Any, recipe: LiveBatch) -> TensorDictBase:
        td = layout_batch(policy, ctx, recipe.layout, seed=recipe.seed)
        if recipe.per_token:
            td.set(ADV, token_advantages(td, recipe.seed), inplace=False)
        return td

    def score(policy: Any, loss: Any, td: TensorDictBase) -> dict[str, tuple[float, float, float]]:
        # Ratio 1 at the current weights, written where the batch's tensors lie: the loss sees
        # the same objects with new contents.
        lp = torch.where(td.get(ATT), own_log_probs(policy, td), float("nan"))
        td.get(SLP).copy_(lp)
        td.get(RLP).copy_(lp)
        mask = td.get(ASST)
        n, s = counts_of(mask)
        if counted:
            with torch.no_grad():
                call_counted(loss, td, GlobalCounts(tokens=3 * n + 1, sequences=2 * s + 1))
        _, got = logp_grads(policy, loss, td, tol)
        adv = td.get(ADV).double()
        a = adv[:, None] if adv.ndim == 1 else adv
        want = -a * weights_for(ctx, mask, n, s)
        if not counted:  # B may count every row without the capability (the aggregation's text)
            every = -a * weights_for(ctx, mask, n, mask.shape[0])
            if (got.double() - every).abs().max() < (got.double() - want).abs().max():
                want = every
        i, t = divmod(int((got.double() - want).abs().argmax()), got.shape[1])
        w = float(want[i, t])
        atol = 1e-6 * tol + 1e-4 * tol * abs(w)
        return {f"d loss_objective / d log p at row {i}, position {t}": (float(got[i, t]), w, atol)}

    check_live(
        ctx,
        make,
        batch_of,
        score,
        "loss_objective",
        what=f"aggregation {ctx.options['aggregation']!r}",
        formula="-advantage x weight at ratio 1",
        in_place=(ADV,),
        recipes=live_batches(per_token),
        start=LiveBatch(LAYOUTS[1], per_token=per_token),
        scales=SCALES,
        examples=examples,
        steps=steps,
    )
