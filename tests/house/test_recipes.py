"""One hook set across GRPO, expert iteration and reward-model training: the recipe x metric
table in the docs is the catalogue's, each example emits exactly its recipe's metrics, and on
the same tiny data the three recipes log their shared names with equal values through one sink,
read back equal from TensorBoard, MLflow (SQLite) and offline W&B."""

from __future__ import annotations

import copy
import json
import math
import runpy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.adapters.trl.preference import reward_dataset
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.catalogue import CATALOGUE_V1, RECIPES, recipe_metrics, recipe_table
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.observability import (
    Accumulator,
    buffer_metrics,
    loss_metrics,
    optim_metrics,
    policy_metrics,
    rollout_metrics,
    selection_metrics,
)
from posttrain.observability.sinks import (
    MlflowSink,
    Tee,
    TensorboardSink,
    WandbSink,
    read_mlflow,
    read_tensorboard,
    read_wandb,
)
from posttrain.reference_impls import RingBuffer, read_jsonl
from posttrain.testing import tiny_causal_lm, tiny_reward_model
from tests.paths import ROOT

K = LLM_LAYOUT_V1.key
# Loops without a generation server emit no gen_server/* (the table says where they apply).
SERVER = tuple(m.name for m in CATALOGUE_V1.metrics if m.section == "gen_server")


def _example(name: str) -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))


def _names(out: Path) -> set[str]:
    """Every name a JsonlSink run holds (scalars and histograms), per-function names folded."""
    names = set(read_jsonl(out))
    hist = out / "histograms.jsonl"
    if hist.exists():
        names |= {json.loads(line)["name"] for line in hist.read_text().splitlines()}
    return {n.replace("/low_token_share/", "/<reward_fn>/") for n in names}


def test_the_docs_table_is_the_catalogues() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    begin, end = "<!-- recipe-table:begin -->\n", "<!-- recipe-table:end -->"
    assert begin in doc
    assert end in doc
    assert doc.split(begin)[1].split(end)[0] == recipe_table()


def test_every_metric_applies_to_some_recipe_and_the_new_ones_to_theirs() -> None:
    covered = set().union(*(recipe_metrics(r) for r in RECIPES))
    assert covered == {m.name for m in CATALOGUE_V1.metrics}
    ei, rm, grpo = (set(recipe_metrics(r)) for r in ("expert_iteration", "reward_model", "grpo"))
    assert {n for n in ei if n.startswith("selection/")}
    assert not any(n.startswith("selection/") for n in grpo | rm)
    assert "policy/kl_ref/k3" not in ei
    assert "loss/nll" in ei - grpo
    assert {"reward_model/loss", "reward_model/accuracy"} <= rm - grpo - ei


def test_the_expert_iteration_example_emits_its_recipes_metrics(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = _example("expert_iteration")["run"](tmp_path, rounds=2)
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)
    assert _names(tmp_path) == set(recipe_metrics("expert_iteration")) - set(SERVER)
    vals = read_jsonl(tmp_path)
    # 4 prompts x 4 answers, the best one kept: rate 1/4; the buffer fills a quarter a round.
    assert [v for _, v in vals["selection/rate"]] == [0.25, 0.25]
    assert [v for _, v in vals["buffer/utilization"]] == [0.5, 1.0]
    for (_, before), (_, after) in zip(
        vals["rollout/reward/max"], vals["selection/reward/min"], strict=True
    ):
        assert after <= before
    for (_, mean), (_, kept) in zip(
        vals["rollout/reward/mean"], vals["selection/reward/mean"], strict=True
    ):
        assert kept >= mean  # the top answer of each group is at least its group's mean


def test_the_reward_model_example_emits_its_recipes_metrics_in_both_loops(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = _example("reward_model_training")["run"](tmp_path, steps=2)
    want = set(recipe_metrics("reward_model"))
    assert _names(tmp_path / "plain") == want
    assert _names(tmp_path / "trl") == want
    plain, trl = read_jsonl(tmp_path / "plain"), read_jsonl(tmp_path / "trl")
    # The hooks' Bradley-Terry loss is the loss each loop backpropagated (TRL's own, no margin).
    assert [v for _, v in plain["reward_model/loss"]] == pytest.approx(losses[:2], rel=1e-6)
    assert [v for _, v in trl["reward_model/loss"]] == pytest.approx(losses[2:], rel=1e-6)


def test_the_hooks_in_reward_trainer_read_what_trl_logs(tmp_path: Path) -> None:
    """Accuracy, margin and loss from TRL's own scores equal TRL's logged accuracy, margin and
    loss at every step (one micro-batch a step: TRL's step mean is the pairs' mean)."""
    ex = _example("reward_model_training")
    buffer = ex["fill_buffer"]()
    pairs = reward_dataset(buffer, len(buffer), pairs="all")
    history: list[dict[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex["trl_loop"](buffer, pairs, tmp_path, steps=3, history=history)
    logged = [h for h in history if "accuracy" in h]
    ours = read_jsonl(tmp_path)
    assert len(logged) == 3
    for ours_name, trl_name in (
        ("reward_model/accuracy", "accuracy"),
        ("reward_model/margin", "margin"),
        ("reward_model/loss", "loss"),
        ("optim/grad_norm", "grad_norm"),
    ):
        got = [v for _, v in ours[ours_name]]
        assert got == pytest.approx([h[trl_name] for h in logged], rel=1e-6), ours_name


def _recipe_values() -> dict[str, dict[str, float]]:
    """One step of each recipe on one batch: 4 prompts x 4 answers sampled by one policy.

    GRPO trains on the batch with its advantages; expert iteration keeps every answer
    (k = n: its SFT batch is the same batch) and takes its SFT step; the reward model trains on
    pairs from the buffer the batch filled. Each reads the same buffer, with one learning rate.
    """
    ei, rm = _example("expert_iteration"), _example("reward_model_training")
    gen = torch.Generator().manual_seed(0)
    policy = tiny_causal_lm(seed=0)
    prompts = torch.randint(3, 64, (4, 3), generator=gen)
    cand, truncated = ei["generate"](policy, prompts, 4, 6, gen, version=0)
    reward = cand.get(K("reward"))
    buffer = RingBuffer(capacity=32, seed=0)
    buffer.extend(cand)
    common: dict[str, Any] = {
        "learner_version": 0,
        "truncated": truncated,
        "reward_fns": {"low_token_share": reward},
    }
    lr = 1e-3

    grpo = Accumulator()
    r = reward.view(4, 4)
    td = cand.clone()
    td.set(
        K("advantage"),
        ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).reshape(-1),
    )
    tokens, attn = td.get(K("tokens")), td.get(K("attention_mask"))
    model = copy.deepcopy(policy)
    logits = model(input_ids=tokens, attention_mask=attn.long()).logits
    td.set(K("sample_log_probs"), token_log_probs(logits.detach(), tokens))
    rollout_metrics(td, grpo, **common)
    policy_metrics(td, logits.detach(), grpo)
    loss_metrics({"loss_objective": torch.tensor(0.0)}, grpo)
    optim_metrics(0.0, lr, grpo)
    buffer_metrics(buffer, grpo, writes=16)

    expert = Accumulator()
    rollout_metrics(cand, expert, **common)
    keep = ei["top_k"](cand, 4, 4)
    selection_metrics(cand, keep, expert)
    model = copy.deepcopy(policy).train()
    ei["sft_step"](model, torch.optim.AdamW(model.parameters(), lr=lr), cand[keep], expert)
    buffer_metrics(buffer, expert, writes=16)

    reward_model = Accumulator()
    pairs = reward_dataset(buffer, len(buffer), pairs="all")
    scorer = tiny_reward_model()
    rm["bt_step"](
        scorer, torch.optim.AdamW(scorer.parameters(), lr=lr), list(pairs)[:4], reward_model
    )
    buffer_metrics(buffer, reward_model, writes=16)
    return {
        "grpo": grpo.values(),
        "expert_iteration": expert.values(),
        "reward_model": reward_model.values(),
    }


# Values a recipe's own training makes differ by design: its loss, gradient and timings.
DIFFER = ("loss/", "optim/grad_norm", "time/", "perf/")


def test_three_recipes_log_shared_names_equal_through_one_sink_and_three_backends(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = _recipe_values()
    for recipe, vals in values.items():
        emitted = {n.replace("/low_token_share/", "/<reward_fn>/") for n in vals}
        assert emitted <= set(recipe_metrics(recipe)), recipe
    order = list(values)
    shared: dict[str, list[str]] = {}
    for name in set().union(*values.values()):
        holders = [r for r in order if name in values[r]]
        if len(holders) > 1 and not name.startswith(DIFFER):
            shared[name] = holders
    # GRPO and expert iteration share the rollout statistics and the entropy; all three share
    # the buffer and the learning rate.
    assert "policy/entropy" in shared
    assert "rollout/reward/std" in shared
    assert shared["buffer/utilization"] == order
    assert shared["optim/lr"] == order
    # Exactly the names the table says two recipes share (less the distributions, not asked
    # for here, and the server's).
    table: dict[str, list[str]] = {}
    for m in CATALOGUE_V1.metrics:
        holders = [r for r in order if m.name in recipe_metrics(r)]
        if len(holders) > 1 and m.reduction != "hist" and not m.name.startswith(DIFFER + SERVER):
            table[m.name.replace("/<reward_fn>/", "/low_token_share/")] = holders
    assert shared == table
    for name, holders in shared.items():
        got = [values[r][name] for r in holders]
        assert all(v == got[0] for v in got), (name, dict(zip(holders, got, strict=True)))

    sink = Tee(
        TensorboardSink(tmp_path / "tb"),
        MlflowSink(tmp_path / "mlflow", run_name="recipes"),
        WandbSink(tmp_path / "wandb", run_name="recipes"),
    )
    for step, recipe in enumerate(order):  # one sink, one step per recipe
        for name, v in values[recipe].items():
            sink.log_scalar(name, v, step)
    sink.close()
    backs = {
        "tensorboard": read_tensorboard(tmp_path / "tb"),
        "mlflow": read_mlflow(tmp_path / "mlflow"),
        "wandb": read_wandb(tmp_path / "wandb"),
    }
    for backend, back in backs.items():
        for name, holders in shared.items():
            at = dict(back[name])
            got = [at[order.index(r)] for r in holders]
            assert all(v == got[0] for v in got), (backend, name, got)
            tol = 1e-6 if backend == "tensorboard" else 1e-12  # TensorBoard stores float32
            assert got[0] == pytest.approx(values[holders[0]][name], rel=tol, abs=1e-12)
