"""Deliberately broken metric sinks: each must fail the suite with its requirement's id."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from posttrain.contracts import Implementation
from posttrain.reference_impls import JsonlSink, read_jsonl
from posttrain.reference_impls.jsonl_sink import FILE_NAME

__all__ = ["EXTRA_MUTANTS", "MUTANTS"]


class RoundsValues(JsonlSink):
    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name, round(value, 2), step)


class FlattensNames(JsonlSink):
    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name.replace("/", "_"), value, step)


class LastValueOnly(JsonlSink):
    """Keeps one value per name: a later step overwrites an earlier one."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.close()
        rows = (
            [json.loads(x) for x in self.path.read_text().splitlines()]
            if self.path.exists()
            else []
        )
        rows = [r for r in rows if r["name"] != name] + [
            {"name": name, "step": int(step or 0), "value": value}
        ]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class DropsNonFinite(JsonlSink):
    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        if math.isfinite(value):
            super().log_scalar(name, value, step)


class BuffersUntilClose(JsonlSink):
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._lines: list[tuple[str, float, int | None]] = []

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self._lines.append((name, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for line in self._lines:
            super().log_scalar(*line)
        self._lines = []
        super().close()


class FilePerProcess(JsonlSink):
    """Each process writes its own file..."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self.path = Path(directory) / f"metrics-{os.getpid()}.jsonl"


def read_newest_file(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """...and the reader reads only the newest one: the last writer wins."""
    files = sorted(Path(directory).glob("metrics-*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    if not files:
        return read_jsonl(directory)
    tmp = Path(directory) / "newest"
    tmp.mkdir(exist_ok=True)
    (tmp / FILE_NAME).write_text(files[-1].read_text())
    return read_jsonl(tmp)


class NoStepAtZero(JsonlSink):
    """A value without a step goes to step 0 (MLflow's and TensorBoard's default), silently."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name, value, 0 if step is None else step)


class NoStepCrashes(JsonlSink):
    """``int(step)`` on the way in: ``step=None``, allowed by the Protocol, raises TypeError."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name, value, int(step))  # type: ignore[arg-type]


class NoStepCountsValues(JsonlSink):
    """A value without a step goes to the count of the name's values (TorchRL's CSVLogger):
    after step 5 it lands at step 1, back in time."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._counts: dict[str, int] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        n = self._counts.get(name, 0)
        self._counts[name] = n + 1
        super().log_scalar(name, value, n if step is None else step)


def _impl(req: str, cls: type[JsonlSink], reader: Any = read_jsonl, **kw: Any) -> Implementation:
    kw.setdefault("capabilities", {"flush"})
    name = f"mutant-{req}-{cls.__name__}"
    return Implementation("metrics", cls, name=name, extras={"reader": reader}, **kw)


MUTANTS: dict[str, Implementation] = {
    "MET-001": _impl("MET-001", RoundsValues),
    "MET-002": _impl("MET-002", FlattensNames),
    "MET-003": _impl("MET-003", LastValueOnly),
    "MET-004": _impl("MET-004", DropsNonFinite),
    "MET-005": _impl("MET-005", BuffersUntilClose),
    "MET-006": _impl("MET-006", FilePerProcess, read_newest_file, capabilities={"cross_process"}),
    "MET-007": _impl("MET-007", NoStepAtZero),
}
"""Requirement id -> a sink that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("MET-007", _impl("MET-007", NoStepCrashes)),
    ("MET-007", _impl("MET-007", NoStepCountsValues)),
]
"""Further bugs one requirement must catch beyond its main mutant: (requirement id, mutant)."""
