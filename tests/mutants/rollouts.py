"""Deliberately broken rollout sources: each must fail the suite with its requirement's id."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict

from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from posttrain.reference_impls import HFRolloutSource

__all__ = ["EXTRA_MUTANTS", "MUTANTS", "SHIFTED_MASKS"]

K = LLM_LAYOUT_V1.key


class _Edit(HFRolloutSource):
    def edit(self, batch: TensorDict) -> TensorDict:
        return batch

    def _generate(self) -> TensorDict:
        return self.edit(super()._generate())


class TrainsOnPrompt(_Edit):
    def edit(self, batch: TensorDict) -> TensorDict:
        batch.set(K("assistant_mask"), batch.get(K("attention_mask")).clone())
        return batch


class PrependsBos(_Edit):
    def edit(self, batch: TensorDict) -> TensorDict:
        n = batch.batch_size[0]
        out = TensorDict({}, batch_size=[n])
        for key in batch.keys(True, True):
            v = batch.get(key)
            if v.ndim == 2:
                fill = 1 if key == K("tokens") else (key == K("attention_mask"))
                first = (
                    torch.full((n, 1), fill, dtype=v.dtype)
                    if v.dtype != torch.float32
                    else torch.full((n, 1), float("nan"))
                )
                v = torch.cat([first, v], dim=1)
            out.set(key, v)
        return out


class StampsNextVersion(_Edit):
    def edit(self, batch: TensorDict) -> TensorDict:
        batch.set(K("policy_version"), batch.get(K("policy_version")) + 1)
        return batch


class VersionNeverMoves(HFRolloutSource):
    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        if weights is not None:
            self.policy.load_state_dict(dict(weights))


class GeneratesWithACopy(HFRolloutSource):
    """Snapshots the policy at construction: updates bump the version but never reach it."""

    def __init__(self, policy: Any, *args: Any, **kw: Any) -> None:
        super().__init__(copy.deepcopy(policy), *args, **kw)

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        self._version += 1


class OneBatchTooMany(HFRolloutSource):
    def __iter__(self) -> Iterator[TensorDict]:
        yield from super().__iter__()
        yield self._generate()


class IgnoresShutdown(HFRolloutSource):
    def shutdown(self) -> None:
        pass


class ShiftedLogProbs(_Edit):
    """log p(token_{t+1}) stored at t: the classic off-by-one alignment bug."""

    def edit(self, batch: TensorDict) -> TensorDict:
        lp = batch.get(K("sample_log_probs"))
        shifted = torch.cat([lp[:, 1:], torch.full_like(lp[:, :1], float("nan"))], dim=1)
        asst = batch.get(K("assistant_mask"))
        batch.set(K("sample_log_probs"), torch.where(asst, shifted.nan_to_num(-1.0), float("nan")))
        return batch


class OneGroupPerItem(_Edit):
    def edit(self, batch: TensorDict) -> TensorDict:
        batch.set(K("group_id"), torch.arange(batch.batch_size[0]))
        return batch


class MissesLastToken(_Edit):
    """The assistant mask stops one token short (the EOS or the last token of a cut response)."""

    def edit(self, batch: TensorDict) -> TensorDict:
        asst = batch.get(K("assistant_mask")).clone()
        last = asst.shape[1] - 1 - asst.flip(1).int().argmax(1)
        asst[torch.arange(asst.shape[0]), last] = False
        batch.set(K("assistant_mask"), asst)
        return batch


class MaskOnPredictingPositions(_Edit):
    """The mask shifted by -1: on the positions whose logits predict the generated tokens."""

    def edit(self, batch: TensorDict) -> TensorDict:
        asst = batch.get(K("assistant_mask"))
        batch.set(K("assistant_mask"), torch.cat([asst[:, 1:], asst[:, :1] & False], dim=1))
        return batch


class MaskShiftedRight(_Edit):
    """The mask shifted by +1: it misses the first generated token."""

    def edit(self, batch: TensorDict) -> TensorDict:
        asst = batch.get(K("assistant_mask"))
        batch.set(K("assistant_mask"), torch.cat([asst[:, :1] & False, asst[:, :-1]], dim=1))
        return batch


class VersionPerBatch(HFRolloutSource):
    """Counts batches as versions: the stamp rises with no new weights."""

    def _generate(self) -> TensorDict:
        out = super()._generate()
        self._version += 1
        return out


def _impl(req: str, cls: type[HFRolloutSource], **kw: Any) -> Implementation:
    kw.setdefault("capabilities", {"log_probs", "groups"})
    return Implementation(
        "rollout", partial(cls, num_samples=2), name=f"mutant-{req}-{cls.__name__}", **kw
    )


MUTANTS: dict[str, Implementation] = {
    "ROLL-001": _impl("ROLL-001", TrainsOnPrompt),
    "ROLL-002": _impl("ROLL-002", PrependsBos),
    "ROLL-003": _impl("ROLL-003", StampsNextVersion),
    "ROLL-004": _impl("ROLL-004", VersionNeverMoves),
    "ROLL-005": _impl("ROLL-005", GeneratesWithACopy),
    "ROLL-006": _impl("ROLL-006", OneBatchTooMany),
    "ROLL-007": _impl("ROLL-007", IgnoresShutdown),
    "ROLL-008": _impl("ROLL-008", ShiftedLogProbs),
    "ROLL-009": _impl("ROLL-009", OneGroupPerItem),
    "ROLL-010": _impl("ROLL-010", HFRolloutSource, capabilities={"ragged"}),
}
"""Requirement id -> a rollout source that breaks exactly that requirement."""

EXTRA_MUTANTS: list[tuple[str, Implementation]] = [
    ("ROLL-001", _impl("ROLL-001", MissesLastToken)),
    ("ROLL-001", _impl("ROLL-001", MaskOnPredictingPositions)),
    ("ROLL-001", _impl("ROLL-001", MaskShiftedRight)),
    ("ROLL-003", _impl("ROLL-003", VersionPerBatch)),
]
"""Further bugs one requirement must catch beyond its main mutant: (requirement id, mutant)."""

SHIFTED_MASKS: dict[int, Implementation] = {
    -1: _impl("ROLL-005", MaskOnPredictingPositions),
    1: _impl("ROLL-005", MaskShiftedRight),
}
"""Shift -> a source whose mask is shifted so: ROLL-005 alone must name the shift as the cause."""
