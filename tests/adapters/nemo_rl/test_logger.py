"""NeMo-RL's LoggerInterface shape over posttrain/TorchRL metric sinks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.adapters.nemo_rl.logger import NemoLogger, metric_name
from posttrain.reference_impls import JsonlSink, read_jsonl


def test_grpo_style_calls_land_under_catalogue_names(tmp_path: Path) -> None:
    log = NemoLogger(JsonlSink(tmp_path), names={"train/reward": "rollout/reward/mean"})
    # As nemo_rl/algorithms/grpo.py logs a step (names from its source).
    log.log_metrics(
        {"reward": 0.25, "loss": torch.tensor(1.5), "probs_ratio_min": 0.9, "text": "skip"},
        step=7,
        prefix="train",
    )
    log.log_metrics(
        {"prepare_for_generation/transfer_and_update_weights": 0.03},
        step=7,
        prefix="timing/train",
        step_finished=True,
    )
    log.log_histogram([1.0, 2.0, 6.0], step=7, name="train/advantages/histogram")
    log.log_plot(object(), step=7, name="train/token_mult_prob_error_plot_sample")
    log.log_hyperparams({"lr": 1e-6})
    log.flush()
    got = read_jsonl(tmp_path)
    assert got["rollout/reward/mean"] == [(7, 0.25)]
    assert got["train/loss"] == [(7, 1.5)]
    ((step, ratio),) = got["train/probs_ratio_min"]
    assert step == 7
    assert ratio == pytest.approx(0.9)
    ((step, seconds),) = got["timing/train/prepare_for_generation/transfer_and_update_weights"]
    assert step == 7
    assert seconds == pytest.approx(0.03)
    assert got["train/advantages/histogram/mean"] == [(7, 3.0)]
    assert got["train/advantages/histogram/max"] == [(7, 6.0)]
    from posttrain.reference_impls.jsonl_sink import read_jsonl_histograms

    ((step, hist),) = read_jsonl_histograms(tmp_path)["train/advantages/histogram"]
    assert (step, hist["values"]) == (7, [1.0, 2.0, 6.0])  # JsonlSink keeps distributions
    assert "train/text" not in got
    assert log.dropped == 2
    assert log.hyperparams == {"lr": 1e-6}


def test_names_outside_the_catalogue_form_are_normalised_or_refused() -> None:
    assert metric_name("Mean Gen Tokens", "train") == "train/mean_gen_tokens"
    assert metric_name("a//b", None) == "a/b"
    with pytest.raises(ValueError, match="no catalogue form"):
        metric_name("!!!")


def test_torchrl_tensorboard_logger_behind_the_nemo_shape(tmp_path: Path) -> None:
    from posttrain.adapters.torchrl.loggers import read_tensorboard, tensorboard_logger

    sink = tensorboard_logger(tmp_path)
    log = NemoLogger(sink)
    log.log_metrics({"reward": 0.5}, step=1, prefix="train")
    log.flush()
    assert read_tensorboard(tmp_path)["train/reward"] == [(1, 0.5)]


def test_catalogue_names_for_nemo_rl_metrics(tmp_path: Path) -> None:
    from posttrain.adapters.nemo_rl.logger import NEMO_TO_CATALOGUE
    from posttrain.contracts.catalogue import CATALOGUE_V1

    for name in NEMO_TO_CATALOGUE.values():
        CATALOGUE_V1.metric(name)  # every target exists
    log = NemoLogger(JsonlSink(tmp_path), catalogue=True)
    log.log_metrics({"kl_penalty": 0.01, "approx_entropy": 2.0}, step=1, prefix="train")
    log.log_metrics(
        {"prepare_for_generation/transfer_and_update_weights": 0.2}, step=1, prefix="timing/train"
    )
    log.flush()
    got = read_jsonl(tmp_path)
    assert sorted(got) == ["policy/kl_ref/k3", "time/weight_sync_s", "train/approx_entropy"]


def test_a_bad_name_logs_nothing_of_the_call(tmp_path: Path) -> None:
    log = NemoLogger(JsonlSink(tmp_path))
    with pytest.raises(ValueError, match=r"metric name '%': no catalogue form .*found ''"):
        log.log_metrics({"reward": 0.5, "text": "skip", "%": 2.0}, step=1)
    with pytest.raises(ValueError, match=r"'train/\?\?\?': no catalogue form .*name '\?\?\?'"):
        log.log_metrics({"reward": 0.5, "???": 3.0}, step=1, prefix="train")
    log.flush()
    assert read_jsonl(tmp_path) == {}
    assert log.dropped == 0


def test_two_names_for_one_metric_are_refused_and_nothing_is_logged(tmp_path: Path) -> None:
    log = NemoLogger(JsonlSink(tmp_path))
    message = (
        r"metrics\['policy_loss'\]: expected a metric of its own, found it maps to "
        r"'train/policy_loss' as metrics\['Policy Loss'\] does"
    )
    with pytest.raises(ValueError, match=message):
        log.log_metrics({"Policy Loss": 1.0, "policy_loss": 2.0}, step=1, prefix="train")
    log.log_metrics({"Policy Loss": 1.0}, step=2, prefix="train")
    log.flush()
    assert read_jsonl(tmp_path) == {"train/policy_loss": [(2, 1.0)]}
