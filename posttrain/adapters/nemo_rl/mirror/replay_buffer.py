"""The rules of NeMo-RL's async replay buffer (NVIDIA-NeMo/RL 7ea279a).

``nemo_rl/algorithms/async_utils/replay_buffer.py:ReplayBufferImpl`` keeps one entry per
prompt group: the weight version that generated it and the one it is meant to train. Its
``sample`` (:func:`take_for_step`, :func:`mean_age`), ``_is_valid_for_target``
(:func:`valid_for_target`) and ``load_state_dict`` (:func:`restore_plan`) decide which
entries a step takes, which are stale, and which survive a restore. These functions hold
those rules over any entries; :class:`posttrain.adapters.nemo_rl.replay_buffer.NemoAsyncReplayBuffer`
applies them to groups it keeps in a posttrain buffer.

Example:
    >>> valid_for_target(version=1, target=3, max_age_steps=1)
    False
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Any, Protocol, TypeVar

NEMO_GYM_TASK_INDEX_KEY = "_ng_task_index"
"""``nemo_rl/experience/interfaces.py:NEMO_GYM_TASK_INDEX_KEY`` (7ea279a)."""
NEXT_NEMO_GYM_TASK_INDEX_KEY = "next_ng_task_index"
"""``nemo_rl/experience/interfaces.py:NEXT_NEMO_GYM_TASK_INDEX_KEY`` (7ea279a)."""


_E = TypeVar("_E", bound="_Versioned")


class _Versioned(Protocol):
    version: int
    target: int


def take_for_step(
    entries: list[_E], n: int, current: int, max_age_steps: int
) -> tuple[list[_E], list[_E] | None]:
    """NeMo-RL's sampling rule for one training step: ``(entries left, entries taken)``.

    An entry generated with weights ``version`` for step ``target`` is too old once
    ``version < max(0, current - max_age_steps)``: it is dropped whatever the answer. The
    step takes its ``n`` earliest entries with ``target == current`` and ``version <=
    current``, or none at all (``None``: the trainer stalls until the rest arrive).

    Example:
        >>> from types import SimpleNamespace as E
        >>> held = [E(version=0, target=2), E(version=1, target=2), E(version=2, target=3)]
        >>> left, taken = take_for_step(held, 1, current=2, max_age_steps=1)
        >>> [(e.version, e.target) for e in left], [(e.version, e.target) for e in taken]
        ([(2, 3)], [(1, 2)])
    """
    floor = max(0, current - max_age_steps)
    alive = [e for e in entries if e.version >= floor]
    for_step = [e for e in alive if e.target == current and e.version <= current]
    if len(for_step) < n:
        return alive, None
    taken = {id(e) for e in for_step[:n]}
    return [e for e in alive if id(e) not in taken], for_step[:n]


def mean_age(taken: list[_E], current: int) -> float:
    """``avg_trajectory_age``: ``current`` less the mean generating version (as a float).

    Example:
        >>> from types import SimpleNamespace as E
        >>> mean_age([E(version=1), E(version=2), E(version=2)], 3)
        1.3333333333333333
    """
    return current - sum(e.version for e in taken) / len(taken)


def valid_for_target(version: int, target: int, max_age_steps: int | None) -> bool:
    """``ReplayBufferImpl._is_valid_for_target``."""
    if max_age_steps is None:
        return True
    return max(0, target - max_age_steps) <= version <= target


Row = tuple[Any, int, int, "int | None"]
"""A restored entry: (payload, generating version, target version, task index)."""


def restore_plan(
    rows: list[Row],
    last: int,
    max_size: int,
    drop_incomplete: bool,
    num_prompts_per_step: int | None,
    current_training_step: int | None,
    max_age_steps: int | None,
) -> tuple[list[Row], int]:
    """Which restored (payload, version, target, task) rows stay, and the new generation mark.

    The rule (what NeMo-RL 7ea279a's ``ReplayBufferImpl.load_state_dict`` leaves behind):

    - *fresh* rows: all, or with ``max_age_steps`` those whose version is valid for their
      target; a target is *short* when it has fewer than ``num_prompts_per_step`` fresh rows.
    - resuming (``current_training_step`` and ``num_prompts_per_step`` given): keep fresh
      rows aimed at ``current_training_step`` or later, without the short targets'
      rows when ``drop_incomplete``; the mark becomes ``current_training_step - 1``.
    - only ``num_prompts_per_step``: keep fresh rows of targets that are not short; if some
      target was short, the mark drops to one below the lowest kept target (never rises),
      or to -1 when nothing is kept.
    - otherwise: keep the fresh rows; the mark stays.
    - then at most ``max_size`` rows remain, in their order: the newest ones, or, when
      resuming from a step, the ones with the lowest targets (ties: the earliest).

    Example:
        >>> p = b"payload"
        >>> rows = [(p, 0, 1, None), (p, 1, 2, None), (p, 1, 2, None), (p, 2, 3, None)]
        >>> kept, mark = restore_plan(rows, 3, 8, False, 2, None, None)
        >>> [r[2] for r in kept], mark
        ([2, 2], 1)
    """
    fresh = [
        r for r in rows if max_age_steps is None or valid_for_target(r[1], r[2], max_age_steps)
    ]
    per_target = Counter(r[2] for r in fresh)
    short = (
        set()
        if num_prompts_per_step is None
        else {t for t, n in per_target.items() if n < num_prompts_per_step}
    )
    if current_training_step is not None and num_prompts_per_step is not None:
        unwanted = short if drop_incomplete else set()
        kept = [r for r in fresh if r[2] >= current_training_step and r[2] not in unwanted]
        last = current_training_step - 1
    else:
        kept = [r for r in fresh if r[2] not in short]
        if short:
            last = min(last, min(r[2] for r in kept) - 1) if kept else -1
    surplus = len(kept) - max_size
    if surplus <= 0:
        return kept, last
    if current_training_step is None:
        return kept[surplus:], last
    lowest = set(heapq.nsmallest(max_size, range(len(kept)), key=lambda i: (kept[i][2], i)))
    return [r for i, r in enumerate(kept) if i in lowest], last
