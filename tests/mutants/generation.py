"""Deliberately broken generation servers: each must fail the suite with its requirement's id."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from posttrain.contracts import Implementation
from posttrain.contracts.generation import RESPONSE_LOG_PROBS_KEY, request_problem
from posttrain.reference_impls import ThreadGenerationServer
from posttrain.reference_impls.generation_server import _Request, greedy_answers

__all__ = ["EXTRA_MUTANTS", "MUTANTS"]


class Float64LogProbs(ThreadGenerationServer):
    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(t, lp.double()) for t, lp in super()._generate(prompts)]


class CrossTalk(ThreadGenerationServer):
    """Hands a batch's answers out in the wrong order (a classic fan-out bug)."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = super()._generate(prompts)
        return out[1:] + out[:1]


class ScoresThePaddedBatch(ThreadGenerationServer):
    """Log-probs from the left-padded batch without position ids: they move with the batch."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = super()._generate(prompts)
        width = max(int(p.numel()) + int(t.numel()) for p, (t, _) in zip(prompts, out, strict=True))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.int64)
        for i, (p, (t, _)) in enumerate(zip(prompts, out, strict=True)):
            full = torch.cat([p, t])
            ids[i, width - full.numel() :] = full
        logits = self.policy(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
        fixed = []
        for i, (_p, (t, _)) in enumerate(zip(prompts, out, strict=True)):
            n = t.numel()
            lp = logits[i, -n:].gather(-1, ids[i, -n:, None])[:, 0]
            fixed.append((t, lp))
        return fixed


class OffByOneLogProbs(ThreadGenerationServer):
    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(t, torch.roll(lp, 1)) for t, lp in super()._generate(prompts)]


class StampsZero(ThreadGenerationServer):
    """Reports rising versions but stamps every response with the first one."""

    _public = 0

    @property
    def policy_version(self) -> int:
        return self._public

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        super().update_policy_weights_(weights)
        self._public = self._version
        self._version = 0


class StaleAfterUpdate(ThreadGenerationServer):
    """Bumps the version at once but loads new weights only after one more batch."""

    _pending: Mapping[str, torch.Tensor] | None = None
    _served_since: int = 0

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        self._pending, self._served_since = weights, 0
        self._version += 1

    def _run(self, batch: list[_Request]) -> None:
        super()._run(batch)
        self._served_since += 1
        if self._pending is not None and self._served_since >= 2:
            self.policy.load_state_dict(dict(self._pending))
            self._pending = None


class BadRequestFailsItsBatch(ThreadGenerationServer):
    def _run(self, batch: list[_Request]) -> None:
        problems = [p for p in (request_problem(r.td) for r in batch) if p]
        if problems:
            for r in batch:
                r.future.set_exception(ValueError(problems[0]))
            return
        super()._run(batch)


class ForgetsPendingOnShutdown(ThreadGenerationServer):
    """Stops the worker but neither serves nor fails what is still queued."""

    def shutdown(self, timeout: float | None = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        with self._queue.mutex:  # jump the queue: what is pending stays there, unresolved
            self._queue.queue.appendleft(None)
            self._queue.not_empty.notify()
        self._worker.join(timeout)


class ServesAfterShutdown(ThreadGenerationServer):
    """Shuts down properly, then still answers a late request inline."""

    def _submit(self, td: Any) -> Any:
        if not self._closed:
            return super()._submit(td)
        req = _Request(td, Future())
        self._run([req])
        return req.future


class NoStats(ThreadGenerationServer):
    def stats(self) -> dict[str, float]:
        return {}


class BadRequestKillsServer(ThreadGenerationServer):
    """The worker thread dies on a malformed request: everyone after it waits forever."""

    def _run(self, batch: list[_Request]) -> None:
        for r in batch:
            problem = request_problem(r.td)
            if problem:
                r.future.set_exception(ValueError(problem))
                raise SystemExit  # ends the worker thread
        super()._run(batch)


class HangsOnShutdown(ThreadGenerationServer):
    """With requests pending, waits for a drain that never comes (no timeout honoured)."""

    def shutdown(self, timeout: float | None = 5.0) -> None:
        if self._queue.empty():
            super().shutdown(timeout)
            return
        self._closed = True
        threading.Event().wait()  # forever


class PadsPastEos(ThreadGenerationServer):
    """Returns the padded generation width: pads follow an early EOS."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for t, lp in super()._generate(prompts):
            extra = self.max_new_tokens - t.numel()
            out.append(
                (
                    torch.cat([t, torch.full((extra,), self.pad, dtype=t.dtype)]),
                    torch.cat([lp, torch.zeros(extra)]),
                )
            )
        return out


class ScoresWithAStaleCopy(ThreadGenerationServer):
    """Generates with the served policy but scores with a copy made at start, never updated."""

    def __init__(self, policy: Any, **kw: Any) -> None:
        super().__init__(policy, **kw)
        self._scorer = copy.deepcopy(policy)

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for p, (t, _) in zip(prompts, super()._generate(prompts), strict=True):
            full = torch.cat([p, t])[None]
            lp = self._scorer(input_ids=full).logits[0, :-1].float().log_softmax(-1)
            out.append((t, lp[p.numel() - 1 :].gather(-1, t[:, None])[:, 0]))
        return out


class KeepsPrefixCacheAcrossUpdates(ThreadGenerationServer):
    """Caches each prompt's KV (prefix caching) and never clears it when weights change.

    Decodes greedily from the cached prefix, log-probs from the decoding's own logits.
    """

    def __init__(self, policy: Any, **kw: Any) -> None:
        super().__init__(policy, **kw)
        self._prefix: dict[tuple[int, ...], Any] = {}

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for p in prompts:
            key = tuple(p.tolist())
            if len(key) > 1 and key not in self._prefix:
                self._prefix[key] = self.policy(
                    input_ids=p[None, :-1], use_cache=True
                ).past_key_values
            past = copy.deepcopy(self._prefix[key]) if len(key) > 1 else None
            step = p[None, -1:] if past is not None else p[None]
            toks: list[int] = []
            lps: list[torch.Tensor] = []
            for _ in range(self.max_new_tokens):
                res = self.policy(input_ids=step, cache=past, use_cache=True)
                past = res.cache
                lp = res.logits[0, -1].float().log_softmax(-1)
                tok = int(lp.argmax())
                toks.append(tok)
                lps.append(lp[tok])
                if tok == self.eos:
                    break
                step = torch.tensor([[tok]])
            out.append((torch.tensor(toks, dtype=torch.int64), torch.stack(lps)))
        return out


class ServesAPrivateCopy(ThreadGenerationServer):
    """Serves its own copy of the policy, as an inference engine does: weights given load into
    it, but ``update_policy_weights_()`` only bumps the version, never re-reading the policy."""

    def __init__(self, policy: Any, **kw: Any) -> None:
        super().__init__(copy.deepcopy(policy), **kw)


class LoadsWeightsMidBatch(ThreadGenerationServer):
    """Loads new weights at once, without waiting for the batch in progress."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        if weights is not None:
            self.policy.load_state_dict(dict(weights))
        self._version += 1


class StampsAtFanOut(ThreadGenerationServer):
    """Bumps the version before loading (under the lock, after the batch in progress), and
    reads it for the stamp when answers go out: a batch in flight gets the new version."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        self._version += 1
        with self._weights_lock:
            if weights is not None:
                self.policy.load_state_dict(dict(weights))

    def _run(self, batch: list[_Request]) -> None:
        inner = [_Request(r.td, Future(), r.queued) for r in batch]
        super()._run(inner)
        version = torch.tensor(self._version, dtype=torch.int64)  # read after the forward
        for r, i in zip(batch, inner, strict=True):
            if not i.future.done() or not r.future.set_running_or_notify_cancel():
                continue
            error = i.future.exception()
            if error is not None:
                r.future.set_exception(error)
            else:
                r.future.set_result(i.future.result().set("policy_version", version.clone()))


class PadsAfterEosInBatch(ThreadGenerationServer):
    """Cuts each row at the batch's generated width, not at its EOS: a row that finished early
    keeps the padding HF ``generate`` appends while the other rows go on."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, width = len(prompts), max(int(p.numel()) for p in prompts)
        ids = torch.full((n, width), self.pad, dtype=torch.int64)
        mask = torch.zeros(n, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - p.numel() :] = p
            mask[i, width - p.numel() :] = 1
        gen = self.policy.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad,
            eos_token_id=self.eos,
        )
        out = []
        for i, p in enumerate(prompts):
            t = gen[i, width:]
            full = torch.cat([p, t])[None]
            lp = self.policy(input_ids=full).logits[0, :-1].float().log_softmax(-1)
            out.append((t.clone(), lp[p.numel() - 1 :].gather(-1, t[:, None])[:, 0]))
        return out


class _NewestFirstClient:
    """Relays answers to its futures newest first: right with one request in flight."""

    def __init__(self, server: ThreadGenerationServer) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._waiting: list[Future[Any]] = []

    def submit(self, request: Any, /) -> Future[Any]:
        out: Future[Any] = Future()
        with self._lock:
            self._waiting.append(out)

        def relay(f: Future[Any]) -> None:
            with self._lock:
                target = self._waiting.pop()
            with contextlib.suppress(InvalidStateError):
                if f.cancelled():
                    target.cancel()
                elif (error := f.exception()) is not None:
                    target.set_exception(error)
                else:
                    target.set_result(f.result())

        self._server._submit(request).add_done_callback(relay)
        return out


class SwapsAnswersOnOneClient(ThreadGenerationServer):
    """Its clients hand answers to their pending requests in the wrong order."""

    def client(self) -> Any:
        return _NewestFirstClient(self)


class _QueueClient:
    def __init__(self, server: ThreadGenerationServer) -> None:
        self._queue = server._queue

    def submit(self, request: Any, /) -> Future[Any]:
        out: Future[Any] = Future()
        self._queue.put(_Request(request, out))
        return out


class OldClientsKeepQueueing(ThreadGenerationServer):
    """Refuses clients asked for after shutdown, but a client taken before it keeps queueing
    requests that no worker will ever serve."""

    def client(self) -> Any:
        return super().client() if self._closed else _QueueClient(self)


class DrainsDespiteFail(ThreadGenerationServer):
    """Declares ``on_shutdown='fail'`` (the default) but serves what is queued at shutdown."""

    def __init__(self, policy: Any, **kw: Any) -> None:
        super().__init__(policy, **{**kw, "on_shutdown": "drain"})


class CachesByStorage(ThreadGenerationServer):
    """Caches answers by the prompt tensor's storage address (a request seen before is not
    generated again): a caller that reuses its prompt buffer for the next prompt gets the
    previous prompt's answer."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = self.__dict__.setdefault(
            "_by_ptr", {}
        )
        todo = [p for p in prompts if p.data_ptr() not in cache]
        for p, answer in zip(todo, super()._generate(todo) if todo else [], strict=True):
            cache[p.data_ptr()] = answer
        return [cache[p.data_ptr()] for p in prompts]


class DropsPadTokens(ThreadGenerationServer):
    """Treats the pad id as padding wherever it occurs (a mask built as ``ids != pad``): a
    prompt holding token 0 is answered as if that token were not there."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kept = [p[p != self.pad] if bool((p != self.pad).any()) else p for p in prompts]
        return super()._generate(kept)


class CastsIntegerPrompts(ThreadGenerationServer):
    """Rejects float prompts but casts any integer (or bool) prompt to int64 and serves it."""

    def _submit(self, td: Any) -> Any:
        prompt = td.get(("tokens", "prompt"), None)
        if isinstance(prompt, torch.Tensor) and not prompt.is_floating_point():
            td = td.clone()
            td.set(("tokens", "prompt"), prompt.long())
        return super()._submit(td)


class SkipsUnchangedUpdate(ThreadGenerationServer):
    """Skips an update whose weights equal the served ones, version included: the same
    weights sent again leave ``policy_version`` where it was."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        own = self.policy.state_dict()
        if weights is not None and all(
            k in own and torch.equal(own[k], t) for k, t in weights.items()
        ):
            return
        super().update_policy_weights_(weights)


class ShortByOne(ThreadGenerationServer):
    """Decodes ``max_new_tokens - 1`` tokens (the prefill's token counted as already in the
    response): a server built with ``max_new_tokens=1`` answers nothing."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.max_new_tokens == 1:
            return [(p[:0], torch.zeros(0)) for p in prompts]
        return greedy_answers(
            self.policy, prompts, self.max_new_tokens - 1, pad=self.pad, eos=self.eos
        )


class SqueezesPrompt(ThreadGenerationServer):
    """Reads the prompt with ``squeeze().tolist()``: a one-token prompt becomes a bare int and
    its request fails with a TypeError."""

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        for p in prompts:
            list(p.squeeze().tolist())
        return super()._generate(prompts)


class DiesOnCancelled(ThreadGenerationServer):
    """Answers with a bare ``set_result``, never asking whether the caller cancelled: a
    cancelled future raises ``InvalidStateError`` in the worker, which dies, and every later
    request waits forever."""

    def _run(self, batch: list[_Request]) -> None:
        for req in batch:
            if req.future.cancelled():
                req.future.set_result(None)  # raises InvalidStateError
        super()._run(batch)


class NoneMeansNoWait(ThreadGenerationServer):
    """Declares ``on_shutdown='drain'`` but reads ``shutdown(timeout=None)`` as ``timeout or
    0``: waiting as long as it takes waits for nothing, and the pending requests fail."""

    def __init__(self, policy: Any, **kw: Any) -> None:
        super().__init__(policy, **{**kw, "on_shutdown": "drain"})

    def shutdown(self, timeout: float | None = 5.0) -> None:
        super().shutdown(timeout or 0.0)


class CountsFromAStaleRead(ThreadGenerationServer):
    """Reads the version before waiting for the weights lock and stores that plus one once its
    weights are loaded: updates from several threads at once count once."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        seen = self._version
        super().update_policy_weights_(weights)
        self._version = seen + 1


def _impl(req: str, factory: Any, **kw: Any) -> Implementation:
    kw.setdefault("options", {"on_shutdown": "fail"})
    return Implementation("generation", factory, name=f"mutant-{req}-{factory.__name__}", **kw)


MUTANTS: dict[str, Implementation] = {
    "GEN-001": _impl("GEN-001", Float64LogProbs),
    "GEN-002": _impl("GEN-002", CrossTalk),
    "GEN-003": _impl("GEN-003", ScoresThePaddedBatch),
    "GEN-004": _impl("GEN-004", OffByOneLogProbs),
    "GEN-005": _impl("GEN-005", StampsZero),
    "GEN-006": _impl("GEN-006", StaleAfterUpdate),
    "GEN-007": _impl("GEN-007", BadRequestFailsItsBatch),
    "GEN-008": _impl("GEN-008", ForgetsPendingOnShutdown),
    "GEN-009": _impl("GEN-009", ServesAfterShutdown),
    "GEN-010": _impl("GEN-010", NoStats),
    # A thread server whose clients hold locks and threads cannot go to another process.
    "GEN-011": _impl("GEN-011", ThreadGenerationServer, capabilities={"processes"}),
}
"""Requirement id -> a generation server that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("GEN-001", _impl("GEN-001", PadsPastEos)),
    ("GEN-002", _impl("GEN-002", SwapsAnswersOnOneClient)),
    ("GEN-003", _impl("GEN-003", PadsAfterEosInBatch)),
    ("GEN-005", _impl("GEN-005", LoadsWeightsMidBatch)),
    ("GEN-005", _impl("GEN-005", StampsAtFanOut)),
    ("GEN-006", _impl("GEN-006", ScoresWithAStaleCopy)),
    ("GEN-006", _impl("GEN-006", KeepsPrefixCacheAcrossUpdates)),
    ("GEN-006", _impl("GEN-006", ServesAPrivateCopy)),
    ("GEN-007", _impl("GEN-007", BadRequestKillsServer)),
    ("GEN-008", _impl("GEN-008", HangsOnShutdown)),
    ("GEN-008", _impl("GEN-008", DrainsDespiteFail)),
    ("GEN-009", _impl("GEN-009", OldClientsKeepQueueing)),
    ("GEN-002", _impl("GEN-002", CachesByStorage)),
    ("GEN-002", _impl("GEN-002", DropsPadTokens)),
    ("GEN-007", _impl("GEN-007", CastsIntegerPrompts)),
    ("GEN-005", _impl("GEN-005", SkipsUnchangedUpdate)),
    ("GEN-001", _impl("GEN-001", ShortByOne)),
    ("GEN-001", _impl("GEN-001", SqueezesPrompt)),
    ("GEN-002", _impl("GEN-002", DiesOnCancelled)),
    ("GEN-008", _impl("GEN-008", NoneMeansNoWait, options={"on_shutdown": "drain"})),
    ("GEN-005", _impl("GEN-005", CountsFromAStaleRead)),
]
"""Named bugs beside the main mutants: a bad request that kills the server, a hang on shutdown,
a server declaring on_shutdown='fail' that drains,
answers swapped between one client's requests, padding after an EOS in a batch, a batch in
flight stamped with the version of weights that did not produce it (or given new weights half
way), stale weights behind an update (a scoring copy, a prefix cache, a private copy that the
no-argument update never re-reads), a client from before shutdown that still queues, a cache
keyed on the prompt's storage, pad ids dropped from prompts, integer prompts of another dtype
cast and served, an update with unchanged weights that keeps the version, a decode one token
short of max_new_tokens, a one-token prompt squeezed to a bare int, a worker that dies on a
future its caller cancelled, shutdown(None) read as shutdown(0) on a draining server, and a
version counted from a read taken before the weights lock (overlapping updates count once)."""

_ = RESPONSE_LOG_PROBS_KEY
