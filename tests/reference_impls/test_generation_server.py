"""The reference generation server's options beyond the default row."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.contracts import Implementation
from posttrain.contracts.generation import (
    PROMPT_KEY,
    RESPONSE_KEY,
    RESPONSE_LOG_PROBS_KEY,
    request_problem,
)
from posttrain.reference_impls import ThreadGenerationServer
from posttrain.reference_impls.generation_server import greedy_answers
from posttrain.testing import tiny_causal_lm

DRAIN = Implementation(
    "generation",
    partial(ThreadGenerationServer, on_shutdown="drain"),
    name="ThreadGenerationServer(on_shutdown='drain')",
    options={"on_shutdown": "drain"},
)


def test_drain_mode_serves_every_pending_request_at_shutdown() -> None:
    rep = run(DRAIN)
    rows = {r.id: r for r in rep.results}
    assert rows["GEN-008"].status is Status.PASS  # with 'drain' the check demands all served
    assert rep.ok


def test_a_server_that_fails_pending_requests_cannot_declare_drain() -> None:
    liar = Implementation(
        "generation",
        ThreadGenerationServer,  # on_shutdown="fail" by default
        name="ThreadGenerationServer declared drain",
        options={"on_shutdown": "drain"},
    )
    row = {r.id: r for r in run(liar).results}["GEN-008"]
    assert row.status is Status.FAIL
    assert "pending requests failed" in row.message


def test_a_cancelled_request_does_not_kill_the_server() -> None:
    import torch
    from tensordict import TensorDict

    from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY
    from posttrain.testing import tiny_causal_lm

    server = ThreadGenerationServer(tiny_causal_lm(), max_new_tokens=2, timeout=0.2)
    client = server.client()
    req = TensorDict({PROMPT_KEY: torch.tensor([5, 6])}, [])
    first = client.submit(req)  # the worker waits 0.2 s for more before running its batch
    cancelled = first.cancel()
    later = client.submit(req).result(timeout=30)
    assert later.get(RESPONSE_KEY).numel() == 2
    assert cancelled == first.cancelled()
    server.shutdown()


def test_submits_racing_shutdown_never_stay_pending() -> None:
    import threading

    import torch
    from tensordict import TensorDict

    from posttrain.contracts.generation import PROMPT_KEY
    from posttrain.testing import tiny_causal_lm

    server = ThreadGenerationServer(tiny_causal_lm(), max_new_tokens=2)
    futures = []
    stop = threading.Event()

    def keep_submitting() -> None:
        client = server.client()
        while not stop.is_set():
            futures.append(client.submit(TensorDict({PROMPT_KEY: torch.tensor([5])}, [])))

    t = threading.Thread(target=keep_submitting)
    t.start()
    server.shutdown(5.0)
    stop.set()
    t.join(10)
    assert futures
    assert all(f.done() for f in futures)


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ({"max_batch_size": 0}, "max_batch_size: expected a positive int, found 0"),
        ({"max_batch_size": -3}, "max_batch_size: expected a positive int, found -3"),
        ({"max_new_tokens": 0}, "max_new_tokens: expected a positive int, found 0"),
        ({"timeout": -1.0}, "timeout: expected seconds >= 0, found -1.0"),
    ],
)
def test_bad_settings_are_refused_at_construction(option: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        ThreadGenerationServer(tiny_causal_lm(), **option)  # type: ignore[arg-type]


class _ExecutorServer:
    """A generation server over ``ThreadPoolExecutor`` (one request per job): ``shutdown``
    cancels what is still queued, as ``shutdown(cancel_futures=True)`` does."""

    def __init__(self, policy: Any, *, max_new_tokens: int) -> None:
        self.policy, self.max_new_tokens = policy, max_new_tokens
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._lock = threading.Lock()
        self._version = 0
        self._served = 0
        self._forward_s = 0.0

    def client(self) -> _ExecutorServer:
        return self

    def submit(self, request: TensorDictBase, /) -> Future[TensorDictBase]:
        return self._pool.submit(self._serve, request)  # after shutdown: RuntimeError

    @property
    def policy_version(self) -> int:
        return self._version

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._lock:
            if weights is not None:
                self.policy.load_state_dict(dict(weights))
            self._version += 1

    def stats(self) -> dict[str, float]:
        n = max(self._served, 1)
        return {"queue_wait_s": 0.0, "batch_size": 1.0, "forward_s": self._forward_s / n}

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _serve(self, request: TensorDictBase) -> TensorDictBase:
        problem = request_problem(request)
        if problem:
            raise ValueError(problem)
        start = time.perf_counter()
        with self._lock, torch.no_grad():
            version = self._version
            ((tokens, lps),) = greedy_answers(
                self.policy, [request.get(PROMPT_KEY)], self.max_new_tokens, pad=0, eos=2
            )
        self._served += 1
        self._forward_s += time.perf_counter() - start
        return TensorDict(
            {
                RESPONSE_KEY: tokens,
                RESPONSE_LOG_PROBS_KEY: lps,
                "policy_version": torch.tensor(version, dtype=torch.int64),
            },
            [],
        )


def test_a_server_that_cancels_pending_futures_at_shutdown_conforms() -> None:
    impl = Implementation(
        "generation", _ExecutorServer, name="executor server", options={"on_shutdown": "fail"}
    )
    rep = run(impl)
    rows = {r.id: r for r in rep.results}
    assert rep.ok, [r.message for r in rep.results if r.blocking]
    assert rows["GEN-008"].status is Status.PASS  # cancelled futures are settled failures
    assert rows["GEN-009"].status is Status.PASS
    server = _ExecutorServer(tiny_causal_lm(), max_new_tokens=2)
    futures = [server.submit(TensorDict({PROMPT_KEY: torch.tensor([5, 6])}, [])) for _ in range(32)]
    server.shutdown()
    assert any(f.cancelled() for f in futures)  # the check above did meet cancellations
