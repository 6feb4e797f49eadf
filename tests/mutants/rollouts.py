"""Deliberately broken rollout sources: each must fail the suite with its requirement's id."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict

from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from posttrain.contracts.alignment import token_log_probs
from posttrain.reference_impls import HFRolloutSource

__all__ = ["CORRECT", "EXTRA_MUTANTS", "MUTANTS", "SHIFTED_MASKS"]

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
    """Loads new weights (checked first, as the reference does) but never bumps the version."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        version = self._version
        super().update_policy_weights_(weights)
        self._version = version


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


class StampsWhenYielded(HFRolloutSource):
    """Generates one batch ahead and stamps each batch when it is yielded: the batch made by the
    old weights before an update carries the new version."""

    def __iter__(self) -> Iterator[TensorDict]:
        if self._closed:
            raise RuntimeError("this rollout source was shut down")
        ahead = self._generate()
        while self.total_batches is None or self._batches < self.total_batches:
            batch, ahead = ahead, self._generate()
            batch.set(
                K("policy_version"), torch.full_like(batch.get(K("policy_version")), self._version)
            )
            yield batch
            self._batches += 1


class StampFrozen(HFRolloutSource):
    """Stamps every batch with the version of its first one: the new weights' batches carry the
    old version while ``policy_version`` rises."""

    _stamp: int | None = None

    def _generate(self) -> TensorDict:
        out = super()._generate()
        if self._stamp is None:
            self._stamp = self._version
        out.set(K("policy_version"), torch.full_like(out.get(K("policy_version")), self._stamp))
        return out


class MasksEosAsPad(_Edit):
    """Derives the masks as ``tokens != pad`` with pad == EOS: a generated EOS is masked out."""

    def edit(self, batch: TensorDict) -> TensorDict:
        real = batch.get(K("tokens")) != self.pad
        batch.set(K("attention_mask"), real)
        batch.set(K("assistant_mask"), batch.get(K("assistant_mask")) & real)
        return batch


class LeftPadded(HFRolloutSource):
    """Correct: TRL's arrangement, prompts left-padded then responses right-padded."""

    def _generate(self) -> TensorDict:
        out = super()._generate()
        att, asst = out.get(K("attention_mask")), out.get(K("assistant_mask"))
        plen = (att & ~asst).sum(-1)
        shift = int(plen.max()) - plen  # move each row right by what its prompt lacks
        width = att.shape[1] + int(shift.max())
        moved = TensorDict({}, batch_size=out.batch_size)
        for key in (K("tokens"), K("attention_mask"), K("assistant_mask"), K("sample_log_probs")):
            v = out.get(key)
            fill = self.pad if key == K("tokens") else (math.nan if v.is_floating_point() else 0)
            new = torch.full((v.shape[0], width), fill, dtype=v.dtype)
            for i in range(v.shape[0]):
                s = int(shift[i])
                new[i, s : s + v.shape[1]] = v[i]
            moved.set(key, new)
        moved.set(K("policy_version"), out.get(K("policy_version")))
        moved.set(K("group_id"), out.get(K("group_id")))
        return moved


class DropsPadIdFromPrompts(HFRolloutSource):
    """Takes a prompt token equal to the pad id for padding (TorchRL's TransformersWrapper
    masks as tokens != pad_token_id): the model never sees it, and the batch's prompt lacks it."""

    def __init__(self, policy: Any, prompts: list[list[int]], *args: Any, **kw: Any) -> None:
        super().__init__(policy, prompts, *args, **kw)
        self.prompts = [[t for t in p if t != self.pad] or p for p in self.prompts]


class NoneUpdateKeepsOldWeights(HFRolloutSource):
    """Generates with a private copy that only explicit weights refresh: after the policy is
    changed in place, ``update_policy_weights_(None)`` bumps the version and nothing else."""

    def __init__(self, policy: Any, *args: Any, **kw: Any) -> None:
        super().__init__(copy.deepcopy(policy), *args, **kw)


class LoadsThenRefusesUnknown(HFRolloutSource):
    """``load_state_dict(strict=True)`` as is: every known tensor is copied, then the unknown
    name raises, so the weights change under the old version."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        if weights is not None:
            self.policy.load_state_dict(dict(weights), strict=True)
        self._version += 1


class GeneratesBeforeCounting(HFRolloutSource):
    """A do-while loop: generates and yields a batch before it looks at the total, so a total
    of 0 yields one batch and every pass over a spent source one more."""

    def __iter__(self) -> Iterator[TensorDict]:
        if self._closed:
            raise RuntimeError("this rollout source was shut down")
        while True:
            yield self._generate()
            self._batches += 1
            if self.total_batches is not None and self._batches >= self.total_batches:
                return


class UpdateRestartsTheCount(HFRolloutSource):
    """Counts the total since the last ``update_policy_weights_``: an update gives a spent
    source a whole new budget."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        super().update_policy_weights_(weights)
        self._batches = 0


class ShutdownSeenByNewIteratorsOnly(HFRolloutSource):
    """Checks for shutdown when an iteration starts, never while it runs: an iterator taken
    before ``shutdown()`` goes on generating after it."""

    def __iter__(self) -> Iterator[TensorDict]:
        if self._closed:
            raise RuntimeError("this rollout source was shut down")
        return self._run()

    def _run(self) -> Iterator[TensorDict]:
        while self.total_batches is None or self._batches < self.total_batches:
            yield self._generate()
            self._batches += 1


class SpentSourceStopsSilently(HFRolloutSource):
    """Looks at the total before it looks at shutdown: once the total is spent, iterating a
    shut-down source ends without an error (TorchRL's LLMCollector does so)."""

    def __iter__(self) -> Iterator[TensorDict]:
        if self.total_batches is not None and self._batches >= self.total_batches:
            return iter(())
        return super().__iter__()


class _Regrouped(_Edit):
    """Numbers the groups by a key of each prompt instead of the prompt itself."""

    def key(self, prompt: list[int]) -> tuple[int, ...]:
        return tuple(prompt)

    def edit(self, batch: TensorDict) -> TensorDict:
        prompts = [p for p in self.prompts for _ in range(self.num_samples)]
        ids: dict[tuple[int, ...], int] = {}
        gids = [ids.setdefault(self.key(p), len(ids)) for p in prompts]
        batch.set(K("group_id"), torch.tensor(gids, dtype=torch.int64))
        return batch


class GroupsByDecodedText(_Regrouped):
    """Groups by the prompt with its special tokens (pad and EOS ids) skipped, as decoding
    with ``skip_special_tokens=True`` does: prompts that differ only in them share a group."""

    def key(self, prompt: list[int]) -> tuple[int, ...]:
        return tuple(t for t in prompt if t not in (self.pad, self.eos))


class GroupsByTruncatedPrompt(_Regrouped):
    """Groups by the prompt's first two tokens (a key cut to a fixed length): a prompt and
    its longer relatives share a group."""

    def key(self, prompt: list[int]) -> tuple[int, ...]:
        return tuple(prompt[:2])


class NoneUpdateKeepsVersion(HFRolloutSource):
    """Takes ``update_policy_weights_(None)`` for "nothing new": the policy changed in place is
    used, but the version stays where it was."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        if weights is not None:
            super().update_policy_weights_(weights)


class ScoresWithTheFirstWeights(HFRolloutSource):
    """Generates with the policy but computes ``sample_log_probs`` with a copy made at
    construction, which no update reaches."""

    def __init__(self, policy: Any, *args: Any, **kw: Any) -> None:
        super().__init__(policy, *args, **kw)
        self._scorer = copy.deepcopy(policy)

    def _generate(self) -> TensorDict:
        out = super()._generate()
        tokens, asst = out.get(K("tokens")), out.get(K("assistant_mask"))
        att = out.get(K("attention_mask")).long()
        with torch.no_grad():
            logits = self._scorer(input_ids=tokens, attention_mask=att).logits
        lp = torch.where(asst, token_log_probs(logits, tokens), float("nan"))
        out.set(K("sample_log_probs"), lp)
        return out


class RaggedMasksPadIdInPrompts(_Edit):
    """Ragged items (each its real tokens), whose prompt mask is ``tokens != pad_id``: a prompt
    token equal to the pad id is marked as padding."""

    def edit(self, batch: TensorDict) -> TensorDict:
        items = []
        for i in range(batch.batch_size[0]):
            n = int(batch.get(K("attention_mask"))[i].sum())
            item = TensorDict(
                {
                    key: batch.get(key)[i][:n] if batch.get(key).ndim == 2 else batch.get(key)[i]
                    for key in batch.keys(True, True)
                },
                batch_size=[],
            )
            prompt_pad = (item.get(K("tokens")) == self.pad) & ~item.get(K("assistant_mask"))
            item.set(K("attention_mask"), item.get(K("attention_mask")) & ~prompt_pad)
            items.append(item)
        return LazyStackedTensorDict.lazy_stack(items, 0)


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
    ("ROLL-001", _impl("ROLL-001", MasksEosAsPad)),
    ("ROLL-003", _impl("ROLL-003", StampsWhenYielded)),
    ("ROLL-003", _impl("ROLL-003", StampFrozen)),
    ("ROLL-002", _impl("ROLL-002", DropsPadIdFromPrompts)),
    ("ROLL-005", _impl("ROLL-005", NoneUpdateKeepsOldWeights)),
    ("ROLL-003", _impl("ROLL-003", LoadsThenRefusesUnknown)),
    ("ROLL-006", _impl("ROLL-006", GeneratesBeforeCounting)),
    ("ROLL-006", _impl("ROLL-006", UpdateRestartsTheCount)),
    ("ROLL-007", _impl("ROLL-007", ShutdownSeenByNewIteratorsOnly)),
    ("ROLL-007", _impl("ROLL-007", SpentSourceStopsSilently)),
    ("ROLL-009", _impl("ROLL-009", GroupsByDecodedText)),
    ("ROLL-009", _impl("ROLL-009", GroupsByTruncatedPrompt)),
    ("ROLL-004", _impl("ROLL-004", NoneUpdateKeepsVersion)),
    ("ROLL-008", _impl("ROLL-008", ScoresWithTheFirstWeights)),
    ("ROLL-010", _impl("ROLL-010", RaggedMasksPadIdInPrompts, capabilities={"ragged"})),
]
"""Further bugs one requirement must catch beyond its main mutant: (requirement id, mutant)."""

CORRECT: list[Implementation] = [
    Implementation(
        "rollout",
        partial(LeftPadded, num_samples=2),
        name="correct-LeftPadded",
        capabilities={"log_probs", "groups"},
    ),
]
"""Correct designs other than the reference that the suite must pass."""

SHIFTED_MASKS: dict[int, Implementation] = {
    -1: _impl("ROLL-005", MaskOnPredictingPositions),
    1: _impl("ROLL-005", MaskShiftedRight),
}
"""Shift -> a source whose mask is shifted so: ROLL-005 alone must name the shift as the cause."""
