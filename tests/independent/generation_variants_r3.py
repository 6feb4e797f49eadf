"""Round-three blind one-bug generation servers, written from ``specs/generation-v1.md`` alone.

Each variant changes one thing in :class:`tests.independent.generation.DrainBatchingServer`
(``on_shutdown="drain"``). Each docstring names the bug, a system that shipped a bug of that
kind (or says it is plausible) and the requirement sentence it breaks; ``DEMOS[name]()`` shows
the bug with plain code against that sentence (True when the bug shows). Run by
tests/conformance/independent/test_variants_by_contract.py.

Measured (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; filled in below after the run):

| variant | breaks | outcome | base on that id |
|---|---|---|---|
| cancel_shift | GEN-002 | caught (FAIL) | PASS |
| lost_update | GEN-005 | caught (FAIL) | PASS |
| exclusive_eos | GEN-001 | caught (FAIL) | PASS |
| prompt_keyed | GEN-002 | caught (FAIL) | PASS |

Messages:

- cancel_shift: GEN-002: after a caller cancelled its request submitted, prompt [30, 31, 32]: no
  response within 10 s (see specs/generation-v1.md#GEN-002)
- lost_update: GEN-005: policy_version went from 0 to 1 after 2 updates from as many threads at
  once (weights [1, 2]): it must rise with every update, to at least 2 (see
  specs/generation-v1.md#GEN-005)
- exclusive_eos: GEN-001: a policy that emits EOS first got response [], expected only EOS (see
  specs/generation-v1.md#GEN-001)
- prompt_keyed: GEN-002: prompt [5, 6, 7]: no response 10.0 s after the other 9 requests sent
  with it were answered (in 0.0 s) (see specs/generation-v1.md#GEN-002)

Missed, and what the domain does not try: none since generation 1.5. Under 1.4 the kit missed
lost_update: GEN-005 made its updates from one thread, one after another, so no two updates
overlapped; 1.5 adds updates from several threads at once.

- (Withdrawn before measuring: a fifth candidate running left-padded rows with positions
  0..width-1. With the suite's rotary-position Llama a constant shift of a row's positions
  changes nothing, so it is no bug there; its demo showed no difference.)

Example:
    >>> sorted(VARIANTS)[0]
    'cancel_shift'
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import Implementation
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, request_problem
from tests.independent._greedy import Decoded, eos_id, greedy_decode
from tests.independent.generation import (
    DrainBatchingServer,
    ServerClosedError,
    _Engine,
    _Pending,
    _response,
    load_checked,
)

__all__ = ["BREAKS", "DEMOS", "VARIANTS"]


def _req(prompt: list[int]) -> TensorDict:
    return TensorDict({PROMPT_KEY: torch.tensor(prompt, dtype=torch.int64)}, batch_size=[])


def _policy() -> Any:
    from posttrain.testing import tiny_causal_lm

    return tiny_causal_lm()


class CancelShiftServer(DrainBatchingServer):
    """BUG: futures stay cancellable while queued (a caller that gave up may ``cancel()``),
    and the worker drops the cancelled requests from the batch before decoding, but hands
    the answers out over the batch as it was formed (``zip(valid, answers)`` where
    ``answers`` follows the surviving requests): after a cancellation each later caller in
    that batch gets the next caller's response and the last one none. The class of vLLM's
    aborted-request bookkeeping bugs (outputs matched to requests by position after an
    abort removed one); plausible here.

    Breaks GEN-002 ("every caller MUST receive the response to its own prompt, never
    another's ..., also after other callers cancelled their futures").
    """

    def _submit(self, request: TensorDictBase) -> cf.Future[TensorDict]:
        fut: cf.Future[TensorDict] = cf.Future()  # left PENDING: cancellable while queued
        with self._lock:
            if self._closed:
                raise ServerClosedError("submit: the server was shut down; no request is taken")
            self._unresolved.add(fut)
            self._queue.put(_Pending(request, fut, time.perf_counter()))
        return fut

    def _serve(self, batch: list[_Pending]) -> None:
        valid: list[tuple[_Pending, tuple[int, ...]]] = []
        for p in batch:
            problem = request_problem(p.request)
            if problem is not None:
                self._resolve(p.future, error=KeyError(problem))
            else:
                valid.append((p, tuple(int(t) for t in p.request.get(PROMPT_KEY).tolist())))
        for p, _ in valid:
            if p.future.cancelled():
                self._resolve(p.future)  # forget it (settling a cancelled future is a no-op)
        live = [(p, prompt) for p, prompt in valid if not p.future.cancelled()]
        if not live:
            return
        with self._lock:
            engine = self._engine
        t0 = time.perf_counter()
        cache = self._cache_of(engine)
        todo = list(dict.fromkeys(prompt for _, prompt in live if prompt not in cache))
        for prompt, d in zip(todo, self._decode(engine, todo), strict=True):
            cache[prompt] = d
        answers = [cache[prompt] for _, prompt in live]
        t1 = time.perf_counter()
        version = self._stamp(engine)
        for (p, _), d in zip(valid, answers, strict=False):  # BUG: `valid`, not `live`
            self._resolve(p.future, result=_response(d, version))
        self._stats.add(sum(t0 - p.t_submit for p, _ in live) / len(live), len(live), t1 - t0)


def demo_cancel_shift() -> bool:
    """With the first of three batched requests cancelled, the second gets the third's answer."""
    policy = _policy()
    prompts = [[5, 6], [7, 8, 9], [11]]
    srv = CancelShiftServer(policy, max_new_tokens=3, linger_s=0.5)
    try:
        c = srv.client()
        futs = [c.submit(_req(p)) for p in prompts]
        futs[0].cancel()
        got = futs[1].result(timeout=30)[RESPONSE_KEY].tolist()
    finally:
        srv.shutdown()
    want = greedy_decode(policy, [prompts[1]], 3)[0].tokens
    return bool(got != want)


class LostUpdateServer(DrainBatchingServer):
    """BUG: ``update_policy_weights_`` takes no update lock ("updates come from one trainer
    thread"): two updates that overlap both read version v, both build an engine, and both
    publish v + 1, so the version does not rise with the second update and one of the two
    weight sets is lost. Plausible: the lost-update race of an unguarded
    read-modify-write (a trainer with a timer-driven sync beside its step-driven one).

    Breaks GEN-005 ("policy_version MUST rise with every update").
    """

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._lock:
            current = self._engine
        model = copy.deepcopy(current.model)
        load_checked(model, self._policy.state_dict() if weights is None else weights)
        with self._lock:
            self._engine = self._new_engine(model, current.version + 1)


def demo_lost_update() -> bool:
    """Two concurrent updates leave the version at 1 (in at least one of 20 tries)."""
    policy = _policy()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for _ in range(20):
            srv = LostUpdateServer(policy, max_new_tokens=1)
            gate = threading.Barrier(2)

            def update(s: LostUpdateServer = srv, g: threading.Barrier = gate) -> None:
                g.wait()
                s.update_policy_weights_()

            threads = [threading.Thread(target=update) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            v = srv.policy_version
            srv.shutdown()
            if v != 2:
                return True
    finally:
        sys.setswitchinterval(old)
    return False


class ExclusiveEosServer(DrainBatchingServer):
    """BUG: responses are trimmed at EOS with an exclusive slice
    (``tokens[: tokens.index(eos)]``, the way stop strings are cut from text), so the EOS
    that ended a response is dropped with its log-prob, and a policy whose first token is
    EOS answers an empty response. The off-by-one at the EOS boundary; the trainer then
    never sees (nor learns) the stop token. Plausible (TRL and vLLM both had to decide
    whether a stop token is included in the output).

    Breaks GEN-001 ("a response that generated EOS MUST end with that EOS ..., so a policy
    whose first token is EOS answers [EOS]"; and 1 <= R).
    """

    def _decode(self, engine: _Engine, prompts: list[tuple[int, ...]]) -> list[Decoded]:
        out = super()._decode(engine, prompts)
        eos = eos_id(engine.model)
        trimmed: list[Decoded] = []
        for d in out:
            if eos is not None and eos in d.tokens:
                end = d.tokens.index(eos)
                d = Decoded(d.tokens[:end], d.log_probs[:end])
            trimmed.append(d)
        return trimmed


class _EosFirstPolicy(torch.nn.Module):
    """A policy whose every greedy token is EOS (id 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(eos_token_id=2)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        logits = torch.zeros(*input_ids.shape, 64)
        logits[..., 2] = 10.0 * self.scale
        return SimpleNamespace(logits=logits)


def demo_exclusive_eos() -> bool:
    """A policy whose first token is EOS gets an empty response, not [EOS]."""
    srv = ExclusiveEosServer(_EosFirstPolicy(), max_new_tokens=3)
    try:
        got = srv.client().submit(_req([5, 6])).result(timeout=30)[RESPONSE_KEY].tolist()
    finally:
        srv.shutdown()
    return bool(got != [2])


class PromptKeyedServer(DrainBatchingServer):
    """BUG: the worker maps each batch's answers back to its callers through a dict keyed by
    the prompt (``{prompt: pending}``), as if a prompt identified a request, so of two
    requests with the same prompt in one batch (a GRPO group, two callers asking the same
    question) only the last is answered and the other waits until shutdown fails it. The
    request-identity collision vLLM's duplicate ``request_id`` reports describe; plausible
    here.

    Breaks GEN-002 ("every caller MUST receive the response to its own prompt").
    """

    def _serve(self, batch: list[_Pending]) -> None:
        valid: list[tuple[_Pending, tuple[int, ...]]] = []
        for p in batch:
            problem = request_problem(p.request)
            if problem is not None:
                self._resolve(p.future, error=KeyError(problem))
            else:
                valid.append((p, tuple(int(t) for t in p.request.get(PROMPT_KEY).tolist())))
        if not valid:
            return
        with self._lock:
            engine = self._engine
        t0 = time.perf_counter()
        waiting = {prompt: p for p, prompt in valid}  # BUG: one caller per prompt
        cache = self._cache_of(engine)
        todo = [prompt for prompt in waiting if prompt not in cache]
        for prompt, d in zip(todo, self._decode(engine, todo), strict=True):
            cache[prompt] = d
        t1 = time.perf_counter()
        version = self._stamp(engine)
        for prompt, p in waiting.items():
            self._resolve(p.future, result=_response(cache[prompt], version))
        self._stats.add(sum(t0 - p.t_submit for p, _ in valid) / len(valid), len(valid), t1 - t0)


def demo_prompt_keyed() -> bool:
    """Of two batched requests with the same prompt, one is never answered."""
    srv = PromptKeyedServer(_policy(), max_new_tokens=2, linger_s=0.5)
    try:
        c = srv.client()
        futs = [c.submit(_req([5, 6])) for _ in range(2)]
        done, _ = cf.wait(futs, timeout=5)
    finally:
        srv.shutdown(timeout=1)
    return len(done) < 2


def _impl(cls: type[DrainBatchingServer]) -> Implementation:
    return Implementation(
        "generation",
        lambda policy, *, max_new_tokens: cls(policy, max_new_tokens=max_new_tokens),
        name=f"r3.{cls.__name__}",
        options={"on_shutdown": "drain"},
    )


VARIANTS: dict[str, Implementation] = {
    "cancel_shift": _impl(CancelShiftServer),
    "lost_update": _impl(LostUpdateServer),
    "exclusive_eos": _impl(ExclusiveEosServer),
    "prompt_keyed": _impl(PromptKeyedServer),
}

BREAKS: dict[str, str] = {
    "cancel_shift": "GEN-002",
    "lost_update": "GEN-005",
    "exclusive_eos": "GEN-001",
    "prompt_keyed": "GEN-002",
}

DEMOS: dict[str, Callable[[], bool]] = {
    "cancel_shift": demo_cancel_shift,
    "lost_update": demo_lost_update,
    "exclusive_eos": demo_exclusive_eos,
    "prompt_keyed": demo_prompt_keyed,
}

# The correct design every variant changes, for the base check on the same id.
BASES: dict[str, Implementation] = dict.fromkeys(VARIANTS, _impl(DrainBatchingServer))


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {}
