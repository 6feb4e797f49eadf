"""Exploration: Hypothesis over a requirement's input domain and over random call sequences.

A check states the domain the spec allows for each input as a strategy (boundaries as explicit
examples) and lets Hypothesis draw from all of it; a stateful check runs random sequences of a
contract's operations against an executable model of the spec. Both are deterministic under
the run's seed and grow with its depth (``--conformance-depth``). A failure is reported as the
shrunk input or the shrunk call sequence, written as a runnable program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from posttrain.conformance.context import ConformanceError, Context

T = TypeVar("T")


def hypothesis_settings(ctx: Context, examples: int, steps: int = 0) -> Any:
    """Settings for ``examples`` inputs (times ``ctx.depth``), ``steps`` calls per sequence.

    No example database and no deadline: a verdict depends on the seed alone, never on what an
    earlier run found or on the machine's speed.

    Example:
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> hypothesis_settings(Context(RING_BUFFER, depth=3), 5).max_examples
        15
    """
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=examples * ctx.depth,
        stateful_step_count=max(1, steps * (1 if ctx.depth == 1 else 2)),
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        report_multiple_bugs=False,
        print_blob=False,
    )


def _failure(e: BaseException, heading: str) -> ConformanceError:
    notes = [n for n in getattr(e, "__notes__", ()) if n.strip()]
    # A failure that replays differently (Hypothesis's FlakyFailure, an exception group: a
    # remote error's traceback differs each time) is reported by the error it first raised.
    while isinstance(getattr(e, "exceptions", None), tuple) and e.exceptions:  # type: ignore[attr-defined]
        e = e.exceptions[0]  # type: ignore[attr-defined]
        notes += [n for n in getattr(e, "__notes__", ()) if n.strip() and n not in notes]
    what = str(e) if isinstance(e, ConformanceError) else f"raised {type(e).__name__}: {e}"
    repro = "\n".join(notes)
    return ConformanceError(f"{what}\n{heading}:\n{repro}" if repro else what)


def run_machine(ctx: Context, machine: type[Any], *, examples: int, steps: int) -> None:
    """Run ``machine`` (a ``RuleBasedStateMachine``) for ``examples`` random sequences.

    A failing sequence is shrunk and raised as a :class:`ConformanceError` whose message ends
    with the sequence as a program (``state = Model(); state.extend(n=3); ...``); an exception
    the implementation raises on a sequence the spec allows is a failure too.

    Example:
        >>> from hypothesis import strategies as st
        >>> from hypothesis.stateful import RuleBasedStateMachine, rule
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> class Counter(RuleBasedStateMachine):
        ...     total = 0
        ...     @rule(n=st.integers(0, 3))
        ...     def add(self, n):
        ...         self.total += n
        >>> run_machine(Context(RING_BUFFER), Counter, examples=2, steps=3)
    """
    from hypothesis import seed
    from hypothesis.stateful import get_state_machine_test

    test = seed(ctx.seed)(
        get_state_machine_test(machine, settings=hypothesis_settings(ctx, examples, steps))
    )
    try:
        test()
    except Exception as e:  # KeyboardInterrupt and SystemExit pass through
        raise _failure(e, "shrunk call sequence (runnable)") from e


def for_all(
    ctx: Context,
    strategy: Any,
    check: Callable[[T], None],
    *,
    examples: int,
    boundaries: Sequence[T] = (),
) -> None:
    """Call ``check`` on every boundary, then on ``examples`` draws of ``strategy``.

    A failing input is shrunk and raised as a :class:`ConformanceError` naming it.

    Example:
        >>> from hypothesis import strategies as st
        >>> from posttrain.reference_impls import RING_BUFFER
        >>> seen = []
        >>> for_all(Context(RING_BUFFER), st.integers(1, 5), seen.append, examples=3,
        ...         boundaries=[1, 5])
        >>> seen[:2]
        [1, 5]
    """
    from hypothesis import example, given, seed

    draw: Any = given  # the strategy's type is the caller's; Hypothesis types it loosely

    def test(value: T) -> None:
        check(value)

    wrapped: Any = draw(strategy)(test)
    for b in reversed(boundaries):  # explicit examples run in the order written
        wrapped = example(b)(wrapped)
    wrapped = seed(ctx.seed)(hypothesis_settings(ctx, examples)(wrapped))
    try:
        wrapped()
    except Exception as e:
        raise _failure(e, "smallest failing input") from e
