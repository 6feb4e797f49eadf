"""Session set-up shared by the tests."""

from __future__ import annotations

import os
import sys

import pytest

# One intra-op thread per process. The tests' tensors are tiny, and with torch's default of one
# thread per core, OpenMP's threads spin against everything else running: on a 2-core machine
# with one other busy process, the loss suite's tests took 125 CPU s instead of 15. Set before
# torch is imported below, so processes the tests spawn inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# pytester's in-process runs (tests/conformance/test_conformance_plugin.py) drop every module first
# imported inside them. Were transformers' Llama module first imported there, the class
# transformers caches would no longer be the one in sys.modules, and pickling a tiny model
# to another process (the cross-process weight syncs) would fail. Import it up front.
import torch
import transformers.models.llama.modeling_llama  # noqa: F401

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # if a plugin imported torch first

_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # Once everything is reported, leave without interpreter teardown: one fresh-clone CI run
    # passed every test and then segfaulted at exit (Ray's core worker, gloo process groups
    # and TorchRL's receiver threads are torn down in native code after Python's). The exit
    # status is the session's own.
    # POSTTRAIN_FULL_TEARDOWN=1 keeps the normal exit, to look for that crash.
    if _STATUS in config.stash and not os.environ.get("POSTTRAIN_FULL_TEARDOWN"):
        # os._exit skips atexit: remove the cached TRL loss trainers' temporary folders here.
        trl_loss = sys.modules.get("posttrain.adapters.trl.loss")
        for trainer in getattr(trl_loss, "_TRAINERS", {}).values():
            trainer.posttrain_output_dir.cleanup()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_STATUS])
