"""Metric sinks written from ``specs/metrics-v1.md`` alone, each with its own reader, and bugs.

``SQLiteSink`` appends one row per point to an SQLite table (WAL mode, so several processes
can log into one run); a value is stored as REAL plus a ``kind`` column, because SQLite turns
a bound NaN into NULL. ``CsvPerMetricSink`` keeps one CSV file per metric, named by the
percent-encoded metric name, with buffered handles that ``flush()`` empties.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> s = SQLiteSink(d)
    >>> s.log_scalar("loss/total", 0.5, step=3)
    >>> s.close()
    >>> read_sqlite(d)
    {'loss/total': [(3, 0.5)]}
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import math
import operator
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

import torch

from posttrain.contracts import Implementation

__all__ = [
    "BUGGY_SINKS",
    "CORRECT_SINKS",
    "CsvPerMetricSink",
    "SQLiteSink",
    "read_csv_dir",
    "read_sqlite",
]

DB_NAME = "metrics.sqlite3"
CSV_DIR = "scalars"
MAX_STEM = 200  # bytes of a file name before ".csv": below the usual 255-byte limit
Points = dict[str, list[tuple[int, float]]]


def _point(name: Any, value: Any, step: Any, counters: dict[str, int]) -> tuple[str, float, int]:
    """Check one ``log_scalar`` call; ``step=None`` is one past the highest step of ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric name: expected a non-empty str, found {name!r}")
    if isinstance(value, (str, bytes, complex, bool)):
        raise TypeError(f"metric {name!r}: expected a real number, found {value!r}")
    v = float(value)  # also a one-element tensor or numpy scalar
    if step is None:
        s = counters.get(name, 0)
    else:
        if isinstance(step, (bool, float)):
            raise TypeError(f"metric {name!r}: step expected an int, found {step!r}")
        s = operator.index(step)
        if s < 0:
            raise ValueError(f"metric {name!r}: step expected >= 0, found {s}")
    counters[name] = max(counters.get(name, 0), s + 1)
    return name, v, s


def _kind(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return "num"


_FROM_KIND = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class SQLiteSink:
    """One table ``points(seq, name, step, value, kind)``; every point is its own row.

    Points are buffered and written in one transaction per ``flush()`` (or every 256
    points, or at ``close()``). WAL journal and a busy timeout let several processes write.

    Example:
        >>> import tempfile, pathlib, math
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> s = SQLiteSink(d)
        >>> s.log_scalar("a/b", float("nan"), step=1); s.flush()
        >>> math.isnan(read_sqlite(d)["a/b"][0][1])
        True
    """

    BATCH = 256

    def __init__(self, directory: Any) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(d / DB_NAME, timeout=60.0, isolation_level=None)
        # Switching to WAL takes an exclusive lock and SQLite may answer "database is locked"
        # at once, without its busy handler, when another process opens the run meanwhile.
        deadline = time.monotonic() + 60.0
        while True:
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute(self.SCHEMA)
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self._pending: list[tuple[str, int, float | None, str]] = []
        self._counters: dict[str, int] = {}

    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS points (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
        "name TEXT NOT NULL, step INTEGER NOT NULL, value REAL, kind TEXT NOT NULL)"
    )
    INSERT = "INSERT INTO points (name, step, value, kind) VALUES (?, ?, ?, ?)"

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        k = _kind(v)
        return (name, step, v if k == "num" else None, k)

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Record ``value`` for ``name`` at ``step`` (buffered until the next flush)."""
        n, v, s = _point(name, value, step, self._counters)
        self._pending.append(self._row(n, s, v))
        if len(self._pending) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        """Write every buffered point in one transaction."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.executemany(self.INSERT, rows)

    def close(self) -> None:
        """Flush and close the connection."""
        if self._conn is not None:
            self.flush()
            self._conn.close()
            self._conn = None  # type: ignore[assignment]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nowhere left to report
            self.close()


def read_sqlite(directory: Any) -> Points:
    """Every point in ``directory``'s database, per name, in logging order.

    Example:
        >>> import tempfile, pathlib
        >>> read_sqlite(pathlib.Path(tempfile.mkdtemp()))
        {}
    """
    db = Path(directory) / DB_NAME
    if not db.exists():
        return {}
    conn = sqlite3.connect(db, timeout=60.0)
    try:
        rows = conn.execute("SELECT name, step, value, kind FROM points ORDER BY seq").fetchall()
    finally:
        conn.close()
    out: Points = {}
    for name, step, value, kind in rows:
        v = float(value) if kind == "num" else _FROM_KIND[kind]
        out.setdefault(name, []).append((int(step), v))
    return out


class CsvPerMetricSink:
    """One ``scalars/<percent-encoded name>.csv`` per metric: a ``#name,<name>`` header row,
    then rows ``step,value``.

    The header carries the name, so a name too long for a file name (255 bytes) is stored
    under a shortened, hashed file name and still reads back whole. Values are written with
    ``repr`` (shortest exact round trip, ``nan``/``inf`` included); handles stay open and
    buffered until ``flush()`` or ``close()``.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> s = CsvPerMetricSink(d)
        >>> s.log_scalar("rollout/reward/mean", 0.1, step=0); s.flush()
        >>> read_csv_dir(d)
        {'rollout/reward/mean': [(0, 0.1)]}
    """

    def __init__(self, directory: Any) -> None:
        self._dir = Path(directory) / CSV_DIR
        self._dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, TextIO] = {}
        self._counters: dict[str, int] = {}

    def _file_name(self, name: str) -> str:
        q = quote(name, safe="")
        if len(q) <= MAX_STEM:
            return q + ".csv"
        return q[: MAX_STEM - 41] + "~" + hashlib.sha1(name.encode()).hexdigest() + ".csv"

    def _stored_name(self, name: str) -> str:
        return name

    def _handle(self, name: str) -> TextIO:
        f = self._files.get(name)
        if f is None:
            f = open(self._dir / self._file_name(name), "a", newline="", encoding="utf-8")  # noqa: SIM115
            if f.tell() == 0:
                csv.writer(f).writerow(["#name", self._stored_name(name)])
            self._files[name] = f
        return f

    def _accept(self, name: str, step: int) -> bool:
        return True

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Append ``step,value`` to ``name``'s file (buffered)."""
        n, v, s = _point(name, value, step, self._counters)
        if self._accept(n, s):
            self._handle(n).write(f"{s},{v!r}\n")

    def flush(self) -> None:
        """Make every point logged so far readable."""
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        """Flush and close every file."""
        for f in self._files.values():
            f.close()
        self._files = {}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nowhere left to report
            self.close()


def read_csv_dir(directory: Any) -> Points:
    """Every point under ``directory``, per decoded metric name, in file order.

    Example:
        >>> import tempfile, pathlib
        >>> read_csv_dir(pathlib.Path(tempfile.mkdtemp()))
        {}
    """
    d = Path(directory) / CSV_DIR
    out: Points = {}
    if not d.is_dir():
        return out
    for p in sorted(d.iterdir()):
        if p.suffix != ".csv":
            continue
        with open(p, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if not rows:  # created, nothing flushed into it yet
            continue
        if rows[0][0] != "#name":
            raise ValueError(f"{p}: no '#name' header row")
        out[rows[0][1]] = [(int(step), float(value)) for step, value in rows[1:]]
    return out


# ---------------------------------------------------------------------------------------------
# One-bug variants.


class SanitisingCsvSink(CsvPerMetricSink):
    """BUG: file names are the metric name with "/" replaced by "_" (as loggers that map names
    to flat file or tag names do), and the reader cannot undo it: "policy/kl" reads back as
    "policy_kl".

    Breaks MET-002 ("Names matching ... MUST be stored unchanged, slashes included").
    """

    def _file_name(self, name: str) -> str:
        return self._stored_name(name) + ".csv"

    def _stored_name(self, name: str) -> str:
        return name.replace("/", "_")


class LongNameCsvSink(CsvPerMetricSink):
    """BUG: the file name is the whole percent-encoded metric name, so a name whose encoding
    passes 255 bytes makes ``log_scalar`` raise ``OSError: File name too long`` (every
    file-per-metric logger that names files after metrics meets this limit).

    Breaks MET-002 ("Names matching ``^[a-z0-9_]+(/[a-z0-9_]+)*$`` MUST be stored unchanged":
    names are promised up to 250 characters, METRIC_NAME_MAX).
    """

    def _file_name(self, name: str) -> str:
        return quote(name, safe="") + ".csv"


class NaNToNullSQLiteSink(SQLiteSink):
    """BUG: the value goes straight into the REAL column; SQLite stores a bound NaN as NULL and
    the reader turns NULL into 0.0. The pitfall MLflow's SQL store met and fixed with an
    ``is_nan`` column (mlflow/mlflow#1573, "Make sql alchemy's log_metric work with NaNs and
    infs").

    Breaks MET-004 (SHOULD: "NaN and infinite values SHOULD be stored as such rather than
    dropped or replaced").
    """

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        return (name, step, v, "num")


def read_sqlite_null_as_zero(directory: Any) -> Points:
    """Reader of :class:`NaNToNullSQLiteSink`: NULL values read as 0.0.

    Example:
        >>> import tempfile, pathlib
        >>> read_sqlite_null_as_zero(pathlib.Path(tempfile.mkdtemp()))
        {}
    """
    db = Path(directory) / DB_NAME
    if not db.exists():
        return {}
    conn = sqlite3.connect(db, timeout=60.0)
    try:
        rows = conn.execute("SELECT name, step, value FROM points ORDER BY seq").fetchall()
    finally:
        conn.close()
    out: Points = {}
    for name, step, value in rows:
        out.setdefault(name, []).append((int(step), 0.0 if value is None else float(value)))
    return out


class UpsertSQLiteSink(SQLiteSink):
    """BUG: one row per (name, step), written with ``INSERT OR REPLACE``: a second value logged
    for a name at a step already used overwrites the first (a "latest value per step" table,
    as W&B's history keeps one row per step).

    Breaks MET-001 ("Every logged (name, step, value) MUST read back").
    """

    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS points (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
        "name TEXT NOT NULL, step INTEGER NOT NULL, value REAL, kind TEXT NOT NULL, "
        "UNIQUE (name, step))"
    )
    INSERT = "INSERT OR REPLACE INTO points (name, step, value, kind) VALUES (?, ?, ?, ?)"


class MonotonicStepCsvSink(CsvPerMetricSink):
    """BUG: a point whose step is lower than the last step logged for its name is dropped
    (W&B's "step must only increase" rule: it warns and ignores such a log call).

    Breaks MET-003 ("Values logged for one name at different steps MUST all be kept").
    """

    def __init__(self, directory: Any) -> None:
        super().__init__(directory)
        self._last: dict[str, int] = {}

    def _accept(self, name: str, step: int) -> bool:
        last = self._last.get(name)
        if last is not None and step < last:
            return False
        self._last[name] = step
        return True


class LastFileFlushCsvSink(CsvPerMetricSink):
    """BUG: ``flush()`` flushes only the file written last (the handle a single-file logger
    would hold), so other metrics stay in their buffers until close.

    Breaks MET-005 ("After flush(), everything logged so far MUST be readable without closing
    the sink").
    """

    def __init__(self, directory: Any) -> None:
        super().__init__(directory)
        self._last_file: TextIO | None = None

    def _handle(self, name: str) -> TextIO:
        self._last_file = super()._handle(name)
        return self._last_file

    def flush(self) -> None:
        """Flush the last file written."""
        if self._last_file is not None:
            self._last_file.flush()


class InfToMaxSQLiteSink(SQLiteSink):
    """BUG: infinities are stored as the largest finite double, as MLflow's SQL store does
    since mlflow/mlflow#1573 ("replace the Infs with max / min float value"; the silent
    change is reported in mlflow/mlflow#22826). NaN is kept.

    Breaks MET-004 (SHOULD: "NaN and infinite values SHOULD be stored as such rather than
    dropped or replaced").
    """

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        if math.isinf(v):
            return (name, step, math.copysign(sys.float_info.max, v), "num")
        return super()._row(name, step, v)


class SixDigitCsvSink(CsvPerMetricSink):
    """BUG: values are written with ``%.6g`` (six significant digits, a common "compact"
    log format), coarser than float32's ~7.2 digits.

    Breaks MET-001 ("... same name, step and value (float32 rounding allowed)").
    """

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Append ``step,value`` with six significant digits."""
        n, v, s = _point(name, value, step, self._counters)
        self._handle(n).write(f"{s},{v:.6g}\n")


class TruncatingCsvSink(CsvPerMetricSink):
    """BUG: each metric file is opened with mode "w": a second process (or a resumed run)
    logging a name another one already wrote truncates that file, and the first writer's
    points vanish (declares cross_process, as a logger that only tested disjoint names).

    Breaks MET-006 ("Metrics logged from several processes into one run MUST all read back").
    """

    def _handle(self, name: str) -> TextIO:
        f = self._files.get(name)
        if f is None:
            f = open(self._dir / self._file_name(name), "w", newline="", encoding="utf-8")  # noqa: SIM115
            csv.writer(f).writerow(["#name", self._stored_name(name)])
            f.flush()
            self._files[name] = f
        return f


# Correct designs that read the spec's latitude differently from the obvious one.


def read_sqlite_by_step(directory: Any) -> Points:
    """CORRECT reader for :class:`SQLiteSink` that lists each name's points by step (then
    logging order), as dashboards plot them; the spec fixes no order within a name.

    Example:
        >>> import tempfile, pathlib
        >>> read_sqlite_by_step(pathlib.Path(tempfile.mkdtemp()))
        {}
    """
    return {n: sorted(p, key=lambda sv: sv[0]) for n, p in read_sqlite(directory).items()}


class Float32CsvSink(CsvPerMetricSink):
    """CORRECT: stores values as float32 (TensorBoard's scalar type); MET-001 allows float32
    rounding, and NaN and infinities survive the cast.
    """

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Append ``step,value`` with the value rounded to float32."""
        n, v, s = _point(name, value, step, self._counters)
        v32 = float(torch.tensor(v, dtype=torch.float32))
        self._handle(n).write(f"{s},{v32!r}\n")


SQLITE = Implementation(
    "metrics",
    SQLiteSink,
    name="independent.SQLiteSink",
    capabilities={"flush", "cross_process"},
    extras={"reader": read_sqlite},
)
CSV_PER_METRIC = Implementation(
    "metrics",
    CsvPerMetricSink,
    name="independent.CsvPerMetricSink",
    capabilities={"flush"},
    extras={"reader": read_csv_dir},
)

CORRECT_SINKS = {
    "sqlite": SQLITE,
    "csv_per_metric": CSV_PER_METRIC,
    "sqlite_step_ordered_reader": Implementation(
        "metrics",
        SQLiteSink,
        name="independent.SQLiteSink[by-step reader]",
        capabilities={"flush"},
        extras={"reader": read_sqlite_by_step},
    ),
    "csv_float32": Implementation(
        "metrics",
        Float32CsvSink,
        name="independent.Float32CsvSink",
        capabilities={"flush"},
        extras={"reader": read_csv_dir},
    ),
}

BUGGY_SINKS: dict[str, tuple[Implementation, str]] = {
    "sanitising_csv": (
        Implementation(
            "metrics",
            SanitisingCsvSink,
            name="independent.SanitisingCsvSink",
            capabilities={"flush"},
            extras={"reader": read_csv_dir},
        ),
        "MET-002",
    ),
    "long_name_csv": (
        Implementation(
            "metrics",
            LongNameCsvSink,
            name="independent.LongNameCsvSink",
            capabilities={"flush"},
            extras={"reader": read_csv_dir},
        ),
        "MET-002",
    ),
    "nan_to_null_sqlite": (
        Implementation(
            "metrics",
            NaNToNullSQLiteSink,
            name="independent.NaNToNullSQLiteSink",
            capabilities={"flush", "cross_process"},
            extras={"reader": read_sqlite_null_as_zero},
        ),
        "MET-004",
    ),
    "inf_to_max_sqlite": (
        Implementation(
            "metrics",
            InfToMaxSQLiteSink,
            name="independent.InfToMaxSQLiteSink",
            capabilities={"flush"},
            extras={"reader": read_sqlite},
        ),
        "MET-004",
    ),
    "six_digit_csv": (
        Implementation(
            "metrics",
            SixDigitCsvSink,
            name="independent.SixDigitCsvSink",
            capabilities={"flush"},
            extras={"reader": read_csv_dir},
        ),
        "MET-001",
    ),
    "truncating_csv": (
        Implementation(
            "metrics",
            TruncatingCsvSink,
            name="independent.TruncatingCsvSink",
            capabilities={"flush", "cross_process"},
            extras={"reader": read_csv_dir},
        ),
        "MET-006",
    ),
    "upsert_sqlite": (
        Implementation(
            "metrics",
            UpsertSQLiteSink,
            name="independent.UpsertSQLiteSink",
            capabilities={"flush", "cross_process"},
            extras={"reader": read_sqlite},
        ),
        "MET-001",
    ),
    "monotonic_step_csv": (
        Implementation(
            "metrics",
            MonotonicStepCsvSink,
            name="independent.MonotonicStepCsvSink",
            capabilities={"flush"},
            extras={"reader": read_csv_dir},
        ),
        "MET-003",
    ),
    "last_file_flush_csv": (
        Implementation(
            "metrics",
            LastFileFlushCsvSink,
            name="independent.LastFileFlushCsvSink",
            capabilities={"flush"},
            extras={"reader": read_csv_dir},
        ),
        "MET-005",
    ),
}
