"""NeMo-RL's GRPO advantage estimator, reproduced (``nemo_rl/algorithms/advantage_estimator.py``).

``GRPOAdvantageEstimator`` groups samples by identical prompt rows; by default the baseline and
the standard deviation leave the sample itself out, and the advantage is divided by
``std + 1e-6`` only where ``std > 0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grpo_advantages(
    prompt_rows: Sequence[Sequence[int]],
    rewards: Sequence[float] | torch.Tensor,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    eps: float = 1e-6,
) -> dict[str, torch.Tensor]:
    """Baseline, standard deviation and advantage per sample, grouped by identical prompt.

    Standard deviations are unbiased (n - 1); a group too small for one (one sample, or two
    with leave-one-out) has std 0 and its advantage is ``reward - baseline``. A sample alone
    in its group under leave-one-out has no other sample: its baseline is its own reward.

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
