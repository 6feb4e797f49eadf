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

_CLIP: dict[str, dict[str, Any]] = {
    "vanilla": {"clip_epsilon": 0.2, "dual_clip": 3.0},
    "gspo": {"clip_epsilon": 0.2},
    "cispo": {"clip_epsilon": 0.2},
}
"""verl's defaults (``clip_ratio_low``/``clip_ratio_high`` 0.2, ``clip_ratio_c`` 3.0) for the
losses that clip a ratio the contract names: vanilla PPO-style (LOSS-014), gspo its token
form's sequence-ratio value (LOSS-022), cispo its weight (LOSS-023). The others clip a
divergence or a covariance, or gate the ratio: no ``clip`` capability."""


def row_name(mode: str, aggregation: str, *, adapted: bool) -> str:
    """The entry-point style name of one row.

    Example:
        >>> row_name("vanilla", "token_mean", adapted=True)
        'verl-adapted-vanilla-token-mean'
    """
    side = "adapted" if adapted else "raw"
    return f"verl-{side}-{mode.replace('_', '-')}-{aggregation.replace('_', '-')}"


_RAW = "8 9 15"
"""What every raw row fails: it checks neither its options nor the batch's fields (LOSS-008,
LOSS-009, LOSS-015)."""

# Measured with verl 0.9.1 (scripts/publish_losses_report.py; docs/reports/losses.md says why).
# mode -> (raw, adapted): the LOSS numbers each side fails beyond _RAW (raw) or at all
# (adapted), one string for all four aggregations or four in VERL_AGGREGATIONS' order
# (token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm).
_MEASURED: dict[str, tuple[str | tuple[str, ...], str | tuple[str, ...]]] = {
    "vanilla": (("", "1 21", "1 21", "1 21"), ""),
    # verl's gspo is GSPO-token, sg(rho_seq) * exp(logp_t - sg(logp_t)), declared as ratio
    # gspo_token (loss 1.5): each token's gradient is its own -A_t * rho * w_t.
    "gspo": ("1 21 22", ""),
    # sapo (a sigmoid gate of r) and dppo_tv/dppo_kl (a truncated, detached ratio times log p)
    # are none of the contract's ratio forms: undeclared, LOSS-021 checks the token ratio (1.8).
    "sapo": ("1 21", ("3 16 21", "16 21", "3 16 21", "3 16 21")),
    # verl's cispo, -sg(clip(r)) * A * log p, declared as ratio cispo (loss 1.5).
    "cispo": (("2 21 23", "1 21 23", "1 21 23", "1 21 23"), ""),
    "gpg": (("", "4", "4", "3 4 5 21"), ""),
    # loss 1.6: LOSS-003's batch holds a row without assistant tokens, which geo_mean's
    # seq-mean-token-mean weighs; LOSS-017 splits with every term live, and KL-Cov picks the
    # tokens it penalises by their covariance within each micro-batch, so splits do not add up.
    "geo_mean": ("1 21", ("3 16 17 21", "3 16 17", "3 16 17 21", "3 16 17 21")),
    # loss 1.9: Clip-Cov zeroes the term of tokens drawn at random among those whose
    # covariance of log-prob and advantage falls in its band; after a training step some do,
    # so on LOSS-003's live policy such a token has no gradient at ratio 1.
    "clip_cov": (("2 21", "1 21", "1 21", "1 21"), "3"),
    "kl_cov": (("2 21", "1 21", "1 21", "1 21"), "17 21"),
    "dro": (("2 21", "1 21", "1 21", "1 21"), "21"),
    "dppo_tv": (("2 21", "1 21", "1 21", "1 21"), "16 21"),
    "dppo_kl": (("2 21", "1 21", "1 21", "1 21"), "16 21"),
    "bypass_mode": (("", "1 21", "1 21", "1 21"), "17"),
}


def _ids(numbers: str) -> frozenset[str]:
    return frozenset(f"LOSS-{int(n):03d}" for n in numbers.split())


KNOWN: dict[str, frozenset[str]] = {}
for _mode, _sides in _MEASURED.items():
    for _adapted, _fails in zip((False, True), _sides, strict=True):
        _per_agg = (_fails,) * len(VERL_AGGREGATIONS) if isinstance(_fails, str) else _fails
        for _agg, _numbers in zip(VERL_AGGREGATIONS, _per_agg, strict=True):
            _known = _ids(_numbers) | (frozenset() if _adapted else _ids(_RAW))
            if _known:
                KNOWN[row_name(_mode, _agg, adapted=_adapted)] = _known
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


def _users_loss(policy: Any, aggregation: str = "seq_mean_token_sum_norm", **options: Any) -> Any:
    return VerlLoss(policy, "vanilla", aggregation, adapted=True, t_norm=None, **options)


USERS_ROWS: dict[str, Implementation] = {
    "verl-users-vanilla-seq-mean-token-sum-norm": Implementation(
        "loss",
        partial(_users_loss, aggregation="seq_mean_token_sum_norm"),
        name="VerlLoss(verl compute_policy_loss_vanilla(loss_agg_mode='seq-mean-token-sum-norm'), "
        "loss_scale_factor unset)",
        capabilities={"per_token_advantage", "global_counts", "clip"},
        options={"aggregation": "seq_mean_token_sum_norm", "ratio": RATIOS["vanilla"]},
        extras={"t_norm": T_NORM, **_CLIP["vanilla"]},
        description="verl 0.9.1's vanilla loss as its trainer runs it: global counts as "
        "batch_num_tokens / global_batch_size (dp_size 1) and ActorConfig.loss_scale_factor at "
        "its default (None): agg_loss divides by the response tensor's width.",
        known_failures=frozenset({"LOSS-003", "LOSS-005", "LOSS-016", "LOSS-017", "LOSS-021"}),
    )
}
"""verl rows at verl's own defaults where the rows above set a value (``loss_scale_factor``)."""
for _name, _impl in USERS_ROWS.items():
    globals()[_name.removeprefix("verl-").replace("-", "_").upper()] = _impl
