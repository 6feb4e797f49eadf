"""Contract ``rollout`` v1: a source of LLM-layout batches whose policy weights can change."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from posttrain.contracts.contract import Capability, Contract
from posttrain.contracts.requirements import Level, Requirement


class RolloutSourceV1(Protocol):
    """A pull-style rollout source (TorchRL's ``LLMCollector`` surface).

    Iterating yields TensorDicts in the LLM layout, each item stamped with the
    ``policy_version`` that generated it. The push-style twin (request in, response out) is a
    separate contract so that neither grows a mode flag.

    Example:
        >>> def first_batch(src: RolloutSourceV1):
        ...     batch = next(iter(src))
        ...     src.update_policy_weights_({})  # new weights: the version rises
        ...     return batch
    """

    def __iter__(self) -> Iterator[TensorDictBase]:
        """Yield batches until the declared total is reached (or forever if none)."""
        ...

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> Any:
        """Load new weights (``None``: re-read the policy's own); later batches use them."""
        ...

    @property
    def policy_version(self) -> int:
        """The version stamped on batches generated from now on."""
        ...

    def shutdown(self) -> Any:
        """Stop generating and free resources; idempotent."""
        ...


_M, _S = Level.MUST, Level.SHOULD

ROLLOUT = Contract(
    id="rollout",
    title="Rollout source",
    purpose=(
        "Produces batches of generated sequences in the LLM layout from a policy whose weights "
        "the trainer updates. Every item says which weights produced it, so staleness is "
        "measurable and off-policy corrections are possible. Out of scope: whether "
        "`update_policy_weights_(weights)` copies `weights` or keeps the tensors it was given "
        "(a colocated source shares them with the trainer by design; a trainer that then "
        "changes them in place owes the source another update for the change to be stamped), "
        "and what it does with a name its policy does not have: raise, or ignore it while its "
        "version rises (a version names the weights, and two versions may name equal weights, "
        "as ROLL-004's update with unchanged values does). Either way `policy_version` names "
        "the weights the source generates with (ROLL-003, ROLL-005): an update that raises "
        "leaves the weights and the version as they were."
    ),
    protocol=RolloutSourceV1,
    factory=(
        "factory(policy, prompts: list[list[int]], total_batches: int | None, *, "
        "max_new_tokens: int) -> RolloutSourceV1  # policy: an HF causal LM the suite supplies"
    ),
    uses_layout=True,
    version="1.4",
    capabilities=(
        Capability(name="ragged", text="Yields ragged batches (lazy stacks / jagged tensors) instead of padded ones.",
            undeclared="Batches are checked as padded ones (ROLL-001's layout, prompts right- or left-padded); ROLL-010 does not apply."),
        Capability(name="log_probs", text="Stamps the behaviour log-probs (`sample_log_probs`) of generated tokens.",
            undeclared="`sample_log_probs` is not read; ROLL-005 checks the new weights through the generated tokens alone; ROLL-008 does not apply."),
        Capability(name="groups", text="Generates several responses per prompt and stamps `group_id`.",
            undeclared="`group_id` is not read; every item must still answer one of the prompts given (ROLL-002); ROLL-009 does not apply."),
    ),
    requirements=(
        Requirement(id="ROLL-001", level=_M, title="batches meet the layout",
            text="Every batch MUST meet the LLM layout v1 (tokens, attention mask, assistant mask, policy_version) with the assistant mask covering exactly the generated tokens: every generated token (the EOS that ends a response included, also where the pad token is EOS), and no prompt or padding token. Prompts MAY be left-padded (TRL's arrangement).", tightened=("1.1", "1.2"),
            domain="Two batches of a source over the suite's four prompts (2 to 4 tokens) with scripted weights: two responses end early at EOS, and the pad token is EOS."),
        Requirement(id="ROLL-002", level=_M, title="prompt preserved",
            text="The real tokens (attention mask True) before the first assistant token MUST be the prompt the source was given.", depends_on=("ROLL-001",), tightened=("1.3",),
            domain="The first batch of a source over the suite's four prompts (token ids 5 to 16, 1 to 4 tokens); then sources over 1 to 6 prompts of 1 to 24 token ids drawn over the whole vocabulary (0 to 63: the pad id 0 and EOS 2 included, anywhere in a prompt), with max_new_tokens 1 to 6. Tried first: prompts the pad id starts, ends or fills ([0, 5, 0], [0], [0, 0, 6]), EOS inside a prompt, a one-token prompt, a 24-token prompt beside a 1-token one."),
        Requirement(id="ROLL-003", level=_M, title="version stamped",
            text="Every item MUST carry `policy_version` equal to the source's `policy_version` when it was generated; that version names the weights, so without `update_policy_weights_` it MUST stay the same from batch to batch.", tightened=("1.1", "1.2", "1.3"), depends_on=("ROLL-001",),
            domain="Three batches without an update, then three after `update_policy_weights_(weights)` with scripted weights whose tokens name them; then random sequences (a fixed one first) of batches and updates on a source: fresh weight dicts, the policy changed in place followed by `update_policy_weights_(None)`, and full dicts with one name the policy lacks (raised: nothing may change; accepted: an update like any other), the same weights again included. After every step the stamps and `policy_version` name the weights the tokens show (a batch of the weights before an update may come once, stamped with their version)."),
        Requirement(id="ROLL-004", level=_M, title="version rises on update",
            text="After `update_policy_weights_`, `policy_version` and the stamps of later batches MUST be greater than before.", depends_on=("ROLL-003",), tightened=("1.4",),
            domain="One batch, `update_policy_weights_` with the policy's own `state_dict()` (unchanged values), one batch; then a fresh source: an update before the first iteration, a batch, two updates in a row (`None`, then the state dict), a batch. Every update raises `policy_version`, every batch's stamps rise past those before."),
        Requirement(id="ROLL-005", level=_M, title="new weights used",
            text="Batches generated after `update_policy_weights_` returns MUST come from the new weights (checked through the generated tokens or log-probs).", depends_on=("ROLL-004",), tightened=("1.3",),
            domain="One batch, then `update_policy_weights_` with weights that emit one forced token, one batch; then ROLL-003's random sequences of batches and updates (fresh dicts, `None` after the policy changed in place, a name the policy lacks), every batch after an update compared with what the weights loaded last generate."),
        Requirement(id="ROLL-006", level=_M, title="declared end",
            text="When a total is declared, iteration MUST stop after exactly that many batches (none for a total of 0). Iterating the same source again MUST yield the total again (a budget per iteration) or nothing (one budget for the source's life), the same at every later iteration, whatever `update_policy_weights_` calls come between or during them.", depends_on=("ROLL-001",), tightened=("1.4",),
            domain="A declared total of 3 batches, iterated to its end (counted up to 10); then sources over 1 to 3 prompts (1 to 3 tokens, max_new_tokens 1, so a total meets and misses the batch's size) with totals 0 to 2, each iterated to its end one to four times (cut off 3 batches past the total), `update_policy_weights_(policy.state_dict())` between iterations and after a batch inside one, and fresh sources. Tried first: a total of 0 iterated twice; a total of 1 iterated, updated, iterated twice; a total of 2 updated after its first batch, then iterated again."),
        Requirement(id="ROLL-007", level=_M, title="shutdown",
            text="`shutdown()` MUST be idempotent, and iterating after it MUST raise a clear error instead of hanging, also once a declared total is spent: a new iteration raises, and so does the next call of every iterator taken before `shutdown()`, started or not; none yields a batch. An iterator that had already come to its end (it stopped, or yielded the whole total) MAY stop again instead.", tightened=("1.4",),
            domain="A source without a total that yielded one batch: `shutdown()` twice, then a new iteration (20 s to raise). Then sources over 2 prompts (max_new_tokens 1): without a total, three iterators taken (one not started, one a batch in, one two batches in); with a total of 2, one iterator run to its end and one taken after it; with a total of 1, never iterated; each shut down twice, and after each shutdown the next call of every iterator and a new iteration. Then random sequences (totals none, 0, 1, 2) of iterators taken, advanced, run to their end, updates and shutdowns (one ends every sequence), everything checked after each shutdown. Every call has 20 s to answer."),
        Requirement(id="ROLL-008", level=_M, title="behaviour log-probs", capability="log_probs",
            text="`sample_log_probs` MUST equal the generating policy's log-probs of the generated tokens within 1e-4.", depends_on=("ROLL-001",), tightened=("1.4",),
            domain="The first batch's `sample_log_probs` against the policy's log-probs of its generated tokens; then a source over prompts the pad id starts, ends or fills, with EOS inside ([0, 5, 0], [2], [7, 2, 8, 0, 0]; max_new_tokens 3): its first batch, then `update_policy_weights_` with other weights and the next batch, each item against the weights its stamp names."),
        Requirement(id="ROLL-009", level=_M, title="groups stamped", capability="groups",
            text="Items generated from the same prompt MUST share a `group_id` and items from different prompts MUST NOT. A prompt is its token ids, the pad id and EOS included: prompts that differ only in them, or of which one is a prefix of the other, are different prompts. A prompt given more than once MAY be one group or one per time it was given. Group ids are compared within a batch.", depends_on=("ROLL-001",), tightened=("1.4",),
            domain="The first batch over the suite's four prompts; then first batches (max_new_tokens 1) over 2 to 4 prompts, most of them kin of one drawn prompt of 1 to 4 token ids: the same prompt, the pad id 0 or EOS 2 before, after or inside it, a prefix of it, it extended, or a prompt drawn over the whole vocabulary (0 to 63). Tried first: [[5, 6], [0, 5, 6], [5, 6, 0], [5, 2, 6]] and [[5, 6, 7], [5, 6], [0], [5, 6]]."),
        Requirement(id="ROLL-010", level=_M, title="ragged batches", capability="ragged",
            text="Ragged batches MUST hold, per item, exactly its real tokens: no padding, the attention mask True throughout.", depends_on=("ROLL-001",), tightened=("1.4",),
            domain="The first batch's items; then two batches over prompts the pad id starts, ends or fills, with EOS inside ([0, 5, 0], [2], [7, 2, 8, 0, 0]; max_new_tokens 3): real tokens only, attention mask True throughout."),
    ),
)  # fmt: skip
