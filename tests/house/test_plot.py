"""``posttrain plot``: runs found once each, overlaid with a legend, smoothed, with bands.

Checked on what the dashboard is made of (runs found, panel series, matplotlib axes), on runs
written to real backends (JSONL, TensorBoard event files, an MLflow SQLite store, offline W&B).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from posttrain.contracts.catalogue import CATALOGUE_V1, RECIPES
from posttrain.observability.plot import (
    PANELS,
    dashboard,
    ema,
    figure,
    find_runs,
    main,
    panels,
    read_run,
    select_runs,
)
from posttrain.observability.sinks import MlflowSink, Tee, TensorboardSink, WandbSink
from posttrain.reference_impls import JsonlSink

STEPS = range(6)


def _log(sink: object, scale: float) -> None:
    for s in STEPS:
        sink.log_scalar("rollout/reward/mean", scale * s, step=s)  # type: ignore[attr-defined]
        sink.log_scalar("rollout/reward/std", 0.5, step=s)  # type: ignore[attr-defined]
        sink.log_scalar("policy/kl_ref/k3", 1e-8 * (1 + s), step=s)  # type: ignore[attr-defined]
        sink.log_scalar("optim/lr", 1e-6 * (s + 1), step=s)  # type: ignore[attr-defined]
    sink.close()  # type: ignore[attr-defined]


def test_a_parent_folder_of_one_teed_run_draws_each_point_once(tmp_path: Path) -> None:
    tee = Tee(
        JsonlSink(tmp_path / "jsonl"),
        TensorboardSink(tmp_path / "tb"),
        MlflowSink(tmp_path / "mlflow", run_name="grpo"),
        WandbSink(tmp_path / "wandb", run_name="grpo"),
    )
    _log(tee, 0.25)
    (run,) = find_runs(tmp_path)
    assert (run.label, run.source) == ("jsonl", "jsonl")
    assert sorted(c.split(" ")[-1] for c in run.copies) == ["(mlflow)", "(tensorboard)", "(wandb)"]
    assert run.scalars["rollout/reward/mean"] == [(s, 0.25 * s) for s in STEPS]
    (reward,) = panels({run.label: run.scalars})[0].series
    assert reward.steps == list(STEPS)  # six points, not eighteen or twenty-four
    assert read_run(tmp_path) == run.scalars


def test_an_mlflow_store_with_two_runs_is_two_lines_never_one_zigzag(tmp_path: Path) -> None:
    _log(MlflowSink(tmp_path, run_name="trl"), 1.0)
    _log(MlflowSink(tmp_path, run_name="torchrl"), -1.0)
    runs = find_runs(tmp_path)
    assert [r.label for r in runs] == ["trl", "torchrl"]
    reward = panels({r.label: r.scalars for r in runs}, smoothing=0.0)[0]
    assert [(s.run, s.steps, s.values) for s in reward.series] == [
        ("trl", list(STEPS), [float(s) for s in STEPS]),
        ("torchrl", list(STEPS), [-float(s) for s in STEPS]),
    ]
    with pytest.raises(ValueError, match=r"2 runs found \(\['trl', 'torchrl'\]\); select one"):
        read_run(tmp_path)
    assert read_run(tmp_path, mlflow_run="trl")["optim/lr"][0] == (0, 1e-6)
    assert [r.label for r in select_runs(runs, ["torch*"])] == ["torchrl"]
    with pytest.raises(ValueError, match=r"--run 'ppo': no run matches; runs found: \['trl'"):
        select_runs(runs, ["ppo"])
    out = tmp_path / "one.png"
    assert main([str(tmp_path), "--run", "torchrl", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--run", "ppo", "--out", str(out)])
    assert e.value.code == 2
    assert main([str(tmp_path), "--mlflow-run", "trl", "--out", str(out)]) == 0
    with pytest.raises(SystemExit) as e:  # exact: "rl" is a part of both names, the name of none
        main([str(tmp_path), "--mlflow-run", "rl", "--out", str(out)])
    assert e.value.code == 2


def test_two_folders_of_equal_jsonl_runs_stay_two_runs(tmp_path: Path) -> None:
    # A deterministic rerun: equal points in one backend are a run of their own.
    for name in ("seed0", "seed0_again"):
        _log(JsonlSink(tmp_path / name), 1.0)
    assert [r.label for r in find_runs(tmp_path)] == ["seed0", "seed0_again"]


def test_ema_is_tensorboards_debiased_average_and_skips_non_finite() -> None:
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no ramp
    got = ema([0.0, 1.0, math.nan, 1.0], 0.5)
    # by hand: (0.5*0 + 0.5*1) / (1 - 0.25) = 2/3; the NaN holds it; then
    # (0.25*0 + 0.25*1 ... ) = (0.5 * 0.5 + 0.5 * 1) / (1 - 0.125) = 0.75 / 0.875
    assert got == pytest.approx([0.0, 2 / 3, 2 / 3, 0.75 / 0.875])
    assert ema([1.0, 5.0], 0.0) == [1.0, 5.0]
    with pytest.raises(ValueError, match=r"smoothing: expected a weight in \[0, 1\), found 1.0"):
        ema([1.0], 1.0)


def test_a_mean_with_a_std_gets_a_band_and_others_do_not() -> None:
    scalars = {
        "rollout/reward/mean": [(0, 1.0), (1, 2.0), (2, 3.0)],
        "rollout/reward/std": [(0, 0.5), (1, 0.25), (2, 0.0)],
        "rollout/response_len/mean": [(0, 10.0), (1, 12.0), (2, 11.0)],
    }
    by_title = {p.title: p for p in panels({"r": scalars}, smoothing=0.0)}
    (reward,) = by_title["reward [1]"].series
    assert reward.band == ([0.5, 1.75, 3.0], [1.5, 2.25, 3.0])
    (length,) = by_title["lengths [tokens]"].series
    assert length.band is None


def test_panels_cover_the_issue_list_with_catalogue_names() -> None:
    titles = [t for t, _m in PANELS]
    for t in (
        "truncated",
        "grad norm",
        "learning rate",
        "zero-std groups",
        "advantage",
        "sampler-trainer mismatch KL",
        "reward",
        "KL to reference",
        "clip fraction",
        "staleness",
        "policy-update KL",
        "effective sample size",
    ):
        assert t in titles
    for _t, metrics in PANELS:
        for m in metrics:
            CATALOGUE_V1.metric(m)  # raises KeyError for a name the catalogue lacks


def test_axes_have_integer_steps_no_offset_and_a_legend_per_run(tmp_path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    runs = {
        "trl": {"policy/kl_ref/k3": [(s, 1.0 + 1e-8 * s) for s in STEPS]},
        "torchrl": {"policy/kl_ref/k3": [(s, 1.0 + 2e-8 * s) for s in STEPS]},
    }
    fig = figure(runs, title="trl vs torchrl", smoothing=0.6)
    fig.canvas.draw()
    kl = next(ax for ax in fig.axes if ax.get_title().startswith("KL to reference"))
    assert isinstance(kl.xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in kl.get_xticks())
    assert kl.yaxis.get_major_formatter().get_useOffset() is False
    # Values near 1 + 1e-8: an offset axis would read "+1" over ticks of 1e-8.
    assert "+" not in kl.yaxis.get_offset_text().get_text()
    legend = [t.get_text() for t in kl.get_legend().get_texts()]
    assert legend == ["trl · policy/kl_ref/k3", "torchrl · policy/kl_ref/k3"]
    colours = {line.get_color() for line in kl.lines}
    assert len(colours) == 2  # one colour per run, raw and smoothed alike
    assert fig._suptitle.get_text() == "trl vs torchrl"
    empty = next(ax for ax in fig.axes if ax.get_title().startswith("grad norm"))
    assert [t.get_text() for t in empty.texts] == ["not logged"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_cli_default_title_names_the_runs_not_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from posttrain.observability import plot

    _log(JsonlSink(tmp_path / "grpo_a"), 1.0)
    _log(JsonlSink(tmp_path / "grpo_b"), 2.0)
    out = tmp_path / "dash.png"
    drawn: list[tuple[list[str], str, float]] = []
    real = plot.dashboard

    def spy(runs: Any, path: Any, *, title: str = "", smoothing: float = 0.6) -> Path:
        drawn.append((list(runs), title, smoothing))
        return real(runs, path, title=title, smoothing=smoothing)

    monkeypatch.setattr(plot, "dashboard", spy)
    assert main([str(tmp_path), "--out", str(out), "--smoothing", "0.3"]) == 0
    assert drawn == [(["grpo_a", "grpo_b"], "posttrain: grpo_a, grpo_b", 0.3)]
    assert capsys.readouterr().out.strip() == str(out)
    assert main([str(tmp_path), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == ["grpo_a  [jsonl, 4 metrics]", "grpo_b  [jsonl, 4 metrics]"]
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[2] in (3, 4)
    runs = {r.label: r.scalars for r in find_runs(tmp_path)}
    assert dashboard(runs["grpo_a"], tmp_path / "single.png").stat().st_size > 10_000


def test_update_kl_and_ess_have_their_panels() -> None:
    scalars = {
        "policy/update_kl/k3": [(1, 0.01), (2, 0.02)],
        "policy/update_kl/k1": [(1, 0.012), (2, 0.018)],
        "policy/ratio/ess": [(1, 1.0), (2, 0.9)],
    }
    by_title = {p.title: p for p in panels({"r": scalars}, smoothing=0.0)}
    kl = by_title["policy-update KL [nats]"]
    assert [s.metric for s in kl.series] == ["policy/update_kl/k3", "policy/update_kl/k1"]
    (ess,) = by_title["effective sample size [1]"].series
    assert (ess.steps, ess.values) == ([1, 2], [1.0, 0.9])


def _recipe_run(recipe: str) -> dict[str, list[tuple[int, float]]]:
    """A run holding every scalar its recipe emits (catalogue names; distributions aside)."""
    from posttrain.contracts.catalogue import recipe_metrics

    return {
        n.replace("<reward_fn>", "fmt"): [(s, 0.1 * (s + 1)) for s in STEPS]
        for n in recipe_metrics(recipe)
        if CATALOGUE_V1.metric(n).reduction != "hist"
    }


def test_each_recipe_gets_its_panels_and_only_those() -> None:
    from posttrain.observability.plot import drawn_panels, recipes_of

    titles = {}
    for recipe in RECIPES:
        run = _recipe_run(recipe)
        assert recipes_of(run) == (recipe,)
        drawn = drawn_panels({recipe: run}, smoothing=0.0)
        assert all(p.series for p in drawn), recipe  # every panel drawn has its lines
        titles[recipe] = {p.title.split(" [")[0] for p in drawn}
    grpo, ei, rm = titles["grpo"], titles["expert_iteration"], titles["reward_model"]
    assert {"selection rate", "reward kept", "pair accuracy", "reward margin"}.isdisjoint(grpo)
    assert {"KL to reference", "clip fraction", "advantage"} <= grpo
    assert {"selection rate", "reward kept", "reward", "entropy", "buffer", "staleness"} <= ei
    assert {"KL to reference", "clip fraction", "advantage", "pair accuracy"}.isdisjoint(ei)
    by_title = {p.title: p for p in panels({"ei": _recipe_run("expert_iteration")})}
    assert "time/weight_sync_s" in {s.metric for s in by_title["time [s]"].series}
    assert rm == {
        "loss",
        "grad norm",
        "learning rate",
        "throughput",
        "time",
        "pair accuracy",
        "reward margin",
        "buffer",
    }


def test_the_reward_margin_has_its_spread_as_a_band_and_losses_share_a_panel() -> None:
    run = _recipe_run("reward_model")
    by_title = {p.title: p for p in panels({"rm": run}, smoothing=0.0)}
    (margin,) = by_title["reward margin [1]"].series
    assert margin.band is not None
    lo, hi = margin.band
    assert [b - a for a, b in zip(lo, hi, strict=True)] == pytest.approx(
        [2 * v for _, v in run["reward_model/margin/std"]]
    )
    assert {s.metric for s in by_title["loss [1]"].series} == {"loss/total", "reward_model/loss"}


def test_the_command_draws_a_run_of_each_recipe(tmp_path: Path) -> None:
    for recipe in RECIPES:
        sink = JsonlSink(tmp_path / recipe)
        for name, points in _recipe_run(recipe).items():
            for s, v in points:
                sink.log_scalar(name, v, step=s)
        sink.close()
    for recipe in ("expert_iteration", "reward_model"):
        out = tmp_path / f"{recipe}.png"
        assert main([str(tmp_path / recipe), "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = figure({"rm": read_run(tmp_path / "reward_model")}, smoothing=0.0)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert len(titles) == 8
    assert "pair accuracy [1]" in titles
    assert not [t for t in titles if t.startswith(("reward [", "KL", "entropy"))]
    # Three recipes at once: the panels of all three, each drawn by the runs that have it.
    fig = figure({r: read_run(tmp_path / r) for r in RECIPES}, smoothing=0.0)
    assert {"selection rate [1]", "pair accuracy [1]", "KL to reference [nats]"} <= {
        ax.get_title() for ax in fig.axes
    }
