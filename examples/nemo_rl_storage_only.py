"""NeMo-RL's async replay buffer, backed by a TorchRL replay buffer: batches come back unchanged.

Run: python examples/nemo_rl_storage_only.py   (CPU; NeMo-RL itself is not needed)
"""

from __future__ import annotations

import torch
from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

from posttrain.adapters.nemo_rl import NemoReplayBuffer
from posttrain.adapters.nemo_rl.mirror.batching import flatten_message_logs
from posttrain.adapters.torchrl import ValidatedReplayBuffer


def group(step: int) -> dict[str, torch.Tensor]:
    """One prompt group of NeMo-RL train data, built as nemo_rl/algorithms/grpo.py builds it."""
    answers = [[21 + step, 22], [31, 32, 33 + step][: 2 + step % 2]]
    logs = [
        [
            {"role": "user", "token_ids": [11, 12, 13]},
            {"role": "assistant", "token_ids": a, "generation_logprobs": [-0.5] * len(a)},
        ]
        for a in answers
    ]
    flat = flatten_message_logs(logs, make_sequence_length_divisible_by=4)
    return {
        "input_ids": flat["token_ids"],
        "input_lengths": flat["input_lengths"],
        "token_mask": flat["token_loss_mask"],
        "generation_logprobs": flat["generation_logprobs"],
        "prev_logprobs": flat["generation_logprobs"] - 0.01,
        "advantages": torch.tensor([[1.0], [-1.0]]).expand(2, flat["token_ids"].shape[1]).clone(),
        "sample_mask": torch.ones(2),
    }


def main() -> int:
    torchrl_buffer = TensorDictReplayBuffer(storage=LazyStackStorage(64))
    # Each group is stored as fixed-width chunks (4 KiB here, as int64 words), one TorchRL item each.
    nemo = NemoReplayBuffer(ValidatedReplayBuffer(torchrl_buffer), 8, chunk_bytes=4096)
    sent = {}
    for step in range(4):  # a generator at version `step` writes for version step + 1
        sent[step] = group(step)
        assert nemo.add({"batch": sent[step], "step": step}, step, step + 1) == "success"
    same = 0
    for version in range(1, 5):
        out = nemo.sample(1, current_weight_version=version, max_age_steps=1)
        assert out is not None
        got = out["trajectories"][0]
        for key, value in sent[got["step"]].items():
            assert got["batch"][key].dtype == value.dtype
            assert torch.equal(got["batch"][key], value), key
        same += 1
    print(f"{same} NeMo-RL batches went through a TorchRL buffer and came back unchanged")
    return same


if __name__ == "__main__":
    main()
