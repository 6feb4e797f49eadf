"""TRL 1.16 DPOTrainer's own sigmoid loss through the dpo_loss suite: the adapted row conforms,
the raw row fails exactly what it declares, and each raw deviation has a repro on TRL's code."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.adapters.trl.dpo import (
    ADAPTED_DPO_SIGMOID,
    BETA,
    RAW_DPO_SIGMOID,
    RAW_KNOWN,
    _fuse,
    dpo_inputs,
    dpo_trainer,
)
from posttrain.testing import llm_batch, tiny_causal_lm
from tests.outcomes import own_failures

pytest.importorskip("trl")


def test_adapted_row_conforms() -> None:
    assert own_failures(ADAPTED_DPO_SIGMOID) == {}


def test_raw_row_fails_what_it_declares() -> None:
    assert set(own_failures(RAW_DPO_SIGMOID)) == set(RAW_KNOWN)


def _trl_call(td: object) -> tuple[float, dict[str, float]]:

    trainer = dpo_trainer()
    policy = tiny_causal_lm(vocab_size=64)
    _fuse(policy)
    trainer._metrics["train"].clear()
    with torch.no_grad():
        loss = trainer._compute_loss(policy, dpo_inputs(td), False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _pairs() -> object:
    td = llm_batch(4, 10, vocab_size=64, seed=3)
    return td.set(("next", "ref_log_probs", "full"), torch.zeros(4, 10))


def test_repro_dpo_005_rewards_are_beta_times_r() -> None:
    # TRL's rewards/chosen is beta * (logp_chosen - ref_chosen): with a zero reference, beta
    # times the chosen answers' summed log-probs, not the contract's r.
    td = _pairs()
    _, metrics = _trl_call(td)
    inputs = dpo_inputs(td)

    policy = tiny_causal_lm(vocab_size=64)
    _fuse(policy)
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = policy(input_ids=inputs["input_ids"], labels=labels, fused_lm_head=True)
    r_chosen = float(out.log_probs.sum(-1)[:2].mean())
    assert math.isclose(metrics["rewards/chosen"], BETA * r_chosen, rel_tol=1e-4)


def test_repro_dpo_006_empty_pair_counts_as_log_2() -> None:
    # A pair without any assistant token still enters TRL's mean over pairs, at -log sigmoid(0).
    td = _pairs()
    td["masks", "all_assistant_mask"][2:] = False  # type: ignore[index]
    loss, _ = _trl_call(td)
    alone, _ = _trl_call(td[:2])  # type: ignore[index]
    assert math.isclose(loss, (alone + math.log(2)) / 2, rel_tol=1e-5)


def test_repro_dpo_009_float_mask_accepted() -> None:
    # TRL reads completion_mask as 0/1 numbers (completion_mask == 0): a float mask is taken.
    td = _pairs()
    inputs = dpo_inputs(td)
    inputs["completion_mask"] = inputs["completion_mask"].float()

    trainer, policy = dpo_trainer(), tiny_causal_lm(vocab_size=64)
    _fuse(policy)
    with torch.no_grad():
        assert torch.isfinite(trainer._compute_loss(policy, inputs, False))
