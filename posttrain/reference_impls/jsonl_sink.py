"""The reference metrics sink: one JSON object per line, read back with :func:`read_jsonl`;
distributions and completion samples in files of their own (:func:`read_jsonl_histograms`,
:func:`read_jsonl_samples`)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

from posttrain.contracts.metrics import (
    METRIC_NAME,
    NextStep,
    histogram_values,
    metric_point,
    sample_rows,
)

FILE_NAME = "metrics.jsonl"
HISTOGRAMS = "histograms.jsonl"
"""``{"name", "step", "values"}`` lines: each distribution's values, exactly."""
SAMPLES = "samples.jsonl"
"""``{"name", "step", "rows"}`` lines: each table's ``[prompt, completion, reward]`` rows."""


class JsonlSink:
    """Appends ``{"name", "step", "value"}`` lines to ``<directory>/metrics.jsonl``.

    Conforms to ``MetricSinkV1`` (TorchRL's ``log_scalar`` signature). Names must match the
    catalogue pattern; NaN and infinities are kept (as JSON's ``NaN``/``Infinity`` tokens).
    Opening in append mode lets several processes log into one run.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = JsonlSink(d)
        >>> sink.log_scalar("rollout/reward/mean", 0.5, step=3)
        >>> sink.log_scalar("rollout/reward/mean", 0.25)  # no step: the next one
        >>> sink.close()
        >>> read_jsonl(d)
        {'rollout/reward/mean': [(3, 0.5), (4, 0.25)]}
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._steps = NextStep()

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Record ``value`` for ``name`` at ``step`` (None: one past ``name``'s highest step)."""
        if not isinstance(name, str) or not METRIC_NAME.match(name):
            raise ValueError(f"name: expected a match of {METRIC_NAME.pattern}, found {name!r}")
        _, v, s = metric_point(name, value, step, steps=self._steps)
        line = json.dumps({"name": name, "step": s, "value": v}) + "\n"
        with self._lock:
            if self._file is None:
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """Record the distribution of ``values`` (finite numbers) for ``name`` at ``step``.

        Example:
            >>> import tempfile
            >>> d = tempfile.mkdtemp()
            >>> sink = JsonlSink(d); sink.log_histogram("rollout/response_len", [3, 5, 5], step=2)
            >>> sink.close(); read_jsonl_histograms(d)
            {'rollout/response_len': [(2, {'count': 3, 'min': 3.0, 'max': 5.0, 'values': [3.0, 5.0, 5.0]})]}
        """
        vals = histogram_values(name, values)
        self._append(HISTOGRAMS, {"name": name, "step": _step(name, step), "values": vals})

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        """Record ``rows`` of ``(prompt, completion, reward)`` as ``name``'s table at ``step``.

        Example:
            >>> import tempfile
            >>> d = tempfile.mkdtemp()
            >>> sink = JsonlSink(d); sink.log_samples("samples", [("2+2=", " 4", 1.0)], step=2)
            >>> sink.close(); read_jsonl_samples(d)
            {'samples': [(2, [('2+2=', ' 4', 1.0)])]}
        """
        checked = [list(r) for r in sample_rows(name, rows)]
        self._append(SAMPLES, {"name": name, "step": _step(name, step), "rows": checked})

    def _append(self, file_name: str, record: dict[str, Any]) -> None:
        # Opened per call: tables and histograms come once a step, scalars many times. ASCII
        # escapes keep U+2028 and the like out of the file, where str.splitlines would cut.
        line = json.dumps(record) + "\n"
        with self._lock, (self.path.parent / file_name).open("a", encoding="utf-8") as f:
            f.write(line)

    def flush(self) -> None:
        """Make everything logged so far readable."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Flush and close the file; logging again reopens it."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_jsonl(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) logged under ``directory``, by name, in logging order.

    Example:
        >>> read_jsonl("/nonexistent")
        {}
    """
    path = Path(directory) / FILE_NAME
    out: dict[str, list[tuple[int, float]]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(rec["name"], []).append((int(rec["step"]), float(rec["value"])))
    return out


def _step(name: str, step: Any) -> int:
    return metric_point(name, 0.0, step)[2]


def _records(directory: str | os.PathLike[str], file_name: str) -> list[dict[str, Any]]:
    path = Path(directory) / file_name
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    return [json.loads(line) for line in lines if line.strip()]


def read_jsonl_histograms(
    directory: str | os.PathLike[str],
) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Every distribution logged under ``directory``: ``{name: [(step, summary), ...]}``,
    the summary with ``count``, ``min``, ``max`` and the ``values`` themselves.

    Example:
        >>> read_jsonl_histograms("/nonexistent")
        {}
    """
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rec in _records(directory, HISTOGRAMS):
        vals = [float(v) for v in rec["values"]]
        summary = {"count": len(vals), "min": min(vals), "max": max(vals), "values": vals}
        out.setdefault(rec["name"], []).append((int(rec["step"]), summary))
    return out


def read_jsonl_samples(
    directory: str | os.PathLike[str],
) -> dict[str, list[tuple[int, list[tuple[str, str, float]]]]]:
    """Every sample table logged under ``directory``: ``{name: [(step, rows), ...]}``.

    Example:
        >>> read_jsonl_samples("/nonexistent")
        {}
    """
    out: dict[str, list[tuple[int, list[tuple[str, str, float]]]]] = {}
    for rec in _records(directory, SAMPLES):
        rows = [(str(p), str(c), float(r)) for p, c, r in rec["rows"]]
        out.setdefault(rec["name"], []).append((int(rec["step"]), rows))
    return out
