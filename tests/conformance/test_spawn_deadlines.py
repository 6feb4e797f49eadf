"""The kit's spawned children: a slow start stretches the work's deadline; a hang still fails."""

from __future__ import annotations

import time
from typing import Any

import pytest

from posttrain.conformance._spawn import Spawned


class SlowToUnpickle:
    """An argument whose unpickling in the child takes ``seconds``: a start under load."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __setstate__(self, state: dict[str, Any]) -> None:
        time.sleep(state["seconds"])
        self.__dict__.update(state)


def work(_arg: Any, seconds: float) -> None:
    time.sleep(seconds)


def fail_now(_arg: Any, code: int) -> None:
    raise SystemExit(code)


def test_a_slow_start_stretches_the_deadline_of_the_work() -> None:
    # Work of 2 s against a base of 0.5 s passes because the start took >= 1 s (x 20).
    procs = Spawned(work, [(SlowToUnpickle(1.0), 2.0)])
    assert procs.join(base_s=0.5) == [0]
    assert procs.startup_s is not None
    assert procs.startup_s >= 1.0
    assert procs.deadline_s(0.5) >= 20.0


def test_work_past_the_deadline_is_stopped_and_reported_as_still_running() -> None:
    procs = Spawned(work, [(None, 60.0)], per_startup=0.0)
    start = time.monotonic()
    assert procs.join(base_s=1.0) == [None]
    assert time.monotonic() - start < 30.0
    assert not procs.procs[0].is_alive()


def test_a_child_that_dies_before_it_runs_fails_at_once_with_its_exit_code() -> None:
    # An argument that cannot be unpickled in the child: it exits before _entry runs.
    procs = Spawned(work, [(_Unloadable(), 0.0)])
    with pytest.raises(TimeoutError, match="exited with 1 before it started running"):
        procs.wait_started()


def test_a_child_that_exits_with_an_error_shows_its_code() -> None:
    assert Spawned(fail_now, [(None, 3)]).join(base_s=10.0) == [3]


class _Unloadable:
    def __init__(self) -> None:
        self.state = "any"  # an empty __dict__ is pickled without state: no __setstate__ call

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("cannot be rebuilt here")
