"""The metrics-sink suite: one check per MET requirement (specs/metrics-v1.md).

What is logged is read back through the backend's own reader, declared by the implementation
as ``Implementation.extras["reader"](directory)``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import struct
import sys
from pathlib import Path
from typing import Any

from posttrain.conformance import explore
from posttrain.conformance._spawn import Spawned
from posttrain.conformance.context import Context
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.metrics import METRIC_NAME_MAX, NextStep

Scalars = dict[str, list[tuple[int, float]]]


def _read(ctx: Context, directory: Path) -> Scalars:
    reader = ctx.impl.extras.get("reader")
    if not callable(reader):
        raise _fail(
            "the implementation declares no reader: set Implementation.extras['reader'] to read(directory)"
        )
    got = reader(directory)
    return {str(k): [(int(s), float(v)) for s, v in vals] for k, vals in dict(got).items()}


def _finish(sink: Any) -> None:
    for name in ("close", "flush"):
        fn = getattr(sink, name, None)
        if callable(fn):
            fn()
            return


PRECISIONS = ("float32", "float64")
"""What ``Implementation.extras['precision']`` may declare: the dtype the backend stores values
in. ``float32`` (the default) allows float32 rounding; ``float64`` asks every value back exactly."""

_F32_MAX = 3.4028234663852886e38  # float32's largest finite value


def _precision(ctx: Context) -> str:
    declared = ctx.impl.extras.get("precision", "float32")
    if declared not in PRECISIONS:
        raise _fail(
            f"Implementation.extras['precision'] is {declared!r}; expected one of {PRECISIONS} "
            "(the dtype the backend stores values in)"
        )
    return str(declared)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a float32 store does: float32's subnormals are
    kept, a value below half its smallest subnormal becomes a zero of its sign."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:  # past float32's largest finite: a float32 store holds infinity
        return math.copysign(math.inf, x)


def _close(read: float, logged: float, precision: str) -> bool:
    """Whether ``read`` is ``logged`` as a store of the declared ``precision`` keeps it."""
    if math.isnan(read) or math.isnan(logged):
        return math.isnan(read) and math.isnan(logged)
    # Compared as floats of the declared dtype, never within an absolute tolerance: a
    # subnormal read back as 0.0, or a value cut to fewer digits than float32 keeps (a sink
    # writing six significant digits), is not what the caller logged. -0.0 == 0.0.
    if math.isinf(read) or math.isinf(logged):  # an infinity is itself in every precision
        return read == logged
    return read == logged or (precision == "float32" and _f32(read) == _f32(logged))


def _shown(name: str) -> str:
    # Names at METRIC_NAME_MAX would fill a message: their start and length identify them.
    return repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name)} characters)"


def _names(names: Any) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - 10} more" if len(names) > 10 else ""
    return "[" + ", ".join(_shown(n) for n in names[:10]) + more + "]"


def _log(sink: Any, name: str, value: float, step: int) -> None:
    try:
        sink.log_scalar(name, value, step=step)
    except Exception as e:
        raise _fail(
            f"log_scalar({_shown(name)}, {value!r}, step={step}) raised {type(e).__name__}: "
            f"{str(e)[:200]}; expected the point stored"
        ) from None


def _log_and_read(ctx: Context, entries: list[tuple[str, float, int]]) -> Scalars:
    with ctx.tmpdir() as d:
        sink = ctx.make(d)
        for name, value, step in entries:
            _log(sink, name, value, step)
        _finish(sink)
        return _read(ctx, d)


def _expect(got: Scalars, entries: list[tuple[str, float, int]], what: str, precision: str) -> None:
    for name, value, step in entries:
        vals = got.get(name)
        if vals is None:
            raise _fail(
                f"{what}: {_shown(name)} logged but not read back; names read back: {_names(got)}"
            )
        if not any(s == step and _close(v, value, precision) for s, v in vals):
            raise _fail(
                f"{what}: {_shown(name)} at step {step} logged as {value!r}"
                f"{_as_stored(value, precision)}, read back "
                f"{vals[:10]}{f' ... and {len(vals) - 10} more' if len(vals) > 10 else ''}"
            )


@requirement("MET-001")
def read_back_exactly(ctx: Context) -> None:
    # Plain names: slashes (MET-002) and steps out of order (MET-003) are checked apart. Two
    # values of one name at one step, logged back to back ("loss") and apart ("reward"), are
    # two points: a table keyed by (name, step), or W&B's own step= (one history row per step,
    # the last value winning), keeps one of them.
    entries = [
        ("loss", 0.125, 0),
        ("loss", 0.375, 0),
        ("reward", 1 / 3, 1),
        ("lr", -2.5e-3, 2),
        ("reward", 2 / 3, 1),
    ]
    precision = _precision(ctx)
    got = _log_and_read(ctx, entries)
    _twice_at_one_step(got, entries, precision)
    _expect(got, entries, "read back", precision)
    from hypothesis import strategies as st

    one_step = one_step_values(ctx)
    explore.for_all(
        ctx,
        st.lists(_values(precision), min_size=1, max_size=20),
        one_step,
        examples=1,
        boundaries=[list(_value_edges(precision))],
    )


def one_step_values(ctx: Context) -> Any:
    """MET-001's drawn check: values across the declared precision's range, each under a name
    of its own."""
    precision = _precision(ctx)

    def one(values: list[float]) -> None:
        entries = [(f"value_{i}", v, 7) for i, v in enumerate(values)]
        _expect(_log_and_read(ctx, entries), entries, "read back", precision)

    return one


def _as_stored(value: float, precision: str) -> str:
    """How a float32 store keeps ``value``, where that differs from it (for messages)."""
    if precision != "float32" or math.isnan(value) or _f32(value) == value:
        return ""
    return f" (float32: {_f32(value)!r}, the declared precision)"


def _twice_at_one_step(got: Scalars, entries: list[tuple[str, float, int]], precision: str) -> None:
    for name, step in (("loss", 0), ("reward", 1)):
        logged = [v for n, v, s in entries if n == name and s == step]
        vals = got.get(name, [])
        if not all(any(s == step and _close(v, w, precision) for s, v in vals) for w in logged):
            raise _fail(
                f"read back: {name!r} logged at step {step} twice, as {logged[0]!r} then "
                f"{logged[1]!r}; expected both read back, found {vals}"
            )


# ---------------------------------------------------------------------------------------------
# The executable model of a sink: an append-only log of (name, step, value) points.

_POOL = ("loss", "reward", "kl_2", "lr")  # plain names: slashes are MET-002's
# MET-007's names each in a group of its own, as in its fixed check: TorchRL's WandbLogger
# keeps one step counter per name prefix.
_NO_STEP_POOL = ("nostep_a/x", "nostep_b/x", "nostep_c/x", "nostep_d/x")
# Values across the declared precision's whole finite range (MET-001): zero of both signs,
# the largest finite values, the smallest normals, subnormals (float32's and float64's: a
# float32 store keeps float32's, and legitimately turns a value below half float32's smallest
# subnormal into 0), and mantissas longer than float32's.
_VALUE_EDGES = (
    0.0,
    -0.0,
    1.0,
    -1.0,
    _F32_MAX,
    -_F32_MAX,
    1.1754943508222875e-38,  # float32's smallest normal
    1.1754942106924411e-38,  # float32's largest subnormal
    1e-40,
    1.401298464324817e-45,  # float32's smallest subnormal
    -1e-45,
    1e-46,  # below half float32's smallest subnormal
    sys.float_info.min,  # float64's smallest normal
    1e-310,
    -5e-324,  # float64's smallest subnormal
    1 / 3,
    0.1,
    2.0**24 + 1,
)
_F64_EDGES = (sys.float_info.max, -sys.float_info.max, 2.0**53 - 1, 1e300)

_STEP_MAX = 2**63 - 1
"""The largest step the suite logs: int64, the step type of TensorBoard's ``Event.step``, of
MLflow's and W&B's steps."""

# Integer-width boundaries: int32, uint32, float64's exact integers, int64.
_STEP_EDGES = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**53 + 1, _STEP_MAX)


def _value_edges(precision: str) -> tuple[float, ...]:
    return _VALUE_EDGES + (_F64_EDGES if precision == "float64" else ())


def _catalogue_names() -> Any:
    """Names over the catalogue alphabet (MET-002): 1 to 6 segments of [a-z0-9_], each 1 to
    40 characters and starting with a letter or a digit, joined by '/'."""
    from hypothesis import strategies as st

    lead = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=1)
    rest = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", max_size=39)
    segment = st.builds(lambda a, b: a + b, lead, rest)
    return st.lists(segment, min_size=1, max_size=6).map("/".join)


def _values(precision: str) -> Any:
    """Any finite value the declared precision holds (float32's range by default)."""
    from hypothesis import strategies as st

    top = _F32_MAX if precision == "float32" else sys.float_info.max
    return st.one_of(
        st.sampled_from(_value_edges(precision)),
        st.floats(-top, top, allow_nan=False, allow_infinity=False),
    )


def _steps(top: int = _STEP_MAX) -> Any:
    """Steps 0 to ``top``: small ones, the integer-width boundaries, and any in between."""
    from hypothesis import strategies as st

    edges = [s for s in _STEP_EDGES if s <= top] + [top]
    return st.one_of(st.integers(0, 12), st.sampled_from(edges), st.integers(0, top))


class _SinkSpec:
    """What a sink must read back: every point logged so far, each once, as logged.

    ``focus`` is the requirement the comparisons speak for: ``MET-003`` (explicit steps, in any
    order, repeated, large, and bursts past any batching threshold), ``MET-005`` (the same,
    read after every ``flush()`` without closing) or ``MET-007`` (steps left out: the name's
    next step, as :class:`~posttrain.contracts.metrics.NextStep` keeps it).
    """

    def __init__(self, ctx: Context, focus: str) -> None:
        self.ctx, self.focus = ctx, focus
        self.stack = contextlib.ExitStack()
        self.dir = self.stack.enter_context(ctx.tmpdir())
        self.sink = ctx.make(self.dir)
        self.precision = _precision(ctx)
        self.points: list[tuple[str, float, int]] = []
        self.steps = NextStep()
        self.calls: list[str] = []
        self.closed = False
        self.bursts = 0

    def log(self, name: str, value: float, step: int | None) -> None:
        want = self.steps(name, step)
        shown = f"sink.log_scalar({name!r}, {value!r}" + ("" if step is None else f", step={step}")
        self.calls.append(shown + ")")
        try:
            if step is None:
                self.sink.log_scalar(name, value)
            else:
                self.sink.log_scalar(name, value, step=step)
        except Exception as e:
            raise _fail(
                f"{shown}) raised {type(e).__name__}: {str(e)[:200]}; expected the point "
                f"stored (after {self._history(len(self.calls) - 1)})"
            ) from None
        self.points.append((name, value, want))

    def burst(self, name: str, n: int, first: int) -> None:
        """``n`` points of one name at consecutive steps: past a writer's batch or queue size."""
        self.bursts += 1
        self.calls.append(
            f"for s in range({first}, {first + n}): sink.log_scalar({name!r}, s / 7, step=s)"
        )
        for s in range(first, first + n):
            _log(self.sink, name, s / 7, s)
            self.points.append((name, s / 7, s))
        self.steps(name, first + n - 1)

    def flush(self) -> None:
        self.calls.append("sink.flush()")
        self.sink.flush()
        self.compare("after flush(), before close")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            _finish(self.sink)
        finally:
            self.stack.close()

    def close_and_compare(self) -> None:
        self.calls.append("sink.close()")
        try:
            _finish(self.sink)
            self.compare("after close")
        finally:
            self.closed = True
            self.stack.close()

    def compare(self, when: str) -> None:
        got = _read(self.ctx, self.dir)
        for name in dict.fromkeys(n for n, _v, _s in self.points):
            logged = [(s, v) for n, v, s in self.points if n == name]
            found = got.get(name, [])
            by_step: dict[int, list[float]] = {}
            for s, v in found:
                by_step.setdefault(s, []).append(v)
            missing = []
            for step, value in logged:  # each read-back point pairs with one logged point
                left = by_step.get(step, [])
                i = next((i for i, v in enumerate(left) if _close(v, value, self.precision)), None)
                if i is None:
                    missing.append((step, value))
                else:
                    left.pop(i)
            if missing:
                step, value = missing[0]
                what = {
                    "MET-003": "values logged for one name at different steps must all be kept, each with its step",
                    "MET-005": "after flush(), everything logged so far must be readable",
                    "MET-007": "a value without a step goes one past the name's highest step",
                }[self.focus]
                raise _fail(
                    f"{when}, {what}: {_shown(name)} logged {len(logged)} times, "
                    f"{value!r} at step {step} not read back (found {len(found)} points: "
                    f"{sorted(found)[:8]}{' ...' if len(found) > 8 else ''}); calls: "
                    f"{self._history(len(self.calls))}"
                )

    def _history(self, n: int) -> str:
        calls = self.calls[:n]
        if not calls:
            return "none"
        more = f" ({len(calls)} calls)" if len(calls) > 10 else ""
        return "[" + "; ".join(calls[-10:]) + "]" + more


def _sink_machine(ctx: Context, focus: str) -> type[Any]:
    """Random log/flush sequences on a new sink each, read back after every flush (MET-005)
    and once closed, against :class:`_SinkSpec`."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    no_step = focus == "MET-007"
    precision = _precision(ctx)
    # Without a step a name's next one is one past its highest: drawn steps leave room for
    # the sequence's steps left out, all within int64.
    top = 2**62 if no_step else _STEP_MAX

    class SinkMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.spec = _SinkSpec(ctx, focus)

        @rule(
            name=st.sampled_from(_NO_STEP_POOL if no_step else _POOL),
            value=_values(precision),
            step=st.one_of(st.none(), _steps(top)) if no_step else _steps(top),
        )
        def log(self, name: str, value: float, step: int | None) -> None:
            self._do(self.spec.log, name, value, step)

        # Once per sequence (a backend that writes each point in its own transaction takes
        # seconds for one), and named after "log" so that shrinking prefers single points.
        @precondition(lambda self: focus == "MET-003" and not self.spec.bursts)
        @rule(name=st.sampled_from(_POOL), n=st.sampled_from((257, 600)), first=_steps(top - 600))
        def volume(self, name: str, n: int, first: int) -> None:
            self._do(self.spec.burst, name, n, first)

        @precondition(lambda self: focus == "MET-005")
        @rule()
        def flush(self) -> None:
            self._do(self.spec.flush)

        def _do(self, step: Any, *args: Any) -> None:
            try:
                step(*args)
            except BaseException:
                self.spec.close()  # the step's failure is the one reported
                raise

        def teardown(self) -> None:
            if not self.spec.closed:
                self.spec.close_and_compare()

    SinkMachine.__name__ = f"SinkMachine_{focus.replace('-', '')}"
    return SinkMachine


def _at_bound(segment: str) -> str:
    """A catalogue-form name of exactly METRIC_NAME_MAX characters: ``segment`` repeated
    between slashes, then a last segment of ``z`` that makes up the length."""
    name = segment
    while len(name) + 1 + len(segment) <= METRIC_NAME_MAX - 2:
        name = f"{name}/{segment}"
    return f"{name}/{'z' * (METRIC_NAME_MAX - len(name) - 1)}"


# The longest names MET-002 promises, in the catalogue's alphabet ([a-z0-9_], '/'): many short
# segments (about 380 bytes once '/' is escaped into one file name), one segment alone (a
# 254-byte "<name>.csv") and a catalogue group over one long leaf.
LONG_NAMES = (
    _at_bound("g_0"),
    ("metric" + "_x" * METRIC_NAME_MAX)[:METRIC_NAME_MAX],
    ("policy/kl_ref/k3" + "_x" * METRIC_NAME_MAX)[:METRIC_NAME_MAX],
)


@requirement("MET-002")
def catalogue_names(ctx: Context) -> None:
    names = [
        "policy/kl_ref/k3",
        "time/weight_sync_s",
        "perf/gen_tokens_per_s",
        "buffer/utilization",
        "step",
        *LONG_NAMES,
    ]
    precision = _precision(ctx)
    entries = [(n, float(i) + 0.5, 7) for i, n in enumerate(names)]
    _expect(_log_and_read(ctx, entries), entries, "catalogue names", precision)
    from hypothesis import strategies as st

    def one(drawn: list[str]) -> None:
        entries = [(n, float(i) + 0.25, 3) for i, n in enumerate(drawn)]
        _expect(_log_and_read(ctx, entries), entries, f"catalogue names {_names(drawn)}", precision)

    explore.for_all(
        ctx, st.lists(_catalogue_names(), min_size=1, max_size=12, unique=True), one, examples=1
    )


# Steps 5 and 3 come after 10: W&B's own step= drops a step lower than the run's last one.
_STEPS = [(0, 0.5), (1, 0.25), (2, 0.75), (10, 1.0), (5, 1.5), (3, 2.5)]

# Every integer-width boundary, on one name beside the steps above, in an order where a step
# cut to 32 bits (2**32 -> 0, 2**31 -> -2**31) or held in a float64 (2**53 + 1 -> 2**53) meets
# a step already logged.
_WIDE_STEPS = [(s, 0.5 + i) for i, s in enumerate(
    (2**31, 0, 2**32, 2**31 - 1, _STEP_MAX, 2**53 + 1, 2**53, 2**32 - 1, 1)
)]  # fmt: skip

_BURST = 1100
"""Points of one name MET-003 logs in a row: past batches of 256, 512 and 1000."""


def _unpaired(
    logged: list[tuple[int, float]], found: list[tuple[int, float]], precision: str
) -> list[tuple[int, float]]:
    """The logged (step, value) points left once each is paired with a read-back point of its
    own: two logged points never match one read-back point."""
    return _unmatched(logged, found, lambda w, f: f[0] == w[0] and _close(f[1], w[1], precision))


@requirement("MET-003")
def steps_kept_apart(ctx: Context) -> None:
    precision = _precision(ctx)
    name, wide = "rollout/reward/mean", "rollout/wide_steps"
    entries = [(name, v, s) for s, v in _STEPS] + [(wide, v, s) for s, v in _WIDE_STEPS]
    got = _log_and_read(ctx, entries)
    found = got.get(wide, [])
    missing = _unpaired(_WIDE_STEPS, found, precision)
    if missing or len(found) != len(_WIDE_STEPS):
        step, value = missing[0] if missing else (None, None)
        gone = (
            f"{value!r} at step {step} not read back"
            if missing
            else f"{len(found)} points read back for {len(_WIDE_STEPS)} logged"
        )
        raise _fail(
            "values logged for one name at different steps must all be kept, each with its "
            f"step: {wide!r} logged at steps {[s for s, _v in _WIDE_STEPS]} (integer-width "
            f"boundaries up to 2**63 - 1) in that order, {gone}; found {len(found)} points: "
            f"{sorted(found)}"
        )
    vals = got.get(name, [])
    for i, (step, value) in enumerate(_STEPS):
        if not any(s == step and _close(v, value, precision) for s, v in vals):
            before = [s for s, _v in _STEPS[:i]]
            order = " (lower than one logged before it)" if before and step < max(before) else ""
            raise _fail(
                f"{name!r} logged at steps {[s for s, _v in _STEPS]} in that order: {value!r} "
                f"at step {step}{order} not read back, found {vals}"
            )
    if len(vals) != len(_STEPS):
        raise _fail(f"one name logged at {len(_STEPS)} steps reads back {len(vals)} values")
    # Past any batching or flushing threshold, whatever the random sequences below draw.
    burst = [(name, float(s) / 7.0, s) for s in range(_BURST)]
    got = _log_and_read(ctx, burst)
    read = {s for s, _v in got.get(name, [])}
    lost = [s for _n, _v, s in burst if s not in read]
    if lost or len(got.get(name, [])) != _BURST:
        raise _fail(
            f"{name!r} logged at steps 0 to {_BURST - 1}: {len(got.get(name, []))} values read "
            f"back, steps {lost[:10]}{' ...' if len(lost) > 10 else ''} missing"
        )
    explore.run_machine(ctx, _sink_machine(ctx, "MET-003"), examples=2, steps=10)


@requirement("MET-004")
def non_finite_kept(ctx: Context) -> None:
    entries = [
        ("policy/kl_ref/k3", math.nan, 0),
        ("policy/kl_ref/k3", math.inf, 2**31),
        ("policy/kl_ref/k3", -math.inf, 2**53 + 1),
    ]
    _expect(_log_and_read(ctx, entries), entries, "non-finite values", _precision(ctx))


# Several names, the first one again last: a sink with a file (or buffer) per name whose
# flush() reaches only the one written last leaves the others unreadable.
_FLUSHED = [
    ("rollout/reward/mean", 0.5, 1),
    ("loss/total", 1.25, 1),
    ("optim/lr", 3e-4, 1),
    ("rollout/reward/mean", 0.75, 2),
    ("optim/lr", 2.5e-4, 2**31),
    ("loss/total", 1.5, _STEP_MAX),
]


@requirement("MET-005")
def flush_makes_readable(ctx: Context) -> None:
    with ctx.tmpdir() as d:
        sink = ctx.make(d)
        for name, value, step in _FLUSHED:
            _log(sink, name, value, step)
        sink.flush()
        got = _read(ctx, d)
        _expect(got, _FLUSHED, "after flush(), before close", _precision(ctx))
        _finish(sink)
    explore.run_machine(ctx, _sink_machine(ctx, "MET-005"), examples=1, steps=10)


_SHARED_BASE = 2**32  # the shared name's steps start past 32 bits


def _child(factory: Any, directory: str, k: int) -> None:
    sink = factory(Path(directory))
    for step in range(3):
        sink.log_scalar(f"worker/w{k}", float(step + 10 * k), step=step)
        sink.log_scalar(
            "worker/all", float(step + 10 * k), step=_SHARED_BASE + step + 10 * k
        )  # one name, both writers
    _finish(sink)


@requirement("MET-006")
def several_writers(ctx: Context) -> None:
    with ctx.tmpdir() as d:
        # The writers' deadline follows how slowly they started: a busy machine is no failure.
        procs = Spawned(_child, [(ctx.impl.factory, str(d), k) for k in range(2)])
        try:
            codes = procs.join(base_s=120.0)
        except TimeoutError as e:
            raise _fail(str(e)) from None
        for code in codes:
            if code is None:
                raise _fail(
                    f"a writer process still ran {procs.deadline_s(120.0):.0f} s after it started "
                    "(logging three steps)"
                )
            if code != 0:
                raise _fail(f"a writer process exited with {code}")
        got = _read(ctx, d)
    entries = [(f"worker/w{k}", float(s + 10 * k), s) for k in range(2) for s in range(3)]
    entries += [
        ("worker/all", float(s + 10 * k), _SHARED_BASE + s + 10 * k)
        for k in range(2)
        for s in range(3)
    ]
    _expect(got, entries, "two processes logging into one run", _precision(ctx))


# Each name in its own group: TorchRL's WandbLogger keeps one step column per name prefix.
_NO_STEP: list[tuple[str, float, int | None, int]] = [
    # (name, value, step given, step expected)
    ("nostep_a/x", 0.5, None, 0),
    ("nostep_a/x", 1.5, None, 1),
    ("nostep_a/x", 2.5, None, 2),
    ("nostep_b/x", 0.25, 0, 0),
    ("nostep_b/x", 0.75, 1, 1),
    ("nostep_b/x", 1.25, None, 2),
    ("nostep_c/x", 3.5, 5, 5),
    ("nostep_c/x", 4.5, None, 6),
    # A step lower than the name's highest, then none: one past the highest, not the last.
    ("nostep_d/x", 5.5, 5, 5),
    ("nostep_d/x", 6.5, 2, 2),
    ("nostep_d/x", 7.5, None, 6),
    # Past integer widths: a counter of 32 bits wraps, one held in a float64 stays at 2**53.
    ("nostep_e/x", 8.5, 2**31 - 1, 2**31 - 1),
    ("nostep_e/x", 9.5, None, 2**31),
    ("nostep_f/x", 10.5, 2**32 - 1, 2**32 - 1),
    ("nostep_f/x", 11.5, None, 2**32),
    ("nostep_g/x", 12.5, 2**53, 2**53),
    ("nostep_g/x", 13.5, None, 2**53 + 1),
    ("nostep_h/x", 14.5, _STEP_MAX - 1, _STEP_MAX - 1),
    ("nostep_h/x", 15.5, None, _STEP_MAX),
]


@requirement("MET-007")
def no_step_is_the_next_step(ctx: Context) -> None:
    with ctx.tmpdir() as d:
        sink = ctx.make(d)
        for name, value, step, _want in _NO_STEP:
            try:
                if step is None:
                    sink.log_scalar(name, value)
                else:
                    sink.log_scalar(name, value, step=step)
            except Exception as e:
                raise _fail(
                    f"log_scalar({name!r}, {value}{'' if step is None else f', step={step}'}) "
                    f"raised {type(e).__name__}: {str(e)[:200]}; expected a value without a step "
                    "recorded at the name's next step"
                ) from None
        _finish(sink)
        got = _read(ctx, d)
    precision = _precision(ctx)
    for name, value, step, want in _NO_STEP:
        vals = got.get(name, [])
        if not any(s == want and _close(v, value, precision) for s, v in vals):
            given = "without a step" if step is None else f"at step {step}"
            raise _fail(
                f"{name!r}: {value} logged {given} after steps "
                f"{[w for n, _v, _s, w in _NO_STEP if n == name and w < want]}, expected at step "
                f"{want}, read back {vals}"
            )
    explore.run_machine(ctx, _sink_machine(ctx, "MET-007"), examples=1, steps=10)


def _extra_reader(ctx: Context, key: str, capability: str) -> Any:
    reader = ctx.impl.extras.get(key)
    if not callable(reader):
        raise _fail(
            f"the implementation declares {capability!r} but no reader: set "
            f"Implementation.extras[{key!r}] to read(directory)"
        )
    return reader


# (name, values, step): steps out of order, a constant sample (NumPy's autodetected range puts
# a single value v in [v - 0.5, v + 0.5]), a single value, negatives and a wide sample whose
# extremes a fixed or clipped bucket range would move. Two calls of "rollout/reward" at step 3
# are two distributions: a store keyed by (name, step) keeps one of them.
_HISTOGRAMS: list[tuple[str, list[float], int]] = [
    ("rollout/response_len", [float(n) for n in (3, 17, 17, 64, 5, 9, 9, 9)], 4),
    ("rollout/response_len", [12.0] * 6, 2),
    ("rollout/reward", [0.25], 3),
    ("rollout/advantage", [-1.5 + 0.03 * i for i in range(100)] + [1e6, -2e5], 3),
    ("rollout/reward", [-1.0, 0.5, 2.0], 3),
    # Passed as a [3, 4] tensor (per-token values of 3 sequences): 12 values, not 3.
    ("rollout/token_log_prob", [-0.5 - 0.25 * i for i in range(12)], 6),
    # float32's range at integer-width steps: subnormals (a bucket range of 2e-40), and its
    # largest values of both signs (a range wider than float32's largest value).
    ("rollout/kl", [1e-40, 3e-40, -1e-45], 2**31),
    ("rollout/kl", [_F32_MAX, -_F32_MAX, 0.0], _STEP_MAX),
]
_AS_MATRIX = {"rollout/token_log_prob": (3, 4)}  # names whose values go as a 2-D tensor


def _tensor(values: list[float], shape: tuple[int, int]) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.float64).reshape(shape)


def _unmatched(wanted: list[Any], found: list[Any], same: Any) -> list[Any]:
    """The ``wanted`` items left once each is paired with its own ``found`` item (``same``):
    two calls must read back as two entries, not one entry matching both."""
    left = list(found)
    missing = []
    for w in wanted:
        i = next((i for i, f in enumerate(left) if same(w, f)), None)
        if i is None:
            missing.append(w)
        else:
            left.pop(i)
    return missing


@requirement("MET-008")
def distributions(ctx: Context) -> None:
    reader = _extra_reader(ctx, "histogram_reader", "histogram")
    precision = _precision(ctx)
    with ctx.tmpdir() as d:
        sink = ctx.make(d)
        for name, values, step in _HISTOGRAMS:
            shape = _AS_MATRIX.get(name)
            try:
                if shape is None:
                    sink.log_histogram(name, list(values), step=step)
                else:
                    sink.log_histogram(name, _tensor(values, shape), step=step)
            except Exception as e:
                raise _fail(
                    f"log_histogram({name!r}, <{len(values)} values>, step={step}) raised "
                    f"{type(e).__name__}: {str(e)[:200]}; expected the distribution stored"
                ) from None
        refused = None
        try:
            sink.log_histogram("rollout/reward", [0.5, math.nan, 1.0], step=5)
        except ValueError as e:
            refused = e
        except Exception as e:
            raise _fail(
                f"log_histogram('rollout/reward', [0.5, nan, 1.0], step=5) raised "
                f"{type(e).__name__}, expected ValueError"
            ) from None
        _finish(sink)
        got = dict(reader(d))
    if refused is None:
        raise _fail(
            "log_histogram('rollout/reward', [0.5, nan, 1.0], step=5) was accepted; expected "
            "ValueError (a NaN is neither a bin nor a value to drop silently)"
        )
    for name, step in dict.fromkeys((n, s) for n, _v, s in _HISTOGRAMS):
        logged = [v for n, v, s in _HISTOGRAMS if (n, s) == (name, step)]
        wanted = [(len(v), min(v), max(v)) for v in logged]
        found = [(s, h) for s, h in got.get(name, []) if s == step]
        summary = [(int(h["count"]), float(h["min"]), float(h["max"])) for _s, h in found]
        missing = _unmatched(
            wanted,
            summary,
            lambda w, f: (
                f[0] == w[0] and _close(f[1], w[1], precision) and _close(f[2], w[2], precision)
            ),
        )
        if missing or len(found) != len(logged):
            calls = "one call" if len(logged) == 1 else f"{len(logged)} calls"
            raise _fail(
                f"log_histogram({name!r}, ..., step={step}), {calls}: expected (count, min, "
                f"max) = {wanted} at step {step}, one per call; read back "
                f"{summary or 'nothing at that step'}"
            )
    if any(s == 5 for s, _h in got.get("rollout/reward", [])):
        raise _fail("a refused distribution (NaN among its values) was stored at step 5")


_LONG_TEXT = "".join(f"line {i}: {'é' if i % 7 else '字'} " + "\n" * (i % 3) for i in range(1200))[
    :20_000
]
_TABLES: list[tuple[str, list[tuple[str, str, float]], int]] = [
    (
        "samples",
        [
            ("What is 2+2?\n", " 4", 1.0),
            ("  leading and trailing  ", "\n\nline\r\nbreaks\t ", -0.5),
            ("", "", math.nan),
            ("naïve → ünïcødé 字", "emoji 🙂 and \u2028 separators", 0.125),
            # Decomposed (NFD) and composed (NFC) forms of one word are different texts.
            ("cafe\u0301 and caf\u00e9", "a\u0308 n\u0303 \u212b \ufb01", 0.75),
            ("long", _LONG_TEXT, 2.0),
        ],
        3,
    ),
    ("samples", [("second step", "kept too", 0.0)], 1),
    ("samples", [("second call", "same step", -2.0), ("", "also kept", 0.5)], 1),
    ("samples/eval", [("other table", "same step", 3.5)], 3),
    # Rewards across float32's range, at a step past float64's exact integers.
    (
        "samples/eval",
        [("wide", "rewards", 1 / 3), ("", "", 1e-40), ("", "", -_F32_MAX), ("", "", 1e-310)],
        2**53 + 1,
    ),
]


def _same_row(a: tuple[str, str, float], b: tuple[str, str, float], precision: str) -> bool:
    return a[0] == b[0] and a[1] == b[1] and _close(float(b[2]), float(a[2]), precision)


def _row_shown(row: Any) -> str:
    return repr(tuple(x[:40] + "..." if isinstance(x, str) and len(x) > 40 else x for x in row))


def _text_diff(want: tuple[str, str, float], found: tuple[str, str, float]) -> str:
    for col, a, b in (("prompt", want[0], found[0]), ("completion", want[1], found[1])):
        if a != b:
            at = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            return f" ({col}: {len(a)} characters logged, {len(b)} read back, first difference at {at})"
    return ""


@requirement("MET-009")
def completion_samples(ctx: Context) -> None:
    reader = _extra_reader(ctx, "samples_reader", "samples")
    precision = _precision(ctx)
    with ctx.tmpdir() as d:
        sink = ctx.make(d)
        for name, rows, step in _TABLES:
            try:
                sink.log_samples(name, [list(r) for r in rows], step=step)
            except Exception as e:
                raise _fail(
                    f"log_samples({name!r}, <{len(rows)} rows>, step={step}) raised "
                    f"{type(e).__name__}: {str(e)[:200]}; expected the table stored"
                ) from None
        _finish(sink)
        got = dict(reader(d))
    for name, step in dict.fromkeys((n, s) for n, _r, s in _TABLES):
        logged = [r for n, r, s in _TABLES if (n, s) == (name, step)]
        tables = [list(t) for s, t in got.get(name, []) if s == step]
        for table in tables:
            for row in table:
                _check_reward(name, step, row)
        if len(tables) != len(logged):
            calls = "one call" if len(logged) == 1 else f"{len(logged)} calls"
            raise _fail(
                f"log_samples({name!r}, step={step}), {calls}: expected {len(logged)} "
                f"table(s) at step {step}, one per call, read back {len(tables)} (steps read "
                f"back for {name!r}: {sorted(s for s, _t in got.get(name, []))})"
            )
        if len(logged) > 1:
            missing = _unmatched(
                logged,
                tables,
                lambda w, f: (
                    len(w) == len(f)
                    and all(_same_row(a, b, precision) for a, b in zip(w, f, strict=True))
                ),
            )
            if missing:
                raise _fail(
                    f"log_samples({name!r}, step={step}), {len(logged)} calls: the table "
                    f"whose first row is {_row_shown(missing[0][0])} is not read back at step "
                    f"{step}; first rows read back: {[_row_shown(t[0]) for t in tables if t]}"
                )
            continue
        ((rows,), (table,)) = (logged, tables)
        if len(table) != len(rows):
            raise _fail(
                f"log_samples({name!r}, step={step}) with {len(rows)} rows reads back {len(table)}"
            )
        for i, (want, found) in enumerate(zip(rows, table, strict=True)):
            if not _same_row(want, found, precision):
                raise _fail(
                    f"log_samples({name!r}, step={step}): row {i} logged as {_row_shown(want)}, "
                    f"read back {_row_shown(found)}{_text_diff(want, found)}"
                )


def _check_reward(name: str, step: int, row: Any) -> None:
    # A reward is a number as logged: None (NaN written as JSON null) or the stored text
    # ('1.0', 'nan') is not what the caller logged, even where float() would accept it.
    reward = row[2]
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise _fail(
            f"log_samples({name!r}, step={step}): expected each reward read back as a real "
            f"number (NaN kept), found {reward!r} ({type(reward).__name__}) in row "
            f"{_row_shown(row)}"
        )
