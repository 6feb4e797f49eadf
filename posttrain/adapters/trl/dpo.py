"""TRL 1.16 DPOTrainer's sigmoid loss as a ``dpo_loss`` implementation (TRL imported lazily).

The loss is TRL's own code: :class:`TRLDPOLoss` builds a real ``DPOTrainer`` once (a tiny
offline model, a word-level tokenizer, ``precompute_ref_log_probs=True`` so that the reference
log-probs are inputs) and calls its ``_compute_loss(policy, inputs, False)`` with the suite's
policy, patched with TRL's fused LM head as ``DPOTrainer`` patches its own model. Only the batch
is mapped:

- the layout's pairs are interleaved (rows 2i chosen, 2i + 1 rejected); TRL's batch is all
  chosen rows, then all rejected rows (``logps.chunk(2)``);
- ``completion_mask`` is the assistant mask (position 0 excluded, attention mask implied);
  ``ref_chosen_logps``/``ref_rejected_logps`` are the layout's ``ref_log_probs`` summed over it,
  as TRL's ``compute_ref_log_probs`` sums its reference's log-probs over the completion.

TRL averages ``-logsigmoid(beta * delta)`` over every pair of the micro-batch and reports
``rewards/chosen`` and ``rewards/rejected`` as ``beta * r`` means over the micro-batch.

- Raw row: that mapping alone; metrics renamed (``rewards/accuracies`` -> ``accuracy``,
  ``rewards/chosen`` -> ``rewards_chosen_mean``, ...) with TRL's values (``beta * r``).
- Adapted row: the batch validated (key, dtype, an even row count); only the counted pairs
  (chosen row with an assistant token) are passed to TRL, and TRL's micro-batch means are
  rescaled by ``counted pairs / P`` (P the batch's own counted pairs, or ``counts.sequences /
  2`` under capability ``global_counts``), its rewards divided by ``beta``. The rescale is
  exact: TRL's per-micro-batch mean times its pair count is the pairs' sum.
"""

from __future__ import annotations

import tempfile
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts

BETA = 0.5
"""``DPOConfig.beta`` of the rows (declared in ``extras['beta']``)."""

K = LLM_LAYOUT_V1.key
_TRAINERS: dict[float, Any] = {}
_METRIC_NAMES = {
    "rewards/accuracies": "accuracy",
    "rewards/chosen": "rewards_chosen_mean",
    "rewards/rejected": "rewards_rejected_mean",
}


def dpo_trainer(beta: float = BETA) -> Any:
    """A real TRL ``DPOTrainer`` (sigmoid loss, reference log-probs as inputs), cached per beta.

    Its own model is a tiny one; the loss is computed with whatever model is passed to
    ``_compute_loss``.

    Example:
        >>> dpo_trainer().loss_types  # doctest: +SKIP
        ['sigmoid']
    """
    if beta in _TRAINERS:
        return _TRAINERS[beta]
    with optional_deps():
        from datasets import Dataset
        from trl.trainer.dpo_config import DPOConfig
        from trl.trainer.dpo_trainer import DPOTrainer
    from posttrain.adapters._hf import word_level_tokenizer
    from posttrain.testing import tiny_causal_lm

    model = tiny_causal_lm(vocab_size=64)
    out_dir = tempfile.TemporaryDirectory(prefix="posttrain-trl-dpo-")
    args = DPOConfig(
        output_dir=out_dir.name,
        beta=beta,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=True,  # reference log-probs are the layout's, passed as inputs
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,  # a float32 suite: TRL's default bf16 autocast moves log-probs by ~1e-3
    )
    trainer: Any = DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}),
        processing_class=word_level_tokenizer(model.config),
    )
    trainer.model.train()  # _compute_loss's "train" mode: metrics under _metrics["train"]
    trainer.posttrain_output_dir = out_dir  # alive as long as the trainer
    _TRAINERS[beta] = trainer
    return trainer


def _fuse(policy: Any) -> None:
    """Patch ``policy`` as DPOTrainer patches its own model (once): ``policy(...,
    fused_lm_head=True)`` returns TRL's per-token log-probs and the metrics' fields."""
    if getattr(policy, "_posttrain_trl_dpo_fused", False):
        return
    with optional_deps():
        from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    policy._posttrain_trl_dpo_fused = True


def dpo_inputs(td: TensorDictBase) -> dict[str, torch.Tensor]:
    """The ``inputs`` dict DPOTrainer's ``_compute_loss`` reads: chosen rows then rejected rows.

    Example:
        >>> import torch
        >>> from posttrain.testing import llm_batch
        >>> td = llm_batch(4, 8).set(("next", "ref_log_probs", "full"), torch.zeros(4, 8))
        >>> sorted(dpo_inputs(td))
        ['attention_mask', 'completion_mask', 'input_ids', 'ref_chosen_logps', 'ref_rejected_logps']
    """
    missing = [
        k
        for k in ("tokens", "attention_mask", "assistant_mask", "ref_log_probs")
        if K(k) not in td.keys(include_nested=True)
    ]
    if missing:
        raise KeyError(f"td: no {K(missing[0])!r} ({missing[0]})")
    order = torch.cat([torch.arange(0, td.batch_size[0], 2), torch.arange(1, td.batch_size[0], 2)])
    # 0/1 integer masks, as TRL's collator writes them (a TRL user's plain conversion).
    att = td.get(K("attention_mask")).long()
    mask = td.get(K("assistant_mask")).long() * att
    mask[:, 0] = 0  # no logit predicts position 0
    ref = torch.where(mask.bool(), td.get(K("ref_log_probs")), 0.0).sum(-1)[order]
    ref_chosen, ref_rejected = ref.chunk(2)
    return {
        "input_ids": td.get(K("tokens"))[order],
        "attention_mask": att[order],
        "completion_mask": mask[order],
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }


class TRLDPOLoss(torch.nn.Module):
    """TRL 1.16 ``DPOTrainer._compute_loss`` (sigmoid loss) as a ``LossModuleV1``.

    ``adapted=False`` (the raw row): the layout mapped to TRL's inputs, TRL's micro-batch mean
    and its metrics as TRL reports them. ``adapted=True``: validated, counted pairs only,
    capability ``global_counts`` (see the module docstring).

    Example:
        >>> from posttrain.testing import tiny_causal_lm  # doctest: +SKIP
        >>> loss = TRLDPOLoss(tiny_causal_lm(vocab_size=64))  # doctest: +SKIP
        >>> loss.trainer.beta  # doctest: +SKIP
        0.5
    """

    def __init__(
        self,
        policy: Any,
        token_reduction: str = "sum",
        *,
        adapted: bool = True,
        beta: float = BETA,
    ) -> None:
        super().__init__()
        if token_reduction != "sum":
            raise ValueError(
                f"token_reduction: TRL's sigmoid loss sums over the answer's tokens, found "
                f"{token_reduction!r}"
            )
        self.policy = policy
        self.adapted = adapted
        self.trainer = dpo_trainer(beta)
        _fuse(policy)

    def _trl(self, td: TensorDictBase) -> tuple[torch.Tensor, dict[str, float]]:
        metrics = self.trainer._metrics["train"]
        metrics.clear()  # one call's metrics, not a history
        loss = self.trainer._compute_loss(self.policy, dpo_inputs(td), False)
        return loss.reshape(()), {
            ours: float(metrics[theirs][-1]) for theirs, ours in _METRIC_NAMES.items()
        }

    def forward(self, td: TensorDictBase, *, counts: GlobalCounts | None = None) -> TensorDict:
        """TRL's DPO loss of ``td``'s pairs (never mutated), as a part of ``counts``' batch."""
        if not self.adapted:
            if counts is not None:
                raise TypeError("counts: the raw TRL row takes no global counts")
            loss, metrics = self._trl(td)
            return TensorDict(
                {"loss_preference": loss, **{k: torch.tensor(v) for k, v in metrics.items()}},
                batch_size=[],
            )
        LLM_LAYOUT_V1.validate_batch(
            td, require=("ref_log_probs",), any_float=True, context="TRL DPO"
        )
        rows = td.batch_size[0] if td.batch_size else 0
        if rows == 0 or rows % 2:
            raise ValueError(
                f"td: expected an even number of rows (chosen, rejected pairs), found {rows}"
            )
        if counts is not None and not isinstance(counts, GlobalCounts):
            raise TypeError(f"counts: expected a GlobalCounts, found {type(counts).__name__}")
        mask = td.get(K("assistant_mask")) & td.get(K("attention_mask"))
        counted = torch.nonzero(mask[0::2, 1:].any(-1)).flatten()
        pairs = counts.sequences // 2 if counts is not None else int(counted.numel())
        if counted.numel() > pairs:
            raise ValueError(
                f"counts: this batch alone holds {counted.numel()} counted pairs, more than the "
                f"global {counts}"
            )
        if counted.numel() == 0:  # this part weighs nothing (TRL's mean of no pair is NaN)
            zero = torch.zeros(())
            return TensorDict(
                {"loss_preference": zero, **{k: zero for k in _METRIC_NAMES.values()}},
                batch_size=[],
            )
        keep = torch.stack([2 * counted, 2 * counted + 1], -1).flatten()
        loss, metrics = self._trl(td[keep])
        scale = counted.numel() / pairs
        beta = float(self.trainer.beta)
        out = {
            "loss_preference": loss * scale,
            "accuracy": torch.tensor(metrics["accuracy"] * scale),
            "rewards_chosen_mean": torch.tensor(metrics["rewards_chosen_mean"] * scale / beta),
            "rewards_rejected_mean": torch.tensor(metrics["rewards_rejected_mean"] * scale / beta),
        }
        return TensorDict(out, batch_size=[])


def _make(policy: Any, token_reduction: str = "sum", *, adapted: bool) -> TRLDPOLoss:
    return TRLDPOLoss(policy, token_reduction, adapted=adapted)


def _row(*, adapted: bool, known: frozenset[str]) -> Implementation:
    return Implementation(
        "dpo_loss",
        partial(_make, adapted=adapted),
        name=f"{'TRLDPOLoss(' if adapted else ''}trl DPOTrainer._compute_loss"
        f"(loss_type=['sigmoid'], beta={BETA}){')' if adapted else ''}",
        capabilities={"global_counts"} if adapted else set(),
        options={"token_reduction": "sum"},
        extras={"beta": BETA},
        description="TRL 1.16's DPOTrainer._compute_loss (sigmoid) on a real trainer, called "
        "with the suite's policy and the layout's reference log-probs; "
        + (
            "adapted: counted pairs only, TRL's micro-batch means rescaled to the global pair "
            "count, rewards divided by beta."
            if adapted
            else "raw: TRL's mean over every pair and its metrics (rewards as beta * r)."
        ),
        known_failures=known,
    )


RAW_KNOWN = frozenset({"DPO-003", "DPO-004", "DPO-005", "DPO-006", "DPO-009"})
"""What the raw row fails, measured with TRL 1.16 (repros in :func:`deviations`): TRL's mean
runs over every pair, a pair without assistant tokens included, so once dpo_loss 1.1's value
and gradient batches hold such pairs the value (DPO-003: 0.1779 where the counted pairs give
2.9e-33) and each token's gradient (DPO-004: half of it with one of two pairs counted) are off
as DPO-006 shows them; rewards come as beta x r (DPO-005); a float mask is accepted (DPO-009)."""

RAW_DPO_SIGMOID = _row(adapted=False, known=RAW_KNOWN)
ADAPTED_DPO_SIGMOID = _row(adapted=True, known=frozenset())
ROWS: dict[str, Implementation] = {
    "trl-raw-dpo-sigmoid": RAW_DPO_SIGMOID,
    "trl-adapted-dpo-sigmoid": ADAPTED_DPO_SIGMOID,
}
"""The TRL DPO rows by name (``trl-adapted-dpo-sigmoid`` is also an entry point)."""
