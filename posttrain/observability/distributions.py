"""Per-step distributions and completion samples for sinks with the ``histogram`` and
``samples`` capabilities (metrics contract 1.3, MET-008 and MET-009).

Wiring, next to the scalar hooks of one step::

    acc = rollout_metrics(batch, learner_version=step, histograms=True)
    acc.log_to(sink, step)          # scalars, and the histograms through log_histogram
    log_completion_samples(sink, prompts, completions, rewards, step, k=8)

The distributions are catalogue entries (reduction ``hist``, catalogue 1.2): the accumulator
keeps their values, so micro-batches and ranks (``all_reduce``) concatenate exactly and the
sink bins once. :func:`log_distributions` logs one batch's directly.

The histograms are over sequences, as the catalogue's ``rollout/*`` sequence metrics are:
``rollout/response_len`` (assistant tokens under the attention mask), ``rollout/reward``
(finite rewards only: a NaN reward is a failed reward call, not a value, as for
``rollout/reward/mean``) and ``rollout/advantage`` (per-sequence advantages, or a per-token
advantage's mean over the sequence's assistant tokens; values outside the mask are unread).

A sink without ``log_histogram`` (``MlflowSink``: MLflow stores scalars only) is refused with
a ``TypeError`` that says so, rather than skipped: a dashboard missing its distributions
should not look like a quiet run. ``Tee`` passes histograms to the sinks that have them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout
from posttrain.observability.hooks import rollout_metrics
from posttrain.observability.reduce import histogram_writer

HISTOGRAM_NAMES = ("rollout/response_len", "rollout/reward", "rollout/advantage")
"""The distributions :func:`log_distributions` logs, each the per-sequence values behind the
catalogue's ``<name>/mean``, ``/min`` and ``/max``."""


@torch.no_grad()
def rollout_distributions(
    td: TensorDictBase, *, layout: Layout = LLM_LAYOUT_V1
) -> dict[str, list[float]]:
    """The per-sequence values of :data:`HISTOGRAM_NAMES` in a rollout batch (a name whose
    field the batch lacks, or with no finite value, is left out).

    Example:
        >>> from posttrain.testing import llm_batch
        >>> d = rollout_distributions(llm_batch(4, 8))
        >>> sorted(d), len(d["rollout/response_len"])
        (['rollout/advantage', 'rollout/response_len', 'rollout/reward'], 4)
    """
    # The hooks' own per-sequence values: one computation for the statistics and the histograms.
    held = rollout_metrics(td, histograms=True, layout=layout).histograms()
    return {name: held[name] for name in HISTOGRAM_NAMES if name in held}


def log_distributions(
    sink: Any, td: TensorDictBase, step: int, *, layout: Layout = LLM_LAYOUT_V1
) -> dict[str, int]:
    """Log :func:`rollout_distributions` of ``td`` to ``sink.log_histogram`` at ``step``;
    returns how many values each histogram holds.

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> from posttrain.testing import llm_batch
        >>> sink = JsonlSink(tempfile.mkdtemp())
        >>> log_distributions(sink, llm_batch(4, 8), step=3)
        {'rollout/response_len': 4, 'rollout/reward': 4, 'rollout/advantage': 4}
    """
    fn = histogram_writer(sink)
    counts = {}
    for name, values in rollout_distributions(td, layout=layout).items():
        fn(name, values, step=step)
        counts[name] = len(values)
    return counts


def log_completion_samples(
    sink: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    rewards: Sequence[float] | torch.Tensor,
    step: int,
    *,
    k: int | None = 8,
    name: str = "samples",
) -> int:
    """The first ``k`` (all with None) ``(prompt, completion, reward)`` rows as ``name``'s table
    at ``step`` (``sink.log_samples``); returns the row count. Texts are decoded strings, kept
    exactly (special tokens included if the decoder kept them).

    Example:
        >>> import tempfile
        >>> from posttrain.reference_impls import JsonlSink
        >>> from posttrain.reference_impls.jsonl_sink import read_jsonl_samples
        >>> d = tempfile.mkdtemp(); sink = JsonlSink(d)
        >>> log_completion_samples(sink, ["2+2="], [" 4"], [1.0], step=5)
        1
        >>> read_jsonl_samples(d)
        {'samples': [(5, [('2+2=', ' 4', 1.0)])]}
    """
    fn = getattr(sink, "log_samples", None)
    if not callable(fn):
        raise TypeError(
            f"{type(sink).__name__} has no log_samples: log completion tables to a W&B or JSONL "
            "sink, or through Tee"
        )
    r = rewards.tolist() if isinstance(rewards, torch.Tensor) else list(rewards)
    if not len(prompts) == len(completions) == len(r):
        raise ValueError(
            f"log_completion_samples: expected as many prompts, completions and rewards, found "
            f"{len(prompts)}, {len(completions)} and {len(r)}"
        )
    rows = list(zip(prompts, completions, r, strict=True))[: None if k is None else k]
    fn(name, rows, step=step)
    return len(rows)
