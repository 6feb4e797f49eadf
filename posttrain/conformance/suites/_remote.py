"""BUF-023's Ray harness: producers in Ray tasks extend a buffer through its clients.

The buffer suite's check (``many_producers``) says what must hold; this module only starts the
producers, holds them at a start line, polls them while the learner samples, and collects what
each extend returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase

from posttrain._deps import optional_deps
from posttrain.conformance.context import ConformanceError

PRODUCERS, EXTENDS_PER_PRODUCER, PER_EXTEND = 3, 4, 3
PRODUCERS_WAIT_S = 120.0

Produced = tuple[list[list[int]], str]
"""One producer's report: the indices each good extend returned, and what its bad extend did
(``"raised <type>: <message>"``, ``"accepted"``, or ``""`` when it sent none)."""


class _Gate:
    """The producers' start line, run as a Ray actor: no producer extends before all have started.

    Ray starts the producers' worker processes seconds apart on a small machine; without a
    start line the first could finish before the last begins, and writes would never race.
    """

    def __init__(self) -> None:
        self.arrived = 0

    def arrive(self) -> None:
        self.arrived += 1

    def count(self) -> int:
        return self.arrived


def _produce(
    handle: Any,
    batches: list[TensorDictBase],
    bad: TensorDictBase | None,
    gate: Any,
    producers: int,
) -> Produced:
    """One producer, run as a Ray task: wait at the gate, extend each batch (the bad one
    half-way), report."""
    with optional_deps():
        import ray

    ray.get(gate.arrive.remote())
    deadline = time.monotonic() + PRODUCERS_WAIT_S / 2
    while ray.get(gate.count.remote()) < producers and time.monotonic() < deadline:
        time.sleep(0.005)
    written: list[list[int]] = []
    outcome = ""
    for i, b in enumerate(batches):
        if bad is not None and i == len(batches) // 2:
            try:
                handle.extend(bad)
                outcome = "accepted"
            except Exception as e:  # any type; the message must name the key
                outcome = f"raised {type(e).__name__}: {e}"
        written.append([int(j) for j in handle.extend(b).tolist()])
    return written, outcome


def run_producers(
    client: Callable[[], Any],
    batches: list[list[TensorDictBase]],
    bad: TensorDictBase | None,
    while_waiting: Callable[[], None],
) -> list[Produced]:
    """One Ray task per entry of ``batches``, each extending through its own ``client()``.

    The first producer also sends ``bad`` half-way. ``while_waiting`` runs between polls (the
    learner's samples) until every producer has finished; a producer still running after
    ``PRODUCERS_WAIT_S`` is cancelled, and that, or a good extend that raised, fails the check.
    """
    with optional_deps():
        import ray

    gate: Any = ray.remote(num_cpus=0)(_Gate).remote()
    task = ray.remote(num_cpus=0)(_produce)
    n = len(batches)
    refs = [
        task.remote(client(), bs, bad if i == 0 else None, gate, n) for i, bs in enumerate(batches)
    ]
    pending = list(refs)
    deadline = time.monotonic() + PRODUCERS_WAIT_S
    try:
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
            while_waiting()
        if pending:
            for ref in pending:  # never leave a producer writing into a buffer the check dropped
                ray.cancel(ref, force=True)
            raise ConformanceError(
                f"{len(pending)} of {n} producers did not finish within {PRODUCERS_WAIT_S:.0f} s"
            )
        try:
            results: list[Produced] = ray.get(refs)
        except Exception as e:
            raise ConformanceError(
                f"a producer's good extend raised {type(e).__name__}: {str(e)[:300]}"
            ) from None
        return results
    finally:
        ray.kill(gate, no_restart=True)
