"""verl 0.9.1's registered policy losses as conformance rows, raw and adapted.

One row per registered loss mode, contract aggregation (verl's ``loss_agg_mode``) and side:
``verl-raw-<mode>-<aggregation>`` hands verl the layout's tensors as they are,
``verl-adapted-<mode>-<aggregation>`` goes through :class:`~posttrain.adapters.verl.loss.VerlLoss`'s
mapping (global counts included). Each row is also a module attribute (``RAW_VANILLA_TOKEN_MEAN``
...), so a failing requirement's repro command can name it. What each row fails, measured with
verl 0.9.1 on CPU, is declared in ``known_failures``; ``make losses-report`` publishes it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from posttrain.adapters.verl.loss import RATIOS, VERL_AGGREGATIONS, VerlLoss
from posttrain.contracts.implementation import Implementation

MODES = (
    "vanilla",
    "gspo",
    "sapo",
    "cispo",
    "gpg",
    "geo_mean",
    "clip_cov",
    "kl_cov",
    "dro",
    "dppo_tv",
    "dppo_kl",
    "bypass_mode",
)
"""verl 0.9.1's ``POLICY_LOSS_REGISTRY``, every one of which takes the registered signature."""

T_NORM = 16
"""The constant ``seq_mean_token_sum_norm`` divides by (verl's ``loss_scale_factor``)."""

_OPTIONS: dict[str, dict[str, Any]] = {"dro": {"dro_beta": 0.1}}
"""Options verl has no default for (``dro_beta`` is None: DRO refuses to run without it)."""

_CLIP: dict[str, dict[str, Any]] = {"vanilla": {"clip_epsilon": 0.2, "dual_clip": 3.0}}
"""verl's defaults (``clip_ratio`` 0.2, ``clip_ratio_c`` 3.0) for the loss that clips PPO-style;
the others clip a sequence ratio, a weight or a divergence: no ``clip`` capability."""

# Measured with verl 0.9.1 (scripts/publish_losses_report.py; docs/reports/losses.md says why).
KNOWN: dict[str, frozenset[str]] = {
    "verl-raw-vanilla-token-mean": frozenset({"LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-raw-vanilla-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-vanilla-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-vanilla-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-gspo-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-gspo-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-gspo-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-gspo-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    # verl's gspo is GSPO-token, sg(rho_seq) * exp(logp_t - sg(logp_t)): with a [B, T]
    # advantage varying along T each token's gradient is -A_t * rho * w_t, not the sequence
    # ratio's -rho * sum_t' w_t' A_t' / L (LOSS-021); with a [B] advantage the two agree.
    **{
        f"verl-adapted-gspo-{agg}": frozenset({"LOSS-021"})
        for agg in (
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
        )
    },
    "verl-raw-sapo-token-mean": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-adapted-sapo-token-mean": frozenset({"LOSS-003", "LOSS-016"}),
    "verl-raw-sapo-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-sapo-seq-mean-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-sapo-seq-mean-token-sum": frozenset({"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-adapted-sapo-seq-mean-token-sum": frozenset({"LOSS-003", "LOSS-016"}),
    "verl-raw-sapo-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-sapo-seq-mean-token-sum-norm": frozenset({"LOSS-003", "LOSS-016"}),
    "verl-raw-cispo-token-mean": frozenset({"LOSS-002", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-adapted-cispo-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-cispo-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-cispo-seq-mean-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-cispo-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-cispo-seq-mean-token-sum": frozenset({"LOSS-016"}),
    "verl-raw-cispo-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-cispo-seq-mean-token-sum-norm": frozenset({"LOSS-016"}),
    "verl-raw-gpg-token-mean": frozenset({"LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-raw-gpg-seq-mean-token-mean": frozenset({"LOSS-004", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-raw-gpg-seq-mean-token-sum": frozenset({"LOSS-004", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-raw-gpg-seq-mean-token-sum-norm": frozenset(
        {"LOSS-003", "LOSS-004", "LOSS-005", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-geo-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-geo-mean-token-mean": frozenset({"LOSS-003", "LOSS-016", "LOSS-017", "LOSS-021"}),
    "verl-raw-geo-mean-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-geo-mean-seq-mean-token-mean": frozenset({"LOSS-016", "LOSS-017"}),
    "verl-raw-geo-mean-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-geo-mean-seq-mean-token-sum": frozenset(
        {"LOSS-003", "LOSS-016", "LOSS-017", "LOSS-021"}
    ),
    "verl-raw-geo-mean-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-geo-mean-seq-mean-token-sum-norm": frozenset(
        {"LOSS-003", "LOSS-016", "LOSS-017", "LOSS-021"}
    ),
    "verl-raw-clip-cov-token-mean": frozenset(
        {"LOSS-002", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-clip-cov-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-clip-cov-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-clip-cov-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-raw-kl-cov-token-mean": frozenset(
        {"LOSS-002", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-kl-cov-token-mean": frozenset({"LOSS-021"}),
    "verl-raw-kl-cov-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-kl-cov-seq-mean-token-mean": frozenset({"LOSS-021"}),
    "verl-raw-kl-cov-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-kl-cov-seq-mean-token-sum": frozenset({"LOSS-021"}),
    "verl-raw-kl-cov-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-kl-cov-seq-mean-token-sum-norm": frozenset({"LOSS-021"}),
    "verl-raw-dro-token-mean": frozenset(
        {"LOSS-002", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-dro-token-mean": frozenset({"LOSS-021"}),
    "verl-raw-dro-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-dro-seq-mean-token-mean": frozenset({"LOSS-021"}),
    "verl-raw-dro-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-dro-seq-mean-token-sum": frozenset({"LOSS-021"}),
    "verl-raw-dro-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-dro-seq-mean-token-sum-norm": frozenset({"LOSS-021"}),
    "verl-raw-dppo-tv-token-mean": frozenset({"LOSS-002", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-adapted-dppo-tv-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-dppo-tv-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-dppo-tv-seq-mean-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-dppo-tv-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-dppo-tv-seq-mean-token-sum": frozenset({"LOSS-016"}),
    "verl-raw-dppo-tv-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-dppo-tv-seq-mean-token-sum-norm": frozenset({"LOSS-016"}),
    "verl-raw-dppo-kl-token-mean": frozenset({"LOSS-002", "LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-adapted-dppo-kl-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-dppo-kl-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-dppo-kl-seq-mean-token-mean": frozenset({"LOSS-016"}),
    "verl-raw-dppo-kl-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-dppo-kl-seq-mean-token-sum": frozenset({"LOSS-016"}),
    "verl-raw-dppo-kl-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015"}
    ),
    "verl-adapted-dppo-kl-seq-mean-token-sum-norm": frozenset({"LOSS-016"}),
    "verl-raw-bypass-mode-token-mean": frozenset({"LOSS-008", "LOSS-009", "LOSS-015"}),
    "verl-adapted-bypass-mode-token-mean": frozenset({"LOSS-017"}),
    "verl-raw-bypass-mode-seq-mean-token-mean": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-bypass-mode-seq-mean-token-mean": frozenset({"LOSS-017"}),
    "verl-raw-bypass-mode-seq-mean-token-sum": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-bypass-mode-seq-mean-token-sum": frozenset({"LOSS-017"}),
    "verl-raw-bypass-mode-seq-mean-token-sum-norm": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    ),
    "verl-adapted-bypass-mode-seq-mean-token-sum-norm": frozenset({"LOSS-017"}),
}
"""Row name -> what it fails, measured."""


def _factory(mode: str, aggregation: str, *, adapted: bool) -> Any:
    def make(policy: Any, **options: Any) -> VerlLoss:
        agg = options.pop("aggregation", aggregation)
        merged = {**_OPTIONS.get(mode, {}), **options}
        return VerlLoss(
            policy,
            mode,
            agg,
            adapted=adapted,
            t_norm=T_NORM if adapted and agg == "seq_mean_token_sum_norm" else None,
            **merged,
        )

    make.__name__ = f"{'adapted' if adapted else 'raw'}_verl_{mode}"
    return make


def row_name(mode: str, aggregation: str, *, adapted: bool) -> str:
    """The entry-point style name of one row.

    Example:
        >>> row_name("vanilla", "token_mean", adapted=True)
        'verl-adapted-vanilla-token-mean'
    """
    side = "adapted" if adapted else "raw"
    return f"verl-{side}-{mode.replace('_', '-')}-{aggregation.replace('_', '-')}"


def _row(mode: str, aggregation: str, *, adapted: bool) -> Implementation:
    name = row_name(mode, aggregation, adapted=adapted)
    caps = {"per_token_advantage"} | ({"global_counts"} if adapted else set())
    extras: dict[str, Any] = {"t_norm": T_NORM}
    if mode in _CLIP:
        caps.add("clip")
        extras.update(_CLIP[mode])
    shown = "".join(f", {k}={v}" for k, v in _OPTIONS.get(mode, {}).items())
    verl_agg = VERL_AGGREGATIONS[aggregation]
    return Implementation(
        "loss",
        partial(_factory(mode, aggregation, adapted=adapted), aggregation=aggregation),
        name=f"{'VerlLoss(' if adapted else ''}verl compute_policy_loss_{mode}"
        f"(loss_agg_mode={verl_agg!r}{shown}){')' if adapted else ''}",
        capabilities=caps,
        options={"aggregation": aggregation} | ({"ratio": RATIOS[mode]} if mode in RATIOS else {}),
        extras=extras,
        description="verl 0.9.1's registered policy loss with verl's ActorConfig, log-probs "
        "from the suite's policy. "
        + (
            "Adapted: mask position 0 cleared, values outside the mask zeroed, global counts "
            f"as batch_num_tokens / global_batch_size (dp_size 1), loss_scale_factor {T_NORM}."
            if adapted
            else "Raw: the layout's tensors as they are (advantage broadcast to [B, T]), "
            "global_batch_info empty (verl's single-batch defaults)."
        ),
        known_failures=KNOWN.get(name, frozenset()),
    )


ROWS: dict[str, Implementation] = {}
"""Every verl row by name."""

for _mode in MODES:
    for _agg in VERL_AGGREGATIONS:
        for _adapted in (False, True):
            _name = row_name(_mode, _agg, adapted=_adapted)
            ROWS[_name] = _row(_mode, _agg, adapted=_adapted)
            # A module attribute per row: the runner's repro command names it.
            globals()[_name.removeprefix("verl-").replace("-", "_").upper()] = ROWS[_name]
