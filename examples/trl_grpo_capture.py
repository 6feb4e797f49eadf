"""GRPOTrainer reads prompts from one buffer and writes its generations into another.

The prompt buffer is posttrain's RingBuffer here; any ReplayBufferV1 works (a TorchRL buffer
filled by LLMCollector: see tests/adapters/trl/test_roundtrip.py). The rewards come from a locally built
HF reward model through the contract-reward adapter, plus a plain TRL reward function.

Run: python examples/trl_grpo_capture.py   (CPU, tiny models, nothing downloaded)
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from torchrl.data import LazyStackStorage, ReplayBuffer
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl import (
    CaptureRollouts,
    hf_reward_model,
    prompt_dataset,
    trl_reward_func,
)
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch, tiny_causal_lm, tiny_reward_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL


def short_answers(completion_ids: list[list[int]], **kw: Any) -> list[float | None]:
    return [1.0 / (1 + len(c)) for c in completion_ids]


def main() -> ReplayBuffer:
    policy = tiny_causal_lm()
    tok = word_level_tokenizer(policy.config)
    tok.padding_side = "left"
    prompts = RingBuffer(16)
    prompts.extend(llm_batch(8, 8, vocab_size=64))  # any LLM-layout data: its prompts are used
    dataset = prompt_dataset(prompts, tok, 4, num_batches=1)

    generations = ReplayBuffer(storage=LazyStackStorage(256))
    capture = CaptureRollouts(generations, prompt_ids=dataset)  # generate from the stored ids
    reward_model = trl_reward_func(hf_reward_model(tiny_reward_model()), tok, name="reward_model")
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[reward_model, short_answers],
            args=GRPOConfig(
                output_dir=out,
                max_steps=2,
                per_device_train_batch_size=4,
                num_generations=2,
                max_completion_length=4,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                logging_steps=1,
                shuffle_dataset=False,  # a buffer sample is random already
            ),
            train_dataset=dataset,
            processing_class=tok,
            rollout_func=capture,
        )
        trainer.train()
    print(f"captured {len(generations)} generations in {capture.groups} groups")
    return generations


if __name__ == "__main__":
    main()
