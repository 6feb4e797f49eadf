"""TRL's online DPO (trl.experimental, TRL 1.16) on prompts from a replay buffer (CPU, tiny model)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl import RewardModule, prompt_dataset, trl_reward_func
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch, tiny_causal_lm

K = LLM_LAYOUT_V1.key
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_online_dpo_trains_on_the_buffers_prompts_scored_by_a_contract_reward(
    tmp_path: Path,
) -> None:
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.padding_side = "left"
    data = llm_batch(8, vocab_size=64)
    rb = RingBuffer(8)
    rb.extend(data)
    stored = {
        tuple(t[a & ~s].tolist())
        for t, a, s in zip(
            data[K("tokens")], data[K("attention_mask")], data[K("assistant_mask")], strict=True
        )
    }
    scored: list[tuple[list[int], list[int]]] = []

    def record(td: Any) -> torch.Tensor:
        # A contract reward: it sees the stored prompt ids (TRL passes the dataset's
        # prompt_ids column on) followed by each generated completion.
        for t, s in zip(td.tensordicts, [x.get(K("assistant_mask")) for x in td.tensordicts],
                        strict=True):  # fmt: skip
            tokens = t.get(K("tokens"))
            scored.append((tokens[~s].tolist(), tokens[s].tolist()))
        return torch.tensor([float(x.get(K("assistant_mask")).sum()) for x in td.tensordicts])

    args = OnlineDPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        max_new_tokens=3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        # accelerate's batch dispatcher (its default for an iterable dataset) reads the batch
        # size from the first column, here the prompt texts, and fails on strings.
        accelerator_config={"dispatch_batches": False},
    )
    # list[Any]: TRL types the list as invariant over its own union of reward kinds.
    rewards: list[Any] = trl_reward_func([RewardModule(record, name="length")], tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OnlineDPOTrainer(
            model=tiny_causal_lm(),
            ref_model=tiny_causal_lm(),
            reward_funcs=rewards,
            args=args,
            train_dataset=prompt_dataset(rb, tok, 2, num_batches=None),
            processing_class=tok,
        )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)
    # Two steps of 2 prompts, each answered twice: 8 scored completions, every prompt a stored one.
    assert len(scored) == 8
    assert {tuple(p) for p, _ in scored} <= stored
    assert all(1 <= len(c) <= 3 for _, c in scored)
