"""Conformance declarations of the observability sinks (entry points in ``pyproject.toml``)."""

from __future__ import annotations

from typing import Any

from posttrain.contracts.implementation import Implementation


def _mlflow(directory: Any) -> Any:
    from posttrain.observability.sinks import MlflowSink

    return MlflowSink(directory)


def _read_mlflow(directory: Any) -> Any:
    from posttrain.observability.sinks import read_mlflow

    return read_mlflow(directory)


MLFLOW_SINK = Implementation(
    "metrics",
    _mlflow,
    name="posttrain.MlflowSink (SQLite tracking store)",
    extras={"reader": _read_mlflow},
    known_failures={"MET-004"},  # SHOULD: MLflow stores +-inf as +-1.797e308
    description="MLflow through its client API into a local SQLite store, read back with MlflowClient.",
)
"""Entry point ``mlflow-sink``."""


def _wandb(directory: Any) -> Any:
    from posttrain.observability.sinks import WandbSink

    return WandbSink(directory)


def _read_wandb(directory: Any) -> Any:
    from posttrain.observability.sinks import read_wandb

    return read_wandb(directory)


def _read_wandb_histograms(directory: Any) -> Any:
    from posttrain.observability.sinks import read_wandb_histograms

    return read_wandb_histograms(directory)


def _read_wandb_samples(directory: Any) -> Any:
    from posttrain.observability.sinks import read_wandb_samples

    return read_wandb_samples(directory)


WANDB_SINK = Implementation(
    "metrics",
    _wandb,
    name="posttrain.WandbSink (offline run)",
    capabilities={"histogram", "samples"},
    extras={
        "reader": _read_wandb,
        "histogram_reader": _read_wandb_histograms,
        "samples_reader": _read_wandb_samples,
    },
    description=(
        "W&B in offline mode, one run per sink, read back from each run's .wandb log with "
        "W&B's own reader (wandb leet inspect --json)."
    ),
)
"""Entry point ``wandb-sink``."""


def _tensorboard(directory: Any) -> Any:
    from posttrain.observability.sinks import TensorboardSink

    return TensorboardSink(directory)


def _read_tensorboard(directory: Any) -> Any:
    from posttrain.adapters.torchrl.loggers import read_tensorboard

    return read_tensorboard(directory)


def _read_tensorboard_histograms(directory: Any) -> Any:
    from posttrain.observability.sinks import read_tensorboard_histograms

    return read_tensorboard_histograms(directory)


TENSORBOARD_SINK = Implementation(
    "metrics",
    _tensorboard,
    name="posttrain.TensorboardSink (event files)",
    capabilities={"flush", "histogram"},
    extras={"reader": _read_tensorboard, "histogram_reader": _read_tensorboard_histograms},
    description=(
        "torch.utils.tensorboard's SummaryWriter (add_scalar, add_histogram), read back with "
        "TensorBoard's EventAccumulator."
    ),
)
"""TensorBoard with histograms (entry point ``tensorboard-sink``)."""
