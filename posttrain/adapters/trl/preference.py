"""Preference datasets from a replay buffer's GRPO groups, for TRL's offline trainers.

A GRPO group is one prompt answered several times, each answer scored: exactly the material
of preference training. Items are sampled once (``batch_size`` of them), grouped by the
layout's ``group_id`` and compared by the layout's reward:

- :func:`dpo_dataset`: ``{"prompt", "chosen", "rejected", "margin"}`` pairs for ``DPOTrainer``
  (best against worst of each group, or every pair whose rewards differ by more than
  ``margin``);
- :func:`kto_dataset`: ``{"prompt", "completion", "label"}`` singles for ``KTOTrainer`` (label:
  the reward is above its group's mean);
- :func:`reward_dataset`: ``{"chosen_ids", "rejected_ids", "margin"}`` for ``RewardTrainer``
  (token ids, which RewardTrainer trains on without re-tokenizing).

DPO and KTO tokenize text themselves (TRL 1.16 has no pre-tokenized path for them): the
prompt text is the one that tokenizes back into the stored prompt ids (a BOS the tokenizer
adds is left out, as in ``prompt_dataset``) and a completion's text is what decoding the
whole sequence adds after the prompt's text, so ``prompt + completion`` re-tokenizes into
the stored ids for tokenizers whose decoding is consistent. Each helper returns a
``datasets.Dataset`` (a finite, map-style set: DPO's reference log-prob precomputation needs
one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from tensordict import TensorDictBase

from posttrain._args import positive_int
from posttrain._deps import optional_deps
from posttrain.adapters.trl.dataset import _added_specials, _prompt_text
from posttrain.adapters.trl.reward import sequences
from posttrain.contracts.buffer import ReplayBufferV1
from posttrain.contracts.keys import key_str
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout

Pairs = Literal["best_worst", "all"]


class _Answer:
    """One sampled item: its prompt ids, completion ids and reward."""

    __slots__ = ("completion", "prompt", "reward")

    def __init__(self, prompt: list[int], completion: list[int], reward: float) -> None:
        self.prompt, self.completion, self.reward = prompt, completion, reward


def _groups(buffer: ReplayBufferV1, batch_size: int, layout: Layout) -> list[list[_Answer]]:
    """The sampled items by group id (groups in first-seen order), each item split at its span;
    an item with no assistant token or a non-finite reward is left out."""
    batch: TensorDictBase = buffer.sample(positive_int("batch_size", batch_size))
    for field in ("reward", "group_id"):
        if batch.get(layout.key(field), None) is None:
            hint = (
                "; score the items first with a contract reward (hf_reward_model, trl_reward)"
                if field == "reward"
                else "; items from CaptureRollouts or TRLRolloutSource carry one"
            )
            raise KeyError(f"{field}: key {key_str(layout.key(field))} is not in the sample{hint}")
    rewards = batch.get(layout.key("reward")).reshape(-1).tolist()
    gids = batch.get(layout.key("group_id")).reshape(-1).tolist()
    _, toks, assts = sequences(batch, layout)
    groups: dict[int, list[_Answer]] = {}
    for i, (t, a, r, g) in enumerate(zip(toks, assts, rewards, gids, strict=True)):
        span = a.nonzero()[:, 0]
        if span.numel() == 0:
            continue  # nothing the model wrote: nothing to prefer
        first, last = int(span[0]), int(span[-1])
        if last - first + 1 != span.numel():
            raise ValueError(
                f"item {i}: the assistant mask is not one span (multi-turn); a (prompt, "
                "completion) pair cannot hold it"
            )
        if not math.isfinite(float(r)):
            continue  # unscored (NaN) or broken: it orders nothing and would poison a mean
        ans = _Answer(t[:first].tolist(), t[first : last + 1].tolist(), float(r))
        group = groups.setdefault(int(g), [])
        if group and group[0].prompt != ans.prompt:
            raise ValueError(
                f"group {int(g)}: items answer different prompts ({group[0].prompt[:8]} and "
                f"{ans.prompt[:8]}); a GRPO group is one prompt answered several times"
            )
        group.append(ans)
    return list(groups.values())


def _pairs(group: list[_Answer], pairs: Pairs, margin: float) -> Iterator[tuple[_Answer, _Answer]]:
    if pairs == "best_worst":
        best = max(group, key=lambda a: a.reward)
        worst = min(group, key=lambda a: a.reward)
        if best.reward - worst.reward > margin:
            yield best, worst
        return
    for a in group:
        for b in group:
            if a.reward - b.reward > margin:
                yield a, b


class _Texts:
    """Prompt and completion texts that re-tokenize into the stored ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.added = _added_specials(tokenizer)

    def prompt(self, ids: list[int]) -> str:
        text = _prompt_text(self.tok, ids, self.added)
        return text if text is not None else str(self.tok.decode(ids))

    def completion(self, prompt: list[int], completion: list[int]) -> str:
        # What the completion adds to the decoded prompt: keeps the separating space that a
        # separate decode of the completion loses ("t5 t6" + " t7", not "t5 t6t7").
        head = str(self.tok.decode(prompt))
        whole = str(self.tok.decode(prompt + completion))
        if whole.startswith(head):
            return whole[len(head) :]
        return str(self.tok.decode(completion))


Rows = Callable[[list[_Answer]], Iterable[tuple[Any, ...]]]


def _pair_rows(
    pairs: Pairs, margin: float, row: Callable[[_Answer, _Answer], tuple[Any, ...]]
) -> Rows:
    """A group's rows: ``row(better, worse)`` for each pair :func:`_pairs` chooses."""
    if pairs not in ("best_worst", "all"):
        raise ValueError(f"pairs: expected 'best_worst' or 'all', found {pairs!r}")
    if not margin >= 0:
        raise ValueError(f"margin: expected a number >= 0, found {margin!r}")
    return lambda group: (row(good, bad) for good, bad in _pairs(group, pairs, margin))


def _table(
    buffer: ReplayBufferV1, batch_size: int, layout: Layout, names: tuple[str, ...], rows_of: Rows
) -> Any:
    """One walk for every builder: sample once, group, and collect each group's rows by column."""
    with optional_deps():
        import datasets

    columns: dict[str, list[Any]] = {n: [] for n in names}
    for group in _groups(buffer, batch_size, layout):
        for row in rows_of(group):
            for n, v in zip(names, row, strict=True):
                columns[n].append(v)
    return datasets.Dataset.from_dict(columns)


def dpo_dataset(
    buffer: ReplayBufferV1,
    tokenizer: Any,
    batch_size: int,
    *,
    pairs: Pairs = "best_worst",
    margin: float = 0.0,
    layout: Layout = LLM_LAYOUT_V1,
) -> Any:
    """Chosen/rejected pairs from the GRPO groups of ``batch_size`` sampled items, for DPOTrainer.

    ``pairs="best_worst"``: one pair per group, its best and worst answer, kept when their
    rewards differ by more than ``margin``; ``pairs="all"``: every ordered pair of answers
    whose rewards differ by more than ``margin``. Rows ``{"prompt", "chosen", "rejected",
    "margin"}`` (``margin``: the reward difference).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> group = TensorDict({("tokens", "full"): torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]]),
        ...     ("masks", "all_attention_mask"): torch.ones(2, 4, dtype=torch.bool),
        ...     ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1]] * 2).bool(),
        ...     ("next", "reward"): torch.tensor([1.0, 0.0]), "group_id": torch.tensor([0, 0])}, [2])
        >>> rb = RingBuffer(2); _ = rb.extend(group)
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.adapters._hf import word_level_tokenizer
        >>> ds = dpo_dataset(rb, word_level_tokenizer(tiny_causal_lm().config), 2)
        >>> ds.column_names
        ['prompt', 'chosen', 'rejected', 'margin']
    """
    texts = _Texts(tokenizer)

    def row(good: _Answer, bad: _Answer) -> tuple[Any, ...]:
        return (
            texts.prompt(good.prompt),
            texts.completion(good.prompt, good.completion),
            texts.completion(bad.prompt, bad.completion),
            good.reward - bad.reward,
        )

    rows_of = _pair_rows(pairs, margin, row)
    return _table(buffer, batch_size, layout, ("prompt", "chosen", "rejected", "margin"), rows_of)


def kto_dataset(
    buffer: ReplayBufferV1,
    tokenizer: Any,
    batch_size: int,
    *,
    layout: Layout = LLM_LAYOUT_V1,
) -> Any:
    """Labelled answers from the GRPO groups of ``batch_size`` sampled items, for KTOTrainer.

    Rows ``{"prompt", "completion", "label"}``: ``label`` is ``True`` where the answer's reward
    is above its group's mean and ``False`` below it; answers at the mean (a group whose
    answers all scored the same) say nothing and are left out, as are answers whose reward is
    not finite (TRL's "unscored" NaN): the mean is over the group's scored answers.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> group = TensorDict({("tokens", "full"): torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]]),
        ...     ("masks", "all_attention_mask"): torch.ones(2, 4, dtype=torch.bool),
        ...     ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1]] * 2).bool(),
        ...     ("next", "reward"): torch.tensor([1.0, 0.0]), "group_id": torch.tensor([0, 0])}, [2])
        >>> rb = RingBuffer(2); _ = rb.extend(group)
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.adapters._hf import word_level_tokenizer
        >>> ds = kto_dataset(rb, word_level_tokenizer(tiny_causal_lm().config), 2)
        >>> ds.column_names
        ['prompt', 'completion', 'label']
    """
    texts = _Texts(tokenizer)

    def labelled(group: list[_Answer]) -> Iterator[tuple[Any, ...]]:
        mean = sum(a.reward for a in group) / len(group)
        for a in group:
            if a.reward != mean:
                yield (
                    texts.prompt(a.prompt),
                    texts.completion(a.prompt, a.completion),
                    a.reward > mean,
                )

    return _table(buffer, batch_size, layout, ("prompt", "completion", "label"), labelled)


def reward_dataset(
    buffer: ReplayBufferV1,
    batch_size: int,
    *,
    pairs: Pairs = "best_worst",
    margin: float = 0.0,
    layout: Layout = LLM_LAYOUT_V1,
) -> Any:
    """Token-id pairs from the GRPO groups of ``batch_size`` sampled items, for RewardTrainer.

    Rows ``{"chosen_ids", "rejected_ids", "margin"}``: prompt plus answer, as stored (no
    re-tokenizing: RewardTrainer trains on ``*_ids`` columns as they are); pairs as in
    :func:`dpo_dataset`. ``margin`` is the reward difference; RewardTrainer adds it to its
    loss when the column is present (``RewardConfig`` has no switch; drop the column to
    train without it).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> group = TensorDict({("tokens", "full"): torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]]),
        ...     ("masks", "all_attention_mask"): torch.ones(2, 4, dtype=torch.bool),
        ...     ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1]] * 2).bool(),
        ...     ("next", "reward"): torch.tensor([1.0, 0.0]), "group_id": torch.tensor([0, 0])}, [2])
        >>> rb = RingBuffer(2); _ = rb.extend(group)
        >>> reward_dataset(rb, 2).column_names
        ['chosen_ids', 'rejected_ids', 'margin']
    """

    def row(good: _Answer, bad: _Answer) -> tuple[Any, ...]:
        return good.prompt + good.completion, bad.prompt + bad.completion, good.reward - bad.reward

    rows_of = _pair_rows(pairs, margin, row)
    return _table(buffer, batch_size, layout, ("chosen_ids", "rejected_ids", "margin"), rows_of)


Trainer = Literal["dpo", "kto", "reward"]


def preference_dataset(
    buffer: ReplayBufferV1,
    trainer: Trainer,
    batch_size: int,
    *,
    tokenizer: Any = None,
    pairs: Pairs = "best_worst",
    margin: float = 0.0,
    layout: Layout = LLM_LAYOUT_V1,
) -> Any:
    """The GRPO groups of ``batch_size`` sampled items as a ``datasets.Dataset`` for ``trainer``.

    ``"dpo"``: chosen/rejected text pairs for ``DPOTrainer`` (:func:`dpo_dataset`); ``"kto"``:
    labelled answers for ``KTOTrainer`` (:func:`kto_dataset`); ``"reward"``: token-id pairs
    for ``RewardTrainer`` (:func:`reward_dataset`). ``tokenizer`` is needed for the text
    trainers (DPO, KTO); ``pairs`` and ``margin`` choose the pairs (DPO, reward).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from posttrain.reference_impls import RingBuffer
        >>> group = TensorDict({("tokens", "full"): torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]]),
        ...     ("masks", "all_attention_mask"): torch.ones(2, 4, dtype=torch.bool),
        ...     ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1]] * 2).bool(),
        ...     ("next", "reward"): torch.tensor([1.0, 0.0]), "group_id": torch.tensor([0, 0])}, [2])
        >>> rb = RingBuffer(2); _ = rb.extend(group)
        >>> preference_dataset(rb, "reward", 2).column_names
        ['chosen_ids', 'rejected_ids', 'margin']
    """
    if trainer == "reward":
        return reward_dataset(buffer, batch_size, pairs=pairs, margin=margin, layout=layout)
    if trainer not in ("dpo", "kto"):
        raise ValueError(f"trainer: expected 'dpo', 'kto' or 'reward', found {trainer!r}")
    if tokenizer is None:
        raise ValueError(
            f"tokenizer: {trainer.upper()}Trainer tokenizes text itself; pass the tokenizer "
            "the trainer will use (its processing_class)"
        )
    if trainer == "dpo":
        return dpo_dataset(buffer, tokenizer, batch_size, pairs=pairs, margin=margin, layout=layout)
    return kto_dataset(buffer, tokenizer, batch_size, layout=layout)
