"""The generation-server suite: one check per GEN requirement (specs/generation-v1.md).

The suite supplies a tiny real HF causal LM. Expected answers come from a model run alone,
greedily, on one prompt at a time: new weights are a second random init of the same tiny
policy, and every token and log-prob served after an update is compared with it. Races are
made deterministic by a forward hook the suite puts on its policy: it holds a batch in flight
on an Event while the suite updates weights or queues more requests. Every wait has a
timeout, so a hanging server fails instead of stalling the run. The harness (policy,
requests, answers, holds) is :mod:`~posttrain.conformance.suites.generation_serving`; GEN-005's
model of the spec and its state machine are :mod:`~posttrain.conformance.suites.generation_model`.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before 3.11
from queue import Empty
from typing import Any

import torch
from tensordict import TensorDict

from posttrain.conformance import explore
from posttrain.conformance._spawn import Spawned
from posttrain.conformance.context import Context, NotApplicable
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites.generation_model import (
    concurrent_rounds,
    machine,
    weights_pool,
)
from posttrain.conformance.suites.generation_serving import (
    CANCEL_WAIT,
    EDGE_PROMPTS,
    EOS,
    EOS_PROMPT,
    EOS_TABLE,
    LONG_PROMPTS,
    MAX_NEW,
    PAD,
    PROMPTS,
    REFUSE_WAIT,
    SHUTDOWN_GRACE,
    UPDATE_RACE,
    WAIT,
    V,
    _alone,
    _Answers,
    _check_layout,
    _Gate,
    _mismatch,
    _outcome,
    _outcomes,
    _prompts,
    _request,
    _result,
    _results,
    _server,
    _stop,
    _Together,
)
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY
from posttrain.testing import forced_token_weights, tiny_causal_lm
from posttrain.testing.policies import next_token_weights


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
        _stop(server)
    _budgets(ctx)


# max_new_tokens GEN-001 tries besides MAX_NEW: one token (an engine whose first token comes
# from prefill and decodes max_new_tokens - 1 more answers nothing) and a longer budget.
BUDGETS = (1, MAX_NEW + 2)


def _budgets(ctx: Context) -> None:
    """GEN-001 for servers built with other ``max_new_tokens``: 1 <= R <= max_new_tokens."""
    prompts = [PROMPTS[3], PROMPTS[0], [PAD], [EOS, V - 1]]
    for max_new in BUDGETS:
        with _server(ctx, max_new=max_new) as (policy, server, _hold):
            eos = policy.config.eos_token_id
            whats = [f"prompt {p} on a server built with max_new_tokens={max_new}" for p in prompts]
            burst = [
                (w, server.client().submit(_request(p)))
                for w, p in zip(whats, prompts, strict=True)
            ]
            for what, out in zip(whats, _results(burst), strict=True):  # one batch
                _check_layout(out, what, max_new)
                toks = out.get(RESPONSE_KEY).tolist()
                if eos in toks[:-1]:
                    raise _fail(f"{what}: response {toks} goes on after EOS ({eos})")


@requirement("GEN-002")
def own_response(ctx: Context) -> None:
    with _server(ctx) as (policy, server, hold):
        alone = {tuple(p): _alone(policy, p) for p in PROMPTS}
        answered: set[tuple[int, ...]] = set()
        errors: list[str] = []
        barrier = threading.Barrier(len(PROMPTS))
        together = _Together()  # a caller still waiting long after the others is lost

        def caller(prompt: list[int]) -> None:
            client = server.client()
            try:
                barrier.wait(timeout=WAIT)
                for _ in range(3):
                    out = together.result(client.submit(_request(prompt)), f"prompt {prompt}")
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
        outs = _results(
            [(f"prompt {PROMPTS[0]}", blocker), *((f"prompt {p}", f) for _i, p, f in sent)]
        )
        for (i, p, _f), out in zip(sent, outs[1:], strict=True):
            wrong = _mismatch(out, alone[tuple(p)])
            if wrong:
                raise _fail(
                    f"client {i} with {len(per_client[i])} requests in flight "
                    f"({per_client[i]}): prompt {p} got {wrong}"
                )
    _own_response_domain(ctx)
    _cancellations(ctx)


def _own_response_domain(ctx: Context) -> None:
    """Any prompts, submitted together on new clients, then one after another on one client
    whose request and prompt tensor are reused once answered (the caller's own buffer): the
    prompt a view at an offset into one storage, rewritten in place with the next prompt."""
    from hypothesis import strategies as st

    answers = _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed))  # a twin of the served

    def one(prompts: list[list[int]]) -> None:
        server = ctx.make(tiny_causal_lm(vocab_size=V, seed=ctx.seed), max_new_tokens=MAX_NEW)
        try:
            burst = [(f"prompt {p}", server.client().submit(_request(p))) for p in prompts]
            for p, out in zip(prompts, _results(burst), strict=True):
                wrong = _mismatch(out, answers(p))
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


# Where in its life a caller cancels its own request: right after submit, queued behind a batch
# in flight, while its own batch is in flight, and after it was answered.
CANCEL_POINTS = ("submitted", "queued", "in flight", "answered")


def _cancel(future: Any) -> bool:
    """Cancels ``future`` where it can be (the Protocol promises ``.result`` only)."""
    cancel = getattr(future, "cancel", None)
    if not callable(cancel):
        return False
    cancel()
    return True


def _cancellations(ctx: Context) -> None:
    """A caller cancels its future at each point of its request's life; every other caller's
    requests, in flight then and submitted later, must still get their own responses."""
    twin = _Answers(tiny_causal_lm(vocab_size=V, seed=ctx.seed))  # the served weights
    with _server(ctx) as (_policy, server, hold):
        for k, point in enumerate(CANCEL_POINTS):
            mine, others = PROMPTS[k], [PROMPTS[(k + j) % len(PROMPTS)] for j in (4, 5)]
            sent: list[tuple[list[int], Any]] = []
            if point in ("queued", "in flight"):
                blocker = PROMPTS[7] if point == "queued" else mine
                with hold.batch(server, blocker) as (held_future, _held):
                    victim = held_future
                    if point == "queued":
                        victim = server.client().submit(_request(mine))
                        sent.append((blocker, held_future))
                    if not _cancel(victim):
                        return
                    sent += [(p, server.client().submit(_request(p))) for p in others[:1]]
            else:
                victim = server.client().submit(_request(mine))
                if point == "answered":
                    _result(victim, f"prompt {mine}")
                if not _cancel(victim):
                    return
            sent += [(p, server.client().submit(_request(p))) for p in others[1:]]
            for p, f in sent:
                out = _result(
                    f, f"after a caller cancelled its request {point}, prompt {p}", CANCEL_WAIT
                )
                wrong = _mismatch(out, twin(p))
                if wrong:
                    raise _fail(
                        f"after a caller cancelled its request {point}, prompt {p} of another "
                        f"caller got {wrong}"
                    )


@requirement("GEN-003")
def batching_does_not_change_results(ctx: Context) -> None:
    # Alone on one server, in a batch on another: a response cache (legitimate for greedy
    # decoding) cannot answer the batched run with what the alone run computed.
    with _server(ctx) as (_policy, server, _hold):
        client = server.client()
        alone = {tuple(p): _result(client.submit(_request(p)), f"{p} alone") for p in PROMPTS}
    with _server(ctx) as (_policy, server, _hold):
        burst = [(f"{p} in a burst", server.client().submit(_request(p))) for p in PROMPTS * 4]
        for p, out in zip(PROMPTS * 4, _results(burst), strict=True):  # batched
            want = alone[tuple(p)]
            wrong = _mismatch(
                out,
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
        got = _results(
            [(f"prompt {LONG_PROMPTS[0]}", blocker), *((f"{p} in a batch", f) for p, f in rows)]
        )
        outs = {tuple(p): out for (p, _f), out in zip(rows, got[1:], strict=True)}
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
        # The same weights again (a trainer step that changed nothing): still an update.
        server.update_policy_weights_(new.state_dict())
        v3 = int(server.policy_version)
        if v3 <= v2:
            raise _fail(
                f"policy_version went from {v2} to {v3} after update_policy_weights_ with the "
                "weights it already served"
            )

    pool, twins = weights_pool(ctx)
    concurrent_rounds(ctx, pool, twins)  # updates from several threads at once
    explore.run_machine(ctx, machine(ctx, pool, twins), examples=4, steps=10)


def _served_by(sent: list[tuple[list[int], Any]], want: dict[Any, Any], when: str) -> None:
    bad = []
    outs = _results([(f"prompt {p} {when}", f) for p, f in sent])
    for (p, _f), out in zip(sent, outs, strict=True):
        wrong = _mismatch(out, want[tuple(p)])
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
        _results([("before the update", server.client().submit(_request(p))) for p in PROMPTS])
        early = [server.client().submit(_request(p)) for p in PROMPTS]  # in flight meanwhile
        server.update_policy_weights_(new.state_dict())
        late = [(p, server.client().submit(_request(p))) for p in PROMPTS]
        _results([("in flight during the update", f) for f in early])
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


# Timeouts GEN-008 passes to shutdown with requests pending: the usual bound, 0, and None (as
# long as it takes: under on_shutdown='drain' every pending request is served). None goes last:
# a server that hangs is told so after 5 s plus the grace, not after the 60 s None is given.
SHUTDOWN_TIMEOUTS: tuple[float | None, ...] = (5.0, 0.0, None)


@requirement("GEN-008")
def shutdown_resolves_everything(ctx: Context) -> None:
    mode = ctx.options.get("on_shutdown", "fail")
    for timeout in SHUTDOWN_TIMEOUTS:
        _shutdown_with_pending(ctx, timeout, mode)
    if mode == "fail":
        _queued_requests_fail(ctx)


def _shutdown_with_pending(ctx: Context, timeout: float | None, mode: str) -> None:
    """``shutdown(timeout)``, twice, with 32 requests pending: it returns within the timeout
    and leaves nothing pending; under ``drain`` with 5 s or None it served every request."""
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed)
    server = ctx.make(policy, max_new_tokens=MAX_NEW)
    futures = [server.client().submit(_request(p)) for p in PROMPTS * 4]
    done = threading.Event()

    def stop() -> None:
        server.shutdown(timeout)
        server.shutdown(timeout)  # idempotent
        done.set()

    call = f"shutdown({timeout}) with {len(futures)} pending requests"
    bound = (WAIT if timeout is None else timeout) + SHUTDOWN_GRACE
    t = threading.Thread(target=stop, daemon=True)
    start = time.perf_counter()
    t.start()
    t.join(bound)
    if not done.is_set():
        _stop(server)
        raise _fail(f"{call} has not returned after {bound:.0f} s (hangs)")
    elapsed = time.perf_counter() - start
    # A timeout shorter than the batch in flight: that batch may settle after shutdown
    # returns (as ThreadPoolExecutor's running tasks do), but never stay pending.
    outcomes = _outcomes(futures, SHUTDOWN_GRACE if timeout == 0.0 else 0.0)
    if "pending" in outcomes:
        after = f" and {SHUTDOWN_GRACE:.0f} s more" if timeout == 0.0 else ""
        raise _fail(
            f"after {call} returned ({elapsed:.1f} s){after}, "
            f"{outcomes.count('pending')} futures are still pending"
        )
    failed = outcomes.count("failed")
    if mode == "drain" and failed and timeout != 0.0:
        raise _fail(
            f"on_shutdown='drain' declared, but after {call}, {failed} pending requests failed "
            "or were cancelled; expected every one served"
            + (" (None: wait as long as they take)" if timeout is None else "")
        )


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
        _results([("serving", server.client().submit(_request(p))) for p in PROMPTS])
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
