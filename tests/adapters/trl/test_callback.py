"""The TRL callback under gradient accumulation, and staleness through CaptureRollouts.

TRL appends one ``kl``/``entropy``/``clip_ratio`` value per micro-batch (a token mean whose
count it drops); the callback takes each with its micro-batch's token count. Two tiny
``GRPOTrainer`` runs on the same completions (a fixed ``rollout_func``: completions of 1, 1, 2
and 4 tokens, so any split into two micro-batches has unequal token counts), one with
gradient accumulation 1 and one with 2, must log the same catalogue values.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.testing import tiny_causal_lm

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
NAMES = ("policy/kl_ref/k3", "policy/entropy", "policy/clip_frac/low", "policy/clip_frac/high")
# Per prompt, its two completions (EOS = 2 ends all but the 4-token one, cut at the limit).
# Prompts of one length: left padding would shift a prompt's positions (TRL passes no position
# ids), so a process holding only the shorter prompt would compute other log-probs.
COMPLETIONS = {"t5 t6 t7": ([2], [9, 10, 11, 12]), "t8 t9 t10": ([13, 2], [2])}


class _Points:
    """A MetricSinkV1 (with histograms) that keeps every point."""

    def __init__(self) -> None:
        self.points: dict[str, dict[int, float]] = {}
        self.hist: dict[str, dict[int, list[float]]] = {}

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.points.setdefault(name, {})[int(step or 0)] = float(value)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        self.hist.setdefault(name, {})[step] = list(values)


def _fixed_rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
    tok = trainer.processing_class
    seen: dict[str, int] = {}
    completions = []
    for p in prompts:
        k = seen.get(p, 0)
        seen[p] = k + 1
        completions.append(list(COMPLETIONS[p][k % 2]))
    return {
        "prompt_ids": tok(text=prompts)["input_ids"],
        "completion_ids": completions,
        "logprobs": None,
    }


def _length_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
    return [float(len(c)) for c in completion_ids]


@torch.no_grad()
def _perturb(model: Any, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)


def _run(
    tmp: Path, ga: int, *, rollout: Any = _fixed_rollout, per_device: int | None = None
) -> tuple[_Points, list[dict[str, float]], Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from posttrain.adapters.trl.callback import CatalogueCallback, install

    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.padding_side = "left"
    if not (tmp / "policy").exists():
        tiny_causal_lm().save_pretrained(tmp / "policy")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trl_logs: list[dict[str, float]] = []

    class Keep(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs is not None:
                trl_logs.append(dict(logs))

    class Move(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:
                _perturb(kw["model"], seed=1, scale=0.3)

    sink = _Points()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(tmp / "policy"),
            reward_funcs=[_length_reward],
            args=GRPOConfig(
                output_dir=str(tmp / f"out{ga}"),
                max_steps=2,
                per_device_train_batch_size=per_device or 4 // ga,
                gradient_accumulation_steps=ga,
                num_iterations=2,  # step 2 reuses the generation: ratios move off 1
                num_generations=2,
                max_completion_length=4,
                beta=0.04,
                # No learning: the optimizer step turns float noise of the GA=1 and GA=2
                # gradients into different weights (Adam's first step is lr * sign(g)). The
                # policy moves by a seeded perturbation after step 1 instead (Move), the same
                # in both runs, so step 2's ratios leave 1 and clip.
                learning_rate=0.0,
                temperature=0.7,
                logging_steps=1,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                seed=3,
            ),
            train_dataset=Dataset.from_dict({"prompt": list(COMPLETIONS)}),
            processing_class=tok,
            rollout_func=rollout,
        )
        _perturb(trainer.ref_model, seed=0, scale=0.2)  # a KL to the reference that is not 0
        cb = install(trainer, CatalogueCallback(rollout, sink=sink, histograms=True))
        trainer.add_callback(Keep())
        trainer.add_callback(Move())
        trainer.train()
    return sink, trl_logs, cb


def test_per_microbatch_metrics_are_token_weighted_under_gradient_accumulation(
    tmp_path: Path,
) -> None:
    one, trl_one, _ = _run(tmp_path, ga=1)
    two, trl_two, _ = _run(tmp_path, ga=2)
    for name in NAMES:
        assert set(one.points[name]) == set(two.points[name]) == {1, 2}, name
        for step in (1, 2):
            a, b = one.points[name][step], two.points[name][step]
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5), (name, step, a, b)
    # The test can tell: the KL and the entropy are not 0, clipping happened at step 2, and
    # TRL's own window mean (a mean of the two micro-batches' means) is off at GA=2.
    assert one.points["policy/kl_ref/k3"][1] > 1e-3
    assert one.points["policy/clip_frac/low"][2] + one.points["policy/clip_frac/high"][2] > 0
    assert abs(trl_two[0]["kl"] - one.points["policy/kl_ref/k3"][1]) > 1e-2
    assert math.isclose(trl_one[0]["kl"], one.points["policy/kl_ref/k3"][1], rel_tol=1e-5)
    # The distributions of the window's generation, through the sink's log_histogram.
    assert sorted(two.hist["rollout/response_len"][1]) == [1.0, 1.0, 2.0, 4.0]
    assert two.hist["rollout/reward"][1] == two.hist["rollout/response_len"][1]


def test_capture_rollouts_reports_the_real_lag_and_the_callback_uses_it(tmp_path: Path) -> None:
    """One generation serves two optimizer steps (num_iterations=2): the capture
    stamps version 0 and reports lag 0 then 1; with a version of 10 per optimizer step, 0
    then 10 (its own unit, not the callback's global_step)."""
    from posttrain.adapters.trl import CaptureRollouts
    from posttrain.observability import Accumulator
    from posttrain.reference_impls import RingBuffer

    pytest.importorskip("trl")
    for scale in (1, 10):

        def version(trainer: Any, scale: int = scale) -> int:
            return scale * int(trainer.state.global_step)

        capture = CaptureRollouts(
            RingBuffer(64),
            width=16,
            metrics=Accumulator(),
            version=version,
        )
        sink, _, _ = _run(tmp_path / f"v{scale}", ga=2, rollout=capture)
        p = sink.points
        assert p["staleness/mean"] == {1: 0.0, 2: float(scale)}, p["staleness/mean"]
        assert p["staleness/max"] == {1: 0.0, 2: float(scale)}
        assert p["staleness/policy_version"] == {1: 0.0, 2: float(scale)}
        assert "time/rollout_s" in p
