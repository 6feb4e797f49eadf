"""A metric sink with NeMo-RL's ``LoggerInterface`` shape, over any ``MetricSinkV1``.

NeMo-RL's loggers (``nemo_rl/utils/logger.py``, commit 7ea279a) take
``log_metrics(metrics, step, prefix="", step_metric=None, step_finished=False)``,
``log_hyperparams(params)``, ``log_histogram(histogram, step, name)`` and
``log_plot(figure, step, name)``; GRPO logs under prefixes ``train``, ``timing/train``,
``performance``, ``refit`` and ``validation`` (``nemo_rl/algorithms/grpo.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from posttrain.contracts.metrics import METRIC_NAME

NEMO_TO_CATALOGUE = {
    "train/reward": "rollout/reward/mean",
    "train/mean_prompt_length": "rollout/prompt_len/mean",
    "train/kl_penalty": "policy/kl_ref/k3",
    "train/probs_ratio": "policy/ratio/mean",
    "train/probs_ratio_min": "policy/ratio/min",
    "train/probs_ratio_max": "policy/ratio/max",
    "train/loss": "loss/total",
    "train/grad_norm": "optim/grad_norm",
    "train/lr": "optim/lr",
    "train/avg_trajectory_age": "staleness/mean",
    "timing/train/generation": "time/rollout_s",
    "timing/train/policy_training": "time/train_s",
    "timing/train/total_step_time": "time/step_s",
    "timing/train/prepare_for_generation/transfer_and_update_weights": "time/weight_sync_s",
}
"""NeMo-RL log name (prefix/key as grpo.py logs it) -> catalogue name, where the formula is the
catalogue's: the loss metrics are token means over the global batch (divided by the global
valid-token count, summed over microbatches), ``kl_penalty`` is the k3 KL before its coefficient
(NeMo-RL's default k3). Left out, as different or not verified: ``approx_entropy``,
``gen_kl_error`` (its KL estimator is unchecked), ``token_mult_prob_error``, per-GPU tokens/s."""

_BAD = re.compile(r"[^a-z0-9_/]+")


def metric_name(name: str, prefix: str | None = "") -> str:
    """``prefix/name`` in the catalogue's form: lowercase, ``[a-z0-9_]`` segments.

    Example:
        >>> metric_name("probs_ratio_min", "train"), metric_name("Policy Loss", "train")
        ('train/probs_ratio_min', 'train/policy_loss')
    """
    full = f"{prefix}/{name}" if prefix else name
    if METRIC_NAME.match(full):
        return full
    # Each part on its own: a name (or prefix) of symbols only would otherwise vanish into
    # the other part and log under it (``train/???`` as ``train``).
    parts = [_segment(prefix, "prefix", full)] if prefix else []
    return "/".join([*parts, _segment(name, "name", full)])


def _segment(part: str, what: str, full: str) -> str:
    out = _BAD.sub("_", part.lower())
    out = re.sub(r"/+", "/", re.sub(r"_*/_*", "/", out)).strip("_/")
    if not METRIC_NAME.match(out):
        raise ValueError(
            f"metric name {full!r}: no catalogue form (expected the {what} {part!r} to keep "
            f"at least one [a-z0-9] character per segment, found {out!r})"
        )
    return out


class NemoLogger:
    """NeMo-RL's ``LoggerInterface`` over a posttrain/TorchRL metric sink; also a ``MetricSinkV1``.

    Scalars (ints, floats, 0-d tensors) go to ``sink.log_scalar(prefix/name, value, step)``
    under the catalogue form of the name (``names`` renames first: NeMo-RL name -> catalogue
    name; ``catalogue=True`` starts from :data:`NEMO_TO_CATALOGUE`); a histogram is logged as its mean, min and max (and as a distribution where the sink has
    ``log_histogram``); a plot is not a scalar and is
    dropped (counted in ``dropped``). ``step_metric`` and ``step_finished`` (W&B's step
    bookkeeping) do not change what is stored.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink, read_jsonl
        >>> d = tempfile.mkdtemp()
        >>> log = NemoLogger(JsonlSink(d))
        >>> log.log_metrics({"reward": 0.5, "probs_ratio_min": 0.9}, step=3, prefix="train")
        >>> log.flush(); sorted(read_jsonl(d))
        ['train/probs_ratio_min', 'train/reward']
    """

    def __init__(
        self, sink: Any, *, names: Mapping[str, str] | None = None, catalogue: bool = False
    ) -> None:
        self.sink = sink
        self.names = {**(NEMO_TO_CATALOGUE if catalogue else {}), **(names or {})}
        self.hyperparams: dict[str, Any] = {}
        self.dropped = 0

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """``MetricSinkV1``: one scalar, name as given (renamed if ``names`` says so)."""
        self.sink.log_scalar(self.names.get(name, name), value, step=step)

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        """NeMo-RL's call: every scalar of ``metrics`` under ``prefix``, all or nothing.

        Every name is worked out before anything is logged: a name with no catalogue form, or
        two names that end up as one metric (``"Policy Loss"`` and ``"policy_loss"``), raise
        ``ValueError`` naming them, and nothing is logged or counted as dropped.
        """
        points: dict[str, tuple[str, float]] = {}  # metric name -> (input name, value)
        dropped = 0
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is None:
                dropped += 1
                continue
            full = f"{prefix}/{key}" if prefix else key
            name = self.names.get(full) or metric_name(key, prefix)
            if name in points:
                raise ValueError(
                    f"metrics[{key!r}]: expected a metric of its own, found it maps to "
                    f"{name!r} as metrics[{points[name][0]!r}] does (nothing logged)"
                )
            points[name] = (key, scalar)
        for name, (_, scalar) in points.items():
            self.sink.log_scalar(name, scalar, step=step)
        self.dropped += dropped

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Kept in ``hyperparams``; passed on where the sink has ``log_hparams``."""
        self.hyperparams.update(params)
        log_hparams = getattr(self.sink, "log_hparams", None)
        if callable(log_hparams):
            log_hparams(dict(params))

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        """Mean, min and max of ``histogram`` as ``name/mean`` etc.; the distribution itself
        (its finite values) too where the sink has ``log_histogram`` (metrics contract 1.3)."""
        values = [v for v in (_scalar(x) for x in histogram) if v is not None]
        if not values:
            self.dropped += 1
            return
        base = metric_name(name)
        log_hist = getattr(self.sink, "log_histogram", None)
        finite = [v for v in values if math.isfinite(v)]
        if callable(log_hist) and finite:
            log_hist(base, finite, step=step)
        for stat, v in (
            ("mean", sum(values) / len(values)),
            ("min", min(values)),
            ("max", max(values)),
        ):
            self.sink.log_scalar(f"{base}/{stat}", v, step=step)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """A figure is not a scalar: dropped."""
        self.dropped += 1

    def flush(self) -> None:
        """The sink's ``flush`` where it has one."""
        flush = getattr(self.sink, "flush", None)
        if callable(flush):
            flush()


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        return float(value.item())
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        out = item()
        return float(out) if isinstance(out, int | float) else None
    return None
