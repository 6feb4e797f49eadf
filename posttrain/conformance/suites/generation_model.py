"""GEN-005's executable model of the generation spec and the state machine that drives it.

The model (:class:`GenerationSpec`) keeps the weights of every version the server reported and,
for each pending request, the version in force at its submit; the machine runs random request
lives and updates (one at a time, and from several threads at once) against a server and the
model, comparing every answer.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from posttrain.conformance.context import Context
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.generation_serving import (
    MAX_NEW,
    PROMPTS,
    WAIT,
    V,
    _Answers,
    _check_layout,
    _mismatch,
    _prompts,
    _request,
    _result,
    _stop,
)
from posttrain.testing import tiny_causal_lm

UPDATES = ("another", "the same", "in place")
F = TypeVar("F", bound=Callable[..., None])


def _step(method: F) -> F:
    """Marks the model broken when ``method`` raises, so ``close`` does not mask the failure."""

    @functools.wraps(method)
    def wrapper(self: GenerationSpec, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper  # type: ignore[return-value]


class GenerationSpec:
    """A server under test and the model of the spec it must match (GEN-005, GEN-006).

    A response must be stamped with one of the versions in force from its request's submit to
    its answer and be, token for token and log-prob for log-prob, that version's greedy answer
    alone; every update (new weights, the same weights again, or the policy changed in place
    and no argument) must raise ``policy_version``. Updates from several threads at once each
    count: ``n`` of them raise the version at least ``n`` times, each version between holds
    one of their weights, and the last version the last weights applied (one of theirs, the
    same for every response stamped with it).

    ``pool`` holds the weights updates choose from, ``twins`` their greedy answers (see
    :func:`weights_pool`), shared by every sequence of one machine.

    Example:
        >>> from posttrain.reference_impls import GENERATION_SERVER
        >>> ctx = Context(GENERATION_SERVER)
        >>> spec = GenerationSpec(ctx, *weights_pool(ctx))
        >>> spec.submit([5, 6], new_client=False); spec.update("another", 1); spec.answer(0)
        >>> spec.concurrent([1, 2, 0], [[7], [8, 9]]); spec.answer(1)
        >>> spec.close()
    """

    def __init__(self, ctx: Context, pool: list[Any], twins: dict[int, _Answers]) -> None:
        self.pool, self.twins = pool, twins
        self.policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
        self.server = ctx.make(self.policy, max_new_tokens=MAX_NEW)
        self.clients = [self.server.client()]
        self.version = int(self.server.policy_version)
        # version -> the indices into pool its weights may be: one after an update from one
        # thread; after updates from several at once, any of theirs until an answer tells.
        self.weights: dict[int, set[int]] = {self.version: {0}}
        # (before, after, indices): versions strictly between, set while updates from several
        # threads overlapped, may hold any of their weights.
        self.spans: list[tuple[int, int, set[int]]] = []
        self.pending: list[tuple[list[int], Any, int]] = []
        self.broken = False

    @_step
    def submit(self, prompt: list[int], new_client: bool) -> None:
        if new_client:
            self.clients.append(self.server.client())
        future = self.clients[-1].submit(_request(prompt))
        self.pending.append((prompt, future, self.version))

    def _candidates(self, stamp: int, since: int) -> set[int] | None:
        """The weights a response stamped ``stamp`` may hold, its request submitted under
        version ``since``, or ``None`` where that version was never in force meanwhile."""
        if stamp < since or stamp > self.version:
            return None
        if stamp in self.weights:
            return self.weights[stamp]
        spans = [w for lo, hi, w in self.spans if lo < stamp < hi and hi > since]
        if not spans:
            return None
        return self.weights.setdefault(stamp, set(spans[0]))

    @_step
    def update(self, which: str, k: int) -> None:
        if which == "in place" and self.pending:
            which = "another"  # the policy changes under no request in flight
        now = min(self.weights[self.version])
        target = now if which == "the same" else (now + k) % len(self.pool)
        before = int(self.server.policy_version)
        if which == "in place":
            self.policy.load_state_dict(self.pool[target])
            self.server.update_policy_weights_()
            call = "the policy changed in place, then update_policy_weights_()"
        else:
            self.server.update_policy_weights_(self.pool[target])
            call = f"update_policy_weights_({which} weights)"
        after = int(self.server.policy_version)
        if after <= before:
            raise _fail(f"policy_version went from {before} to {after} after {call}")
        self.version = after
        self.weights[after] = {target}

    @_step
    def concurrent(self, ks: list[int], prompts: list[list[int]]) -> None:
        """``len(ks)`` updates from as many threads at once, released together (weights ``k``
        steps on from the served ones, 0 the same again), ``prompts`` submitted meanwhile;
        then one request, answered at once, must be stamped with the version they left."""
        now = min(self.weights[self.version])
        targets = [(now + k) % len(self.pool) for k in ks]
        before = int(self.server.policy_version)
        start = threading.Barrier(len(ks) + 1)
        seen: dict[int, int] = {}
        errors: list[BaseException] = []

        def update(i: int) -> None:
            try:
                start.wait(WAIT)
                self.server.update_policy_weights_(self.pool[targets[i]])
                seen[i] = int(self.server.policy_version)
            except BaseException as e:  # re-raised in the suite's thread
                errors.append(e)

        threads = [threading.Thread(target=update, args=(i,), daemon=True) for i in range(len(ks))]
        for t in threads:
            t.start()
        start.wait(WAIT)
        for p in prompts:  # in flight while the updates run
            self.submit(p, new_client=True)
        call = f"{len(ks)} updates from as many threads at once (weights {targets})"
        for t in threads:
            t.join(WAIT)
            if t.is_alive():
                raise _fail(f"{call}: one has not returned after {WAIT:.0f} s")
        if errors:
            raise errors[0]
        after = int(self.server.policy_version)
        if after - before < len(ks):
            raise _fail(
                f"policy_version went from {before} to {after} after {call}: it must rise with "
                f"every update, to at least {before + len(ks)}"
            )
        low = {i: v for i, v in seen.items() if v <= before}
        if low:
            raise _fail(
                f"{call}: policy_version read right after update {min(low)} returned was "
                f"{low[min(low)]}, not above {before} (the version before them)"
            )
        self.spans.append((before, after, set(targets)))
        self.weights[after] = set(targets)
        self.version = after
        self.submit(PROMPTS[len(self.spans) % len(PROMPTS)], new_client=False)
        self.answer(len(self.pending) - 1)

    @_step
    def answer(self, i: int) -> None:
        prompt, future, since = self.pending.pop(i)
        out = _result(future, f"prompt {prompt}")
        _check_layout(out, f"prompt {prompt}")
        stamp = int(out.get("policy_version"))
        candidates = self._candidates(stamp, since)
        if candidates is None:
            raise _fail(
                f"prompt {prompt} was stamped {stamp}; the versions in force from its "
                f"submit to its answer were {self._in_force(since)}"
            )
        wrong = {k: _mismatch(out, self.twins[k](prompt)) for k in sorted(candidates)}
        matched = {k for k, w in wrong.items() if w is None}
        if not matched:
            which = (
                f"version {stamp}'s weights"
                if len(candidates) == 1
                else f"any of weights {sorted(candidates)}, which version {stamp} may hold"
            )
            raise _fail(
                f"prompt {prompt} was stamped {stamp}, but its answer is not the greedy "
                f"answer of {which}: {'; '.join(str(w) for w in wrong.values())}"
            )
        candidates &= matched  # every later response stamped so must hold the same weights

    def _in_force(self, since: int) -> str:
        known = sorted(v for v in self.weights if v >= since)
        spans = [f"{lo + 1}..{hi - 1}" for lo, hi, _w in self.spans if hi > since and hi - lo > 1]
        return str(known) + (f" (and any of {', '.join(spans)})" if spans else "")

    def close(self) -> None:
        """Answers what is pending, then shuts the server down; after a failed step it only
        shuts it down (the failure is the step's, not a later answer's)."""
        try:
            while self.pending and not self.broken:
                self.answer(0)
        finally:
            _stop(self.server)


def weights_pool(ctx: Context) -> tuple[list[Any], dict[int, _Answers]]:
    """The three weights sets updates choose from, and each one's greedy answers."""
    pool = [tiny_causal_lm(vocab_size=V, seed=ctx.seed + k).state_dict() for k in range(3)]
    twins = {k: _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed + k)) for k in range(3)}
    return pool, twins


# GEN-005's fixed rounds of updates from several threads at once: each thread's weights as
# steps on from the served ones (0: the same again); two, four and three threads.
ROUNDS = ([1, 2], [1, 2, 0, 1], [2, 2, 1])


def concurrent_rounds(ctx: Context, pool: list[Any], twins: dict[int, _Answers]) -> None:
    """:data:`ROUNDS` against one server, a request in flight before each and one submitted
    while its updates run, every answer checked against the model, the newest first."""
    spec = GenerationSpec(ctx, pool, twins)
    try:
        for r, ks in enumerate(ROUNDS):
            spec.submit(PROMPTS[r], new_client=True)
            spec.concurrent(ks, [PROMPTS[r + len(ROUNDS)]])
        while spec.pending:
            spec.answer(len(spec.pending) - 1)
    finally:
        spec.close()


def machine(ctx: Context, pool: list[Any] | None = None, twins: Any = None) -> type[Any]:
    """Random request lives and updates, each sequence on a new server, against the model.

    Requests come from new or reused clients, with any prompt, and are awaited in any order;
    updates come one at a time or from several threads at once, requests in flight.
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    pool, twins = weights_pool(ctx) if pool is None or twins is None else (pool, twins)
    served: list[Any] = pool

    class GenerationMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.spec = GenerationSpec(ctx, served, twins)

        @rule(prompt=_prompts(), new_client=st.booleans())
        def submit(self, prompt: list[int], new_client: bool) -> None:
            self.spec.submit(prompt, new_client)

        @rule(which=st.sampled_from(UPDATES), k=st.integers(1, 2))
        def update(self, which: str, k: int) -> None:
            self.spec.update(which, k)

        @rule(
            ks=st.lists(st.integers(0, 2), min_size=2, max_size=4),
            prompts=st.lists(_prompts(), max_size=2),
        )
        def concurrent_updates(self, ks: list[int], prompts: list[list[int]]) -> None:
            self.spec.concurrent(ks, prompts)

        @precondition(lambda self: bool(self.spec.pending))
        @rule(data=st.data())
        def answer(self, data: Any) -> None:
            self.spec.answer(data.draw(st.integers(0, len(self.spec.pending) - 1), label="request"))

        def teardown(self) -> None:
            self.spec.close()

    GenerationMachine.__name__ = "GenerationMachine"
    return GenerationMachine
