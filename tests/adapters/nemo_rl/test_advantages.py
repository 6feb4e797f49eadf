"""NeMo-RL's advantage estimators against vectors its own functions produced (7ea279a)."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.adapters.nemo_rl.mirror.advantages import (
    baseline_and_std_per_prompt,
    clip_advantages,
    grpo_advantage,
    reinforce_plus_plus_advantage,
)
from tests.paths import DATA

V = json.loads((DATA / "nemo_rl_advantages.json").read_text())


def _same(got: torch.Tensor, want: list[object]) -> None:
    """Equal to NeMo-RL's values within 1e-6 relative: bit for bit on the CPU that produced
    them, but a CPU whose vector kernels round the mean-square std ``(E[r^2] - E[r]^2) *
    n / (n - 1)`` the other way (0.5 against 0.49999997) moves an advantage by 2 ULPs."""
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_near_constant_group_gives_nemo_rls_5310_04() -> None:
    v = V["grpo_near_constant"]
    p, r = torch.tensor(v["prompt_ids"]), torch.tensor(v["rewards"])
    a = grpo_advantage(p, r, torch.ones(*v["mask_shape"]))
    assert a.shape == (4, 3)
    assert torch.equal(a[:, 0], torch.tensor(v["advantages"]))
    assert round(a[3, 0].item(), 2) == 5310.04
    b, s = baseline_and_std_per_prompt(p, r, torch.ones(4))
    assert torch.equal(torch.stack([b, s]), torch.tensor(v["baseline_std"]))


@pytest.mark.parametrize("loo", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantage_matches_nemo_rl(loo: bool, norm: bool) -> None:
    v = V[f"grpo_mixed_loo{int(loo)}_norm{int(norm)}"]
    a = grpo_advantage(
        torch.tensor(v["prompt_ids"]),
        torch.tensor(v["rewards"]),
        torch.tensor(v["mask"]),
        leave_one_out=loo,
        normalize=norm,
    )
    _same(a, v["advantages"])


def test_clipping_matches_nemo_rl() -> None:
    v = V["grpo_clip"]
    c = V[v["case"]]
    a = grpo_advantage(
        torch.tensor(c["prompt_ids"]), torch.tensor(c["rewards"]), torch.tensor(c["mask"])
    )
    got = clip_advantages(a, v["advantage_clip_low"], v["advantage_clip_high"])
    _same(got, v["advantages"])
    w = V["grpo_near_constant_clip"]
    n = V[w["case"]]
    a = grpo_advantage(torch.tensor(n["prompt_ids"]), torch.tensor(n["rewards"]), torch.ones(4, 3))
    got = clip_advantages(a, w["advantage_clip_low"], w["advantage_clip_high"])
    assert torch.equal(got[:, 0], torch.tensor(w["advantages"]))


@pytest.mark.parametrize("mb", [True, False])
@pytest.mark.parametrize("kl", [True, False])
def test_reinforce_plus_plus_matches_nemo_rl(mb: bool, kl: bool) -> None:
    v = V[f"rpp_mb{int(mb)}_kl{int(kl)}"]
    a = reinforce_plus_plus_advantage(
        torch.tensor(v["prompt_ids"]),
        torch.tensor(v["rewards"]),
        torch.tensor(v["mask"]),
        minus_baseline=mb,
        use_kl_in_reward=kl,
        kl_coef=v["kl_coef"],
        kl_type=v["kl_type"],
        logprobs_policy=torch.tensor(v["logprobs_policy"]),
        logprobs_reference=torch.tensor(v["logprobs_reference"]),
    )
    torch.testing.assert_close(a, torch.tensor(v["advantages"]), rtol=0, atol=1e-6)
