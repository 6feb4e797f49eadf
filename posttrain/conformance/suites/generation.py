"""The generation-server suite: one check per GEN requirement (specs/generation-v1.md).

The suite supplies a tiny real HF causal LM. Expected answers come from a model run alone,
greedily, on one prompt at a time: new weights are a second random init of the same tiny
policy, and every token and log-prob served after an update is compared with it. Races are
made deterministic by a forward hook the suite puts on its policy: it holds a batch in flight
on an Event while the suite updates weights or queues more requests. Every wait has a
timeout, so a hanging server fails instead of stalling the run.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before 3.11
from contextlib import contextmanager
from queue import Empty
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.conformance import explore
from posttrain.conformance._spawn import Spawned
from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY
from posttrain.testing import forced_token_weights, tiny_causal_lm
from posttrain.testing.policies import next_token_weights

V = 64
MAX_NEW = 3
WAIT = 60.0
REFUSE_WAIT = 10.0  # a request after shutdown: an answer this late counts as a hang
SHUTDOWN_GRACE = 10.0  # shutdown(5.0) must return within 5 s plus this
UPDATE_RACE = 0.5  # how long a held batch waits for an update that waits for it
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [20, 21], [30, 31, 32], [40, 41], [50]]
# A next-token table for GEN-003's EOS check: [5, 6, 7] answers [11, EOS] while the other
# rows of its batch go on to MAX_NEW tokens (2 is the tiny policy's EOS).
EOS_PROMPT = [5, 6, 7]
LONG_PROMPTS = [[8, 9], [20, 21], [30, 31, 32]]
EOS_TABLE = {7: 11, 11: 2, 9: 12, 12: 13, 13: 14, 21: 22, 22: 23, 23: 24, 32: 33, 33: 34, 34: 35}
EOS = 2  # the tiny policy's EOS token
PAD = 0  # and its pad token
# Prompts the domain starts from: the pad token, EOS and the largest id as real prompt tokens,
# one token, and prompts longer than any of PROMPTS.
EDGE_PROMPTS = [
    [PAD],
    [EOS],
    [V - 1],
    [PAD, PAD, 5],
    [5, EOS, 6, PAD],
    [V - 1] * 12,
    list(range(14)),
]


def _prompts() -> Any:
    """Any prompt: every token id of the vocabulary (pad and EOS included), 1 to 14 tokens."""
    from hypothesis import strategies as st

    return st.lists(st.integers(0, V - 1), min_size=1, max_size=14)


class _Answers:
    """Greedy answers of one weights set, each computed once, the model alone."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self._memo: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def __call__(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        key = tuple(prompt)
        if key not in self._memo:
            self._memo[key] = _alone(self.policy, prompt)
        return self._memo[key]


def _stop(server: Any) -> None:
    t = threading.Thread(target=server.shutdown, daemon=True)
    t.start()
    t.join(5.0 + SHUTDOWN_GRACE)


def _request(prompt: list[int]) -> TensorDict:
    return TensorDict({PROMPT_KEY: torch.tensor(prompt, dtype=torch.int64)}, batch_size=[])


class _Hold:
    """Holds one forward of the suite's policy, in the server's thread, until released.

    A forward hook installed before the server is built (so a server that copies the policy
    copies the hook too). Armed, the next forward run by another thread than the suite's
    blocks after computing its logits: that batch is in flight, mid-generation, for as long
    as the suite wants. Disarmed, the hook does nothing.
    """

    def __init__(self, policy: Any) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._owner = threading.get_ident()
        self.entered = threading.Event()
        self._release = threading.Event()
        entered, release = self.entered, self._release

        # A closure, not a bound method: deepcopy shares a function but would copy an object
        # holding locks (and fail).
        def hook(_module: Any, _args: Any, _output: Any) -> None:
            if threading.get_ident() == self._owner:
                return  # served inline in the suite's thread: blocking would deadlock
            with self._lock:
                if not self._armed:
                    return
                self._armed = False
            entered.set()
            release.wait(WAIT)

        self._handle = policy.register_forward_hook(hook)

    @contextmanager
    def batch(self, server: Any, prompt: list[int]) -> Iterator[tuple[Any, bool]]:
        """Submits ``prompt`` and holds its batch in flight inside the block.

        Yields its future and whether the hold took (False: the server never ran the suite's
        policy in another thread, e.g. a copy rebuilt without hooks; the check goes on
        unheld). The batch is released on leaving the block, whatever happens.
        """
        with self._lock:
            self.entered.clear()
            self._release.clear()
            self._armed = True
        future = server.client().submit(_request(prompt))
        try:
            deadline = time.perf_counter() + WAIT
            while not self.entered.wait(0.01):
                if _outcome(future) != "pending" or time.perf_counter() > deadline:
                    break
            with self._lock:
                self._armed = False
            held = self.entered.is_set()
            if not held and _outcome(future) == "pending":
                raise _fail(f"prompt {prompt}: no response within {WAIT:.0f} s")
            yield future, held
        finally:
            self._release.set()

    def close(self) -> None:
        self._release.set()
        self._handle.remove()


@contextmanager
def _server(ctx: Context, policy: Any = None) -> Iterator[tuple[Any, Any, _Hold]]:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed) if policy is None else policy
    hold = _Hold(policy)
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    try:
        yield policy, server, hold
    finally:
        hold.close()
        t = threading.Thread(target=server.shutdown, daemon=True)
        t.start()
        t.join(5.0 + SHUTDOWN_GRACE)


def _alone(policy: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy answer and its log-probs, the model alone on this one prompt."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = policy.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=policy.config.eos_token_id,
        )
        resp = out[0, len(prompt) :].tolist()
        if policy.config.eos_token_id in resp:
            resp = resp[: resp.index(policy.config.eos_token_id) + 1]
        full = torch.tensor([[*prompt, *resp]])
        lp = policy(input_ids=full).logits[0, :-1].float().log_softmax(-1)
        lps = lp[len(prompt) - 1 :].gather(-1, full[0, len(prompt) :, None])[:, 0]
    return resp, lps


def _result(future: Any, what: str, wait: float = WAIT) -> TensorDictBase:
    try:
        out: TensorDictBase = future.result(timeout=wait)
    except (TimeoutError, FuturesTimeout):
        raise _fail(f"{what}: no response within {wait:.0f} s") from None
    return out


def _outcome(handle: Any) -> str:
    """``"served"``, ``"failed"`` or ``"pending"``, read through ``.result(timeout)`` alone:
    the Protocol promises nothing else of what ``submit`` returns. A cancelled future is a
    settled failure."""
    try:
        handle.result(timeout=0)
    except (TimeoutError, FuturesTimeout):
        return "pending"
    except (Exception, CancelledError):
        return "failed"
    return "served"


def _check_layout(out: Any, what: str) -> None:
    if not isinstance(out, TensorDictBase):
        raise _fail(f"{what}: response is {type(out).__name__}, expected a TensorDict")
    toks = out.get(RESPONSE_KEY, None)
    lps = out.get(RESPONSE_LOG_PROBS_KEY, None)
    ver = out.get("policy_version", None)
    if toks is None or lps is None or ver is None:
        missing = [
            k
            for k, v in (
                (RESPONSE_KEY, toks),
                (RESPONSE_LOG_PROBS_KEY, lps),
                ("policy_version", ver),
            )
            if v is None
        ]
        raise _fail(f"{what}: response lacks {missing}")
    if toks.dtype != torch.int64 or toks.ndim != 1 or not 1 <= toks.numel() <= MAX_NEW:
        raise _fail(
            f"{what}: {RESPONSE_KEY!r} is {toks.dtype} {list(toks.shape)}, expected int64 [1..{MAX_NEW}]"
        )
    if lps.dtype != torch.float32 or lps.shape != toks.shape:
        raise _fail(
            f"{what}: {RESPONSE_LOG_PROBS_KEY!r} is {lps.dtype} {list(lps.shape)}, expected float32 {list(toks.shape)}"
        )
    if ver.dtype != torch.int64 or ver.ndim != 0:
        raise _fail(f"{what}: policy_version is {ver.dtype} {list(ver.shape)}, expected int64 []")


def _mismatch(out: TensorDictBase, want: tuple[list[int], torch.Tensor]) -> str | None:
    """How a response differs from an expected (tokens, log-probs), or ``None``."""
    toks = out.get(RESPONSE_KEY).tolist()
    if toks != want[0]:
        return f"tokens {toks}, expected {want[0]}"
    lps = out.get(RESPONSE_LOG_PROBS_KEY)
    if lps.shape != want[1].shape:
        return f"log-probs of shape {list(lps.shape)}, expected {list(want[1].shape)}"
    diff = float((lps.float() - want[1]).abs().max())
    if not diff <= 1e-4:
        return f"tokens {toks} as expected, but log-probs differ by {diff:.2e}"
    return None


@requirement("GEN-001")
def response_layout(ctx: Context) -> None:
    with _server(ctx) as (policy, server, _hold):
        eos = policy.config.eos_token_id
        for p in PROMPTS:
            out = _result(server.client().submit(_request(p)), f"prompt {p}")
            _check_layout(out, f"prompt {p}")
            toks = out.get(RESPONSE_KEY).tolist()
            if eos in toks[:-1]:
                raise _fail(f"prompt {p}: response {toks} goes on after EOS ({eos})")
    # A policy that answers EOS at once: the response is that one token.
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    policy.load_state_dict(forced_token_weights(policy, policy.config.eos_token_id))
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    try:
        toks = _result(server.client().submit(_request(PROMPTS[0])), "EOS first").get(RESPONSE_KEY)
        if toks.tolist() != [policy.config.eos_token_id]:
            raise _fail(
                f"a policy that emits EOS first got response {toks.tolist()}, expected only EOS"
            )
    finally:
        t = threading.Thread(target=server.shutdown, daemon=True)
        t.start()
        t.join(5.0 + SHUTDOWN_GRACE)


@requirement("GEN-002")
def own_response(ctx: Context) -> None:
    with _server(ctx) as (policy, server, hold):
        alone = {tuple(p): _alone(policy, p) for p in PROMPTS}
        answered: set[tuple[int, ...]] = set()
        errors: list[str] = []
        barrier = threading.Barrier(len(PROMPTS))

        def caller(prompt: list[int]) -> None:
            client = server.client()
            try:
                barrier.wait(timeout=WAIT)
                for _ in range(3):
                    out = _result(client.submit(_request(prompt)), f"prompt {prompt}")
                    answered.add(tuple(prompt))
                    # Tokens and log-probs: two prompts may share a greedy answer, not its scores.
                    wrong = _mismatch(out, alone[tuple(prompt)])
                    if wrong:
                        errors.append(f"prompt {prompt} got {wrong}")
            except Exception as e:
                errors.append(f"prompt {prompt}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=caller, args=(p,), daemon=True) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        if errors:
            raise _fail(f"{len(PROMPTS)} concurrent callers: " + "; ".join(errors[:3]))
        if len(answered) != len(PROMPTS):
            raise _fail(f"only {len(answered)} of {len(PROMPTS)} concurrent callers were answered")

        # Several requests in flight on each client: queued behind a held batch, they are all
        # pending together when the answers come back.
        per_client = [[PROMPTS[(2 * i + k) % len(PROMPTS)] for k in range(4)] for i in range(4)]
        with hold.batch(server, PROMPTS[0]) as (blocker, _held):
            sent = []
            for i, prompts in enumerate(per_client):
                client = server.client()
                sent += [(i, p, client.submit(_request(p))) for p in prompts]
        _result(blocker, f"prompt {PROMPTS[0]}")
        for i, p, f in sent:
            wrong = _mismatch(_result(f, f"prompt {p}"), alone[tuple(p)])
            if wrong:
                raise _fail(
                    f"client {i} with {len(per_client[i])} requests in flight "
                    f"({per_client[i]}): prompt {p} got {wrong}"
                )
    _own_response_domain(ctx)


def _own_response_domain(ctx: Context) -> None:
    """Any prompts, submitted together on new clients, then one after another on one client
    whose request and prompt tensor are reused once answered (the caller's own buffer): the
    prompt a view at an offset into one storage, rewritten in place with the next prompt."""
    from hypothesis import strategies as st

    answers = _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed))  # a twin of the served

    def one(prompts: list[list[int]]) -> None:
        server = ctx.make(tiny_causal_lm(vocab_size=V, seed=ctx.seed), max_new_tokens=MAX_NEW)
        try:
            burst = [(p, server.client().submit(_request(p))) for p in prompts]
            for p, f in burst:
                wrong = _mismatch(_result(f, f"prompt {p}"), answers(p))
                if wrong:
                    raise _fail(f"prompts {prompts} submitted together: prompt {p} got {wrong}")
            client = server.client()
            store = torch.zeros(32, dtype=torch.int64)
            request = TensorDict({PROMPT_KEY: store[1 : 1 + len(prompts[0])]}, batch_size=[])
            for k, p in enumerate(prompts):
                view = store[1 : 1 + len(p)]
                view.copy_(torch.tensor(p, dtype=torch.int64))
                if request.get(PROMPT_KEY).shape != view.shape:
                    request.set(PROMPT_KEY, view)
                out = _result(client.submit(request), f"prompt {p}")
                wrong = _mismatch(out, answers(p))
                if wrong:
                    raise _fail(
                        f"one client reusing its request (prompt rewritten in place once "
                        f"answered), request {k + 1} of {prompts}: prompt {p} got {wrong}"
                    )
        finally:
            _stop(server)

    explore.for_all(
        ctx,
        st.lists(_prompts(), min_size=1, max_size=6),
        one,
        examples=4,
        boundaries=[EDGE_PROMPTS, [[5, 6, 7], [8, 9, 10], [5, 6, 7], [PAD, EOS]]],
    )


@requirement("GEN-003")
def batching_does_not_change_results(ctx: Context) -> None:
    # Alone on one server, in a batch on another: a response cache (legitimate for greedy
    # decoding) cannot answer the batched run with what the alone run computed.
    with _server(ctx) as (_policy, server, _hold):
        client = server.client()
        alone = {tuple(p): _result(client.submit(_request(p)), f"{p} alone") for p in PROMPTS}
    with _server(ctx) as (_policy, server, _hold):
        burst = [(p, server.client().submit(_request(p))) for p in PROMPTS * 4]  # batched
        for p, f in burst:
            want = alone[tuple(p)]
            wrong = _mismatch(
                _result(f, f"{p} in a burst"),
                (want.get(RESPONSE_KEY).tolist(), want.get(RESPONSE_LOG_PROBS_KEY).float()),
            )
            if wrong:
                raise _fail(f"prompt {p} served alone and among others: {wrong} (alone)")

    # A row that ends at EOS in a batch whose other rows go on: nothing may follow its EOS.
    # A held batch makes the rows queue, so they are served together.
    def eos_policy() -> Any:
        policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
        policy.load_state_dict(next_token_weights(policy, EOS_TABLE))
        return policy

    eos = eos_policy().config.eos_token_id
    with _server(ctx, eos_policy()) as (_policy, server, _hold):
        alone_eos = _result(server.client().submit(_request(EOS_PROMPT)), f"{EOS_PROMPT} alone")
    with _server(ctx, eos_policy()) as (_policy, server, hold):
        with hold.batch(server, LONG_PROMPTS[0]) as (blocker, _held):
            rows = [(p, server.client().submit(_request(p))) for p in [EOS_PROMPT, *LONG_PROMPTS]]
        _result(blocker, f"prompt {LONG_PROMPTS[0]}")
        outs = {tuple(p): _result(f, f"{p} in a batch") for p, f in rows}
    alone_toks = alone_eos.get(RESPONSE_KEY).tolist()
    wrong = _mismatch(
        outs[tuple(EOS_PROMPT)], (alone_toks, alone_eos.get(RESPONSE_LOG_PROBS_KEY).float())
    )
    if wrong:
        got = outs[tuple(EOS_PROMPT)].get(RESPONSE_KEY).tolist()
        after = len(got) - got.index(eos) - 1 if eos in got else 0
        longer = [outs[tuple(p)].get(RESPONSE_KEY).numel() for p in LONG_PROMPTS]
        raise _fail(
            f"prompt {EOS_PROMPT}, whose answer ends at EOS ({eos}), served alone gave "
            f"{alone_toks}; batched with rows of {longer} tokens it gave {wrong} (alone)"
            + (f": {after} tokens after EOS" if after else "")
        )


@requirement("GEN-004")
def behaviour_log_probs(ctx: Context) -> None:
    with _server(ctx) as (policy, server, _hold):
        for p in PROMPTS[:3]:
            out = _result(server.client().submit(_request(p)), f"prompt {p}")
            toks = out.get(RESPONSE_KEY)
            full = torch.tensor([[*p, *toks.tolist()]])
            with torch.no_grad():
                lp = policy(input_ids=full).logits[0, :-1].float().log_softmax(-1)
            want = lp[len(p) - 1 :].gather(-1, full[0, len(p) :, None])[:, 0]
            diff = (out.get(RESPONSE_LOG_PROBS_KEY) - want).abs().max()
            if diff > 1e-4:
                raise _fail(
                    f"prompt {p}: response log-probs differ from the model's by {float(diff):.2e}"
                )
        twin = tiny_causal_lm(vocab_size=V, seed=ctx.seed)  # the served weights, hook-free

        def one(p: list[int]) -> None:
            out = _result(server.client().submit(_request(p)), f"prompt {p}")
            toks = out.get(RESPONSE_KEY)
            full = torch.tensor([[*p, *toks.tolist()]])
            with torch.no_grad():
                lp = twin(input_ids=full).logits[0, :-1].float().log_softmax(-1)
            want = lp[len(p) - 1 :].gather(-1, full[0, len(p) :, None])[:, 0]
            got = out.get(RESPONSE_LOG_PROBS_KEY)
            diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
            if not diff <= 1e-4:
                raise _fail(
                    f"prompt {p}, response {toks.tolist()}: log-probs differ from the model's "
                    f"by {diff:.2e}"
                )

        explore.for_all(ctx, _prompts(), one, examples=6, boundaries=EDGE_PROMPTS)


@requirement("GEN-005")
def version_stamped(ctx: Context) -> None:
    old = tiny_causal_lm(vocab_size=V, seed=ctx.seed)  # the served weights, hook-free
    new = tiny_causal_lm(vocab_size=V, seed=ctx.seed + 1)
    prompt = PROMPTS[2]
    answers = {"the previous weights": _alone(old, prompt), "the new weights": _alone(new, prompt)}
    with _server(ctx) as (_policy, server, hold):
        v0 = int(server.policy_version)
        out = _result(server.client().submit(_request(PROMPTS[0])), "before update")
        if int(out.get("policy_version")) != v0:
            raise _fail(f"response stamped {int(out.get('policy_version'))}, server version {v0}")
        server.update_policy_weights_(None)
        v1 = int(server.policy_version)
        if v1 <= v0:
            raise _fail(f"policy_version went from {v0} to {v1} after an update")
        out = _result(server.client().submit(_request(PROMPTS[0])), "after update")
        if int(out.get("policy_version")) != v1:
            raise _fail(
                f"response after the update stamped {int(out.get('policy_version'))}, expected {v1}"
            )

        # New weights arrive while a batch is held in flight, mid-generation. Its stamp must
        # name the weights that produced every one of its tokens and log-probs.
        returned = threading.Event()
        errors: list[BaseException] = []

        def update() -> None:
            try:
                server.update_policy_weights_(new.state_dict())
            except BaseException as e:  # re-raised in the suite's thread
                errors.append(e)
            finally:
                returned.set()

        with hold.batch(server, prompt) as (inflight, held):
            threading.Thread(target=update, daemon=True).start()
            # Released once the update returned or bumped the version, or after UPDATE_RACE
            # (an update that waits for the batch in progress).
            deadline = time.perf_counter() + UPDATE_RACE
            while (
                not returned.is_set()
                and int(server.policy_version) == v1
                and time.perf_counter() < deadline
            ):
                time.sleep(0.005)
        what = "a batch " + ("held in flight" if held else "in flight") + " during an update"
        out = _result(inflight, what)
        if not returned.wait(WAIT):
            raise _fail(f"update_policy_weights_ has not returned {WAIT:.0f} s after {what}")
        if errors:
            raise errors[0]
        v2 = int(server.policy_version)
        if v2 <= v1:
            raise _fail(f"policy_version went from {v1} to {v2} after an update")
        stamp = int(out.get("policy_version"))
        by_stamp = {v1: "the previous weights", v2: "the new weights"}
        if stamp not in by_stamp:
            raise _fail(
                f"{what} was stamped {stamp}, neither the version before ({v1}) nor after ({v2})"
            )
        wrong = _mismatch(out, answers[by_stamp[stamp]])
        if wrong:
            other = next(w for w in answers if w != by_stamp[stamp])
            hint = f"; it is {other}' answer" if _mismatch(out, answers[other]) is None else ""
            raise _fail(
                f"{what} was stamped {stamp} ({by_stamp[stamp]}), but its answer is not "
                f"theirs: {wrong}{hint}"
            )

    explore.run_machine(ctx, _machine(ctx), examples=4, steps=10)


def _machine(ctx: Context) -> type[Any]:
    """Random request lives and updates against a model of the spec (GEN-005, GEN-006).

    The model: the weights of every version the server reported, and for each pending request
    the versions in force from its submit on. A response must be stamped with one of those and
    be, token for token and log-prob for log-prob, that version's greedy answer alone; every
    update (new weights, the same weights again, or the policy changed in place and no
    argument) must raise ``policy_version``. Requests come from new or reused clients, with
    any prompt, and are awaited in any order.
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    pool = [tiny_causal_lm(vocab_size=V, seed=ctx.seed + k).state_dict() for k in range(3)]
    twins = {k: _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed + k)) for k in range(3)}

    class GenerationMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
            self.server = ctx.make(self.policy, max_new_tokens=MAX_NEW)
            self.clients = [self.server.client()]
            self.version = int(self.server.policy_version)
            self.weights = {self.version: 0}  # version -> index into pool
            self.pending: list[tuple[list[int], Any, list[int]]] = []

        @rule(prompt=_prompts(), new_client=st.booleans())
        def submit(self, prompt: list[int], new_client: bool) -> None:
            if new_client:
                self.clients.append(self.server.client())
            future = self.clients[-1].submit(_request(prompt))
            self.pending.append((prompt, future, [self.version]))

        @rule(which=st.sampled_from(("another", "the same", "in place")), k=st.integers(1, 2))
        def update(self, which: str, k: int) -> None:
            if which == "in place" and self.pending:
                which = "another"  # the policy changes under no request in flight
            now = self.weights[self.version]
            target = now if which == "the same" else (now + k) % len(pool)
            before = int(self.server.policy_version)
            if which == "in place":
                self.policy.load_state_dict(pool[target])
                self.server.update_policy_weights_()
                call = "the policy changed in place, then update_policy_weights_()"
            else:
                self.server.update_policy_weights_(pool[target])
                call = f"update_policy_weights_({which} weights)"
            after = int(self.server.policy_version)
            if after <= before:
                raise _fail(f"policy_version went from {before} to {after} after {call}")
            self.version = after
            self.weights[after] = target
            for _p, _f, allowed in self.pending:
                allowed.append(after)

        @precondition(lambda self: bool(self.pending))
        @rule(data=st.data())
        def answer(self, data: Any) -> None:
            self._answer(data.draw(st.integers(0, len(self.pending) - 1), label="request"))

        def _answer(self, i: int) -> None:
            prompt, future, allowed = self.pending.pop(i)
            out = _result(future, f"prompt {prompt}")
            _check_layout(out, f"prompt {prompt}")
            stamp = int(out.get("policy_version"))
            if stamp not in allowed:
                raise _fail(
                    f"prompt {prompt} was stamped {stamp}; the versions in force from its "
                    f"submit to its answer were {allowed}"
                )
            wrong = _mismatch(out, twins[self.weights[stamp]](prompt))
            if wrong:
                raise _fail(
                    f"prompt {prompt} was stamped {stamp}, but its answer is not the greedy "
                    f"answer of version {stamp}'s weights: {wrong}"
                )

        def teardown(self) -> None:
            try:
                while self.pending:
                    self._answer(0)
            finally:
                _stop(self.server)

    GenerationMachine.__name__ = "GenerationMachine"
    return GenerationMachine


def _served_by(sent: list[tuple[list[int], Any]], want: dict[Any, Any], when: str) -> None:
    bad = []
    for p, f in sent:
        wrong = _mismatch(_result(f, f"prompt {p} {when}"), want[tuple(p)])
        if wrong:
            bad.append(f"{p}: {wrong}")
    if bad:
        more = f" ... and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise _fail(
            f"{when}, {len(bad)} of {len(sent)} answers are not the new weights' (greedy, the "
            "model alone): " + "; ".join(bad[:3]) + more
        )


@requirement("GEN-006")
def new_weights_used(ctx: Context) -> None:
    new = tiny_causal_lm(vocab_size=V, seed=ctx.seed + 1)
    newer = tiny_causal_lm(vocab_size=V, seed=ctx.seed + 2)
    with _server(ctx) as (policy, server, _hold):
        # Every prompt served once first: a cache kept from the old weights would answer these.
        for f in [server.client().submit(_request(p)) for p in PROMPTS]:
            _result(f, "before the update")
        early = [server.client().submit(_request(p)) for p in PROMPTS]  # in flight meanwhile
        server.update_policy_weights_(new.state_dict())
        late = [(p, server.client().submit(_request(p))) for p in PROMPTS]
        for f in early:
            _result(f, "in flight during the update")
        _served_by(
            late,
            {tuple(p): _alone(new, p) for p in PROMPTS},
            "after update_policy_weights_(weights) returned",
        )
        # The Protocol's other form: the policy changed in place, then no argument.
        policy.load_state_dict(newer.state_dict())
        server.update_policy_weights_()
        _served_by(
            [(p, server.client().submit(_request(p))) for p in PROMPTS],
            {tuple(p): _alone(newer, p) for p in PROMPTS},
            "after the policy changed in place and update_policy_weights_() (no argument: "
            "re-read the policy's own) returned",
        )


@requirement("GEN-007")
def bad_request_isolated(ctx: Context) -> None:
    with _server(ctx) as (policy, server, _hold):
        bad_key = TensorDict({("tokens", "prompts"): torch.tensor([5, 6])}, batch_size=[])
        bad_dtype = TensorDict({PROMPT_KEY: torch.tensor([5.0, 6.0])}, batch_size=[])
        good_before = server.client().submit(_request(PROMPTS[0]))
        futures = {
            "missing key": server.client().submit(bad_key),
            "float prompt": server.client().submit(bad_dtype),
        }
        good_with = server.client().submit(_request(PROMPTS[1]))
        for what, f in futures.items():
            try:
                f.result(timeout=REFUSE_WAIT)
            except (TimeoutError, FuturesTimeout):
                raise _fail(f"{what}: the bad request's future never resolved") from None
            except Exception as e:
                if repr(PROMPT_KEY) not in str(e) and "tokens.prompt" not in str(e):
                    raise _fail(
                        f"{what}: failed without naming the key {PROMPT_KEY!r}: {e}"
                    ) from None
            else:
                raise _fail(f"{what}: the bad request was answered instead of failing")
        for p, f in ((PROMPTS[0], good_before), (PROMPTS[1], good_with)):
            out = _result(f, f"valid request {p} next to bad ones", REFUSE_WAIT)
            _check_layout(out, f"valid request {p}")
            if out.get(RESPONSE_KEY).tolist() != _alone(policy, p)[0]:
                raise _fail(f"valid request {p} next to bad ones got another answer")
        later = _result(
            server.client().submit(_request(PROMPTS[2])), "a request after the bad ones"
        )
        if later.get(RESPONSE_KEY).tolist() != _alone(policy, PROMPTS[2])[0]:
            raise _fail("after bad requests the server answers wrongly")
        answers = _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed))

        def one(case: tuple[str, Any, list[int]]) -> None:
            kind, fault, p = case
            if kind == "dtype":
                bad = TensorDict({PROMPT_KEY: torch.tensor(p).to(fault)}, batch_size=[])
                what = f"prompt {p} as {fault}"
            else:
                bad = TensorDict({fault: torch.tensor(p)}, batch_size=[])
                what = f"prompt {p} under key {fault!r} instead of {PROMPT_KEY!r}"
            f_bad = server.client().submit(bad)
            f_good = server.client().submit(_request(p))
            try:
                f_bad.result(timeout=REFUSE_WAIT)
            except (TimeoutError, FuturesTimeout):
                raise _fail(f"{what}: the bad request's future never resolved") from None
            except (Exception, CancelledError) as e:
                if repr(PROMPT_KEY) not in str(e) and "tokens.prompt" not in str(e):
                    raise _fail(
                        f"{what}: failed without naming the key {PROMPT_KEY!r}: {e}"
                    ) from None
            else:
                raise _fail(f"{what}: the bad request was answered instead of failing")
            wrong = _mismatch(_result(f_good, f"valid request {p} next to {what}"), answers(p))
            if wrong:
                raise _fail(f"valid request {p} next to a bad one ({what}) got {wrong}")

        from hypothesis import strategies as st

        faults = st.one_of(
            st.tuples(st.just("dtype"), st.sampled_from(BAD_DTYPES), _prompts()),
            st.tuples(st.just("key"), st.sampled_from(BAD_KEYS), _prompts()),
        )
        explore.for_all(
            ctx,
            faults,
            one,
            examples=5,
            boundaries=[
                ("dtype", torch.int32, [5, 6]),
                ("dtype", torch.uint8, [PAD, EOS]),
                ("dtype", torch.bool, [1, 0]),
                ("key", ("prompt",), [5]),
            ],
        )


# Wrong prompt dtypes (GEN-007's domain): floats, narrower integers (a server that casts
# int32 to int64 takes them), bytes and booleans; keys a prompt may be misfiled under.
BAD_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int16,
    torch.uint8,
    torch.bool,
)
BAD_KEYS = (("tokens", "prompts"), ("prompt",), ("tokens", "response"), ("input_ids",))


@requirement("GEN-008")
def shutdown_resolves_everything(ctx: Context) -> None:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    futures = [server.client().submit(_request(p)) for p in PROMPTS * 4]
    done = threading.Event()

    def stop() -> None:
        server.shutdown(5.0)
        server.shutdown(5.0)  # idempotent
        done.set()

    t = threading.Thread(target=stop, daemon=True)
    start = time.perf_counter()
    t.start()
    t.join(5.0 + SHUTDOWN_GRACE)
    if not done.is_set():
        raise _fail(
            f"shutdown(5.0) with {len(futures)} pending requests has not returned after "
            f"{5.0 + SHUTDOWN_GRACE:.0f} s (hangs)"
        )
    elapsed = time.perf_counter() - start
    outcomes = [_outcome(f) for f in futures]
    if "pending" in outcomes:
        raise _fail(
            f"after shutdown returned ({elapsed:.1f} s), {outcomes.count('pending')} futures "
            "are still pending"
        )
    mode = ctx.options.get("on_shutdown", "fail")
    failed = outcomes.count("failed")
    if mode == "drain" and failed:
        raise _fail(
            f"on_shutdown='drain' declared, but {failed} pending requests failed or were cancelled"
        )
    if mode == "fail":
        _queued_requests_fail(ctx)


def _queued_requests_fail(ctx: Context) -> None:
    """on_shutdown='fail': requests still queued at shutdown fail (or are cancelled).

    Every forward the server runs in its own threads is held at a gate the suite owns, so
    nothing is served before ``shutdown`` is called: a server that then serves every one of
    the requests, more of them than it had forwards in flight, drained them. Requests in
    flight may still be served (``ThreadPoolExecutor.shutdown(cancel_futures=True)`` lets
    running tasks finish), so the check needs more requests than held forwards.
    """
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    gate = _Gate(policy)
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    try:
        first = server.client().submit(_request(PROMPTS[0]))
        deadline = time.perf_counter() + WAIT
        while not gate.entered.wait(0.01):
            if _outcome(first) != "pending" or time.perf_counter() > deadline:
                return  # served inline or out of process: nothing the suite can hold
        futures = [first, *(server.client().submit(_request(p)) for p in PROMPTS * 2)]
        time.sleep(0.1)  # let idle workers take what they can: they block at the gate too
        pending = [f for f in futures if _outcome(f) == "pending"]
        held = gate.count
        called = threading.Event()

        def stop() -> None:
            called.set()
            server.shutdown(5.0)

        t = threading.Thread(target=stop, daemon=True)
        t.start()
        called.wait(WAIT)
        deadline = time.perf_counter() + 0.5  # for shutdown to mark what it fails
        while time.perf_counter() < deadline and t.is_alive():
            if any(_outcome(f) != "pending" for f in pending):
                break
            time.sleep(0.01)
        gate.open()
        t.join(5.0 + SHUTDOWN_GRACE)
    finally:
        gate.close()
        last = threading.Thread(target=server.shutdown, args=(5.0,), daemon=True)
        last.start()
        last.join(5.0 + SHUTDOWN_GRACE)
    served = [_outcome(f) for f in pending].count("served")
    if pending and served == len(pending) > held:
        raise _fail(
            f"on_shutdown='fail' declared (the default), but all {served} requests pending at "
            f"shutdown were served, with {held} forward(s) in flight: the queued ones were "
            "drained, not failed"
        )


class _Gate:
    """Holds every forward of the suite's policy run outside the suite's thread until opened.

    Installed before the server is built, so a server that copies the policy copies the hook.
    """

    def __init__(self, policy: Any) -> None:
        self._owner = threading.get_ident()
        self._lock = threading.Lock()
        self._open = threading.Event()
        self.entered = threading.Event()
        self.count = 0
        opened, entered = self._open, self.entered

        # A closure, not a bound method: deepcopy shares a function (see _Hold).
        def hook(_module: Any, _args: Any, _output: Any) -> None:
            if threading.get_ident() == self._owner or opened.is_set():
                return
            with self._lock:
                self.count += 1
            entered.set()
            opened.wait(WAIT)

        self._handle = policy.register_forward_hook(hook)

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.set()
        self._handle.remove()


@requirement("GEN-009")
def closed_server_refuses(ctx: Context) -> None:
    with _server(ctx) as (_policy, server, _hold):
        before = server.client()  # taken, and used, while the server was serving
        _result(before.submit(_request(PROMPTS[0])), "before shutdown")
        server.shutdown(5.0)
        outcome: dict[str, str] = {}

        def attempt(what: str, client: Any) -> None:
            try:
                client().submit(_request(PROMPTS[0])).result(timeout=REFUSE_WAIT)
                outcome[what] = "answered"
            except (TimeoutError, FuturesTimeout):
                outcome[what] = "hung"
            except (Exception, CancelledError):  # a cancelled future is a refusal too
                outcome[what] = "refused"

        ways = {"a client taken before shutdown": lambda: before, "a new client": server.client}
        threads = [threading.Thread(target=attempt, args=w, daemon=True) for w in ways.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REFUSE_WAIT + 5)
        bad = [f"{w}: {outcome.get(w, 'hung')}" for w in ways if outcome.get(w) != "refused"]
        if bad:
            raise _fail(
                "a request after shutdown() through " + "; ".join(bad) + ", expected a clear error"
            )


@requirement("GEN-010")
def statistics(ctx: Context) -> None:
    with _server(ctx) as (_policy, server, _hold):
        for f in [server.client().submit(_request(p)) for p in PROMPTS]:
            _result(f, "serving")
        stats = dict(server.stats())
        if not isinstance(stats.get("batch_size"), int | float) or stats["batch_size"] < 1:
            raise _fail(
                f"stats()['batch_size'] is {stats.get('batch_size')!r} after serving 8 requests"
            )
        for key in ("queue_wait_s", "batch_size", "forward_s"):
            v = stats.get(key)
            if not isinstance(v, int | float) or not v >= 0 or v != v or v == float("inf"):
                raise _fail(
                    f"stats()[{key!r}] is {v!r}; expected a finite number >= 0 (found keys {sorted(stats)})"
                )


def _remote_caller(client: Any, prompt: list[int], out: Any) -> None:  # pragma: no cover - child
    try:
        res = client.submit(_request(prompt)).result(timeout=WAIT)
        out.put((prompt, res.get(RESPONSE_KEY).tolist()))
    except Exception as e:
        out.put((prompt, f"{type(e).__name__}: {e}"))


@requirement("GEN-011")
def clients_in_other_processes(ctx: Context) -> None:
    if "processes" not in ctx.capabilities:
        raise NotApplicable("capability 'processes' not declared")
    with _server(ctx) as (policy, server, _hold):
        queue = mp.get_context("spawn").Queue()
        # The clients' deadline follows how slowly they started: a busy machine is no failure.
        procs = Spawned(_remote_caller, [(server.client(), p, queue) for p in PROMPTS[:3]])
        try:
            until = time.monotonic() + procs.deadline_s(WAIT)
            items = [queue.get(timeout=max(0.1, until - time.monotonic())) for _ in procs.procs]
        except (TimeoutError, Empty) as e:
            procs.terminate()
            raise _fail(
                str(e)
                if isinstance(e, TimeoutError)
                else f"a client in another process had no response "
                f"{procs.deadline_s(WAIT):.0f} s after it started"
            ) from None
        procs.join(WAIT)
        got = {tuple(p): v for p, v in items}
        for p in PROMPTS[:3]:
            if got.get(tuple(p)) != _alone(policy, p)[0]:
                raise _fail(f"a client in another process asked {p} and got {got.get(tuple(p))!r}")
