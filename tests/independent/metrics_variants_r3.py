"""Round-three blind one-bug metric sinks (contract ``metrics`` v1), written from
``specs/metrics-v1.md`` alone (the suites unread), to measure the kit's reach.

Each variant changes one thing in a correct design of :mod:`tests.independent.sinks`
(``SQLiteSink``) or :mod:`tests.independent.sinks_capabilities` (``BinnedFileSink``), a bug
of a kind not named in ``metrics_variants.py`` nor in those modules: a step wrapped to 32
bits, subnormal values flushed to zero, a name cut one short of its field, a line-oriented reader that splits on Unicode line
separators, a refused histogram that still leaves a record. Each docstring names the bug, a
system that shipped one of that kind (or says it is plausible) and the requirement sentence it
breaks; ``DEMOS[name]()`` shows the bug with plain code against that sentence (True when it
shows).

Results (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; each base design passes the id):

- ``int32_step`` breaks MET-003: **caught** (MET-003: 'rollout/wide_steps' logged at steps
  [2147483648, 0, 4294967296, 2147483647, 9223372036854775807, ...] (integer-width boundaries
  up to 2**63 - 1) in that order: 0.5 at step 2147483648 not read back; found 9 points:
  [(-2147483648, 0.5), (-1, 4.5), ...)
- ``flush_to_zero`` breaks MET-001: **caught** (MET-001: read back: 'value_7' at step 7 logged
  as 1.1754942106924411e-38, read back [(7, 0.0)]: float32's largest subnormal, among the
  boundaries tried first, compared as a float32 store keeps it)
- ``name_cut_at_249`` breaks MET-002: **caught** (MET-002: catalogue names:
  'g_0/g_0/g_0/g_0/g_0/g_0/g_0/g_0/g_0/g_0/'... (250 characters) logged but not read back;
  names read back: ['buffer/utilization', 'g_0/)
- ``splitlines_samples`` breaks MET-009: **caught** (MET-009: log_samples('samples',
  step=3), one call: expected 1 table(s) at step 3, one per call, read back 0 (steps read
  back for 'samples': [1, 1]) (see specs/m)
- ``refused_histogram_kept`` breaks MET-008: **caught** (MET-008: a refused distribution
  (NaN among its values) was stored at step 5 (see specs/metrics-v1.md#MET-008))

Base on the same ids and declarations (``SQLiteSink``, ``BinnedFileSink``): MET-001,
MET-002, MET-003, MET-008 and MET-009 all PASS.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> s = Int32StepSink(d); s.log_scalar("a/b", 1.5, step=2**31); s.close()
    >>> read_sqlite(d)["a/b"]
    [(-2147483648, 1.5)]
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.contracts import Implementation
from tests.independent.sinks import SQLiteSink, read_sqlite
from tests.independent.sinks_capabilities import (
    BinnedFileSink,
    Tables,
    _hex_reward,
    _rows,
    _step,
    _values,
    read_binned_histograms,
    read_binned_scalars,
)

__all__ = [
    "BREAKS",
    "DEMOS",
    "VARIANTS",
    "FlushToZeroSink",
    "Int32StepSink",
    "NameCutAt249Sink",
    "RefusedHistogramKeptSink",
    "SplitlinesSamplesSink",
    "read_sqlite",
]


class Int32StepSink(SQLiteSink):
    """BUG: the step stored through a 32-bit signed integer (a numpy ``int32`` array of steps
    on a platform whose default int is 32 bits, as numpy's was on Windows before 2.0, or a
    C ``int`` in a native writer): step 2**31 wraps to -2**31 and 10**12 to a small number.
    Shipped in users' loggers: talmolab/track-mjx#32 ("Step overflow in logging": the W&B
    step "loops back to negative values ... being stored as an int32") and
    google-deepmind/mujoco_playground#48 (the step counter overflows past 2**31). Breaks MET-003
    ("Values logged for one name at different steps MUST all be kept, each with its
    step")."""

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        wrapped = (step + 2**31) % 2**32 - 2**31
        return super()._row(name, wrapped, v)


class FlushToZeroSink(SQLiteSink):
    """BUG: values below float32's smallest normal (1.18e-38) in magnitude stored as 0.0, as
    a writer that packs through a float32 path with flush-to-zero / denormals-are-zero on
    (GPU kernels and ``-ffast-math`` builds do) stores them: 1e-40 and -1e-45 read back 0.
    Float32 *rounding* keeps a subnormal (1e-40 is about 9.99995e-41 in float32); flushing
    it is not rounding. Plausible. Breaks MET-001 ("Every logged (name, step, value) MUST
    read back ... with the same ... value (float32 rounding allowed)")."""

    TINY = 1.1754943508222875e-38

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        if math.isfinite(v) and 0.0 < abs(v) < self.TINY:
            v = 0.0
        return super()._row(name, step, v)


class NameCutAt249Sink(SQLiteSink):
    """BUG: names cut to fit a fixed 250-byte field that keeps one byte for a terminating NUL
    (a C-style ``char name[250]``), so a name of exactly 250 characters, MLflow's limit and
    the longest the spec promises, is stored with its last character dropped; every shorter
    name is unchanged. An off-by-one at the boundary. Plausible. Breaks MET-002 ("Names ...
    of up to 250 characters ... MUST be stored unchanged")."""

    FIELD = 250

    def _row(self, name: str, step: int, v: float) -> tuple[str, int, float | None, str]:
        return super()._row(name[: self.FIELD - 1], step, v)


SAMPLES_JSONL = "samples.jsonl"


class SplitlinesSamplesSink(BinnedFileSink):
    """BUG: sample tables appended as JSON lines to one ``samples.jsonl`` written with
    ``ensure_ascii=False`` (readable UTF-8, as most JSONL loggers write), and read back with
    ``str.splitlines()``, which also splits on U+2028, U+2029, U+0085, \\x1c-\\x1e, \\v and
    \\f: ``json.dumps`` escapes \\n and \\r but leaves those raw, so a completion holding
    U+2028 cuts its record in two and the table does not read back. The JSON-vs-line-
    separator trap (ECMAScript's U+2028 issue). Plausible. Breaks MET-009 ("each text
    unchanged (newlines, ..., non-ASCII, ...)": the table reads back with every row)."""

    def log_samples(self, name: str, rows: Any, step: int) -> None:
        checked = _rows(name, rows)
        s = _step(name, step)
        rec = {"name": name, "step": s, "rows": [[p, c, r.hex()] for p, c, r in checked]}
        with self.lock, open(self.dir / SAMPLES_JSONL, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


def read_jsonl_samples(directory: Path | str) -> Tables:
    """``{name: [(step, rows), ...]}`` from ``samples.jsonl``, one record per line."""
    out: Tables = {}
    path = Path(directory) / SAMPLES_JSONL
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            t = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn record (the bug): skipped as a partial write would be
        rows = [(p, c, _hex_reward(r)) for p, c, r in t["rows"]]
        out.setdefault(t["name"], []).append((int(t["step"]), rows))
    return out


class RefusedHistogramKeptSink(BinnedFileSink):
    """BUG: ``log_histogram`` with a NaN or infinite value bins and writes the finite values
    first and raises ValueError after (the check placed after the write, so the exception
    reports the bad value but the store already holds a distribution of the rest): the
    caller sees a refusal, the reader a histogram. An exception-safety slip (state after a
    refused call). Plausible. Breaks MET-008 ("a NaN or infinite value MUST be refused with
    ValueError rather than binned or dropped")."""

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        flat = values.reshape(-1).tolist() if hasattr(values, "reshape") else list(values)
        finite = [float(v) for v in flat if math.isfinite(float(v))]
        if finite:
            super().log_histogram(name, finite, step)
            self.flush()
        if len(finite) != len(flat):
            _values(name, flat)  # raises ValueError naming the non-finite value


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------


def _sqlite(name: str, cls: type[SQLiteSink]) -> Implementation:
    return Implementation(
        "metrics",
        cls,
        name=f"r3/{name}",
        capabilities={"flush", "cross_process"},
        extras={"reader": read_sqlite},
    )


def _binned(name: str, cls: type[BinnedFileSink], samples: Any = None) -> Implementation:
    from tests.independent.sinks_capabilities import read_binned_samples

    return Implementation(
        "metrics",
        cls,
        name=f"r3/{name}",
        capabilities={"flush", "histogram", "samples"},
        extras={
            "reader": read_binned_scalars,
            "histogram_reader": read_binned_histograms,
            "samples_reader": samples or read_binned_samples,
        },
    )


_SQLITE = _sqlite("sqlite-base", SQLiteSink)
_BINNED = _binned("binned-base", BinnedFileSink)
# Each variant's correct design (the same class without the bug), by variant.
BASES: dict[str, Implementation] = {
    "int32_step": _SQLITE,
    "flush_to_zero": _SQLITE,
    "name_cut_at_249": _SQLITE,
    "splitlines_samples": _BINNED,
    "refused_histogram_kept": _BINNED,
}

VARIANTS: dict[str, Implementation] = {
    "int32_step": _sqlite("int32-step", Int32StepSink),
    "flush_to_zero": _sqlite("flush-to-zero", FlushToZeroSink),
    "name_cut_at_249": _sqlite("name-cut-at-249", NameCutAt249Sink),
    "splitlines_samples": _binned(
        "splitlines-samples", SplitlinesSamplesSink, samples=read_jsonl_samples
    ),
    "refused_histogram_kept": _binned("refused-histogram-kept", RefusedHistogramKeptSink),
}

BREAKS: dict[str, str] = {
    "int32_step": "MET-003",
    "flush_to_zero": "MET-001",
    "name_cut_at_249": "MET-002",
    "splitlines_samples": "MET-009",
    "refused_histogram_kept": "MET-008",
}

BASE_OF: dict[str, str] = {
    "int32_step": "sqlite",
    "flush_to_zero": "sqlite",
    "name_cut_at_249": "sqlite",
    "splitlines_samples": "binned",
    "refused_histogram_kept": "binned",
}

# ------------------------------------------------------------------------------------------
# demos
# ------------------------------------------------------------------------------------------


def _tmp() -> Path:
    return Path(tempfile.mkdtemp())


def demo_int32_step() -> bool:
    """Steps 2**31 and 10**12 read back at those steps from the base, not from the variant."""
    steps = [2**31, 10**12]

    def back(cls: type[SQLiteSink]) -> list[int]:
        d = _tmp()
        s = cls(d)
        for st in steps:
            s.log_scalar("a/b", 1.0, step=st)
        s.close()
        return [st for st, _ in read_sqlite(d)["a/b"]]

    return back(SQLiteSink) == steps and back(Int32StepSink) != steps


def demo_flush_to_zero() -> bool:
    """1e-40 reads back non-zero (its float32 rounding) from the base, 0 from the variant."""

    def back(cls: type[SQLiteSink]) -> float:
        d = _tmp()
        s = cls(d)
        s.log_scalar("a/b", 1e-40, step=0)
        s.close()
        return read_sqlite(d)["a/b"][0][1]

    return back(SQLiteSink) != 0.0 and back(FlushToZeroSink) == 0.0


def demo_name_cut_at_249() -> bool:
    """A name of exactly 250 characters reads back whole from the base only."""
    name = "a" * 120 + "/" + "b" * 129
    assert len(name) == 250

    def back(cls: type[SQLiteSink]) -> list[str]:
        d = _tmp()
        s = cls(d)
        s.log_scalar(name, 1.0, step=0)
        s.close()
        return list(read_sqlite(d))

    return back(SQLiteSink) == [name] and back(NameCutAt249Sink) != [name]


def demo_splitlines_samples() -> bool:
    """A completion holding U+2028: the table reads back whole from the base, not here."""
    from tests.independent.sinks_capabilities import read_binned_samples

    rows = [("p", "line\u2028sep", 1.0), ("q", "r", 0.5)]

    def back(cls: type[BinnedFileSink], reader: Callable[[Path], Tables]) -> Any:
        d = _tmp()
        s = cls(d)
        s.log_samples("samples/x", rows, step=3)
        s.close()
        return reader(d)

    want = {"samples/x": [(3, rows)]}
    base = back(BinnedFileSink, read_binned_samples)
    bug = back(SplitlinesSamplesSink, read_jsonl_samples)
    return bool(base == want and bug != want)


def demo_refused_histogram_kept() -> bool:
    """A histogram holding NaN is refused by both; only the base stores nothing."""

    def back(cls: type[BinnedFileSink]) -> tuple[bool, Any]:
        d = _tmp()
        s = cls(d)
        try:
            s.log_histogram("h/x", [1.0, float("nan"), 2.0], step=0)
            refused = False
        except ValueError:
            refused = True
        s.close()
        return refused, read_binned_histograms(d)

    base, bug = back(BinnedFileSink), back(RefusedHistogramKeptSink)
    return base == (True, {}) and bug[0] and bug[1] != {}


DEMOS: dict[str, Callable[[], bool]] = {
    "int32_step": demo_int32_step,
    "flush_to_zero": demo_flush_to_zero,
    "name_cut_at_249": demo_name_cut_at_249,
    "splitlines_samples": demo_splitlines_samples,
    "refused_histogram_kept": demo_refused_histogram_kept,
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {}
