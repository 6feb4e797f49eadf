"""One-bug generation servers written from ``specs/generation-v1.md`` alone, for the kit's reach.

Each variant changes one thing in :class:`tests.independent.generation.DrainBatchingServer`
(``on_shutdown="drain"``). Each docstring names the bug, a system that shipped a bug of that
kind (or says it is plausible) and the requirement sentence it breaks; ``demo_<name>()`` shows
the bug with plain code against that sentence (True when the bug shows).

Example:
    >>> sorted(VARIANTS)[0]
    'budget_off_by_one'
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.contracts import Implementation
from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY, RESPONSE_LOG_PROBS_KEY
from posttrain.testing import tiny_causal_lm
from tests.independent._greedy import Decoded, greedy_decode
from tests.independent.generation import (
    DrainBatchingServer,
    ServerClosedError,
    _Engine,
    _Pending,
    _settle,
)

__all__ = ["BASES", "DEMOS", "VARIANTS"]


def _req(*tokens: int) -> TensorDict:
    return TensorDict({PROMPT_KEY: torch.tensor(tokens, dtype=torch.int64)}, [])


# ---------------------------------------------------------------------------------------------
# The variants


class SqueezedPromptServer(DrainBatchingServer):
    """BUG: the prompt is read with ``.squeeze().tolist()`` (to drop a batch dim some callers
    send), which turns a one-token prompt into a bare int, so that request fails ("'int'
    object is not iterable"). The size-1 ``squeeze`` slip many batch-size-1 bug reports
    trace back to. Plausible.

    Breaks GEN-001 ("A response MUST hold ('tokens', 'response') int64 [R] ...").
    """

    def _serve(self, batch: list[_Pending]) -> None:
        ok: list[_Pending] = []
        for p in batch:
            prompt = p.request.get(PROMPT_KEY, None)
            try:
                if isinstance(prompt, torch.Tensor):
                    list(prompt.squeeze().tolist())
            except TypeError as e:
                self._resolve(p.future, error=e)
                continue
            ok.append(p)
        if ok:
            super()._serve(ok)


def demo_squeezed_prompt() -> bool:
    srv = SqueezedPromptServer(tiny_causal_lm(), max_new_tokens=2)
    try:
        srv.client().submit(_req(5)).result(timeout=30)
    except TypeError:
        return True
    finally:
        srv.shutdown()
    return False


class BudgetOffByOneServer(DrainBatchingServer):
    """BUG: decodes ``max_new_tokens - 1`` steps, counting the prefill step's token as if it
    were already in the response: with ``max_new_tokens=1`` every response is empty. The
    off-by-one of engines whose first token comes from prefill. Plausible.

    Breaks GEN-001 ("('tokens', 'response') int64 [R] with 1 <= R <= max_new_tokens").
    """

    def _decode(self, engine: _Engine, prompts: list[tuple[int, ...]]) -> list[Decoded]:
        return greedy_decode(engine.model, prompts, self._max_new - 1, stop=self._abort.is_set)


def demo_budget_off_by_one() -> bool:
    srv = BudgetOffByOneServer(tiny_causal_lm(), max_new_tokens=1)
    try:
        out = srv.client().submit(_req(5, 6)).result(timeout=30)
    finally:
        srv.shutdown()
    return int(out.get(RESPONSE_KEY).numel()) < 1


class MixedClockServer(DrainBatchingServer):
    """BUG: requests are stamped with ``time.time()`` at submit, the batch start with
    ``time.perf_counter()``, and the queue wait is their difference: a large negative number.
    The wall-clock vs monotonic-clock mix-up. Plausible.

    Breaks GEN-010 ("stats() SHOULD report finite, non-negative queue_wait_s").
    """

    def _submit(self, request: TensorDictBase) -> cf.Future[TensorDict]:
        fut: cf.Future[TensorDict] = cf.Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise ServerClosedError("submit: the server was shut down; no request is taken")
            self._unresolved.add(fut)
            self._queue.put(_Pending(request, fut, time.time()))
        return fut


def demo_mixed_clock() -> bool:
    srv = MixedClockServer(tiny_causal_lm(), max_new_tokens=2)
    try:
        srv.client().submit(_req(5, 6)).result(timeout=30)
        return srv.stats()["queue_wait_s"] < 0
    finally:
        srv.shutdown()


class SecondShutdownRaisesServer(DrainBatchingServer):
    """BUG: a second ``shutdown`` raises ("server already shut down"), so a ``finally:
    server.shutdown()`` after an ``atexit`` or context-manager shutdown turns a clean exit
    into a traceback. Plausible (engines whose ``shutdown`` asserts it runs once).

    Breaks GEN-008 ("shutdown ... MUST ... be idempotent").
    """

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Stop serving; only once."""
        if self._closed:
            raise RuntimeError("shutdown: the server is already shut down")
        super().shutdown(timeout)


def demo_second_shutdown_raises() -> bool:
    srv = SecondShutdownRaisesServer(tiny_causal_lm(), max_new_tokens=2)
    srv.shutdown()
    try:
        srv.shutdown()
    except RuntimeError:
        return True
    return False


class NoneTimeoutZeroServer(DrainBatchingServer):
    """BUG: the shutdown deadline is ``timeout or 0``, so ``shutdown(timeout=None)`` ("wait as
    long as it takes") waits for nothing and fails every pending request, though the server
    declares ``on_shutdown="drain"``. The ``x or default`` slip on a meaningful None/0.
    Plausible.

    Breaks GEN-008 ("leave no pending future unresolved (each served or failed, as the
    on_shutdown option says)").
    """

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Stop serving within ``timeout`` seconds (None read as 0)."""
        super().shutdown(timeout or 0.0)


def demo_none_timeout_zero() -> bool:
    srv = NoneTimeoutZeroServer(tiny_causal_lm(), max_new_tokens=4)
    client = srv.client()
    futs = [client.submit(_req(5 + i, 6)) for i in range(8)]
    srv.shutdown(timeout=None)
    return any(f.exception(timeout=30) is not None for f in futs)


class CancelKillsWorkerServer(DrainBatchingServer):
    """BUG: futures are left PENDING (cancellable) and answered with a bare ``set_result``; a
    caller that cancels its future (it timed out waiting) makes ``set_result`` raise
    ``InvalidStateError`` in the worker thread, which dies, and every later request waits
    forever. Plausible: ``InvalidStateError`` on a future the caller cancelled is a common
    crash of request loops.

    Breaks GEN-002 ("every caller MUST receive the response to its own prompt").
    """

    def _submit(self, request: TensorDictBase) -> cf.Future[TensorDict]:
        fut: cf.Future[TensorDict] = cf.Future()
        with self._lock:
            if self._closed:
                raise ServerClosedError("submit: the server was shut down; no request is taken")
            self._unresolved.add(fut)
            self._queue.put(_Pending(request, fut, time.perf_counter()))
        return fut

    def _resolve(self, fut: cf.Future[TensorDict], **kw: Any) -> None:
        with self._lock:
            self._unresolved.discard(fut)
        if fut.done() and not fut.cancelled():  # failed at a shutdown deadline: first wins
            return
        if kw.get("error") is not None:
            fut.set_exception(kw["error"])
        else:
            fut.set_result(kw.get("result"))


def demo_cancel_kills_worker() -> bool:
    died: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda a: died.append(a.exc_value)  # the worker's death, recorded
    srv = CancelKillsWorkerServer(tiny_causal_lm(), max_new_tokens=2)
    try:
        client = srv.client()
        first = client.submit(_req(5, 6))
        first.cancel()
        second = client.submit(_req(7, 8))
        try:
            second.result(timeout=2)
        except cf.TimeoutError:
            return bool(died)
        return False
    finally:
        srv.shutdown(timeout=1.0)
        _settle(second, error=RuntimeError("demo over"))
        threading.excepthook = hook


class _MaskFromIds:
    """Calls the model with the attention mask inferred from the ids (``ids != pad``)."""

    def __init__(self, model: Any, pad: int = 0) -> None:
        self.model = model
        self.config = model.config
        self.pad = pad

    def __call__(self, *, input_ids: torch.Tensor, **_: Any) -> Any:
        mask = (input_ids != self.pad).long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos)


class MaskFromPadIdServer(DrainBatchingServer):
    """BUG: the attention mask is inferred from the ids (``input_ids != pad_token_id``), as
    Hugging Face ``generate`` does when no mask is passed, so a prompt that contains the pad
    id (0 here) as a real token has it masked out, alone or in a batch, and the log-probs are
    not the serving weights' own (transformers warns about exactly this when pad == eos).

    Breaks GEN-004 ("('log_probs', 'response') MUST equal the serving weights' log-probs of
    the response tokens within 1e-4").
    """

    def _decode(self, engine: _Engine, prompts: list[tuple[int, ...]]) -> list[Decoded]:
        return greedy_decode(
            _MaskFromIds(engine.model), prompts, self._max_new, stop=self._abort.is_set
        )


@torch.no_grad()
def _reference_log_probs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(prompt)
    return torch.stack([lp[p - 1 + i, t] for i, t in enumerate(response)])


def demo_mask_from_pad_id() -> bool:
    policy = tiny_causal_lm()
    srv = MaskFromPadIdServer(policy, max_new_tokens=3)
    try:
        out = srv.client().submit(_req(5, 0, 0, 7)).result(timeout=30)
    finally:
        srv.shutdown()
    ref = _reference_log_probs(policy, [5, 0, 0, 7], out.get(RESPONSE_KEY).tolist())
    return not torch.allclose(out.get(RESPONSE_LOG_PROBS_KEY), ref, atol=1e-4)


class VersionShapeOneServer(DrainBatchingServer):
    """BUG: ``policy_version`` is stamped as ``torch.tensor([version])``, shape [1] instead of
    a scalar, the shape-[1]-for-a-scalar slip (TorchRL's GRPOLoss returned shape-[1] terms).
    Stacking responses then gives a [B, 1] version column.

    Breaks GEN-001 ("policy_version int64 []").
    """

    def _resolve(self, fut: cf.Future[TensorDict], **kw: Any) -> None:
        result = kw.get("result")
        if result is not None:
            v = result.get("policy_version")
            result.del_("policy_version")
            result.set("policy_version", v.reshape(1))
        super()._resolve(fut, **kw)


def demo_version_shape_one() -> bool:
    srv = VersionShapeOneServer(tiny_causal_lm(), max_new_tokens=2)
    try:
        out = srv.client().submit(_req(5, 6)).result(timeout=30)
    finally:
        srv.shutdown()
    return tuple(out.get("policy_version").shape) != ()


# ---------------------------------------------------------------------------------------------
# Declarations


def _impl(cls: type[DrainBatchingServer]) -> Implementation:
    return Implementation(
        "generation",
        lambda policy, *, max_new_tokens: cls(policy, max_new_tokens=max_new_tokens),
        name=f"independent.variants.{cls.__name__}",
        options={"on_shutdown": "drain"},
    )


BASES: dict[str, Implementation] = {}

# name -> (requirement id the bug breaks, declaration)
VARIANTS: dict[str, tuple[str, Implementation]] = {
    "squeezed_prompt": ("GEN-001", _impl(SqueezedPromptServer)),
    "budget_off_by_one": ("GEN-001", _impl(BudgetOffByOneServer)),
    "mixed_clock": ("GEN-010", _impl(MixedClockServer)),
    "second_shutdown_raises": ("GEN-008", _impl(SecondShutdownRaisesServer)),
    "none_timeout_zero": ("GEN-008", _impl(NoneTimeoutZeroServer)),
    "cancel_kills_worker": ("GEN-002", _impl(CancelKillsWorkerServer)),
    "mask_from_pad_id": ("GEN-004", _impl(MaskFromPadIdServer)),
    "version_shape_one": ("GEN-001", _impl(VersionShapeOneServer)),
}

DEMOS: dict[str, Callable[[], bool]] = {
    "squeezed_prompt": demo_squeezed_prompt,
    "budget_off_by_one": demo_budget_off_by_one,
    "mixed_clock": demo_mixed_clock,
    "second_shutdown_raises": demo_second_shutdown_raises,
    "none_timeout_zero": demo_none_timeout_zero,
    "cancel_kills_worker": demo_cancel_kills_worker,
    "mask_from_pad_id": demo_mask_from_pad_id,
    "version_shape_one": demo_version_shape_one,
}
