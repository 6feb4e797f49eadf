"""Contract ``metrics`` v1: a sink for scalar metrics (TorchRL's ``Logger.log_scalar``)."""

from __future__ import annotations

import re
import threading
from typing import Any, Protocol

from posttrain._args import as_count
from posttrain.contracts.contract import Capability, Contract
from posttrain.contracts.requirements import Level, Requirement

METRIC_NAME = re.compile(r"^[a-z0-9_]+(/[a-z0-9_]+)*$")
"""Metric names: lowercase path segments, e.g. ``policy/kl_ref/k3``."""

METRIC_NAME_MAX = 250
"""The longest name MET-002 promises to store: MLflow's limit for a metric key.

MLflow refuses a longer key (``MAX_ENTITY_KEY_LENGTH``, ``mlflow/utils/validation.py``); 250
also keeps a per-metric file ``<segment>.csv`` within the usual 255-byte file-name limit.

Example:
    >>> len("policy/kl_ref/k3") <= METRIC_NAME_MAX
    True
"""


class NextStep:
    """One sink's steps: ``step=None`` is the name's next step, one past the highest so far.

    What MET-007 asks of ``log_scalar(name, value)`` without a step (TorchRL's ``WandbLogger``
    rule, per name): 0 for a name's first value, after steps 0 and 1 it is 2, after step 5 it
    is 6. Explicit steps are recorded too, so a later ``None`` follows them. Thread-safe.

    Example:
        >>> steps = NextStep()
        >>> steps("loss", None), steps("loss", None), steps("loss", 5), steps("loss", None)
        (0, 1, 5, 6)
        >>> steps("kl", None), steps("loss", 2), steps("loss", None)
        (0, 2, 7)
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, step: int | None) -> int:
        """The step to record ``name``'s value at: ``step``, or the next one when None."""
        with self._lock:
            last = self._last.get(name, -1)
            s = last + 1 if step is None else step
            self._last[name] = max(last, s)
            return s


def metric_point(
    name: str, value: Any, step: Any = None, *, steps: NextStep | None = None
) -> tuple[str, float, int]:
    """A ``log_scalar`` call's arguments checked: ``(name, float value, int step >= 0)``.

    ``value`` is anything with one real number (a float, an int, a one-element tensor);
    ``step`` an integer, or None for the sink's next step for ``name`` (MET-007), which
    ``steps`` (the sink's :class:`NextStep`) keeps; without ``steps`` a None step is refused
    rather than put at 0. A float step is refused rather than rounded: MET-001 reads back the
    step that was logged. Nothing is recorded in ``steps`` for a refused call.

    Example:
        >>> import torch
        >>> metric_point("loss/total", torch.tensor(0.5), step=3)
        ('loss/total', 0.5, 3)
        >>> steps = NextStep()
        >>> metric_point("loss/total", 0.5, steps=steps), metric_point("loss/total", 0.25, steps=steps)
        (('loss/total', 0.5, 0), ('loss/total', 0.25, 1))
        >>> metric_point("loss/total", 0.5, step=2.7)
        Traceback (most recent call last):
        ...
        ValueError: metric 'loss/total': step expected an int >= 0 or None, found 2.7
    """
    if not isinstance(name, str):
        raise ValueError(f"metric name: expected a str, found {type(name).__name__}")
    s = None if step is None else as_count(step)
    if step is not None and s is None:
        raise ValueError(f"metric {name!r}: step expected an int >= 0 or None, found {step!r}")
    try:
        if isinstance(value, str | bytes | complex):  # float("nan") would turn text into a value
            raise TypeError(type(value).__name__)
        v = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        # Built here only: the repr of a tensor costs ~60 us, on every call were it eager.
        raise ValueError(
            f"metric {name!r}: value expected one real number, found {value!r:.80}"
        ) from e
    if steps is not None:
        return name, v, steps(name, s)
    if s is None:
        raise ValueError(
            f"metric {name!r}: step None means the sink's next step for it, and no step "
            "counter was given (metric_point(..., steps=NextStep()))"
        )
    return name, v, s


class MetricSinkV1(Protocol):
    """Where metrics go. TorchRL's loggers (``CSVLogger``, ``TensorboardLogger``) conform.

    Example:
        >>> def log_step(sink: MetricSinkV1, step: int, reward: float) -> None:
        ...     sink.log_scalar("rollout/reward/mean", reward, step=step)
    """

    def log_scalar(self, name: str, value: float, step: int | None = None) -> Any:
        """Record ``value`` for ``name`` at ``step`` (None: the sink's next step for ``name``)."""
        ...


_M, _S = Level.MUST, Level.SHOULD

METRICS = Contract(
    id="metrics",
    title="Metric sink",
    purpose=(
        "Receives scalar metrics named after the observability catalogue and stores them in a "
        "real backend (CSV, TensorBoard, MLflow, W&B, JSONL), from which they read back unchanged."
    ),
    protocol=MetricSinkV1,
    version="1.2",
    factory=(
        "factory(directory: pathlib.Path) -> MetricSinkV1  # and Implementation.extras['reader']"
        "(directory) -> {name: [(step, value), ...]}, reading through the backend's own reader"
    ),
    capabilities=(
        Capability(name="flush", text="`flush()` makes everything logged so far readable by the backend's own reader.", methods=("flush",)),
        Capability(name="cross_process", text="Several processes may log into one run."),
    ),
    requirements=(
        Requirement(id="MET-001", level=_M, title="read back exactly", tightened=("1.1", "1.2"),
            text="Every logged (name, step, value) MUST read back from the backend with the same name, step and value (float32 rounding allowed); two values logged for one name at one step are two points, and both read back."),
        Requirement(id="MET-002", level=_M, title="catalogue names", tightened=("1.2",),
            text="Names matching `^[a-z0-9_]+(/[a-z0-9_]+)*$` of up to 250 characters (MLflow's limit for a metric key) MUST be stored unchanged, slashes included.", depends_on=("MET-001",)),
        Requirement(id="MET-003", level=_M, title="steps kept apart", tightened=("1.2",),
            text="Values logged for one name at different steps MUST all be kept, each with its step, in whatever order the steps come (a step lower than one already logged for the name included).", depends_on=("MET-001",)),
        Requirement(id="MET-004", level=_S, title="non-finite values kept",
            text="NaN and infinite values SHOULD be stored as such rather than dropped or replaced.", depends_on=("MET-001",)),
        Requirement(id="MET-005", level=_M, title="flush", capability="flush", tightened=("1.2",),
            text="After `flush()`, everything logged so far, under every name, MUST be readable without closing the sink.", depends_on=("MET-001",)),
        Requirement(id="MET-006", level=_M, title="several writers", capability="cross_process",
            text="Metrics logged from several processes into one run MUST all read back.", depends_on=("MET-001",)),
        Requirement(id="MET-007", level=_S, title="no step: the next step", since="1.1",
            text="A value logged without a step (`step=None`) SHOULD be recorded at the sink's next step for its name, one past the highest step logged for that name through the sink (0 for its first value), and read back there, not raise or fall back to step 0 (a SHOULD until v2: the 1.0 Protocol allowed `step=None` without saying what it means).", depends_on=("MET-001",)),
    ),
)  # fmt: skip
