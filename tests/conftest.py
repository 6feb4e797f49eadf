"""Session set-up shared by the tests."""

from __future__ import annotations

import os
import sys

import pytest

# pytester's in-process runs (tests/test_conformance_plugin.py) drop every module first
# imported inside them. Were transformers' Llama module first imported there, the class
# transformers caches would no longer be the one in sys.modules, and pickling a tiny model
# to another process (the cross-process weight syncs) would fail. Import it up front.
import transformers.models.llama.modeling_llama  # noqa: F401

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
