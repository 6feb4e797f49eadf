"""The configurable policy loss's options: one frozen, validated dataclass."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from posttrain._kl import KL_ESTIMATORS
from posttrain.contracts.loss import AGGREGATIONS

RATIOS = ("token", "sequence", "on_policy", "none", "gspo_token", "cispo")
"""``ratio`` values (see :class:`PolicyLossOptions`).

Example:
    >>> RATIOS[0]
    'token'
"""

KL_GRADIENTS = ("pathwise", "score", "behaviour")
"""``kl_gradient`` values (see :class:`PolicyLossOptions`).

Example:
    >>> "score" in KL_GRADIENTS
    True
"""

IMPORTANCE_CORRECTIONS = (None, "plain", "tis", "icepop", "seq_mask_tis")
"""``importance_correction`` values (see :class:`PolicyLossOptions`).

Example:
    >>> IMPORTANCE_CORRECTIONS[2]
    'tis'
"""

SEQUENCE_RATIOS = ("sequence", "gspo_token")
"""The ratios taken per sequence (GSPO): importance weights are per sequence under them too."""


@dataclass(frozen=True)
class PolicyLossOptions:
    """Every option of :class:`~posttrain.policy_loss.PolicyLoss`, validated on construction.

    Notation: per token t of row i, m the assistant mask (position 0 excluded), log pi the
    policy's log-prob, log pi_old ``sample_log_probs`` (the PPO ratio's denominator),
    log pi_gen the sampler's (at ``generation_key``; ``sample_log_probs`` when unset),
    log pi_ref ``ref_log_probs``, A the advantage, r = exp(log pi - log pi_old), sg() stop
    gradient. Framework settings are the ones each option reproduces.

    ``aggregation`` (default ``"token_mean"``): how per-token terms x become one scalar,
    Σ w·x with w = m/N (``token_mean``), m/(B·L_i) (``seq_mean_token_mean``), m/B
    (``seq_mean_token_sum``), m/(B·t_norm) (``seq_mean_token_sum_norm``); N tokens, B rows
    holding one, L_i row i's tokens (:data:`posttrain.contracts.loss.AGGREGATIONS`). verl
    ``loss_agg_mode``; NeMo-RL ``token_level_loss`` (True: token_mean, False:
    seq_mean_token_mean); TRL ``loss_type`` (dapo, grpo, dr_grpo).

    ``t_norm`` (default None): the constant T_norm of ``seq_mean_token_sum_norm``, a positive
    int required there. TRL dr_grpo's ``max_completion_length``; verl's ``loss_scale_factor``.

    ``clip_epsilon`` (default 0.2): ε or (ε_low, ε_high); the surrogate is
    max(-A·r, -A·clip(r, 1 - ε_low, 1 + ε_high)). NeMo-RL ``ratio_clip_min`` /
    ``ratio_clip_max``; verl ``clip_ratio_low`` / ``clip_ratio_high``; TRL ``epsilon`` /
    ``epsilon_high``; TorchRL ``clip_epsilon``.

    ``dual_clip`` (default None): c > 1; where A < 0 the per-token loss is also capped at -A·c
    (Ye et al. 2020). NeMo-RL ``ratio_clip_c``; verl ``clip_ratio_c``.

    ``ratio`` (default ``"token"``): the ratio the surrogate clips: ``token`` r per token;
    ``sequence`` GSPO's exp(mean_t(log pi - log pi_old)) per row (NeMo-RL
    ``sequence_level_importance_ratios``); ``gspo_token`` sg(ρ_seq)·exp(log pi - sg(log pi))
    (verl ``gspo``); ``on_policy`` exactly 1 with the policy's gradient (NeMo-RL
    ``force_on_policy_ratio``); ``none`` REINFORCE's -A·log pi (NeMo-RL
    ``disable_ppo_ratio``); ``cispo`` CISPO's -A·sg(clip(r))·log pi, a clipped weight bounding
    the gradient without zeroing it (NeMo-RL ``use_cispo``; verl ``cispo``; no dual clip).

    ``kl_coef`` (default 0.0): β >= 0; with β > 0 the loss returns ``loss_kl_to_ref`` = β·Σ w·k
    and needs ``ref_log_probs``. NeMo-RL ``reference_policy_kl_penalty`` (0 under
    ``use_kl_in_reward``); verl ``kl_loss_coef``; TRL ``beta``.

    ``kl_estimator`` (default ``"k3"``): k of log ρ = log pi_ref - log pi: k1 = -log ρ,
    k2 = (log ρ)²/2, k3 = ρ - 1 - log ρ. NeMo-RL ``reference_policy_kl_type``; verl
    ``kl_loss_type`` (k1, mse = k2, low_var_kl = k3).

    ``kl_input_clamp`` / ``kl_output_clamp`` (default None): log ρ clamped to ±the first before
    the estimator, k to ±the second after it. NeMo-RL ``kl_input_clamp_value`` /
    ``kl_output_clamp_value``.

    ``kl_gradient`` (default ``"pathwise"``): how k is differentiated: as written
    (``pathwise``: verl, TRL), times exp(log pi - sg(log pi)) (``score``: value 1, adds the
    score-function term; NeMo-RL's default) or times exp(log pi - sg(log pi_gen))
    (``behaviour``: NeMo-RL ``use_on_policy_kl_approximation``).

    ``importance_correction`` (default None): the off-policy weight pi_old / pi_gen (per row
    under a sequence ratio) multiplying each token's loss: ``plain``; ``tis`` clamped to
    ``importance_bounds``; ``icepop`` zero outside them; ``seq_mask_tis`` a row zeroed when
    its geometric-mean weight is outside them. NeMo-RL ``use_importance_sampling_correction``
    and ``truncated_importance_sampling_type``.

    ``importance_bounds`` (default None): (low, high), 0 <= low <= high, high > 0, only with a
    truncating correction; ``tis`` takes low None as 0. NeMo-RL
    ``truncated_importance_sampling_ratio_min`` / ``truncated_importance_sampling_ratio``.

    ``generation_key`` (default None): where the batch holds log pi_gen as [B, T] floats.
    NeMo-RL's ``generation_logprobs``.

    ``entropy_coef`` (default 0.0): finite; ``loss_entropy`` = -coef·Σ w·H_t. verl
    ``entropy_coeff``; TorchRL ``entropy_coeff``.

    ``positive_nll_coef`` (default 0.0): >= 0; ``loss_positive_nll`` = coef times the mean of
    -log pi over the tokens of rows with ``reward`` > 0, this batch's own tokens (VAPO).
    NeMo-RL ``positive_example_nll_weight``.

    Example:
        >>> PolicyLossOptions(clip_epsilon=(0.2, 0.28)).clip
        (0.2, 0.28)
        >>> PolicyLossOptions(ratio="tokens")
        Traceback (most recent call last):
        ...
        ValueError: ratio: expected one of ['token', 'sequence', 'on_policy', 'none', 'gspo_token', 'cispo'], found 'tokens'
    """

    aggregation: str = "token_mean"
    t_norm: int | None = None
    clip_epsilon: float | tuple[float, float] = 0.2
    dual_clip: float | None = None
    ratio: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_input_clamp: float | None = None
    kl_output_clamp: float | None = None
    kl_gradient: str = "pathwise"
    importance_correction: str | None = None
    importance_bounds: tuple[float | None, float] | None = None
    generation_key: Any = None
    entropy_coef: float = 0.0
    positive_nll_coef: float = 0.0

    def __post_init__(self) -> None:
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        t = self.t_norm
        if self.aggregation == "seq_mean_token_sum_norm" and (
            not isinstance(t, int) or isinstance(t, bool) or t < 1
        ):
            raise ValueError(f"t_norm: seq_mean_token_sum_norm needs a positive int, found {t!r}")
        _clip_pair(self.clip_epsilon)
        _choice("ratio", self.ratio, RATIOS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("kl_gradient", self.kl_gradient, KL_GRADIENTS)
        _choice("importance_correction", self.importance_correction, IMPORTANCE_CORRECTIONS)
        _at_least("kl_coef", self.kl_coef, 0.0)  # NaN fails too: it would drop the KL term
        _at_least("positive_nll_coef", self.positive_nll_coef, 0.0)
        if not _real(self.entropy_coef) or not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef: expected a finite number, found {self.entropy_coef!r}")
        d = self.dual_clip
        if d is not None and (not _real(d) or not d > 1):
            raise ValueError(f"dual_clip: expected None or a number > 1, found {d!r}")
        if self.ratio == "cispo" and d is not None:
            raise ValueError(f"dual_clip: ratio 'cispo' takes no dual clip, found {d!r}")
        for name in ("kl_input_clamp", "kl_output_clamp"):
            v = getattr(self, name)
            if v is not None and (not _real(v) or not v >= 0):
                raise ValueError(f"{name}: expected None or a number >= 0, found {v!r}")
        object.__setattr__(
            self, "importance_bounds", _bounds(self.importance_correction, self.importance_bounds)
        )

    @property
    def clip(self) -> tuple[float, float]:
        """``clip_epsilon`` as (ε_low, ε_high).

        Example:
            >>> PolicyLossOptions(clip_epsilon=0.1).clip
            (0.1, 0.1)
        """
        return _clip_pair(self.clip_epsilon)

    @property
    def required(self) -> tuple[str, ...]:
        """The layout fields a batch must hold under these options.

        Example:
            >>> PolicyLossOptions(kl_coef=0.1).required
            ('sample_log_probs', 'advantage', 'ref_log_probs')
        """
        need = ["sample_log_probs", "advantage"]
        need += ["ref_log_probs"] if self.kl_coef > 0 else []
        need += ["reward"] if self.positive_nll_coef > 0 else []
        return tuple(need)


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy floats too


def _choice(name: str, value: object, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, found {value!r}")


def _at_least(name: str, value: object, low: float) -> None:
    if not _real(value) or not value >= low:  # type: ignore[operator]
        raise ValueError(f"{name}: expected a number >= {low:g}, found {value!r}")


def _clip_pair(eps: object) -> tuple[float, float]:
    pair: Any = (eps, eps) if _real(eps) else eps
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or not all(_real(x) for x in pair)
        or not (0 <= pair[0] <= 1 and pair[1] >= 0)
    ):
        raise ValueError(
            "clip_epsilon: expected a number or a (low, high) pair with 0 <= low <= 1 (1: no "
            f"lower bound) and high >= 0, found {eps!r}"
        )
    return float(pair[0]), float(pair[1])


def _bounds(kind: str | None, bounds: object) -> tuple[float, float] | None:
    """Validated (low, high) truncation bounds; ``tis`` defaults its low bound to 0."""
    if kind in (None, "plain"):
        if bounds is not None:
            raise ValueError(
                f"importance_bounds: only with a truncating importance_correction, found {bounds!r}"
            )
        return None
    ok = isinstance(bounds, tuple | list) and len(bounds) == 2
    lo: Any = bounds[0] if ok else None  # type: ignore[index]
    hi: Any = bounds[1] if ok else None  # type: ignore[index]
    if lo is None and kind == "tis":
        lo = 0.0
    if not ok or not _real(lo) or not _real(hi) or not 0 <= lo <= hi or not hi > 0:
        raise ValueError(
            f"importance_bounds: {kind} needs (low, high) with 0 <= low <= high and high > 0, "
            f"found {bounds!r}"
        )
    return float(lo), float(hi)
