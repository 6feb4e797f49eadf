"""Generation servers (contract ``generation`` v1) written from ``specs/generation-v1.md`` alone.

Two correct designs, neither the obvious one-worker-one-request loop:

* :class:`DrainBatchingServer`: one worker thread batches requests dynamically (a short linger
  after the first), generates with a private *engine* (a copy of the policy plus a response
  cache for greedy decoding, like vLLM's prefix cache), and swaps in a whole new engine on a
  weight update, so an update never waits for a batch in flight. ``on_shutdown="drain"``.
* :class:`CancelPoolServer`: a ``ThreadPoolExecutor`` serves each request in a pool thread on
  the policy itself, a readers-writer lock keeps an update from tearing a generation, and
  ``shutdown`` cancels queued futures (``cancel_futures=True``) and aborts running ones at the
  next token. ``on_shutdown="fail"``.

Then one-bug variants, each naming the requirement id it breaks (our reading of the spec).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import Implementation
from posttrain.contracts.generation import (
    PROMPT_KEY,
    RESPONSE_KEY,
    RESPONSE_LOG_PROBS_KEY,
    request_problem,
)
from tests.independent._greedy import Decoded, greedy_decode

__all__ = [
    "BUGGY_GENERATION",
    "CORRECT_GENERATION",
    "CancelPoolServer",
    "DrainBatchingServer",
    "load_checked",
]


class ServerClosedError(RuntimeError):
    """Raised by ``submit`` on a server that was shut down."""


def load_checked(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (all or some of the model's names) into ``model``, all or nothing.

    Every name, shape and dtype is checked before the first write, so a bad mapping raises
    naming the key and leaves the model untouched.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> load_checked(m, {"bias": torch.ones(2)})
        >>> m.bias.tolist()
        [1.0, 1.0]
    """
    own = model.state_dict()
    for name, w in weights.items():
        if name not in own:
            raise KeyError(f"weights: unknown name {name!r}")
        if not isinstance(w, torch.Tensor) or w.shape != own[name].shape:
            found = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(
                f"weights: {name!r} expected shape {list(own[name].shape)}, found {found}"
            )
        if w.dtype != own[name].dtype:
            raise TypeError(f"weights: {name!r} expected dtype {own[name].dtype}, found {w.dtype}")
    with torch.no_grad():
        for name, w in weights.items():
            own[name].copy_(w)


def _response(d: Decoded, version: int) -> TensorDict:
    return TensorDict(
        {
            RESPONSE_KEY: torch.tensor(d.tokens, dtype=torch.int64),
            RESPONSE_LOG_PROBS_KEY: torch.tensor(d.log_probs, dtype=torch.float32),
            "policy_version": torch.tensor(version, dtype=torch.int64),
        },
        batch_size=[],
    )


def _settle(fut: cf.Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    # A future failed at a shutdown deadline may be answered late by the worker: first wins.
    with contextlib.suppress(cf.InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums = {"queue_wait_s": 0.0, "batch_size": 0.0, "forward_s": 0.0}
        self._batches = 0

    def add(self, wait_s: float, size: int, forward_s: float) -> None:
        with self._lock:
            self._sums["queue_wait_s"] += wait_s
            self._sums["batch_size"] += size
            self._sums["forward_s"] += forward_s
            self._batches += 1

    def means(self) -> dict[str, float]:
        with self._lock:
            n = max(self._batches, 1)
            return {k: v / n for k, v in self._sums.items()}


class _Client:
    def __init__(self, submit: Any) -> None:
        self._submit = submit

    def submit(self, request: TensorDictBase, /) -> cf.Future[TensorDict]:
        fut: cf.Future[TensorDict] = self._submit(request)
        return fut


# --------------------------------------------------------------------------------------------
# Design 1: dynamic batching worker, engine swap on update, drain on shutdown
# --------------------------------------------------------------------------------------------


@dataclass
class _Engine:
    """A frozen copy of the policy, the version it serves, and its greedy response cache."""

    model: Any
    version: int
    cache: dict[tuple[int, ...], Decoded] = field(default_factory=dict)


@dataclass
class _Pending:
    request: Any
    future: cf.Future[TensorDict]
    t_submit: float


class DrainBatchingServer:
    """A worker thread that batches requests and drains the queue on ``shutdown``.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> srv = DrainBatchingServer(tiny_causal_lm(), max_new_tokens=2)
        >>> req = TensorDict({PROMPT_KEY: torch.tensor([5, 6])}, [])
        >>> srv.client().submit(req).result(timeout=30)["policy_version"].item()
        0
        >>> srv.shutdown()
    """

    def __init__(
        self, policy: Any, *, max_new_tokens: int, max_batch: int = 16, linger_s: float = 0.01
    ) -> None:
        self._policy = policy
        self._max_new = max_new_tokens
        self._max_batch = max_batch
        self._linger = linger_s
        self._lock = threading.Lock()  # closed flag, engine, unresolved futures
        self._update_lock = threading.Lock()  # one update at a time, versions in order
        self._engine = _Engine(copy.deepcopy(policy), 0)
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._unresolved: set[cf.Future[TensorDict]] = set()
        self._closed = False
        self._abort = threading.Event()
        self._stats = _Stats()
        self._worker = threading.Thread(target=self._run, name="drain-server", daemon=True)
        self._worker.start()

    # -- the public surface ---------------------------------------------------------------
    def client(self) -> _Client:
        return _Client(self._submit)

    @property
    def policy_version(self) -> int:
        with self._lock:
            return self._engine.version

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._update_lock:
            with self._lock:
                current = self._engine
            model = copy.deepcopy(current.model)
            src = self._policy.state_dict() if weights is None else weights
            load_checked(model, src)
            with self._lock:
                self._engine = self._new_engine(model, current.version + 1)

    def stats(self) -> dict[str, float]:
        return self._stats.means()

    def shutdown(self, timeout: float | None = 5.0) -> None:
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            self._queue.put(None)  # after every accepted request: they drain first
        self._worker.join(timeout)
        if self._worker.is_alive():  # the deadline came first: fail what is left
            self._abort.set()
            with self._lock:
                left = list(self._unresolved)
                self._unresolved.clear()
            for fut in left:
                _settle(fut, error=TimeoutError("shutdown deadline passed before this request"))

    # -- hooks the buggy variants override ---------------------------------------------------
    def _new_engine(self, model: Any, version: int) -> _Engine:
        return _Engine(model, version)

    def _cache_of(self, engine: _Engine) -> dict[tuple[int, ...], Decoded]:
        return engine.cache

    def _stamp(self, engine: _Engine) -> int:
        return engine.version

    def _decode(self, engine: _Engine, prompts: list[tuple[int, ...]]) -> list[Decoded]:
        return greedy_decode(engine.model, prompts, self._max_new, stop=self._abort.is_set)

    def _order(self, batch: list[tuple[_Pending, tuple[int, ...]]]) -> list[int]:
        return list(range(len(batch)))

    # -- internals ----------------------------------------------------------------------
    def _submit(self, request: TensorDictBase) -> cf.Future[TensorDict]:
        fut: cf.Future[TensorDict] = cf.Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise ServerClosedError("submit: the server was shut down; no request is taken")
            self._unresolved.add(fut)
            self._queue.put(_Pending(request, fut, time.perf_counter()))
        return fut

    def _resolve(self, fut: cf.Future[TensorDict], **kw: Any) -> None:
        with self._lock:
            self._unresolved.discard(fut)
        _settle(fut, **kw)

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            end = time.perf_counter() + self._linger
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get(timeout=max(end - time.perf_counter(), 0.0))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._serve(batch)

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
        with self._lock:  # read after the batch is formed: every member saw this engine
            engine = self._engine
        t0 = time.perf_counter()
        try:
            cache = self._cache_of(engine)
            order = self._order(valid)
            todo = list(dict.fromkeys(valid[i][1] for i in order if valid[i][1] not in cache))
            for prompt, d in zip(todo, self._decode(engine, todo), strict=True):
                cache[prompt] = d
            answers = [cache[valid[i][1]] for i in order]
        except Exception as e:  # the batch fails, the server lives on
            for p, _ in valid:
                self._resolve(p.future, error=e)
            return
        t1 = time.perf_counter()
        version = self._stamp(engine)
        for (p, _), d in zip(valid, answers, strict=True):
            self._resolve(p.future, result=_response(d, version))
        self._stats.add(sum(t0 - p.t_submit for p, _ in valid) / len(valid), len(valid), t1 - t0)


# --------------------------------------------------------------------------------------------
# Design 2: thread pool, readers-writer lock, cancel on shutdown
# --------------------------------------------------------------------------------------------


class _RWLock:
    """Many readers or one writer; a waiting writer holds new readers back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class CancelPoolServer:
    """Each request is a task of a ``ThreadPoolExecutor``; ``shutdown`` cancels what is left.

    A cancelled future is settled: ``.result()`` raises ``CancelledError``.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> srv = CancelPoolServer(tiny_causal_lm(), max_new_tokens=2)
        >>> bad = srv.client().submit(TensorDict({}, []))
        >>> "('tokens', 'prompt')" in str(bad.exception(timeout=5))
        True
        >>> srv.shutdown()
    """

    def __init__(self, policy: Any, *, max_new_tokens: int, workers: int = 2) -> None:
        self._model = policy
        self._max_new = max_new_tokens
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="cancel-pool")
        self._rw = _RWLock()
        self._version = 0
        self._closed = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._futures: set[cf.Future[TensorDict]] = set()
        self._stats = _Stats()

    def client(self) -> _Client:
        return _Client(self._submit)

    @property
    def policy_version(self) -> int:
        return self._version

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._rw.write():  # waits for generations in flight, holds new ones back
            if weights is not None:  # None: the policy is served in place, nothing to re-read
                load_checked(self._model, weights)
            self._bump()

    def _bump(self) -> None:
        self._version += 1

    def stats(self) -> dict[str, float]:
        return self._stats.means()

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._closed.set()
        self._stop.set()  # running generations stop at their next token
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            futs = list(self._futures)
        _, late = cf.wait(futs, timeout=timeout)
        for fut in late:  # stuck past the deadline: fail it rather than leave it pending
            _settle(fut, error=TimeoutError("shutdown deadline passed during this request"))

    def _submit(self, request: TensorDictBase) -> cf.Future[TensorDict]:
        if self._closed.is_set():
            raise ServerClosedError("submit: the server was shut down; no request is taken")
        problem = request_problem(request)
        if problem is not None:
            bad: cf.Future[TensorDict] = cf.Future()
            bad.set_exception(KeyError(problem))
            return bad
        prompt = [int(t) for t in request.get(PROMPT_KEY).tolist()]
        try:
            fut = self._pool.submit(self._serve, prompt, time.perf_counter())
        except RuntimeError as e:  # shut down between the check and here
            raise ServerClosedError("submit: the server was shut down") from e
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: cf.Future[TensorDict]) -> None:
        with self._lock:
            self._futures.discard(fut)

    def _serve(self, prompt: list[int], t_submit: float) -> TensorDict:
        with self._rw.read():
            t0 = time.perf_counter()
            version = self._version  # stamped at generation start, under the same lock
            [d] = greedy_decode(self._model, [prompt], self._max_new, stop=self._stop.is_set)
            t1 = time.perf_counter()
        self._stats.add(t0 - t_submit, 1, t1 - t0)
        return _response(d, version)


class _Reply:
    """A handle with only what the Protocol names: ``result(timeout)``."""

    def __init__(self, fut: cf.Future[TensorDict]) -> None:
        self._fut = fut

    def result(self, timeout: float | None = None) -> TensorDict:
        return self._fut.result(timeout)


class ResultOnlyServer(CancelPoolServer):
    """:class:`CancelPoolServer` whose ``submit`` returns a minimal reply handle (as an RPC
    stub or a Ray-style reference would): ``.result(timeout)`` gives the response or raises
    the request's own error, and that is all the spec asks of it ("Future-like object:
    ``.result(timeout)`` gives the response or raises the request's own error").

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> srv = ResultOnlyServer(tiny_causal_lm(), max_new_tokens=2)
        >>> reply = srv.client().submit(TensorDict({PROMPT_KEY: torch.tensor([5])}, []))
        >>> reply.result(timeout=30)[RESPONSE_KEY].shape
        torch.Size([2])
        >>> srv.shutdown()
    """

    def _submit(self, request: TensorDictBase) -> Any:
        return _Reply(super()._submit(request))


# --------------------------------------------------------------------------------------------
# One-bug variants
# --------------------------------------------------------------------------------------------


class StalePrefixCacheServer(DrainBatchingServer):
    """BUG (breaks GEN-006): the response cache is the server's, not the engine's, so a weight
    update does not reset it and a prompt seen before is answered from the old weights.

    The shape of vLLM's prefix cache surviving ``load_weights``: "the cached prefix won't be
    updated after load_weights, making the new model running with the old cached prefix"
    (https://github.com/vllm-project/vllm/issues/9744); OpenRLHF then added a prefix-cache
    reset after each sync (https://github.com/OpenRLHF/OpenRLHF/pull/703).
    """

    def __init__(self, policy: Any, *, max_new_tokens: int) -> None:
        self._shared_cache: dict[tuple[int, ...], Decoded] = {}
        super().__init__(policy, max_new_tokens=max_new_tokens)

    def _cache_of(self, engine: _Engine) -> dict[tuple[int, ...], Decoded]:
        return self._shared_cache


class VersionAtCompletionServer(DrainBatchingServer):
    """BUG (breaks GEN-005): the version is read when the batch *completes*, not from the
    engine that generated it, so a batch in flight during an update is stamped with the new
    version although the old weights produced it. rLLM shipped exactly this and fixed it in
    "stamp weight_version at dispatch, not completion" (https://github.com/rllm-org/rllm/pull/622).
    """

    def _stamp(self, engine: _Engine) -> int:
        return self.policy_version


class PrefixSortedServer(DrainBatchingServer):
    """BUG (breaks GEN-002): the batch is reordered by prompt (longest-prefix-match style, to
    share cached prefixes) and the answers are handed back by position in the *reordered*
    batch, i.e. to the wrong callers whenever the batch was not already sorted."""

    def _order(self, batch: list[tuple[_Pending, tuple[int, ...]]]) -> list[int]:
        return sorted(range(len(batch)), key=lambda i: batch[i][1])


class PadAfterEosServer(DrainBatchingServer):
    """BUG (breaks GEN-003): a row that reached EOS keeps being padded while the batch's
    longest row runs, and the padding stays in its response (HF ``generate`` output, untrimmed),
    so the same request served alone and in a batch differ once any row ends early."""

    def _decode(self, engine: _Engine, prompts: list[tuple[int, ...]]) -> list[Decoded]:
        return greedy_decode(engine.model, prompts, self._max_new, trim_at_eos=False)


class NoCancelShutdownServer(CancelPoolServer):
    """BUG (breaks GEN-008): ``shutdown`` calls ``executor.shutdown(wait=False)`` without
    ``cancel_futures`` (the pre-3.9 idiom) and returns at once: queued requests stay pending
    past the return and are then served, though the server declares ``on_shutdown="fail"``."""

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False)


class BatchPoisonServer(DrainBatchingServer):
    """BUG (breaks GEN-007): the batch's prompts are read before any request is validated, so
    one request with a missing key fails every future of its batch (and one with a float
    prompt is served as if its ids were ints)."""

    def _serve(self, batch: list[_Pending]) -> None:
        try:
            for p in batch:
                if PROMPT_KEY not in p.request.keys(include_nested=True):
                    raise KeyError(f"request: key {PROMPT_KEY!r} is missing")
                p.request.set(PROMPT_KEY, p.request.get(PROMPT_KEY).to(torch.int64))
        except Exception as e:
            for p in batch:
                self._resolve(p.future, error=e)
            return
        super()._serve(batch)


class AcceptAfterShutdownServer(DrainBatchingServer):
    """BUG (breaks GEN-009): ``submit`` does not look at the closed flag, so a request sent
    after ``shutdown`` is queued behind the worker's stop sentinel and its future never
    resolves."""

    def _submit(self, request: TensorDictBase) -> cf.Future[TensorDict]:
        fut: cf.Future[TensorDict] = cf.Future()
        fut.set_running_or_notify_cancel()
        self._queue.put(_Pending(request, fut, time.perf_counter()))
        return fut


class NoneNoBumpServer(DrainBatchingServer):
    """BUG (breaks GEN-005): ``update_policy_weights_()`` with no argument re-reads the policy
    but keeps the version ("same weights object, same version"), so responses from the new
    weights carry the old version and the version does not rise with that update."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        if weights is not None:
            super().update_policy_weights_(weights)
            return
        with self._update_lock:
            model = copy.deepcopy(self._engine.model)
            load_checked(model, self._policy.state_dict())
            with self._lock:
                self._engine = self._new_engine(model, self._engine.version)


class TemperatureLogProbsServer(DrainBatchingServer):
    """BUG (breaks GEN-004): the log-probs returned are those of the sampling distribution
    (logits divided by a temperature of 0.7), not the serving weights' own, the mismatch vLLM's
    ``logprobs_mode`` ("raw" vs "processed") exists to settle; the tokens are still greedy."""

    def _decode(self, engine: _Engine, prompts: list[tuple[int, ...]]) -> list[Decoded]:
        out = super()._decode(engine, prompts)
        return [Decoded(d.tokens, [x / 0.7 for x in d.log_probs]) for d in out]


class DrainingPoolServer(CancelPoolServer):
    """BUG (breaks GEN-008, "each served or failed, as the on_shutdown option says"): declared
    ``on_shutdown="fail"`` but ``shutdown`` lets the executor finish every queued request
    (``shutdown(wait=False)`` without ``cancel_futures``, then waits up to the timeout), so
    pending requests are served, not failed, and a shutdown under load takes up to the whole
    timeout instead of returning at once."""

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False)
        with self._lock:
            futs = list(self._futures)
        _, late = cf.wait(futs, timeout=timeout)
        for fut in late:
            _settle(fut, error=TimeoutError("shutdown deadline passed during this request"))


def _drain(policy: Any, *, max_new_tokens: int) -> DrainBatchingServer:
    return DrainBatchingServer(policy, max_new_tokens=max_new_tokens)


def _pool(policy: Any, *, max_new_tokens: int) -> CancelPoolServer:
    return CancelPoolServer(policy, max_new_tokens=max_new_tokens)


def _variant(cls: type[Any], opt: str) -> Implementation:
    return Implementation(
        "generation",
        lambda policy, *, max_new_tokens: cls(policy, max_new_tokens=max_new_tokens),
        name=f"independent.{cls.__name__}",
        options={"on_shutdown": opt},
    )


CORRECT_GENERATION: dict[str, Implementation] = {
    "drain_batching": Implementation(
        "generation",
        _drain,
        name="independent.DrainBatchingServer",
        options={"on_shutdown": "drain"},
    ),
    "cancel_pool": Implementation(
        "generation", _pool, name="independent.CancelPoolServer", options={"on_shutdown": "fail"}
    ),
    "result_only_handles": _variant(ResultOnlyServer, "fail"),
}

# name -> (implementation, requirement id the bug breaks)
BUGGY_GENERATION: dict[str, tuple[Implementation, str]] = {
    "stale_prefix_cache": (_variant(StalePrefixCacheServer, "drain"), "GEN-006"),
    "version_at_completion": (_variant(VersionAtCompletionServer, "drain"), "GEN-005"),
    "prefix_sorted_positional": (_variant(PrefixSortedServer, "drain"), "GEN-002"),
    "pad_after_eos": (_variant(PadAfterEosServer, "drain"), "GEN-003"),
    "no_cancel_shutdown": (_variant(NoCancelShutdownServer, "fail"), "GEN-008"),
    "batch_poison": (_variant(BatchPoisonServer, "drain"), "GEN-007"),
    "accept_after_shutdown": (_variant(AcceptAfterShutdownServer, "drain"), "GEN-009"),
    "none_no_bump": (_variant(NoneNoBumpServer, "drain"), "GEN-005"),
    "temperature_log_probs": (_variant(TemperatureLogProbsServer, "drain"), "GEN-004"),
    "declared_fail_but_drains": (_variant(DrainingPoolServer, "fail"), "GEN-008"),
}
