"""Deliberately broken metric sinks: each must fail the suite with its requirement's id."""

from __future__ import annotations

import json
import math
import os
import struct
import unicodedata
from pathlib import Path
from typing import Any

from posttrain.contracts import Implementation
from posttrain.reference_impls import JsonlSink, read_jsonl
from posttrain.reference_impls.jsonl_sink import (
    FILE_NAME,
    HISTOGRAMS,
    SAMPLES,
    read_jsonl_histograms,
    read_jsonl_samples,
)

__all__ = ["EXTRA_MUTANTS", "MUTANTS"]


class RoundsValues(JsonlSink):
    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name, round(value, 2), step)


class FlattensNames(JsonlSink):
    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name.replace("/", "_"), value, step)


class LastValueOnly(JsonlSink):
    """Keeps one step per name: a value at another step overwrites the earlier ones (values
    at the same step are kept, so MET-001 alone does not see it)."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.close()
        rows = (
            [json.loads(x) for x in self.path.read_text().splitlines()]
            if self.path.exists()
            else []
        )
        rows = [r for r in rows if r["name"] != name or r["step"] == int(step or 0)] + [
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


class KeepsLastPerStep(JsonlSink):
    """One value per (name, step): a second value at a step already logged replaces the first
    (a table keyed by name and step, ``INSERT OR REPLACE``)."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.close()
        rows = (
            [json.loads(x) for x in self.path.read_text().splitlines()]
            if self.path.exists()
            else []
        )
        rows = [r for r in rows if (r["name"], r["step"]) != (name, step)]
        rows.append({"name": name, "step": int(step or 0), "value": value})
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class MergesRepeatedStep(JsonlSink):
    """W&B's own ``step=``: calls at the step of the previous call fill one history row, so a
    name logged twice in a row at one step keeps its last value only."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._row: dict[str, float] = {}
        self._row_step: int | None = None

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        if step != self._row_step:
            self._commit()
        self._row[name] = value
        self._row_step = step

    def _commit(self) -> None:
        for name, value in self._row.items():
            super().log_scalar(name, value, self._row_step)
        self._row = {}

    def flush(self) -> None:
        self._commit()
        super().flush()

    def close(self) -> None:
        self._commit()
        super().close()


class TruncatesLongNames(JsonlSink):
    """Names cut to 200 characters (a backend's shorter key column), a trailing '/' dropped so
    the cut name is still a catalogue name and is stored."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name[:200].rstrip("/"), value, step)


class FileNamedAfterMetric(JsonlSink):
    """A file per metric named after the whole name, '/' escaped: a name whose file name passes
    255 bytes raises ``OSError: File name too long``."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        (self.path.parent / (name.replace("/", "%2F") + ".touch")).touch()
        super().log_scalar(name, value, step)


class DropsLowerSteps(JsonlSink):
    """W&B's rule for its own step: a value at a step lower than the name's last is dropped."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._last: dict[str, int] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        s = int(step or 0)
        if s >= self._last.get(name, s):
            self._last[name] = s
            super().log_scalar(name, value, step)


class FlushesLastNameOnly(BuffersUntilClose):
    """A buffer per name; ``flush()`` writes out only the buffer of the name logged last."""

    def flush(self) -> None:
        if self._lines:
            last = self._lines[-1][0]
            for line in [x for x in self._lines if x[0] == last]:
                JsonlSink.log_scalar(self, *line)
            self._lines = [x for x in self._lines if x[0] != last]
            JsonlSink.flush(self)


class BinsWithAutodetectedRange(JsonlSink):
    """Keeps a distribution as 64 bins over NumPy's autodetected range, as
    ``wandb.Histogram(values)`` does: a sample of one value v reads back as [v - 0.5, v + 0.5]."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        import numpy as np

        counts, edges = np.histogram(np.asarray(values, dtype=np.float64), bins=64)
        rec = {"name": name, "step": step, "counts": counts.tolist(), "edges": edges.tolist()}
        self._append(HISTOGRAMS, rec)


def read_binned(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Count, min and max from the stored bins."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    path = Path(directory) / HISTOGRAMS
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        summary = {"count": sum(r["counts"]), "min": r["edges"][0], "max": r["edges"][-1]}
        out.setdefault(r["name"], []).append((r["step"], summary))
    return out


class HistogramDropsNonFinite(JsonlSink):
    """Leaves NaN and infinities out of a distribution without a word: the count shrinks."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        super().log_histogram(name, [v for v in values if math.isfinite(v)], step)


class HistogramLatestOnly(JsonlSink):
    """One distribution per name (a run summary): a later call replaces the earlier steps'."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        path = self.path.parent / HISTOGRAMS
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["name"] != name))
        super().log_histogram(name, values, step)


class TruncatesCompletions(JsonlSink):
    """Texts cut to 1,000 characters (a table cell limit)."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        super().log_samples(name, [(p[:1000], c[:1000], r) for p, c, r in rows], step)


class StripsTexts(JsonlSink):
    """Texts stripped of leading and trailing whitespace (a tidy-up that changes them)."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        super().log_samples(name, [(p.strip(), c.strip(), r) for p, c, r in rows], step)


class TableLatestOnly(JsonlSink):
    """One table per name (W&B's ``latest`` alias read as the table): earlier steps' go."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        path = self.path.parent / SAMPLES
        old = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        path.write_text("".join(json.dumps(r) + "\n" for r in old if r["name"] != name))
        super().log_samples(name, rows, step)


class RawUnicodeLines(JsonlSink):
    """Writes tables with ``ensure_ascii=False`` ...: U+2028 lands in the file unescaped."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        rec = {"name": name, "step": step, "rows": [list(r) for r in rows]}
        with (self.path.parent / SAMPLES).open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def read_samples_splitlines(
    directory: str | os.PathLike[str],
) -> dict[str, list[tuple[int, list[tuple[str, str, float]]]]]:
    """... and reads them back with ``str.splitlines``, which also cuts at U+2028."""
    out: dict[str, list[tuple[int, list[tuple[str, str, float]]]]] = {}
    path = Path(directory) / SAMPLES
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a cut line: its table is lost
        rows = [(p, c, float(x)) for p, c, x in r["rows"]]
        out.setdefault(r["name"], []).append((r["step"], rows))
    return out


class DropsNanRewardRows(JsonlSink):
    """Rows whose reward is NaN (a failed reward call) are left out of the table."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        super().log_samples(name, [r for r in rows if not math.isnan(float(r[2]))], step)


class HistogramPerStep(JsonlSink):
    """One distribution per (name, step): a second call at a step already logged replaces the
    first (a table keyed by name and step)."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        path = self.path.parent / HISTOGRAMS
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        keep = [r for r in rows if (r["name"], r["step"]) != (name, step)]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        super().log_histogram(name, values, step)


class TablePerStep(JsonlSink):
    """One table per (name, step): a second ``log_samples`` at a logged step replaces the first."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        path = self.path.parent / SAMPLES
        old = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        keep = [r for r in old if (r["name"], r["step"]) != (name, step)]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        super().log_samples(name, rows, step)


def _samples_rewards_as(
    convert: Any,
) -> Any:
    def read(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, list[Any]]]]:
        return {
            name: [(step, [(p, c, convert(r)) for p, c, r in rows]) for step, rows in tables]
            for name, tables in read_jsonl_samples(directory).items()
        }

    return read


read_samples_nan_as_none = _samples_rewards_as(lambda r: None if math.isnan(r) else r)
"""A reader that turns a NaN reward into None (strict JSON's null)."""
read_samples_reward_text = _samples_rewards_as(repr)
"""A reader that hands each reward back as its text ('1.0', 'nan')."""


class NoStepAfterLastStep(JsonlSink):
    """A value without a step goes one past the name's *last* step, not its highest: after
    steps 5 and 2 it lands at 3, beside a point already there."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._last: dict[str, int] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        s = self._last.get(name, -1) + 1 if step is None else int(step)
        self._last[name] = s
        super().log_scalar(name, value, s)


class HistogramCountsRows(JsonlSink):
    """A distribution's count is ``len(values)``, min and max over every value: a [B, T]
    tensor counts as B values (the ``len(tensor)`` vs ``numel()`` slip)."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        flat = values.reshape(-1).tolist() if hasattr(values, "reshape") else list(values)
        vals = sorted(float(v) for v in flat)
        rows = len(values)
        # Stored so that the reader's count is the row count, min and max still right.
        kept = [vals[0], vals[-1], *vals[1 : rows - 1]] if rows > 1 else vals[:1]
        super().log_histogram(name, kept, step)


class NormalisesTextsNfc(JsonlSink):
    """Sample texts normalised to Unicode NFC before they are stored (a "clean the text"
    step): a decomposed e + U+0301 reads back composed."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        nfc = [
            (unicodedata.normalize("NFC", p), unicodedata.normalize("NFC", c), r)
            for p, c, r in rows
        ]
        super().log_samples(name, nfc, step)


class DropsPastBatch(JsonlSink):
    """Loses the point that fills each batch of 256 (an off-by-one where a writer hands a full
    batch to its backend): a run of fewer than 256 points reads back whole."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._n = 0

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self._n += 1
        if self._n % 256:
            super().log_scalar(name, value, step)


_F32_TINY = 1.1754943508222875e-38  # float32's smallest normal


class FlushesSubnormals(JsonlSink):
    """Stores a value below float32's smallest normal as 0.0 (a float32 path with flush-to-zero
    on, as GPUs and ``-ffast-math`` builds run): float32 keeps 1e-40, this sink loses it."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        v = float(value)
        super().log_scalar(name, math.copysign(0.0, v) if abs(v) < _F32_TINY else v, step)


class Float32UnderFloat64(JsonlSink):
    """Declares float64 storage (``extras['precision']``) but keeps each value's float32
    rounding, as a float32 column would: 1/3 reads back as 0.3333333432674408."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        v = float(value)
        f32 = struct.unpack("f", struct.pack("f", v))[0] if abs(v) < 3.4e38 else v
        super().log_scalar(name, f32, step)


class WrapsStepTo32Bits(JsonlSink):
    """Keeps a step in an unsigned 32-bit column: 2**32 reads back as 0, 2**63 - 1 as
    2**32 - 1."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name, value, None if step is None else step % 2**32)


class StepsAsFloat64(JsonlSink):
    """Steps held as float64 (a JSON reader that parses every number as a double): a step past
    2**53 reads back rounded, 2**53 + 1 as 2**53."""

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        super().log_scalar(name, value, None if step is None else int(float(step)))


class NoStepCounterInFloat64(JsonlSink):
    """Keeps each name's next step in a float64: past 2**53 the next step after 2**53 is 2**53
    again."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self._last: dict[str, float] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        last = self._last.get(name, -1.0)
        s = int(last + 1.0) if step is None else step
        self._last[name] = max(last, float(s))
        super().log_scalar(name, value, s)


class UnknownPrecision(JsonlSink):
    """Declared with ``extras['precision'] = "bfloat16"``, a storage precision the spec does not
    name (float32 or float64): the suite cannot know what to compare."""


def _impl(
    req: str,
    cls: type[JsonlSink],
    reader: Any = read_jsonl,
    *,
    histogram_reader: Any = read_jsonl_histograms,
    samples_reader: Any = read_jsonl_samples,
    **kw: Any,
) -> Implementation:
    kw.setdefault("capabilities", {"flush"})
    name = kw.pop("name", f"mutant-{req}-{cls.__name__}")
    extras = {
        "reader": reader,
        "histogram_reader": histogram_reader,
        "samples_reader": samples_reader,
        **kw.pop("extras", {}),
    }
    return Implementation("metrics", cls, name=name, extras=extras, **kw)


MUTANTS: dict[str, Implementation] = {
    "MET-001": _impl("MET-001", RoundsValues),
    "MET-002": _impl("MET-002", FlattensNames),
    "MET-003": _impl("MET-003", LastValueOnly),
    "MET-004": _impl("MET-004", DropsNonFinite),
    "MET-005": _impl("MET-005", BuffersUntilClose),
    "MET-006": _impl("MET-006", FilePerProcess, read_newest_file, capabilities={"cross_process"}),
    "MET-007": _impl("MET-007", NoStepAtZero),
    "MET-008": _impl(
        "MET-008",
        BinsWithAutodetectedRange,
        histogram_reader=read_binned,
        capabilities={"histogram"},
    ),
    "MET-009": _impl("MET-009", TruncatesCompletions, capabilities={"samples"}),
}
"""Requirement id -> a sink that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("MET-003", _impl("MET-003", DropsPastBatch)),
    ("MET-007", _impl("MET-007", NoStepAfterLastStep)),
    ("MET-008", _impl("MET-008", HistogramCountsRows, capabilities={"histogram"})),
    ("MET-009", _impl("MET-009", NormalisesTextsNfc, capabilities={"samples"})),
    ("MET-001", _impl("MET-001", KeepsLastPerStep)),
    ("MET-001", _impl("MET-001", MergesRepeatedStep)),
    ("MET-002", _impl("MET-002", TruncatesLongNames)),
    ("MET-002", _impl("MET-002", FileNamedAfterMetric)),
    ("MET-003", _impl("MET-003", DropsLowerSteps)),
    ("MET-005", _impl("MET-005", FlushesLastNameOnly)),
    ("MET-007", _impl("MET-007", NoStepCrashes)),
    ("MET-007", _impl("MET-007", NoStepCountsValues)),
    ("MET-008", _impl("MET-008", HistogramDropsNonFinite, capabilities={"histogram"})),
    ("MET-008", _impl("MET-008", HistogramLatestOnly, capabilities={"histogram"})),
    ("MET-009", _impl("MET-009", StripsTexts, capabilities={"samples"})),
    ("MET-009", _impl("MET-009", TableLatestOnly, capabilities={"samples"})),
    (
        "MET-009",
        _impl(
            "MET-009",
            RawUnicodeLines,
            samples_reader=read_samples_splitlines,
            capabilities={"samples"},
        ),
    ),
    ("MET-009", _impl("MET-009", DropsNanRewardRows, capabilities={"samples"})),
    ("MET-001", _impl("MET-001", FlushesSubnormals)),
    ("MET-001", _impl("MET-001", Float32UnderFloat64, extras={"precision": "float64"})),
    ("MET-003", _impl("MET-003", WrapsStepTo32Bits)),
    ("MET-003", _impl("MET-003", StepsAsFloat64)),
    ("MET-007", _impl("MET-007", NoStepCounterInFloat64)),
    ("MET-001", _impl("MET-001", UnknownPrecision, extras={"precision": "bfloat16"})),
    ("MET-008", _impl("MET-008", HistogramPerStep, capabilities={"histogram"})),
    ("MET-009", _impl("MET-009", TablePerStep, capabilities={"samples"})),
    (
        "MET-009",
        _impl(
            "MET-009",
            JsonlSink,
            samples_reader=read_samples_nan_as_none,
            capabilities={"samples"},
            name="mutant-MET-009-NanRewardReadAsNone",
        ),
    ),
    (
        "MET-009",
        _impl(
            "MET-009",
            JsonlSink,
            samples_reader=read_samples_reward_text,
            capabilities={"samples"},
            name="mutant-MET-009-RewardReadAsText",
        ),
    ),
]
"""Further bugs one requirement must catch beyond its main mutant: (requirement id, mutant)."""
