"""TorchRL's loggers as metric sinks, read back through each backend's own files and reader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = [
    "csv_logger",
    "read_tensorboard",
    "read_torchrl_csv",
    "read_torchrl_wandb",
    "tensorboard_logger",
    "wandb_logger",
]

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
    from torchrl.record.loggers.csv import CSVLogger

    return CSVLogger(exp_name=EXP_NAME, log_dir=str(directory))


def read_torchrl_csv(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a ``CSVLogger`` wrote under ``directory``: ``scalars/<name>.csv`` files."""
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
    from torchrl.record.loggers.tensorboard import TensorboardLogger

    return TensorboardLogger(exp_name=EXP_NAME, log_dir=str(directory))


def read_tensorboard(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``directory``, via TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    runs = sorted({p.parent for p in Path(directory).rglob("events.out.tfevents.*")})
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((int(e.step), float(e.value)) for e in acc.Scalars(tag))
    return out


def wandb_logger(directory: str | os.PathLike[str]) -> Any:
    """TorchRL's ``WandbLogger`` in offline mode, writing a W&B run under ``directory``.

    TorchRL's logger sets ``WANDB_MODE=dryrun`` in the process environment; the previous value is
    put back so later W&B runs of the process are not silently offline.

    Example:
        >>> import tempfile
        >>> sink = wandb_logger(tempfile.mkdtemp())  # doctest: +SKIP
        >>> sink.log_scalar("policy/kl_ref/k3", 0.25, step=3); sink.close()  # doctest: +SKIP
    """
    from torchrl.record.loggers.wandb import WandbLogger

    from posttrain.observability.sinks import quiet_wandb_settings

    before = os.environ.get("WANDB_MODE")
    try:
        return WandbLogger(
            exp_name=EXP_NAME,
            offline=True,
            # offline=True alone only sets WANDB_MODE, which W&B reads once per process: after any
            # earlier W&B run in the process the logger would try to go online (see
            # docs/torchrl.md); W&B's own mode argument is what makes every run offline.
            mode="offline",
            save_dir=str(directory),
            project="posttrain",
            log_env_packages=False,
            reinit="create_new",
            settings=quiet_wandb_settings(),
        )
    finally:
        if before is None:
            os.environ.pop("WANDB_MODE", None)
        else:
            os.environ["WANDB_MODE"] = before


def read_torchrl_wandb(directory: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a ``WandbLogger`` wrote under ``directory``, through W&B's own reader.

    TorchRL keeps one step column per name group: ``a/b/c`` is plotted against ``a/b/step``, a
    top-level name against ``step``; names that are themselves step columns are not metrics.
    """
    from torchrl.record.loggers.wandb import WandbLogger

    from posttrain.observability.sinks import read_wandb

    return read_wandb(directory, step_key=WandbLogger._step_key)
