"""TRL 1.16 GRPOTrainer's own _compute_loss, per loss_type, through the loss suite: a
deterministic slice (the whole field runs in `make losses-report`)."""

from __future__ import annotations

import pytest

from posttrain.adapters.trl.loss import ADAPTED_KNOWN, LOSS_TYPES, RAW_KNOWN, ROWS
from tests.outcomes import own_failures

SLICE = [
    "trl-raw-grpo",
    "trl-adapted-grpo",
    "trl-adapted-bnpo",
    "trl-adapted-dapo",
    "trl-adapted-cispo",
]


@pytest.mark.parametrize("name", SLICE)
def test_trl_row_fails_what_it_declares(name: str) -> None:
    side, lt = name.split("-", 2)[1:]
    known: frozenset[str] = (ADAPTED_KNOWN if side == "adapted" else RAW_KNOWN).get(
        lt.replace("-", "_"), frozenset()
    )
    assert set(own_failures(ROWS[name])) == set(known)


def test_every_loss_type_trl_offers_has_rows() -> None:
    import dataclasses
    import re

    from trl.trainer.grpo_config import GRPOConfig

    field = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type")
    listed = field.metadata["help"].split("Supported values are")[1].split(".")[0]
    assert set(re.findall(r"'(\w+)'", listed)) == set(LOSS_TYPES)
    assert len(ROWS) == 2 * len(LOSS_TYPES)


@pytest.mark.parametrize(
    "name",
    [
        "trl-adapted-cispo-default",
        "trl-adapted-dapo-bf16-default",
        "trl-users-bnpo",
        "trl-users-dapo",
    ],
)
def test_trl_default_and_users_rows_fail_what_they_declare(name: str) -> None:
    from posttrain.adapters.trl.implementations import ROWS as MORE

    assert set(own_failures(MORE[name])) == set(MORE[name].known_failures)


def test_cispo_rows_declare_the_bounds_trl_clamps_at() -> None:
    # GRPOTrainer._compute_loss clamps cispo's weight at epsilon_high itself, from above only.
    from posttrain.testing import tiny_causal_lm

    for name in ("trl-raw-cispo", "trl-adapted-cispo"):
        row = ROWS[name]
        assert row.options["ratio"] == "cispo"
        assert "clip" in row.capabilities
        low, high = row.extras["clip_epsilon"]
        trainer = row.factory(tiny_causal_lm(vocab_size=64), **row.options).trainer
        assert 1 + high == pytest.approx(trainer.epsilon_high)
        assert low == 1.0  # a lower bound of 0: nothing clamped below


@pytest.mark.parametrize(
    ("name", "rid"), [("trl-adapted-cispo", "LOSS-023"), ("trl-adapted-luspo", "LOSS-022")]
)
def test_adapted_rows_conform_to_their_declared_clip(name: str, rid: str) -> None:
    from posttrain.conformance import Status
    from tests.outcomes import run_for

    got = {r.id: r for r in run_for(ROWS[name], rid).results}[rid]
    assert got.status is Status.PASS, got.message


def test_a_micro_batch_without_loss_tokens_still_runs_trls_loss() -> None:
    # GRPOTrainer._compute_loss all-reduces its metrics across ranks: a rank whose micro-batch
    # holds no assistant token must take part, or the other ranks' collectives mismatch.
    import torch

    from posttrain.contracts.loss import GlobalCounts
    from posttrain.testing import llm_batch, tiny_causal_lm

    row = ROWS["trl-adapted-bnpo"]
    loss = row.factory(tiny_causal_lm(vocab_size=64), **row.options)
    td = llm_batch(2, 9, vocab_size=64)
    td.set(
        ("masks", "all_assistant_mask"), torch.zeros_like(td.get(("masks", "all_assistant_mask")))
    )
    metrics = loss.trainer._metrics["train"]
    before = sum(len(v) for v in metrics.values())
    out = loss(td, counts=GlobalCounts(tokens=5, sequences=2))
    assert float(out["loss_objective"]) == 0.0
    assert sum(len(v) for v in metrics.values()) > before
