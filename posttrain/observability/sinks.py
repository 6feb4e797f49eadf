"""Metric sinks on real backends that TorchRL's loggers do not cover as a ``MetricSinkV1``.

TorchRL's ``CSVLogger`` and ``TensorboardLogger`` conform as they are but for a value logged
without a step (MET-007, published in ``posttrain.adapters.torchrl.deviations``;
``posttrain.adapters.torchrl.loggers``); posttrain's ``JsonlSink`` is the reference. MLflow is
added here through its client API (a local SQLite tracking store, one run per sink): TorchRL's
``MLFlowLogger`` drives MLflow's process-global active run, so two of them in one process
collide. W&B is added through its offline mode (one run per sink, read back with W&B's own reader
of the run's ``.wandb`` log, ``wandb leet inspect --json``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain._deps import optional_deps
from posttrain.contracts.metrics import (
    SAMPLE_COLUMNS,
    NextStep,
    histogram_values,
    metric_point,
    sample_rows,
)

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
        self._steps = NextStep()

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """One metric value at ``step`` (None: one past ``name``'s highest step so far)."""
        if self._closed:
            raise RuntimeError(
                f"MlflowSink: log_scalar({name!r}) after close(): the run is finished"
            )
        # MLflow itself would put a missing step at 0 (MET-007).
        _, v, s = metric_point(name, value, step, steps=self._steps)
        self.client.log_metric(self.run_id, name, v, timestamp=int(time.time() * 1000), step=s)

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
    through MLflow's own client.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> for name, kl in (("trl", 0.25), ("torchrl", 0.5)):  # doctest: +SKIP
        ...     sink = MlflowSink(d, run_name=name)
        ...     sink.log_scalar("policy/kl_ref/k3", kl, step=3); sink.close()
        >>> read_mlflow(d, "trl")  # doctest: +SKIP
        {'policy/kl_ref/k3': [(3, 0.25)]}
    """
    with optional_deps():
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


class TensorboardSink:
    """``MetricSinkV1`` writing TensorBoard event files under ``directory``, histograms too.

    Scalars through ``SummaryWriter.add_scalar`` (stored as float32), distributions through
    ``add_histogram`` (TensorBoard keeps count, min, max, sum and the buckets). TorchRL's
    ``TensorboardLogger`` is the same writer, but its ``log_histogram`` needs ``bins=`` (it
    raises ``KeyError: 'bins'`` without) and its ``log_scalar`` puts a value without a step at
    step 0 (MET-007). Needs tensorboard (``posttrain[observability]``).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = TensorboardSink(d)
        >>> sink.log_scalar("loss/total", 0.5, step=1)
        >>> sink.log_histogram("rollout/response_len", [3, 5, 5], step=1); sink.close()
        >>> read_tensorboard_histograms(d)["rollout/response_len"][0][1]["count"]
        3
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        with optional_deps():
            from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))
        self._steps = NextStep()

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """One value at ``step`` (None: one past ``name``'s highest step so far)."""
        _, v, s = metric_point(name, value, step, steps=self._steps)
        self.writer.add_scalar(name, v, global_step=s)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """The distribution of ``values`` (finite numbers) at ``step``."""
        import numpy as np

        vals = np.asarray(histogram_values(name, values), dtype=np.float64)
        self.writer.add_histogram(name, vals, global_step=metric_point(name, 0.0, step)[2])

    def flush(self) -> None:
        """Write the pending events to the file."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def tensorboard_events(
    directory: str | os.PathLike[str], kind: str = "scalars"
) -> list[tuple[Path, dict[str, list[Any]]]]:
    """Every folder under ``directory`` holding TensorBoard event files, with its events of
    ``kind`` (``"scalars"`` or ``"histograms"``) by tag, through TensorBoard's own
    ``EventAccumulator``: the one walker of event files (readers, the plot).

    Each folder is read on its own (its event files only): an accumulator over a parent folder
    would read a nested run's events again.

    Example:
        >>> import tempfile
        >>> tensorboard_events(tempfile.mkdtemp())
        []
    """
    folders = sorted({p.parent for p in Path(directory).rglob("events.out.tfevents.*")})
    if not folders:
        return []
    with optional_deps():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for folder in folders:
        acc = EventAccumulator(str(folder), size_guidance={kind: 0})
        acc.Reload()
        read = acc.Scalars if kind == "scalars" else acc.Histograms
        out.append((folder, {tag: list(read(tag)) for tag in acc.Tags()[kind]}))
    return out


def read_tensorboard(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``directory`` (values as TensorBoard stores
    them, float32): ``{name: [(step, value), ...]}``, folder by folder in the order each
    folder's accumulator gives them (not re-sorted: a reader must show what was written).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = TensorboardSink(d); sink.log_scalar("loss/total", 0.5, step=1); sink.close()
        >>> read_tensorboard(d)
        {'loss/total': [(1, 0.5)]}
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for _folder, tags in tensorboard_events(directory, "scalars"):
        for tag, events in tags.items():
            out.setdefault(tag, []).extend((int(e.step), float(e.value)) for e in events)
    return out


def read_tensorboard_histograms(
    directory: str | os.PathLike[str],
) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Every histogram in the event files under ``directory``, through TensorBoard's own
    ``EventAccumulator``: ``{name: [(step, {"count", "min", "max", "sum"}), ...]}``.

    Example:
        >>> import tempfile
        >>> read_tensorboard_histograms(tempfile.mkdtemp())
        {}
    """
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for _folder, tags in tensorboard_events(directory, "histograms"):
        for tag, events in tags.items():
            for e in events:
                h = e.histogram_value
                summary = {
                    "count": int(h.num),
                    "min": float(h.min),
                    "max": float(h.max),
                    "sum": float(h.sum),
                }
                out.setdefault(tag, []).append((int(e.step), summary))
    for vals in out.values():
        vals.sort(key=lambda sv: sv[0])
    return out


WANDB_STEP = "posttrain:step"
"""The history column holding each row's step (a ':' keeps it apart from catalogue names)."""

_WANDB_QUIET = {
    # No system-monitor threads, console capture, git or code snapshots: a sink only logs scalars.
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_disable_machine_info": True,
    "console": "off",
    "disable_git": True,
    "save_code": False,
    "silent": True,
}


def quiet_wandb_settings(**overrides: Any) -> Any:
    """``wandb.Settings`` for a scalar-only run: no system metrics, console capture or git.

    Example:
        >>> quiet_wandb_settings().console  # doctest: +SKIP
        'off'
    """
    return _wandb().Settings(**{**_WANDB_QUIET, **overrides})


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("WandbSink needs wandb: pip install 'posttrain[observability]'") from e
    return wandb


class WandbSink:
    """``MetricSinkV1`` writing a W&B run in offline mode under ``directory`` (no server, no login).

    Steps are kept per value, in any order: each history row carries its step in the column
    ``posttrain:step`` (declared as the run's x-axis), because W&B's own ``step=`` argument drops
    a row whose step is lower than one already logged. Values logged for one step are gathered
    into one row, written when the step changes, a name repeats or the sink closes. ``close``
    finishes the run; ``wandb sync DIR/wandb/offline-run-*`` uploads it later. Needs
    ``pip install 'posttrain[observability]'``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = WandbSink(d)  # doctest: +SKIP
        >>> sink.log_scalar("policy/kl_ref/k3", 0.25, step=3); sink.close()  # doctest: +SKIP
        >>> read_wandb(d)  # doctest: +SKIP
        {'policy/kl_ref/k3': [(3, 0.25)]}
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        project: str = "posttrain",
        run_name: str = "run",
        **init_kwargs: Any,
    ) -> None:
        fixed = sorted({"mode", "dir", "reinit", "project", "name"} & set(init_kwargs))
        if fixed:
            raise TypeError(
                f"WandbSink: {', '.join(fixed)} cannot be passed to wandb.init here: the sink "
                "writes offline under `directory` (name the run with run_name=, project=)"
            )
        wandb = _wandb()
        given = init_kwargs.pop("settings", None) or {}
        if not isinstance(given, dict):  # a wandb.Settings: keep only what its caller set
            given = {k: getattr(given, k) for k in given.model_fields_set}
        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = quiet_wandb_settings(**given)
        self.run: Any = wandb.init(
            mode="offline",
            dir=str(directory),
            project=project,
            name=run_name,
            reinit="create_new",  # several sinks (runs) may live in one process
            settings=settings,
            **init_kwargs,
        )
        self.run.define_metric("*", step_metric=WANDB_STEP)
        self._row: dict[str, Any] = {}
        self._closed = False
        self._steps = NextStep()

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """One value at ``step`` (None: one past ``name``'s highest step so far)."""
        if self._closed:
            raise RuntimeError(
                f"WandbSink: log_scalar({name!r}) after close(): the run is finished"
            )
        if isinstance(name, str) and (name == WANDB_STEP or name.startswith("_")):
            raise ValueError(
                f"metric name {name!r}: W&B reserves names starting with '_' and "
                f"{WANDB_STEP!r} holds the step; expected a catalogue name such as 'loss/total'"
            )
        # After the name check: a refused call must not advance the name's next step.
        _, v, s = metric_point(name, value, step, steps=self._steps)
        self._put(name, v, s)

    def _put(self, name: str, value: Any, step: int) -> None:
        if self._row and (self._row[WANDB_STEP] != step or name in self._row):
            self._commit()
        self._row[name] = value
        self._row[WANDB_STEP] = step

    def _open(self, what: str, name: str) -> None:
        if self._closed:
            raise RuntimeError(f"WandbSink: {what}({name!r}) after close(): the run is finished")

    def log_histogram(self, name: str, values: Any, step: int, *, bins: int = 64) -> None:
        """A ``wandb.Histogram`` of ``values`` (finite numbers) at ``step``, ``bins`` bins.

        The bin edges span exactly [min, max] (a sample of one value v is one bin [v, v],
        where ``wandb.Histogram(values)`` would make it [v - 0.5, v + 0.5]), so the reader
        gets count, min and max back from the stored bins.
        """
        import numpy as np

        self._open("log_histogram", name)
        vals = np.asarray(histogram_values(name, values), dtype=np.float64)
        s = metric_point(name, 0.0, step)[2]
        lo, hi = float(vals.min()), float(vals.max())
        if lo == hi:
            counts, edges = np.array([vals.size]), np.array([lo, hi])
        else:
            counts, edges = np.histogram(vals, bins=bins, range=(lo, hi))
        hist = _wandb().Histogram(np_histogram=(counts.tolist(), edges.tolist()))
        self._put(name, hist, s)

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        """A ``wandb.Table`` of ``(prompt, completion, reward)`` rows at ``step``."""
        self._open("log_samples", name)
        data = [list(r) for r in sample_rows(name, rows)]
        s = metric_point(name, 0.0, step)[2]
        self._put(name, _wandb().Table(columns=list(SAMPLE_COLUMNS), data=data), s)

    def _commit(self) -> None:
        if self._row:
            row, self._row = self._row, {}
            self.run.log(row)

    def close(self) -> None:
        """Write the pending row and finish the run; idempotent."""
        if not self._closed:
            self._closed = True
            self._commit()
            self.run.finish()


def _history(path: Path) -> list[dict[str, Any]]:
    # W&B's own reader of the transaction log (wandb >= 0.31): one JSON record per line.
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    # Offline, so the reader sends no telemetry to a W&B server (it would otherwise try).
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"reading {path}: `wandb leet inspect` ran over 120 s") from None
    if out.returncode != 0:
        raise RuntimeError(
            f"reading {path}: `wandb leet inspect --json` failed ({out.returncode}; it needs "
            f"wandb >= 0.31): {out.stderr.strip()[-500:]}"
        )
    rows = []
    for n, line in enumerate(out.stdout.splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise RuntimeError(
                f"reading {path}: line {n} of the reader is not JSON: {line[:200]!r}"
            ) from None
        if rec.get("type") == "history":
            rows.append(rec["history"]["item"])
    return rows


def read_wandb(
    directory: str | os.PathLike[str], *, step_key: Callable[[str], str] | None = None
) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every offline W&B run under ``directory``, through W&B's own reader.

    ``step_key(name)`` names the history column holding ``name``'s step (``posttrain:step`` for
    ``WandbSink``); step columns themselves are not metrics. A run with metrics but none at a
    step column of this convention (another logger's run) raises rather than reading as empty.

    Example:
        >>> import tempfile
        >>> read_wandb(tempfile.mkdtemp())
        {}
    """
    key_of = step_key or (lambda _name: WANDB_STEP)
    out: dict[str, list[tuple[int, float]]] = {}
    files = {p.resolve() for p in Path(directory).glob("**/run-*.wandb")}
    for path in sorted(files):
        seen, placed = 0, 0
        for item in _history(path):
            # Media (histograms, tables) flatten to "<name>.<field>": no catalogue name has a '.'.
            names = [k for k in item if not k.startswith("_") and "." not in k]
            steps = {key_of(k) for k in names}
            for k in names:
                if k in steps or k == key_of(k):
                    continue
                seen += 1
                s = item.get(key_of(k))
                if not isinstance(s, int | float) or not math.isfinite(s):
                    continue  # a row without this name's step: nothing to place it at
                placed += 1
                # float() also reads the reader's "NaN", "Infinity" and "-Infinity".
                out.setdefault(k, []).append((int(s), float(item[k])))
        if seen and not placed:
            raise ValueError(
                f"{path}: {seen} metric values but none at its step column (expected e.g. "
                f"{key_of('x')!r}): a run written with another step convention"
            )
    for vals in out.values():
        vals.sort(key=lambda sv: sv[0])
    return out


def _wandb_media(
    directory: str | os.PathLike[str], kind: str
) -> list[tuple[Path, str, int, dict[str, Any]]]:
    # (run directory, name, step, {field: value}) of every media value of ``kind`` under
    # ``directory``, at WandbSink's step column.
    out = []
    files = {p.resolve() for p in Path(directory).glob("**/run-*.wandb")}
    for path in sorted(files):
        for item in _history(path):
            step = item.get(WANDB_STEP)
            for key, value in item.items():
                name, dot, field = key.partition(".")
                if dot and field == "_type" and value == kind and isinstance(step, int | float):
                    fields = {
                        f.partition(".")[2]: v for f, v in item.items() if f.startswith(name + ".")
                    }
                    out.append((path.parent, name, int(step), fields))
    return out


def read_wandb_histograms(
    directory: str | os.PathLike[str],
) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Every ``wandb.Histogram`` a ``WandbSink`` logged under ``directory``, through W&B's own
    reader: ``{name: [(step, {"count", "min", "max", "bins", "counts"}), ...]}``.

    Example:
        >>> import tempfile
        >>> read_wandb_histograms(tempfile.mkdtemp())
        {}
    """
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for _run, name, step, f in _wandb_media(directory, "histogram"):
        edges, counts = [float(x) for x in f["bins"]], [int(x) for x in f["values"]]
        summary = {
            "count": sum(counts),
            "min": edges[0],
            "max": edges[-1],
            "bins": edges,
            "counts": counts,
        }
        out.setdefault(name, []).append((step, summary))
    for vals in out.values():
        vals.sort(key=lambda sv: sv[0])
    return out


def read_wandb_samples(
    directory: str | os.PathLike[str],
) -> dict[str, list[tuple[int, list[tuple[str, str, float]]]]]:
    """Every sample table a ``WandbSink`` logged under ``directory``: the history row names
    the table's file (``files/media/table/*.table.json``), read as W&B wrote it.

    Example:
        >>> import tempfile
        >>> read_wandb_samples(tempfile.mkdtemp())
        {}
    """
    out: dict[str, list[tuple[int, list[tuple[str, str, float]]]]] = {}
    for run, name, step, f in _wandb_media(directory, "table-file"):
        # The path comes from the run's own history: never follow it out of files/.
        root = (run / "files").resolve()
        path = (root / str(f["path"])).resolve()
        if not path.is_relative_to(root):
            raise ValueError(
                f"read {name!r} at step {step} of the W&B run {run}: expected a table file "
                f"under {root}, found the path {str(f['path'])!r} outside it"
            )
        table = json.loads(path.read_text(encoding="utf-8"))
        cols = [table["columns"].index(c) for c in SAMPLE_COLUMNS]
        rows = [(str(r[cols[0]]), str(r[cols[1]]), float(r[cols[2]])) for r in table["data"]]
        out.setdefault(name, []).append((step, rows))
    for vals in out.values():
        vals.sort(key=lambda sv: sv[0])
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

    def _each(self, method: str, name: str, payload: Any, step: int) -> None:
        fns = [getattr(s, method) for s in self.sinks if callable(getattr(s, method, None))]
        if not fns:
            kinds = ", ".join(type(s).__name__ for s in self.sinks)
            raise TypeError(f"Tee: none of its sinks ({kinds}) has {method}({name!r}, ...)")
        for fn in fns:
            fn(name, payload, step=step)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """Log a distribution to every sink that has ``log_histogram`` (MLflow's has none)."""
        self._each("log_histogram", name, values, step)

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        """Log a sample table to every sink that has ``log_samples``."""
        self._each("log_samples", name, rows, step)

    def close(self) -> None:
        """Close (or flush) every sink that can be."""
        for s in self.sinks:
            fn = getattr(s, "close", None) or getattr(s, "flush", None)
            if callable(fn):
                fn()
