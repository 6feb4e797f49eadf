"""Contract ``metrics`` v1: a sink for scalar metrics (TorchRL's ``Logger.log_scalar``), and
optionally for distributions (``log_histogram``) and completion samples (``log_samples``)."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from posttrain._args import as_count
from posttrain.contracts.contract import Capability, Contract
from posttrain.contracts.requirements import Level, Requirement

METRIC_NAME = re.compile(r"^[a-z0-9_]+(/[a-z0-9_]+)*$")
"""Metric names: lowercase path segments, e.g. ``policy/kl_ref/k3``."""

METRIC_NAME_MAX = 250
"""The longest name MET-002 promises to store: MLflow's limit for a metric key.

MLflow refuses a longer key (``MAX_ENTITY_KEY_LENGTH``, ``mlflow/utils/validation.py``); 250
also keeps a per-metric file ``<segment>.csv`` within the usual 255-byte file-name limit.

Example:
    >>> len("policy/kl_ref/k3") <= METRIC_NAME_MAX
    True
"""


class NextStep:
    """One sink's steps: ``step=None`` is the name's next step, one past the highest so far.

    What MET-007 asks of ``log_scalar(name, value)`` without a step (TorchRL's ``WandbLogger``
    rule, per name): 0 for a name's first value, after steps 0 and 1 it is 2, after step 5 it
    is 6. Explicit steps are recorded too, so a later ``None`` follows them. Thread-safe.

    Example:
        >>> steps = NextStep()
        >>> steps("loss", None), steps("loss", None), steps("loss", 5), steps("loss", None)
        (0, 1, 5, 6)
        >>> steps("kl", None), steps("loss", 2), steps("loss", None)
        (0, 2, 7)
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, step: int | None) -> int:
        """The step to record ``name``'s value at: ``step``, or the next one when None."""
        with self._lock:
            last = self._last.get(name, -1)
            s = last + 1 if step is None else step
            self._last[name] = max(last, s)
            return s


def metric_point(
    name: str, value: Any, step: Any = None, *, steps: NextStep | None = None
) -> tuple[str, float, int]:
    """A ``log_scalar`` call's arguments checked: ``(name, float value, int step >= 0)``.

    ``value`` is anything with one real number (a float, an int, a one-element tensor);
    ``step`` an integer, or None for the sink's next step for ``name`` (MET-007), which
    ``steps`` (the sink's :class:`NextStep`) keeps; without ``steps`` a None step is refused
    rather than put at 0. A float step is refused rather than rounded: MET-001 reads back the
    step that was logged. Nothing is recorded in ``steps`` for a refused call.

    Example:
        >>> import torch
        >>> metric_point("loss/total", torch.tensor(0.5), step=3)
        ('loss/total', 0.5, 3)
        >>> steps = NextStep()
        >>> metric_point("loss/total", 0.5, steps=steps), metric_point("loss/total", 0.25, steps=steps)
        (('loss/total', 0.5, 0), ('loss/total', 0.25, 1))
        >>> metric_point("loss/total", 0.5, step=2.7)
        Traceback (most recent call last):
        ...
        ValueError: metric 'loss/total': step expected an int >= 0 or None, found 2.7
    """
    if not isinstance(name, str):
        raise ValueError(f"metric name: expected a str, found {type(name).__name__}")
    s = None if step is None else as_count(step)
    if step is not None and s is None:
        raise ValueError(f"metric {name!r}: step expected an int >= 0 or None, found {step!r}")
    try:
        if isinstance(value, str | bytes | complex):  # float("nan") would turn text into a value
            raise TypeError(type(value).__name__)
        v = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        # Built here only: the repr of a tensor costs ~60 us, on every call were it eager.
        raise ValueError(
            f"metric {name!r}: value expected one real number, found {value!r:.80}"
        ) from e
    if steps is not None:
        return name, v, steps(name, s)
    if s is None:
        raise ValueError(
            f"metric {name!r}: step None means the sink's next step for it, and no step "
            "counter was given (metric_point(..., steps=NextStep()))"
        )
    return name, v, s


def histogram_values(name: str, values: Any) -> list[float]:
    """``log_histogram``'s values checked: a non-empty flat list of finite floats.

    Accepts a sequence of numbers, a tensor or an array of any shape (flattened). A NaN or an
    infinity is refused rather than binned or dropped (MET-008): no backend bins it faithfully
    (NumPy's autodetected range raises, TensorBoard's counts go wrong), and dropping it would
    change the count the reader sees. Filter what is not a value first
    (``posttrain.observability.distributions`` does, for NaN rewards).

    Example:
        >>> histogram_values("rollout/reward", [1, 0.5])
        [1.0, 0.5]
        >>> histogram_values("rollout/reward", [1.0, float("nan")])
        Traceback (most recent call last):
        ...
        ValueError: histogram 'rollout/reward': expected finite values, found 1 non-finite of 2 (nan)
    """
    if not isinstance(name, str) or not METRIC_NAME.match(name):
        raise ValueError(
            f"histogram name: expected a match of {METRIC_NAME.pattern}, found {name!r}"
        )
    flat = values.reshape(-1).tolist() if hasattr(values, "reshape") else list(values)
    try:
        out = [float(v) for v in flat]
    except (TypeError, ValueError) as e:
        raise ValueError(f"histogram {name!r}: expected numbers, found {flat[:5]!r:.80}") from e
    if not out:
        raise ValueError(f"histogram {name!r}: expected at least one value, found none")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(
            f"histogram {name!r}: expected finite values, found {len(bad)} non-finite of "
            f"{len(out)} ({', '.join(map(repr, bad[:3]))})"
        )
    return out


SAMPLE_COLUMNS = ("prompt", "completion", "reward")
"""The columns of a completion sample table, in order."""


def sample_rows(name: str, rows: Any) -> list[tuple[str, str, float]]:
    """``log_samples``'s rows checked: ``(prompt, completion, reward)`` triples.

    A row is a mapping with keys :data:`SAMPLE_COLUMNS` or a 3-sequence; texts must be ``str``
    (kept exactly: newlines, spaces, non-ASCII), the reward one real number (NaN kept).

    Example:
        >>> sample_rows("samples", [{"prompt": "2+2=", "completion": " 4", "reward": 1}])
        [('2+2=', ' 4', 1.0)]
        >>> sample_rows("samples", [("2+2=", 4, 1.0)])
        Traceback (most recent call last):
        ...
        ValueError: samples 'samples': row 0 expected (prompt: str, completion: str, reward: number), found ('2+2=', 4, 1.0)
    """
    if not isinstance(name, str) or not METRIC_NAME.match(name):
        raise ValueError(f"samples name: expected a match of {METRIC_NAME.pattern}, found {name!r}")
    out = []
    for i, row in enumerate(rows):
        cells = tuple(row[c] for c in SAMPLE_COLUMNS) if isinstance(row, Mapping) else row
        ok = (
            isinstance(cells, Sequence)
            and len(cells) == 3
            and isinstance(cells[0], str)
            and isinstance(cells[1], str)
            and not isinstance(cells[2], str | bytes | bool)
        )
        try:
            reward = float(cells[2]) if ok else math.nan
        except (TypeError, ValueError, RuntimeError):
            ok = False
        if not ok:
            raise ValueError(
                f"samples {name!r}: row {i} expected (prompt: str, completion: str, reward: "
                f"number), found {row!r:.200}"
            )
        out.append((cells[0], cells[1], reward))
    return out


class HistogramSinkV1(Protocol):
    """The ``histogram`` capability: a sink that also stores distributions.

    Example:
        >>> def log_lengths(sink: HistogramSinkV1, step: int, lengths: list[int]) -> None:
        ...     sink.log_histogram("rollout/response_len", lengths, step=step)
    """

    def log_histogram(self, name: str, values: Any, step: int) -> Any:
        """Record the distribution of ``values`` (finite numbers) for ``name`` at ``step``."""
        ...


class SampleSinkV1(Protocol):
    """The ``samples`` capability: a sink that also stores completion sample tables.

    Example:
        >>> def log_table(sink: SampleSinkV1, step: int) -> None:
        ...     sink.log_samples("samples", [("2+2=", " 4", 1.0)], step=step)
    """

    def log_samples(self, name: str, rows: Any, step: int) -> Any:
        """Record ``rows`` of ``(prompt, completion, reward)`` as ``name``'s table at ``step``."""
        ...


class MetricSinkV1(Protocol):
    """Where metrics go. TorchRL's loggers (``CSVLogger``, ``TensorboardLogger``) conform.

    Example:
        >>> def log_step(sink: MetricSinkV1, step: int, reward: float) -> None:
        ...     sink.log_scalar("rollout/reward/mean", reward, step=step)
    """

    def log_scalar(self, name: str, value: float, step: int | None = None) -> Any:
        """Record ``value`` for ``name`` at ``step`` (None: the sink's next step for ``name``)."""
        ...


_M, _S = Level.MUST, Level.SHOULD

METRICS = Contract(
    id="metrics",
    title="Metric sink",
    purpose=(
        "Receives scalar metrics named after the observability catalogue and stores them in a "
        "real backend (CSV, TensorBoard, MLflow, W&B, JSONL), from which they read back unchanged. "
        "Names outside the catalogue's alphabet (MET-002: `^[a-z0-9_]+(/[a-z0-9_]+)*$`, up to "
        "250 characters), such as upper case, '-', '.', spaces, empty segments or longer "
        "names, are out of scope of v1: a sink may store, rewrite or refuse them, and the "
        "suite logs none. Also out of scope: a sink made again on a directory a closed sink "
        "wrote (reopening a run); several processes writing one run is the `cross_process` "
        "capability. Steps are integers from 0 to 2**63 - 1 (int64: the step type of "
        "TensorBoard's events, of MLflow and of W&B). Storage precision: "
        "`Implementation.extras['precision']` names the dtype the backend stores values in, "
        "`'float32'` (the default when nothing is declared; TensorBoard's scalars) or "
        "`'float64'` (text, JSON, SQLite, MLflow, W&B). It decides what every check compares, "
        "with no other tolerance: a float32 store reads back each value's float32 rounding "
        "(to nearest: float32's subnormals kept, a value below half its smallest subnormal "
        "becomes 0, float32's range only is logged), a float64 store the value itself (any "
        "finite float64 is logged). -0.0 may read back as 0.0."
    ),
    protocol=MetricSinkV1,
    version="1.5",
    factory=(
        "factory(directory: pathlib.Path) -> MetricSinkV1  # and Implementation.extras['reader']"
        "(directory) -> {name: [(step, value), ...]}, reading through the backend's own reader"
    ),
    capabilities=(
        Capability(name="flush", text="`flush()` makes everything logged so far readable by the backend's own reader.", methods=("flush",),
            undeclared="No `flush()` is called: everything logged is read back once the sink is closed (its `close()`, else its `flush()`, else nothing), in MET-003's random sequences as in every other check; MET-005 does not apply."),
        Capability(name="cross_process", text="Several processes may log into one run.",
            undeclared="Every value is logged from the suite's own process, through one sink per run; MET-006 does not apply."),
        Capability(name="histogram", text="`log_histogram(name, values, step)` stores a distribution (TensorBoard histograms, `wandb.Histogram`); read back with `Implementation.extras['histogram_reader'](directory) -> {name: [(step, {'count', 'min', 'max'}), ...]}`.", methods=("log_histogram",),
            undeclared="`log_histogram` is not called (a sink without the capability need not have it); MET-008 does not apply. Scalars are checked as for every sink."),
        Capability(name="samples", text="`log_samples(name, rows, step)` stores a table of (prompt, completion, reward) rows (`wandb.Table`); read back with `Implementation.extras['samples_reader'](directory) -> {name: [(step, [(prompt, completion, reward), ...]), ...]}`.", methods=("log_samples",),
            undeclared="`log_samples` is not called (a sink without the capability need not have it); MET-009 does not apply. Scalars are checked as for every sink."),
    ),
    requirements=(
        Requirement(id="MET-001", level=_M, title="read back exactly", tightened=("1.1", "1.2", "1.4", "1.5"),
            text="Every logged (name, step, value) MUST read back from the backend with the same name, step and value (float32 rounding allowed, as a float32 store rounds, where the implementation does not declare `extras['precision'] = 'float64'`); two values logged for one name at one step are two points, and both read back.",
            domain="Five points of three names at steps 0 to 2 (two values of one name at one step, back to back and apart); then sinks each given 1 to 20 values, each under a name of its own at step 7 (the steps' range is MET-003's), across the declared precision's whole finite range: 0.0, -0.0, ±1, ±3.4028234663852886e38 (float32's largest), 1.1754943508222875e-38 (float32's smallest normal) and float32's largest subnormal, 1e-40, 1.4e-45 (float32's smallest subnormal), -1e-45, 1e-46 (below half of it), 2.2250738585072014e-308 (float64's smallest normal), 1e-310, -5e-324, 1/3, 0.1, 2**24 + 1 tried first (under `float64` also ±1.7976931348623157e308, 1e300, 2**53 - 1), then any finite float of float32's range (float64's under `float64`). Each read back as its float32 rounding (the default) or exactly (`float64`): a subnormal read back as 0 in a store that holds it fails, and so does a value cut to fewer digits than the declared dtype keeps."),
        Requirement(id="MET-002", level=_M, title="catalogue names", tightened=("1.2", "1.4"),
            text="Names matching `^[a-z0-9_]+(/[a-z0-9_]+)*$` of up to 250 characters (MLflow's limit for a metric key) MUST be stored unchanged, slashes included.", depends_on=("MET-001",),
            domain="Five catalogue names and three of exactly 250 characters (many short segments, one segment alone, a group over one long leaf) on one sink; then sinks each given 1 to 12 names drawn over the alphabet: 1 to 6 segments of 1 to 40 characters of [a-z0-9_], each starting with a letter or a digit (a digit first included), joined by '/'. Names outside the alphabet are never logged (out of scope)."),
        Requirement(id="MET-003", level=_M, title="steps kept apart", tightened=("1.2", "1.4", "1.5"),
            text="Values logged for one name at different steps MUST all be kept, each with its step, in whatever order the steps come (a step lower than one already logged for the name included).", depends_on=("MET-001",),
            domain="One name at steps 0, 1, 2, 10, 5, 3 in that order, and on the same sink one name at every integer-width boundary: steps 2**31, 0, 2**32, 2**31 - 1, 2**63 - 1, 2**53 + 1, 2**53, 2**32 - 1, 1 in that order, each read back once at its own step; one name at steps 0 to 1099 in a row (past batches of 256, 512 and 1000); then random sequences on a new sink each, read back once it is closed: points of four plain names with MET-001's values at steps 0 to 12, those boundaries and any up to 2**63 - 1, in any order, repeated and lower than the name's highest, and one burst of 257 or 600 points of one name at consecutive steps (past a writer's batch or queue size). Every point read back, each once."),
        Requirement(id="MET-004", level=_S, title="non-finite values kept", tightened=("1.5",),
            text="NaN and infinite values SHOULD be stored as such rather than dropped or replaced.", depends_on=("MET-001",),
            domain="NaN, +inf and -inf of one name at steps 0, 2**31 and 2**53 + 1."),
        Requirement(id="MET-005", level=_M, title="flush", capability="flush", tightened=("1.2", "1.4", "1.5"),
            text="After `flush()`, everything logged so far, under every name, MUST be readable without closing the sink.", depends_on=("MET-001",),
            domain="Six points of three names (the first name again last; two at steps 2**31 and 2**63 - 1), flushed and read; then MET-003's random sequences with `flush()` among the calls, everything logged so far read back after each flush, before close."),
        Requirement(id="MET-006", level=_M, title="several writers", capability="cross_process", tightened=("1.5",),
            text="Metrics logged from several processes into one run MUST all read back.", depends_on=("MET-001",),
            domain="Two spawned processes, each a sink on the same directory logging three steps of a name of its own (steps 0 to 2) and of one shared name (steps past 2**32)."),
        Requirement(id="MET-007", level=_S, title="no step: the next step", since="1.1",
            text="A value logged without a step (`step=None`) SHOULD be recorded at the sink's next step for its name, one past the highest step logged for that name through the sink (0 for its first value), and read back there, not raise or fall back to step 0 (a SHOULD until v2: the 1.0 Protocol allowed `step=None` without saying what it means).", depends_on=("MET-001",), tightened=("1.4", "1.5"),
            domain="Eight names: three values without a step; two steps then none; step 5 then none; steps 5 and 2 then none (6, not 3); steps 2**31 - 1, 2**32 - 1, 2**53 and 2**63 - 2 each then none (2**31, 2**32, 2**53 + 1 and 2**63 - 1: past a 32-bit or a float64 counter). Then MET-003's random sequences over four names, each in a group of its own (`nostep_a/x` ...), with `step=None` among steps up to 2**62, each expected where `NextStep` puts it."),
        Requirement(id="MET-008", level=_M, title="distributions", capability="histogram", since="1.3",
            text="`log_histogram(name, values, step)` with finite values MUST store one distribution per call that reads back at its step with the number of values, their minimum and their maximum (float32 rounding allowed), steps in any order, a sample whose values are all equal included; a NaN or infinite value MUST be refused with ValueError rather than binned or dropped.", depends_on=("MET-001",), tightened=("1.4", "1.5"),
            domain="Lists of 1 to 102 values (all equal, one value, negatives, 1e6 beside -2e5; float32's subnormals 1e-40, 3e-40, -1e-45 at step 2**31; ±3.4028234663852886e38 beside 0 at step 2**63 - 1), two calls of one name at one step, steps in any order, and a [3, 4] tensor (12 values, not 3); then a list holding NaN. Minimum and maximum compared in the declared precision."),
        Requirement(id="MET-009", level=_M, title="completion samples", capability="samples", since="1.3",
            text="`log_samples(name, rows, step)` with rows of (prompt: str, completion: str, reward: float) MUST store one table per call that reads back at its step with every row in order, each text unchanged (newlines, leading and trailing spaces, non-ASCII, empty and 20,000-character texts) and each reward as logged (NaN kept); tables of one name at several steps are all kept.", depends_on=("MET-001",), tightened=("1.4", "1.5"),
            domain="Five tables of two names: texts with newlines (\\n, \\r\\n), tabs, leading and trailing spaces, accents, CJK, emoji, U+2028, decomposed (NFD: e + U+0301) beside composed characters, compatibility characters (U+212B, U+FB01), empty and 20,000-character texts; rewards 1.0, -0.5, NaN, 0.125, and 1/3, 1e-40, -3.4028234663852886e38, 1e-310 (compared in the declared precision) in a table at step 2**53 + 1; two tables of one name at one step."),
    ),
)  # fmt: skip
