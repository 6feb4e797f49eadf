"""NeMo-RL's loss configurations and metrics (``nemo_rl/algorithms/loss/loss_functions.py``, 7ea279a).

``ClippedPGLossConfig`` (:data:`CLIPPED_PG_DEFAULTS`, all 19 keys) mapped onto posttrain's
:class:`~posttrain.policy_loss.PolicyLossOptions` with the combinations ``ClippedPGLossFn``
refuses refused (:func:`clipped_pg_options`), the metrics ``ClippedPGLossFn.__call__``
returns as it reduces them (:func:`clipped_pg_metrics`), and ``DPOLossConfig``'s keys
(:data:`DPO_DEFAULTS`). Pinned by 60 cases NeMo-RL's own ``ClippedPGLossFn`` produced
(``tests/data/nemo_rl_clipped_pg_options.json``). The NeMo-RL ``LossFunction`` objects built
from them are the adapter's (:func:`posttrain.adapters.nemo_rl.loss.clipped_pg_loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain._kl import kl_estimate
from posttrain.contracts.loss import GlobalCounts
from posttrain.policy_loss import PolicyLoss, PolicyLossOptions
from posttrain.policy_loss.ratio import clamped, ratios

GENERATION_KEY = ("log_probs", "generation")
"""Where :class:`ContractAsNemoLoss` puts NeMo-RL's ``generation_logprobs`` (the sampler's;
``sample_log_probs`` holds ``prev_logprobs``, the PPO ratio's denominator): pass it as
``PolicyLoss(..., generation_key=GENERATION_KEY)`` for importance-sampling correction.

Example:
    >>> GENERATION_KEY
    ('log_probs', 'generation')
"""


CLIPPED_PG_DEFAULTS: dict[str, Any] = {
    "disable_ppo_ratio": False,
    "token_level_loss": True,
    "sequence_level_importance_ratios": False,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "use_kl_in_reward": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
    "use_on_policy_kl_approximation": False,
    "force_on_policy_ratio": False,
    "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}
"""NeMo-RL's ``ClippedPGLossConfig`` keys and defaults (commit 7ea279a), all 19.

Example:
    >>> len(CLIPPED_PG_DEFAULTS)
    19
"""


def clipped_pg_options(cfg: Mapping[str, Any]) -> tuple[PolicyLossOptions, str]:
    """:class:`~posttrain.policy_loss.PolicyLossOptions` and NeMo-RL loss type for a
    ``ClippedPGLossConfig``.

    Every key of :data:`CLIPPED_PG_DEFAULTS` maps to a posttrain option (missing keys take
    NeMo-RL's defaults; ``PolicyLossOptions`` names the key each option reproduces); an
    unknown key, or a combination NeMo-RL refuses or this mapping cannot express, raises
    ``ValueError`` naming it.

    Example:
        >>> opts, level = clipped_pg_options({"ratio_clip_c": 3.0, "token_level_loss": False})
        >>> opts.dual_clip, opts.aggregation, level
        (3.0, 'seq_mean_token_mean', 'sequence_level')
    """
    unknown = sorted(set(cfg) - set(CLIPPED_PG_DEFAULTS))
    if unknown:
        raise ValueError(f"ClippedPGLossConfig: unknown keys {unknown}")
    c = {**CLIPPED_PG_DEFAULTS, **cfg}
    token_level = bool(c["token_level_loss"])
    ratio = _clipped_pg_ratio(c, token_level)
    tis = c["truncated_importance_sampling_type"]
    if tis is not None and not c["use_importance_sampling_correction"]:
        raise ValueError(
            "truncated_importance_sampling_type: needs use_importance_sampling_correction=True"
        )
    correction: str | None = None
    bounds: tuple[float | None, float] | None = None
    if c["use_importance_sampling_correction"]:
        correction = "plain" if tis is None else str(tis).replace("-", "_")
        if tis is not None:
            bounds = (
                c["truncated_importance_sampling_ratio_min"],
                c["truncated_importance_sampling_ratio"],
            )
    opts = PolicyLossOptions(
        aggregation="token_mean" if token_level else "seq_mean_token_mean",
        clip_epsilon=(float(c["ratio_clip_min"]), float(c["ratio_clip_max"])),
        ratio=ratio,
        dual_clip=c["ratio_clip_c"],
        kl_coef=0.0 if c["use_kl_in_reward"] else float(c["reference_policy_kl_penalty"]),
        kl_estimator=c["reference_policy_kl_type"],
        kl_input_clamp=c["kl_input_clamp_value"],
        kl_output_clamp=c["kl_output_clamp_value"],
        kl_gradient="behaviour" if c["use_on_policy_kl_approximation"] else "score",
        importance_correction=correction,
        importance_bounds=bounds,
        generation_key=GENERATION_KEY,
        positive_nll_coef=float(c["positive_example_nll_weight"]),
    )
    return opts, "token_level" if token_level else "sequence_level"


def _clipped_pg_ratio(c: Mapping[str, Any], token_level: bool) -> str:
    """The ``ratio`` option of a ``ClippedPGLossConfig``, refusing what NeMo-RL refuses."""
    seq_ratio = bool(c["sequence_level_importance_ratios"])
    if seq_ratio and token_level:
        raise ValueError("sequence_level_importance_ratios: needs token_level_loss=False")
    ratio = "sequence" if seq_ratio else "token"
    for key, value in (("force_on_policy_ratio", "on_policy"), ("disable_ppo_ratio", "none")):
        if c[key] and seq_ratio:
            raise ValueError(f"{key} with sequence_level_importance_ratios is not mapped")
        if c[key] and ratio == "token":
            ratio = value
    if c["use_cispo"]:
        if ratio != "token" or c["ratio_clip_c"] is not None:
            raise ValueError(
                "use_cispo: needs a token ratio (none of disable_ppo_ratio, "
                "force_on_policy_ratio, sequence_level_importance_ratios) and ratio_clip_c "
                f"None (NeMo-RL's rule), found ratio {ratio!r}, ratio_clip_c "
                f"{c['ratio_clip_c']!r}"
            )
        ratio = "cispo"
    return ratio


def clipped_pg_metrics(
    loss: PolicyLoss,
    td: TensorDictBase,
    counts: GlobalCounts,
    out: TensorDictBase,
    data: Mapping[str, Any],
) -> dict[str, float]:
    """NeMo-RL's ``ClippedPGLossFn`` metrics of a :class:`~posttrain.policy_loss.PolicyLoss`
    on its layout batch ``td``: token sums over the global token count (extrema: this
    batch's), ``sampling_importance_ratio`` and ``is_oob_ratio`` as NeMo-RL reduces them.

    Example:
        >>> import torch
        >>> from posttrain.testing import llm_batch, tiny_causal_lm
        >>> loss, td = PolicyLoss(tiny_causal_lm(), kl_coef=0.1), llm_batch(2, 6, vocab_size=64)
        >>> m = clipped_pg_metrics(loss, td, GlobalCounts.of(td), loss(td), {"sample_mask": torch.ones(2)})
        >>> round(m["token_mult_prob_error"], 6), m["kl_penalty"] > 0
        (1.0, True)
    """
    o = loss.options
    with torch.no_grad():
        x = loss.inputs(td, counts)
        prox, gen, logp, mask = loss.proximal(x), x.gen, x.logp, x.mask
        ratio = ratios(logp, prox, x.fm, o.ratio)
        ratio_c = clamped(ratio, o.ratio, o.clip)
        tm = x.fm / max(counts.tokens, 1)
        mix = torch.log(0.5 * prox.exp() + 0.5 * gen.exp())
        # NeMo-RL's Jensen-Shannon term is k3-shaped whatever the KL type.
        js = 0.5 * kl_estimate(prox - mix) + 0.5 * kl_estimate(gen - mix)
        pick, pick_c = ratio[mask], ratio_c[mask]
        inf = float("inf")
        res = {
            "probs_ratio": (ratio * tm).sum(),
            "probs_ratio_clamped": (ratio_c * tm).sum(),
            "probs_ratio_min": pick.min() if pick.numel() else inf,
            "probs_ratio_max": pick.max() if pick.numel() else -inf,
            "probs_ratio_clamped_min": pick_c.min() if pick.numel() else inf,
            "probs_ratio_clamped_max": pick_c.max() if pick.numel() else -inf,
            "token_mult_prob_error": ((gen - prox).abs() * x.fm).exp().mul(tm).sum(),
            "gen_kl_error": (kl_estimate(prox - gen, o.kl_estimator) * tm).sum(),
            "policy_kl_error": (kl_estimate(gen - prox, o.kl_estimator) * tm).sum(),
            "js_divergence_error": (js * tm).sum(),
            "approx_entropy": -((logp - gen).exp() * logp * tm).sum(),
        }
        res.update(_importance_metrics(loss, x, prox, data))
    for key, term, coef in (
        ("kl_penalty", "loss_kl_to_ref", o.kl_coef),
        ("positive_nll_loss", "loss_positive_nll", o.positive_nll_coef),
    ):
        res[key] = float(out.get(term).detach()) / coef if term in out.keys() else 0.0  # noqa: SIM118
    return {k: float(v) for k, v in res.items()}


def _importance_metrics(
    loss: Any, x: Any, prox: torch.Tensor, data: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``sampling_importance_ratio`` (and ``is_oob_ratio`` under truncation) as NeMo-RL 7ea279a
    reduces them (``ClippedPGLossFn.__call__``)."""
    o = loss.options
    w, outside = loss.importance(x, prox)
    n_tok, n_seq = max(x.counts.tokens, 1), max(x.counts.sequences, 1)
    res: dict[str, torch.Tensor] = {}
    if o.importance_correction in ("tis", "icepop"):
        res["is_oob_ratio"] = (outside.to(x.fm.dtype) * x.fm).sum() / n_tok
    elif o.importance_correction == "seq_mask_tis":
        res["is_oob_ratio"] = (outside[:, 0] & x.mask.any(-1)).sum().to(x.fm.dtype) / n_seq
    if w.shape[-1] == 1:
        # Sequence ratios: NeMo-RL's masked_mean of a [B, 1] weight over the [B] sample_mask
        # broadcasts to the sum of every row's weight times sum(sample_mask).
        sampled = data["sample_mask"].to(w.dtype).sum()
        res["sampling_importance_ratio"] = w.sum() * sampled / n_seq
    else:
        res["sampling_importance_ratio"] = (w * x.fm).sum() / n_tok
    return res


DPO_DEFAULTS: dict[str, Any] = {
    "reference_policy_kl_penalty": 0.05,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.0,
    "preference_average_log_probs": False,
    "sft_average_log_probs": False,
}
"""NeMo-RL's ``DPOLossConfig`` keys and defaults (commit 7ea279a).

Example:
    >>> DPO_DEFAULTS["reference_policy_kl_penalty"]
    0.05
"""
