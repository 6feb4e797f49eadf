"""TorchRL's loggers as metric sinks, read back through each backend's own files and reader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from posttrain._deps import optional_deps

EXP_NAME = "run"


def csv_logger(directory: str | os.PathLike[str]) -> Any:
    """TorchRL's ``CSVLogger`` writing under ``directory`` (the metrics-sink factory).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> csv_logger(d).log_scalar("rollout/reward/mean", 0.5, step=2)
        >>> read_torchrl_csv(d)
        {'rollout/reward/mean': [(2, 0.5)]}
    """
    with optional_deps():
        from torchrl.record.loggers.csv import CSVLogger

    return CSVLogger(exp_name=EXP_NAME, log_dir=str(directory))


def read_torchrl_csv(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a ``CSVLogger`` wrote under ``directory``: ``scalars/<name>.csv`` files.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = csv_logger(d)
        >>> sink.log_scalar("loss", 1.5, step=0); sink.log_scalar("loss", 0.5, step=1)
        >>> sink.log_scalar("policy/kl", 0.25, step=1)  # written to scalars/policy/kl.csv
        >>> read_torchrl_csv(d)
        {'loss': [(0, 1.5), (1, 0.5)], 'policy/kl': [(1, 0.25)]}
    """
    root = Path(directory, EXP_NAME, "scalars")
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(root.rglob("*.csv")):
        name = path.relative_to(root).with_suffix("").as_posix()
        for line in path.read_text().splitlines():
            if line.strip():
                step, value = line.split(",", 1)
                out.setdefault(name, []).append((int(step), float(value)))
    return out


def tensorboard_logger(directory: str | os.PathLike[str]) -> Any:
    """TorchRL's ``TensorboardLogger`` writing event files under ``directory``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = tensorboard_logger(d)
        >>> sink.log_scalar("policy/kl_ref/k3", 0.25, step=3)
        >>> sink.close()
        >>> read_tensorboard(d)
        {'policy/kl_ref/k3': [(3, 0.25)]}
    """
    with optional_deps():
        from torchrl.record.loggers.tensorboard import TensorboardLogger

    return TensorboardLogger(exp_name=EXP_NAME, log_dir=str(directory))


def read_tensorboard(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``directory``, via TensorBoard's reader.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> sink = tensorboard_logger(d)
        >>> sink.log_scalar("loss", 1.5, step=0); sink.log_scalar("loss", 0.5, step=1)
        >>> sink.close()
        >>> read_tensorboard(d)
        {'loss': [(0, 1.5), (1, 0.5)]}
    """
    from posttrain.observability.sinks import read_tensorboard as read

    return read(directory)


def wandb_logger(directory: str | os.PathLike[str]) -> Any:
    """TorchRL's ``WandbLogger`` writing an offline W&B run under ``directory``.

    Offline through W&B's own ``mode="offline"``, not TorchRL's ``offline=True``: that flag
    only sets ``WANDB_MODE``, which W&B reads once per process, so it is ignored after any
    earlier W&B run in the process, and when it comes first it leaves every later W&B run of
    the process offline (``tests/adapters/torchrl/test_loggers.py`` pins both).

    Example:
        >>> import tempfile
        >>> sink = wandb_logger(tempfile.mkdtemp())  # doctest: +SKIP
        >>> sink.log_scalar("policy/kl_ref/k3", 0.25, step=3); sink.close()  # doctest: +SKIP
    """
    with optional_deps():
        from torchrl.record.loggers.wandb import WandbLogger

    from posttrain.observability.sinks import quiet_wandb_settings

    return WandbLogger(
        exp_name=EXP_NAME,
        offline=False,
        mode="offline",
        save_dir=str(directory),
        project="posttrain",
        log_env_packages=False,
        reinit="create_new",
        settings=quiet_wandb_settings(),
    )


def torchrl_wandb_step_key(name: str) -> str:
    """The history column holding ``name``'s step in a TorchRL ``WandbLogger`` run (TorchRL
    0.14's rule: one step column per name group, a top-level name against ``step``).

    Example:
        >>> torchrl_wandb_step_key("policy/kl_ref/k3"), torchrl_wandb_step_key("loss")
        ('policy/kl_ref/step', 'step')
    """
    if name == "step" or name.endswith("/step"):
        return name
    prefix, sep, _ = name.rpartition("/")
    return f"{prefix}{sep}step" if sep else "step"


def read_torchrl_wandb(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a ``WandbLogger`` wrote under ``directory``, through W&B's own reader.

    TorchRL keeps one step column per name group (:func:`torchrl_wandb_step_key`); names that
    are themselves step columns are not metrics.

    Example:
        >>> import tempfile
        >>> read_torchrl_wandb(tempfile.mkdtemp())
        {}
    """
    from posttrain.observability.sinks import read_wandb

    return read_wandb(directory, step_key=torchrl_wandb_step_key)
