"""Contract ``loss`` v1: a policy-gradient loss over the LLM layout."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Union

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from posttrain.contracts.contract import Capability, Contract, Option
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.contracts.mapping import LOSS_COUNT_FRAMEWORKS, LOSS_COUNT_KEYS
from posttrain.contracts.requirements import Level, Requirement

LossOutput = Union[TensorDictBase, Mapping[str, torch.Tensor]]
"""What a loss returns: ``loss_*`` scalars that sum to the objective, plus diagnostics.

Example:
    >>> out: LossOutput = {"loss_objective": torch.tensor(0.5), "clip_fraction": torch.tensor(0.1)}
    >>> sum(v for k, v in out.items() if k.startswith("loss_")).item()
    0.5
"""

AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
"""How per-token terms become one scalar; the weight of token t of sequence i (m = assistant
mask and attention mask, position 0 excluded; L_i = its count in row i; N = sum(m); B = the
rows with L_i > 0, a row without an assistant token weighs nothing and is not counted
(without capability ``global_counts`` B may count every row instead); T_norm = a declared
constant): token_mean m/N; seq_mean_token_mean m/(B*L_i); seq_mean_token_sum m/B; seq_mean_token_sum_norm m/(B*T_norm). N and B are
``GlobalCounts.of(td)``; under capability ``global_counts`` a call's ``counts`` replaces them.

Example:
    >>> AGGREGATIONS[0]
    'token_mean'
"""


def _count(name: str, value: object) -> int:
    """``value`` as a count: an integral number >= 0 (a 0-dim tensor after an all-reduce too)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not float(value) >= 0 or float(value) != int(float(value)):  # type: ignore[arg-type]
        raise ValueError(f"GlobalCounts.{name}: expected a whole number >= 0, found {value!r}")
    return int(float(value))  # type: ignore[arg-type]


@dataclass(frozen=True)
class GlobalCounts:
    """The counts a loss normalizes by, taken over the *global* batch: every micro-batch of an
    optimizer step on every data-parallel rank.

    ``tokens``: assistant tokens (``assistant_mask`` and ``attention_mask`` True, position 0
    excluded: no logit predicts it). ``sequences``: rows holding at least one such token; a
    row without one weighs nothing and is not counted (verl's rule; TRL's grpo ``.mean()``
    and NeMo-RL's ``sample_mask`` sum count such a row, see the mapping table in the spec).

    A loss under capability ``global_counts`` is called ``loss(td, counts=counts)`` on each
    micro-batch; the micro-batches' ``loss_*`` terms (and their gradients) then add up to the
    whole batch's, so gradient accumulation is a plain sum and data-parallel ranks all-reduce
    gradients by sum. Counts are a call argument, not layout fields: they describe the global
    batch, not a row, and a row-sliced field would travel into buffers and be cut with the
    batch (NeMo-RL's ``global_valid_toks``/``global_valid_seqs`` and TRL's
    ``num_items_in_batch`` are call arguments too). A frozen pair keeps the two together.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> td = llm_batch(4, 8)
        >>> whole = GlobalCounts.of(td)
        >>> GlobalCounts.of(td[:1]) + GlobalCounts.of(td[1:]) == whole
        True
        >>> GlobalCounts(tokens=3, sequences=-1)
        Traceback (most recent call last):
        ...
        ValueError: GlobalCounts.sequences: expected a whole number >= 0, found -1
    """

    tokens: int
    sequences: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _count("tokens", self.tokens))
        object.__setattr__(self, "sequences", _count("sequences", self.sequences))

    def __add__(self, other: GlobalCounts) -> GlobalCounts:
        """The counts of two disjoint parts of a batch together."""
        return GlobalCounts(self.tokens + other.tokens, self.sequences + other.sequences)

    @classmethod
    def of(cls, td: TensorDictBase, layout: Layout = LLM_LAYOUT_V1) -> GlobalCounts:
        """The counts of one batch (padded, or a lazy stack of ragged items).

        Sum them over micro-batches, or all-reduce ``[tokens, sequences]`` over ranks, for the
        global batch.
        """
        k = layout.key
        items = list(td.tensordicts) if isinstance(td, LazyStackedTensorDict) else [td]
        toks = seqs = 0
        for item in items:
            m = item.get(k("assistant_mask")) & item.get(k("attention_mask"))
            per_row = m[..., 1:].reshape(-1, m.shape[-1] - 1).sum(-1)
            toks += int(per_row.sum())
            seqs += int((per_row > 0).sum())
        return cls(toks, seqs)


class LossModuleV1(Protocol):
    """A loss: called on one LLM-layout TensorDict, returns ``loss_*`` scalars.

    Mirrors TorchRL's ``LossModule`` (an ``nn.Module`` called on a TensorDict). The factory
    receives the policy, an HF-style causal LM (``policy(input_ids=..., attention_mask=...)
    .logits`` is [B, T, V]; logits at t predict token t+1).

    Example:
        >>> from posttrain.contracts import LossModuleV1
        >>> def total(loss: LossModuleV1, td):
        ...     out = loss(td)
        ...     return sum(v for k, v in out.items() if k.startswith("loss_"))
    """

    def __call__(self, td: TensorDictBase, /) -> Any:
        """Compute the loss terms for ``td``; never mutate it."""
        ...


class SupportsGlobalCounts(Protocol):
    """Capability ``global_counts``: ``loss(td, counts=GlobalCounts(...))`` normalizes by the
    global batch's counts; without ``counts`` by ``GlobalCounts.of(td)``.

    Example:
        >>> from posttrain.contracts import GlobalCounts, SupportsGlobalCounts
        >>> def micro_step(loss: SupportsGlobalCounts, part, whole: GlobalCounts):
        ...     out = loss(part, counts=whole)
        ...     return sum(v for k, v in out.items() if k.startswith("loss_"))
    """

    def __call__(self, td: TensorDictBase, /, *, counts: GlobalCounts | None = None) -> Any:
        """The loss terms of ``td`` as a part of the batch ``counts`` describes."""
        ...


# The precisions the suite runs a loss in (``Implementation.extras['precision']``, default
# float32): the policy's weights in that dtype, layout fields as the layout says. Each maps to
# (factor, micro-batch tolerance): every float32 tolerance of the suite is multiplied by the
# factor; LOSS-017/018 compare parts with the whole within the second figure, relative to the
# largest magnitude. Half-precision factors are measured, not derived: the largest error seen
# on the bundled and adapted losses over several seeds, with a margin.
LOSS_PRECISIONS: dict[str, tuple[float, float]] = {
    "float32": (1.0, 1e-5),
    "float64": (1.0, 1e-10),
    "float16": (50.0, 5e-3),
    "bfloat16": (400.0, 4e-2),
}


def _precision_table() -> str:
    rows = [
        f"| {name} | x{factor:g} | {add:.0e} |" for name, (factor, add) in LOSS_PRECISIONS.items()
    ]
    return "\n".join(["| precision | float32 tolerances | LOSS-017/018 |", "|---|---|---|", *rows])


def _counts_table() -> str:
    head = "| count | " + " | ".join(LOSS_COUNT_FRAMEWORKS) + " |"
    rule = "|---|" + "---|" * len(LOSS_COUNT_FRAMEWORKS)
    rows = [f"| `{k}` | " + " | ".join(v) + " |" for k, v in LOSS_COUNT_KEYS.items()]
    return "\n".join([head, rule, *rows])


_M, _S = Level.MUST, Level.SHOULD

# What the suite feeds, named once for the domains below.
_BATCH = (
    "The suite's batch: 4 rows of width 10 over a vocabulary of 64 (a 3-token prompt, an "
    "answer, right padding; tokens and lengths drawn by the seed: attended lengths 8, 4, 4, 9, "
    "answers of 5, 1, 1, 6 tokens at seed 0), sample and reference log-probs the policy's own "
    "on assistant tokens (ratio 1) and NaN elsewhere, [B] advantages drawn by the seed, two "
    "positive and two negative in a drawn order, none within 0.1 of 0 (-0.661, -0.267, 0.562, "
    "0.621 at seed 0)"
)
_LAYOUTS = (
    "width 2 with one row of one assistant token; 3 rows whose first has no "
    "assistant token, with a hole and advantages -1.3 and 0; 3 rows whose last has none, with "
    "a hole and advantages 50, -1e-3 and -50; then Hypothesis draws (times "
    "--conformance-depth) of 1 to 8 rows of width 2 to 12, each row an attended length "
    "of 2 to the width, an answer from any position 1 to its end (none, where it starts at the "
    "end: any row may hold no assistant token, the batch at least one), a hole (attended, not "
    "assistant) one position into an answer of 3 or more where drawn, and an advantage of 0, "
    "±1e-3, 0.7, -1.3, ±50 or any in [-5, 5]; ratio 1, behaviour and reference log-probs "
    "the policy's own on every attended position (prompt and holes too), NaN on padding"
)

LOSS = Contract(
    id="loss",
    title="Policy-gradient loss",
    purpose=(
        "Turns a batch in the LLM layout (tokens, masks, behaviour log-probs, advantages) and a "
        "policy into scalar loss terms. The `loss_*` entries sum to the objective; "
        "`loss_objective` is the policy-gradient term. Only assistant-masked tokens may "
        "influence anything.\n\n"
        "Nobody trains on one batch in one process: under capability `global_counts` a loss "
        "takes the global batch's counts (all micro-batches, all data-parallel ranks) as "
        "`loss(td, counts=GlobalCounts(tokens=..., sequences=...))`, so micro-batch losses "
        "add up to the whole batch's (gradient accumulation is a plain sum, ranks all-reduce "
        "gradients by sum). A call argument, not layout fields: the counts describe the global "
        "batch, not a row. `tokens` counts assistant tokens (position 0 excluded); `sequences` "
        "counts rows holding at least one (verl's rule: a row without one weighs nothing and is "
        "not counted). Without `counts` a loss keeps its single-batch meaning. Where the "
        "frameworks take these counts:\n\n" + _counts_table() + "\n\n"
        "Precision: `Implementation.extras['precision']` (default `float32`) says in which dtype "
        "the suite runs the policy's weights; layout fields stay in the layout's dtypes. Every "
        "float32 tolerance of the suite is multiplied by the precision's factor, and LOSS-017/"
        "018 compare micro-batches with the whole batch within the last column (relative to "
        "the largest magnitude). The half-precision figures cover a loss that computes "
        "log-probs from its half-precision logits in float32 (as NeMo-RL and verl do); one that "
        "runs log-softmax in half precision misplaces log-probs by up to about |log p| x 2^-8 "
        "in bfloat16 and fails where that exceeds them (at ratio 1 a `kl_approx` off zero, a "
        "clipped surrogate off its value).\n\n" + _precision_table()
    ),
    protocol=LossModuleV1,
    extra_protocols=(SupportsGlobalCounts, GlobalCounts),
    version="1.10",
    factory=(
        "factory(policy, **overrides) -> LossModuleV1  # policy: an HF-style causal LM the suite "
        "supplies; overrides only in LOSS-008 (a declared option's name, a misspelt keyword); "
        "seq_mean_token_sum_norm reads Implementation.extras['t_norm'], capability clip "
        "extras['clip_epsilon'] (and 'dual_clip'); capability global_counts: "
        "loss(td, counts=GlobalCounts(...)) on micro-batches (LOSS-016 to LOSS-018); "
        "extras['precision'] the dtype of the policy's weights (see Precision); capability diagnostics: extras['kl_approx'] (LOSS-024)"
    ),
    uses_layout=True,
    capabilities=(
        Capability(name="kl_to_ref", text="Adds a KL penalty to the reference log-probs (`ref_log_probs`).", undeclared="No KL term is asked for; `ref_log_probs` are an input like any other: LOSS-004 to LOSS-007 and LOSS-017 feed them off the policy's."),
        Capability(name="per_token_advantage", text="Accepts advantages of shape [B, T] as well as [B].", undeclared="Only [B] advantages are fed; every check that feeds [B, T] ones (LOSS-003, 011, 017, 021) feeds [B] ones as well."),
        Capability(name="ragged", text="Accepts ragged batches (lazy stacks / jagged tensors).", undeclared="Only padded batches are fed (micro-batches padded to their own width in LOSS-017)."),
        Capability(name="diagnostics", text="Returns `clip_fraction`, `kl_approx` and `entropy` alongside the loss terms. `kl_approx` estimates the KL between the behaviour policy and the policy (LOSS-024); `Implementation.extras['kl_approx']` may name the estimator (since 1.6).", undeclared="No diagnostic is asked for; one returned anyway is an output like any other, held to LOSS-004 to LOSS-007."),
        Capability(name="clip", text="Clips the ratio r = exp(logp - sample_log_probs) PPO-style: per token max(-A·r, -A·clip(r, 1 - ε_low, 1 + ε_high)), and with dual clip c > 1 its min with -A·c where A < 0. The bounds are declared in `Implementation.extras`: `clip_epsilon` (ε, or the pair (ε_low, ε_high), 0 <= ε_low <= 1 and ε_high >= 0; ε_low = 1 is a lower bound of 0, no lower clip, as CISPO's weight has) and, for dual clip, `dual_clip` (c > 1 + ε_high).", undeclared="The surrogate is checked at ratio 1 (LOSS-003, LOSS-016) and, off policy, with log r within ±0.1, where no PPO clip bound of 0.2 acts (LOSS-017, LOSS-021)."),
        Capability(name="global_counts", text="`loss(td, counts=GlobalCounts(tokens=..., sequences=...))` normalizes by the global batch's counts (all micro-batches, all data-parallel ranks): sum(m) becomes `counts.tokens` and B `counts.sequences` in the aggregation weights, and diagnostics are sums divided by `counts.tokens`; without `counts`, by `GlobalCounts.of(td)`. Since 1.3.", undeclared="`loss(td)` alone: LOSS-003 checks on every loss (since 1.6) that a row without an assistant token weighs nothing, B counting the rows that hold one or every row (the capability pins the former: LOSS-016); LOSS-017 measures and reports (NOT_APPLICABLE) how the gradient depends on the micro-batch split."),
    ),
    options=(
        Option(name="aggregation", values=AGGREGATIONS, default="token_mean", text="How per-token terms are reduced to a scalar. With m_t the assistant mask (and the attention mask; position 0 excluded: no logit predicts it), L_i = Σ_t m_t of row i, N = Σ_i L_i and B the number of rows with L_i > 0 (a row without an assistant token weighs nothing and is not counted; without capability global_counts B may instead count every row of the batch, as TRL's and TorchRL's means do, the row still weighing nothing), token t of row i weighs `token_mean` w = m/N; `seq_mean_token_mean` w = m/(B·L_i); `seq_mean_token_sum` w = m/B; `seq_mean_token_sum_norm` w = m/(B·T_norm), T_norm = `Implementation.extras['t_norm']`. A term is Σ_i,t w·x_t of its per-token value x (`loss_objective`: x = -A·ρ, ρ the declared ratio). N and B are `GlobalCounts.of(td)`, or under capability global_counts the `counts` passed (formulas stated here since 1.6)."),
        Option(name="kl_estimator", values=("k1", "k2", "k3"), default="k3", text="Capability kl_to_ref: the per-token estimate of KL(pi || pi_ref) from log r = log pi_ref - log pi (Schulman): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. Since 1.4; checked by LOSS-019, where undeclared at its default `k3` (since 1.8)."),
        Option(name="kl_gradient", values=("pathwise", "score"), default="pathwise", text="Capability kl_to_ref: how the KL estimate is differentiated: as written (`pathwise`), or times exp(log pi - sg(log pi)) (`score`: the same value, plus the score-function term k per token; NeMo-RL's form). Since 1.4; checked by LOSS-020, where undeclared at its default `pathwise` (since 1.8)."),
        Option(name="ratio", values=("token", "sequence", "on_policy", "none", "gspo_token", "cispo"), default="token", text="The ratio the surrogate clips: per token r_t = exp(log pi - sample_log_probs); `sequence` the row's geometric mean exp(mean_t log r_t) at every token (GSPO); `on_policy` exactly 1 with the gradient of log pi (NeMo-RL force_on_policy_ratio); `none` the log-prob itself, the surrogate -A log pi (REINFORCE, NeMo-RL disable_ppo_ratio); `gspo_token` GSPO's token form sg(ρ_seq)·pi/sg(pi): the sequence ratio's value, each token's gradient its own (GSPO-token, verl's gspo); `cispo` sg(clip(r_t, 1 - ε_low, 1 + ε_high))·log pi, the surrogate -A·sg(clip(r))·log pi (CISPO, MiniMax-M1). Since 1.4 (`gspo_token` and `cispo` since 1.5); checked by LOSS-021 (LOSS-022 and LOSS-023 for the clipped forms), where undeclared at its default `token` (since 1.8)."),
    ),
    requirements=(
        Requirement(id="LOSS-001", level=_M, title="scalar finite terms", tightened=("1.8", "1.10"),
            text="`loss(td)` MUST return a TensorDict or mapping whose `loss_*` entries are finite scalar tensors, including `loss_objective`.",
            domain=_BATCH + "; one call. Since 1.8 also drawn layouts (8 draws at depth 1), each called under no_grad: " + _LAYOUTS + "."),
        Requirement(id="LOSS-002", level=_M, title="gradients reach the policy", tightened=("1.10",),
            text="The sum of the `loss_*` entries MUST have a gradient that reaches the policy's parameters.", depends_on=("LOSS-001",),
            domain=_BATCH + "; the sum of the `loss_*` terms back-propagated once: some parameter gradient not zero, all finite."),
        Requirement(id="LOSS-003", level=_M, title="aggregation weights", tightened=("1.2", "1.3", "1.6", "1.9", "1.10"),
            text="At ratio 1, the gradient of `loss_objective` with respect to each token's log-prob MUST equal minus the token's advantage (its row's value for a [B] advantage, its own position's value for a [B, T] one under capability per_token_advantage) times the declared aggregation's weight, however the loss calls the policy (one batched call, or several over rows or parts of rows) and however it computes log-probs from the logits; a `loss_objective` that reaches the logits other than through the tokens' log-probs (a temperature, a vocabulary entropy inside it) has no such gradient and fails, saying so. Since 1.9 this holds on every call of one loss object built on a live policy: after training steps, weights loaded into the policy in place, in-place changes of the batch's tokens, advantages and log-probs, and (under capability global_counts) a call with another batch's counts, the gradient is the one the policy's current weights and the batch's current contents give (nothing kept from an earlier call).", depends_on=("LOSS-002",),
            domain="The suite's batch of 4 rows ([B] advantages, none within 0.1 of 0; [B, T] ones different at every position under per_token_advantage) and, since 1.6, a batch of 5 rows one of which holds no assistant token (finite log-probs everywhere), whatever capability global_counts says. Since 1.9 also random call sequences on one loss object (a fixed one, then 2 Hypothesis sequences of 5 steps at depth 1, times --conformance-depth), the policy's output head scaled by 1 or 4: new batches (at most 2 held) of drawn layouts, 1 to 5 rows of width 2 to 10 with rows without an assistant token and holes ([B, T] advantages under per_token_advantage); training steps of lr x the sign of the gradient of `loss_objective` through the loss (lr 1e-3, 1e-2, 0.1); loads of weights with noise in place (`load_state_dict`); in-place changes of a batch's tokens and advantages. Before every batch is scored after every step, its behaviour and reference log-probs are rewritten in place to the policy's current ones and, under global_counts, the loss is first called with counts (3N + 1, 2S + 1)."),
        Requirement(id="LOSS-004", level=_M, title="masked positions are inert", tightened=("1.8", "1.10"),
            text="Changing tokens, log-probs or advantages outside the assistant mask (NaN included) MUST NOT change any output.", depends_on=("LOSS-001",),
            domain=_BATCH + ", then with sample and reference log-probs set to 123, NaN and -1e30 outside the assistant mask (prompt and padding) and the tokens at padding positions changed (prompt tokens stay: they condition the answer); under per_token_advantage also a [B, T] advantage constant along T set to 123 and NaN outside the mask. Since 1.8 also drawn layouts (3 draws at depth 1): " + _LAYOUTS + "; under per_token_advantage a [B, T] advantage with a drawn sign at every position (magnitude in [0.5, 1.5) times the row's |A|, at least 1e-3); then 123, NaN and -1e30 at every log-prob and advantage outside the assistant mask (holes inside an answer included, and for 123 and -1e30 the [B] advantage of a row without an assistant token: whether a NaN one may reach the outputs is not decided) and other tokens at padding positions; compared within 1e-5."),
        Requirement(id="LOSS-005", level=_M, title="padding is inert", tightened=("1.10",),
            text="Appending padding columns (attention and assistant mask False) MUST NOT change any output.", depends_on=("LOSS-001",),
            domain=_BATCH + " with 3 padding columns appended (masks False, log-probs NaN, tokens 0; the [B] advantage unchanged); outputs compared within 1e-5 (times the precision's factor)."),
        Requirement(id="LOSS-006", level=_M, title="batch order is inert", tightened=("1.8", "1.10"),
            text="Permuting the batch MUST NOT change any output beyond float reassociation.", depends_on=("LOSS-001",),
            domain=_BATCH + " in the row order [2, 0, 3, 1]; outputs compared within 1e-5. Since 1.8 also drawn layouts (5 draws at depth 1): " + _LAYOUTS + "; each in a drawn order of its rows (the two 3-row layouts in the cycles [2, 0, 1] and [1, 2, 0] first)."),
        Requirement(id="LOSS-007", level=_M, title="input not mutated", tightened=("1.10",),
            text="`loss(td)` MUST NOT add, remove or change any entry of `td`.", depends_on=("LOSS-001",),
            domain=_BATCH + "; one call, then every leaf compared bit for bit with a copy taken before it (keys added or removed reported)."),
        Requirement(id="LOSS-008", level=_M, title="unknown options rejected", tightened=("1.8",),
            text="Constructing a loss with an unknown option value or keyword argument MUST raise an error naming it.",
            domain="The factory called once per declared option with an unknown value (`token_meen` for `aggregation`, `no_such_<option>` for any other) and, since 1.8, with the declared value's near misses (in upper case, with `_x` appended, cut by its last character, and the empty string; any that is a defined value left out), and once with the misspelt keyword `aggregaton`; the error must contain that value or keyword (the option's name for the empty value)."),
        Requirement(id="LOSS-009", level=_M, title="bad layout rejected", tightened=("1.1", "1.7"),
            text="A batch missing a required field or with a wrong dtype (any other dtype for an integer or bool field: tokens, and masks, which are never taken as weights; a non-floating dtype for a float field) MUST raise an error naming the key; a float field in another floating dtype (float64, bfloat16, float16) is not a wrong dtype: the loss either refuses it naming the key or computes in its own precision and gives the outputs of the same values in the layout dtype.",
            domain="The suite's batch with `sample_log_probs`, `advantage` and `ref_log_probs` each in float64, bfloat16 and float16, one field at a time and, since 1.7, all three at once; since 1.7 the outputs' dtypes are compared with those of the same values in float32 as well as their values."),
        Requirement(id="LOSS-010", level=_M, title="KL to reference", tightened=("1.10",), capability="kl_to_ref",
            text="With reference log-probs equal to the policy's own, `loss_kl_to_ref` MUST be zero; it MUST become positive when they differ on assistant tokens, stay zero when they differ elsewhere only, and stay the same when padding columns are appended (it is reduced over assistant tokens, not positions).", depends_on=("LOSS-001",),
            domain=_BATCH + ": reference log-probs the policy's own (expected 0 within 1e-6), set to -3.0 outside the assistant mask only (0), moved by -0.5 on every assistant token (expected above 1e-6), and that last batch with 3 padding columns appended (the same within 1e-4 relative)."),
        Requirement(id="LOSS-011", level=_M, title="per-token advantages", tightened=("1.10",), capability="per_token_advantage",
            text="An advantage of shape [B, T] constant along T MUST give the same outputs as the [B] advantage.", depends_on=("LOSS-003",),
            domain=_BATCH + " with its [B] advantage broadcast to [B, T] (the row's value at every position, inside and outside the mask); outputs compared within 1e-5."),
        Requirement(id="LOSS-012", level=_M, title="diagnostics over assistant tokens", capability="diagnostics", tightened=("1.2", "1.10"),
            text="`clip_fraction`, `kl_approx` and `entropy` MUST be averaged over assistant-masked tokens only (prompt and padding excluded) — at ratio 1 `clip_fraction` and `kl_approx` are 0, when every assistant token is clipped `clip_fraction` is 1, and `entropy` is the token mean of the full-vocabulary (or sampled) entropy of the distribution each assistant token was drawn from (the logits one position before it; the sampled estimate is -log p of the token).", depends_on=("LOSS-001",),
            domain=_BATCH + " with |A| (the advantages' magnitudes) under the suite's policy with its output head scaled by 30 (peaked next-token distributions whose entropy differs from position to position): at ratio 1 `clip_fraction` and `kl_approx` within 1e-6 of 0 and `entropy` over the whole assistant mask and over masks holding one token per row (each row's first, middle, then last assistant token) against the full-vocabulary and the sampled estimate within 1e-4 relative; every assistant token's ratio at e (`clip_fraction` 1 for ratio `token`, `sequence`, `gspo_token` and `cispo`); then the first assistant token of every row made prompt (`kl_approx` the same within 1e-4 relative)."),
        Requirement(id="LOSS-013", level=_M, title="ragged equals padded", tightened=("1.10",), capability="ragged",
            text="A ragged batch MUST give the same outputs as its right-padded form.", depends_on=("LOSS-001",),
            domain=_BATCH + " as a lazy stack of its 4 rows, each cut to its attended length, against its padded form; outputs compared within 1e-5."),
        Requirement(id="LOSS-014", level=_M, title="clipped surrogate", tightened=("1.8",), capability="clip", since="1.1",
            text="At ratios on both sides of the declared clip bounds and advantages A of both signs, `loss_objective` MUST equal the sum over tokens of the aggregation's weight w times the declared clipped surrogate, and its gradient with respect to each token's log-prob MUST be -A·r·w where the unclipped term is the active one and 0 where a clipped one is (r > 1 + ε_high with A > 0, r < 1 - ε_low with A < 0, r > c with A < 0 under dual clip c).", depends_on=("LOSS-003",),
            domain="4 rows of a 3-token prompt and answers filling widths T, T - 1, T - 2, T (T = 3 + n + 2, n the ratios), each row's assistant tokens cycling through the ratios (shifted by one per row, so each ratio meets both signs), [B] advantages alternating +, -, +, -; values and per-token gradients against float64 within 1e-4 relative. First the probes 0.5 lo, 0.97 lo, 1.03 lo, 1, 0.97 hi, 1.03 hi, 2 hi (and 0.97 c, 1.03 c, 2 c under dual clip c; lo = 1 - ε_low, hi = 1 + ε_high; any within 1% of a bound left out; where lo is 0, 0.02 and 0.3 in place of the three at lo) with magnitudes drawn in [0.5, 1.5). Since 1.8 then every bound approached from both sides at 0.5% (1% in half precision) with advantages 50, -1e-3, 0, -50, and Hypothesis draws (4 at depth 1, times --conformance-depth) of 2 to 8 ratios, each within 5% of a bound or anywhere in [0.05, 4], none nearer a bound than 0.2% (1% in half precision, whose log-probs are coarser), with magnitudes 0, 1e-3, 0.5, 1, 50 or any in [1e-3, 20]."),
        Requirement(id="LOSS-015", level=_S, title="mis-shaped fields rejected", tightened=("1.10",), since="1.1",
            text="A batch whose advantage or log-probs it reads have a shape outside the layout's (an advantage [B, 1] or [B, T - 1], log-probs one position short or long of the tokens) SHOULD raise an error naming the key: nothing is broadcast, padded or cut into place (a SHOULD until v2: no 1.0 sentence asked for it).",
            domain=_BATCH + " with, one at a time, an advantage [B, 1] and [B, T - 1], sample log-probs [B, T - 1] and [B, T + 1] (a NaN column appended) and, under kl_to_ref, reference log-probs [B, T - 1]."),
        Requirement(id="LOSS-016", level=_M, title="global counts normalize", capability="global_counts", since="1.3",
            text="`loss(td, counts=GlobalCounts(tokens=N, sequences=S))` MUST weight every term as the declared aggregation does with the token count sum(m) replaced by N and the row count B by S, whatever the batch's own counts; `loss(td)` MUST equal `loss(td, counts=GlobalCounts.of(td))`, whose `sequences` holds only rows with at least one assistant token (a row without one weighs nothing and is not counted).", depends_on=("LOSS-001",),
            domain="A batch of 5 rows of width 10 (row 2 without an assistant token, row 0 an answer from position 0 on; its other rows drawn as the suite's batch is), ratio 1, [B] advantages; called without counts, with `GlobalCounts.of(td)`, and with the counts of a larger batch (3N + 5 tokens, 2S + 3 sequences); `loss_objective` against float64 within 1e-5 relative."),
        Requirement(id="LOSS-017", level=_M, title="micro-batches add up", since="1.3", tightened=("1.6", "1.7", "1.9"),
            text="Under capability `global_counts`, for every aggregation and any split of a batch into micro-batches (any order of the rows, cut anywhere: uneven, a single row, one without any assistant token; in one process or spread over data-parallel ranks, which all-reduce the shards' counts and then the gradients by sum), with every term live (off policy, reference log-probs off the policy's so a KL term is not zero, a [B, T] advantage under capability per_token_advantage, ragged micro-batches under capability ragged), each called with the whole batch's `GlobalCounts`, the micro-batches' `loss_*` terms MUST sum to the whole batch's (called without counts) and the policy-parameter gradients of their sums to its gradient, within the declared precision's tolerance of the largest magnitude (1e-5 in float32, 1e-10 in float64; see Precision). A loss without the capability is not failed but measured: the suite reports (NOT_APPLICABLE) the gradient weight one token of a short and of a long answer gets in one batch and when they land in different micro-batches accumulated as users write it (the mean of the micro-batch losses).", depends_on=("LOSS-002",),
            domain="A batch of 5 rows (row 2 without an assistant token, row 0 assistant from position 0 on), sample log-probs the policy's own minus offsets within ±0.1 (inside the declared clip bounds), reference log-probs the policy's own plus 0.54 / 0.06 alternating; splits [0] + [1..4], [0, 1, 3] + [2] + [4] and [3, 1] + [4, 0, 2] first, then Hypothesis draws of a row order and cut points (4 at depth 1, times --conformance-depth), each micro-batch padded to its own width or, under ragged, also a lazy stack of rows cut to their lengths. Since 1.7 also across ranks (at --conformance-depth 2 and above until 1.9, at every depth since): the implementation rebuilt in 4 processes forked from a forkserver that imported torch and the implementation's module (from its module:attr import target, or else pickled, its factory importable by name; otherwise NOT_APPLICABLE, saying so) that form gloo process groups of 4 and then 2 ranks on 127.0.0.1, each rank with the environment torchrun sets and its loss built inside the group; the 5-row batch with one rank holding only the row without an assistant token (and, under ragged, in ragged form), then 2 drawn cases per group (times --conformance-depth), each a batch of its own of 4 to 8 rows, its rows in a drawn order cut into one shard per rank and each shard cut anywhere into as many micro-batches as every other rank's (ranks take the same number of accumulation steps; ragged ones drawn under ragged); each rank all-reduces its shard's GlobalCounts, calls the loss on its micro-batches with them and accumulates, then the ranks all-reduce the gradients and loss_* terms by sum, compared with the whole batch's in one process."),
        Requirement(id="LOSS-018", level=_M, title="diagnostics add up", capability="global_counts", since="1.3",
            text="Under capabilities `global_counts` and `diagnostics`, with `counts`, `clip_fraction`, `kl_approx` and `entropy` MUST be sums over the micro-batch's assistant tokens divided by `counts.tokens`, so the micro-batches' values sum to the whole batch's and the metric catalogue's `tok` reduction of the pairs (value x `counts.tokens`, the micro-batch's token count) gives it exactly, never a mean of micro-batch means (within the tolerance of LOSS-017).", depends_on=("LOSS-001",),
            domain="The 5-row batch of LOSS-016 with |A| under the peaked policy of LOSS-012, sample log-probs moved so rows 0 and 3 are at ratio e (all clipped, a KL above 0) and the rest at 1; split into [0] + [1..4], [0, 1, 3] + [2] + [4] and [3, 1] + [4, 0, 2], each micro-batch padded to its own width and called with the whole batch's counts."),
        Requirement(id="LOSS-019", level=_M, title="declared KL estimator", capability="kl_to_ref", since="1.4", tightened=("1.7", "1.8"),
            text="For option `kl_estimator` as declared (its default `k3` where undeclared, since 1.8), off policy (sample log-probs the policy's own minus small per-token offsets) with reference log-probs the policy's own shifted by δ_t on each assistant token (δ_t > 0 varying along the row), then by -δ_t, `loss_kl_to_ref` MUST have the sign of the declared estimator's k(δ) and the ratio loss_kl_to_ref(δ) / loss_kl_to_ref(-δ) MUST equal Σ w·k(δ_t) / Σ w·k(-δ_t) (the coefficient cancels): the estimate is per token, of log pi_ref - log pi, not of a row's mean log-ratio nor weighted by the sampling ratio.",
            domain="δ_t cycling along each row's assistant tokens: 0.9, 0.1 first and, since 1.7, 0.05, 0.6, 1.5, 2.8, 4.0 (a policy far from its reference: k3(4) is about 50), then Hypothesis draws of 2 to 6 sizes in [0.02, 4.5] (4 at depth 1, times --conformance-depth); sample log-probs the policy's own minus offsets within ±0.1."),
        Requirement(id="LOSS-020", level=_M, title="declared KL gradient", capability="kl_to_ref", since="1.4", tightened=("1.8", "1.10"),
            text="For option `kl_gradient` as declared (its default `pathwise` where undeclared, since 1.8), off policy (sample log-probs the policy's own minus small per-token offsets) with reference log-probs the policy's own shifted by δ_t on each assistant token (varying along the row), `loss_kl_to_ref` MUST carry a gradient and its gradient with respect to each assistant token's log-prob MUST be w_t·β·(-k'(δ_t)) (`pathwise`) or w_t·β·(k(δ_t) - k'(δ_t)) (`score`), w the aggregation's weight, k the declared estimator (k3 if undeclared) with k' its derivative in log r, and β = loss_kl_to_ref / Σ w_t·k(δ_t).",
            domain=_BATCH + " off policy (sample log-probs the policy's own minus per-token offsets within ±0.1, and within half the log of each declared clip bound), reference log-probs the policy's own plus δ_t, δ_t alternating 0.9, 0.1 along each row; the per-token gradient against float64 within 1e-4 relative."),
        Requirement(id="LOSS-021", level=_M, title="declared ratio", since="1.4", tightened=("1.5", "1.8", "1.10"),
            text="For option `ratio` as declared (its default `token` where undeclared, since 1.8), off policy (sample log-probs the policy's own minus small per-token offsets, inside the clip bounds), `loss_objective` MUST equal Σ w·(-A·ρ) and its gradient with respect to each token's log-prob the derivative of that sum, with a [B] advantage and, under capability per_token_advantage, a [B, T] one varying along T (under `sequence` each token's gradient then mixes its row's advantages, -ρ·Σ_t' w_t'·A_t'/L, L the row's assistant-token count; under `gspo_token` it is the token's own, -A_t·ρ·w_t), ρ being exp(log r_t) (`token`), exp(mean of log r over the row's assistant tokens) (`sequence`; `gspo_token`: that value, with the gradient of exp(log pi_t - sg(log pi_t)) times it), 1 with the gradient of log pi (`on_policy`), log pi itself (`none`) or sg(r_t)·log pi (`cispo`: value -A·r·log pi, gradient -A·r·w). A declared ratio other than `token` scopes the PPO readings of the other requirements: LOSS-014 is NOT_APPLICABLE, LOSS-012's all-clipped `clip_fraction` of 1 holds for `sequence`, `gspo_token` and `cispo` only, LOSS-003's [B, T]-advantage reading is skipped for `sequence` (a row's ratio mixes its tokens), and LOSS-016's value at ratio 1 is Σ w·(-A·log pi) for `none` and `cispo`.",
            domain=_BATCH + " off policy (sample log-probs the policy's own minus per-token offsets within ±0.1, and within half the log of each declared clip bound), with its [B] advantage and, under per_token_advantage, a [B, T] one of magnitude in [0.5, 1.5) with a drawn sign at every position; value and per-token gradient against float64 within 1e-4 relative."),
        Requirement(id="LOSS-022", level=_M, title="sequence ratio clipped", capability="clip", since="1.4", tightened=("1.5",),
            text="Where option `ratio` is declared `sequence` or `gspo_token`, with sample log-probs that put each row's sequence ratio ρ outside the declared clip bounds (above 1 + ε_high and below 1 - ε_low where that is above 0, advantages of both signs), `loss_objective` MUST equal Σ w·max(-A·ρ, -A·clip(ρ, 1 - ε_low, 1 + ε_high)) (and its min with -A·c where A < 0 under dual clip c), and its gradient with respect to each token's log-prob MUST be zero in the rows where the clipped term is active and -A·ρ·(Σ_row w)/L elsewhere, L the row's assistant-token count (every aggregation's weight is constant along a row, so for `gspo_token`, -A·ρ·w_t, this is the same number).",
            domain="4 rows of width 10 (3-token prompts, answers of 6, 2, 2 and 7 tokens at seed 0) whose sequence ratios are 1.25 hi, 0.75 lo, 1.25 hi, 0.75 lo (hi = 1 + ε_high, lo = 1 - ε_low; where lo is 0, 0.3 in place of 0.75 lo) with advantage signs +, -, -, + (magnitudes the suite's draw), token log-ratios alternating ±0.05 around the row's mean; value and per-token gradient against float64 within 1e-4 relative."),
        Requirement(id="LOSS-023", level=_M, title="CISPO weight clipped", capability="clip", since="1.5",
            text="Where option `ratio` is declared `cispo`, with sample log-probs that put token ratios r above 1 + ε_high, below 1 - ε_low (where that is above 0) and inside the bounds, advantages of both signs, `loss_objective` MUST equal Σ w·(-A·c·log pi) with c = clip(r, 1 - ε_low, 1 + ε_high), and its gradient with respect to each token's log-prob MUST be -A·c·w: a clipped weight bounds the token's gradient, it never zeroes it (PPO's clipped term would).",
            domain="4 rows of width 10 (3-token prompts, answers of 4, 2, 5 and 7 tokens at seed 0) whose token ratios cycle through 1.25 hi, (1 + hi) / 2, 0.75 lo (where lo > 0; else 0.3, which no clip may touch) and (lo + 1) / 2 along each row, shifted by one per row, advantage signs alternating +, -; value and per-token gradient against float64 within 1e-4 relative."),
        Requirement(id="LOSS-024", level=_M, title="kl_approx estimates the behaviour KL", capability="diagnostics", since="1.6",
            text="`kl_approx` MUST be the mean over assistant tokens of one per-token estimate of the KL between the behaviour policy and the policy, of y_t = log pi_t - sample_log_probs_t: KL(pi_sample ‖ pi) by `k1` = -y, `k2` = y²/2 or `k3` = e^y - 1 - y, or KL(pi ‖ pi_sample) by `k1_reverse` = y or `k3_reverse` = e^-y - 1 + y (the one `Implementation.extras['kl_approx']` names where declared, any of them where not), and MUST NOT read `ref_log_probs` (a KL to the reference is `loss_kl_to_ref`'s).", depends_on=("LOSS-012",),
            domain="The suite's batch with y_t cycling 0.6, -0.3, 0.9, -0.5, 0.2, -0.8 along each row (every estimator then gives another mean), reference log-probs the policy's own and then moved by 0.7."),
    ),
)  # fmt: skip
