"""Metric sinks with the metrics v1.3 capabilities ``histogram`` and ``samples``, written from
``specs/metrics-v1.md`` alone, each with its readers, and one-bug variants.

- ``SqliteRawSink`` stores every scalar, every histogram's raw values and every sample row in
  one SQLite database (autocommit, so a point is readable once the call returns); values are
  kept as their ``repr`` text, because SQLite turns a bound NaN into NULL.
- ``BinnedFileSink`` appends scalars to a buffered text file (``flush()`` makes them
  readable), keeps a histogram as 8 bin counts plus its exact count, min and max (hex floats,
  exact), and writes each sample table as a JSON file of its own.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> s = BinnedFileSink(d)
    >>> s.log_histogram("rollout/reward", [0.5, 1.0, 1.0], step=2)
    >>> s.close()
    >>> read_binned_histograms(d)
    {'rollout/reward': [(2, {'count': 3, 'min': 0.5, 'max': 1.0})]}
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.contracts import Implementation

__all__ = ["BUGGY_SINKS", "CORRECT_SINKS", "BinnedFileSink", "SqliteRawSink"]

_NAME = re.compile(r"^[a-z0-9_]+(/[a-z0-9_]+)*$")
Points = dict[str, list[tuple[int, float]]]
Hists = dict[str, list[tuple[int, dict[str, float]]]]
Tables = dict[str, list[tuple[int, list[tuple[str, str, float]]]]]
NBINS = 8


def _number(name: str, value: Any) -> float:
    if isinstance(value, (str, bytes, bool, complex)):
        raise ValueError(f"metric {name!r}: expected a real number, found {value!r:.60}")
    return float(value)


def _step(name: str, step: Any) -> int:
    if isinstance(step, bool) or (not isinstance(step, int) and not hasattr(step, "__index__")):
        raise ValueError(f"metric {name!r}: step expected an int >= 0, found {step!r}")
    s = int(step)
    if s < 0:
        raise ValueError(f"metric {name!r}: step expected an int >= 0, found {step!r}")
    return s


class _Steps:
    """step=None is one past the highest step logged for the name (0 for its first value)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def __call__(self, name: str, step: Any) -> int:
        s = self.last.get(name, -1) + 1 if step is None else _step(name, step)
        self.last[name] = max(self.last.get(name, -1), s)
        return s


def _values(name: str, values: Any) -> list[float]:
    """A histogram's values: flattened, numbers, at least one, all finite (else ValueError)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"histogram name {name!r}: expected lowercase path segments")
    flat = values.reshape(-1).tolist() if hasattr(values, "reshape") else list(values)
    out = [_number(name, v) for v in flat]
    if not out:
        raise ValueError(f"histogram {name!r}: no values")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"histogram {name!r}: {len(bad)} non-finite value(s), e.g. {bad[0]!r}")
    return out


def _rows(name: str, rows: Any) -> list[tuple[str, str, float]]:
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, Mapping):
            row = (row["prompt"], row["completion"], row["reward"])
        if not isinstance(row, Sequence) or len(row) != 3:
            raise ValueError(f"samples {name!r}: row {i} is not (prompt, completion, reward)")
        p, c, r = row
        if not isinstance(p, str) or not isinstance(c, str):
            raise ValueError(f"samples {name!r}: row {i} texts must be str")
        out.append((p, c, _number(name, r)))
    return out


# --- design 1: SQLite, raw values ---

DB = "run.sqlite3"


class SqliteRawSink:
    """Scalars, raw histogram values and sample rows in one SQLite file."""

    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory) / DB
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.lock = threading.Lock()
        self.steps = _Steps()
        with self.lock:
            self.db.executescript(
                "CREATE TABLE IF NOT EXISTS scalars (name TEXT, step INTEGER, value TEXT);"
                "CREATE TABLE IF NOT EXISTS hists (name TEXT, step INTEGER, vals TEXT);"
                "CREATE TABLE IF NOT EXISTS samples (tid INTEGER, name TEXT, step INTEGER, "
                "idx INTEGER, prompt TEXT, completion TEXT, reward TEXT);"
            )

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        v = _number(name, value)
        with self.lock:
            s = self.steps(name, step)
            self.db.execute("INSERT INTO scalars VALUES (?, ?, ?)", (name, s, repr(v)))

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        vals = self.histogram_values(name, values)
        s = _step(name, step)
        with self.lock:
            self.db.execute(
                "INSERT INTO hists VALUES (?, ?, ?)", (name, s, json.dumps([repr(v) for v in vals]))
            )

    def histogram_values(self, name: str, values: Any) -> list[float]:
        return _values(name, values)

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        checked = self.sample_rows(name, rows)
        s = _step(name, step)
        with self.lock:
            (tid,) = self.db.execute("SELECT COALESCE(MAX(tid), -1) + 1 FROM samples").fetchone()
            self.db.executemany(
                "INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(tid, name, s, i, p, c, repr(r)) for i, (p, c, r) in enumerate(checked)],
            )

    def sample_rows(self, name: str, rows: Any) -> list[tuple[str, str, float]]:
        return _rows(name, rows)

    def close(self) -> None:
        with self.lock:
            self.db.close()


def _connect(directory: Path | str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{Path(directory) / DB}?mode=ro", uri=True)


def read_sqlite_scalars(directory: Path | str) -> Points:
    """``{name: [(step, value), ...]}`` in logging order."""
    out: Points = {}
    with _connect(directory) as db:
        for name, step, value in db.execute("SELECT name, step, value FROM scalars ORDER BY rowid"):
            out.setdefault(name, []).append((int(step), float(value)))
    return out


def read_sqlite_histograms(directory: Path | str) -> Hists:
    """``{name: [(step, {'count', 'min', 'max'}), ...]}`` from the raw values."""
    out: Hists = {}
    with _connect(directory) as db:
        for name, step, vals in db.execute("SELECT name, step, vals FROM hists ORDER BY rowid"):
            v = [float(x) for x in json.loads(vals)]
            out.setdefault(name, []).append(
                (int(step), {"count": len(v), "min": min(v), "max": max(v)})
            )
    return out


def read_sqlite_samples(directory: Path | str) -> Tables:
    """``{name: [(step, [(prompt, completion, reward), ...]), ...]}``, one entry per call."""
    tables: dict[int, tuple[str, int, list[tuple[str, str, float]]]] = {}
    with _connect(directory) as db:
        q = "SELECT tid, name, step, prompt, completion, reward FROM samples ORDER BY tid, idx"
        for tid, name, step, p, c, r in db.execute(q):
            tables.setdefault(tid, (name, int(step), []))[2].append((p, c, _reward(r)))
    out: Tables = {}
    for name, step, rows in tables.values():
        out.setdefault(name, []).append((step, rows))
    return out


def _reward(text: Any) -> Any:
    return float(text)


# --- design 2: files, binned histograms ---

SCALARS = "scalars.txt"
HISTS = "histograms.txt"
SAMPLES = "samples"


class BinnedFileSink:
    """Buffered text files for scalars and histograms (bins + exact count/min/max); one JSON
    file per sample table. ``flush()`` makes everything readable."""

    def __init__(self, directory: Path | str) -> None:
        self.dir = Path(directory)
        self.lock = threading.Lock()
        self.steps = _Steps()
        self.scalars = open(self.dir / SCALARS, "a", encoding="utf-8")  # noqa: SIM115
        self.hists = open(self.dir / HISTS, "a", encoding="utf-8")  # noqa: SIM115
        (self.dir / SAMPLES).mkdir(exist_ok=True)
        self.tables = len(list((self.dir / SAMPLES).glob("*.json")))

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        v = _number(name, value)
        with self.lock:
            s = self.steps(name, step)
            self.scalars.write(f"{name}\t{s}\t{v.hex()}\n")

    def bins(self, vals: list[float]) -> tuple[list[float], list[int]] | None:
        """8 equal bins over [min, max] (closed on the right); one bin for a constant sample."""
        lo, hi = min(vals), max(vals)
        if lo == hi:
            return [lo, hi], [len(vals)]
        width = (hi - lo) / NBINS
        edges = [lo + i * width for i in range(NBINS)] + [hi]
        counts = [0] * NBINS
        for v in vals:
            counts[min(int((v - lo) / width), NBINS - 1)] += 1
        return edges, counts

    def histogram_values(self, name: str, values: Any) -> list[float]:
        return _values(name, values)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        vals = self.histogram_values(name, values)
        s = _step(name, step)
        binned = self.bins(vals)
        if binned is None:
            return
        edges, counts = binned
        rec = [
            name,
            s,
            len(vals),
            min(vals).hex(),
            max(vals).hex(),
            [e.hex() for e in edges],
            counts,
        ]
        with self.lock:
            self.hists.write(json.dumps(rec) + "\n")

    def table_json(self, name: str, step: int, rows: list[tuple[str, str, float]]) -> str:
        return json.dumps(
            {"name": name, "step": step, "rows": [[p, c, r.hex()] for p, c, r in rows]}
        )

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        checked = _rows(name, rows)
        s = _step(name, step)
        with self.lock:
            path = self.dir / SAMPLES / f"{self.tables:08d}.json"
            self.tables += 1
            path.write_text(self.table_json(name, s, checked), encoding="utf-8")

    def flush(self) -> None:
        with self.lock:
            self.scalars.flush()
            self.hists.flush()

    def close(self) -> None:
        with self.lock:
            self.scalars.close()
            self.hists.close()


def read_binned_scalars(directory: Path | str) -> Points:
    """``{name: [(step, value), ...]}`` in logging order."""
    out: Points = {}
    path = Path(directory) / SCALARS
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        name, step, hexv = line.split("\t")
        out.setdefault(name, []).append((int(step), float.fromhex(hexv)))
    return out


def histogram_summary(rec: list[Any]) -> dict[str, float]:
    """What a stored histogram says: its exact count, min and max."""
    return {"count": rec[2], "min": float.fromhex(rec[3]), "max": float.fromhex(rec[4])}


def read_binned_histograms(directory: Path | str) -> Hists:
    """``{name: [(step, {'count', 'min', 'max'}), ...]}``."""
    out: Hists = {}
    path = Path(directory) / HISTS
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        rec = json.loads(line)
        out.setdefault(rec[0], []).append((int(rec[1]), histogram_summary(rec)))
    return out


def read_binned_samples(directory: Path | str) -> Tables:
    """``{name: [(step, rows), ...]}``, tables in the order they were logged."""
    out: Tables = {}
    for path in sorted((Path(directory) / SAMPLES).glob("*.json")):
        t = json.loads(path.read_text(encoding="utf-8"))
        rows = [(p, c, _hex_reward(r)) for p, c, r in t["rows"]]
        out.setdefault(t["name"], []).append((int(t["step"]), rows))
    return out


def _hex_reward(r: Any) -> Any:
    return float.fromhex(r) if isinstance(r, str) else r


# --- one-bug variants (each docstring names the requirement expected to catch it) ---


class DropsNonFinite(BinnedFileSink):
    """Filters NaN and infinities out of a histogram's values and bins the rest silently
    (``values[np.isfinite(values)]``), instead of refusing them with ValueError. MET-008."""

    def histogram_values(self, name: str, values: Any) -> list[float]:
        flat = values.reshape(-1).tolist() if hasattr(values, "reshape") else list(values)
        return _values(name, [float(v) for v in flat if math.isfinite(float(v))])


class SkipsConstantSample(BinnedFileSink):
    """A sample whose values are all equal has no bin width: the call returns without storing
    anything (a ``if hi == lo: return`` guard against dividing by zero). MET-008."""

    def bins(self, vals: list[float]) -> tuple[list[float], list[int]] | None:
        return None if min(vals) == max(vals) else super().bins(vals)


class HalfOpenLastBin(BinnedFileSink):
    """Bins are half-open [lo, hi) including the last (``int((v - lo) / width)`` without the
    clamp): the maximum falls outside every bin, and the count read back is the sum of the
    bins. MET-008."""

    def bins(self, vals: list[float]) -> tuple[list[float], list[int]] | None:
        lo, hi = min(vals), max(vals)
        if lo == hi:
            return [lo, hi], [len(vals)]
        width = (hi - lo) / NBINS
        counts = [0] * NBINS
        for v in vals:
            i = int((v - lo) / width)
            if i < NBINS:
                counts[i] += 1
        return [lo + i * width for i in range(NBINS)] + [hi], counts

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        vals = self.histogram_values(name, values)
        binned = self.bins(vals)
        assert binned is not None
        kept = sum(binned[1])  # what the bins hold is what is reported
        super().log_histogram(name, sorted(vals)[:kept] or vals[:1], step)


class MinMaxFromNiceEdges(BinnedFileSink):
    """Reports min and max as the outer bin edges after widening them to 'nice' round
    numbers (a tenth), as a plotting backend chooses its axis: not the data's extremes.
    MET-008."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        vals = self.histogram_values(name, values)
        lo, hi = math.floor(min(vals) * 10) / 10, math.ceil(max(vals) * 10) / 10
        s = _step(name, step)
        rec = [name, s, len(vals), lo.hex(), hi.hex(), [], []]
        with self.lock:
            self.hists.write(json.dumps(rec) + "\n")


class StripsTexts(SqliteRawSink):
    """Strips leading and trailing whitespace from prompts and completions (a table cleaner
    that tidies texts for display). MET-009."""

    def sample_rows(self, name: str, rows: Any) -> list[tuple[str, str, float]]:
        return [(p.strip(), c.strip(), r) for p, c, r in _rows(name, rows)]


class OneTablePerName(SqliteRawSink):
    """Keeps one table per name: a new ``log_samples`` call deletes the name's earlier rows
    (W&B's run summary keeps the last table logged under a key). MET-009."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        with self.lock:
            self.db.execute("DELETE FROM samples WHERE name = ?", (name,))
        super().log_samples(name, rows, step)


class NaNRewardAsNull(BinnedFileSink):
    """Writes rewards as JSON numbers with NaN turned into null (strict JSON has no NaN), so
    a NaN reward reads back as None. MET-009."""

    def table_json(self, name: str, step: int, rows: list[tuple[str, str, float]]) -> str:
        cells = [[p, c, r if math.isfinite(r) else None] for p, c, r in rows]
        return json.dumps({"name": name, "step": step, "rows": cells})


class HistogramPerStep(SqliteRawSink):
    """Keeps one histogram per (name, step): a second call at a step already logged replaces
    the first (``INSERT OR REPLACE`` on a (name, step) key). MET-008 (one per call)."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        vals = self.histogram_values(name, values)
        with self.lock:
            self.db.execute(
                "DELETE FROM hists WHERE name = ? AND step = ?", (name, _step(name, step))
            )
        super().log_histogram(name, vals, step)


class TablePerStep(SqliteRawSink):
    """Keeps one table per (name, step): a second ``log_samples`` at a step already logged
    replaces the first. MET-009 (one table per call)."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        checked = self.sample_rows(name, rows)
        with self.lock:
            self.db.execute(
                "DELETE FROM samples WHERE name = ? AND step = ?", (name, _step(name, step))
            )
        super().log_samples(name, checked, step)


def _reward_text(directory: Path | str) -> dict[str, list[tuple[int, list[Any]]]]:
    """The samples reader of ``RewardAsText``: the stored text is handed back as is."""
    out: dict[str, list[tuple[int, list[Any]]]] = {}
    with _connect(directory) as db:
        tables: dict[int, tuple[str, int, list[Any]]] = {}
        q = "SELECT tid, name, step, prompt, completion, reward FROM samples ORDER BY tid, idx"
        for tid, name, step, p, c, r in db.execute(q):
            tables.setdefault(tid, (name, int(step), []))[2].append((p, c, r))
    for name, step, rows in tables.values():
        out.setdefault(name, []).append((step, rows))
    return out


# --- declarations ---


def _sqlite(name: str, cls: type[SqliteRawSink] = SqliteRawSink, **extras: Any) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"sqlite/{name}",
        capabilities={"histogram", "samples"},
        extras={
            "reader": read_sqlite_scalars,
            "histogram_reader": read_sqlite_histograms,
            "samples_reader": read_sqlite_samples,
            **extras,
        },
    )


def _binned(name: str, cls: type[BinnedFileSink] = BinnedFileSink) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"binned/{name}",
        capabilities={"flush", "histogram", "samples"},
        extras={
            "reader": read_binned_scalars,
            "histogram_reader": read_binned_histograms,
            "samples_reader": read_binned_samples,
        },
    )


CORRECT_SINKS: dict[str, Implementation] = {
    "sqlite_raw": _sqlite("raw"),
    "binned_file": _binned("file"),
}

BUGGY_SINKS: dict[str, tuple[Implementation, str]] = {
    "drops_non_finite": (_binned("drops_non_finite", DropsNonFinite), "MET-008"),
    "skips_constant_sample": (_binned("skips_constant_sample", SkipsConstantSample), "MET-008"),
    "half_open_last_bin": (_binned("half_open_last_bin", HalfOpenLastBin), "MET-008"),
    "min_max_from_nice_edges": (_binned("min_max_from_nice_edges", MinMaxFromNiceEdges), "MET-008"),
    "strips_texts": (_sqlite("strips_texts", StripsTexts), "MET-009"),
    "one_table_per_name": (_sqlite("one_table_per_name", OneTablePerName), "MET-009"),
    "nan_reward_as_null": (_binned("nan_reward_as_null", NaNRewardAsNull), "MET-009"),
    "reward_as_text": (_sqlite("reward_as_text", samples_reader=_reward_text), "MET-009"),
    "histogram_per_step": (_sqlite("histogram_per_step", HistogramPerStep), "MET-008"),
    "table_per_step": (_sqlite("table_per_step", TablePerStep), "MET-009"),
}
