"""Contract ``nll_loss`` v1: the supervised fine-tuning (SFT) loss over the LLM layout."""

from __future__ import annotations

from posttrain.contracts.contract import Capability, Contract, Option
from posttrain.contracts.loss import GlobalCounts, LossModuleV1, SupportsGlobalCounts
from posttrain.contracts.requirements import Level, Requirement

NLL_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
"""How -log p of the assistant tokens becomes one scalar; the weight w of token t of row i
(m = assistant mask with position 0 False, N = tokens, S = rows holding one, L_i = row i's
count): token_mean m/N; seq_mean_token_mean m/(S*L_i); seq_mean_token_sum m/S.

Example:
    >>> NLL_AGGREGATIONS[0]
    'token_mean'
"""

_M = Level.MUST

_SHAPES = (
    "Batches of 1 to 5 rows and T from 2 (one scored position) to 24 columns, every token an id "
    "in [0, V) of the suite's policy (V = 64; the ids 0, the policy's pad id, and V - 1 placed "
    "on assistant tokens as boundaries: no id is an ignore_index, the masks alone exclude), prompts of 0 to T - 1 tokens and answers of any length, right-padded, with "
    "rows whose assistant mask is all False (one, or all but one), a row attended and answered "
    "from position 0 to the last column (no prompt, no padding) and ragged lengths; "
)
_TAIL = (
    " A batch without any assistant token is not drawn (nothing to average over). The "
    "boundaries first: one row of T = 2, a full row of T = 24."
)
_BATCHES = (
    _SHAPES + "the policy's output head scaled by any factor from 1 to 1000, the factors 1, 30 "
    "and 1000 tried (near-one-hot next-token distributions; at 1000 logits of magnitude up to "
    "about 400 and assistant log p down to about -600, far below -100)." + _TAIL
)
_GRAD_BATCHES = (
    _SHAPES + "the policy's output head scaled by any factor from 1 to 30, 1 and 30 tried (past "
    "it the float32 gradient of the likeliest tokens, d/d logit = d/d log p·(1 - p), rounds to "
    "0: a batch of such tokens has none to read, NLL-003 checks the values there)." + _TAIL
)
_LIVE = (
    " Then (since 1.2) one loss object built on a live policy, first in a fixed sequence on "
    "one batch (output head x 1): scored, a training step, a weight load, an in-place change of "
    "the batch, a second batch and a training step on it; then in random sequences of up to 5 "
    "steps (10 from depth 2), the output head scaled by 1, 30 or 1000: up to 2 batches, each "
    "scored again after "
    "every step; training steps of the policy between calls (each weight moved by lr·sign of "
    "the gradient of `loss_nll` through the loss itself, lr 1e-3 to 0.1), new weights loaded "
    "into it in place (`load_state_dict`, as a weight sync does), and a batch's tokens changed "
    "in place in the same TensorDict; each value compared with the formula from the policy's "
    "current weights and the batch's current contents."
)

NLL = Contract(
    id="nll_loss",
    title="Supervised (NLL) loss",
    purpose=(
        "Supervised fine-tuning: turns a batch in the LLM layout (tokens, attention and "
        "assistant masks) and a policy into `loss_nll`, the mean negative log-likelihood of the "
        "assistant tokens: Σ_i,t w_it·(-log p(token_it | tokens_i,<t)), the weights w those of "
        "the declared aggregation (see option `aggregation`). The assistant mask marks the "
        "tokens trained on; position 0 never counts (no logit predicts it), the prompt and "
        "padding never do. The log-prob of token t is read from the logits at t - 1 (Hugging "
        "Face's convention). Only the policy's log-probs carry a gradient: no z-loss, no temperature inside "
        "`loss_nll`, and no label smoothing unless it is asked for: under capability "
        "`label_smoothing` (since 1.1) the factory takes `label_smoothing=ε` by name and, "
        "for ε > 0, smooths the targets as `torch.nn.functional.cross_entropy(label_smoothing=ε)` "
        "does (NLL-009); NLL-003 to NLL-008 check the loss built with `label_smoothing=0.0`. "
        "Undeclared, ε is 0: a `loss_nll` that smooths anyway fails NLL-003 and NLL-004, the "
        "message naming the smoothing."
        "\n\n"
        "The counts are those of the policy-gradient loss (contract `loss`, `GlobalCounts`): "
        "`tokens` counts assistant tokens, `sequences` rows holding at least one. Under "
        "capability `global_counts`, `loss(td, counts=GlobalCounts(...))` on each micro-batch "
        "of an optimizer step (every data-parallel rank's included) normalizes by the global "
        "batch's counts, so the micro-batches' terms and gradients add up to the whole "
        "batch's: accumulation is a plain sum and ranks all-reduce gradients by sum. "
        "NeMo-RL's `NLLLossFn` takes them as `global_valid_toks`/`global_valid_seqs`, TRL's "
        "SFT trainer as `num_items_in_batch`; TorchRL's `SFTLoss` has none (capability "
        "undeclared).\n\n"
        "Other `loss_*` terms may be returned (their sum is the objective), as may metrics "
        "(NeMo-RL's `num_unmasked_tokens`); the suite reads `loss_nll` alone for values and "
        "gradients, and checks the others only for finiteness. The suite runs in float32 with "
        "a tiny real Hugging Face causal LM it supplies; values are compared with the formula "
        "computed in float64 from the same policy within 1e-5 (relative; absolute: the float32 "
        "rounding of logits of a few hundred, NLL-003) and gradients within 1e-4 (relative). Each requirement's domain says what its check draws "
        "(since 1.1): batch shapes, masks and tokens are generated, the boundaries tried first, "
        "deterministically under `--conformance-seed`; bfloat16 and float16 policies are out of "
        "scope of v1 (the suite's policy is float32).\n\n"
        "The loss is a function of the policy's current weights, the batch's current contents "
        "and `counts`: a loss object keeps the policy it was built on, live, and a user trains "
        "it, loads new weights into it and refills a batch in place between calls. NLL-003 "
        "drives that statefully (since 1.2): random sequences of new batches, training steps, "
        "weight loads and in-place changes of a batch on one loss object, every batch scored "
        "after every step (no result kept from an earlier call). What a sequence of calls of "
        "one optimizer step must satisfy (micro-batches adding up to the whole batch, in any "
        "order and any split) is drawn by NLL-008 as a split of the batch; every check calls "
        "one loss object on several batches in turn, so a value carried from one call to the "
        "next shows as a wrong value."
    ),
    protocol=LossModuleV1,
    extra_protocols=(SupportsGlobalCounts, GlobalCounts),
    version="1.2",
    factory=(
        "factory(policy, aggregation=<declared>) -> LossModuleV1  # policy: an HF-style causal "
        "LM the suite supplies; the declared aggregation reaches the factory by name; capability "
        "global_counts: loss(td, counts=GlobalCounts(...)) on micro-batches (NLL-007, NLL-008); "
        "capability label_smoothing: factory(policy, aggregation=..., label_smoothing=ε) (NLL-009)"
    ),
    uses_layout=True,
    capabilities=(
        Capability(name="global_counts", text="`loss(td, counts=GlobalCounts(tokens=..., sequences=...))` normalizes by the global batch's counts (all micro-batches, all data-parallel ranks): N becomes `counts.tokens` and S `counts.sequences` in the aggregation weights; without `counts`, by `GlobalCounts.of(td)`.", undeclared="`loss(td)` alone, normalized by the batch's own `GlobalCounts.of(td)` (NLL-003: a row without an assistant token weighs nothing and is not one of the S rows); NLL-007 and NLL-008 do not apply."),
        Capability(name="label_smoothing", text="The factory takes `label_smoothing=ε` by name (ε in [0, 1)): each assistant token's term becomes (1 - ε)·(-log p(token)) + ε·mean over the V vocabulary entries of -log p(v), both from the logits at t - 1, as `torch.nn.functional.cross_entropy(label_smoothing=ε)` defines it (transformers' `label_smoothing_factor`); ε = 0 is the plain NLL. The ε the suite checks is declared in `Implementation.extras['label_smoothing']`; since 1.1.", undeclared="ε = 0: the factory gets no `label_smoothing` keyword and `loss_nll` is the unsmoothed NLL (NLL-003, NLL-004 fail a loss that smooths, naming the smoothing); NLL-009 does not apply."),
    ),
    options=(
        Option(name="aggregation", values=NLL_AGGREGATIONS, default="token_mean", text="How -log p is reduced (m the assistant mask, position 0 excluded; N tokens, S rows holding one, L_i row i's count): `token_mean` w = m/N (NeMo-RL's NLLLossFn, TorchRL's SFTLoss `sum`/N); `seq_mean_token_mean` w = m/(S·L_i); `seq_mean_token_sum` w = m/S."),
    ),
    requirements=(
        Requirement(id="NLL-001", level=_M, title="scalar finite terms", tightened=("1.1", "1.2"),
            text="`loss(td)` MUST return a TensorDict or mapping whose `loss_*` entries are finite scalar tensors, including `loss_nll`.",
            domain=_BATCHES),
        Requirement(id="NLL-002", level=_M, title="gradients reach the policy", tightened=("1.1", "1.2"),
            text="`loss_nll` MUST carry a gradient that reaches the policy's parameters (non-zero and finite).", depends_on=("NLL-001",),
            domain=_GRAD_BATCHES),
        Requirement(id="NLL-003", level=_M, title="loss value", tightened=("1.1", "1.2"),
            text="`loss_nll` MUST equal Σ w·(-log p) over the batch, log p(token_t) read from the logits at t - 1 and w the declared aggregation's weights (assistant tokens only: prompt, padding and position 0 weigh nothing), computed in float64 from the same policy, within 1e-5 relative (absolute: 1e-7, or 5e-7 of Σ w·max_v abs(logit_v) at t - 1 where larger, the float32 rounding of log-probs read from logits of a few hundred), on every call: from the policy's current weights and the batch's current contents, whatever one loss object computed on earlier calls (the policy trained or its weights loaded in place, the same batch changed in place).", depends_on=("NLL-001",),
            domain=_BATCHES + _LIVE),
        Requirement(id="NLL-004", level=_M, title="gradient through the log-probs only", tightened=("1.1", "1.2"),
            text="The gradient of `loss_nll` with respect to each token's log-prob MUST be -w (the declared aggregation's weight; 0 outside the assistant mask), however the loss calls the policy; a `loss_nll` that reaches the logits other than through the tokens' log-probs (label smoothing, a z-loss, a temperature) has no such gradient and fails, saying so.", depends_on=("NLL-002",),
            domain=_GRAD_BATCHES),
        Requirement(id="NLL-005", level=_M, title="padding is inert", tightened=("1.1", "1.2"),
            text="Appending padding columns (attention and assistant mask False), or changing the tokens at padding positions, MUST NOT change any output.", depends_on=("NLL-001",),
            domain=_BATCHES + " Rows right- or left-padded (a left-padded row's padding precedes its prompt); 1 to 5 padding columns appended; the padding tokens replaced by other ids in [0, V). Outputs compared within 1e-5, or NLL-003's absolute tolerance where larger."),
        Requirement(id="NLL-006", level=_M, title="bad layout rejected", tightened=("1.1",),
            text="A batch missing `tokens`, the attention mask or the assistant mask, or with a mask of a non-bool dtype (a float32 or int64 0/1 mask) MUST raise an error naming the key: a mask is never taken as weights, nor a missing one replaced by another.",
            domain="Each of `tokens`, the attention mask and the assistant mask missing; each mask as float32, float16, bfloat16, float64, int64, int32, int8 and uint8 0/1 values (every one tried), on batches of 1 to 4 rows."),
        Requirement(id="NLL-007", level=_M, title="global counts normalize", capability="global_counts", tightened=("1.1", "1.2"),
            text="`loss(td, counts=GlobalCounts(tokens=N, sequences=S))` MUST give the `loss_nll` of NLL-003 with the token count replaced by N and the row count by S, whatever the batch's own counts.", depends_on=("NLL-001",),
            domain=_BATCHES + " N from the batch's own token count to 1000 times it, S from its own row count (rows holding an assistant token) to 1000 times it, the batch's own counts tried first."),
        Requirement(id="NLL-008", level=_M, title="micro-batches add up", capability="global_counts", tightened=("1.1", "1.2"),
            text="For any split of a batch into micro-batches (uneven, a single row, one without any assistant token), each called with the whole batch's `GlobalCounts.of(td)`, the micro-batches' `loss_*` terms MUST sum to the whole batch's called without counts, and the policy-parameter gradients of their sums to its gradient, within 1e-5 of the largest magnitude: `loss(td)` normalizes by `GlobalCounts.of(td)`, whose `sequences` holds only rows with an assistant token.", depends_on=("NLL-002",),
            domain=_GRAD_BATCHES + " Any order of the rows cut anywhere into micro-batches, each padded to its own longest row; single-row micro-batches and one without an assistant token tried first."),
        Requirement(id="NLL-009", level=_M, title="label smoothing as declared", capability="label_smoothing", since="1.1", tightened=("1.2",),
            text="Built with `label_smoothing=ε` (the declared `extras['label_smoothing']`), `loss_nll` MUST equal Σ w·((1 - ε)·(-log p(token_t)) + ε·(1/V)·Σ_v -log p(v)), both from the logits at t - 1 and w the declared aggregation's weights, computed in float64 from the same policy within 1e-5 relative, and its policy-parameter gradients MUST be that formula's within 1e-4 of the largest: a smoothing term of the wrong sign or weight, or over the wrong positions, fails here, the message naming the smoothing.", depends_on=("NLL-002",),
            domain=_GRAD_BATCHES + " ε the declared one."),
    ),
)  # fmt: skip
"""The ``nll_loss`` contract (specs/nll_loss-v1.md).

Example:
    >>> NLL.version, [r.id for r in NLL.requirements][:2]
    ('1.2', ['NLL-001', 'NLL-002'])
"""
