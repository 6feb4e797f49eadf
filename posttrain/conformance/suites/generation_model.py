"""GEN-005's executable model of the generation spec and the state machine that drives it.

The model (:class:`GenerationSpec`) keeps the weights of every version the server reported and,
for each pending request, the versions in force from its submit on; the machine runs random
request lives and updates against a server and the model, comparing every answer.
"""

from __future__ import annotations

from typing import Any

from posttrain.conformance.context import Context
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.generation_serving import (
    MAX_NEW,
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


class GenerationSpec:
    """A server under test and the model of the spec it must match (GEN-005, GEN-006).

    A response must be stamped with one of the versions in force from its request's submit to
    its answer and be, token for token and log-prob for log-prob, that version's greedy answer
    alone; every update (new weights, the same weights again, or the policy changed in place
    and no argument) must raise ``policy_version``.

    ``pool`` holds the weights updates choose from, ``twins`` their greedy answers (see
    :func:`weights_pool`), shared by every sequence of one machine.

    Example:
        >>> from posttrain.reference_impls import GENERATION_SERVER
        >>> ctx = Context(GENERATION_SERVER)
        >>> spec = GenerationSpec(ctx, *weights_pool(ctx))
        >>> spec.submit([5, 6], new_client=False); spec.update("another", 1); spec.answer(0)
        >>> spec.close()
    """

    def __init__(self, ctx: Context, pool: list[Any], twins: dict[int, _Answers]) -> None:
        self.pool, self.twins = pool, twins
        self.policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
        self.server = ctx.make(self.policy, max_new_tokens=MAX_NEW)
        self.clients = [self.server.client()]
        self.version = int(self.server.policy_version)
        self.weights = {self.version: 0}  # version -> index into pool
        self.pending: list[tuple[list[int], Any, list[int]]] = []

    def submit(self, prompt: list[int], new_client: bool) -> None:
        if new_client:
            self.clients.append(self.server.client())
        future = self.clients[-1].submit(_request(prompt))
        self.pending.append((prompt, future, [self.version]))

    def update(self, which: str, k: int) -> None:
        if which == "in place" and self.pending:
            which = "another"  # the policy changes under no request in flight
        now = self.weights[self.version]
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
        self.weights[after] = target
        for _p, _f, allowed in self.pending:
            allowed.append(after)

    def answer(self, i: int) -> None:
        prompt, future, allowed = self.pending.pop(i)
        out = _result(future, f"prompt {prompt}")
        _check_layout(out, f"prompt {prompt}")
        stamp = int(out.get("policy_version"))
        if stamp not in allowed:
            raise _fail(
                f"prompt {prompt} was stamped {stamp}; the versions in force from its "
                f"submit to its answer were {allowed}"
            )
        wrong = _mismatch(out, self.twins[self.weights[stamp]](prompt))
        if wrong:
            raise _fail(
                f"prompt {prompt} was stamped {stamp}, but its answer is not the greedy "
                f"answer of version {stamp}'s weights: {wrong}"
            )

    def close(self) -> None:
        try:
            while self.pending:
                self.answer(0)
        finally:
            _stop(self.server)


def weights_pool(ctx: Context) -> tuple[list[Any], dict[int, _Answers]]:
    """The three weights sets updates choose from, and each one's greedy answers."""
    pool = [tiny_causal_lm(vocab_size=V, seed=ctx.seed + k).state_dict() for k in range(3)]
    twins = {k: _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed + k)) for k in range(3)}
    return pool, twins


def machine(ctx: Context) -> type[Any]:
    """Random request lives and updates, each sequence on a new server, against the model.

    Requests come from new or reused clients, with any prompt, and are awaited in any order.
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    pool, twins = weights_pool(ctx)

    class GenerationMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.spec = GenerationSpec(ctx, pool, twins)

        @rule(prompt=_prompts(), new_client=st.booleans())
        def submit(self, prompt: list[int], new_client: bool) -> None:
            self.spec.submit(prompt, new_client)

        @rule(which=st.sampled_from(UPDATES), k=st.integers(1, 2))
        def update(self, which: str, k: int) -> None:
            self.spec.update(which, k)

        @precondition(lambda self: bool(self.spec.pending))
        @rule(data=st.data())
        def answer(self, data: Any) -> None:
            self.spec.answer(data.draw(st.integers(0, len(self.spec.pending) - 1), label="request"))

        def teardown(self) -> None:
            self.spec.close()

    GenerationMachine.__name__ = "GenerationMachine"
    return GenerationMachine
