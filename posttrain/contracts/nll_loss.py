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
        "Face's convention). Only the policy's log-probs carry a gradient: no label smoothing, "
        "no z-loss, no temperature inside `loss_nll`. Label smoothing is out of scope of v1 "
        "(a smoothed `loss_nll` fails NLL-003 and NLL-004 as any other value does; NLL-004's "
        "message says the loss reaches the logits other than through the tokens' log-probs)."
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
        "computed in float64 from the same policy within 1e-5 (relative) and gradients "
        "within 1e-4 (relative)."
    ),
    protocol=LossModuleV1,
    extra_protocols=(SupportsGlobalCounts, GlobalCounts),
    version="1.0",
    factory=(
        "factory(policy, aggregation=<declared>) -> LossModuleV1  # policy: an HF-style causal "
        "LM the suite supplies; the declared aggregation reaches the factory by name; capability "
        "global_counts: loss(td, counts=GlobalCounts(...)) on micro-batches (NLL-007, NLL-008)"
    ),
    uses_layout=True,
    capabilities=(
        Capability(name="global_counts", text="`loss(td, counts=GlobalCounts(tokens=..., sequences=...))` normalizes by the global batch's counts (all micro-batches, all data-parallel ranks): N becomes `counts.tokens` and S `counts.sequences` in the aggregation weights; without `counts`, by `GlobalCounts.of(td)`."),
    ),
    options=(
        Option(name="aggregation", values=NLL_AGGREGATIONS, default="token_mean", text="How -log p is reduced (m the assistant mask, position 0 excluded; N tokens, S rows holding one, L_i row i's count): `token_mean` w = m/N (NeMo-RL's NLLLossFn, TorchRL's SFTLoss `sum`/N); `seq_mean_token_mean` w = m/(S·L_i); `seq_mean_token_sum` w = m/S."),
    ),
    requirements=(
        Requirement(id="NLL-001", level=_M, title="scalar finite terms",
            text="`loss(td)` MUST return a TensorDict or mapping whose `loss_*` entries are finite scalar tensors, including `loss_nll`."),
        Requirement(id="NLL-002", level=_M, title="gradients reach the policy",
            text="`loss_nll` MUST carry a gradient that reaches the policy's parameters (non-zero and finite).", depends_on=("NLL-001",)),
        Requirement(id="NLL-003", level=_M, title="loss value",
            text="`loss_nll` MUST equal Σ w·(-log p) over the batch, log p(token_t) read from the logits at t - 1 and w the declared aggregation's weights (assistant tokens only: prompt, padding and position 0 weigh nothing), computed in float64 from the same policy, within 1e-5 relative.", depends_on=("NLL-001",)),
        Requirement(id="NLL-004", level=_M, title="gradient through the log-probs only",
            text="The gradient of `loss_nll` with respect to each token's log-prob MUST be -w (the declared aggregation's weight; 0 outside the assistant mask), however the loss calls the policy; a `loss_nll` that reaches the logits other than through the tokens' log-probs (label smoothing, a z-loss, a temperature) has no such gradient and fails, saying so.", depends_on=("NLL-002",)),
        Requirement(id="NLL-005", level=_M, title="padding is inert",
            text="Appending padding columns (attention and assistant mask False), or changing the tokens at padding positions, MUST NOT change any output.", depends_on=("NLL-001",)),
        Requirement(id="NLL-006", level=_M, title="bad layout rejected",
            text="A batch missing `tokens`, the attention mask or the assistant mask, or with a mask of a non-bool dtype (a float32 or int64 0/1 mask) MUST raise an error naming the key: a mask is never taken as weights, nor a missing one replaced by another."),
        Requirement(id="NLL-007", level=_M, title="global counts normalize", capability="global_counts",
            text="`loss(td, counts=GlobalCounts(tokens=N, sequences=S))` MUST give the `loss_nll` of NLL-003 with the token count replaced by N and the row count by S, whatever the batch's own counts.", depends_on=("NLL-001",)),
        Requirement(id="NLL-008", level=_M, title="micro-batches add up", capability="global_counts",
            text="For any split of a batch into micro-batches (uneven, a single row, one without any assistant token), each called with the whole batch's `GlobalCounts.of(td)`, the micro-batches' `loss_*` terms MUST sum to the whole batch's called without counts, and the policy-parameter gradients of their sums to its gradient, within 1e-5 of the largest magnitude: `loss(td)` normalizes by `GlobalCounts.of(td)`, whose `sequences` holds only rows with an assistant token.", depends_on=("NLL-002",)),
    ),
)  # fmt: skip
"""The ``nll_loss`` contract (specs/nll_loss-v1.md).

Example:
    >>> NLL.version, [r.id for r in NLL.requirements][:2]
    ('1.0', ['NLL-001', 'NLL-002'])
"""
