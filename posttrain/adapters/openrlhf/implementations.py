"""OpenRLHF 0.11.2's PolicyLoss as conformance rows, raw and adapted.

Rows: PPO (``policy_loss_type='ppo'``, clip 0.2), PPO with dual clip 3.0, and GSPO, each in
OpenRLHF's two aggregations (``token_level_loss`` True: token_mean, False:
seq_mean_token_mean). Each row is also a module attribute, so a repro command can name it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from posttrain.adapters.openrlhf.loss import OPENRLHF_AGGREGATIONS, OpenRLHFPolicyLoss
from posttrain.contracts.implementation import Implementation

VARIANTS: dict[str, dict[str, Any]] = {
    "ppo": {},
    "ppo-dual-clip": {"dual_clip": 3.0},
    "gspo": {"policy_loss_type": "gspo"},
}
"""Row variant -> PolicyLoss keyword arguments."""

# Measured with OpenRLHF 0.11.2 (scripts/publish_losses_report.py; docs/reports/losses.md):
# every raw row checks neither options nor fields and reads position 0 and values outside the
# mask as they are; the adapted GSPO token-mean row is OpenRLHF's own sequence-ratio form.
KNOWN: dict[str, frozenset[str]] = {
    f"openrlhf-raw-{variant}-{agg.replace('_', '-')}": frozenset(
        {"LOSS-001", "LOSS-008", "LOSS-009", "LOSS-015", "LOSS-021"}
    )
    for variant in VARIANTS
    for agg in OPENRLHF_AGGREGATIONS
} | {"openrlhf-adapted-gspo-token-mean": frozenset({"LOSS-003", "LOSS-016", "LOSS-021"})}
"""Row name -> what it fails, measured."""


def _factory(options: dict[str, Any], *, adapted: bool) -> Any:
    def make(policy: Any, aggregation: str = "token_mean", **kwargs: Any) -> OpenRLHFPolicyLoss:
        return OpenRLHFPolicyLoss(policy, aggregation, adapted=adapted, **{**options, **kwargs})

    make.__name__ = f"{'adapted' if adapted else 'raw'}_openrlhf_policy_loss"
    return make


ROWS: dict[str, Implementation] = {}
"""Every OpenRLHF row by name (``openrlhf-<raw|adapted>-<variant>-<aggregation>``)."""

for _variant, _opts in VARIANTS.items():
    for _agg in OPENRLHF_AGGREGATIONS:
        for _adapted in (False, True):
            _side = "adapted" if _adapted else "raw"
            _name = f"openrlhf-{_side}-{_variant}-{_agg.replace('_', '-')}"
            _clip = _variant != "gspo"
            _extras: dict[str, Any] = {"clip_epsilon": 0.2} if _clip else {}
            if "dual_clip" in _opts:
                _extras["dual_clip"] = _opts["dual_clip"]
            _shown = "".join(f", {k}={v!r}" for k, v in _opts.items())
            ROWS[_name] = Implementation(
                "loss",
                partial(_factory(_opts, adapted=_adapted), aggregation=_agg),
                name=f"{'OpenRLHFPolicyLoss(' if _adapted else ''}openrlhf PolicyLoss(token_level_"
                f"loss={OPENRLHF_AGGREGATIONS[_agg]}{_shown}){')' if _adapted else ''}",
                capabilities={"per_token_advantage"}
                | ({"global_counts"} if _adapted else set())
                | ({"clip"} if _clip else set()),
                options={"aggregation": _agg, "ratio": "token" if _clip else "sequence"},
                extras=_extras,
                description="OpenRLHF 0.11.2's PolicyLoss loaded from openrlhf/models/loss.py "
                "alone; log-probs from the suite's policy. "
                + (
                    "Adapted: mask position 0 cleared, values outside the mask zeroed, global "
                    "counts as batch_num_tokens / global_batch_size (dp_size 1)."
                    if _adapted
                    else "Raw: the layout's tensors as they are, no global counts."
                ),
                known_failures=KNOWN.get(_name, frozenset()),
            )
            # A module attribute per row: the runner's repro command names it.
            globals()[_name.removeprefix("openrlhf-").replace("-", "_").upper()] = ROWS[_name]
