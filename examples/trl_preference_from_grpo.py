"""Preference training from GRPO groups: TRL's GRPO generation fills a TorchRL buffer, a
contract reward scores it, and DPOTrainer, KTOTrainer and RewardTrainer train on pairs and
labelled answers drawn from its groups.

Run: python examples/trl_preference_from_grpo.py   (CPU, tiny models, nothing downloaded)
"""

from __future__ import annotations

import tempfile
from typing import Any

from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.data.replay_buffers import SamplerWithoutReplacement
from trl.trainer.dpo_config import DPOConfig
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.kto_config import KTOConfig
from trl.trainer.kto_trainer import KTOTrainer
from trl.trainer.reward_config import RewardConfig
from trl.trainer.reward_trainer import RewardTrainer

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl import TRLRolloutSource, preference_dataset, trl_reward
from posttrain.testing import tiny_causal_lm, tiny_reward_model


def digit_sum(completion_ids: list[list[int]], **kw: Any) -> list[float]:
    """Any TRL reward function scores the stored answers (here: a toy, deterministic one)."""
    return [float(sum(c) % 7) for c in completion_ids]


def main() -> list[float]:
    tok = word_level_tokenizer(tiny_causal_lm().config)
    # 1. GRPO groups: 3 prompts x 4 answers from TRL's GRPO generation, scored, stored.
    source = TRLRolloutSource(
        tiny_causal_lm(), [[5, 6], [7], [8, 9, 10]], 1, max_new_tokens=3, num_generations=4
    )
    buffer = ReplayBuffer(storage=LazyStackStorage(32), sampler=SamplerWithoutReplacement())
    for batch in source:
        buffer.extend(trl_reward(digit_sum, tok)(batch))
    source.shutdown()

    losses: list[float] = []
    common: dict[str, Any] = {
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_steps": 1,
    }
    with tempfile.TemporaryDirectory() as out:
        # 2. DPO on each group's best vs worst answer.
        dpo = DPOTrainer(
            model=tiny_causal_lm(),
            ref_model=tiny_causal_lm(),  # built, not loaded: the policy has no hub path
            args=DPOConfig(output_dir=out, **common),
            train_dataset=preference_dataset(buffer, "dpo", 12, tokenizer=tok),
            processing_class=tok,
        )
        dpo.train()
        # 3. KTO on answers labelled above / below their group's mean.
        kto = KTOTrainer(
            model=tiny_causal_lm(),
            ref_model=tiny_causal_lm(),
            args=KTOConfig(output_dir=out, **common),
            train_dataset=preference_dataset(buffer, "kto", 12, tokenizer=tok),
            processing_class=tok,
        )
        kto.train()
        # 4. A reward model on every pair whose rewards differ by more than 1.
        rm = RewardTrainer(
            model=tiny_reward_model(),
            args=RewardConfig(output_dir=out, **common),
            train_dataset=preference_dataset(buffer, "reward", 12, pairs="all", margin=1.0),
            processing_class=tok,
        )
        rm.train()
    for trainer in (dpo, kto, rm):
        losses += [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("DPO, KTO, reward-model losses:", losses)
    return losses


if __name__ == "__main__":
    main()
