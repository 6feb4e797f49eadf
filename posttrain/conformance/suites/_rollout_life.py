"""A rollout source's life, for ROLL-006 (declared end) and ROLL-007 (shutdown).

Two executable models of the spec, each driven by a fixed sequence and then by a Hypothesis
state machine: :class:`Budget` iterates a source with a declared total again and again (fresh
sources, updates between and inside the passes) and knows how many batches each pass may
yield; :class:`Lifecycle` holds iterators at every point of their life (taken but not started,
mid-way, run to their end, several at once), shuts the source down and knows what each must
answer afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from posttrain.conformance.context import Context
from posttrain.conformance.suites._fail import fail as _fail

PROMPTS = [[5, 6, 7], [8], [9, 10]]  # 1 to 3 of them: totals meet and miss the batch's size
PAST = 3  # batches a pass may run past its total before it is cut off (and reported)
WAIT_S = 20.0  # for an answer after shutdown(): longer is a hang


def make(ctx: Context, policy: Any, total: int | None, prompts: int) -> Any:
    """A source over the first ``prompts`` of :data:`PROMPTS`, one new token per response."""
    return ctx.make(policy, [list(p) for p in PROMPTS[:prompts]], total, max_new_tokens=1)


def answer(call: Callable[[], Any], wait_s: float = WAIT_S) -> tuple[str, BaseException | None]:
    """What ``call()`` (one ``next``) did: 'yielded', 'stopped', 'raised' or 'hung'."""
    out: list[tuple[str, BaseException | None]] = []

    def go() -> None:
        try:
            call()
            out.append(("yielded", None))
        except StopIteration:
            out.append(("stopped", None))
        except Exception as e:  # any error is an answer; which one is the source's to choose
            out.append(("raised", e))

    t = threading.Thread(target=go, daemon=True, name="rollout-life")
    t.start()
    t.join(wait_s)
    return out[0] if out else ("hung", None)


def _history(log: list[str]) -> str:
    if not log:
        return "no call"
    more = f" ({len(log)} calls)" if len(log) > 10 else ""
    return "[" + "; ".join(log[-10:]) + "]" + more


def _update(src: Any, policy: Any, log: list[str]) -> None:
    """``update_policy_weights_`` with the policy's own values; one that raises is ROLL-004's."""
    try:
        src.update_policy_weights_(policy.state_dict())
        log.append("src.update_policy_weights_(policy.state_dict())")
    except Exception as e:
        log.append(f"src.update_policy_weights_(policy.state_dict()) raised {type(e).__name__}")


class Budget:
    """ROLL-006's model: how many batches each pass over a source with total ``T`` yields.

    The first pass yields exactly ``T`` (none for 0). A later pass over the same source yields
    ``T`` again (a budget per iteration) or nothing (one budget for the source's life): the
    first later pass shows which, and every later one must agree, whatever updates came
    between. A pass is iterated to its end; an update may come after any of its batches.
    """

    def __init__(self, ctx: Context, policy: Any, total: int, prompts: int) -> None:
        self.ctx, self.policy = ctx, policy
        self.sources: list[Any] = []
        self.log: list[str] = []
        self.fresh(total, prompts)

    def fresh(self, total: int, prompts: int) -> None:
        """Shut the current source down and make a new one."""
        if self.sources:
            self.sources[-1].shutdown()
        self.total, self.prompts = total, prompts
        self.passes: list[int] = []
        self.mode: str | None = None  # 'iteration' or 'life', once a later pass shows it
        self.sources.append(make(self.ctx, self.policy, total, prompts))
        self.log.append(f"src = factory(policy, PROMPTS[:{prompts}], {total}, max_new_tokens=1)")

    @property
    def src(self) -> Any:
        return self.sources[-1]

    def update(self) -> None:
        _update(self.src, self.policy, self.log)

    def full_pass(self, update_after: int | None = None) -> None:
        """Iterate to the end (cut off ``PAST`` batches past the total), then compare."""
        n, t = 0, self.total
        inside: list[str] = []
        for _ in self.src:
            n += 1
            if n == update_after:
                _update(self.src, self.policy, inside)
            if n > t + PAST:
                break
        got = f"more than {t + PAST}" if n > t + PAST else str(n)
        during = f", {inside[0]} after batch {update_after}" if inside else ""
        self.log.append(f"list(src)  # {got} batches{during}")
        k = len(self.passes)
        self.passes.append(n)
        if k == 0:
            if n != t:
                raise _fail(
                    f"declared total {t} batches, the first iteration of the source yielded "
                    f"{got} (calls: {_history(self.log)})"
                )
            return
        allowed = {"iteration": {t}, "life": {0}, None: {t, 0}}[self.mode]
        if n not in allowed:
            said = {
                "iteration": f"an earlier one yielded {t} again: a budget per iteration",
                "life": "an earlier one yielded none: one budget for the source's life",
                None: "",
            }[self.mode]
            raise _fail(
                f"declared total {t} batches, iteration {k + 1} of the same source yielded "
                f"{got}; a later iteration yields the total again (a budget per iteration) "
                f"or none (one budget for the source's life), the same every time"
                + (f" ({said})" if said else "")
                + f" (iterations so far: {self.passes}; calls: {_history(self.log)})"
            )
        if t > 0 and self.mode is None:
            self.mode = "life" if n == 0 else "iteration"

    def close(self) -> None:
        for s in self.sources:
            s.shutdown()


def budget_sequences(ctx: Context, policy: Any) -> None:
    """ROLL-006's fixed sequences: totals 0 and 1, three passes, updates between and inside."""
    for total, prompts, steps in (
        (0, 2, ("pass", "pass")),
        (1, 1, ("pass", "update", "pass", "pass")),
        (2, 3, ("pass:1", "pass")),
    ):
        model = Budget(ctx, policy, total, prompts)
        try:
            for step in steps:
                if step == "update":
                    model.update()
                else:
                    model.full_pass(int(step[5:]) if ":" in step else None)
        finally:
            model.close()


def budget_machine(ctx: Context, policy: Any) -> type[Any]:
    """Random passes (each maybe on a fresh source, after an update, with one inside) against
    :class:`Budget`: every step iterates, so no sequence is spent on setup alone."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

    totals, sizes = st.integers(0, 2), st.integers(1, len(PROMPTS))

    class RolloutBudgetMachine(RuleBasedStateMachine):
        model: Budget

        @initialize(total=totals, prompts=sizes)
        def start(self, total: int, prompts: int) -> None:
            self.model = Budget(ctx, policy, total, prompts)

        @rule(
            update_before=st.booleans(),
            update_after=st.none() | st.integers(1, 3),
            fresh=st.none() | st.tuples(totals, sizes),
        )
        def full_pass(
            self, update_before: bool, update_after: int | None, fresh: tuple[int, int] | None
        ) -> None:
            if fresh is not None:
                self.model.fresh(*fresh)
            if update_before:
                self.model.update()
            self.model.full_pass(update_after)

        def teardown(self) -> None:
            if hasattr(self, "model"):
                self.model.close()

    return RolloutBudgetMachine


class Lifecycle:
    """ROLL-007's model: every iterator's answer after ``shutdown()``.

    Before it, iterators are taken (``iter(src)``) and advanced (``next``) in any order, some
    to their end. ``shutdown()`` returns, a second call too. After it, a new iteration raises;
    so does every iterator taken before, started or not, except one that had already stopped
    (or that had yielded the whole total) which may stop again; none yields a batch, and none
    hangs (an answer within 20 s).
    """

    def __init__(self, ctx: Context, policy: Any, total: int | None, prompts: int = 2) -> None:
        self.policy, self.total = policy, total
        self.src = make(ctx, policy, total, prompts)
        self.iters: list[tuple[Iterator[Any], str, int]] = []  # iterator, state, batches
        self.closed = False
        self.log = [f"src = factory(policy, PROMPTS[:{prompts}], {total}, max_new_tokens=1)"]

    def take(self) -> None:
        """``iter(src)``: before shutdown a new iterator is kept; after it, one must raise."""
        if self.closed:
            self._new_after()
            return
        self.iters.append((iter(self.src), "not started", 0))
        self.log.append(f"it{len(self.iters) - 1} = iter(src)")

    def advance(self, i: int) -> None:
        if not self.iters:
            return
        i %= len(self.iters)
        if self.closed:
            self._after(i)
            return
        it, _state, n = self.iters[i]
        what, err = answer(lambda: next(it))
        self.log.append(f"next(it{i})  # {what}")
        if what == "hung":
            raise _fail(
                f"next() before shutdown() gives no answer in {WAIT_S:.0f} s ({self._at()})"
            )
        if what == "yielded":
            self.iters[i] = (it, "mid-way", n + 1)
        else:  # stopped at its end, or refused: either way it is over
            self.iters[i] = (it, "run to its end" if err is None else "raised", n)

    def full_pass(self, i: int) -> None:
        """Run iterator ``i`` to its end (a declared total only; cut off past it)."""
        if self.total is None or self.closed or not self.iters:
            return
        for _ in range(self.total + PAST):
            self.advance(i)
            if self.iters[i % len(self.iters)][1] not in ("not started", "mid-way"):
                return

    def update(self) -> None:
        if not self.closed:
            _update(self.src, self.policy, self.log)

    def shutdown(self) -> None:
        """``shutdown()`` (again, if it was): then every iterator and a new one must refuse."""
        again = self.closed
        try:
            self.src.shutdown()
        except Exception as e:
            raise _fail(
                f"shutdown() {'called again ' if again else ''}raised {type(e).__name__}: {e} "
                f"({self._at()}); it must be idempotent"
            ) from e
        self.log.append("src.shutdown()")
        self.closed = True
        for i in range(len(self.iters)):
            self._after(i)
        self._new_after()

    def _at(self) -> str:
        return f"calls: {_history(self.log)}"

    def _after(self, i: int) -> None:
        it, state, n = self.iters[i]
        what, _err = answer(lambda: next(it))
        self.log.append(f"next(it{i})  # {what}")
        # One that is over (stopped, raised, or yielded its whole total) may stop again.
        over = state in ("run to its end", "raised") or (self.total is not None and n >= self.total)
        if what == "raised":
            self.iters[i] = (it, "raised", n)  # a generator that raised is over
            return
        if what == "stopped" and over:
            return
        desc = f"an iterator taken before shutdown() ({state}, {n} batches)"
        if what == "hung":
            raise _fail(f"{desc} gives no answer in {WAIT_S:.0f} s after it ({self._at()})")
        if what == "yielded":
            raise _fail(f"{desc} yielded a batch after it; expected a clear error ({self._at()})")
        raise _fail(
            f"{desc} stopped silently (StopIteration) after it; expected a clear error "
            f"({self._at()})"
        )

    def _new_after(self) -> None:
        def first() -> Any:
            return next(iter(self.src))

        what, _err = answer(first)
        self.log.append(f"next(iter(src))  # {what}")
        if what == "raised":
            return
        spent = f", the total {self.total} spent" if self.total is not None else ""
        told = {
            "hung": f"gives no answer in {WAIT_S:.0f} s",
            "yielded": "yielded a batch",
            "stopped": "stopped silently (StopIteration)",
        }[what]
        raise _fail(
            f"a new iteration after shutdown(){spent} {told}; expected a clear error ({self._at()})"
        )

    def close(self) -> None:
        if not self.closed:
            self.src.shutdown()


def lifecycle_sequence(ctx: Context, policy: Any) -> None:
    """ROLL-007's fixed sequence: iterators at every point of their life, then shutdown."""
    endless = Lifecycle(ctx, policy, None)
    spent = Lifecycle(ctx, policy, 2)
    idle = Lifecycle(ctx, policy, 1)
    try:
        endless.take()  # it0: taken, never started
        endless.take()
        endless.advance(1)  # it1: mid-way
        endless.take()
        endless.advance(2)
        endless.advance(2)  # it2: mid-way, further on
        spent.take()
        spent.full_pass(0)  # it0: run to its end
        spent.take()  # it1: taken after the total was spent
        for model in (endless, spent, idle):
            model.shutdown()
            model.shutdown()
    finally:
        for model in (endless, spent, idle):
            model.close()


def lifecycle_machine(ctx: Context, policy: Any) -> type[Any]:
    """Random steps against :class:`Lifecycle`; a sequence that did not shut the source down
    ends with ``shutdown()`` and its checks."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

    # The simplest step first: a sequence shrinks towards advancing the first iterator.
    kinds = ("advance", "take", "full_pass", "update", "shutdown")

    class RolloutLifecycleMachine(RuleBasedStateMachine):
        model: Lifecycle
        failed = False

        @initialize(total=st.none() | st.integers(0, 2))
        def start(self, total: int | None) -> None:
            self.model = Lifecycle(ctx, policy, total)
            self.model.take()

        @rule(kind=st.sampled_from(kinds), i=st.integers(0, 3))
        def step(self, kind: str, i: int) -> None:
            try:
                if kind in ("advance", "full_pass"):
                    getattr(self.model, kind)(i)
                else:
                    getattr(self.model, kind)()
            except BaseException:
                self.failed = True
                raise

        def teardown(self) -> None:
            if not hasattr(self, "model"):
                return
            if not self.failed and not self.model.closed:
                self.model.shutdown()
            self.model.close()

    return RolloutLifecycleMachine
