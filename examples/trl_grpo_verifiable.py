"""Verifiable-reward GRPO from a replay buffer: prompts and their ground-truth answers stored
together, GRPOTrainer's default generation path, a tokenizer that adds BOS.

`prompt_dataset(..., columns={"solution": "solution"})` passes the stored string column to
every reward function (TRL hands dataset columns over as keyword arguments), and writes the
prompt text so that TRL's re-tokenizing gives the stored ids back (the BOS is not doubled).

Run: python examples/trl_grpo_verifiable.py   (CPU, tiny model, nothing downloaded)
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict
from tokenizers import processors
from torchrl.data import LazyStackStorage, ReplayBuffer
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl import prompt_dataset
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import tiny_causal_lm

K = LLM_LAYOUT_V1.key


def correct(completions: list[str], solution: list[str], **kw: Any) -> list[float | None]:
    """1 where the answer contains the ground truth (a TRL reward function, unchanged)."""
    return [float(s in c.split()) for c, s in zip(completions, solution, strict=True)]


def main() -> list[float]:
    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )  # adds BOS, as Llama's tokenizer does
    items = []
    for i, prompt in enumerate([[1, 8, 9], [1, 10, 11, 12], [1, 13], [1, 14, 15]]):
        n = len(prompt)
        td = TensorDict(
            {
                K("tokens"): torch.tensor([*prompt, 20, 21]),
                K("attention_mask"): torch.ones(n + 2, dtype=torch.bool),
                K("assistant_mask"): torch.arange(n + 2) >= n,
            },
            batch_size=[],
        )
        td.set("solution", NonTensorData(f"t{30 + i}"))
        items.append(td)
    buffer = ReplayBuffer(storage=LazyStackStorage(16))
    buffer.extend(LazyStackedTensorDict.lazy_stack(items, 0))

    dataset = prompt_dataset(buffer, tok, 2, num_batches=2, columns={"solution": "solution"})
    print(next(iter(dataset)))  # {'prompt': 't8 t9', 'prompt_ids': [1, 8, 9], 'solution': ...}
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=tiny_causal_lm(),
            reward_funcs=[correct],
            args=GRPOConfig(
                output_dir=out,
                max_steps=2,
                per_device_train_batch_size=4,
                num_generations=2,
                max_completion_length=3,
                shuffle_dataset=False,  # the buffer's sampler already randomizes
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                logging_steps=1,
            ),
            train_dataset=dataset,
            processing_class=tok,
        )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("GRPO losses:", losses)
    return losses


if __name__ == "__main__":
    main()
