"""Round-three blind one-bug rollout sources, written from ``specs/rollout-v1.md`` alone.

Each variant subclasses a correct design of :mod:`tests.independent.rollouts`
(``EagerPrefetchSource``: padded, log-probs, groups; ``LazyGeneratorSource``: ragged, a
private engine copy, one budget for life) and plants one bug, naming the requirement whose
sentence it breaks. ``DEMOS[name]()`` shows the bug without the kit (True when the sentence
fails on the variant). Run by tests/conformance/independent/test_variants_by_contract.py.

Measured (``run_for(VARIANTS[v], BREAKS[v])``, depth 1; filled in below after the run):

| variant | breaks | outcome | base on that id |
|---|---|---|---|
| bump_before_load | ROLL-003 | caught (FAIL) | PASS |
| do_while_total | ROLL-006 | caught (FAIL) | PASS |
| open_iterator | ROLL-007 | caught (FAIL) | PASS |
| cut_at_eos | ROLL-002 | caught (FAIL) | PASS |
| pad_blind_groups | ROLL-009 | caught (FAIL) | PASS |

Messages:

- bump_before_load: ROLL-003: after [batch; policy.load_state_dict(scripted_weights(policy, 1));
  src.update_policy_weights_(None); batch], an update_policy_weights_ that raised (KeyError)
  changed policy_version from 1 to 2 (see specs/rollout-v1.md#ROLL-003)
- do_while_total: ROLL-006: declared total 0 batches, the first iteration of the source yielded
  1 (calls: [src = factory(policy, PROMPTS[:2], 0, max_new_tokens=1); list(src)  # 1 batches])
- open_iterator: ROLL-007: an iterator taken before shutdown() (not started, 0 batches) yielded a
  batch after it; expected a clear error (calls: [src = factory(policy, PROMPTS[:2], None,
  max_new_tokens=1); it0 = iter(src); it1 = iter(src); next(it1)  # yielded; it2 = iter(src);
  next(it2)  # yielded; next(it2)  # yielded; src.shutdown(); next(it0)  # yielded])
- cut_at_eos: ROLL-002: prompts [[0, 5, 0], [2], [7, 2, 8, 0, 0]], max_new_tokens=3: item 2: the
  real tokens before the response are [7, 2], not one of the prompts given [[0, 5, 0], [2], [7,
  2, 8, 0, 0]] smallest failing input: Failing explicit example: test( value=([[0, 5,
- pad_blind_groups: ROLL-009: prompts [[5, 6], [0, 5, 6], [5, 6, 0], [5, 2, 6]]: items 0 and 2
  answer different prompts [5, 6] / [0, 5, 6] but share group id 0

Caught since rollout 1.4, whose domains now try what they did not: ROLL-006 totals of 0 and
more, each source iterated again and again with updates between; ROLL-007 iterators taken
before shutdown() at every point of their life; ROLL-009 prompts that differ only in pad or EOS
ids, prefixes of each other and the same prompt twice.

Example:
    >>> sorted(VARIANTS)[0]
    'bump_before_load'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

import tests.independent.rollouts as ro
from posttrain.contracts import LLM_LAYOUT_V1, Implementation
from tests.independent.generation import load_checked

__all__ = ["BREAKS", "DEMOS", "VARIANTS"]

_K = LLM_LAYOUT_V1.key


def _policy() -> Any:
    from posttrain.testing import tiny_causal_lm

    return tiny_causal_lm()


class BumpBeforeLoadSource(ro.EagerPrefetchSource):
    """BUG: ``update_policy_weights_`` bumps the version first and loads the weights after
    ("the new version is on its way"), so an update refused for a name the policy lacks
    raises with the version already raised: later batches come from the unchanged weights
    stamped with a version that names no weights. Plausible (exception safety: the counter
    moved before the step that can fail).

    Breaks ROLL-003 ("Every item MUST carry policy_version equal to the source's
    policy_version when it was generated; that version names the weights"; the spec: "an
    update that raises leaves the weights and the version as they were").
    """

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        with self._lock:
            self._version += 1
            if weights is not None:
                load_checked(self._policy, weights)


def demo_bump_before_load() -> bool:
    """A refused update changes the version."""
    policy = _policy()
    src = BumpBeforeLoadSource(policy, [[5, 6]], None, max_new_tokens=1)
    bad = dict(policy.state_dict())
    bad["no.such.weight"] = torch.zeros(1)
    with contextlib.suppress(KeyError, ValueError, TypeError):
        src.update_policy_weights_(bad)
    src.shutdown()
    return src.policy_version != 0


class DoWhileTotalSource(ro.LazyGeneratorSource):
    """BUG: the batch loop is a do-while (generate, yield, count, *then* test the budget), so
    each iteration yields at least one batch: ``total_batches=0`` yields one, and iterating
    again after the lifetime budget is spent yields one more each time. Plausible: the
    ``while True: ...; if n >= total: break`` shape.

    Breaks ROLL-006 ("When a total is declared, iteration MUST stop after exactly that many
    batches").
    """

    def __iter__(self) -> Iterator[TensorDictBase]:
        while True:
            if self._closed:
                raise ro.SourceClosedError("rollout source was shut down: it yields no more")
            batch = self._generate()
            self._produced += 1
            yield batch
            if self._total is not None and self._produced >= self._total:
                return


def demo_do_while_total() -> bool:
    """A source with total 2, iterated twice, yields 3 batches (and total 0 yields 1)."""
    src = DoWhileTotalSource(_policy(), [[5, 6]], 2, max_new_tokens=1)
    n = len(list(src)) + len(list(src))
    zero = DoWhileTotalSource(_policy(), [[5, 6]], 0, max_new_tokens=1)
    return n != 2 or len(list(zero)) != 0


class OpenIteratorSource(ro.LazyGeneratorSource):
    """BUG: the closed flag is checked when iteration *starts*, so an iterator taken before
    ``shutdown()`` keeps yielding (it lazily rebuilds the engine copy ``shutdown`` freed): a
    trainer thread still looping over the source never sees the shutdown. Plausible (a
    guard in ``__iter__`` instead of in the loop).

    Breaks ROLL-007 ("iterating after it [shutdown()] MUST raise a clear error instead of
    hanging").
    """

    def __iter__(self) -> Iterator[TensorDictBase]:
        if self._closed:
            raise ro.SourceClosedError("rollout source was shut down: it yields no more batches")
        return self._loop()

    def _loop(self) -> Iterator[TensorDictBase]:
        while self._total is None or self._produced < self._total:
            batch = self._generate()
            self._produced += 1
            yield batch


def demo_open_iterator() -> bool:
    """An iterator taken before shutdown yields after it."""
    src = OpenIteratorSource(_policy(), [[5, 6]], None, max_new_tokens=1)
    it = iter(src)
    next(it)
    src.shutdown()
    try:
        next(it)
    except ro.SourceClosedError:
        return False
    return True


class CutAtEosSource(ro.LazyGeneratorSource):
    """BUG: each prompt is cut after its first EOS (the packed-dataset splitter: "what
    follows EOS is the next document"), so a prompt holding EOS inside (a multi-turn chat
    whose earlier turn ended with EOS, or raw ids that happen to contain it) is shortened
    before generation. Plausible.

    Breaks ROLL-002 ("The real tokens (attention mask True) before the first assistant token
    MUST be the prompt the source was given").
    """

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None,
        *,
        max_new_tokens: int,
    ) -> None:
        eos = int(policy.config.eos_token_id)
        cut = [list(p[: p.index(eos) + 1]) if eos in p else list(p) for p in prompts]
        super().__init__(policy, cut, total_batches, max_new_tokens=max_new_tokens)


def demo_cut_at_eos() -> bool:
    """The prompt [5, 2, 6] comes back as [5, 2]."""
    src = CutAtEosSource(_policy(), [[5, 2, 6]], 1, max_new_tokens=1)
    item = next(iter(src))[0]
    src.shutdown()
    tokens = item.get(_K("tokens"))
    first_asst = int(item.get(_K("assistant_mask")).nonzero()[0])
    return bool(tokens[:first_asst].tolist() != [5, 2, 6])


class PadBlindGroupsSource(ro.EagerPrefetchSource):
    """BUG: prompts are grouped by their content with the pad id removed
    (``tuple(t for t in p if t != pad)``, the key a collator-side dedupe uses so that padded
    and unpadded copies of a prompt match), so two different prompts that differ only by
    pad-id tokens ([0, 5, 0] and [5], or [0] and [0, 0]) share a ``group_id``. Plausible.

    Breaks ROLL-009 ("items from different prompts MUST NOT [share a group_id]").
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
        super().__init__(
            policy, prompts, total_batches, max_new_tokens=max_new_tokens, group_size=group_size
        )
        pad = 0
        first: dict[tuple[int, ...], int] = {}
        self._groups = [
            first.setdefault(tuple(t for t in p if t != pad), i // group_size)
            for i, p in enumerate(self._prompts)
        ]


def demo_pad_blind_groups() -> bool:
    """The prompts [0, 5, 0] and [5] share a group."""
    src = PadBlindGroupsSource(_policy(), [[0, 5, 0], [5]], 1, max_new_tokens=1)
    groups = next(iter(src)).get(_K("group_id")).tolist()
    src.shutdown()
    return len(set(groups)) != 2


_PREFETCH_CAPS = {"log_probs", "groups"}
_LAZY_CAPS = {"ragged", "log_probs"}


def _impl(cls: type[Any], caps: set[str]) -> Implementation:
    def factory(
        policy: Any, prompts: list[list[int]], total_batches: int | None, *, max_new_tokens: int
    ) -> Any:
        return cls(policy, prompts, total_batches, max_new_tokens=max_new_tokens)

    return Implementation("rollout", factory, name=f"r3.{cls.__name__}", capabilities=caps)


VARIANTS: dict[str, Implementation] = {
    "bump_before_load": _impl(BumpBeforeLoadSource, _PREFETCH_CAPS),
    "do_while_total": _impl(DoWhileTotalSource, _LAZY_CAPS),
    "open_iterator": _impl(OpenIteratorSource, _LAZY_CAPS),
    "cut_at_eos": _impl(CutAtEosSource, _LAZY_CAPS),
    "pad_blind_groups": _impl(PadBlindGroupsSource, _PREFETCH_CAPS),
}

BREAKS: dict[str, str] = {
    "bump_before_load": "ROLL-003",
    "do_while_total": "ROLL-006",
    "open_iterator": "ROLL-007",
    "cut_at_eos": "ROLL-002",
    "pad_blind_groups": "ROLL-009",
}

DEMOS: dict[str, Callable[[], bool]] = {
    "bump_before_load": demo_bump_before_load,
    "do_while_total": demo_do_while_total,
    "open_iterator": demo_open_iterator,
    "cut_at_eos": demo_cut_at_eos,
    "pad_blind_groups": demo_pad_blind_groups,
}

# The correct design each variant subclasses, for the base check on the same id.
BASES: dict[str, Implementation] = {
    "bump_before_load": _impl(ro.EagerPrefetchSource, _PREFETCH_CAPS),
    "do_while_total": _impl(ro.LazyGeneratorSource, _LAZY_CAPS),
    "open_iterator": _impl(ro.LazyGeneratorSource, _LAZY_CAPS),
    "cut_at_eos": _impl(ro.LazyGeneratorSource, _LAZY_CAPS),
    "pad_blind_groups": _impl(ro.EagerPrefetchSource, _PREFETCH_CAPS),
}


# What the kit misses of these variants (strict xfails in tests/conformance/independent/test_variants_by_contract.py):
# an entry goes once the kit fails the variant on the requirement it breaks.
KIT_DEFECTS: dict[str, str] = {}

# Variants the kit fails under another requirement (a foundation that blocks theirs).
OTHER_ID: dict[str, str] = {}
