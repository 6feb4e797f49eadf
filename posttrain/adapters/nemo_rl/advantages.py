"""NeMo-RL's advantage estimators, reproduced (``nemo_rl/algorithms/advantage_estimator.py``).

Followed at NeMo-RL commit 7ea279a and pinned by vectors its own functions produced
(``tests/data/nemo_rl_advantages.json``):

- :func:`baseline_and_std_per_prompt` is ``nemo_rl/algorithms/utils.py:
  calculate_baseline_and_std_per_prompt`` with its numerics: the group's mean and mean square
  are masked matmuls, and the std is ``sqrt((E[r^2] - E[r]^2) * n / (n - 1))``. That form
  cancels catastrophically on a near-constant group: rewards ``[1/3, 1/3, 1/3, 0.9]`` give
  the last sample a std of 1.06e-4 (the exact leave-one-out std is 0) and an advantage of
  5310.04, as NeMo-RL trains on;
- :func:`grpo_advantage` is ``GRPOAdvantageEstimator.compute_advantage`` ([B, S] from
  ``prompt_ids``, ``rewards`` and ``mask``); :func:`clip_advantages` is
  ``nemo_rl/algorithms/grpo.py:_clip_grpo_advantages``;
- :func:`reinforce_plus_plus_advantage` is ``ReinforcePlusPlusAdvantageEstimator.
  compute_advantage`` (optional group-mean baseline, optional KL in the reward, global
  whitening over the mask).

:func:`grpo_advantages` (per-sample, [B]) keeps its own exact-std numerics; use
:func:`grpo_advantage` where NeMo-RL's values are wanted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std, grouped by identical prompt rows, as NeMo-RL computes them.

    ``nemo_rl/algorithms/utils.py:calculate_baseline_and_std_per_prompt`` (7ea279a): a group
    with at most one valid sample gets its rewards as baseline and std 0; a NaN std (a
    negative variance's square root) becomes 0.

    Example:
        >>> p = torch.tensor([[7, 8]] * 4)
        >>> b, s = baseline_and_std_per_prompt(p, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.9]),
        ...                                    torch.ones(4))
        >>> f"{s[3].item():.4g}"
        '0.0001057'
    """
    if prompts.ndim == 1:  # NeMo-RL's prompts are rows (b, s); a [b] id vector is one column
        prompts = prompts.unsqueeze(-1)
    unique_prompts = torch.unique(prompts, dim=0)
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for i in range(len(unique_prompts)):
        idx = torch.arange(len(prompts), device=rewards.device)[
            (prompts == unique_prompts[i]).all(1)
        ]
        n = len(idx)
        if leave_one_out_baseline:
            matrix = (1 - torch.eye(n)).to(rewards.device)
        else:
            matrix = torch.ones((n, n)).to(rewards.device)
        if valid_mask[idx].sum() <= 1:
            baseline[idx] = rewards[idx]
            continue
        num_valid = valid_mask[idx].float().sum() - int(leave_one_out_baseline)
        mean = torch.matmul(matrix, rewards[idx] * valid_mask[idx]) / num_valid
        mean_sq = torch.matmul(matrix, torch.pow(rewards[idx], 2) * valid_mask[idx]) / num_valid
        baseline[idx] = mean
        std[idx] = ((mean_sq - mean.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
    return baseline, std


def grpo_advantage(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
) -> torch.Tensor:
    """``GRPOAdvantageEstimator.compute_advantage``: [B, S] advantages (``mask``'s shape).

    ``reward - baseline``, divided by ``std + 1e-6`` where ``std > 0`` when ``normalize``, then
    expanded along S (an expanded view, as NeMo-RL returns it).

    Example:
        >>> p = torch.tensor([[7, 8]] * 4)
        >>> a = grpo_advantage(p, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.9]), torch.ones(4, 3))
        >>> a.shape, round(a[3, 0].item(), 2)
        (torch.Size([4, 3]), 5310.04)
    """
    baseline, std = baseline_and_std_per_prompt(
        prompt_ids, rewards, torch.ones_like(rewards), leave_one_out_baseline=leave_one_out
    )
    adv = (rewards - baseline).unsqueeze(-1)
    if normalize:
        nz = std > 0
        adv[nz] = adv[nz] / (std.unsqueeze(-1)[nz] + 1e-6)
    return adv.expand(mask.shape)


def clip_advantages(
    advantages: torch.Tensor, low: float | None = None, high: float | None = None
) -> torch.Tensor:
    """``grpo.py:_clip_grpo_advantages``: clamp to ``[low, high]``; ``None`` leaves a side open.

    Example:
        >>> clip_advantages(torch.tensor([-2.0, 0.5, 3.0]), -1.0, None).tolist()
        [-1.0, 0.5, 3.0]
    """
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages


def _kl(
    logprobs: torch.Tensor,
    reference: torch.Tensor,
    kl_type: str,
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> torch.Tensor:
    """``nemo_rl/algorithms/utils.py:calculate_kl`` with its default clamps (no IS weights)."""
    logr = reference - logprobs
    if input_clamp is not None:
        logr = logr.clamp(min=-input_clamp, max=input_clamp)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = torch.square(logr) / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl_type: expected 'k1', 'k2' or 'k3', found {kl_type!r}")
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl


def reinforce_plus_plus_advantage(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    minus_baseline: bool = True,
    use_kl_in_reward: bool = False,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    logprobs_policy: torch.Tensor | None = None,
    logprobs_reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ReinforcePlusPlusAdvantageEstimator.compute_advantage``: [B, S], whitened over ``mask``.

    The KL term applies only when ``use_kl_in_reward`` and both log-prob tensors are given
    (NeMo-RL skips it silently otherwise).

    Example:
        >>> p = torch.tensor([[1], [1], [2], [2]])
        >>> a = reinforce_plus_plus_advantage(p, torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.ones(4, 2))
        >>> [round(x, 4) for x in a[:, 0].tolist()]
        [0.6325, -0.6325, 1.2649, -1.2649]
    """
    if minus_baseline:
        mean, _ = baseline_and_std_per_prompt(
            prompt_ids, rewards, torch.ones_like(rewards), leave_one_out_baseline=False
        )
        adv = rewards - mean
    else:
        adv = rewards
    adv = adv.unsqueeze(-1).expand(mask.shape)
    if use_kl_in_reward and logprobs_policy is not None and logprobs_reference is not None:
        adv = adv - kl_coef * _kl(logprobs_policy, logprobs_reference, kl_type)
    adv_mean = (adv * mask).sum() / mask.sum()
    adv_var = ((adv - adv_mean).pow(2) * mask).sum() / mask.sum()
    return (adv - adv_mean) * adv_var.clamp(min=1e-8).rsqrt()


def grpo_advantages(
    prompt_rows: Sequence[Sequence[int]],
    rewards: Sequence[float] | torch.Tensor,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    eps: float = 1e-6,
) -> dict[str, torch.Tensor]:
    """Baseline, standard deviation and advantage per sample, grouped by identical prompt.

    Standard deviations are unbiased (n - 1) and computed exactly (``Tensor.std``), not with
    NeMo-RL's mean-square form: on a near-constant group they differ (see
    :func:`grpo_advantage` for NeMo-RL's numbers). A group too small for one (one sample, or
    two with leave-one-out) has std 0 and its advantage is ``reward - baseline``. A sample
    alone in its group under leave-one-out has no other sample: its baseline is its own reward.

    Example:
        >>> out = grpo_advantages([[1], [1], [2]], [1.0, 0.0, 5.0], leave_one_out=False)
        >>> [round(a, 4) for a in out["advantages"].tolist()]
        [0.7071, -0.7071, 0.0]
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if len(prompt_rows) != r.numel():
        raise ValueError(
            f"rewards: expected one per prompt row ({len(prompt_rows)}), found {r.numel()}"
        )
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(prompt_rows):
        groups.setdefault(tuple(int(t) for t in row), []).append(i)
    baseline = torch.zeros_like(r)
    std = torch.zeros_like(r)
    for members in groups.values():
        g = r[members]
        for j, i in enumerate(members):
            others = torch.cat([g[:j], g[j + 1 :]]) if leave_one_out else g
            if others.numel() == 0:
                baseline[i] = r[i]
                continue
            baseline[i] = others.mean()
            std[i] = others.std(unbiased=True) if others.numel() > 1 else 0.0
    adv = r - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return {"baseline": baseline, "std": std, "advantages": adv}
