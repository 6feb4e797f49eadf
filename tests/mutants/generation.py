"""Deliberately broken generation servers: each must fail the suite with its requirement's id."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from posttrain.contracts import Implementation
from posttrain.contracts.generation import RESPONSE_LOG_PROBS_KEY, request_problem
from posttrain.reference_impls import ThreadGenerationServer
from posttrain.reference_impls.generation_server import _Request

__all__ = ["MUTANTS"]


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
    ("GEN-007", _impl("GEN-007", BadRequestKillsServer)),
    ("GEN-008", _impl("GEN-008", HangsOnShutdown)),
]
"""The issue's named bugs beside the main mutants: a bad request that kills the server, a hang
on shutdown."""

_ = RESPONSE_LOG_PROBS_KEY
