"""The reference metrics sink: one JSON object per line, read back with :func:`read_jsonl`."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO

from posttrain.contracts.metrics import METRIC_NAME, NextStep, metric_point

FILE_NAME = "metrics.jsonl"


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
