"""The metric catalogue inside a running ``GRPOTrainer``, through the trainer's own logging.

TRL computes several catalogue metrics itself, with the catalogue's formula (from
``trl/trainer/grpo_trainer.py``, TRL 1.16): ``kl`` is the k3 KL to the reference as a masked
token mean over the global batch, ``entropy`` the full-vocabulary entropy likewise, and
``clip_ratio/low_mean`` / ``clip_ratio/high_mean`` the sign-aware clip fractions. The callback
adds them under the catalogue's names, and adds the rollout metrics (lengths, staleness) of the
generations :class:`~posttrain.adapters.trl.rollout.CaptureRollouts` saw since the last log.
Because it writes into the ``logs`` every reporter receives, it must run before them:
:func:`install` puts it first.
"""

from __future__ import annotations

from typing import Any

from posttrain.observability.reduce import Accumulator

TRL_SAME = {
    "kl": "policy/kl_ref/k3",
    "entropy": "policy/entropy",
    "clip_ratio/low_mean": "policy/clip_frac/low",
    "clip_ratio/high_mean": "policy/clip_frac/high",
    "reward": "rollout/reward/mean",
    "loss": "loss/total",
    "grad_norm": "optim/grad_norm",
    "learning_rate": "optim/lr",
}
"""TRL log key -> catalogue name, where TRL's formula is the catalogue's (checked in its source;
``reward`` is a mean of equal-size per-step means, equal to the sequence mean)."""


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

    ``capture`` is the trainer's ``rollout_func`` (:class:`CaptureRollouts` created with
    ``metrics=Accumulator()``): its rollout metrics since the last log are added and reset.
    ``sink`` (any ``MetricSinkV1``) also receives the catalogue metrics under their exact
    names at the trainer's global step (reporters add their own prefixes, e.g. ``train/``).

    Example:
        >>> cb = CatalogueCallback()
        >>> logs = {"kl": 0.1, "entropy": 2.0, "loss": 0.5}
        >>> cb.on_log(None, None, None, logs=logs)
        >>> logs["policy/kl_ref/k3"], logs["loss/total"]
        (0.1, 0.5)
    """

    def __init__(self, capture: Any = None, sink: Any = None) -> None:
        self.capture = capture
        self.sink = sink

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add the catalogue's names to TRL's ``logs`` before the reporting callbacks see them."""
        if logs is None or any(k.startswith("eval_") for k in logs):
            return
        for trl_name, name in TRL_SAME.items():
            value = logs.get(trl_name)
            if isinstance(value, int | float):
                logs[name] = float(value)
        added = {name: logs[name] for name in TRL_SAME.values() if name in logs}
        acc: Accumulator | None = getattr(self.capture, "metrics", None)
        if acc is not None:
            added.update(acc.values())
            self.capture.metrics = Accumulator(acc.catalogue)
        logs.update(added)
        if self.sink is not None and state is not None:
            for name, value in added.items():
                self.sink.log_scalar(name, value, step=int(state.global_step))


def install(trainer: Any, callback: Any) -> Any:
    """Put ``callback`` first, so its additions reach every reporter (TensorBoard, MLflow ...).

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
    return callback
