"""The metric catalogue inside a running ``GRPOTrainer``, through the trainer's own logging.

TRL 1.16 (``trl/trainer/grpo_trainer.py``) logs the mean, over the log window, of values it
appends once per generation or per micro-batch: ``reward``, ``reward_std``,
``rewards/<f>/mean``, ``frac_reward_zero_std`` and ``completions/*`` per generation batch;
``kl``, ``entropy`` and ``clip_ratio/*`` per micro-batch (each a token mean over that
micro-batch, whose token count it does not keep). The callback does not forward those means of
means. :func:`install` hooks the trainer where the un-averaged values pass:

- ``_calculate_rewards`` returns every completion's reward per function (``rewards_per_func``);
- ``_generate_and_score_completions`` returns the completions (ids, masks) and advantages:
  the callback runs :func:`~posttrain.observability.hooks.rollout_metrics` on them (rewards
  weighted as TRL weights them, NaN for an unscorable completion; groups of
  ``num_generations``; truncation as TRL's ``completions/clipped_ratio``: the last completion
  token is neither EOS nor pad; per-function rewards);
- ``_prepare_inputs`` hands each micro-batch to the optimizer: staleness is counted there, the
  optimizer steps done (``state.global_step``) minus those done when the batch was generated
  (0 when every step generates, the lag when ``steps_per_generation`` or ``num_iterations``
  reuse a generation); with a :class:`~posttrain.adapters.trl.rollout.CaptureRollouts` as the
  ``rollout_func``, its :meth:`~posttrain.adapters.trl.rollout.CaptureRollouts.consumed` counts
  it instead, in the capture's own ``version`` (the one stamped on the buffer's items);
- ``_compute_loss`` appends one value per micro-batch to TRL's ``kl``, ``entropy`` and
  ``clip_ratio/low_mean``/``high_mean`` (each a token mean over the micro-batch on every
  process, its count reduced away): the callback takes each value with the micro-batch's own
  token count (its completion mask; its sequence count where TRL averages over sequences), so
  the log window's ``policy/kl_ref/k3``, ``policy/entropy`` and ``policy/clip_frac/*`` are
  token means over every token of the window and of every process, whatever the gradient
  accumulation.

``loss``, ``grad_norm`` and ``learning_rate`` are the Trainer's own. Generation time and
tokens per second come from :class:`~posttrain.adapters.trl.rollout.CaptureRollouts` when it
is the ``rollout_func``.
Because the callback writes into the ``logs`` every reporter receives, it must run before
them: :func:`install` puts it first.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from tensordict import TensorDict

from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability.reduce import Accumulator

TRL_SAME = {
    "loss": "loss/total",
    "grad_norm": "optim/grad_norm",
    "learning_rate": "optim/lr",
}
"""Trainer log key -> catalogue name: one value per log, the catalogue's quantity."""

TRL_PER_MICROBATCH = {
    "kl": "policy/kl_ref/k3",
    "entropy": "policy/entropy",
    "clip_ratio/low_mean": "policy/clip_frac/low",
    "clip_ratio/high_mean": "policy/clip_frac/high",
}
"""TRL key -> catalogue name where TRL's formula is the catalogue's (a token mean over one
micro-batch, across processes): each value is taken with its micro-batch's token count."""

_PER_SEQUENCE_WHEN_SEQUENCE_LEVEL = {"clip_ratio/low_mean", "clip_ratio/high_mean"}

K = LLM_LAYOUT_V1.key


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "CatalogueCallback needs transformers: pip install 'posttrain[trl]'"
        ) from e
    base: type = TrainerCallback
    return base


class CatalogueCallback(_callback_base()):  # type: ignore[misc]
    """Adds catalogue metrics to every ``GRPOTrainer`` log, for every reporter to see.

    :func:`install` attaches it to the trainer (see the module's text for what it reads
    where). ``capture`` is the trainer's ``rollout_func`` (:class:`CaptureRollouts` created
    with ``metrics=Accumulator()``): its generation time and tokens per second since the last
    log are added. ``sink`` (any ``MetricSinkV1``) also receives the catalogue metrics under
    their exact names at the trainer's global step (reporters add their own prefixes, e.g.
    ``train/``); with ``histograms``, also the distributions ``rollout/response_len``,
    ``rollout/reward`` and ``rollout/advantage`` of the log window through its
    ``log_histogram``. With ``keep_batches``, :attr:`batches` keeps each training generation as a
    layout batch (with the weights version that generated it) and :attr:`consumed` each
    micro-batch the optimizer took (with the version it trained), for checks.

    Example:
        >>> cb = CatalogueCallback()
        >>> logs = {"kl": 0.1, "loss": 0.5, "grad_norm": 2.0}
        >>> cb.on_log(None, None, None, logs=logs)  # not installed: the Trainer's own values
        >>> logs["loss/total"], logs["optim/grad_norm"], "policy/kl_ref/k3" in logs
        (0.5, 2.0, False)
    """

    def __init__(
        self,
        capture: Any = None,
        sink: Any = None,
        *,
        keep_batches: bool = False,
        histograms: bool = False,
    ) -> None:
        if histograms and not callable(getattr(sink, "log_histogram", None)):
            raise TypeError(
                f"CatalogueCallback(histograms=True): expected a sink with log_histogram "
                f"(MET-008: JSONL, TensorBoard, W&B), found {type(sink).__name__}"
            )
        self.capture = capture
        self.sink = sink
        self.histograms = histograms
        self.trainer: Any = None
        self.acc = Accumulator()
        self.keep_batches = keep_batches
        self.batches: list[tuple[int, TensorDict]] = []
        self.consumed: list[tuple[int, TensorDict]] = []
        self._rewards: torch.Tensor | None = None
        self._generated_at: int | None = None

    def attach(self, trainer: Any) -> None:
        """Hook ``trainer``'s reward, generation and input methods (on the instance)."""
        self.trainer = trainer
        rewards = trainer._calculate_rewards
        generate = trainer._generate_and_score_completions
        prepare = trainer._prepare_inputs
        compute_loss = trainer._compute_loss

        @functools.wraps(rewards)
        def calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            out = rewards(*args, **kwargs)
            self._rewards = out.detach()
            return out

        @functools.wraps(generate)
        def generate_and_score(*args: Any, **kwargs: Any) -> Any:
            out = generate(*args, **kwargs)
            if trainer.model.training:
                self._rollout(out)
            return out

        @functools.wraps(prepare)
        def prepare_inputs(*args: Any, **kwargs: Any) -> Any:
            out = prepare(*args, **kwargs)
            if trainer.model.training and self._generated_at is not None:
                n = int(out["prompt_ids"].shape[0])
                cap = self.capture
                # The capture counts only with an accumulator of its own and a generation it
                # stamped; otherwise the lag is counted here, in global steps.
                if (
                    callable(getattr(cap, "consumed", None))
                    and getattr(cap, "metrics", None) is not None
                    and getattr(cap, "stamped", None) is not None
                ):
                    cap.consumed(trainer, n)  # its own version, read at on_log
                else:
                    lag = int(trainer.state.global_step) - self._generated_at
                    self.acc.add("staleness/mean", lag * n, n)
                    self.acc.add("staleness/max", lag)
                    self.acc.add("staleness/policy_version", int(trainer.state.global_step))
                if self.keep_batches:
                    self.consumed.append((int(trainer.state.global_step), _layout(out, 0, 1)))
            return out

        @functools.wraps(compute_loss)
        def compute_loss_counted(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            held = trainer._metrics["train"]
            # get, not []: TRL's metrics are a defaultdict, and a key read into it would be
            # logged by TRL as None (kl without beta, clip ratios of another loss type).
            before = {key: len(held.get(key, ())) for key in TRL_PER_MICROBATCH}
            out = compute_loss(model, inputs, *a, **kw)
            if trainer.model.training:
                self._per_microbatch(inputs, before)
            return out

        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_score
        trainer._prepare_inputs = prepare_inputs
        trainer._compute_loss = compute_loss_counted

    def _per_microbatch(self, inputs: dict[str, Any], before: dict[str, int]) -> None:
        """TRL's values of this micro-batch, each with this process's share of its count.

        TRL's value is ``sum / count`` over every process's tokens (``global_masked_mean``);
        adding ``(value * n_p, n_p)`` on each process p, then summing the pairs over micro-batches
        and processes (``all_reduce``), gives ``sum_i value_i * N_i / sum_i N_i``: the token mean
        over the whole window.
        """
        trainer = self.trainer
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        tokens = float(mask.sum())
        rows = float(mask.shape[0])
        one_column = int(mask.shape[1]) == 1  # TRL then averages over sequences
        sequence_level = getattr(trainer, "importance_sampling_level", "token") == "sequence"
        held = trainer._metrics["train"]
        for key, name in TRL_PER_MICROBATCH.items():
            values = held.get(key, [])
            if len(values) != before[key] + 1:
                continue  # not logged by this micro-batch (kl without beta, another loss type)
            per_seq = one_column or (sequence_level and key in _PER_SEQUENCE_WHEN_SEQUENCE_LEVEL)
            n = rows if per_seq else tokens
            self.acc.add(name, float(values[-1]) * n, n)

    def _rollout(self, out: dict[str, Any]) -> None:
        from posttrain.observability.hooks import rollout_metrics

        trainer = self.trainer
        ids, mask = out["completion_ids"].cpu(), out["completion_mask"].cpu().bool()
        b = int(ids.shape[0])
        start = int(trainer.accelerator.process_index) * b
        td = _layout(out, start, int(trainer.num_generations))
        fns: dict[str, torch.Tensor] = {}
        if self._rewards is not None:
            per_func = self._rewards.cpu().float()[start : start + b]
            weights = trainer.reward_weights.cpu().float()
            # As TRL: the weighted sum over the functions that scored it; NaN if none did.
            reward = (per_func * weights[None]).nansum(1)
            reward[per_func.isnan().all(1)] = torch.nan
            td.set(K("reward"), reward)
            fns = {n: per_func[:, i] for i, n in enumerate(trainer.reward_func_names)}
        # TRL's completions/clipped_ratio: the last completion token is neither EOS nor pad.
        ends = set(getattr(trainer, "eos_token_ids", None) or [])
        pad = getattr(getattr(trainer, "_tokenizer", None), "pad_token_id", None)
        ends |= {pad} if pad is not None else set()
        lengths = mask.sum(1)
        last = ids.gather(1, (lengths - 1).clamp_min(0)[:, None])[:, 0]
        truncated = torch.tensor([int(t) not in ends for t in last.tolist()]) & (lengths > 0)
        rollout_metrics(
            td, self.acc, truncated=truncated, reward_fns=fns, histograms=self.histograms
        )
        self._generated_at = int(trainer.state.global_step)
        if self.keep_batches:
            self.batches.append((self._generated_at, td))

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add the catalogue's names to TRL's ``logs`` before the reporting callbacks see them."""
        if logs is None or any(k.startswith("eval_") for k in logs):
            return
        added: dict[str, float] = {}
        for trl_name, name in TRL_SAME.items():
            value = logs.get(trl_name)
            if isinstance(value, int | float):
                added[name] = float(value)
        acc: Accumulator | None = getattr(self.capture, "metrics", None)
        if acc is not None:
            # Generation time and rate, and the staleness its consumed() counted; the rollout
            # metrics come from TRL's own rewards (_rollout), which the capture cannot see.
            added.update(
                {
                    k: v
                    for k, v in acc.values().items()
                    if k.startswith(("time/", "perf/", "staleness/"))
                }
            )
            self.capture.metrics = Accumulator(acc.catalogue)
        self.acc.all_reduce()
        added.update(self.acc.values())
        hist = self.acc.histograms()
        self.acc = Accumulator(self.acc.catalogue)
        logs.update(added)
        if self.sink is not None and state is not None:
            for name, value in added.items():
                self.sink.log_scalar(name, value, step=int(state.global_step))
            for name, values in hist.items():  # reporters' logs take scalars only
                self.sink.log_histogram(name, values, step=int(state.global_step))


def _layout(out: dict[str, Any], start: int, group: int) -> TensorDict:
    """TRL's batch dict (left-padded prompts, right-padded completions) in the LLM layout."""
    prompt_ids, prompt_mask = out["prompt_ids"].cpu(), out["prompt_mask"].cpu().bool()
    ids, mask = out["completion_ids"].cpu(), out["completion_mask"].cpu().bool()
    b = int(ids.shape[0])
    return TensorDict(
        {
            K("tokens"): torch.cat([prompt_ids, ids], 1),
            K("attention_mask"): torch.cat([prompt_mask, mask], 1),
            K("assistant_mask"): torch.cat([torch.zeros_like(prompt_mask), mask], 1),
            K("advantage"): out["advantages"].detach().cpu().float().reshape(-1),
            K("group_id"): (start + torch.arange(b)) // group,
        },
        batch_size=[b],
    )


def install(trainer: Any, callback: Any) -> Any:
    """Put ``callback`` first, so its additions reach every reporter (TensorBoard, MLflow ...),
    and attach it to ``trainer`` (its ``attach(trainer)``, when it has one).

    ``Trainer(callbacks=...)`` appends after the reporters, which would log ``logs`` before
    the callback adds to it.

    Example:
        >>> import tempfile
        >>> from transformers import Trainer, TrainingArguments
        >>> from posttrain.testing import tiny_causal_lm
        >>> args = TrainingArguments(tempfile.mkdtemp(), report_to=["tensorboard"], use_cpu=True)
        >>> trainer = Trainer(tiny_causal_lm(), args)
        >>> cb = install(trainer, CatalogueCallback())
        >>> [type(c).__name__ for c in trainer.callback_handler.callbacks]
        ['CatalogueCallback', 'DefaultFlowCallback', 'TensorBoardCallback', ...]
    """
    trainer.callback_handler.callbacks.insert(0, callback)
    if hasattr(callback, "attach") and hasattr(trainer, "_generate_and_score_completions"):
        callback.attach(trainer)
    return callback
