"""The reference generation server: one worker thread batching requests over HF ``generate``."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._args import positive_int
from posttrain._futures import settle
from posttrain.contracts.generation import (
    PROMPT_KEY,
    RESPONSE_KEY,
    RESPONSE_LOG_PROBS_KEY,
    request_problem,
)
from posttrain.errors import ServerClosed


@dataclass
class _Request:
    td: TensorDictBase
    future: Future[TensorDictBase]
    queued: float = field(default_factory=time.perf_counter)


class _Client:
    def __init__(self, server: ThreadGenerationServer) -> None:
        self._server = server

    def submit(self, request: TensorDictBase, /) -> Future[TensorDictBase]:
        return self._server._submit(request)

    def __call__(self, request: TensorDictBase, /) -> TensorDictBase:
        return self.submit(request).result()


class ThreadGenerationServer:
    """Conforms to ``GenerationServerV1``: greedy HF generation, batched by one worker thread.

    The worker takes up to ``max_batch_size`` queued requests (waiting ``timeout`` seconds for
    more after the first), checks each (a bad one fails its own future), left-pads the valid
    prompts, generates greedily, and scores each answer alone (prompt + response, no padding)
    for its log-probs. ``update_policy_weights_`` checks names, shapes and dtypes, then loads
    between batches: once it returns, every later request sees the new weights. ``shutdown``
    fails pending requests (``on_shutdown="fail"``, the default) or serves them (``"drain"``).

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> server = ThreadGenerationServer(tiny_causal_lm(), max_new_tokens=2)
        >>> out = server.client()(TensorDict({("tokens", "prompt"): torch.tensor([5, 6])}, []))
        >>> out["tokens", "response"].shape, int(out["policy_version"])
        (torch.Size([2]), 0)
        >>> server.shutdown(); server.shutdown()
    """

    def __init__(
        self,
        policy: Any,
        *,
        max_new_tokens: int = 4,
        max_batch_size: int = 8,
        timeout: float = 0.005,
        on_shutdown: str = "fail",
    ) -> None:
        if on_shutdown not in ("fail", "drain"):
            raise ValueError(f"on_shutdown: expected 'fail' or 'drain', found {on_shutdown!r}")
        max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
        max_batch_size = positive_int("max_batch_size", max_batch_size)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise ValueError(f"timeout: expected seconds >= 0, found {timeout!r}")
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.max_batch_size = max_batch_size
        self.timeout = timeout
        self.on_shutdown = on_shutdown
        cfg = policy.config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._weights_lock = threading.Lock()
        self._state_lock = threading.Lock()  # _closed, enqueueing and the in-flight batch
        self._inflight: list[_Request] = []
        self._version = 0
        self._closed = False
        self._stats = {"queue_wait_s": 0.0, "batch_size": 0.0, "forward_s": 0.0}
        self._batches = 0
        self._worker = threading.Thread(target=self._serve, name="generation-server", daemon=True)
        self._worker.start()

    # --- the contract -----------------------------------------------------------------

    def client(self) -> _Client:
        """A client handle (``submit`` returns a ``concurrent.futures.Future``)."""
        return _Client(self)

    @property
    def policy_version(self) -> int:
        """The version stamped on responses generated from now on."""
        return self._version

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        """Load ``weights`` between batches (checked first: a bad set changes nothing)."""
        if self._closed:
            raise ServerClosed("update_policy_weights_ after shutdown()")
        with self._weights_lock:
            if weights is not None:
                own = self.policy.state_dict()
                bad = sorted(set(own) ^ set(weights)) + sorted(
                    k
                    for k in own
                    if k in weights
                    and (weights[k].shape != own[k].shape or weights[k].dtype != own[k].dtype)
                )
                if bad:
                    raise ValueError(f"weights rejected (server unchanged): {bad[:5]}")
                self.policy.load_state_dict(dict(weights), strict=True)
            self._version += 1

    def stats(self) -> dict[str, float]:
        """Means over served batches: queue wait, batch size, forward time (seconds)."""
        n = max(self._batches, 1)
        return {k: v / n for k, v in self._stats.items()} | {"batches": float(self._batches)}

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Stop; pending requests fail or drain (``on_shutdown``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.on_shutdown == "fail":  # stop after the batch in progress: the sentinel goes first
            with self._queue.mutex:
                self._queue.queue.appendleft(None)
                self._queue.unfinished_tasks += 1
                self._queue.not_empty.notify()
        else:  # drain: the sentinel queues behind every pending request
            self._queue.put(None)
        self._worker.join(timeout)
        while True:  # whatever the worker did not take fails now: no future stays pending
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and not item.future.done():
                item.future.set_exception(
                    ServerClosed("the server shut down before serving this request")
                )

    # --- the worker ---------------------------------------------------------------------

    def _submit(self, td: TensorDictBase) -> Future[TensorDictBase]:
        fut: Future[TensorDictBase] = Future()
        if self._closed:
            fut.set_exception(
                ServerClosed("submit after shutdown(): this server serves no more requests")
            )
            return fut
        self._queue.put(_Request(td, fut))
        return fut

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                if self.on_shutdown == "drain":
                    self._drain()
                return
            batch = [first]
            stop = False
            deadline = time.perf_counter() + self.timeout
            while len(batch) < self.max_batch_size:
                try:
                    item = self._queue.get(timeout=max(deadline - time.perf_counter(), 0))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._run(batch)
            if stop:
                if self.on_shutdown == "drain":
                    self._drain()
                return

    def _drain(self) -> None:
        pending = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item)
        for i in range(0, len(pending), self.max_batch_size):
            self._run(pending[i : i + self.max_batch_size])

    def _run(self, batch: list[_Request]) -> None:
        valid = []
        for req in batch:
            if not req.future.set_running_or_notify_cancel():
                continue  # cancelled by its caller
            problem = request_problem(req.td)
            if problem:
                settle(req.future, error=ValueError(problem))
            else:
                valid.append(req)
        if not valid:
            return
        with self._state_lock:
            self._inflight = valid
        start = time.perf_counter()
        try:
            with self._weights_lock, torch.no_grad():
                version = self._version
                answers = self._generate([r.td.get(PROMPT_KEY) for r in valid])
        except Exception as e:
            for r in valid:
                r.future.set_exception(e)
            return
        forward = time.perf_counter() - start
        self._batches += 1
        self._stats["batch_size"] += len(valid)
        self._stats["forward_s"] += forward
        self._stats["queue_wait_s"] += sum(start - r.queued for r in valid) / len(valid)
        for r, (tokens, lps) in zip(valid, answers, strict=True):
            settle(
                r.future,
                result=TensorDict(
                    {
                        RESPONSE_KEY: tokens,
                        RESPONSE_LOG_PROBS_KEY: lps,
                        "policy_version": torch.tensor(version, dtype=torch.int64),
                    },
                    batch_size=[],
                ),
            )

    def _generate(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return greedy_answers(self.policy, prompts, self.max_new_tokens, pad=self.pad, eos=self.eos)


def greedy_answers(
    policy: Any, prompts: list[torch.Tensor], max_new_tokens: int, *, pad: int, eos: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per prompt: its greedy response (cut after EOS) and the response's log-probs, each
    answer scored alone (prompt + response, no padding) so batching cannot move them.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> [(t.shape, lp.dtype) for t, lp in greedy_answers(tiny_causal_lm(), [torch.tensor([5, 6])], 2, pad=0, eos=2)]
        [(torch.Size([2]), torch.float32)]
    """
    n, width = len(prompts), max(int(p.numel()) for p in prompts)
    ids = torch.full((n, width), pad, dtype=torch.int64)
    mask = torch.zeros(n, width, dtype=torch.int64)
    for i, p in enumerate(prompts):  # HF batched generation wants left padding
        ids[i, width - p.numel() :] = p
        mask[i, width - p.numel() :] = 1
    out = policy.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    answers = []
    for i, p in enumerate(prompts):
        resp = out[i, width:].tolist()
        if eos is not None and eos in resp:
            resp = resp[: resp.index(eos) + 1]
        full = torch.tensor([*p.tolist(), *resp], dtype=torch.int64)
        logits = policy(input_ids=full[None]).logits[0, :-1].float()
        lp = logits.log_softmax(-1)[p.numel() - 1 :].gather(-1, full[p.numel() :, None])[:, 0]
        answers.append((full[p.numel() :], lp))
    return answers
