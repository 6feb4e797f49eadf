"""TorchRL's CSVLogger, TensorboardLogger and WandbLogger as metric sinks, read back through their
backends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import posttrain.adapters.torchrl.implementations as trl_impls
from posttrain.adapters.torchrl.deviations import LOGGER_DEVIATIONS, Deviation
from posttrain.conformance import Status, run


def _fresh_env() -> dict[str, str]:
    # No key, no server and no inherited mode: a run that tries to go online fails at login.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_BASE_URL="http://127.0.0.1:9", NETRC=os.devnull, WANDB_SILENT="true")
    return env


@pytest.mark.parametrize("name", ["CSV_LOGGER", "TENSORBOARD_LOGGER"])
def test_torchrl_loggers_conform(name: str) -> None:
    rep = run(getattr(trl_impls, name))
    assert [r.id for r in rep.results if r.status is Status.PASS] == [
        f"MET-00{i}" for i in range(1, 7)
    ]


def test_torchrl_wandb_logger_loses_metrics_named_step() -> None:
    rep = run(trl_impls.WANDB_LOGGER)
    status = {r.id: r.status for r in rep.results}
    assert status == {
        "MET-001": Status.PASS,
        "MET-002": Status.FAIL,
        "MET-003": Status.PASS,
        "MET-004": Status.PASS,
        "MET-005": Status.NOT_APPLICABLE,  # no flush to the .wandb file on demand
        "MET-006": Status.PASS,
    }
    (met2,) = (r for r in rep.results if r.id == "MET-002")
    assert "'step' logged but not read back" in met2.message
    assert os.environ.get("WANDB_MODE") != "dryrun"  # the factory put the environment back


@pytest.mark.parametrize("deviation", LOGGER_DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_logger_repro_still_reproduces(deviation: Deviation) -> None:
    out = subprocess.run(
        [sys.executable, "-c", deviation.repro], capture_output=True, text=True, env=_fresh_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_offline_flag_alone_is_not_honoured_after_an_earlier_wandb_run() -> None:
    # Why wandb_logger passes mode="offline": offline=True only sets WANDB_MODE, which W&B reads
    # once per process, so a second logger tries to log in to a server.
    code = """
import tempfile, wandb
from torchrl.record.loggers.wandb import WandbLogger
wandb.init(mode="offline", dir=tempfile.mkdtemp()).finish()
try:
    WandbLogger(exp_name="x", offline=True, save_dir=tempfile.mkdtemp(), log_env_packages=False)
except wandb.errors.UsageError as e:
    assert "API key" in str(e), e
else:
    raise SystemExit("offline=True was honoured")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_fresh_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]
