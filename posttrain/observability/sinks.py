"""Metric sinks on real backends that TorchRL's loggers do not cover as a ``MetricSinkV1``.

TorchRL's ``CSVLogger`` and ``TensorboardLogger`` conform as they are
(``posttrain.adapters.torchrl.loggers``); posttrain's ``JsonlSink`` is the reference. MLflow is
added here through its client API (a local SQLite tracking store, one run per sink): TorchRL's
``MLFlowLogger`` drives MLflow's process-global active run, so two of them in one process
collide.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["MlflowSink", "Tee", "mlflow_uri", "read_mlflow"]

EXPERIMENT = "posttrain"


def mlflow_uri(directory: str | os.PathLike[str]) -> str:
    """The SQLite tracking URI of the store under ``directory``.

    Example:
        >>> mlflow_uri("/tmp/x")
        'sqlite:////tmp/x/mlflow.db'
    """
    return f"sqlite:///{Path(directory).resolve()}/mlflow.db"


class MlflowSink:
    """``MetricSinkV1`` writing to an MLflow tracking store (SQLite) under ``directory``.

    Every ``log_scalar`` is one ``log_metric`` of the sink's run (MLflow keeps every step);
    ``close`` marks the run finished. Needs ``pip install 'posttrain[observability]'``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = MlflowSink(d)  # doctest: +SKIP
        >>> sink.log_scalar("policy/kl_ref/k3", 0.25, step=3); sink.close()  # doctest: +SKIP
        >>> read_mlflow(d)  # doctest: +SKIP
        {'policy/kl_ref/k3': [(3, 0.25)]}
    """

    def __init__(self, directory: str | os.PathLike[str], *, run_name: str = "run") -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "MlflowSink needs mlflow: pip install 'posttrain[observability]'"
            ) from e
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=mlflow_uri(directory))
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = (
            exp.experiment_id
            if exp is not None
            else self.client.create_experiment(
                EXPERIMENT, artifact_location=Path(directory).resolve().as_uri() + "/artifacts"
            )
        )
        self.run_id: str = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self._closed = False

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """One metric value at ``step`` (0 when none is given)."""
        self.client.log_metric(
            self.run_id, name, float(value), timestamp=int(time.time() * 1000), step=step or 0
        )

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Run parameters (strings in MLflow)."""
        for k, v in params.items():
            self.client.log_param(self.run_id, k, v)

    def close(self) -> None:
        """Mark the run finished; idempotent."""
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id)


def read_mlflow(
    directory: str | os.PathLike[str], run_name: str | None = None
) -> dict[str, list[tuple[int, float]]]:
    """Every metric of every run (or of the runs named ``run_name``) under ``directory``,
    through MLflow's own client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri(directory))
    exp = client.get_experiment_by_name(EXPERIMENT)
    out: dict[str, list[tuple[int, float]]] = {}
    if exp is None:
        return out
    for run in client.search_runs([exp.experiment_id]):
        if run_name is not None and run.info.run_name != run_name:
            continue
        for key in run.data.metrics:
            history = client.get_metric_history(run.info.run_id, key)
            out.setdefault(key, []).extend((int(m.step), float(m.value)) for m in history)
    for vals in out.values():
        vals.sort()
    return out


class Tee:
    """One ``MetricSinkV1`` writing to several (TensorBoard and MLflow at once, say).

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink, read_jsonl
        >>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> tee = Tee(JsonlSink(a), JsonlSink(b))
        >>> tee.log_scalar("loss/total", 1.0, step=1); tee.close()
        >>> read_jsonl(a) == read_jsonl(b) == {"loss/total": [(1, 1.0)]}
        True
    """

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Log to every sink."""
        for s in self.sinks:
            s.log_scalar(name, value, step=step)

    def close(self) -> None:
        """Close (or flush) every sink that can be."""
        for s in self.sinks:
            fn = getattr(s, "close", None) or getattr(s, "flush", None)
            if callable(fn):
                fn()
