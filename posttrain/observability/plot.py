"""A run's metrics as one PNG dashboard of the core panels.

``python -m posttrain.observability.plot RUN_DIR --out dashboard.png`` reads JSONL
(``JsonlSink``), TensorBoard event files or an MLflow store (``MlflowSink``) under ``RUN_DIR``
and draws reward, KL, entropy, clip fractions, lengths, throughput and staleness, one panel
each, with the catalogue's names and units. Needs matplotlib (``posttrain[observability]``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from posttrain._deps import optional_deps
from posttrain.contracts.catalogue import CATALOGUE_V1

Scalars = dict[str, list[tuple[int, float]]]

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("rollout/reward/mean", "rollout/reward/min", "rollout/reward/max")),
    ("KL to reference", ("policy/kl_ref/k3", "policy/kl_ref/k1")),
    ("entropy", ("policy/entropy", "policy/entropy/sampled")),
    ("clip fraction", ("policy/clip_frac/low", "policy/clip_frac/high")),
    ("lengths", ("rollout/response_len/mean", "rollout/prompt_len/mean")),
    ("throughput", ("perf/gen_tokens_per_s", "perf/train_tokens_per_s")),
    ("staleness", ("staleness/mean", "staleness/max")),
    ("loss", ("loss/total", "loss/policy")),
)
"""Panel title -> the catalogue metrics it draws."""


def read_run(directory: str | os.PathLike[str], *, mlflow_run: str | None = None) -> Scalars:
    """Every scalar under ``directory``: JSONL, TensorBoard, an MLflow store (one run of it
    with ``mlflow_run``) and offline W&B runs written by ``WandbSink``, merged.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> d = tempfile.mkdtemp()
        >>> sink = JsonlSink(d); sink.log_scalar("rollout/reward/mean", 0.5, step=1); sink.close()
        >>> read_run(d)
        {'rollout/reward/mean': [(1, 0.5)]}
    """
    d = Path(directory)
    out: Scalars = {}
    if any(d.rglob("*.jsonl")):
        from posttrain.reference_impls import read_jsonl

        for sub in sorted({p.parent for p in d.rglob("*.jsonl")}):
            for k, v in read_jsonl(sub).items():
                out.setdefault(k, []).extend(v)
    if any(d.rglob("events.out.tfevents.*")):
        with optional_deps():
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        for run in sorted({p.parent for p in d.rglob("events.out.tfevents.*")}):
            acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                out.setdefault(tag, []).extend(
                    (int(e.step), float(e.value)) for e in acc.Scalars(tag)
                )
    if (d / "mlflow.db").exists():
        from posttrain.observability.sinks import read_mlflow

        for k, v in read_mlflow(d, mlflow_run).items():
            out.setdefault(k, []).extend(v)
    if any(d.rglob("run-*.wandb")):
        from posttrain.observability.sinks import read_wandb

        for k, v in read_wandb(d).items():
            out.setdefault(k, []).extend(v)
    return {k: sorted(v) for k, v in out.items()}


def dashboard(scalars: Scalars, out: str | os.PathLike[str], *, title: str = "") -> Path:
    """Draw :data:`PANELS` from ``scalars`` into a PNG at ``out``; empty panels say so.

    Example:
        >>> import tempfile, os
        >>> path = dashboard({"rollout/reward/mean": [(1, 0.1), (2, 0.4)]}, tempfile.mktemp(suffix=".png"))
        >>> path.stat().st_size > 1000
        True
    """
    with optional_deps():
        import matplotlib

    matplotlib.use("Agg")
    with optional_deps():
        import matplotlib.pyplot as plt

    cols = 4
    rows = -(-len(PANELS) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (name, metrics) in zip(axes.flat, PANELS, strict=False):
        drawn = False
        for m in metrics:
            series = scalars.get(m)
            if not series:
                continue
            steps, values = zip(*series, strict=True)
            ax.plot(steps, values, marker="o", markersize=3, label=m)
            drawn = True
        unit = CATALOGUE_V1.metric(metrics[0]).unit
        ax.set_title(f"{name} [{unit}]", fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(
    argv: list[str] | None = None, prog: str = "python -m posttrain.observability.plot"
) -> int:
    """The command line: read a run directory, write the dashboard PNG.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> d = tempfile.mkdtemp()
        >>> sink = JsonlSink(d); sink.log_scalar("loss/total", 1.0, step=1); sink.close()
        >>> main([d, "--out", os.path.join(d, "dashboard.png")])
        /.../dashboard.png
        0
    """
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("run", type=Path)
    p.add_argument("--out", type=Path, default=Path("dashboard.png"))
    p.add_argument("--mlflow-run", default=None, help="the MLflow run to draw (default: all)")
    args = p.parse_args(argv)
    scalars: Any = read_run(args.run, mlflow_run=args.mlflow_run)
    if not scalars:
        print(f"no metrics found under {args.run}")
        return 1
    print(dashboard(scalars, args.out, title=str(args.run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
