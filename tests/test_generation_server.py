"""The reference generation server's options beyond the default row."""

from __future__ import annotations

import re
from functools import partial

import pytest

from posttrain.conformance import Status, run
from posttrain.conformance.policy import tiny_causal_lm
from posttrain.contracts import Implementation
from posttrain.reference_impls import ThreadGenerationServer

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

    from posttrain.conformance.policy import tiny_causal_lm
    from posttrain.contracts.generation import PROMPT_KEY, RESPONSE_KEY

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

    from posttrain.conformance.policy import tiny_causal_lm
    from posttrain.contracts.generation import PROMPT_KEY

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
