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


WANDB_SINK = Implementation(
    "metrics",
    _wandb,
    name="posttrain.WandbSink (offline run)",
    extras={"reader": _read_wandb},
    description=(
        "W&B in offline mode, one run per sink, read back from each run's .wandb log with "
        "W&B's own reader (wandb leet inspect --json)."
    ),
)
"""Entry point ``wandb-sink``."""
