"""Runs' metrics as one PNG dashboard: every run overlaid, smoothed, with spread bands.

``posttrain plot DIR [DIR ...] --out dashboard.png`` finds every run under each directory:
a folder of JSONL (``JsonlSink``), a folder of TensorBoard event files, each run of an MLflow
store (``MlflowSink``'s ``mlflow.db``) and each offline W&B run (``WandbSink``). Each run is
drawn once, in its own colour, with a legend: a run written to several backends at once
(``Tee``) is found in each and drawn from the first (the others are listed as its copies), so
a parent folder never counts a point twice. ``--run NAME`` keeps the runs whose label contains
NAME (an MLflow store with two runs is two runs, never one line through both). Lines are a
debiased EMA of the points (``--smoothing``, TensorBoard's rule; the raw points stay faint
behind), a ``<name>/mean`` with a ``<name>/std`` gets a mean +- std band, steps are integers
and no axis carries an offset. Needs matplotlib (``posttrain[observability]``).
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain._commands import DEFAULT_SMOOTHING as DEFAULT_SMOOTHING
from posttrain._commands import plot_parser
from posttrain._deps import optional_deps
from posttrain.contracts.catalogue import CATALOGUE_V1, RECIPES, recipe_metrics

Scalars = dict[str, list[tuple[int, float]]]

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("rollout/reward/mean",)),
    ("advantage", ("rollout/advantage/mean", "rollout/advantage/min", "rollout/advantage/max")),
    ("zero-std groups", ("rollout/group/zero_std_frac",)),
    ("KL to reference", ("policy/kl_ref/k3", "policy/kl_ref/k1")),
    ("entropy", ("policy/entropy", "policy/entropy/sampled")),
    ("clip fraction", ("policy/clip_frac/low", "policy/clip_frac/high")),
    ("importance ratio", ("policy/ratio/mean", "policy/ratio/min", "policy/ratio/max")),
    ("sampler-trainer mismatch KL", ("policy/mismatch_kl",)),
    ("lengths", ("rollout/response_len/mean", "rollout/prompt_len/mean")),
    ("truncated", ("rollout/truncated_frac",)),
    ("loss", ("loss/total", "loss/policy", "loss/nll", "reward_model/loss")),
    ("grad norm", ("optim/grad_norm",)),
    ("learning rate", ("optim/lr",)),
    ("throughput", ("perf/gen_tokens_per_s", "perf/train_tokens_per_s")),
    ("staleness", ("staleness/mean", "staleness/max")),
    ("time", ("time/step_s", "time/rollout_s", "time/train_s", "time/weight_sync_s")),
    ("policy-update KL", ("policy/update_kl/k3", "policy/update_kl/k1")),
    ("effective sample size", ("policy/ratio/ess",)),
    ("selection rate", ("selection/rate",)),
    ("reward kept", ("selection/reward/mean", "selection/reward/min", "selection/reward/max")),
    ("pair accuracy", ("reward_model/accuracy",)),
    ("reward margin", ("reward_model/margin",)),
    ("buffer", ("buffer/utilization",)),
)
"""Panel title -> the catalogue metrics it draws (a ``/mean`` with a ``/std``, or a metric
with a ``<name>/std``, gets a band)."""


@dataclass
class Run:
    """One run found under a directory: where, from which backend, and its scalars.

    Example:
        >>> Run("trl", "mlflow", Path("runs"), {"loss/total": [(1, 0.5)]}).label
        'trl'
    """

    label: str
    source: str
    path: Path
    scalars: Scalars
    copies: list[str] = field(default_factory=list)
    """Labels of the same run found in other backends (skipped: one drawing per point)."""


def _rel(path: Path, root: Path) -> str:
    rel = path.resolve().relative_to(root.resolve()).as_posix()
    return root.resolve().name if rel == "." else rel


def _jsonl_runs(root: Path) -> list[Run]:
    from posttrain.reference_impls import read_jsonl
    from posttrain.reference_impls.jsonl_sink import FILE_NAME

    dirs = sorted({p.parent for p in root.rglob(FILE_NAME)})
    return [Run(_rel(d, root), "jsonl", d, read_jsonl(d)) for d in dirs]


def _tensorboard_runs(root: Path) -> list[Run]:
    from posttrain.observability.sinks import tensorboard_events

    out = []
    for d, tags in tensorboard_events(root, "scalars"):
        scalars = {tag: [(int(e.step), float(e.value)) for e in ev] for tag, ev in tags.items()}
        if scalars:
            out.append(Run(_rel(d, root), "tensorboard", d, scalars))
    return out


def _mlflow_runs(root: Path) -> list[Run]:
    stores = sorted({p.parent for p in root.rglob("mlflow.db")})
    if not stores:
        return []
    with optional_deps():
        from mlflow.tracking import MlflowClient

    from posttrain.observability.sinks import EXPERIMENT, mlflow_uri

    out = []
    for store in stores:
        client = MlflowClient(tracking_uri=mlflow_uri(store))
        exp = client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            continue
        runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
        names = [r.info.run_name for r in runs]
        for r in runs:
            scalars = {
                key: sorted(
                    (int(m.step), float(m.value))
                    for m in client.get_metric_history(r.info.run_id, key)
                )
                for key in r.data.metrics
            }
            name = str(r.info.run_name)
            if names.count(r.info.run_name) > 1:  # two runs of one name stay two runs
                name = f"{name}:{r.info.run_id[:8]}"
            at_root = store.resolve() == root.resolve()
            label = name if at_root else f"{_rel(store, root)}/{name}"
            out.append(Run(label, "mlflow", store, scalars))
    return out


def _wandb_runs(root: Path) -> list[Run]:
    files = sorted({p.resolve() for p in root.rglob("run-*.wandb")})
    if not files:
        return []
    from posttrain.observability.sinks import read_wandb

    out = []
    for f in files:
        # One run's folder: read_wandb reads every .wandb under what it is given.
        scalars = read_wandb(f.parent)
        out.append(Run(_rel(f.parent, root), "wandb", f.parent, scalars))
    return out


def _fingerprint(scalars: Scalars) -> tuple[Any, ...]:
    # float32: TensorBoard keeps float32, so a Tee's copies agree only to that precision.
    import numpy as np

    return tuple(
        (
            k,
            tuple(
                (s, float(np.float32(v)) if math.isfinite(v) else repr(v)) for s, v in sorted(vals)
            ),
        )
        for k, vals in sorted(scalars.items())
    )


def find_runs(directory: str | os.PathLike[str]) -> list[Run]:
    """Every run under ``directory``, each once (see the module docstring), by label.

    A run found with the same points in a second backend is listed in the first's ``copies``
    and not returned again.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> d = Path(tempfile.mkdtemp())
        >>> for name in ("a", "b"):
        ...     sink = JsonlSink(d / name); sink.log_scalar("loss/total", 1.0, step=1); sink.close()
        >>> [r.label for r in find_runs(d)]
        ['a', 'b']
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: expected a run directory, found none")
    found = [
        *_jsonl_runs(root),
        *_tensorboard_runs(root),
        *_mlflow_runs(root),
        *_wandb_runs(root),
    ]
    out: list[Run] = []
    seen: dict[tuple[Any, ...], Run] = {}
    for run in found:
        if not run.scalars:
            continue
        key = _fingerprint(run.scalars)
        # Equal points from another backend: one Tee wrote both. Within one backend, equal
        # runs (a deterministic rerun) are runs of their own.
        if key in seen and seen[key].source != run.source:
            seen[key].copies.append(f"{run.label} ({run.source})")
            continue
        seen[key] = run
        out.append(run)
    labels = [r.label for r in out]
    for run in out:  # one folder holding two backends' different runs: name the backend too
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({run.source})"
    return out


def select_runs(runs: Sequence[Run], patterns: Sequence[str]) -> list[Run]:
    """The runs whose label contains one of ``patterns`` (or matches it as a glob); all of
    them without patterns. A pattern matching nothing raises, listing the labels.

    Example:
        >>> runs = [Run("mlflow/trl", "mlflow", Path("."), {}), Run("mlflow/torchrl", "mlflow", Path("."), {})]
        >>> [r.label for r in select_runs(runs, ["mlflow"])]
        ['mlflow/trl', 'mlflow/torchrl']
        >>> [r.label for r in select_runs(runs, ["*/trl"])]
        ['mlflow/trl']
    """
    if not patterns:
        return list(runs)
    out = []
    for p in patterns:
        hit = [r for r in runs if p in r.label or fnmatch.fnmatchcase(r.label, p)]
        if not hit:
            raise ValueError(
                f"--run {p!r}: no run matches; runs found: {[r.label for r in runs][:10]}"
            )
        out += [r for r in hit if r not in out]
    return out


def read_run(directory: str | os.PathLike[str], *, mlflow_run: str | None = None) -> Scalars:
    """The scalars of the one run under ``directory`` (``mlflow_run`` selects one by label).

    Several different runs raise rather than merge: merged, two runs draw one zig-zag line.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> d = tempfile.mkdtemp()
        >>> sink = JsonlSink(d); sink.log_scalar("rollout/reward/mean", 0.5, step=1); sink.close()
        >>> read_run(d)
        {'rollout/reward/mean': [(1, 0.5)]}
    """
    runs = find_runs(directory)
    if mlflow_run is not None:
        runs = [r for r in runs if r.label.split("/")[-1] == mlflow_run] or select_runs(
            runs, [mlflow_run]
        )
    if len(runs) > 1:
        raise ValueError(
            f"{directory}: {len(runs)} runs found ({[r.label for r in runs][:10]}); select one "
            "(mlflow_run=, or --run in `posttrain plot`) or draw them all with dashboard()"
        )
    return runs[0].scalars if runs else {}


def ema(values: Sequence[float], smoothing: float) -> list[float]:
    """TensorBoard's debiased exponential moving average; a NaN or inf point is skipped
    (the line holds its last value) rather than poisoning every later one.

    Example:
        >>> ema([1.0, 3.0], 0.5)  # (0.5 * 1 + 1 * 3 ...) debiased: the first point is itself
        [1.0, 2.3333333333333335]
        >>> ema([1.0, float("nan"), 3.0], 0.0)
        [1.0, 1.0, 3.0]
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing: expected a weight in [0, 1), found {smoothing!r}")
    out, last, weight = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            last = last * smoothing + (1 - smoothing) * v
            weight = weight * smoothing + (1 - smoothing)
        out.append(last / weight if weight else math.nan)
    return out


@dataclass
class Series:
    """One metric of one run as drawn: its points, the smoothed line and the band, if any.

    Example:
        >>> s = Series("a", "optim/lr", [0, 1], [1e-6, 2e-6], [1e-6, 2e-6])
        >>> s.band is None, s.smooth[-1]
        (True, 2e-06)
    """

    run: str
    metric: str
    steps: list[int]
    values: list[float]
    smooth: list[float]
    band: tuple[list[float], list[float]] | None = None


@dataclass
class Panel:
    """One panel: its title (with the catalogue's unit) and its series.

    Example:
        >>> p = panels({"a": {"optim/lr": [(0, 1e-6)]}}, smoothing=0.0)[12]
        >>> p.title, p.metrics, [s.run for s in p.series]
        ('learning rate [1]', ('optim/lr',), ['a'])
    """

    title: str
    metrics: tuple[str, ...]
    series: list[Series]


def panels(runs: Mapping[str, Scalars], *, smoothing: float = DEFAULT_SMOOTHING) -> list[Panel]:
    """What :func:`dashboard` draws, as data: one :class:`Panel` per :data:`PANELS` entry.

    Example:
        >>> ps = panels({"a": {"rollout/reward/mean": [(1, 1.0), (2, 3.0)],
        ...                    "rollout/reward/std": [(1, 0.5), (2, 0.5)]}}, smoothing=0.0)
        >>> s = ps[0].series[0]
        >>> (s.run, s.steps, s.smooth, s.band)
        ('a', [1, 2], [1.0, 3.0], ([0.5, 2.5], [1.5, 3.5]))
    """
    out = []
    for title, metrics in PANELS:
        series = []
        for label, scalars in runs.items():
            for m in metrics:
                points = sorted(scalars.get(m, []))
                if not points:
                    continue
                steps = [s for s, _ in points]
                values = [v for _, v in points]
                smooth = ema(values, smoothing)
                band = None
                sd_name = m[: -len("mean")] + "std" if m.endswith("/mean") else m + "/std"
                if scalars.get(sd_name):
                    std = dict(scalars[sd_name])
                    sd = ema([std.get(s, math.nan) for s in steps], smoothing)
                    band = (
                        [a - b for a, b in zip(smooth, sd, strict=True)],
                        [a + b for a, b in zip(smooth, sd, strict=True)],
                    )
                series.append(Series(label, m, steps, values, smooth, band))
        unit = CATALOGUE_V1.metric(metrics[0]).unit
        out.append(Panel(f"{title} [{unit}]", metrics, series))
    return out


_STYLES = ("-", "--", ":", "-.")


def recipes_of(scalars: Scalars) -> tuple[str, ...]:
    """The recipes (:data:`~posttrain.contracts.catalogue.RECIPES`) whose metrics hold every
    catalogue name the run logged: what the run can be (all of them when none can).

    Example:
        >>> recipes_of({"selection/rate": [(0, 0.25)], "loss/nll": [(0, 3.0)]})
        ('expert_iteration',)
        >>> recipes_of({"optim/lr": [(0, 1e-3)]})
        ('grpo', 'expert_iteration', 'reward_model')
    """
    known = {m.name for m in CATALOGUE_V1.metrics}
    names = {n for n in scalars if n in known}
    fits = tuple(r for r in RECIPES if names <= set(recipe_metrics(r)))
    return fits or RECIPES


def drawn_panels(
    runs: Mapping[str, Scalars], *, smoothing: float = DEFAULT_SMOOTHING
) -> list[Panel]:
    """The panels :func:`figure` draws: those of :func:`panels` that apply to the recipes the
    runs can be (:func:`recipes_of`), so a reward-model run shows no rollout panels and a GRPO
    run no selection panel; a panel that applies but holds nothing says "not logged".

    Example:
        >>> rm = {"reward_model/accuracy": [(0, 0.5)], "loss/total": [(0, 0.7)]}
        >>> [p.title for p in drawn_panels({"rm": rm})][:3]
        ['loss [1]', 'grad norm [1]', 'learning rate [1]']
    """
    applies: set[str] = set()
    for scalars in runs.values():
        for recipe in recipes_of(scalars):
            applies |= set(recipe_metrics(recipe))
    return [p for p in panels(runs, smoothing=smoothing) if applies & set(p.metrics)]


def dashboard(
    runs: Scalars | Mapping[str, Scalars],
    out: str | os.PathLike[str],
    *,
    title: str = "",
    smoothing: float = DEFAULT_SMOOTHING,
) -> Path:
    """Draw :func:`panels` of ``runs`` (label -> scalars, or one run's scalars) into a PNG.

    Example:
        >>> import tempfile
        >>> path = dashboard({"rollout/reward/mean": [(1, 0.1), (2, 0.4)]}, tempfile.mktemp(suffix=".png"))
        >>> path.stat().st_size > 1000
        True
    """
    fig = figure(runs, title=title, smoothing=smoothing)
    path = Path(out)
    try:
        fig.savefig(path, dpi=80)
    finally:
        # Not a pyplot figure (nothing global to close); drop its artists now, even when
        # saving failed.
        fig.clear()
    return path


def _as_runs(runs: Scalars | Mapping[str, Scalars]) -> dict[str, Scalars]:
    if runs and all(isinstance(v, list) for v in runs.values()):
        return {"run": runs}  # type: ignore[dict-item]
    return dict(runs)  # type: ignore[arg-type]


def figure(
    runs: Scalars | Mapping[str, Scalars], *, title: str = "", smoothing: float = DEFAULT_SMOOTHING
) -> Any:
    """The dashboard as a matplotlib ``Figure`` (what :func:`dashboard` saves).

    Example:
        >>> fig = figure({"a": {"optim/lr": [(0, 1e-6), (1, 2e-6)]}}, smoothing=0.0)
        >>> ax = fig.axes[12]; ax.get_title(), [float(y) for y in ax.lines[-1].get_ydata()]
        ('learning rate [1]', [1e-06, 2e-06])
    """
    # A Figure on its own Agg canvas, not pyplot: the caller's matplotlib backend and
    # pyplot's figure registry stay as they were.
    with optional_deps():
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator, ScalarFormatter

    by_run = _as_runs(runs)
    colours = {label: f"C{i % 10}" for i, label in enumerate(by_run)}
    several = len(by_run) > 1
    drawn = drawn_panels(by_run, smoothing=smoothing)
    cols = 4
    rows = -(-len(drawn) // cols)
    fig = Figure(figsize=(4.2 * cols, 3 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, panel in zip(axes.flat, drawn, strict=False):
        for s in panel.series:
            c = colours[s.run]
            style = _STYLES[panel.metrics.index(s.metric) % len(_STYLES)]
            label = f"{s.run} · {s.metric}" if several else s.metric
            if smoothing:  # the points themselves, faint, under the smoothed line
                ax.plot(s.steps, s.values, style, color=c, alpha=0.25, linewidth=0.8)
            ax.plot(s.steps, s.smooth, style, color=c, linewidth=1.6, label=label)
            if s.band is not None:
                ax.fill_between(s.steps, *s.band, color=c, alpha=0.15, linewidth=0)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fmt = ScalarFormatter(useOffset=False)
        fmt.set_powerlimits((-3, 4))  # 1e-8 reads as "x1e-8" over the axis, never an offset
        ax.yaxis.set_major_formatter(fmt)
        if panel.series:
            ax.legend(fontsize=6.5, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(
    argv: list[str] | None = None, prog: str = "python -m posttrain.observability.plot"
) -> int:
    """The command line: find the runs under each directory, write the dashboard PNG.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> d = tempfile.mkdtemp()
        >>> sink = JsonlSink(d); sink.log_scalar("loss/total", 1.0, step=1); sink.close()
        >>> main([d, "--out", os.path.join(d, "dashboard.png")])
        /.../dashboard.png
        0
    """
    p = plot_parser(prog)
    args = p.parse_args(argv)
    if not 0.0 <= args.smoothing < 1.0:
        p.error(f"--smoothing: expected a weight in [0, 1), found {args.smoothing}")
    found: list[Run] = []
    for d in args.dirs:
        try:
            runs = find_runs(d)
        except FileNotFoundError as e:
            p.error(str(e))
        if len(args.dirs) > 1:  # the same run name in two directories stays two runs
            top = Path(d).resolve().name
            for r in runs:
                r.label = r.label if r.label == top else f"{top}/{r.label}"
        found += runs
    try:
        chosen = select_runs(found, args.run)
    except ValueError as e:
        p.error(str(e))
    if args.mlflow_run is not None:  # an exact MLflow run name, as before --run existed
        chosen = [r for r in chosen if r.label.split("/")[-1] == args.mlflow_run]
        if not chosen:
            p.error(
                f"--mlflow-run {args.mlflow_run!r}: no run of that name; runs found: "
                f"{[r.label for r in found][:10]}"
            )
    if args.list or not chosen:
        for r in found:
            copies = f" (also in {', '.join(r.copies)})" if r.copies else ""
            print(f"{r.label}  [{r.source}, {len(r.scalars)} metrics]{copies}")
        if not chosen:
            print(f"no metrics found under {', '.join(map(str, args.dirs))}")
            return 1
        return 0
    labels = [r.label for r in chosen]
    title = args.title if args.title is not None else "posttrain: " + ", ".join(labels)
    print(
        dashboard(
            {r.label: r.scalars for r in chosen}, args.out, title=title, smoothing=args.smoothing
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
