"""The executable model of weight sync (WS-002, WS-003) and the random send/receive
sequences driven against it, each on a new pair."""

from __future__ import annotations

import contextlib
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before 3.11
from typing import Any

import torch

from posttrain.conformance.context import Context
from posttrain.conformance.suites._compare import bits_equal
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._weight_sync_domains import (
    MODELS,
    Weights,
    bump_,
    fresh_like,
)
from posttrain.conformance.suites._weight_sync_pair import diff, setup


def holding(model: Any, sent: dict[int, Weights]) -> str:
    """Which of ``sent``'s versions the model's weights are, in words."""
    for v, w in sent.items():
        if not diff(model, w):
            return f"the weights of version {v}"
    return "weights of none of them"


def mix(model: Any, sent: dict[int, Weights], versions: tuple[int, ...]) -> str:
    """How many of the model's tensors are each of ``versions``' weights, in words."""
    own = {n: t.detach().cpu() for n, t in model.state_dict().items()}
    by: dict[str, list[str]] = {}
    for n in sent[versions[0]]:
        got = own.get(n)
        match = [v for v in versions if got is not None and bits_equal(got, sent[v][n].cpu())]
        by.setdefault(f"version {match[-1]}'s" if match else "no send's", []).append(n)
    return ", ".join(f"{len(ns)} {k} (e.g. {ns[:2]})" for k, ns in sorted(by.items()))


def snapshot(w: Weights) -> Weights:
    return {n: t.detach().clone() for n, t in w.items()}


class SyncSpec:
    """The executable model of WS-002 (and of WS-003's in-place changes), driven on one pair.

    ``held`` is the version the receiver must report and ``unadopted`` the sends not yet
    adopted. A send leaves ``held`` alone; a ``receive()`` with sends pending adopts the next
    or the newest of them (either is allowed) and drops the older ones; one with nothing
    pending changes nothing. After every step the model holds ``held``'s weights (or, under
    ``applies_on_send``, one unadopted send's, whole). Sends are fresh dicts or the
    ``state_dict()`` of a live trainer module changed in place between sends (the same tensor
    objects, new values), also while a send of it is pending; right after a send returns the
    trainer may step (:meth:`step`), changing in place every tensor not yet adopted: what a
    receive() adopts is the weights as they were at their send. With ``aliasing`` (WS-003)
    the sender's tensors of every adopted send may be changed in place, and the receiver's
    model must not move. ``kind`` names the receiver's model (:data:`MODELS`).
    """

    def __init__(self, ctx: Context, *, aliasing: bool = False, kind: str = "float32") -> None:
        self.sender, self.receiver, self.model, self.source = setup(ctx, kind)
        self.applies_on_send = "applies_on_send" in ctx.capabilities
        self.aliasing = aliasing
        self.trainer = MODELS[kind](ctx.seed + 2)
        self.held = int(self.receiver.version)
        self.sent: dict[int, Weights] = {self.held: snapshot(self.model.state_dict())}
        self.objects: dict[int, Weights] = {}  # what was passed to send, by version
        self.live: set[int] = set()  # versions sent as the trainer's live state_dict
        self.unadopted: list[int] = []

    def weights(self, live: bool, seed: int) -> tuple[Weights, bool]:
        """The next send's weights: the trainer's live tensors stepped in place, or fresh."""
        gen = torch.Generator().manual_seed(seed)
        if live:
            with torch.no_grad():
                for t in self.trainer.state_dict().values():
                    t.copy_(fresh_like(t, gen))
            return self.trainer.state_dict(), True
        return {n: fresh_like(t, gen) for n, t in self.source.items()}, False

    def send(
        self, weights: Weights, version: int, *, live: bool = False, step: float | None = None
    ) -> None:
        """Send ``weights`` as ``version``; with ``step``, the trainer steps right after."""
        self.sent[version] = snapshot(weights)
        self.objects[version] = weights
        if live:
            self.live.add(version)
        self.sender.send(weights, version=version)
        self.unadopted.append(version)
        what = f"after send(version={version})"
        if step is not None:
            self.step(step)
            what += f" and a training step changing the sent tensors in place (by {step:g})"
        self.check(f"{what}, before a receive()")

    def step(self, delta: float) -> None:
        """The trainer steps in place: its live tensors and every tensor of a send not yet
        adopted change (a trainer reusing its buffers); the weights as sent stay the spec's."""
        tensors = [*self.trainer.state_dict().values()]
        tensors += [t for v in self.unadopted for t in self.objects[v].values()]
        seen: set[tuple[int, torch.dtype]] = set()
        with torch.no_grad():
            for t in tensors:
                if (t.data_ptr(), t.dtype) not in seen:  # a state_dict's tensors are new views
                    seen.add((t.data_ptr(), t.dtype))
                    bump_(t, delta)

    def receive(self) -> None:
        if not self.unadopted:
            with contextlib.suppress(TimeoutError, FuturesTimeout):
                self.receiver.receive(timeout=0.01)
            self.check("after a receive() with nothing sent since the last one")
            return
        pending = list(self.unadopted)
        self.receiver.receive(timeout=10.0)
        got = self.receiver.version
        allowed = sorted({pending[0], pending[-1]})
        if got not in allowed:
            raise _fail(
                f"after a receive() with versions {pending} sent since the last, "
                f"receiver.version is {got!r}; expected "
                + " or ".join(map(str, allowed))
                + " (the next pending send or the newest)"
            )
        self.held = int(got)
        self.unadopted = [v for v in pending if v > got]
        self.check(f"after a receive() with versions {pending} sent since the last")
        if self.aliasing:  # the trainer's next step changes what it sent, right after a sync
            self.change(1.0)

    def check(self, what: str) -> None:
        got = self.receiver.version
        if got != self.held:
            raise _fail(
                f"{what}: receiver.version is {got!r}; expected {self.held} (the version "
                f"adopted last; sends not yet adopted: {self.unadopted})"
            )
        if self.aliasing:
            return
        if not self.applies_on_send or not self.unadopted:
            if diff(self.model, self.sent[self.held]):
                pending = f"; sends not yet adopted: {self.unadopted}" if self.unadopted else ""
                raise _fail(
                    f"{what}: receiver.version is {self.held} but the model holds "
                    f"{holding(self.model, self.sent)}{pending}{self._moved()}"
                )
            return
        whole = (self.held, *self.unadopted)
        if all(diff(self.model, self.sent[v]) for v in whole):
            raise _fail(
                f"{what}, under capability applies_on_send, the model's tensors are "
                f"{mix(self.model, self.sent, whole)}; expected the weights of version "
                + " or ".join(map(str, whole))
                + ", whole"
            )

    def _moved(self) -> str:
        """Whether the model holds a send's tensors as they are now, changed since the send."""
        now = [
            v
            for v, w in self.objects.items()
            if any(not bits_equal(t, self.sent[v][n]) for n, t in w.items())
            and not diff(self.model, w)
        ]
        if not now:
            return ""
        return (
            f"; it holds the values the tensors sent as version {now[-1]} have now, changed in "
            "place after that send returned: expected the weights as they were at the send"
        )

    def change(self, delta: float) -> None:
        """The sender changes in place every tensor it sent under a version adopted or dropped."""
        before = snapshot(self.model.state_dict())
        done = [v for v in self.objects if v <= self.held]
        if self.live & set(self.unadopted):
            done = [v for v in done if v not in self.live]
        with torch.no_grad():
            for v in done:
                for t in self.objects[v].values():
                    bump_(t, delta)
        changed = diff(self.model, before)
        if changed:
            raise _fail(
                f"after the sender changed in place the tensors it sent as versions {done} "
                f"(adopted or dropped: version {self.held} is held), the receiver's model "
                f"changed: {len(changed)} tensors, e.g. {changed[:3]}"
            )
        for v in done:
            self.objects.pop(v)


# Version gaps the machine draws: the next version, skips, and a jump past 2**31 (a version
# kept in an int32 wraps there); and the versions it starts above, so that its sequences
# cross digit counts (9 to 10, 99 to 100) and 2**31.
GAPS = (1, 1, 2, 9, 2**31)
STARTS = (0, 7, 97, 2**31 - 3)


def examples(ctx: Context, n: int) -> int:
    """Sequences per machine: each builds a pair, two new processes under ``cross_process``
    (seconds each on 2 cores), where a default run tries one."""
    return 1 if "cross_process" in ctx.capabilities and ctx.depth == 1 else n


def machine(ctx: Context, *, aliasing: bool = False) -> type[Any]:
    """Random send/receive sequences, each on a new pair, against :class:`SyncSpec`."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    steps = st.sampled_from((None, 1.0, -0.5, 1e6)) if not aliasing else st.just(None)

    class WeightSyncMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.last = 0

        @initialize(start=st.sampled_from(STARTS), model=st.sampled_from(tuple(MODELS)))
        def start_above(self, start: int, model: str) -> None:
            self.spec = SyncSpec(ctx, aliasing=aliasing, kind=model)
            self.last = start

        @rule(gap=st.sampled_from(GAPS), live=st.booleans(), seed=st.integers(0, 2**16), step=steps)
        def send(self, gap: int, live: bool, seed: int, step: float | None) -> None:
            self._send(gap, live, seed, step)

        @rule(gap=st.sampled_from(GAPS), live=st.booleans(), seed=st.integers(0, 2**16), step=steps)
        def sync(self, gap: int, live: bool, seed: int, step: float | None) -> None:
            """A send and the receive() right after it: a trainer's usual step."""
            self._send(gap, live, seed, step)
            self.receive()

        def _send(self, gap: int, live: bool, seed: int, step: float | None) -> None:
            weights, live = self.spec.weights(live, seed)
            self.last += gap
            self.spec.send(weights, self.last, live=live, step=step)

        @rule()
        def receive(self) -> None:
            self.spec.receive()

        @precondition(lambda self: not aliasing)
        @rule(delta=st.sampled_from((1.0, -0.5, 1e6)))
        def train(self, delta: float) -> None:
            """The trainer steps with sends pending or not, then the model is compared."""
            self.spec.step(delta)
            self.spec.check(f"after a training step (by {delta:g}) changed the sent tensors")

        @precondition(lambda self: aliasing)
        @rule(delta=st.sampled_from((1.0, -0.5, 1e6)))
        def change_sent_tensors(self, delta: float) -> None:
            self.spec.change(delta)

    WeightSyncMachine.__name__ = "WeightSyncMachine"
    return WeightSyncMachine
