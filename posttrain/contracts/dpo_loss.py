"""Contract ``dpo_loss`` v1: the direct preference optimization (DPO) loss over the LLM layout."""

from __future__ import annotations

from posttrain.contracts.contract import Capability, Contract, Option
from posttrain.contracts.loss import GlobalCounts, LossModuleV1, SupportsGlobalCounts
from posttrain.contracts.requirements import Level, Requirement

_M = Level.MUST

_PAIRS_SHAPES = (
    "Batches of 1 to 4 pairs (rows 2i, 2i + 1 sharing a prompt of 0 to T - 2 tokens) and T from "
    "2 to 20 columns, token ids in [0, V) with 0 and V - 1 on assistant tokens as boundaries, "
    "answers of any length, right-padded, a pair answered from position 0 to the last column; "
    "reference log-probs the policy's own minus per-token offsets, from within ±1 to ±200 "
    "nats (margins β·Δ of either sign from ties, Δ = 0, to past ±100, where σ underflows in "
    "float32), β the declared one; "
)
_PAIRS_TAIL = " The boundaries first: one pair of T = 2, a tie, the largest margins."
_PAIRS = (
    _PAIRS_SHAPES + "the policy's output head scaled by any factor from 1 to 1000, the factors "
    "1, 30 and 1000 tried (at 1000 logits of magnitude up to about 400, log p down to about "
    "-600)." + _PAIRS_TAIL
)
_GRAD_PAIRS = (
    _PAIRS_SHAPES + "the policy's output head scaled by any factor from 1 to 30, 1 and 30 "
    "tried (past it the float32 gradient of the likeliest tokens, d/d logit = d/d log p·"
    "(1 - p), rounds to 0 and cannot be read; DPO-003 checks the values there)." + _PAIRS_TAIL
)
_LIVE = (
    " Then (since 1.2) one loss object built on a live policy, first in a fixed sequence on "
    "one batch (output head x 1): scored, a training step, a weight load, an in-place change of "
    "the batch, a second batch and a training step on it; then in random sequences of up to 5 "
    "steps (10 from depth 2), the output head scaled by 1, 30 or 1000: up to 2 batches, each "
    "scored again after "
    "every step (`loss_preference` and the metrics); training steps of the policy between "
    "calls (each weight moved by lr·sign of the gradient of `loss_preference` through the loss "
    "itself, lr 1e-3 to 0.1), new weights loaded into it in place (`load_state_dict`, as a "
    "weight sync does), and a batch's tokens and `ref_log_probs` changed in place in the same "
    "TensorDict; each value compared with the formula from the policy's current weights and "
    "the batch's current contents."
)
_FLOAT32 = (
    "(absolute: 1e-6, or 2e-7·max(1, β) of an answer's Σ(abs(log p) + abs(log p_ref) + "
    "max_v abs(logit_v)) where larger, the float32 rounding of its log-probs and of the logits "
    "they are read from)"
)

DPO = Contract(
    id="dpo_loss",
    title="Preference (DPO) loss",
    purpose=(
        "Direct preference optimization (Rafailov et al., the sigmoid loss). A batch in the LLM "
        "layout holds pairs as consecutive rows: row 2i is pair i's chosen answer, row 2i + 1 "
        "its rejected one (NeMo-RL's interleaving); `ref_log_probs` holds the reference "
        "policy's log-probs of the tokens, aligned like the layout's log-probs. The reward of "
        "an answer is r = Σ_t (log p_t - log p_ref,t) over its assistant tokens (position 0 "
        "excluded), or the mean over them under option `token_reduction` `mean` (NeMo-RL's "
        "`preference_average_log_probs`, IPO-style length normalization); log p_t is read from "
        "the policy's logits at t - 1. `loss_preference` is the mean over pairs of "
        "-log σ(β·(r_chosen - r_rejected)), β declared in `Implementation.extras['beta']`; the "
        "reference log-probs are data, never differentiated. Label smoothing (conservative DPO, "
        "cDPO: -(1 - ε)·log σ(βΔ) - ε·log σ(-βΔ) per pair, TRL's `DPOConfig.label_smoothing` "
        "in its sigmoid loss) is capability `label_smoothing` (since 1.1): the factory takes "
        "`label_smoothing=ε` by name and DPO-010 checks the declared ε; DPO-003 to DPO-008 check "
        "the loss built with `label_smoothing=0.0`. Undeclared, ε is 0: a `loss_preference` that "
        "smooths anyway fails DPO-003 and DPO-004, the message naming the smoothing. Robust DPO "
        "and other pair losses are out of scope of v1.\n\n"
        "A pair counts when its chosen row holds an assistant token (a pair with an empty "
        "rejected row counts: its rejected reward is 0); a pair that does not count weighs "
        "nothing. Under capability `global_counts`, `loss(td, counts=GlobalCounts(tokens, "
        "sequences))` takes the global batch's counts with `sequences` = 2 × the counted pairs "
        "(NeMo-RL's `global_valid_seqs`, the rows of counted pairs; `GlobalCounts.of` counts "
        "rows with a token instead and differs when a rejected row is empty), so micro-batches "
        "of whole pairs, each with the global counts, add up to the whole batch. "
        "`loss_preference` and the metrics do not depend on `counts.tokens` (they average over "
        "pairs; another `loss_*` term, such as an SFT term, may use it). A batch without a "
        "counted pair has nothing to average over and is not checked.\n\n"
        "Metrics (entries not starting with `loss_`): `accuracy`, the share of counted pairs "
        "with r_chosen > r_rejected (a tie is no win); `rewards_chosen_mean` and "
        "`rewards_rejected_mean`, the mean r over counted pairs (NeMo-RL's, without β; TRL's "
        "`rewards/chosen` is β·r). Under `global_counts` each is a sum over the micro-batch's "
        "pairs divided by the global pair count, so micro-batches' metrics add up too.\n\n"
        "Other `loss_*` terms may be returned (an SFT term on the chosen answers, NeMo-RL's "
        "`sft_loss_weight`); the suite reads `loss_preference` for values and gradients. It runs "
        "in float32 with a tiny real Hugging Face causal LM it supplies and compares with the "
        "formula computed in float64 within 1e-5 (relative; absolute: the float32 rounding of "
        "the log-probs and logits, DPO-003); gradients within 1e-4. Each "
        "requirement's domain says what its check draws (since 1.1), the boundaries tried "
        "first, deterministically under `--conformance-seed`; bfloat16 and float16 policies "
        "are out of scope of v1 (the suite's policy is float32).\n\n"
        "The loss is a function of the policy's current weights, the batch's current contents "
        "and `counts`: a loss object keeps the policy it was built on, live, and a user trains "
        "it, loads new weights into it and refills a batch in place between calls. DPO-003 "
        "drives that statefully (since 1.2): random sequences of new batches, training steps, "
        "weight loads and in-place changes of a batch on one loss object, every batch scored "
        "after every step (no result kept from an earlier call). What a sequence of calls of "
        "one optimizer step must satisfy (micro-batches of whole pairs adding up to the whole "
        "batch, in any order and any split) is drawn by DPO-008 as a split of the pairs; every "
        "check calls one loss object on several batches in turn, so a value carried from one "
        "call to the next shows as a wrong value."
    ),
    protocol=LossModuleV1,
    extra_protocols=(SupportsGlobalCounts, GlobalCounts),
    version="1.2",
    factory=(
        "factory(policy, token_reduction=<declared>) -> LossModuleV1  # policy: an HF-style "
        "causal LM the suite supplies; β pre-bound and declared in Implementation.extras['beta']; "
        "capability global_counts: loss(td, counts=GlobalCounts(...)) on micro-batches of whole "
        "pairs (DPO-007, DPO-008); capability label_smoothing: factory(policy, "
        "token_reduction=..., label_smoothing=ε) (DPO-010)"
    ),
    uses_layout=True,
    capabilities=(
        Capability(name="global_counts", text="`loss(td, counts=GlobalCounts(tokens=..., sequences=...))` averages over `counts.sequences / 2` pairs, the global batch's counted pairs (all micro-batches, all data-parallel ranks), the loss and the metrics alike; without `counts` over the batch's own counted pairs.", undeclared="`loss(td)` alone, averaged over the batch's own counted pairs (DPO-003, DPO-005, DPO-006); DPO-007 and DPO-008 do not apply."),
        Capability(name="label_smoothing", text="The factory takes `label_smoothing=ε` by name (ε in [0, 1/2)): each counted pair's term becomes conservative DPO's -(1 - ε)·log σ(β·Δ) - ε·log σ(-β·Δ) (TRL's `DPOConfig.label_smoothing` in its sigmoid loss, OpenRLHF's `label_smoothing`); ε = 0 is the plain sigmoid loss. The ε the suite checks is declared in `Implementation.extras['label_smoothing']`; since 1.1.", undeclared="ε = 0: the factory gets no `label_smoothing` keyword and `loss_preference` is the plain sigmoid loss (DPO-003, DPO-004 fail a loss that smooths, naming the smoothing); DPO-010 does not apply."),
    ),
    options=(
        Option(name="token_reduction", values=("sum", "mean"), default="sum", text="How an answer's per-token log-ratios log p - log p_ref become its reward: their sum over its assistant tokens (the DPO paper's, TRL's `sigmoid`) or their mean (NeMo-RL's `preference_average_log_probs`)."),
    ),
    requirements=(
        Requirement(id="DPO-001", level=_M, tightened=("1.1", "1.2"), title="scalar finite terms",
            text="`loss(td)` MUST return a TensorDict or mapping whose `loss_*` entries are finite scalar tensors, including `loss_preference`.",
            domain=_PAIRS),
        Requirement(id="DPO-002", level=_M, tightened=("1.1", "1.2"), title="gradients reach the policy",
            text="`loss_preference` MUST carry a gradient that reaches the policy's parameters (non-zero and finite).", depends_on=("DPO-001",),
            domain=_GRAD_PAIRS),
        Requirement(id="DPO-003", level=_M, tightened=("1.1", "1.2"), title="preference loss value",
            text="With reference log-probs that differ from the policy's own, `loss_preference` MUST equal the mean over counted pairs of -log σ(β·(r_chosen - r_rejected)), rows 2i chosen and 2i + 1 rejected, r the declared `token_reduction` of log p - log p_ref over the answer's assistant tokens and β the declared `extras['beta']`, computed in float64 from the same policy, within 1e-5 relative " + _FLOAT32 + ", on every call: from the policy's current weights and the batch's current contents, whatever one loss object computed on earlier calls (the policy trained or its weights loaded in place, the same batch changed in place).", depends_on=("DPO-001",),
            domain=_PAIRS + _LIVE),
        Requirement(id="DPO-004", level=_M, tightened=("1.1", "1.2"), title="gradient through both answers",
            text="The gradient of `loss_preference` with respect to each assistant token's log-prob MUST be -β·σ(-β·Δ)·c/P on the chosen answer and +β·σ(-β·Δ)·c/P on the rejected one (Δ = r_chosen - r_rejected, P the counted pairs, c = 1 for `sum` and 1/L for `mean`, L the answer's assistant-token count), 0 elsewhere, however the loss calls the policy: both answers' log-probs carry the gradient, the reference's none.", depends_on=("DPO-002",),
            domain=_GRAD_PAIRS + " Without ties: the gradient is read per row, matched by its tokens, and a tie's two rows are one."),
        Requirement(id="DPO-005", level=_M, tightened=("1.1", "1.2"), title="reward metrics",
            text="`accuracy` MUST be the share of counted pairs whose r_chosen > r_rejected (a tie, two equal answers, is no win; a win however small its margin: β·Δ = 1e-30 > 0 is a win, though σ(β·Δ) rounds to 1/2 in float32 below about 6e-8), and `rewards_chosen_mean` and `rewards_rejected_mean` the mean over counted pairs of r_chosen and r_rejected (without β), within 1e-5 relative " + _FLOAT32 + ".", depends_on=("DPO-001",),
            domain=_PAIRS + " A tie pair (the rejected answer the chosen one: equal rewards) in every batch of 2 pairs or more. Near-ties (since 1.2): the last pair two equal answers, the policy's greedy continuation of a prompt under its output head x 1000 (each log p 0 or nearly), whose reference log-probs differ at one token, margins β·Δ of either sign drawn log-uniformly from 1e-30 to 1e-6 in magnitude (or the smallest whose sign float32 sums keep, where larger), the tie then on the pair before; boundaries β·Δ = 1e-9, 1e-30 (one pair of T = 2), -3e-8 beside a tie."),
        Requirement(id="DPO-006", level=_M, tightened=("1.1", "1.2"), title="pairs counted",
            text="In a batch with a pair whose rejected row holds no assistant token, a pair with no assistant token at all and a pair whose chosen row holds none but whose rejected row does, `loss_preference` and the metrics MUST average over the pairs whose chosen row holds an assistant token (the first counts, its rejected reward 0; the second and third weigh nothing, in the loss and in every metric, and are not counted), never over half the rows holding a token (an `accuracy` above 1) nor over the pairs with a token in either row.", depends_on=("DPO-001",),
            domain=_PAIRS + " Pairs with an empty rejected row, with both rows empty and with an empty chosen row beside an answer, in any position; at least one counted pair."),
        Requirement(id="DPO-007", level=_M, tightened=("1.1", "1.2"), title="global counts normalize", capability="global_counts",
            text="`loss(td, counts=GlobalCounts(tokens=N, sequences=2P))` MUST give the `loss_preference` of DPO-003 averaged over P pairs instead of the batch's own counted pairs, whatever the batch's own counts.", depends_on=("DPO-001",),
            domain=_PAIRS + " P from the batch's own counted pairs to 1000 times them (`sequences` = 2P), `tokens` from its own to 1000 times, the own counts tried first."),
        Requirement(id="DPO-008", level=_M, tightened=("1.1", "1.2"), title="micro-batches add up", capability="global_counts",
            text="For any split of a batch into micro-batches of whole pairs (uneven, a single pair, one whose pair has an empty rejected row), each called with the whole batch's counts (its assistant tokens, 2 × its counted pairs), the micro-batches' `loss_*` terms, `accuracy`, `rewards_chosen_mean` and `rewards_rejected_mean` MUST sum to the whole batch's called without counts, and the policy-parameter gradients of their `loss_*` sums to its gradient, within 1e-5 of the largest magnitude.", depends_on=("DPO-002",),
            domain=_GRAD_PAIRS + " Any order of the pairs cut anywhere into micro-batches of whole pairs, each padded to its own longest row; single-pair micro-batches tried first."),
        Requirement(id="DPO-009", level=_M, tightened=("1.1",), title="bad layout rejected",
            text="A batch without `ref_log_probs`, or with a mask of a non-bool dtype, MUST raise an error naming the key (reference log-probs are never taken as 0), and a batch of an odd number of rows MUST raise an error (no row is dropped or paired with the next batch's).",
            domain="`ref_log_probs` missing; the attention or assistant mask as float32, float16, bfloat16, int64, int32 and uint8 0/1 values (every one tried); 1, 3 and 7 rows (odd) of a batch of pairs."),
        Requirement(id="DPO-010", level=_M, title="label smoothing as declared", capability="label_smoothing", since="1.1", tightened=("1.2",),
            text="Built with `label_smoothing=ε` (the declared `extras['label_smoothing']`), `loss_preference` MUST equal the mean over counted pairs of -(1 - ε)·log σ(β·Δ) - ε·log σ(-β·Δ) (Δ = r_chosen - r_rejected as in DPO-003), computed in float64 from the same policy within 1e-5 relative " + _FLOAT32 + ", and its gradient with respect to each assistant token's log-prob MUST be ∓β·((1 - ε)·σ(-β·Δ) - ε·σ(β·Δ))·c/P on the chosen (-) and rejected (+) answers (c and P as in DPO-004): a smoothing term of the wrong sign or weight fails here, the message naming the smoothing.", depends_on=("DPO-002",),
            domain=_GRAD_PAIRS + " ε the declared one; without ties for the gradient (DPO-004)."),
    ),
)  # fmt: skip
"""The ``dpo_loss`` contract (specs/dpo_loss-v1.md).

Example:
    >>> DPO.version, DPO.default_options()
    ('1.2', {'token_reduction': 'sum'})
"""
