"""TorchRL's GRPOLoss trains a tiny policy on LLMCollector rollouts scored by an HF reward model.

Run: python examples/torchrl_grpo_hf_reward.py   (CPU, tiny models, nothing downloaded)
"""

from __future__ import annotations

import torch

from posttrain.adapters._layout import to_padded
from posttrain.adapters.torchrl.loss import make_loss
from posttrain.adapters.torchrl.rollout import llm_collector
from posttrain.adapters.trl import hf_reward_model
from posttrain.testing import tiny_causal_lm, tiny_reward_model


def main() -> list[float]:
    torch.manual_seed(0)
    policy = tiny_causal_lm()
    source = llm_collector(policy, [[5, 6, 7]] * 4, 3, max_new_tokens=4, adapted=True)
    reward = hf_reward_model(tiny_reward_model())  # writes ("next", "reward"), float32 [B]
    loss = make_loss("GRPOLoss", adapted=True)(policy)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    rewards = []
    for batch in source:  # one GRPO group per batch: the same prompt answered 4 times
        batch = reward(batch)
        r = batch.get(("next", "reward"))
        dense = to_padded(batch)
        dense.set("advantage", (r - r.mean()) / (r.std() + 1e-6))
        opt.zero_grad()
        loss(dense).get("loss_objective").backward()
        opt.step()
        rewards.append(float(r.mean()))
    source.shutdown()
    print("mean reward per step:", rewards)
    return rewards


if __name__ == "__main__":
    main()
