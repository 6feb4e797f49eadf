"""The kit's spawned processes, with deadlines that follow how slowly processes start right now.

A check that spawns processes (MET-006's writers, GEN-011's clients) must wait for them with a
deadline, or a hanging implementation would stall the run. A fixed deadline fails a correct
implementation on a machine whose cores are busy: a spawned process that imports torch starts
in about 3 s on an idle 2-core machine and in over a minute when 30 processes share the cores.
So each child reports as soon as it runs (its interpreter up, the target and its arguments
unpickled: the imports done), and its work gets ``max(base, PER_STARTUP x the slowest start)``,
the rule ``make report-distributed`` applies to its rows. Only the start itself has a fixed
limit, :data:`STARTUP_LIMIT_S`, far above any start seen, and a child that dies first fails at
once with its exit code.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from posttrain._forkserver import context as context  # the kit's children start there

PER_STARTUP = 20.0
"""A spawned child's work may take this many times the slowest start of its siblings."""

STARTUP_LIMIT_S = 600.0
"""How long a child may take to start running at all (interpreter, imports, unpickling)."""


def _entry(ready: Any, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    ready.put(os.getpid())
    target(*args)


class Spawned:
    """Processes running ``target(*args)`` for each ``args``, spawned, each reporting its start.

    Example:
        >>> procs = Spawned(print, [("a child",)])  # doctest: +SKIP
        >>> procs.join(base_s=10.0)  # doctest: +SKIP
        [0]
    """

    def __init__(
        self,
        target: Callable[..., Any],
        args: Sequence[tuple[Any, ...]],
        *,
        per_startup: float = PER_STARTUP,
        startup_limit_s: float = STARTUP_LIMIT_S,
        preload: Sequence[str] | None = None,
    ) -> None:
        ctx = context(preload)
        self.per_startup = per_startup
        self.startup_limit_s = startup_limit_s
        self._ready: Any = ctx.Queue()
        self._t0 = time.monotonic()
        self.procs = [ctx.Process(target=_entry, args=(self._ready, target, a)) for a in args]
        for p in self.procs:
            p.start()
        self.startup_s: float | None = None

    def wait_started(self) -> float:
        """Block until every child runs; the slowest start in seconds.

        Raises ``TimeoutError`` naming the exit code when a child dies before it runs, or the
        children not yet running after :attr:`startup_limit_s`.
        """
        if self.startup_s is not None:
            return self.startup_s
        waiting = {p.pid for p in self.procs}
        limit = self._t0 + self.startup_limit_s
        while waiting:
            try:
                waiting.discard(self._ready.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            dead = [p for p in self.procs if p.pid in waiting and p.exitcode is not None]
            if dead:
                raise TimeoutError(
                    f"a spawned process exited with {dead[0].exitcode} before it started running"
                )
            if time.monotonic() > limit:
                raise TimeoutError(
                    f"{len(waiting)} of {len(self.procs)} spawned processes not running after "
                    f"{self.startup_limit_s:g} s"
                )
        self.startup_s = time.monotonic() - self._t0
        return self.startup_s

    def deadline_s(self, base_s: float) -> float:
        """Seconds the children's work may take once they run: ``max(base_s, per_startup x start)``.

        Example:
            >>> s = Spawned.__new__(Spawned); s.per_startup, s.startup_s = 20.0, 0.2
            >>> s.deadline_s(10.0), (setattr(s, "startup_s", 3.0), s.deadline_s(10.0))[1]
            (10.0, 60.0)
        """
        return max(base_s, self.per_startup * (self.wait_started()))

    def join(self, base_s: float) -> list[int | None]:
        """Wait for every child to exit within :meth:`deadline_s`; their exit codes (None: still
        running at the deadline, then terminated). Raises :meth:`wait_started`'s
        ``TimeoutError``, every child stopped."""
        try:
            until = time.monotonic() + self.deadline_s(base_s)
        except TimeoutError:
            self.terminate()
            raise
        for p in self.procs:
            p.join(max(0.0, until - time.monotonic()))
        codes = [p.exitcode for p in self.procs]
        self.terminate()
        return codes

    def terminate(self) -> None:
        """Stop every child still running (a check that failed leaves nothing behind)."""
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
                p.join(5.0)
