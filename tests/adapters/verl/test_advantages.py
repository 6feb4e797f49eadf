"""verl 0.9.1's outcome advantage estimators against posttrain's, on the same rewards.

verl's functions (``verl/trainer/ppo/core_algos.py``: GRPO and its vectorized twin, RLOO and
its vectorized twin, REINFORCE++ and REINFORCE++-baseline) run here on a DataProto whose
rewards and groups reach posttrain through the layout codec (``posttrain.adapters.verl.
data``); posttrain's are ``grpo_advantages`` / ``grpo_advantage`` /
``reinforce_plus_plus_advantage`` (``posttrain/adapters/nemo_rl/mirror/advantages.py``). The groups
are ragged (1, 2, 3, 5, 4 and 4 answers), one of them constant (1/3 four times) and one near
constant (1/3, 1/3, 1/3, 0.9). Agreement is asserted within 1e-6; each place they differ is
asserted as it is, and published in docs/verl.md.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.adapters.nemo_rl.mirror.advantages import (
    grpo_advantage,
    grpo_advantages,
    reinforce_plus_plus_advantage,
)
from posttrain.adapters.verl.data import to_layout
from posttrain.contracts.layout import LLM_LAYOUT_V1

verl_protocol = pytest.importorskip("verl.protocol")
from verl.trainer.ppo import core_algos  # noqa: E402

ca: Any = core_algos  # verl is untyped
TOL = 1e-6
SIZES = (1, 2, 3, 5, 4, 4)
R = 7


def batch(sizes: tuple[int, ...] = SIZES, seed: int = 0, holes: bool = False) -> Any:
    """A verl DataProto of outcome rewards: group i has ``sizes[i]`` answers of one prompt."""
    g = torch.Generator().manual_seed(seed)
    groups: list[torch.Tensor] = [
        torch.rand(1, generator=g),
        torch.tensor([0.0, 1.0]),
        torch.rand(3, generator=g),
        (torch.rand(5, generator=g) > 0.5).float(),
        torch.full((4,), 1 / 3),  # constant: no signal, std 0
        torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.9]),  # near constant
    ]
    chosen = []
    for n in sizes:  # each size takes the first group of that size not yet taken
        chosen.append(groups.pop(next(i for i, x in enumerate(groups) if len(x) == n)))
    rewards = torch.cat(chosen)
    b = len(rewards)
    lengths = torch.randint(1, R + 1, (b,), generator=g)
    mask = (torch.arange(R) < lengths[:, None]).long()
    response_mask = mask.clone()
    if holes:  # multi-turn: tool output inside the response is attended, not trained on
        response_mask[:, 1] = 0
        response_mask[torch.arange(b), lengths - 1] = 1
    scores = torch.zeros(b, R)
    scores[torch.arange(b), lengths - 1] = rewards  # verl's reward managers: the last token
    prompts = torch.full((b, 2), 5)
    responses = torch.where(mask.bool(), 9, 0)
    uid = np.array([f"prompt-{i}" for i, n in enumerate(sizes) for _ in range(n)], dtype=object)
    return verl_protocol.DataProto.from_single_dict(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([torch.ones(b, 2, dtype=torch.int64), mask], 1),
            "responses": responses,
            "response_mask": response_mask,
            "token_level_rewards": scores,
            "uid": uid,
        }
    )


def inputs(proto: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """posttrain's view of the same batch: per-answer reward and group id, via the codec."""
    td = to_layout(proto)
    k = LLM_LAYOUT_V1.key
    return td[k("reward")], td[k("group_id")], proto.batch["response_mask"].float()


def per_answer(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The answer's scalar advantage from verl's [B, R] output (0 off the mask)."""
    return (adv * mask).sum(-1) / mask.sum(-1)


def verl_run(name: str, proto: Any, **kw: Any) -> torch.Tensor:
    b = proto.batch
    out, _ = getattr(ca, name)(
        b["token_level_rewards"].clone(), b["response_mask"].float(),
        index=proto.non_tensor_batch["uid"], **kw,
    )  # fmt: skip
    return out  # type: ignore[no-any-return]


def split(gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the answers alone in their group, and of the rest."""
    alone = torch.bincount(gid)[gid] == 1
    return alone, ~alone


@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_matches_posttrain_except_a_lone_answer(normalize: bool) -> None:
    proto = batch()
    rewards, gid, mask = inputs(proto)
    verl = per_answer(
        verl_run("compute_grpo_outcome_advantage", proto, norm_adv_by_std_in_grpo=normalize), mask
    )
    vec = per_answer(
        verl_run(
            "compute_grpo_vectorized_outcome_advantage", proto, norm_adv_by_std_in_grpo=normalize
        ),
        mask,
    )
    ours = grpo_advantages(gid[:, None].tolist(), rewards, leave_one_out=False, normalize=normalize)
    alone, grouped = split(gid)
    assert torch.allclose(verl[grouped], ours["advantages"][grouped], atol=TOL, rtol=0)
    assert torch.allclose(vec, verl, atol=TOL, rtol=0)  # verl's two GRPOs agree
    # The constant group: no signal in either (verl: 0 / (0 + eps); posttrain: std 0).
    const = (rewards == 1 / 3).nonzero()[:4, 0]
    assert verl[const].abs().max() <= TOL
    assert ours["advantages"][const].abs().max() <= TOL
    # A lone answer: verl's baseline is 0 and its std 1, so it keeps its reward (over 1 + eps);
    # posttrain's baseline is the answer itself, so its advantage is 0.
    expect = rewards[alone] / (1 + 1e-6) if normalize else rewards[alone]
    assert torch.allclose(verl[alone], expect, atol=TOL, rtol=0)
    assert torch.equal(ours["advantages"][alone], torch.zeros_like(expect))
    # posttrain's NeMo-RL numerics (mean-square std) agree with verl's too, off a lone answer.
    nemo = grpo_advantage(gid, rewards, mask, leave_one_out=False, normalize=normalize)[:, 0]
    assert torch.allclose(nemo[grouped], verl[grouped], atol=TOL, rtol=0)


def test_rloo_matches_posttrain_leave_one_out_except_a_lone_answer() -> None:
    proto = batch()
    rewards, gid, mask = inputs(proto)
    loop = per_answer(verl_run("compute_rloo_outcome_advantage", proto), mask)
    vec = per_answer(verl_run("compute_rloo_vectorized_outcome_advantage", proto), mask)
    ours = grpo_advantages(gid[:, None].tolist(), rewards, leave_one_out=True, normalize=False)
    alone, grouped = split(gid)
    assert torch.allclose(loop[grouped], ours["advantages"][grouped], atol=TOL, rtol=0)
    assert torch.allclose(vec[grouped], ours["advantages"][grouped], atol=TOL, rtol=0)
    # A lone answer: verl's loop RLOO keeps its reward, its vectorized RLOO gives 0 (as
    # posttrain does): verl's two registered RLOOs disagree.
    assert torch.allclose(loop[alone], rewards[alone], atol=TOL, rtol=0)
    assert torch.equal(vec[alone], torch.zeros_like(vec[alone]))
    assert torch.equal(ours["advantages"][alone], torch.zeros_like(vec[alone]))


def bessel(mask: torch.Tensor) -> float:
    """verl whitens with the unbiased token variance, posttrain with the biased one."""
    n = float(mask.sum())
    return float((n / (n - 1)) ** 0.5)


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_differs_by_the_token_variance_estimator(holes: bool) -> None:
    proto = batch(holes=holes)
    rewards, gid, mask = inputs(proto)
    config = types.SimpleNamespace(gamma=1.0)
    b = proto.batch
    verl, _ = ca.compute_reinforce_plus_plus_outcome_advantage(
        b["token_level_rewards"].clone(), b["response_mask"].float(), config=config
    )
    ours = reinforce_plus_plus_advantage(gid, rewards, mask, minus_baseline=False)
    # Equal up to sqrt(N / (N - 1)) over the N trained tokens, and verl zeroes the rest.
    assert torch.allclose(verl, ours * mask / bessel(mask), atol=TOL, rtol=0)
    assert not torch.allclose(verl, ours * mask, atol=TOL, rtol=0)


def test_reinforce_plus_plus_baseline_differs_by_variance_and_a_lone_answer() -> None:
    proto = batch(sizes=(2, 3, 5, 4, 4))  # no lone answer: only the variance differs
    rewards, gid, mask = inputs(proto)
    verl = verl_run("compute_reinforce_plus_plus_baseline_outcome_advantage", proto)
    ours = reinforce_plus_plus_advantage(gid, rewards, mask, minus_baseline=True)
    assert torch.allclose(verl, ours * mask / bessel(mask), atol=TOL, rtol=0)
    # A lone answer: verl's baseline is 0 (it keeps its reward), posttrain's is the answer
    # itself (score 0); the whitening then moves every answer of the batch.
    proto = batch()
    rewards, gid, mask = inputs(proto)
    verl = verl_run("compute_reinforce_plus_plus_baseline_outcome_advantage", proto)
    ours = reinforce_plus_plus_advantage(gid, rewards, mask, minus_baseline=True)
    gap = (verl - ours * mask / bessel(mask)).abs().max().item()
    assert gap > 0.1, gap
