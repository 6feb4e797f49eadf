"""Child processes forked from a server that imported the heavy modules once.

A fresh interpreter spends seconds importing torch (about 3 s on an idle 2-core machine); a
child forked from the process's forkserver, which imported it once, starts in a fraction of a
second. The conformance kit's ranks and writers and TorchRL's distributed weight-sync receiver
all start their children here.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no forkserver on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext


def context(preload: Sequence[str] | None = None) -> SpawnContext | ForkServerContext:
    """Where the children come from: with ``preload``, forked from the process's forkserver,
    which imported those modules once; without it, or where the platform has no forkserver,
    spawned.

    The forkserver is one per process and imports its modules when it starts: the first call
    that starts it decides them, and a later caller's children import what is missing.

    Example:
        >>> context().get_start_method()
        'spawn'
        >>> context(["torch"]).get_start_method()
        'forkserver'
    """
    if preload is None or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx
