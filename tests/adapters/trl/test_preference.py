"""Preference datasets from a GRPO-filled buffer, round-tripped through TRL's DPOTrainer,
KTOTrainer and RewardTrainer (CPU, tiny models, a tokenizer that adds BOS, two steps each)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from posttrain.adapters.trl import TRLRolloutSource, preference_dataset, trl_reward
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import tiny_causal_lm, tiny_reward_model
from tests.adapters.trl.test_verifiable import BOS, bos_tokenizer

K = LLM_LAYOUT_V1.key
EOS = 2
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = [[BOS, 5, 6], [BOS, 7], [BOS, 8, 9, 10]]


def digit_sum(completion_ids: list[list[int]], **kw: Any) -> list[float]:
    """A deterministic reward that differs between a group's answers."""
    return [float(sum(c) % 7) for c in completion_ids]


@pytest.fixture(scope="module")
def grpo_buffer() -> Any:
    """TRL's GRPO generation (4 answers per prompt, group ids) scored and stored in TorchRL."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = TRLRolloutSource(
            tiny_causal_lm(),
            PROMPTS,
            1,
            max_new_tokens=3,
            num_generations=4,
            tokenizer=bos_tokenizer(),
        )
        batch = next(iter(src))
        src.shutdown()
    batch = trl_reward(digit_sum, bos_tokenizer())(batch)
    rb = ReplayBuffer(storage=LazyStackStorage(32), sampler=SamplerWithoutReplacement())
    rb.extend(batch)
    return rb, batch


def _stored(batch: TensorDictBase) -> dict[tuple[int, ...], tuple[tuple[int, ...], float, int]]:
    """completion ids -> (prompt ids, reward, group) of every stored answer."""
    out = {}
    for x in batch.tensordicts:
        t, a = x.get(K("tokens"))[x.get(K("attention_mask"))], x.get(K("assistant_mask"))
        out[tuple(t[a].tolist())] = (
            tuple(t[~a].tolist()),
            float(x.get(K("reward"))),
            int(x.get(K("group_id"))),
        )
    return out


def _args(config: Any, tmp_path: Path, **kw: Any) -> Any:
    return config(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        **kw,
    )


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _strip_eos(ids: list[int]) -> tuple[int, ...]:
    # DPO/KTO append EOS to a completion that lacks one.
    return tuple(ids[:-1] if ids and ids[-1] == EOS else ids)


def test_pairs_are_best_worst_or_every_pair_above_the_margin(grpo_buffer: Any) -> None:
    rb, batch = grpo_buffer
    stored = _stored(batch)
    by_group: dict[int, list[float]] = {}
    for _, r, g in stored.values():
        by_group.setdefault(g, []).append(r)
    n = len(rb)
    best_worst = preference_dataset(rb, "reward", n)
    assert len(best_worst) == sum(max(v) > min(v) for v in by_group.values())
    for row in best_worst:
        assert row["margin"] == pytest.approx(
            max(by_group[stored[_completion(row["chosen_ids"], stored)][2]])
            - min(by_group[stored[_completion(row["chosen_ids"], stored)][2]])
        )
    every = preference_dataset(rb, "reward", n, pairs="all", margin=1.0)
    expected = sum(1 for v in by_group.values() for a in v for b in v if a - b > 1.0)
    assert len(every) == expected
    assert all(m > 1.0 for m in every["margin"])
    kto = preference_dataset(rb, "kto", n, tokenizer=bos_tokenizer())
    means = {g: sum(v) / len(v) for g, v in by_group.items()}
    assert len(kto) == sum(r != means[g] for _, r, g in stored.values())


def _completion(ids: Any, stored: dict[tuple[int, ...], Any]) -> tuple[int, ...]:
    for c, (p, _, _) in stored.items():
        if tuple(ids) == p + c:
            return c
    raise AssertionError(f"{ids} is not a stored sequence")


def test_dpo_trainer_trains_on_the_stored_ids_of_each_pair(
    grpo_buffer: Any, tmp_path: Path
) -> None:
    from trl.trainer.dpo_config import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer

    rb, batch = grpo_buffer
    stored = _stored(batch)
    ds = preference_dataset(rb, "dpo", len(rb), tokenizer=bos_tokenizer())
    assert len(ds) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=tiny_causal_lm(),
            ref_model=tiny_causal_lm(),  # built, not loaded: the policy has no hub path
            args=_args(DPOConfig, tmp_path),
            train_dataset=ds,
            processing_class=bos_tokenizer(),
        )
        for row in _rows(trainer):  # TRL's own tokenization of our text
            chosen, rejected = _strip_eos(row["chosen_ids"]), _strip_eos(row["rejected_ids"])
            assert stored[chosen][0] == tuple(row["prompt_ids"])  # one BOS, the stored prompt
            assert stored[rejected][0] == tuple(row["prompt_ids"])
            assert stored[chosen][1] > stored[rejected][1]
            assert stored[chosen][2] == stored[rejected][2]
        trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)


def test_kto_trainer_trains_on_labelled_answers(grpo_buffer: Any, tmp_path: Path) -> None:
    from trl.trainer.kto_config import KTOConfig
    from trl.trainer.kto_trainer import KTOTrainer

    rb, batch = grpo_buffer
    stored = _stored(batch)
    ds = preference_dataset(rb, "kto", len(rb), tokenizer=bos_tokenizer())
    assert len(ds) >= 2
    assert len(set(ds["label"])) == 2  # both kinds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(
            model=tiny_causal_lm(),
            ref_model=tiny_causal_lm(),
            args=_args(KTOConfig, tmp_path),
            train_dataset=ds,
            processing_class=bos_tokenizer(),
        )
        for row in _rows(trainer):
            prompt, _, _ = stored[_strip_eos(row["completion_ids"])]
            assert prompt == tuple(row["prompt_ids"])
        trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)


def test_reward_trainer_trains_on_the_stored_pairs(grpo_buffer: Any, tmp_path: Path) -> None:
    from trl.trainer.reward_config import RewardConfig
    from trl.trainer.reward_trainer import RewardTrainer

    rb, batch = grpo_buffer
    stored = _stored(batch)
    ds = preference_dataset(rb, "reward", len(rb))
    assert len(ds) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RewardTrainer(
            model=tiny_reward_model(),
            args=_args(RewardConfig, tmp_path),
            train_dataset=ds,
            processing_class=bos_tokenizer(),
        )
        for row in _rows(trainer):
            chosen = _completion(_strip_eos(row["chosen_ids"]), stored)
            rejected = _completion(_strip_eos(row["rejected_ids"]), stored)
            assert stored[chosen][1] > stored[rejected][1]
        trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)


def _rows(trainer: Any) -> Any:
    """The trainer's prepared (tokenized) training rows."""
    return iter(trainer.train_dataset)


def test_a_nan_reward_is_left_out_not_a_poisoned_group_mean() -> None:
    from tensordict import TensorDict

    from posttrain.adapters._hf import word_level_tokenizer
    from posttrain.reference_impls import RingBuffer

    group = TensorDict(
        {
            ("tokens", "full"): torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10], [5, 6, 11, 12]]),
            ("masks", "all_attention_mask"): torch.ones(3, 4, dtype=torch.bool),
            ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1]] * 3).bool(),
            ("next", "reward"): torch.tensor([1.0, 0.0, math.nan]),
            "group_id": torch.tensor([0, 0, 0]),
        },
        [3],
    )
    rb = RingBuffer(3, sampling="without_replacement")  # each call draws all 3
    rb.extend(group)
    ds = preference_dataset(rb, "kto", 3, tokenizer=word_level_tokenizer(tiny_causal_lm().config))
    assert sorted(ds["label"]) == [False, True]  # mean 0.5 over the 2 scored answers
    pairs = preference_dataset(rb, "reward", 3)
    assert list(pairs["margin"]) == [1.0]
