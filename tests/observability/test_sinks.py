"""posttrain's own sinks on MLflow and W&B, through the metrics-sink suite and their edge cases."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.conformance import Status
from posttrain.conformance.runner import run
from posttrain.observability.implementations import MLFLOW_SINK, WANDB_SINK
from posttrain.observability.sinks import WANDB_STEP, WandbSink, quiet_wandb_settings, read_wandb
from posttrain.reference_impls import JsonlSink, read_jsonl


def test_wandb_sink_conforms() -> None:
    status = {r.id: r.status for r in run(WANDB_SINK).results}
    assert status == {
        **{f"MET-00{i}": Status.PASS for i in (1, 2, 3, 4)},
        "MET-005": Status.NOT_APPLICABLE,  # W&B writes its .wandb log on its own schedule
        "MET-006": Status.NOT_APPLICABLE,  # one run per process (offline W&B has no shared run)
        "MET-007": Status.PASS,  # no step: the name's next step, not W&B's or MLflow's 0
        "MET-008": Status.PASS,  # wandb.Histogram over exactly [min, max]
        "MET-009": Status.PASS,  # wandb.Table, read back from the run's table file
    }


def test_mlflow_sink_conforms_but_clips_infinities() -> None:
    rep = run(MLFLOW_SINK)
    status = {r.id: r.status for r in rep.results}
    assert status["MET-001"] is status["MET-002"] is status["MET-003"] is Status.PASS
    assert status["MET-007"] is Status.PASS  # MLflow itself would store a missing step as 0
    assert status["MET-004"] is Status.FAIL  # SHOULD: MLflow stores +-inf as +-1.797e308
    # No histogram or sample table in MLflow's metric store: neither capability is declared.
    assert status["MET-008"] is status["MET-009"] is Status.NOT_APPLICABLE
    assert rep.ok  # a SHOULD failure does not fail the run
    assert rep.surprises() == []  # declared: known_failures={"MET-004"}


def test_wandb_sink_keeps_steps_in_any_order(tmp_path: Path) -> None:
    # W&B's own step= argument would drop the rows at steps 2 and 1 (lower than 5).
    sink = WandbSink(tmp_path)
    sink.log_scalar("loss/total", 1.0, step=5)
    sink.log_scalar("loss/total", 2.0, step=2)
    sink.log_scalar("rollout/reward/mean", 0.5, step=1)
    sink.log_scalar("rollout/reward/mean", 0.75, step=1)  # the same name twice at one step
    sink.close()
    assert read_wandb(tmp_path) == {
        "loss/total": [(2, 2.0), (5, 1.0)],
        "rollout/reward/mean": [(1, 0.5), (1, 0.75)],
    }


@pytest.mark.parametrize("name", [WANDB_STEP, "_runtime"])
def test_wandb_sink_refuses_reserved_names_and_keeps_what_it_had(tmp_path: Path, name: str) -> None:
    sink = WandbSink(tmp_path)
    sink.log_scalar("loss/total", 1.0, step=3)
    with pytest.raises(ValueError, match="expected a catalogue name") as e:
        sink.log_scalar(name, 2.0, step=3)
    assert repr(name) in str(e.value)
    sink.close()
    assert read_wandb(tmp_path) == {"loss/total": [(3, 1.0)]}


def test_wandb_sink_after_close_refuses_and_step_none_is_the_next_step(tmp_path: Path) -> None:
    sink = WandbSink(tmp_path)
    sink.log_scalar("optim/lr", 1e-3)  # the name's first value: step 0
    sink.log_scalar("optim/lr", 2e-3, step=4)
    sink.log_scalar("optim/lr", 3e-3)  # one past its highest step
    with pytest.raises(ValueError, match="expected a catalogue name"):
        sink.log_scalar("_hidden", 1.0)  # refused: the next step of nothing moves
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"log_scalar\('loss/total'\) after close"):
        sink.log_scalar("loss/total", 1.0, step=1)
    assert read_wandb(tmp_path) == {"optim/lr": [(0, 1e-3), (4, 2e-3), (5, 3e-3)]}


def test_wandb_sink_keeps_quiet_settings_and_refuses_what_it_fixes(tmp_path: Path) -> None:
    import wandb

    with pytest.raises(TypeError, match="mode cannot be passed"):
        WandbSink(tmp_path, mode="online")
    sink = WandbSink(tmp_path, settings=wandb.Settings(x_stats_sampling_interval=30.0))
    try:
        quiet = quiet_wandb_settings()
        assert sink.run.settings.console == quiet.console == "off"
        assert sink.run.settings.x_disable_stats is True
        assert sink.run.settings.x_stats_sampling_interval == 30.0
    finally:
        sink.close()


def test_read_wandb_refuses_a_run_with_another_step_convention(tmp_path: Path) -> None:
    from posttrain.adapters.torchrl.loggers import read_torchrl_wandb

    sink = WandbSink(tmp_path)
    sink.log_scalar("loss/total", 1.0, step=2)
    sink.close()
    with pytest.raises(ValueError, match="none at its step column"):
        read_torchrl_wandb(tmp_path)  # TorchRL's columns are <group>/step, not posttrain:step


@pytest.mark.parametrize(
    ("value", "step", "says"),
    [
        (1.0, 2.7, "step expected an int >= 0 or None, found 2.7"),
        (1.0, -5, "step expected an int >= 0 or None, found -5"),
        (1.0, True, "step expected an int >= 0 or None, found True"),
        ("abc", 1, "value expected one real number, found 'abc'"),
        ("nan", 1, "value expected one real number, found 'nan'"),
        (torch.ones(2), 1, "value expected one real number, found tensor([1., 1.])"),
    ],
)
def test_jsonl_sink_refuses_what_would_not_read_back_as_logged(
    tmp_path: Path, value: object, step: object, says: str
) -> None:
    sink = JsonlSink(tmp_path)
    sink.log_scalar("loss/total", 1.0, step=1)
    with pytest.raises(ValueError, match=re.escape(f"metric 'loss/total': {says}")):
        sink.log_scalar("loss/total", value, step=step)  # type: ignore[arg-type]
    sink.log_scalar("loss/total", torch.tensor(2.0), step=torch.tensor(4))  # type: ignore[arg-type]
    sink.close()
    assert read_jsonl(tmp_path) == {"loss/total": [(1, 1.0), (4, 2.0)]}


def test_mlflow_sink_refuses_logging_after_close(tmp_path: Path) -> None:
    from posttrain.observability.sinks import MlflowSink, read_mlflow

    sink = MlflowSink(tmp_path)
    sink.log_scalar("loss/total", 1.0, step=1)
    sink.close()
    with pytest.raises(RuntimeError, match=r"log_scalar\('loss/total'\) after close"):
        sink.log_scalar("loss/total", 3.0, step=9)
    with pytest.raises(ValueError, match=re.escape("step expected an int >= 0 or None, found 2.5")):
        MlflowSink(tmp_path, run_name="second").log_scalar("loss/total", 1.0, step=2.5)  # type: ignore[arg-type]
    assert read_mlflow(tmp_path, "run") == {"loss/total": [(1, 1.0)]}


def test_raw_wandb_step_keeps_one_value_per_step_and_drops_lower_steps(tmp_path: Path) -> None:
    # Why WandbSink keeps its step in a column of its own (MET-001, MET-003): W&B's own step=
    # fills one history row per step (the last value of a name wins) and ignores a lower step.
    import wandb

    from posttrain.observability.sinks import _history

    run = wandb.init(
        mode="offline",
        dir=str(tmp_path),
        project="posttrain",
        reinit="create_new",
        settings=quiet_wandb_settings(),
    )
    run.log({"loss/total": 1.0}, step=3)
    run.log({"loss/total": 2.0}, step=3)
    run.log({"loss/total": 3.0}, step=5)
    run.log({"loss/total": 4.0}, step=4)
    run.finish()
    (path,) = tmp_path.glob("**/run-*.wandb")
    rows = [(r["_step"], r["loss/total"]) for r in _history(path)]
    assert rows == [(3, 2.0), (5, 3.0)]


def test_met002_names_at_the_bound_are_mlflows_limit(tmp_path: Path) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH

    from posttrain.conformance.suites.metrics import LONG_NAMES
    from posttrain.contracts.metrics import METRIC_NAME, METRIC_NAME_MAX
    from posttrain.observability.sinks import MlflowSink, read_mlflow

    assert METRIC_NAME_MAX == MAX_ENTITY_KEY_LENGTH == 250
    assert all(len(n) == METRIC_NAME_MAX and METRIC_NAME.match(n) for n in LONG_NAMES)
    sink = MlflowSink(tmp_path)
    with pytest.raises(MlflowException, match="exceeds the maximum length of 250"):
        sink.log_scalar("a" * (METRIC_NAME_MAX + 1), 1.0, step=0)
    sink.log_scalar(LONG_NAMES[0], 1.0, step=0)
    sink.close()
    assert read_mlflow(tmp_path) == {LONG_NAMES[0]: [(0, 1.0)]}


def test_tensorboard_sink_conforms_with_histograms() -> None:
    from posttrain.observability.implementations import TENSORBOARD_SINK

    status = {r.id: r.status for r in run(TENSORBOARD_SINK).results}
    assert status == {
        **{f"MET-00{i}": Status.PASS for i in (1, 2, 3, 4, 5, 7, 8)},
        "MET-006": Status.NOT_APPLICABLE,
        "MET-009": Status.NOT_APPLICABLE,  # TensorBoard has text, not tables of rows
    }


def _batch_with_nan_outside_mask() -> Any:
    from posttrain.contracts.layout import LLM_LAYOUT_V1
    from posttrain.testing import llm_batch

    k = LLM_LAYOUT_V1.key
    td = llm_batch(4, 8)
    asst = td.get(k("assistant_mask")) & td.get(k("attention_mask"))
    adv = torch.where(asst, torch.arange(4.0)[:, None], torch.nan)  # TorchRL writes NaN there
    td.set(k("advantage"), adv)
    td.set(k("reward"), torch.tensor([1.0, float("nan"), 0.5, 2.0]))
    return td


def test_distributions_read_back_from_jsonl_tensorboard_and_wandb(tmp_path: Path) -> None:
    from posttrain.observability.distributions import log_distributions, rollout_distributions
    from posttrain.observability.sinks import (
        TensorboardSink,
        read_tensorboard_histograms,
        read_wandb_histograms,
    )
    from posttrain.reference_impls.jsonl_sink import read_jsonl_histograms

    td = _batch_with_nan_outside_mask()
    want = rollout_distributions(td)
    assert want["rollout/advantage"] == [0.0, 1.0, 2.0, 3.0]  # NaN outside the mask unread
    assert want["rollout/reward"] == [1.0, 0.5, 2.0]  # a NaN reward is no value
    sinks: dict[str, tuple[Any, Any]] = {
        "jsonl": (JsonlSink(tmp_path / "j"), read_jsonl_histograms),
        "tb": (TensorboardSink(tmp_path / "t"), read_tensorboard_histograms),
        "wandb": (WandbSink(tmp_path / "w"), read_wandb_histograms),
    }
    for sink, _reader in sinks.values():
        assert log_distributions(sink, td, step=7) == {n: len(v) for n, v in want.items()}
        sink.close()
    for key, (_sink, reader) in sinks.items():
        got = reader(tmp_path / key[0])
        for name, values in want.items():
            ((step, h),) = got[name]
            assert (step, h["count"], h["min"], h["max"]) == (
                7,
                len(values),
                min(values),
                max(values),
            ), key


def test_mlflow_has_no_histograms_and_says_so_tee_sends_them_where_they_fit(tmp_path: Path) -> None:
    from posttrain.observability.distributions import log_completion_samples, log_distributions
    from posttrain.observability.sinks import MlflowSink, Tee
    from posttrain.reference_impls.jsonl_sink import read_jsonl_histograms, read_jsonl_samples

    td = _batch_with_nan_outside_mask()
    mlflow = MlflowSink(tmp_path / "m")
    with pytest.raises(
        TypeError, match=r"MlflowSink has no log_histogram: .*MLflow has no histogram type"
    ):
        log_distributions(mlflow, td, step=1)
    with pytest.raises(TypeError, match="MlflowSink has no log_samples"):
        log_completion_samples(mlflow, ["p"], ["c"], [1.0], step=1)
    with pytest.raises(TypeError, match=r"Tee: none of its sinks \(MlflowSink\) has log_histogram"):
        Tee(mlflow).log_histogram("rollout/reward", [1.0], step=1)
    tee = Tee(mlflow, JsonlSink(tmp_path / "j"))
    log_distributions(tee, td, step=2)
    assert (
        log_completion_samples(
            tee, ["a", "b", "c"], ["x", "y", "z"], torch.tensor([1.0, 0.0, 0.5]), 2, k=2
        )
        == 2
    )
    tee.close()
    assert read_jsonl_histograms(tmp_path / "j")["rollout/reward"][0][1]["values"] == [
        1.0,
        0.5,
        2.0,
    ]
    assert read_jsonl_samples(tmp_path / "j") == {
        "samples": [(2, [("a", "x", 1.0), ("b", "y", 0.0)])]
    }
    with pytest.raises(ValueError, match="expected as many prompts, completions and rewards"):
        log_completion_samples(tee, ["a"], ["x", "y"], [1.0], 3)


def test_samples_read_back_from_wandb_next_to_scalars(tmp_path: Path) -> None:
    from posttrain.observability.sinks import read_wandb_samples

    sink = WandbSink(tmp_path)
    sink.log_scalar("rollout/reward/mean", 0.5, step=1)
    sink.log_samples("samples", [("p\n", " c ", float("nan"))], step=1)
    sink.log_histogram("rollout/reward", [0.5, 0.5], step=1)
    sink.close()
    assert read_wandb(tmp_path) == {"rollout/reward/mean": [(1, 0.5)]}  # media are no scalars
    ((step, rows),) = read_wandb_samples(tmp_path)["samples"]
    assert (step, rows[0][:2]) == (1, ("p\n", " c "))
    assert math.isnan(rows[0][2])


def test_read_wandb_samples_refuses_a_table_path_outside_the_run_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from posttrain.observability import sinks

    run = tmp_path / "run-x"
    (run / "files").mkdir(parents=True)
    (tmp_path / "secret.json").write_text("{}")
    entry = (run, "rollout/samples", 1, {"path": "../../secret.json"})
    monkeypatch.setattr(sinks, "_wandb_media", lambda d, kind: [entry])
    with pytest.raises(ValueError, match="outside it"):
        sinks.read_wandb_samples(tmp_path)


def test_advantage_histogram_leaves_out_sequences_without_assistant_tokens() -> None:
    from posttrain.observability.distributions import rollout_distributions
    from posttrain.testing import llm_batch

    td = llm_batch(4, 8)
    td["masks", "all_assistant_mask"][1] = False
    td.set("advantage", torch.full((4, 8), 2.0))
    d = rollout_distributions(td)
    assert d["rollout/advantage"] == [2.0, 2.0, 2.0]  # not a 0.0 for the empty sequence
    assert d["rollout/response_len"][1] == 0.0
