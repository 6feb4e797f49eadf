"""Round-three blind one-bug variants of a policy-gradient loss (contract ``loss`` v1),
written from ``specs/loss-v1.md`` alone (the suites unread), to measure the kit's reach.

The base, :class:`HookedR3`, is ``losses_options.MaskedMeanLoss`` (one batched call, masked
per-token terms, global counts, diagnostics, clip-higher bounds (0.2, 0.28), dual clip 3)
with its ``__call__`` opened into two hooks: reading the batch, and the per-position entropy.
It conforms. Each variant changes one thing, a bug of a kind not named in
``loss_variants.py`` nor ``losses_options.py``: asymmetric clip bounds swapped, an entropy
one position off, an in-place clean-up of the caller's batch, aggregation weights rounded to
half precision. ``DEMOS[name]()`` shows the bug with plain code against the sentence (True
when it shows).

Results (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; the base ``HookedR3`` passes each
id):

- ``clip_bounds_swapped`` breaks LOSS-014: **caught** (LOSS-014: clip bounds [0.8, 1.28],
  dual clip 3: at ratio 1.242 with advantage +1.43 (row 2, position 5; the unclipped term is
  active), d loss_objective / d logp)
- ``entropy_own_position`` breaks LOSS-012: **caught** (LOSS-012: at ratio 1, entropy is
  1.84859; over the assistant tokens, of the distributions they were drawn from (the logits
  one position earlier), the full-vocab)
- ``nan_to_num_in_place`` breaks LOSS-007: **caught** (LOSS-007: loss(td) mutated its input:
  key ('log_probs', 'full') changed; key ('next', 'ref_log_probs', 'full') changed (see
  specs/loss-v1.md#LOSS-007))
- ``weights_in_half`` breaks LOSS-003: **caught** (LOSS-003: aggregation
  'seq_mean_token_mean', a [B] advantage: d loss_objective / d logp at row 0, position 3 (an
  assistant token) is -0.0330595, expected -advan)

Base on the same ids and declarations: LOSS-003, LOSS-007, LOSS-012 and LOSS-014 all PASS.

Example:
    >>> from posttrain.testing import llm_batch, tiny_causal_lm
    >>> out = HookedR3(tiny_causal_lm(vocab_size=64), clip_epsilon=(0.2, 0.28))(llm_batch(2, 9, vocab_size=64))
    >>> sorted(k for k in out if k.startswith("loss_"))
    ['loss_kl_to_ref', 'loss_objective']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, GlobalCounts, Implementation
from tests.independent.losses_options import MaskedMeanLoss, _Batch, _counts_of

__all__ = ["BREAKS", "DEMOS", "VARIANTS", "HookedR3"]

_K = LLM_LAYOUT_V1.key


class HookedR3(MaskedMeanLoss):
    """``MaskedMeanLoss`` with hooks for reading the batch and the entropy; the same terms.

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss = HookedR3(tiny_causal_lm(vocab_size=64))
        >>> float(loss(llm_batch(3, 10, vocab_size=64))["entropy"]) > 0
        True
    """

    def read(self, td: TensorDictBase) -> _Batch:
        return _Batch(td, kl=self.kl, per_token_adv=True, dtype=torch.float32)

    def entropy(self, logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """[B, T]: at t, the entropy of the distribution token t was drawn from (logits t - 1)."""
        p = torch.softmax(logits[:, :-1], -1)
        ent = -(p * logp).sum(-1)
        return torch.cat([ent.new_zeros(ent.shape[0], 1), ent], 1)

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        b = self.read(td)
        counts = counts if counts is not None else _counts_of(b.m)
        logits = self.policy(input_ids=b.tokens, attention_mask=b.att.long()).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        lp = torch.cat(
            [logp.new_zeros(b.m.shape[0], 1), logp.gather(-1, b.tokens[:, 1:, None])[..., 0]], 1
        )
        lp = torch.where(b.m, lp, torch.zeros_like(lp))
        w = self.weights(b, counts)
        a = b.adv
        rho = self.rho(lp, b)
        clipped = torch.zeros_like(b.m)
        per = -a * rho if self.ratio == "none" else self.clipped_surrogate(a, rho)
        if self.bounds is not None and self.ratio in ("token", "sequence"):
            lo, hi = self.bounds
            r = rho.detach()
            clipped = b.m & ((r < lo) | (r > hi))
        zero = torch.zeros((), dtype=per.dtype)
        out: dict[str, torch.Tensor] = {"loss_objective": torch.where(b.m, w * per, zero).sum()}
        if self.kl:
            assert b.ref is not None
            x = torch.where(b.m, b.ref - lp, torch.zeros_like(lp))
            kt = self.kl_term(self.kl_value(x), lp)
            out["loss_kl_to_ref"] = self.kl_coef * torch.where(b.m, w * kt, zero).sum()
        with torch.no_grad():
            n = max(counts.tokens, 1)
            lr = torch.where(b.m, b.slp - lp, torch.zeros_like(lp))
            ent = self.entropy(logits, logp)
            out["clip_fraction"] = clipped.sum().float() / n
            out["kl_approx"] = torch.where(b.m, torch.exp(lr) - 1 - lr, zero).sum() / n
            out["entropy"] = torch.where(b.m, ent, zero).sum() / n
        return out


class ClipBoundsSwapped(HookedR3):
    """BUG: clip-higher's asymmetric bounds (ε_low, ε_high) = (0.2, 0.28) unpacked in the
    wrong order, the ratio clipped to [1 - ε_high, 1 + ε_low] = [0.72, 1.2] instead of
    [0.8, 1.28] (DAPO's decoupled clip, verl's ``clip_ratio_low``/``clip_ratio_high``, two
    floats of one tuple whose order nothing checks): the symmetric default ε hides it.
    Plausible. Breaks LOSS-014 (``loss_objective`` MUST equal Σ w times the declared clipped
    surrogate, gradient 0 where a clipped term is active: r > 1 + ε_high with A > 0, r < 1 -
    ε_low with A < 0)."""

    def __init__(self, policy: Any, **kw: Any) -> None:
        super().__init__(policy, **kw)
        eps = kw.get("clip_epsilon")
        if isinstance(eps, (tuple, list)):
            self.bounds = (1 - float(eps[1]), 1 + float(eps[0]))


class EntropyOwnPosition(HookedR3):
    """BUG: ``entropy`` at token t taken from the logits at t (the distribution of the *next*
    token) instead of t - 1, the one token t was drawn from: the log-probs are shifted, the
    entropy is not (huggingface/trl#5620, "Fix entropy calculation in SFT": "Bug 1 --
    Misaligned by one position"; PrimeIntellect-ai/prime-rl#1525's review: "Entropy tensor
    not shifted causing position misalignment"). Breaks LOSS-012 (``entropy``
    is the token mean of the entropy of "the distribution each assistant token was drawn
    from (the logits one position before it)")."""

    def entropy(self, logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        full = torch.log_softmax(logits, -1)
        return -(full.exp() * full).sum(-1)


class NanToNumInPlace(HookedR3):
    """BUG: the NaN the producer wrote outside the assistant mask (TorchRL's convention) is
    cleaned up with ``nan_to_num_(0.0)`` on the tensor ``td.get`` returned, which is the
    caller's own storage: the loss's values are right, but the batch the caller keeps (for
    a replay buffer, a second epoch, a logging hook) now holds 0 where it held NaN. The
    aliasing slip of an in-place op on a TensorDict entry. Plausible. Breaks LOSS-007
    (``loss(td)`` MUST NOT add, remove or change any entry of ``td``)."""

    def read(self, td: TensorDictBase) -> _Batch:
        for name in ("sample_log_probs", "ref_log_probs"):
            key = _K(name)
            if key in td.keys(include_nested=True):
                v = td.get(key)
                if v.is_floating_point():
                    v.nan_to_num_(0.0)
        return super().read(td)


class WeightsInHalf(HookedR3):
    """BUG: the aggregation weights m/N (or m/(B·L_i), m/B) built in float16 to halve a
    [B, T] buffer under mixed precision and widened back: 1/N is rounded to 11 significant
    bits (up to 2^-12 relative), so every token's gradient is off by that much, and past
    N of about 16,000 tokens 1/N is a float16 subnormal and loses more bits. Plausible (a
    dtype chosen for memory, not for the sum). Breaks LOSS-003 (the gradient MUST equal minus
    the token's advantage times the declared aggregation's weight)."""

    def weights(self, b: _Batch, counts: GlobalCounts) -> torch.Tensor:
        w = super().weights(b, counts)
        return w.to(torch.float16).to(torch.float32)


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------

_EXTRAS: dict[str, Any] = {"clip_epsilon": (0.2, 0.28), "dual_clip": 3.0}


def _impl(cls: type[HookedR3], name: str, aggregation: str = "token_mean") -> Implementation:
    options: dict[str, Any] = {
        "aggregation": aggregation,
        "kl_estimator": "k3",
        "kl_gradient": "pathwise",
        "ratio": "token",
    }
    return Implementation(
        "loss",
        functools.partial(cls, **options, **_EXTRAS),
        name=name,
        capabilities={
            "kl_to_ref",
            "clip",
            "global_counts",
            "diagnostics",
            "per_token_advantage",
        },
        options={k: str(v) for k, v in options.items()},
        extras=dict(_EXTRAS),
        description=(cls.__doc__ or "").split("\n\n")[0],
    )


BASE = _impl(HookedR3, "r3/loss-base")
BASE_SEQ = _impl(HookedR3, "r3/loss-base-seq", "seq_mean_token_mean")

VARIANTS: dict[str, Implementation] = {
    "clip_bounds_swapped": _impl(ClipBoundsSwapped, "r3/loss-clip-bounds-swapped"),
    "entropy_own_position": _impl(EntropyOwnPosition, "r3/loss-entropy-own-position"),
    "nan_to_num_in_place": _impl(NanToNumInPlace, "r3/loss-nan-to-num-in-place"),
    "weights_in_half": _impl(WeightsInHalf, "r3/loss-weights-in-half", "seq_mean_token_mean"),
}

# Each variant's correct design (the hooks as they conform, same aggregation), by variant.
BASES: dict[str, Implementation] = {
    "clip_bounds_swapped": BASE,
    "entropy_own_position": BASE,
    "nan_to_num_in_place": BASE,
    "weights_in_half": BASE_SEQ,
}

BREAKS: dict[str, str] = {
    "clip_bounds_swapped": "LOSS-014",
    "entropy_own_position": "LOSS-012",
    "nan_to_num_in_place": "LOSS-007",
    "weights_in_half": "LOSS-003",
}

# ------------------------------------------------------------------------------------------
# demos
# ------------------------------------------------------------------------------------------

_V = 32


def _policy() -> Any:
    from posttrain.testing import tiny_causal_lm

    return tiny_causal_lm(vocab_size=_V, seed=3)


def _batch(n: int, t: int = 10, seed: int = 0) -> TensorDictBase:
    from posttrain.testing import llm_batch

    return llm_batch(n, t, vocab_size=_V, seed=seed)


def _on_policy(policy: Any, td: TensorDictBase) -> TensorDictBase:
    """``td`` with sample log-probs the policy's own (ratio 1), NaN outside the mask kept."""
    tok, att = td.get(_K("tokens")), td.get(_K("attention_mask"))
    with torch.no_grad():
        ids = torch.where(att, tok, torch.zeros_like(tok))
        z = torch.log_softmax(policy(input_ids=ids, attention_mask=att.long()).logits, -1)
    lp = torch.cat(
        [z.new_zeros(tok.shape[0], 1), z[:, :-1].gather(-1, tok[:, 1:, None])[..., 0]], 1
    )
    m = td.get(_K("assistant_mask")) & att
    slp = td.get(_K("sample_log_probs"))
    slp.copy_(torch.where(m, lp, slp))
    return td


def demo_clip_bounds_swapped() -> bool:
    """r = 1.25 with A > 0: inside [0.8, 1.28], so the token's gradient is -A·r·w, not 0."""
    policy = _policy()
    td = _on_policy(policy, _batch(2, 10, seed=1))
    slp = td.get(_K("sample_log_probs"))
    m = td.get(_K("assistant_mask")) & td.get(_K("attention_mask"))
    slp.copy_(torch.where(m, slp - float(torch.log(torch.tensor(1.25))), slp))
    td.set("advantage", torch.ones(2))

    def grads(cls: type[HookedR3]) -> float:
        loss = cls(policy, clip_epsilon=(0.2, 0.28), kl_to_ref=False)
        policy.zero_grad()
        loss(td)["loss_objective"].backward()
        return sum(float(p.grad.abs().sum()) for p in policy.parameters() if p.grad is not None)

    return grads(HookedR3) > 0 and grads(ClipBoundsSwapped) == 0


def demo_entropy_own_position() -> bool:
    """The spec's entropy: the mean over assistant tokens t of H(softmax(logits[t - 1])), on
    a sharpened policy (weights x 5) whose entropy varies along a row."""
    policy, td = _policy(), _batch(3, 10, seed=2)
    with torch.no_grad():
        for q in policy.parameters():
            q.mul_(5.0)
    tok, att = td.get(_K("tokens")), td.get(_K("attention_mask"))
    m = td.get(_K("assistant_mask")) & att
    m[:, 0] = False
    with torch.no_grad():
        ids = torch.where(att, tok, torch.zeros_like(tok))
        z = torch.log_softmax(policy(input_ids=ids, attention_mask=att.long()).logits.double(), -1)
    h = -(z.exp() * z).sum(-1)
    spec = float(sum(float(h[i, t - 1]) for i, t in m.nonzero().tolist()) / int(m.sum()))

    def ent(cls: type[HookedR3]) -> float:
        return float(cls(policy)(td)["entropy"])

    return abs(ent(HookedR3) - spec) < 1e-5 and abs(ent(EntropyOwnPosition) - spec) > 1e-3


def demo_nan_to_num_in_place() -> bool:
    """The caller's batch holds NaN outside the mask before the call and not after."""
    policy, td = _policy(), _batch(3, 10, seed=3)
    before = td.get(_K("sample_log_probs")).clone()
    HookedR3(policy)(td)
    kept = torch.equal(td.get(_K("sample_log_probs")).isnan(), before.isnan())
    NanToNumInPlace(policy)(td)
    changed = not torch.equal(td.get(_K("sample_log_probs")).isnan(), before.isnan())
    return kept and changed


def demo_weights_in_half() -> bool:
    """Token mean over N = 7 tokens: the weight 1/7 differs from its float16 rounding."""
    policy, td = _policy(), _batch(3, 10, seed=4)
    b = _Batch(td, kl=True, per_token_adv=True, dtype=torch.float32)
    c = GlobalCounts(tokens=7, sequences=3)
    spec = b.m.double() / 7
    base = HookedR3(policy).weights(b, c).double()
    bug = WeightsInHalf(policy).weights(b, c).double()

    def rel(x: torch.Tensor) -> float:
        return float(((x - spec).abs() / spec.clamp(min=1e-30)).max())

    return rel(base) < 1e-6 and rel(bug) > 1e-5


DEMOS: dict[str, Callable[[], bool]] = {
    "clip_bounds_swapped": demo_clip_bounds_swapped,
    "entropy_own_position": demo_entropy_own_position,
    "nan_to_num_in_place": demo_nan_to_num_in_place,
    "weights_in_half": demo_weights_in_half,
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {}
