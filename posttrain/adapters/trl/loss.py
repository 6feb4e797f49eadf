"""TRL GRPOTrainer's loss, per ``loss_type``, as a loss implementation (TRL imported lazily).

The loss is TRL's own code: :class:`TRLGRPOLoss` builds a real ``GRPOTrainer`` once (a tiny
offline model, a word-level tokenizer, no dataset to speak of) and calls its
``_compute_loss(policy, inputs)`` with the suite's policy. Only the batch is mapped:

- TRL splits a row into ``prompt_ids`` and ``completion_ids``; the split is the first
  assistant position of the batch (position 1 at the earliest: no logit predicts position 0),
  ``prompt_mask``/``completion_mask`` are the attention mask's two parts, and the tokens the
  loss trains on are TRL's ``tool_mask`` (completion positions that are assistant tokens), so
  the policy sees every attended token while only assistant tokens count.
- ``old_per_token_logps`` and ``advantages`` [B] (or [B, T]) are the layout's, cut at the split.

Global counts (the adapted row): ``dapo``, ``cispo`` and ``vespo`` take TRL's own
``num_items_in_batch`` = ``counts.tokens`` (one process, one accumulation step: TRL's normalizer
is then exactly ``num_items_in_batch``). ``grpo``, ``bnpo``, ``dr_grpo``, ``sapo`` and ``luspo``
normalize by the micro-batch itself and divide by the accumulation steps; the adapter rescales
their value (by ``rows / counts.sequences`` for the sequence means, ``tokens / counts.tokens``
for ``bnpo``), as a TRL user would have to. Across data-parallel ranks, every rank's rows are
padded to the most any holds (:func:`_pad_rows_to_ranks`), as TRL's per-row gather needs.
"""

from __future__ import annotations

import tempfile
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.adapters._layout import global_counts, loss_tokens
from posttrain.adapters._layout import zero_outside as zero_outside_mask
from posttrain.contracts.implementation import Implementation
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.loss import GlobalCounts

LOSS_TYPES = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "sapo": "seq_mean_token_mean",
    "vespo": "token_mean",
    "luspo": "seq_mean_token_sum",
}
"""TRL 1.16's ``loss_type`` values -> the contract aggregation each one's normalizer is."""

RATIOS = {
    "grpo": "token",
    "bnpo": "token",
    "dr_grpo": "token",
    "dapo": "token",
    "luspo": "sequence",
    "cispo": "cispo",
}
"""TRL loss_type -> the contract's ``ratio`` option (loss 1.5). ``GRPOTrainer._compute_loss``
computes cispo as ``-clamp(coef_1, max=epsilon_high).detach() * advantages *
per_token_logps``: CISPO's form (``cispo``) with an upper bound only, at ``epsilon_high`` itself
(see :data:`CLIP_EPSILON`). sapo gates the ratio through a sigmoid
(``sigmoid(tau * (coef_1 - 1)) * 4 / tau``) and vespo weights log p by a gamma weight of the
sequence (``get_gamma_weights``): none of the contract's forms, no ``ratio`` declared."""

GLOBAL_TOKENS = ("dapo", "cispo", "vespo")
"""The loss types that divide by TRL's ``num_items_in_batch`` (the global token count)."""

MAX_COMPLETION_LENGTH = 16
"""``GRPOConfig.max_completion_length``: ``dr_grpo``'s constant (the contract's ``t_norm``)."""

K = LLM_LAYOUT_V1.key
_TRAINERS: dict[tuple[Any, ...], Any] = {}


def grpo_trainer(loss_type: str, **config: Any) -> Any:
    """A real TRL ``GRPOTrainer`` for ``loss_type`` (cached per configuration), offline.

    Its own model is a tiny one; the loss is computed with whatever model is passed to
    ``_compute_loss``.

    Example:
        >>> grpo_trainer("bnpo").loss_type  # doctest: +SKIP
        'bnpo'
    """
    key = (loss_type, *sorted(config.items()))
    if key in _TRAINERS:
        return _TRAINERS[key]
    with optional_deps():
        from datasets import Dataset
        from trl.trainer.grpo_config import GRPOConfig
        from trl.trainer.grpo_trainer import GRPOTrainer
    from posttrain.adapters._hf import word_level_tokenizer
    from posttrain.testing import tiny_causal_lm

    model = tiny_causal_lm(vocab_size=64)
    tok = word_level_tokenizer(model.config)
    tok.padding_side = "left"
    if loss_type == "luspo":  # TRL refuses luspo at token level
        config.setdefault("importance_sampling_level", "sequence")
    # Removed with the trainer, or at exit (TemporaryDirectory's own weakref.finalize): the
    # cache keeps its trainers, and their folders, until then.
    out_dir = tempfile.TemporaryDirectory(prefix="posttrain-trl-loss-")
    args = GRPOConfig(
        output_dir=out_dir.name,
        loss_type=loss_type,
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=MAX_COMPLETION_LENGTH,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        # TRL's default bf16=True runs the policy under bfloat16 autocast (log-probs ~1e-3 off);
        # the loss suite is a float32 suite, so the rows run TRL in float32.
        bf16=config.pop("bf16", False),
        **config,
    )
    trainer: Any = GRPOTrainer(
        model=model,
        reward_funcs=[_no_reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [""]}),
        processing_class=tok,
    )
    trainer.model.train()  # _compute_loss's "train" mode: the accumulation normalizer applies
    trainer.current_gradient_accumulation_steps = 1
    trainer.posttrain_output_dir = out_dir  # alive as long as the trainer
    _TRAINERS[key] = trainer
    return trainer


def _fuse(policy: Any, trainer: Any) -> None:
    """Patch ``policy`` as GRPOTrainer patches its own model (once): ``policy(...,
    fused_lm_head=True)`` then returns TRL's chunked log-probs; without it, its forward is
    unchanged."""
    if getattr(policy, "_posttrain_trl_fused", False):
        return
    with optional_deps():
        from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(
        policy,
        temperature=trainer.temperature,
        cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32,
        outputs=("log_probs", "entropy"),
    )
    policy._posttrain_trl_fused = True


def _no_reward(**_: Any) -> list[float | None]:  # pragma: no cover - never called: no training
    return []


def trl_inputs(td: TensorDictBase, *, zero_outside: bool) -> tuple[dict[str, Any], torch.Tensor]:
    """The ``inputs`` dict GRPOTrainer's ``_compute_loss`` reads, and the loss mask [B, C].

    Example:
        >>> from posttrain.testing import llm_batch
        >>> inputs, mask = trl_inputs(llm_batch(2, 8), zero_outside=True)
        >>> sorted(inputs)[:3], mask.shape[0]
        (['advantages', 'completion_ids', 'completion_mask'], 2)
    """
    tokens, att = td.get(K("tokens")), td.get(K("attention_mask"))
    asst = loss_tokens(td.get(K("assistant_mask")), att)
    first = asst.float().argmax(-1)[asst.any(-1)]
    split = max(1, int(first.min())) if first.numel() else tokens.shape[1] - 1
    old, adv = td.get(K("sample_log_probs"), None), td.get(K("advantage"), None)
    mask = asst[:, split:]
    inputs: dict[str, Any] = {
        "prompt_ids": tokens[:, :split],
        "prompt_mask": att[:, :split].long(),
        "completion_ids": tokens[:, split:],
        "completion_mask": att[:, split:].long(),
        "tool_mask": mask.long(),
        "num_items_in_batch": mask.sum(),
    }
    if old is not None:
        old = old[:, split:]
        inputs["old_per_token_logps"] = zero_outside_mask(mask, old) if zero_outside else old
    if adv is not None:
        if adv.ndim == 2:
            adv = adv[:, split:]
            adv = zero_outside_mask(mask, adv) if zero_outside else adv
        inputs["advantages"] = adv
    return inputs, mask


def _pad_rows_to_ranks(inputs: dict[str, Any], rows: int, processes: int) -> int:
    """Pad ``inputs``' rows (in place) to the most any rank holds; return the padded count.

    ``GRPOTrainer._compute_loss`` all-gathers one clip ratio per row (``accelerator.gather``),
    which needs as many rows on every rank: TRL's trainer keeps ``per_device_train_batch_size``
    fixed, a loop with ragged shards does not. The padding rows repeat the first row with no
    loss token (``tool_mask`` 0) and advantage 0: they add nothing to a sum and count only in
    the means over rows, which the caller rescales. Across ranks this is one all-reduce of the
    row count per call, made only where TRL's accelerator spans several processes.

    Example (one process: nothing to pad):
        >>> from posttrain.testing import llm_batch
        >>> inputs, _ = trl_inputs(llm_batch(2, 8), zero_outside=True)
        >>> _pad_rows_to_ranks(inputs, 2, processes=1), inputs["completion_ids"].shape[0]
        (2, 2)
    """
    if processes <= 1 or rows == 0:
        return rows
    import torch.distributed as dist

    most = torch.tensor([rows], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    extra = int(most.item()) - rows
    if extra <= 0:
        return rows
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == rows:
            pad = value[:1].expand(extra, *value.shape[1:])
            if key in ("tool_mask", "advantages"):
                pad = torch.zeros_like(pad)
            inputs[key] = torch.cat([value, pad])
    return rows + extra


class TRLGRPOLoss(torch.nn.Module):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` for one ``loss_type`` as a ``LossModuleV1``.

    ``adapted=False`` (the raw row): the layout mapped to TRL's inputs, values as they are
    (NaN outside the assistant mask stays NaN), ``num_items_in_batch`` the batch's own loss
    tokens, one accumulation step. ``adapted=True``: the batch validated, values outside the
    mask zeroed, capability ``global_counts`` (see the module docstring).

    Example:
        >>> from posttrain.testing import llm_batch, tiny_causal_lm  # doctest: +SKIP
        >>> loss = TRLGRPOLoss(tiny_causal_lm(vocab_size=64), "dapo")  # doctest: +SKIP
        >>> loss(llm_batch(2, 8, vocab_size=64))["loss_objective"].shape  # doctest: +SKIP
        torch.Size([])
    """

    def __init__(
        self,
        policy: Any,
        loss_type: str = "grpo",
        aggregation: str | None = None,
        *,
        adapted: bool = True,
        ratio: str | None = None,
        **config: Any,
    ) -> None:
        super().__init__()
        if adapted and ratio is not None and ratio != RATIOS.get(loss_type):
            raise ValueError(
                f"ratio: TRL's {loss_type!r} surrogate is "
                f"{RATIOS.get(loss_type, 'none of the contract forms')!r}, found {ratio!r}"
            )
        if loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type: expected one of {sorted(LOSS_TYPES)}, found {loss_type!r}"
            )
        if adapted and aggregation is not None and aggregation != LOSS_TYPES[loss_type]:
            raise ValueError(
                f"aggregation: TRL's loss_type {loss_type!r} normalizes as "
                f"{LOSS_TYPES[loss_type]!r}, found {aggregation!r}"
            )
        self.policy = policy
        self.loss_type = loss_type
        self.adapted = adapted
        self.trainer = grpo_trainer(loss_type, **config)
        _fuse(policy, self.trainer)

    def forward(
        self,
        td: TensorDictBase,
        *,
        counts: GlobalCounts | None = None,
        num_items_in_batch: int | None = None,
    ) -> TensorDict:
        """TRL's loss of ``td`` (never mutated), as a part of the batch ``counts`` describes.

        ``num_items_in_batch`` (raw row only): TRL's own global token count, as its trainer
        passes it under gradient accumulation (default: this batch's loss tokens).
        """
        if self.adapted:
            LLM_LAYOUT_V1.validate_batch(
                td, require=("sample_log_probs", "advantage"), context=f"TRL {self.loss_type}"
            )
            own, c = global_counts(td, counts)
        elif counts is not None:
            raise TypeError("counts: the raw TRL row takes no global counts")
        inputs, _ = trl_inputs(td, zero_outside=self.adapted)
        rows = td.batch_size[0]
        if self.adapted and self.loss_type in _CLIPPED:
            rows = _pad_rows_to_ranks(inputs, rows, self.trainer.accelerator.num_processes)
        if num_items_in_batch is not None:
            if self.adapted:
                raise TypeError("num_items_in_batch: the adapted row takes counts=GlobalCounts")
            inputs["num_items_in_batch"] = torch.tensor(float(num_items_in_batch))
        scale = 1.0
        if self.adapted:
            if self.loss_type in GLOBAL_TOKENS:
                # TRL divides num_items_in_batch by the number of processes, undoing the mean
                # DDP takes of gradients; the contract's ranks all-reduce by sum.
                ranks = self.trainer.accelerator.num_processes
                inputs["num_items_in_batch"] = torch.tensor(float(c.tokens) * ranks)
            elif self.loss_type == "bnpo":
                scale = own.tokens / max(c.tokens, 1)
            else:  # a mean over every row of the micro-batch, rows without a token included
                scale = rows / max(c.sequences, 1)  # TRL's mean counts the padding rows too
            if own.tokens == 0:  # this part weighs nothing (TRL's means of nothing may be NaN)
                # TRL's loss still runs: it all-reduces its metrics across ranks, and a rank
                # that skipped those collectives would leave the others waiting on it.
                with torch.no_grad():
                    self.trainer._compute_loss(self.policy, inputs)
                return TensorDict({"loss_objective": torch.zeros(())}, batch_size=[])
        loss = self.trainer._compute_loss(self.policy, inputs)
        return TensorDict({"loss_objective": (loss * scale).reshape(())}, batch_size=[])


_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The loss types whose term is PPO's clipped surrogate (TRL's epsilon 0.2): TRL 1.16's
``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) clamps ``coef_1`` to
``[1 - epsilon_low, 1 + epsilon_high]`` for ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` and
``luspo`` (luspo's ``coef_1`` the sequence ratio: ``importance_sampling_level='sequence'``),
both epsilons ``GRPOConfig.epsilon`` (0.2) where ``epsilon_high`` is unset."""


def _factory(loss_type: str, *, adapted: bool) -> Any:
    def make(policy: Any, aggregation: str | None = None, **config: Any) -> TRLGRPOLoss:
        return TRLGRPOLoss(policy, loss_type, aggregation, adapted=adapted, **config)

    make.__name__ = f"{'adapted' if adapted else 'raw'}_trl_{loss_type}"
    return make


_CONFIG: dict[str, dict[str, Any]] = {"cispo": {"epsilon_high": 5.0}}
"""GRPOConfig values a row sets: cispo's upper clip on its ratio weight is ``epsilon_high``,
whose default (``epsilon``, 0.2) clamps every weight at ratio 1 to 0.2 (a fifth of the
gradient); TRL's documentation recommends 5.0 for cispo (ScaleRL's ε_max)."""

CLIP_EPSILON: dict[str, float | tuple[float, float]] = {
    **dict.fromkeys(_CLIPPED, 0.2),
    # trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, loss_type 'cispo':
    # torch.clamp(coef_1, max=self.epsilon_high).detach(), epsilon_high the row's 5.0: the
    # contract's clip(r, 1 - ε_low, 1 + ε_high) with 1 + ε_high = 5.0 and no lower bound
    # (ε_low = 1: a ratio is never below 0).
    "cispo": (1.0, _CONFIG["cispo"]["epsilon_high"] - 1),
}
"""TRL loss_type -> the ``clip_epsilon`` its rows declare (capability ``clip``): the bounds
``GRPOTrainer._compute_loss`` applies in the row's configuration."""


def _row(loss_type: str, *, adapted: bool, known: frozenset[str] = frozenset()) -> Implementation:
    agg = LOSS_TYPES[loss_type]
    return Implementation(
        "loss",
        partial(
            _factory(loss_type, adapted=adapted), aggregation=agg, **_CONFIG.get(loss_type, {})
        ),
        name=f"{'TRLGRPOLoss(' if adapted else ''}trl GRPOTrainer._compute_loss"
        f"(loss_type={loss_type!r}"
        + "".join(f", {k}={v}" for k, v in _CONFIG.get(loss_type, {}).items())
        + f"){')' if adapted else ''}",
        capabilities={"per_token_advantage"}
        | ({"global_counts"} if adapted else set())
        | ({"clip"} if loss_type in CLIP_EPSILON else set()),
        options={"aggregation": agg}
        | ({"ratio": RATIOS[loss_type]} if loss_type in RATIOS else {}),
        extras={"t_norm": MAX_COMPLETION_LENGTH}
        | ({"clip_epsilon": CLIP_EPSILON[loss_type]} if loss_type in CLIP_EPSILON else {}),
        description="TRL 1.16's GRPOTrainer._compute_loss on a real trainer, called with the "
        "suite's policy; "
        + (
            "adapted: values outside the mask zeroed, global counts as num_items_in_batch "
            "(dapo, cispo, vespo) or a rescale of TRL's micro-batch mean (the others)."
            if adapted
            else "raw: the layout's values as they are, num_items_in_batch the batch's own tokens."
        ),
        known_failures=known,
    )


RAW_KNOWN: dict[str, frozenset[str]] = {
    "grpo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}),
    "bnpo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}),
    "dr_grpo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}),
    "dapo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}),
    "cispo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021", "LOSS-023"}),
    "sapo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}),
    "vespo": frozenset({"LOSS-002", "LOSS-004", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}),
    "luspo": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021", "LOSS-022"}),
}
"""What each raw row fails, measured with TRL 1.16 (loss type -> requirement ids). The raw rows
pass the layout's NaN sample log-probs outside the assistant mask to TRL, whose masked sum
keeps them (NaN x 0): loss_objective is NaN off policy, so the ratio checks (LOSS-021, and
LOSS-022/LOSS-023 under the declared clip) fail; the adapted rows zero them and conform."""
ADAPTED_KNOWN: dict[str, frozenset[str]] = {
    # Measured with TRL 1.16: their loss_objective at ratio 1 is not the aggregation's
    # weighted sum of -A (LOSS-016's value), whatever the counts. (cispo declares ratio cispo,
    # whose value at ratio 1 is the sum of w * -A * log p: it conforms.) sapo's sigmoid gate
    # and vespo's gamma weight are none of the contract's ratio forms: undeclared, LOSS-021
    # checks the token ratio (loss 1.8) and they fail it.
    "sapo": frozenset({"LOSS-016", "LOSS-021"}),
    "vespo": frozenset({"LOSS-016", "LOSS-021"}),
}
"""What each adapted row fails, measured with TRL 1.16 (loss type -> requirement ids)."""

ROWS: dict[str, Implementation] = {}
"""``trl-raw-<loss_type>`` and ``trl-adapted-<loss_type>`` rows, by name."""
for _lt in LOSS_TYPES:
    for _adapted in (False, True):
        _side = "adapted" if _adapted else "raw"
        _known = (ADAPTED_KNOWN if _adapted else RAW_KNOWN).get(_lt, frozenset())
        ROWS[f"trl-{_side}-{_lt.replace('_', '-')}"] = _row(_lt, adapted=_adapted, known=_known)
        # A module attribute per row: the runner's repro command names it.
        globals()[f"{_side}_{_lt}".upper()] = ROWS[f"trl-{_side}-{_lt.replace('_', '-')}"]
