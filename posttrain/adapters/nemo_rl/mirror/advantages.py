"""NeMo-RL's advantage estimators, from their specification (``nemo_rl/algorithms/advantage_estimator.py``).

Written from the math of NeMo-RL commit 7ea279a (the code is posttrain's own) and pinned by
vectors NeMo-RL's own functions produced (``tests/data/nemo_rl_advantages.json``; the
committed vectors are matched bit for bit on the CPU that produced them and within 1e-6
relative elsewhere, where vector kernels may round the mean-square std by one ULP; RE++ to
1e-6 absolute):

- :func:`baseline_and_std_per_prompt` gives the per-prompt statistics of
  ``nemo_rl/algorithms/utils.py:calculate_baseline_and_std_per_prompt``, including its
  mean-square std ``sqrt((E[r^2] - E[r]^2) * n / (n - 1))``. That form cancels
  catastrophically on a near-constant group: rewards ``[1/3, 1/3, 1/3, 0.9]`` give the last
  sample a std of 1.06e-4 (the exact leave-one-out std is 0) and an advantage of 5310.04, as
  NeMo-RL trains on;
- :func:`grpo_advantage` gives ``GRPOAdvantageEstimator.compute_advantage`` ([B, S] from
  ``prompt_ids``, ``rewards`` and ``mask``); :func:`clip_advantages` gives
  ``nemo_rl/algorithms/grpo.py:_clip_grpo_advantages``;
- :func:`reinforce_plus_plus_advantage` gives ``ReinforcePlusPlusAdvantageEstimator.
  compute_advantage`` (optional group-mean baseline, optional KL in the reward, global
  whitening over the mask).

:func:`grpo_advantages` (per-sample, [B], prompt rows of any length) shares their grouping
and baseline but takes the exact two-pass std; use :func:`grpo_advantage` where NeMo-RL's
values are wanted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain._kl import KL_ESTIMATORS, kl_estimate


def _group_layout(prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each sample's group (identical prompt rows) and its column in a [groups, width] table.

    Members keep their batch order along the row; ``width`` is the largest group's size.
    """
    rows = prompts.unsqueeze(-1) if prompts.ndim == 1 else prompts.reshape(len(prompts), -1)
    _, group = torch.unique(rows, dim=0, return_inverse=True)
    sizes = torch.bincount(group)
    order = torch.sort(group, stable=True).indices
    first = torch.cumsum(sizes, 0) - sizes  # where each group starts in ``order``
    column = torch.empty_like(group)
    column[order] = torch.arange(len(group), device=group.device) - first[group[order]]
    return group, column, int(sizes.max()) if len(group) else 0


def baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std over the samples sharing its prompt row, as NeMo-RL's.

    The specification (``calculate_baseline_and_std_per_prompt``, 7ea279a): samples are
    grouped by identical prompt rows (a [B] id vector is one column). Within a group only
    valid samples (``valid_mask``) contribute; ``n`` is the group's valid count, less one
    under leave-one-out, where a sample's statistics are taken over the group's *other*
    samples. The baseline is ``mean = S1 / n`` and the std is
    ``sqrt((S2 / n - mean**2) * n / (n - 1))`` (``S1``, ``S2``: sums of the contributing
    rewards and squared rewards), with NaN replaced by 0; that mean-square form cancels
    catastrophically on a near-constant group (see the module docstring). A group with at
    most one valid sample gets its own rewards as baseline and std 0.

    Here each group is laid out as one row of a table (``torch.unique`` + index ops); under
    leave-one-out a sample's sums are the exclusive prefix plus exclusive suffix sums of its
    row, so no sample's reward is added and then subtracted again.

    Example:
        >>> p = torch.tensor([[7, 8]] * 4)
        >>> b, s = baseline_and_std_per_prompt(p, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.9]),
        ...                                    torch.ones(4))
        >>> f"{s[3].item():.4g}"
        '0.0001057'
    """
    if len(rewards) == 0:
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    group, column, width = _group_layout(prompts.to(rewards.device))
    n_groups = int(group.max()) + 1
    weight = valid_mask.to(rewards.dtype)

    def sums(values: torch.Tensor) -> torch.Tensor:
        table = torch.zeros(n_groups, width, dtype=rewards.dtype, device=rewards.device)
        table[group, column] = values * weight
        if not leave_one_out_baseline:
            return table.sum(1)[group]
        zero = torch.zeros_like(table[:, :1])
        before = torch.cat([zero, table[:, :-1]], 1).cumsum(1)
        after = torch.cat([zero, table.flip(1)[:, :-1]], 1).cumsum(1).flip(1)
        return (before + after)[group, column]

    valid = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    valid = valid.index_add(0, group, weight)[group]
    n = valid - int(leave_one_out_baseline)
    mean = sums(rewards) / n
    mean_sq = sums(torch.pow(rewards, 2)) / n
    std = ((mean_sq - mean.square()) * (n / (n - 1))).sqrt().nan_to_num(0)
    alone = valid <= 1
    baseline = torch.where(alone, rewards, mean)
    return baseline, torch.where(alone, torch.zeros_like(std), std)


def grpo_advantage(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
) -> torch.Tensor:
    """``GRPOAdvantageEstimator.compute_advantage``: [B, S] advantages (``mask``'s shape).

    ``reward - baseline`` (every sample valid), divided by ``std + 1e-6`` where ``std > 0``
    when ``normalize``, then expanded along S (an expanded view, as NeMo-RL returns it).

    Example:
        >>> p = torch.tensor([[7, 8]] * 4)
        >>> a = grpo_advantage(p, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.9]), torch.ones(4, 3))
        >>> a.shape, round(a[3, 0].item(), 2)
        (torch.Size([4, 3]), 5310.04)
    """
    _, _, centred = _grpo(prompt_ids, rewards, leave_one_out, normalize, 1e-6, exact_std=False)
    return centred.unsqueeze(-1).expand(mask.shape)


def _grpo(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    leave_one_out: bool,
    normalize: bool,
    eps: float,
    *,
    exact_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO's baseline, std and advantage per sample (every sample valid), both public forms.

    ``exact_std`` replaces NeMo-RL's mean-square std by the two-pass one, the root of the mean
    squared deviation from the baseline over the same samples (n - 1 in the denominator).
    """
    baseline, std = baseline_and_std_per_prompt(
        prompts, rewards, torch.ones_like(rewards), leave_one_out_baseline=leave_one_out
    )
    if exact_std and len(rewards):
        group, column, width = _group_layout(prompts)
        table = torch.zeros(int(group.max()) + 1, width, dtype=rewards.dtype)
        present = torch.zeros(table.shape, dtype=torch.bool)
        table[group, column] = rewards
        present[group, column] = True
        others, kept = table[group], present[group]  # [B, width]: each sample's group
        if leave_one_out:
            kept = kept.clone()
            kept[torch.arange(len(group)), column] = False
        n = kept.sum(1).to(rewards.dtype)
        squares = torch.where(kept, (others - baseline[:, None]).square(), 0.0).sum(1)
        std = torch.where(n > 1, (squares / (n - 1).clamp(min=1)).sqrt(), 0.0)
    centred = rewards - baseline
    if normalize:
        centred = torch.where(std > 0, centred / (std + eps), centred)
    return baseline, std, centred


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
    """Per-token KL estimate of NeMo-RL's ``calculate_kl`` (default clamps, no IS weights).

    With ``x = reference - logprobs`` clamped to ``[-input_clamp, input_clamp]``: k1 is
    ``-x``, k2 is ``x**2 / 2``, k3 is ``exp(x) - 1 - x``; the estimate is then clamped to
    ``[-output_clamp, output_clamp]``.
    """
    if kl_type not in KL_ESTIMATORS:
        raise ValueError(f"kl_type: expected 'k1', 'k2' or 'k3', found {kl_type!r}")
    x = reference - logprobs
    if input_clamp is not None:
        x = x.clamp(-input_clamp, input_clamp)
    kl = kl_estimate(x, kl_type)
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


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

    The specification: the reward, less its prompt group's mean (all samples, no
    leave-one-out) when ``minus_baseline``, broadcast over S; less ``kl_coef`` times the
    per-token KL when ``use_kl_in_reward`` and both log-prob tensors are given (NeMo-RL skips
    it silently otherwise); then whitened with the mean and (biased) variance over the
    tokens ``mask`` selects, the variance floored at 1e-8.

    Example:
        >>> p = torch.tensor([[1], [1], [2], [2]])
        >>> a = reinforce_plus_plus_advantage(p, torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.ones(4, 2))
        >>> [round(x, 4) for x in a[:, 0].tolist()]
        [0.6325, -0.6325, 1.2649, -1.2649]
    """
    score = rewards
    if minus_baseline:
        score = (
            rewards
            - baseline_and_std_per_prompt(
                prompt_ids, rewards, torch.ones_like(rewards), leave_one_out_baseline=False
            )[0]
        )
    token_score = score.unsqueeze(-1).expand(mask.shape)
    if use_kl_in_reward and logprobs_policy is not None and logprobs_reference is not None:
        token_score = token_score - kl_coef * _kl(logprobs_policy, logprobs_reference, kl_type)
    tokens = mask.sum()
    centre = (token_score * mask).sum() / tokens
    spread = ((token_score - centre).square() * mask).sum() / tokens
    return (token_score - centre) / spread.clamp(min=1e-8).sqrt()


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
    # Prompt rows may differ in length: each distinct row becomes one group id.
    ids: dict[tuple[int, ...], int] = {}
    group = torch.tensor(
        [ids.setdefault(tuple(int(t) for t in row), len(ids)) for row in prompt_rows],
        dtype=torch.int64,
    )
    baseline, std, adv = _grpo(group, r, leave_one_out, normalize, eps, exact_std=True)
    return {"baseline": baseline, "std": std, "advantages": adv}
