"""SFTTrainer trained on a TorchRL replay buffer that a TorchRL LLMCollector filled (ragged).

Run: python examples/trl_sft_from_torchrl_buffer.py   (CPU, tiny models, nothing downloaded)
"""

from __future__ import annotations

import tempfile

import torch
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.data.replay_buffers import SamplerWithoutReplacement
from trl.trainer.sft_config import SFTConfig
from trl.trainer.sft_trainer import SFTTrainer

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.torchrl.rollout import llm_collector
from posttrain.adapters.trl import sft_dataset
from posttrain.testing import tiny_causal_lm


def main() -> list[float]:
    torch.manual_seed(0)
    policy = tiny_causal_lm()
    # 1. TorchRL generates: 2 batches x 4 prompts of different lengths -> ragged items.
    source = llm_collector(policy, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]], 2, adapted=True)
    buffer = ReplayBuffer(storage=LazyStackStorage(64), sampler=SamplerWithoutReplacement())
    for batch in source:
        buffer.extend(batch)
    source.shutdown()

    # 2. TRL trains on it: rows are real tokens only, labels -100 outside the assistant mask.
    tok = word_level_tokenizer(policy.config)
    with tempfile.TemporaryDirectory() as out:
        trainer = SFTTrainer(
            model=tiny_causal_lm(),
            args=SFTConfig(
                output_dir=out,
                max_steps=2,
                per_device_train_batch_size=4,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                logging_steps=1,
            ),
            train_dataset=sft_dataset(buffer, 4, num_batches=2),
            processing_class=tok,
        )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("SFT losses:", losses)
    return losses


if __name__ == "__main__":
    main()
