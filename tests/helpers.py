"""Small builders shared by the tests."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from posttrain.contracts import LLM_LAYOUT_V1


def llm_batch(b: int = 4, t: int = 8, *, device: str = "cpu", seed: int = 0) -> TensorDict:
    """A valid LLM-layout batch: prompt of 3 tokens, then a response, then right padding."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (b, t), generator=g)
    lengths = torch.randint(4, t + 1, (b,), generator=g)
    pos = torch.arange(t).expand(b, t)
    attn = pos < lengths[:, None]
    asst = attn & (pos >= 3)
    lp = -torch.rand(b, t, generator=g)
    k = LLM_LAYOUT_V1.key
    return TensorDict(
        {
            k("tokens"): tokens,
            k("attention_mask"): attn,
            k("assistant_mask"): asst,
            k("sample_log_probs"): lp,
            k("ref_log_probs"): lp - 0.1,
            k("advantage"): torch.randn(b, generator=g),
            k("reward"): torch.rand(b, generator=g),
            k("policy_version"): torch.zeros(b, dtype=torch.int64),
            k("group_id"): torch.arange(b) // 2,
        },
        batch_size=[b],
        device=device,
    )
