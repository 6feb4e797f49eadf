"""TorchRL's CSVLogger, TensorboardLogger and WandbLogger as metric sinks, read back through their
backends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import posttrain.adapters.torchrl.implementations as trl_impls
from posttrain.adapters.torchrl.deviations import LOGGER_DEVIATIONS, Deviation
from posttrain.conformance import Status
from posttrain.conformance.runner import run


def _fresh_env() -> dict[str, str]:
    # No key, no server and no inherited mode: a run that tries to go online fails at login.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_BASE_URL="http://127.0.0.1:9", NETRC=os.devnull, WANDB_SILENT="true")
    return env


@pytest.mark.parametrize(
    ("name", "no_step"),
    [
        (
            "CSV_LOGGER",
            "'nostep_c/x': 4.5 logged without a step after steps [5], expected at step 6",
        ),
        ("TENSORBOARD_LOGGER", "'nostep_a/x': 1.5 logged without a step after steps [0]"),
    ],
)
def test_torchrl_loggers_conform_but_for_a_missing_step(name: str, no_step: str) -> None:
    rep = run(getattr(trl_impls, name))
    assert [r.id for r in rep.results if r.status is Status.PASS] == [
        f"MET-00{i}" for i in range(1, 7)
    ]
    (met7,) = (r for r in rep.results if r.id == "MET-007")
    assert met7.status is Status.FAIL
    assert no_step in met7.message, met7.message
    assert rep.surprises() == []  # declared: known_failures={"MET-007"}


def test_torchrl_wandb_logger_loses_metrics_named_step() -> None:
    rep = run(trl_impls.WANDB_LOGGER)
    status = {r.id: r.status for r in rep.results}
    assert status == {
        "MET-001": Status.PASS,
        "MET-002": Status.FAIL,
        "MET-003": Status.PASS,
        "MET-004": Status.PASS,
        "MET-005": Status.NOT_APPLICABLE,  # no flush to the .wandb file on demand
        "MET-006": Status.NOT_APPLICABLE,  # one run per process
        "MET-007": Status.PASS,  # no step: one past the highest of the name's step group
        # Not declared: TorchRL's log_histogram builds wandb.Histogram over NumPy's own range.
        "MET-008": Status.NOT_APPLICABLE,
        "MET-009": Status.NOT_APPLICABLE,
    }
    (met2,) = (r for r in rep.results if r.id == "MET-002")
    assert "'step' logged but not read back" in met2.message
    assert rep.surprises() == []  # declared: known_failures={"MET-002"}


def test_step_columns_follow_torchrls_rule() -> None:
    from torchrl.record.loggers.wandb import WandbLogger

    from posttrain.adapters.torchrl.loggers import torchrl_wandb_step_key

    for name in ("loss", "step", "policy/kl_ref/k3", "time/weight_sync_s", "a/step", "a/b/step"):
        assert torchrl_wandb_step_key(name) == WandbLogger._step_key(name), name


def test_the_row_leaves_later_wandb_runs_of_the_process_as_they_were() -> None:
    # TorchRL's offline=True would leave WANDB_MODE=dryrun in W&B's per-process settings.
    code = """
import tempfile, wandb
from posttrain.adapters.torchrl.loggers import wandb_logger
wandb_logger(tempfile.mkdtemp()).close()
try:
    wandb.init(dir=tempfile.mkdtemp())
except wandb.errors.UsageError as e:
    assert "API key" in str(e), e  # it tried to go online, as a plain init should here
else:
    raise SystemExit("a later plain wandb.init() ran offline")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_fresh_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("deviation", LOGGER_DEVIATIONS, ids=lambda d: "-".join(d.requirements))
def test_each_published_logger_repro_still_reproduces(deviation: Deviation) -> None:
    out = subprocess.run(
        [sys.executable, str(deviation.path)], capture_output=True, text=True, env=_fresh_env()
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
