"""One-bug variants of a rollout source (contract ``rollout`` v1), written from
``specs/rollout-v1.md`` alone, to measure the conformance kit's reach.

Each variant subclasses a correct design of ``tests/independent/rollouts.py``
(``EagerPrefetchSource``: padded, log-probs, groups; ``LazyGeneratorSource``: ragged, a private
engine copy; ``LeftPaddedSource``: TRL's arrangement) and plants one bug of a kind real
systems have shipped, naming the requirement whose sentence it breaks. ``demo_<name>()``
shows the bug without the kit (True: the sentence fails on the variant and holds on the base).

Example:
    >>> from posttrain.testing import tiny_causal_lm
    >>> src = GroupsRepeatNotInterleaved(tiny_causal_lm(), [[5, 6], [7]], 1, max_new_tokens=1)
    >>> next(iter(src)).get("group_id").tolist()
    [0, 0, 1, 1]
    >>> src.shutdown()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from tests.independent import rollouts as ro
from tests.independent._greedy import greedy_decode

__all__ = ["BASES", "DEMOS", "VARIANTS"]

_K = LLM_LAYOUT_V1.key


class LeftPadPrefixAttention(ro.LeftPaddedSource):
    """BUG: TRL's arrangement (prompts left-padded, completions right-padded) with the
    attention mask derived as a prefix, ``arange(T) < end`` with ``end`` the row's last real
    token + 1 (NeMo-RL's ``input_lengths`` rule, which assumes right padding): the pad tokens
    in front of a short prompt are marked real. The assistant mask is right. Breaks ROLL-002
    ("The real tokens (attention mask True) before the first assistant token MUST be the
    prompt the source was given")."""

    def _generate(self) -> TensorDict:
        batch = super()._generate()
        att = batch.get(_K("attention_mask"))
        t = att.shape[1]
        end = t - att.flip(1).long().argmax(1)  # one past the last real token
        batch.set(_K("attention_mask"), torch.arange(t)[None, :] < end[:, None])
        return batch


class TruncatedPrompt(ro.LazyGeneratorSource):
    """BUG: prompts longer than ``max_prompt_length`` (here 4) are cut from the left, TRL's
    ``max_prompt_length`` with ``truncation_side="left"``: the model never sees the start of
    a long prompt, and the batch's prompt is not the one given. Breaks ROLL-002."""

    max_prompt_length = 4

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None,
        *,
        max_new_tokens: int,
    ) -> None:
        cut = [list(p)[-self.max_prompt_length :] for p in prompts]
        super().__init__(policy, cut, total_batches, max_new_tokens=max_new_tokens)


class NoneUpdateIgnored(ro.LazyGeneratorSource):
    """BUG: ``update_policy_weights_(None)`` ("re-read the policy's own") bumps the version
    but leaves the engine copy as it was: only explicit weights are loaded. A trainer that
    steps the shared policy in place and calls ``update_policy_weights_()`` gets batches
    stamped new from the old weights. Plausible (a local collector whose no-argument update
    assumes the policy is shared). Breaks ROLL-005 ("Batches generated after
    ``update_policy_weights_`` returns MUST come from the new weights")."""

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        if weights is None:
            with self._lock:
                self._engine_model()  # built, but not refreshed
                self._version += 1
            return
        super().update_policy_weights_(weights)


class GroupsRepeatNotInterleaved(ro.EagerPrefetchSource):
    """BUG: the prompts are repeated batch-wise (``prompts * n``: p0, p1, p0, p1) while the
    group ids assume ``repeat_interleave`` (p0, p0, p1, p1: ``i // n``), the confusion verl's
    ``DataProto.repeat(interleave=...)`` flag and TRL's ``RepeatSampler`` exist for: every
    group mixes two prompts. Breaks ROLL-009 ("Items generated from the same prompt MUST
    share a ``group_id`` and items from different prompts MUST NOT")."""

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None,
        *,
        max_new_tokens: int,
        group_size: int = 2,
    ) -> None:
        super().__init__(
            policy, prompts, total_batches, max_new_tokens=max_new_tokens, group_size=group_size
        )
        base = [[int(t) for t in p] for p in prompts]
        self._prompts = [list(p) for _ in range(group_size) for p in base]
        self._groups = [i // group_size for i in range(len(self._prompts))]


class LogProbsStoredBf16(ro.EagerPrefetchSource):
    """BUG: the behaviour log-probs are stored in the model's half precision (bfloat16) to
    save buffer memory and widened back to float32 in the batch: each is off by up to
    |log p|·2^-9 (0.008 at log p = -4), the training/inference log-prob mismatch reported
    against vLLM and SGLang bf16 rollouts (verl's and SkyRL's "rollout log-probs differ"
    issues). Breaks ROLL-008 (``sample_log_probs`` within 1e-4)."""

    def _generate(self) -> TensorDict:
        batch = super()._generate()
        lp = batch.get(_K("sample_log_probs"))
        batch.set(_K("sample_log_probs"), lp.to(torch.bfloat16).to(torch.float32))
        return batch


class TotalCountsItems(ro.EagerPrefetchSource):
    """BUG: the declared total is read as a number of items (TorchRL's ``total_frames``), so
    iteration stops once that many items were yielded: ``ceil(total / items per batch)``
    batches. Breaks ROLL-006 ("When a total is declared, iteration MUST stop after exactly
    that many batches")."""

    def _limit(self) -> int | None:
        if self._total is None:
            return None
        per = len(self._prompts)
        return -(-self._total // per)


class VersionInt32(ro.LazyGeneratorSource):
    """BUG: ``policy_version`` stamped as int32 (``torch.tensor(v, dtype=torch.int32)``, the
    dtype NeMo-RL gives ``input_lengths``), not the layout's int64: a buffer that validates
    the layout refuses the batch, and a concatenation with int64 stamps promotes or fails.
    Breaks ROLL-001 ("Every batch MUST meet the LLM layout v1")."""

    def _generate(self) -> LazyStackedTensorDict:
        batch = super()._generate()
        items = []
        for item in batch.tensordicts:
            item = item.clone()
            item.set(_K("policy_version"), item.get(_K("policy_version")).to(torch.int32))
            items.append(item)
        return LazyStackedTensorDict.lazy_stack(items, 0)


# ------------------------------------------------------------------------------------------
# declarations
# ------------------------------------------------------------------------------------------

_PREFETCH_CAPS = {"log_probs", "groups"}
_LAZY_CAPS = {"ragged", "log_probs"}


def _impl(cls: type[Any], caps: set[str]) -> Implementation:
    def factory(
        policy: Any, prompts: list[list[int]], total_batches: int | None, *, max_new_tokens: int
    ) -> Any:
        return cls(policy, prompts, total_batches, max_new_tokens=max_new_tokens)

    return Implementation(
        "rollout", factory, name=f"rollout-variants.{cls.__name__}", capabilities=caps
    )


BASES: dict[str, Implementation] = {}  # the bases are rollouts.CORRECT_ROLLOUT's designs

VARIANTS: dict[str, tuple[str, Implementation]] = {
    "left_pad_prefix_attention": ("ROLL-002", _impl(LeftPadPrefixAttention, _PREFETCH_CAPS)),
    "truncated_prompt": ("ROLL-002", _impl(TruncatedPrompt, _LAZY_CAPS)),
    "none_update_ignored": ("ROLL-005", _impl(NoneUpdateIgnored, _LAZY_CAPS)),
    "groups_repeat_not_interleaved": (
        "ROLL-009", _impl(GroupsRepeatNotInterleaved, _PREFETCH_CAPS)
    ),
    "log_probs_stored_bf16": ("ROLL-008", _impl(LogProbsStoredBf16, _PREFETCH_CAPS)),
    "total_counts_items": ("ROLL-006", _impl(TotalCountsItems, _PREFETCH_CAPS)),
    "version_int32": ("ROLL-001", _impl(VersionInt32, _LAZY_CAPS)),
}  # fmt: skip


# ------------------------------------------------------------------------------------------
# demos
# ------------------------------------------------------------------------------------------

_PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14]]


def _policy() -> Any:
    from posttrain.testing import tiny_causal_lm

    return tiny_causal_lm(vocab_size=64, seed=5)


def _first(cls: type[Any], policy: Any = None, total: int | None = 1) -> TensorDictBase:
    src = cls(policy if policy is not None else _policy(), _PROMPTS, total, max_new_tokens=3)
    try:
        return next(iter(src))
    finally:
        src.shutdown()


def _rows(batch: TensorDictBase) -> list[TensorDictBase]:
    if isinstance(batch, LazyStackedTensorDict):
        return list(batch.tensordicts)
    return [batch[i] for i in range(batch.batch_size[0])]


def _prompts_ok(batch: TensorDictBase, given: list[list[int]]) -> bool:
    """ROLL-002: the real tokens before the first assistant token are the prompt given."""
    seen = []
    for row in _rows(batch):
        tok, att = row.get(_K("tokens")), row.get(_K("attention_mask"))
        first = int(row.get(_K("assistant_mask")).long().argmax())
        seen.append(tok[:first][att[:first]].tolist())
    return all(s in given for s in seen) and all(p in seen for p in given)


def demo_left_pad_prefix_attention() -> bool:
    return _prompts_ok(_first(ro.LeftPaddedSource), _PROMPTS) and not _prompts_ok(
        _first(LeftPadPrefixAttention), _PROMPTS
    )


def demo_truncated_prompt() -> bool:
    return _prompts_ok(_first(ro.LazyGeneratorSource), _PROMPTS) and not _prompts_ok(
        _first(TruncatedPrompt), _PROMPTS
    )


def _new_weights_used(cls: type[Any]) -> bool:
    """ROLL-005 with a no-argument update after the policy was changed in place."""
    policy = _policy()
    src = cls(policy, _PROMPTS, None, max_new_tokens=3)
    try:
        it = iter(src)
        next(it)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.5, alpha=1.0)
        src.update_policy_weights_(None)
        batch = next(it)
        want = greedy_decode(policy, _PROMPTS, 3)
        for row, d, p in zip(_rows(batch), want, _PROMPTS, strict=True):
            lp = row.get(_K("sample_log_probs"))[len(p) : len(p) + len(d.log_probs)]
            if not torch.allclose(lp, torch.tensor(d.log_probs), atol=1e-4):
                return False
        return True
    finally:
        src.shutdown()


def demo_none_update_ignored() -> bool:
    return _new_weights_used(ro.LazyGeneratorSource) and not _new_weights_used(NoneUpdateIgnored)


def _groups_ok(batch: TensorDictBase) -> bool:
    """ROLL-009: same prompt <=> same group_id."""
    rows = _rows(batch)
    keys = []
    for row in rows:
        first = int(row.get(_K("assistant_mask")).long().argmax())
        att = row.get(_K("attention_mask"))
        keys.append(tuple(row.get(_K("tokens"))[:first][att[:first]].tolist()))
    gid = batch.get("group_id").tolist()
    n = len(rows)
    return all((keys[i] == keys[j]) == (gid[i] == gid[j]) for i in range(n) for j in range(n))


def demo_groups_repeat_not_interleaved() -> bool:
    return _groups_ok(_first(ro.EagerPrefetchSource)) and not _groups_ok(
        _first(GroupsRepeatNotInterleaved)
    )


def _log_probs_ok(cls: type[Any]) -> bool:
    """ROLL-008: sample_log_probs equal the policy's log-probs of the generated tokens."""
    policy = _policy()
    batch = _first(cls, policy)
    tok, att = batch.get(_K("tokens")), batch.get(_K("attention_mask"))
    asst = batch.get(_K("assistant_mask"))
    with torch.no_grad():
        logits = policy(input_ids=tok, attention_mask=att.long()).logits
    lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, tok[:, 1:, None])[..., 0]
    got = batch.get(_K("sample_log_probs"))[:, 1:].double()
    diff = torch.where(asst[:, 1:], (lp - got).abs(), torch.zeros_like(lp))
    return float(diff.max()) <= 1e-4


def demo_log_probs_stored_bf16() -> bool:
    return _log_probs_ok(ro.EagerPrefetchSource) and not _log_probs_ok(LogProbsStoredBf16)


def _count(cls: type[Any], total: int) -> int:
    src = cls(_policy(), _PROMPTS, total, max_new_tokens=2)
    try:
        return sum(1 for _ in src)
    finally:
        src.shutdown()


def demo_total_counts_items() -> bool:
    return _count(ro.EagerPrefetchSource, 3) == 3 and _count(TotalCountsItems, 3) != 3


def demo_version_int32() -> bool:
    def dtype(cls: type[Any]) -> torch.dtype:
        d: torch.dtype = _rows(_first(cls))[0].get(_K("policy_version")).dtype
        return d

    return dtype(ro.LazyGeneratorSource) == torch.int64 and dtype(VersionInt32) != torch.int64


DEMOS: dict[str, Callable[[], bool]] = {name: globals()[f"demo_{name}"] for name in VARIANTS}
