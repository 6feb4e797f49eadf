"""Rollout sources (contract ``rollout`` v1) written from ``specs/rollout-v1.md`` alone.

Two correct designs, neither the obvious generate-on-``next`` loop over the policy:

* :class:`EagerPrefetchSource`: generates one batch ahead in a background thread while the
  caller consumes the current one; padded batches (right padding), behaviour log-probs and
  GRPO groups (each prompt twice, one ``group_id`` per distinct prompt). A batch prefetched
  before an update is honest about its version, and is regenerated rather than yielded after
  the update (so no batch yielded after ``update_policy_weights_`` returned is stale). The
  total counts per iteration.
* :class:`LazyGeneratorSource`: a generator that generates only when pulled, with a private
  engine copy of the policy built on first use, ragged batches (a lazy stack of items, each its
  real tokens only) and one budget of ``total_batches`` for the source's whole life (TorchRL's
  ``total_frames`` semantics).

Then one-bug variants, each naming the requirement id it breaks (our reading of the spec).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from tests.independent._greedy import Decoded, greedy_decode
from tests.independent.generation import load_checked

__all__ = ["BUGGY_ROLLOUT", "CORRECT_ROLLOUT", "EagerPrefetchSource", "LazyGeneratorSource"]

_K = LLM_LAYOUT_V1.key
_WAIT_S = 60.0  # no wait on the prefetcher is unbounded


class SourceClosedError(RuntimeError):
    """Raised when a shut-down source is iterated."""


def _item_fields(prompt: Sequence[int], d: Decoded, width: int, lead: int) -> dict[Any, Any]:
    """One item's layout fields, right-padded to ``width``; the mask starts ``lead`` early."""
    seq = [*prompt, *d.tokens]
    p, n = len(prompt), len(seq)
    tokens = torch.zeros(width, dtype=torch.int64)
    tokens[:n] = torch.tensor(seq, dtype=torch.int64)
    attn = torch.zeros(width, dtype=torch.bool)
    attn[:n] = True
    asst = torch.zeros(width, dtype=torch.bool)
    asst[p - lead : n] = True
    lp = torch.zeros(width, dtype=torch.float32)
    lp[p:n] = torch.tensor(d.log_probs, dtype=torch.float32)
    return {
        _K("tokens"): tokens,
        _K("attention_mask"): attn,
        _K("assistant_mask"): asst,
        _K("sample_log_probs"): lp,
    }


def padded_batch(
    prompts: Sequence[Sequence[int]],
    decoded: Sequence[Decoded],
    version: int,
    group_ids: Sequence[int] | None = None,
    *,
    mask_lead: int = 0,
) -> TensorDict:
    """A right-padded LLM-layout batch of ``prompts`` and their continuations.

    Example:
        >>> td = padded_batch([[5, 6], [7]], [Decoded([9], [-0.5]), Decoded([3, 2], [-1.0, -2.0])], 4)
        >>> td.get(("tokens", "full")).tolist(), td.get("policy_version").tolist()
        ([[5, 6, 9], [7, 3, 2]], [4, 4])
    """
    width = max(len(p) + len(d.tokens) for p, d in zip(prompts, decoded, strict=True))
    rows = [_item_fields(p, d, width, mask_lead) for p, d in zip(prompts, decoded, strict=True)]
    data: dict[Any, Any] = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    data[_K("policy_version")] = torch.full((len(rows),), version, dtype=torch.int64)
    if group_ids is not None:
        data[_K("group_id")] = torch.tensor(list(group_ids), dtype=torch.int64)
    return TensorDict(data, batch_size=[len(rows)])


def ragged_batch(
    prompts: Sequence[Sequence[int]],
    decoded: Sequence[Decoded],
    version: int,
    *,
    mask_lead: int = 0,
) -> LazyStackedTensorDict:
    """A lazy stack of items, each exactly its real tokens (attention mask True throughout).

    Example:
        >>> td = ragged_batch([[5, 6], [7]], [Decoded([9], [-0.5]), Decoded([3, 2], [-1.0, -2.0])], 1)
        >>> [x.get(("tokens", "full")).tolist() for x in td.tensordicts]
        [[5, 6, 9], [7, 3, 2]]
    """
    items: list[TensorDictBase] = []
    for p, d in zip(prompts, decoded, strict=True):
        f = _item_fields(p, d, len(p) + len(d.tokens), mask_lead)
        f[_K("policy_version")] = torch.tensor(version, dtype=torch.int64)
        items.append(TensorDict(f, batch_size=[]))
    return LazyStackedTensorDict.lazy_stack(items, 0)


# --------------------------------------------------------------------------------------------
# Design 1: one batch ahead, in a background thread
# --------------------------------------------------------------------------------------------


class EagerPrefetchSource:
    """Generates batch k+1 while batch k is consumed; padded, with log-probs and groups.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = EagerPrefetchSource(tiny_causal_lm(), [[5, 6], [7]], 2, max_new_tokens=2)
        >>> [b.get("policy_version").tolist() for b in src]
        [[0, 0, 0, 0], [0, 0, 0, 0]]
        >>> src.shutdown()
    """

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None,
        *,
        max_new_tokens: int,
        group_size: int = 2,
    ) -> None:
        self._policy = policy
        self._total = total_batches
        self._max_new = max_new_tokens
        first: dict[tuple[int, ...], int] = {}
        self._prompts: list[list[int]] = []
        self._groups: list[int] = []
        for i, p in enumerate(prompts):
            key = tuple(int(t) for t in p)
            gid = first.setdefault(key, i)  # identical prompts are one group
            for _ in range(group_size):
                self._prompts.append(list(key))
                self._groups.append(gid)
        self._lock = threading.Lock()  # the policy's weights and the version, together
        self._version = 0
        self._closed = False
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="prefetch")

    @property
    def policy_version(self) -> int:
        return self._version

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._lock:  # waits for a prefetch in flight: no batch mixes two weights
            if weights is not None:  # None: the policy is used in place, already current
                load_checked(self._policy, weights)
            self._version += 1

    def shutdown(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __iter__(self) -> Iterator[TensorDictBase]:
        self._check_open()
        return self._batches()

    def _check_open(self) -> None:
        if self._closed:
            raise SourceClosedError("rollout source was shut down: it yields no more batches")

    def _generate(self) -> TensorDict:
        with self._lock:
            version = self._version
            decoded = greedy_decode(self._policy, self._prompts, self._max_new)
        return padded_batch(self._prompts, decoded, version, self._groups)

    def _fresh(self, batch: TensorDict) -> TensorDict:
        if int(batch.get("policy_version")[0]) != self._version:
            return self._generate()  # prefetched before an update: generate it again
        return batch

    def _limit(self) -> int | None:
        return self._total

    # The correct design does not care whether the prefetch or an update comes first; the
    # bugs planted below only show when the prefetch came first, so they wait for it.
    _settle_ahead = False

    def _batches(self) -> Iterator[TensorDictBase]:
        limit = self._limit()
        ahead = self._pool.submit(self._generate)
        n = 0
        while limit is None or n < limit:
            self._check_open()
            batch = self._fresh(ahead.result(timeout=_WAIT_S))
            n += 1
            if limit is None or n < limit:
                ahead = self._pool.submit(self._generate)
                if self._settle_ahead:  # the variants: the prefetch always beats an update
                    ahead.result(timeout=_WAIT_S)
            yield batch


# --------------------------------------------------------------------------------------------
# Design 2: lazy generator over a private engine, ragged batches, one budget for life
# --------------------------------------------------------------------------------------------


class LazyGeneratorSource:
    """Generates a ragged batch only when pulled, from its own copy of the policy.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = LazyGeneratorSource(tiny_causal_lm(), [[5, 6], [7]], 1, max_new_tokens=2)
        >>> [len(b.tensordicts) for b in src], list(src)
        ([2], [])
    """

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None,
        *,
        max_new_tokens: int,
    ) -> None:
        self._policy = policy
        self._prompts = [[int(t) for t in p] for p in prompts]
        self._total = total_batches
        self._max_new = max_new_tokens
        self._engine: Any = None  # built on first use
        self._lock = threading.Lock()
        self._version = 0
        self._produced = 0
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    def _engine_model(self) -> Any:
        if self._engine is None:
            self._engine = copy.deepcopy(self._policy)
        return self._engine

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._lock:
            src = self._policy.state_dict() if weights is None else weights
            load_checked(self._target(), src)
            self._version += 1

    def _target(self) -> Any:
        return self._engine_model()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._engine = None

    def __iter__(self) -> Iterator[TensorDictBase]:
        while self._total is None or self._produced < self._total:
            if self._closed:
                raise SourceClosedError("rollout source was shut down: it yields no more batches")
            batch = self._generate()
            self._produced += 1
            yield batch
        if self._closed:
            raise SourceClosedError("rollout source was shut down: it yields no more batches")

    def _stamp(self, version: int) -> int:
        return version

    def _generate(self) -> LazyStackedTensorDict:
        with self._lock:
            version = self._version
            decoded = greedy_decode(self._engine_model(), self._prompts, self._max_new)
        return ragged_batch(self._prompts, decoded, self._stamp(version), mask_lead=self._lead())

    def _lead(self) -> int:
        return 0


def left_padded_batch(
    prompts: Sequence[Sequence[int]],
    decoded: Sequence[Decoded],
    version: int,
    group_ids: Sequence[int] | None = None,
) -> TensorDict:
    """TRL's arrangement: prompts left-padded to the longest, then completions right-padded.

    The spec's mapping table gives exactly this for TRL (``prompt_ids`` left-padded then
    ``completion_ids`` right-padded); the attention mask marks the real tokens.

    Example:
        >>> td = left_padded_batch([[5, 6], [7]], [Decoded([9], [-0.5]), Decoded([3, 2], [-1.0, -2.0])], 0)
        >>> td.get(("tokens", "full")).tolist()
        [[5, 6, 9, 0], [0, 7, 3, 2]]
        >>> td.get(("masks", "all_attention_mask")).tolist()
        [[True, True, True, False], [False, True, True, True]]
    """
    p_len = max(len(p) for p in prompts)
    r_len = max(len(d.tokens) for d in decoded)
    b = len(prompts)
    tokens = torch.zeros(b, p_len + r_len, dtype=torch.int64)
    attn = torch.zeros(b, p_len + r_len, dtype=torch.bool)
    asst = torch.zeros_like(attn)
    lp = torch.zeros(b, p_len + r_len, dtype=torch.float32)
    for i, (p, d) in enumerate(zip(prompts, decoded, strict=True)):
        n = len(d.tokens)
        tokens[i, p_len - len(p) : p_len] = torch.tensor(list(p), dtype=torch.int64)
        tokens[i, p_len : p_len + n] = torch.tensor(d.tokens, dtype=torch.int64)
        attn[i, p_len - len(p) : p_len + n] = True
        asst[i, p_len : p_len + n] = True
        lp[i, p_len : p_len + n] = torch.tensor(d.log_probs, dtype=torch.float32)
    data: dict[Any, Any] = {
        _K("tokens"): tokens,
        _K("attention_mask"): attn,
        _K("assistant_mask"): asst,
        _K("sample_log_probs"): lp,
        _K("policy_version"): torch.full((b,), version, dtype=torch.int64),
    }
    if group_ids is not None:
        data[_K("group_id")] = torch.tensor(list(group_ids), dtype=torch.int64)
    return TensorDict(data, batch_size=[b])


class LeftPaddedSource(EagerPrefetchSource):
    """:class:`EagerPrefetchSource` yielding TRL-arranged batches (see
    :func:`left_padded_batch`): prompts left-padded, completions right-padded.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = LeftPaddedSource(tiny_causal_lm(), [[5, 6], [7]], 1, max_new_tokens=1)
        >>> next(iter(src)).get(("masks", "all_attention_mask"))[2].tolist()
        [False, True, True]
        >>> src.shutdown()
    """

    def _generate(self) -> TensorDict:
        with self._lock:
            version = self._version
            decoded = greedy_decode(self._policy, self._prompts, self._max_new)
        return left_padded_batch(self._prompts, decoded, version, self._groups)


# --------------------------------------------------------------------------------------------
# One-bug variants
# --------------------------------------------------------------------------------------------


class StampAtYieldSource(EagerPrefetchSource):
    """BUG (breaks ROLL-003): the prefetched batch is stamped when it is *yielded*, with the
    version current then, so a batch generated before an update by the old weights carries the
    new version (the prefetch is not regenerated either)."""

    _settle_ahead = True

    def _fresh(self, batch: TensorDict) -> TensorDict:
        batch.set("policy_version", torch.full_like(batch.get("policy_version"), self._version))
        return batch


class OneTooManySource(EagerPrefetchSource):
    """BUG (breaks ROLL-006): the prefetch loop counts from one but compares with ``<=``, so
    iteration yields ``total_batches + 1`` batches."""

    def _limit(self) -> int | None:
        return None if self._total is None else self._total + 1


class MaskFromLastPromptTokenSource(LazyGeneratorSource):
    """BUG (breaks ROLL-001): the assistant mask starts one position early, at the last prompt
    token (the classic off-by-one between "position t predicts t+1" and "position t holds
    token t"), so it covers a token that was not generated."""

    def _lead(self) -> int:
        return 1


class StaleStampSource(LazyGeneratorSource):
    """BUG (breaks ROLL-003): the version stamp is read once, when the source first generates,
    and reused: batches generated after an update by the new weights carry a stale version."""

    _first: int | None = None

    def _stamp(self, version: int) -> int:
        if self._first is None:
            self._first = version
        return self._first


class PolicyNotEngineSource(LazyGeneratorSource):
    """BUG (breaks ROLL-005): ``update_policy_weights_`` loads the weights into the trainer's
    policy object, not into the engine copy the generator runs, and bumps the version: batches
    after the update are stamped new but come from the old weights."""

    def _target(self) -> Any:
        return self._policy


class StalePrefetchYieldedSource(EagerPrefetchSource):
    """BUG (breaks ROLL-004, read as "batches yielded after the update"): a batch prefetched
    before an update keeps its honest old stamp (ROLL-003 holds) but is still yielded after the
    update, so the first batch the caller gets after ``update_policy_weights_`` is stamped no
    higher than before. (ROLL-005 speaks of batches *generated* after the update; ROLL-004 of
    *later* batches, which we read as later yielded.)"""

    _settle_ahead = True

    def _fresh(self, batch: TensorDict) -> TensorDict:
        return batch


class BosPrependSource(LazyGeneratorSource):
    """BUG (breaks ROLL-002): the source prepends BOS to every prompt that lacks it (what a
    chat template plus ``add_special_tokens=True`` does twice over), so the tokens before the
    first assistant token are not the prompt it was given."""

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None,
        *,
        max_new_tokens: int,
    ) -> None:
        bos = int(getattr(policy.config, "bos_token_id", 1) or 1)
        fixed = [p if list(p[:1]) == [bos] else [bos, *p] for p in prompts]
        super().__init__(policy, fixed, total_batches, max_new_tokens=max_new_tokens)


class ShiftedLogProbsSource(EagerPrefetchSource):
    """BUG (breaks ROLL-008): ``sample_log_probs`` are written one position early (at the
    position whose logits predicted the token, HF's convention, instead of the token's own
    position, the layout's), so each generated token carries its successor's log-prob."""

    def _generate(self) -> TensorDict:
        batch = super()._generate()
        lp = batch.get(_K("sample_log_probs"))
        batch.set(_K("sample_log_probs"), torch.roll(lp, -1, dims=-1))
        return batch


class RowGroupsSource(EagerPrefetchSource):
    """BUG (breaks ROLL-009): ``group_id`` is the row index, so the two responses to the same
    prompt land in different groups (every GRPO advantage becomes zero)."""

    def _generate(self) -> TensorDict:
        batch = super()._generate()
        batch.set(_K("group_id"), torch.arange(batch.batch_size[0], dtype=torch.int64))
        return batch


class PaddedRaggedSource(LazyGeneratorSource):
    """BUG (breaks ROLL-010): declares ``ragged`` but pads every item to the batch's longest,
    with the attention mask False on the padding."""

    def _generate(self) -> LazyStackedTensorDict:
        with self._lock:
            version = self._version
            decoded = greedy_decode(self._engine_model(), self._prompts, self._max_new)
        dense = padded_batch(self._prompts, decoded, version)
        return LazyStackedTensorDict.lazy_stack([dense[i] for i in range(dense.batch_size[0])], 0)


class EmptyAfterShutdownSource(EagerPrefetchSource):
    """BUG (breaks ROLL-007): iterating a shut-down source yields nothing instead of raising,
    so a trainer loop over it ends quietly as if the run were done."""

    def __iter__(self) -> Iterator[TensorDictBase]:
        if self._closed:
            return iter(())
        return self._batches()


class EosAsPadSource(EagerPrefetchSource):
    """BUG (breaks ROLL-001): the pad token is set to EOS and the masks are derived as
    ``tokens != pad``, so a generated EOS is masked out of the attention and assistant masks
    (the model never learns to stop). The classic ``tokenizer.pad_token = tokenizer.eos_token``
    trap: "the model never learn to generate EOS tokens ... the pad token / eos token
    corresponds to attention mask = 0" (https://github.com/huggingface/trl/issues/1623), still
    being fixed in 2026 (https://github.com/huggingface/trl/pull/6357, GKD/GOLD)."""

    def _generate(self) -> TensorDict:
        batch = super()._generate()
        eos = int(self._policy.config.eos_token_id)
        tokens = batch.get(_K("tokens"))
        real = batch.get(_K("attention_mask")) & (tokens != eos)
        batch.set(_K("tokens"), torch.where(batch.get(_K("attention_mask")), tokens, eos))
        batch.set(_K("attention_mask"), real)
        batch.set(_K("assistant_mask"), batch.get(_K("assistant_mask")) & real)
        return batch


class ShutdownOnceSource(LazyGeneratorSource):
    """BUG (breaks ROLL-007): a second ``shutdown()`` raises ("already shut down") instead of
    doing nothing, so a ``finally: src.shutdown()`` after an error path crashes."""

    def shutdown(self) -> None:
        if self._closed:
            raise RuntimeError("shutdown: the source is already shut down")
        super().shutdown()


def _impl(cls: type[Any], caps: set[str]) -> Implementation:
    def factory(
        policy: Any, prompts: list[list[int]], total_batches: int | None, *, max_new_tokens: int
    ) -> Any:
        return cls(policy, prompts, total_batches, max_new_tokens=max_new_tokens)

    return Implementation("rollout", factory, name=f"independent.{cls.__name__}", capabilities=caps)


_PREFETCH_CAPS = {"log_probs", "groups"}
_LAZY_CAPS = {"ragged", "log_probs"}

CORRECT_ROLLOUT: dict[str, Implementation] = {
    "eager_prefetch": _impl(EagerPrefetchSource, _PREFETCH_CAPS),
    "lazy_generator": _impl(LazyGeneratorSource, _LAZY_CAPS),
    "left_padded": _impl(LeftPaddedSource, _PREFETCH_CAPS),
}

# name -> (implementation, requirement id the bug breaks)
BUGGY_ROLLOUT: dict[str, tuple[Implementation, str]] = {
    "stamp_at_yield": (_impl(StampAtYieldSource, _PREFETCH_CAPS), "ROLL-003"),
    "one_too_many": (_impl(OneTooManySource, _PREFETCH_CAPS), "ROLL-006"),
    "mask_from_last_prompt_token": (_impl(MaskFromLastPromptTokenSource, _LAZY_CAPS), "ROLL-001"),
    "stale_stamp": (_impl(StaleStampSource, _LAZY_CAPS), "ROLL-003"),
    "policy_not_engine": (_impl(PolicyNotEngineSource, _LAZY_CAPS), "ROLL-005"),
    "stale_prefetch_yielded": (_impl(StalePrefetchYieldedSource, _PREFETCH_CAPS), "ROLL-004"),
    "bos_prepend": (_impl(BosPrependSource, _LAZY_CAPS), "ROLL-002"),
    "shifted_log_probs": (_impl(ShiftedLogProbsSource, _PREFETCH_CAPS), "ROLL-008"),
    "row_groups": (_impl(RowGroupsSource, _PREFETCH_CAPS), "ROLL-009"),
    "padded_ragged": (_impl(PaddedRaggedSource, _LAZY_CAPS), "ROLL-010"),
    "empty_after_shutdown": (_impl(EmptyAfterShutdownSource, _PREFETCH_CAPS), "ROLL-007"),
    "eos_as_pad": (_impl(EosAsPadSource, _PREFETCH_CAPS), "ROLL-001"),
    "shutdown_once": (_impl(ShutdownOnceSource, _LAZY_CAPS), "ROLL-007"),
}
