"""The generation suite's harness: the policy, requests, expected answers and held forwards.

Expected answers come from a model run alone, greedily, on one prompt at a time. Races are made
deterministic by forward hooks the suite puts on its policy (:class:`_Hold` holds one batch in
flight, :class:`_Gate` every forward until opened). Every wait has a timeout, so a hanging
server fails instead of stalling the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeout  # not the builtin before 3.11
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY
from posttrain.testing import tiny_causal_lm

V = 64
MAX_NEW = 3
WAIT = 60.0
REFUSE_WAIT = 10.0  # a request after shutdown: an answer this late counts as a hang
CANCEL_WAIT = 10.0  # a request after another caller cancelled: an answer this late is a hang
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
def _server(
    ctx: Context, policy: Any = None, max_new: int = MAX_NEW
) -> Iterator[tuple[Any, Any, _Hold]]:
    policy = tiny_causal_lm(vocab_size=V, seed=ctx.seed) if policy is None else policy
    hold = _Hold(policy)
    server = ctx.make(policy, max_new_tokens=max_new)
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
    """The response to a valid request: its failure is the server's, a FAIL of the check."""
    try:
        out: TensorDictBase = future.result(timeout=wait)
    except (TimeoutError, FuturesTimeout) as e:
        if not _settled(future):
            raise _fail(f"{what}: no response within {wait:.0f} s") from None
        raise _fail(
            f"{what}: the valid request failed with {type(e).__name__}: {str(e)[:300]}; "
            "expected its response"
        ) from e
    except (Exception, CancelledError) as e:
        raise _fail(
            f"{what}: the valid request failed with {type(e).__name__}: {str(e)[:300]}; "
            "expected its response"
        ) from e
    return out


# A request still pending this many times as long after its batch-mates were answered as
# they took is lost, not slow (never less than CANCEL_WAIT): a correct server under load
# answers requests submitted together within a small multiple of one another.
STRAGGLER_FACTOR = 20.0
PENDING = object()  # what _Together.poll returns for a request not answered yet


class _Together:
    """The answers of requests submitted together, and how long to wait for the last ones.

    Until one of them is answered each may take ``WAIT``; after that a request still pending
    ``max(floor, STRAGGLER_FACTOR x`` the time the answered ones took``)`` (``floor``:
    ``CANCEL_WAIT``, never more than ``wait``) after the last answer is lost: the check fails
    then instead of waiting out ``WAIT``. Safe to share between caller threads.

    Example:
        >>> from concurrent.futures import Future
        >>> answered, lost = Future(), Future()
        >>> answered.set_result("out")
        >>> _Together(floor=0.1).results([("prompt [5]", answered), ("prompt [6]", lost)])
        Traceback (most recent call last):
        ...
        posttrain.conformance.context.ConformanceError: prompt [6]: no response ... s after the other 1 requests sent with it were answered (in ... s)
    """

    def __init__(self, wait: float = WAIT, floor: float = CANCEL_WAIT) -> None:
        self.wait, self.floor = wait, floor
        self.start = time.perf_counter()
        self.answered = 0
        self.last: float | None = None
        self._lock = threading.Lock()

    def _deadline(self) -> tuple[float, str | None]:
        with self._lock:
            if self.last is None:
                return self.start + self.wait, None
            took = self.last - self.start
            bound = min(self.wait, max(self.floor, STRAGGLER_FACTOR * took))
            return self.last + bound, (
                f"the other {self.answered} requests sent with it were answered (in {took:.1f} s)"
            )

    def _answered(self) -> None:
        with self._lock:
            self.answered += 1
            self.last = time.perf_counter()

    def poll(self, future: Any, what: str, wait: float = 0.0) -> Any:
        """``future``'s response, or ``PENDING`` while it is pending (``wait`` at most)."""
        try:
            out = future.result(timeout=wait)
        except (TimeoutError, FuturesTimeout):
            if not _settled(future):
                return PENDING
            return _result(future, what, 0.0)  # failed with a TimeoutError of its own
        except (Exception, CancelledError):
            return _result(future, what, 0.0)
        self._answered()
        return out

    def _late(self, what: str) -> None:
        deadline, after = self._deadline()
        now = time.perf_counter()
        if now < deadline:
            return
        if after is None:
            raise _fail(f"{what}: no response within {self.wait:.0f} s")
        assert self.last is not None
        raise _fail(f"{what}: no response {now - self.last:.1f} s after {after}")

    def result(self, future: Any, what: str) -> TensorDictBase:
        """``future``'s response (the check fails if it is lost, as the class says)."""
        while True:
            out = self.poll(future, what, 0.02)
            if out is not PENDING:
                return out
            self._late(what)

    def results(self, sent: Sequence[tuple[str, Any]]) -> list[TensorDictBase]:
        """Every response of ``sent`` (``(what, future)`` pairs), in order, each read as it
        comes, so the answer times are the server's, not the order asked in."""
        got: dict[int, TensorDictBase] = {}
        while len(got) < len(sent):
            pending = [i for i in range(len(sent)) if i not in got]
            for n, i in enumerate(pending):
                what, future = sent[i]
                out = self.poll(future, what, 0.02 if n == 0 else 0.0)
                if out is not PENDING:
                    got[i] = out
            if len(got) < len(sent):
                self._late(sent[min(i for i in range(len(sent)) if i not in got)][0])
        return [got[i] for i in range(len(sent))]


def _results(sent: Sequence[tuple[str, Any]], wait: float = WAIT) -> list[TensorDictBase]:
    """The responses to valid requests submitted together (see :class:`_Together`)."""
    return _Together(wait).results(sent)


def _settled(handle: Any) -> bool:
    """Whether a handle whose ``.result(timeout)`` raised ``TimeoutError`` is done: failed with
    a ``TimeoutError`` of its own (a shutdown deadline's) rather than still pending. Read
    through ``done()`` where the handle has it."""
    done = getattr(handle, "done", None)
    return bool(done()) if callable(done) else False


def _outcome(handle: Any, wait: float = 0.0) -> str:
    """``"served"``, ``"failed"`` or ``"pending"``, read through ``.result(timeout)`` alone:
    the Protocol promises nothing else of what ``submit`` returns. A cancelled future is a
    settled failure. A ``TimeoutError`` is the request's own (failed, not pending) when the
    handle says it is done, or when it came well before ``wait`` ran out."""
    start = time.perf_counter()
    try:
        handle.result(timeout=wait)
    except (TimeoutError, FuturesTimeout):
        early = wait > 0 and time.perf_counter() - start < wait / 2
        return "failed" if early or _settled(handle) else "pending"
    except (Exception, CancelledError):
        return "failed"
    return "served"


def _outcomes(handles: list[Any], within: float) -> list[str]:
    """Each handle's :func:`_outcome`, waiting up to ``within`` seconds in all for the
    pending ones. With ``within`` 0, each as it is now: a handle still pending is asked again
    for 0.2 s only to tell one with ``.result`` alone that failed with a ``TimeoutError`` of its
    own (it raises at once: failed) from one still pending, and one served in those 0.2 s was
    pending when asked (a server that serves its queue after ``shutdown`` returned)."""
    deadline = time.perf_counter() + within
    out = []
    for h in handles:
        now = _outcome(h)
        if now == "pending" and within > 0:
            now = _outcome(h, max(deadline - time.perf_counter(), 0.2))
        elif now == "pending":
            now = "failed" if _outcome(h, 0.2) == "failed" else "pending"
        out.append(now)
    return out


def _check_layout(out: Any, what: str, max_new: int = MAX_NEW) -> None:
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
    if toks.dtype != torch.int64 or toks.ndim != 1 or not 1 <= toks.numel() <= max_new:
        raise _fail(
            f"{what}: {RESPONSE_KEY!r} is {toks.dtype} {list(toks.shape)}, expected int64 [R] "
            f"with 1 <= R <= max_new_tokens = {max_new}"
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
