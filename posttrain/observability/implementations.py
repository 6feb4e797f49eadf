"""Conformance declarations of the observability sinks (entry points in ``pyproject.toml``).

Each row names its sink class and readers in ``posttrain.observability.sinks`` by attribute:
the backends (MLflow, W&B, TensorBoard) are imported only when a row is run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from posttrain.contracts.implementation import Implementation


def _call(attr: str, directory: Any) -> Any:
    from posttrain.observability import sinks

    return getattr(sinks, attr)(directory)


def _lazy(attr: str) -> Callable[[Any], Any]:
    # A partial of a module function (not a closure): rows stay picklable for worker processes.
    return functools.partial(_call, attr)


def _sink(
    cls: str,
    name: str,
    description: str,
    *,
    readers: dict[str, str],
    capabilities: frozenset[str] = frozenset(),
    known_failures: frozenset[str] = frozenset(),
    precision: str = "float32",
) -> Implementation:
    """One sink row: ``sinks.<cls>(directory)``, its readers as ``extras`` (key -> attribute)."""
    return Implementation(
        "metrics",
        _lazy(cls),
        name=name,
        capabilities=capabilities,
        extras={"precision": precision, **{key: _lazy(attr) for key, attr in readers.items()}},
        known_failures=known_failures,
        description=description,
    )


MLFLOW_SINK = _sink(
    "MlflowSink",
    "posttrain.MlflowSink (SQLite tracking store)",
    "MLflow through its client API into a local SQLite store, read back with MlflowClient.",
    readers={"reader": "read_mlflow"},
    known_failures=frozenset({"MET-004"}),  # SHOULD: MLflow stores +-inf as +-1.797e308
    precision="float64",  # a SQL double per value
)
"""Entry point ``mlflow-sink``."""

WANDB_SINK = _sink(
    "WandbSink",
    "posttrain.WandbSink (offline run)",
    "W&B in offline mode, one run per sink, read back from each run's .wandb log with "
    "W&B's own reader (wandb leet inspect --json).",
    readers={
        "reader": "read_wandb",
        "histogram_reader": "read_wandb_histograms",
        "samples_reader": "read_wandb_samples",
    },
    capabilities=frozenset({"histogram", "samples"}),
    precision="float64",  # values travel as JSON numbers in the run's log
)
"""Entry point ``wandb-sink``."""

TENSORBOARD_SINK = _sink(
    "TensorboardSink",
    "posttrain.TensorboardSink (event files)",
    "torch.utils.tensorboard's SummaryWriter (add_scalar, add_histogram), read back with "
    "TensorBoard's EventAccumulator.",
    readers={"reader": "read_tensorboard", "histogram_reader": "read_tensorboard_histograms"},
    capabilities=frozenset({"flush", "histogram"}),
)
"""TensorBoard with histograms (entry point ``tensorboard-sink``)."""
