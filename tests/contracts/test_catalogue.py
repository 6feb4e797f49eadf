"""The metric catalogue v1 (posttrain.contracts.catalogue) and its crosswalk."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from posttrain.contracts.catalogue import CATALOGUE_V1, Catalogue, MetricDef
from tests.paths import ROOT

# The issue's minimum, by catalogue name.
REQUIRED = [
    "rollout/reward/mean", "rollout/reward/std", "rollout/reward/min", "rollout/reward/max",
    "rollout/reward_fn/<reward_fn>/mean", "rollout/group/zero_std_frac",
    "rollout/advantage/mean", "rollout/advantage/std", "rollout/response_len/mean",
    "rollout/prompt_len/mean", "rollout/truncated_frac", "policy/kl_ref/k1", "policy/kl_ref/k3",
    "policy/kl_ref/seq_k1", "policy/entropy", "policy/entropy/sampled", "policy/ratio/mean",
    "policy/clip_frac/low", "policy/clip_frac/high", "policy/mismatch_kl", "loss/total",
    "optim/grad_norm", "optim/lr", "time/weight_sync_s", "perf/gen_tokens_per_s",
    "perf/train_tokens_per_s", "staleness/policy_version", "staleness/mean", "staleness/max",
    "buffer/size", "buffer/capacity", "buffer/utilization", "buffer/writes", "buffer/reads",
    "reward_model/accuracy", "reward_model/margin",
]  # fmt: skip


def test_the_catalogue_holds_the_issues_minimum() -> None:
    names = {m.name for m in CATALOGUE_V1.metrics}
    assert sorted(set(REQUIRED) - names) == []
    assert {m.reduction for m in CATALOGUE_V1.metrics} == {
        "tok", "seq", "sum", "min", "max", "last", "rate", "hist",
    }  # fmt: skip


def _site(module: str) -> str:
    import importlib

    mod = importlib.import_module(module)
    assert mod.__file__ is not None
    return Path(mod.__file__).read_text()


def test_trl_names_in_the_crosswalk_exist_in_trls_source() -> None:
    # If TRL renames a metric, this fails: the crosswalk must follow.
    source = _site("trl.trainer.grpo_trainer") + _site("trl.trainer.reward_trainer")
    for m in CATALOGUE_V1.metrics:
        trl = m.crosswalk.get("trl", "")
        name = trl.split(" ")[0]
        if not name or name in ("—", "loss", "grad_norm", "learning_rate"):  # none; Trainer's
            continue
        pattern = re.escape(name).replace("<name>", r"\{[a-z_]+\}")
        assert re.search(pattern, source), f"{m.name}: TRL metric {name!r} not in TRL's source"


def test_torchrl_names_in_the_crosswalk_exist_in_torchrls_source() -> None:
    source = _site("torchrl.objectives.llm.grpo") + _site(
        "torchrl.modules.inference_server._server"
    )
    for m in CATALOGUE_V1.metrics:
        name = m.crosswalk.get("torchrl", "").split(" ")[0]
        if name and name not in ("—", "sum"):
            assert f'"{name}"' in source, f"{m.name}: TorchRL key {name!r} not in TorchRL's source"


def test_verl_names_in_the_crosswalk_exist_in_verls_source() -> None:
    # verl builds most names from a prefix and a key ("actor/" + metrics["kl_loss"],
    # f"timing_s/{name}" + marked_timer("update_weights")): a name counts as present when the
    # whole name or its last key appears quoted in verl's installed source, so a renamed key fails.
    verl = pytest.importorskip("verl", reason="pip install --no-deps verl")
    root = Path(verl.__file__).parent
    source = "\n".join(p.read_text(errors="ignore") for p in sorted(root.rglob("*.py")))
    checked = 0
    for m in CATALOGUE_V1.metrics:
        name = m.crosswalk.get("verl", "").split(" ")[0]
        if not name or name == "—":
            continue
        key = name.rsplit("/", 1)[-1]
        found = name in source or re.search(rf"[\"'/]{re.escape(key)}[\"']", source)
        assert found, f"{m.name}: verl metric {name!r} (key {key!r}) not in verl's source"
        checked += 1
    assert checked >= 30  # the verl column names 35 metrics


def test_bad_definitions_are_refused() -> None:
    with pytest.raises(ValidationError, match="must match"):
        MetricDef(name="Bad Name", unit="1", reduction="seq", formula="x", inputs=(), section="x")
    with pytest.raises(ValidationError, match="unknown frameworks"):
        MetricDef(
            name="a/b", unit="1", reduction="seq", formula="x", inputs=(), section="a",
            crosswalk={"rllib": "x"},
        )  # fmt: skip
    m = CATALOGUE_V1.metrics[0]
    with pytest.raises(ValidationError, match="duplicate names"):
        Catalogue(name="c", version="1.0", metrics=(m, m))
    with pytest.raises(KeyError, match="no metric 'nope'"):
        CATALOGUE_V1.metric("nope")


def test_the_spec_lists_every_metric() -> None:
    spec = (ROOT / "specs" / "metrics_catalogue-v1.md").read_text()
    for m in CATALOGUE_V1.metrics:
        assert f"`{m.name}`" in spec


def test_every_metric_declares_how_ranks_combine() -> None:
    rules = {m.name: m.ranks for m in CATALOGUE_V1.metrics}
    assert rules["time/rollout_s"] == "max"  # ranks run at once: not 2 x 2 s
    assert rules["perf/gen_tokens_per_s"] == "rate"
    assert rules["rollout/reward/std"] == rules["policy/ratio/ess"] == "moments"
    assert rules["buffer/writes"] == rules["loss/total"] == "sum"
    assert {m.ranks for m in CATALOGUE_V1.metrics if m.reduction in ("tok", "seq")} == {
        "pairs",
        "moments",
    }
    new = {m.name for m in CATALOGUE_V1.metrics if m.since == "1.1"}
    assert new == {
        "rollout/reward_fn/<reward_fn>/std",
        "policy/update_kl/k1",
        "policy/update_kl/k3",
        "policy/ratio/ess",
        "perf/gen_tokens_per_s_per_rank",
        "perf/train_tokens_per_s_per_rank",
    }
    assert rules["perf/gen_tokens_per_s_per_rank"] == "pairs"  # tokens over rank-seconds
    assert CATALOGUE_V1.metric("policy/update_kl/k1").crosswalk["verl"].startswith("actor/ppo_kl")
    assert CATALOGUE_V1.metric("policy/update_kl/k1").crosswalk["torchrl"].startswith("kl_approx")
    assert CATALOGUE_V1.metric("policy/ratio/ess").crosswalk["torchrl"].startswith("ESS")
    hist = {m.name for m in CATALOGUE_V1.metrics if m.since == "1.2"}
    assert hist == {"rollout/response_len", "rollout/reward", "rollout/advantage"}
    assert {rules[n] for n in hist} == {"concat"}
