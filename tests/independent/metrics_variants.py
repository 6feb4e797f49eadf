"""One-bug metric sinks written from ``specs/metrics-v1.md`` alone, to measure the kit's reach.

Each variant changes one thing in a correct design: the sinks of
:mod:`tests.independent.sinks` and :mod:`tests.independent.sinks_capabilities`, or one of two
designs written here, :class:`AsyncCsvSink` (a background writer thread that ``flush()``
waits for) and :class:`CsvTablesSink` (sample tables as CSV files). Each docstring names the
bug, a system that shipped a bug of that kind (or says it is plausible) and the requirement
sentence it breaks; ``demo_<name>()`` shows the bug with plain code against that sentence
(True when the bug shows).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> s = CsvTablesSink(d)
    >>> s.log_samples("samples/rollout", [("a\\r\\nb", "c", 0.5)], step=1); s.close()
    >>> read_csv_tables(d)
    {'samples/rollout': [(1, [('a\\r\\nb', 'c', 0.5)])]}
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import queue
import tempfile
import threading
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from posttrain.contracts import Implementation
from tests.independent.sinks import (
    CsvPerMetricSink,
    SQLiteSink,
    _point,
    read_csv_dir,
    read_sqlite,
)
from tests.independent.sinks_capabilities import (
    SAMPLES,
    BinnedFileSink,
    SqliteRawSink,
    _rows,
    _step,
    read_binned_histograms,
    read_binned_samples,
    read_binned_scalars,
    read_sqlite_histograms,
    read_sqlite_samples,
    read_sqlite_scalars,
)

__all__ = ["BASES", "DEMOS", "VARIANTS", "AsyncCsvSink", "CsvTablesSink", "read_csv_tables"]

Tables = dict[str, list[tuple[int, list[tuple[str, str, float]]]]]


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="metrics-variant-"))


# ---------------------------------------------------------------------------------------------
# Correct designs written here


class AsyncCsvSink(CsvPerMetricSink):
    """:class:`CsvPerMetricSink` whose files are written by a background thread (as
    TensorBoard's event writer and MLflow's async logging do): ``log_scalar`` only queues,
    the thread writes every ``period_s``, and ``flush()`` waits for the queue to drain.

    Example:
        >>> s = AsyncCsvSink(_tmp()); s.log_scalar("a/b", 1.5, step=2); s.flush(); s.close()
    """

    def __init__(self, directory: Any, *, period_s: float = 0.1) -> None:
        super().__init__(directory)
        self._period = period_s
        self._q: queue.Queue[tuple[str, float, int] | None] = queue.Queue()
        self._io = threading.Lock()
        self._closed = False
        self._error: OSError | None = None
        self._worker = threading.Thread(target=self._drain, name="async-csv", daemon=True)
        self._worker.start()

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Queue ``(name, step, value)`` for the writer thread."""
        self._q.put(_point(name, value, step, self._counters))

    def _drain(self) -> None:
        while True:
            items = [self._q.get()]
            time.sleep(self._period)  # batch what arrives meanwhile into one write
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._q.get_nowait())
            try:
                with self._io:
                    for item in items:
                        if item is not None:
                            n, v, s = item
                            self._handle(n).write(f"{s},{v!r}\n")
            except OSError as e:  # the run directory went away: report it at the next flush
                self._error = e
            finally:
                for _ in items:
                    self._q.task_done()
            if None in items:
                return

    def _wait_for_writer(self) -> None:
        self._q.join()

    def flush(self) -> None:
        """Wait for the writer thread to write everything queued, then flush the files."""
        self._wait_for_writer()
        if self._error is not None:
            raise OSError(f"the metric writer thread failed: {self._error}") from self._error
        with self._io:
            super().flush()

    def close(self) -> None:
        """Flush, stop the writer thread and close the files."""
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._worker.join()
        with self._io:
            super().close()


def _table_path(directory: Path, i: int) -> Path:
    return directory / SAMPLES / f"{i:08d}.csv"


class CsvTablesSink(BinnedFileSink):
    """:class:`BinnedFileSink` with each sample table written as a CSV file of its own: a
    ``name,step`` row, then ``prompt,completion,reward`` rows (reward as a hex float, exact,
    NaN kept). Texts keep every character: the file is written and read with ``newline=""``.
    """

    def __init__(self, directory: Path | str) -> None:
        super().__init__(directory)
        self.tables = len(list((self.dir / SAMPLES).glob("*.csv")))

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        """Write one table as ``samples/<n>.csv``."""
        checked = _rows(name, rows)
        s = _step(name, step)
        with self.lock:
            path = _table_path(self.dir, self.tables)
            self.tables += 1
            with open(path, "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                w.writerow([name, s])
                w.writerows([p, c, r.hex()] for p, c, r in checked)


def _read_tables(directory: Path | str, newline: str | None) -> Tables:
    out: Tables = {}
    for path in sorted((Path(directory) / SAMPLES).glob("*.csv")):
        with open(path, newline=newline, encoding="utf-8") as f:
            head, *rows = list(csv.reader(f))
        table = [(p, c, float.fromhex(r)) for p, c, r in rows]
        out.setdefault(head[0], []).append((int(head[1]), table))
    return out


def read_csv_tables(directory: Path | str) -> Tables:
    """``{name: [(step, rows), ...]}`` from :class:`CsvTablesSink`'s files."""
    return _read_tables(directory, "")


# ---------------------------------------------------------------------------------------------
# The variants


class GlobalStepSink(SQLiteSink):
    """BUG: ``step=None`` goes one past the highest step logged through the sink for *any*
    name (W&B's run-global ``_step``), so a name's first value without a step lands after
    every other metric's steps instead of at 0.

    Breaks MET-007 ("one past the highest step logged for that name through the sink (0 for
    its first value)").
    """

    def __init__(self, directory: Any) -> None:
        super().__init__(directory)
        self._global_next = 0

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Record at ``step``, or at the sink-wide next step."""
        n, v, s = _point(name, value, self._global_next if step is None else step, {})
        self._global_next = max(self._global_next, s + 1)
        self._pending.append(self._row(n, s, v))
        if len(self._pending) >= self.BATCH:
            self.flush()


def demo_global_step() -> bool:
    d = _tmp()
    s = GlobalStepSink(d)
    for i in range(3):
        s.log_scalar("loss/total", 1.0, step=i)
    s.log_scalar("rollout/reward/mean", 0.5)
    s.close()
    return read_sqlite(d)["rollout/reward/mean"] != [(0, 0.5)]


class LastStepSink(SQLiteSink):
    """BUG: ``step=None`` goes one past the *last* step logged for the name, not the highest
    (a "previous step + 1" counter): after steps 5 then 2, a value without a step lands at 3,
    beside an existing point, instead of at 6. Plausible.

    Breaks MET-007 ("one past the highest step logged for that name through the sink").
    """

    def __init__(self, directory: Any) -> None:
        super().__init__(directory)
        self._last: dict[str, int] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Record at ``step``, or one past the name's previous step."""
        want = self._last.get(name, -1) + 1 if step is None else step
        n, v, s = _point(name, value, want, {})
        self._last[n] = s
        self._pending.append(self._row(n, s, v))
        if len(self._pending) >= self.BATCH:
            self.flush()


def demo_last_step() -> bool:
    d = _tmp()
    s = LastStepSink(d)
    s.log_scalar("loss/total", 1.0, step=5)
    s.log_scalar("loss/total", 2.0, step=2)
    s.log_scalar("loss/total", 3.0)
    s.close()
    return read_sqlite(d)["loss/total"][-1] != (6, 3.0)


class FlushSkipsQueueSink(AsyncCsvSink):
    """BUG: ``flush()`` flushes the open files but does not wait for the writer thread's
    queue, so what was logged in the last ``period_s`` is not yet in any file when the caller
    reads. Plausible, for any asynchronous event writer (TensorBoard's, MLflow's async
    logging) whose ``flush`` must wait for its queue.

    Breaks MET-005 ("After flush(), everything logged so far, under every name, MUST be
    readable without closing the sink").
    """

    def _wait_for_writer(self) -> None:
        return None


def demo_flush_skips_queue() -> bool:
    d = _tmp()
    s = FlushSkipsQueueSink(d)
    s.log_scalar("loss/total", 1.0, step=0)
    s.flush()
    seen = read_csv_dir(d)
    s.close()
    return seen.get("loss/total") != [(0, 1.0)]


class StepZeroFalsySink(SQLiteSink):
    """BUG: ``step = step or next_step``: an explicit ``step=0`` is falsy and is replaced by
    the name's next step, so a second value at step 0, or a value logged back at step 0 (a
    re-evaluation of the initial checkpoint), lands past the name's last step. The ``if not
    step`` slip Python loggers keep shipping. Plausible.

    Breaks MET-001 ("Every logged (name, step, value) MUST read back ... with the same name,
    step and value; two values logged for one name at one step are two points"), and MET-003
    ("each with its step ... (a step lower than one already logged for the name included)").
    """

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Record at ``step``; a falsy step means "the next one"."""
        super().log_scalar(name, value, step or None)


def demo_step_zero_falsy() -> bool:
    d = _tmp()
    s = StepZeroFalsySink(d)
    s.log_scalar("eval/reward", 0.7, step=3)
    s.log_scalar("eval/reward", 0.1, step=0)
    s.close()
    return (0, 0.1) not in read_sqlite(d)["eval/reward"]


class UnsignedInfSink(SQLiteSink):
    """BUG: the non-finite tag is taken with ``math.isinf`` alone, so -inf is stored as
    "inf" and reads back as +inf (a log-prob of an impossible token becomes +inf). Plausible,
    of the kind of MLflow's SQL store turning infinities into the largest finite doubles.

    Breaks MET-004 ("NaN and infinite values SHOULD be stored as such").
    """

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        if math.isinf(v):
            return (name, step, None, "inf")
        return super()._row(name, step, v)


def demo_unsigned_inf() -> bool:
    d = _tmp()
    s = UnsignedInfSink(d)
    s.log_scalar("loss/kl", float("-inf"), step=0)
    s.close()
    return read_sqlite(d)["loss/kl"] != [(0, float("-inf"))]


class OuterLenCountSink(BinnedFileSink):
    """BUG: a histogram's count is ``len(values)``, the length of the outer dimension, while
    min, max and bins use every value: a ``[B, T]`` tensor of per-token values is counted as
    B values. The ``len(tensor)`` vs ``numel()`` slip. Plausible.

    Breaks MET-008 ("MUST store one distribution per call that reads back at its step with the
    number of values").
    """

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """Store the distribution of ``values`` (counted by their first dimension)."""
        vals = self.histogram_values(name, values)
        s = _step(name, step)
        binned = self.bins(vals)
        if binned is None:
            return
        edges, counts = binned
        rec = [
            name,
            s,
            len(values),
            min(vals).hex(),
            max(vals).hex(),
            [e.hex() for e in edges],
            counts,
        ]
        with self.lock:
            self.hists.write(json.dumps(rec) + "\n")


def demo_outer_len_count() -> bool:
    d = _tmp()
    s = OuterLenCountSink(d)
    s.log_histogram("rollout/token_log_prob", torch.zeros(3, 4) - 0.5, step=0)
    s.close()
    return read_binned_histograms(d)["rollout/token_log_prob"][0][1]["count"] != 12


def read_csv_tables_universal(directory: Path | str) -> Tables:
    """BUG reader: opens the CSV files without ``newline=""``."""
    return _read_tables(directory, None)


def demo_universal_newlines() -> bool:
    d = _tmp()
    s = CsvTablesSink(d)
    s.log_samples("samples/rollout", [("line one\r\nline two\r", "ok", 1.0)], step=0)
    s.close()
    return read_csv_tables_universal(d)["samples/rollout"][0][1][0][0] != "line one\r\nline two\r"


class NfcTextsSink(SqliteRawSink):
    """BUG: sample texts are normalised to Unicode NFC before they are stored (a "clean the
    text" step), so a completion holding a decomposed character (e + U+0301, as tokenizers
    byte-decode it) reads back composed. Plausible.

    Breaks MET-009 ("each text unchanged (newlines, leading and trailing spaces, non-ASCII,
    ...)").
    """

    def sample_rows(self, name: str, rows: Any) -> list[tuple[str, str, float]]:
        return [
            (unicodedata.normalize("NFC", p), unicodedata.normalize("NFC", c), r)
            for p, c, r in _rows(name, rows)
        ]


def demo_nfc_texts() -> bool:
    d = _tmp()
    s = NfcTextsSink(d)
    s.log_samples("samples/rollout", [("caf\u0065\u0301", "x", 0.0)], step=0)
    s.close()
    return read_sqlite_samples(d)["samples/rollout"][0][1][0][0] != "caf\u0065\u0301"


# ---------------------------------------------------------------------------------------------
# Declarations


def _sqlite(cls: type[SQLiteSink]) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"independent.variants.{cls.__name__}",
        capabilities={"flush"},
        extras={"reader": read_sqlite},
    )


def _async(cls: type[AsyncCsvSink]) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"independent.variants.{cls.__name__}",
        capabilities={"flush"},
        extras={"reader": read_csv_dir},
    )


def _binned(cls: type[BinnedFileSink], samples_reader: Any = read_binned_samples) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"independent.variants.{cls.__name__}",
        capabilities={"flush", "histogram", "samples"},
        extras={
            "reader": read_binned_scalars,
            "histogram_reader": read_binned_histograms,
            "samples_reader": samples_reader,
        },
    )


def _raw(cls: type[SqliteRawSink]) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"independent.variants.{cls.__name__}",
        capabilities={"histogram", "samples"},
        extras={
            "reader": read_sqlite_scalars,
            "histogram_reader": read_sqlite_histograms,
            "samples_reader": read_sqlite_samples,
        },
    )


BASES: dict[str, Implementation] = {
    "async_csv": _async(AsyncCsvSink),
    "csv_tables": _binned(CsvTablesSink, read_csv_tables),
}

# name -> (requirement id the bug breaks, declaration)
VARIANTS: dict[str, tuple[str, Implementation]] = {
    "global_step": ("MET-007", _sqlite(GlobalStepSink)),
    "last_step": ("MET-007", _sqlite(LastStepSink)),
    "flush_skips_queue": ("MET-005", _async(FlushSkipsQueueSink)),
    "step_zero_falsy": ("MET-001", _sqlite(StepZeroFalsySink)),
    "unsigned_inf": ("MET-004", _sqlite(UnsignedInfSink)),
    "outer_len_count": ("MET-008", _binned(OuterLenCountSink)),
    "universal_newlines": ("MET-009", _binned(CsvTablesSink, read_csv_tables_universal)),
    "nfc_texts": ("MET-009", _raw(NfcTextsSink)),
}

DEMOS: dict[str, Callable[[], bool]] = {
    "global_step": demo_global_step,
    "last_step": demo_last_step,
    "flush_skips_queue": demo_flush_skips_queue,
    "step_zero_falsy": demo_step_zero_falsy,
    "unsigned_inf": demo_unsigned_inf,
    "outer_len_count": demo_outer_len_count,
    "universal_newlines": demo_universal_newlines,
    "nfc_texts": demo_nfc_texts,
}
