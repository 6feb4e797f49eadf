"""TRL as a rollout source: ``GRPOTrainer``'s generations captured into any ``ReplayBufferV1``.

TRL 1.16 exposes generation through one public seam, ``GRPOTrainer(rollout_func=...)``
(experimental in TRL). :class:`CaptureRollouts` is such a function: it generates the way
TRL's own transformers path does (prompts tokenized by the trainer's processing class,
left-padded, ``model.generate`` with the trainer's generation config, completions cut after
the first EOS), returns what TRL expects, and writes each batch to a buffer in the LLM layout.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.contracts.buffer import ReplayBufferV1
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout


class CaptureRollouts:
    """A ``rollout_func`` for ``GRPOTrainer`` that also extends ``buffer`` with every batch.

    TRL hands it the prompts already repeated ``num_generations`` times in a row (its sampler
    repeats each prompt; the function returns one completion per entry). Each run of
    ``num_generations`` entries is one GRPO group: items get consecutive ``group_id``s (a run
    of different prompts is refused: TRL's grouping changed). ``policy_version`` is the
    trainer's ``state.global_step`` when the batch was generated (optimizer steps so far), or
    what ``version(trainer)`` returns.

    ``metrics`` (an ``posttrain.observability.Accumulator``) receives the catalogue's rollout
    metrics of every training batch, its generation time and tokens per second, and the
    staleness of each micro-batch the optimizer takes (:meth:`consumed`: the ``version`` now
    minus the one stamped at generation; 0 when every step generates, the lag when TRL reuses
    a generation). ``posttrain.adapters.trl.callback.CatalogueCallback`` calls
    :meth:`consumed` and reads ``metrics``.

    Items are ragged (one per completion: prompt then completion tokens, attention all true,
    assistant mask on the completion, log-probs of the completion tokens under the sampling
    temperature, NaN on the prompt). Pass ``width`` to right-pad them to a fixed length for
    storages that need one shape. Rewards are computed by TRL after generation and are not
    in the item; score the buffer with a contract reward (``hf_reward_model``,
    ``trl_reward``) when you read it back.

    Example:
        >>> from posttrain.reference_impls import RingBuffer
        >>> capture = CaptureRollouts(RingBuffer(64), width=16)
        >>> capture.groups  # GRPOTrainer(..., rollout_func=capture) fills it
        0
    """

    def __init__(
        self,
        buffer: ReplayBufferV1,
        *,
        width: int | None = None,
        layout: Layout = LLM_LAYOUT_V1,
        version: Callable[[Any], int] | None = None,
        prompt_ids: Any = None,
        eval_buffer: ReplayBufferV1 | None = None,
        report_logprobs: bool = False,
        metrics: Any = None,
    ) -> None:
        self.buffer = buffer
        self.eval_buffer = eval_buffer
        self.width = width
        self.layout = layout
        self.version = version or _global_step
        self.texts: Mapping[str, list[int]] = getattr(
            prompt_ids, "posttrain_prompt_ids", prompt_ids if prompt_ids is not None else {}
        )
        self.report_logprobs = report_logprobs
        self.metrics = metrics
        self.groups = 0
        self.calls = 0
        self.stamped: int | None = None
        """The ``policy_version`` stamped on the latest training generation."""

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """Generate one completion per prompt entry; extend the buffer; return TRL's dict."""
        if int(getattr(trainer.accelerator, "num_processes", 1)) > 1:
            raise RuntimeError(
                "CaptureRollouts: one process only (group ids are numbered per process and "
                "ZeRO-3/FSDP parameters are not gathered for generation)"
            )
        training = bool(trainer.model.training)
        g = int(trainer.num_generations if training else trainer.num_generations_eval)
        if len(prompts) % g:
            raise ValueError(
                f"prompts: expected a multiple of num_generations={g} entries, found {len(prompts)}"
            )
        for k in range(0, len(prompts), g):
            if any(p != prompts[k] for p in prompts[k : k + g]):
                raise ValueError(
                    f"prompts[{k}:{k + g}]: expected one prompt repeated num_generations={g} "
                    "times (TRL's RepeatSampler order); found different prompts"
                )
        tok = trainer.processing_class
        chat = getattr(trainer, "chat_template_kwargs", None) or {}
        prompt_ids = self._prompt_ids(tok, prompts, chat)
        start = time.perf_counter()
        items, completion_ids, logprobs = self.generate(trainer, prompt_ids, g)
        seconds = time.perf_counter() - start
        target = self.buffer if training else self.eval_buffer
        if target is not None:
            target.extend(items)  # before bookkeeping: a refused extend changes nothing here
            self.groups += len(prompts) // g
        if training:
            self.stamped = int(items[0].get(self.layout.key("policy_version")))
        if self.metrics is not None and training:
            from posttrain.observability.hooks import rollout_metrics

            # No learner version here: against the version it was just stamped with, a batch is
            # always 0 old. Its lag is counted when the optimizer takes it (consumed).
            rollout_metrics(items, self.metrics)
            self.metrics.add("time/rollout_s", seconds)
            self.metrics.add("perf/gen_tokens_per_s", sum(len(c) for c in completion_ids), seconds)
        self.calls += 1
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            # TRL's transformers path reports none; reported ones feed its importance
            # sampling / off-policy masking (sampling_per_token_logps).
            "logprobs": logprobs if self.report_logprobs else None,
        }

    def consumed(self, trainer: Any, n: int) -> None:
        """The optimizer takes ``n`` sequences of the latest training generation now: add
        their staleness (``version(trainer)`` minus the version stamped at generation) to
        ``metrics``. Nothing without ``metrics`` or before a training generation.

        Example:
            >>> from types import SimpleNamespace
            >>> from posttrain.observability import Accumulator
            >>> from posttrain.reference_impls import RingBuffer
            >>> capture = CaptureRollouts(RingBuffer(8), metrics=Accumulator())
            >>> capture.stamped = 3  # as a generation at global step 3 leaves it
            >>> capture.consumed(SimpleNamespace(state=SimpleNamespace(global_step=5)), 4)
            >>> capture.metrics.values()
            {'staleness/mean': 2.0, 'staleness/max': 2.0, 'staleness/policy_version': 5.0}
        """
        if self.metrics is None or self.stamped is None:
            return
        learner = int(self.version(trainer))
        lag = learner - self.stamped
        self.metrics.add("staleness/mean", lag * n, n)
        self.metrics.add("staleness/max", lag)
        self.metrics.add("staleness/policy_version", learner)

    def _prompt_ids(self, tok: Any, prompts: list[Any], chat: dict[str, Any]) -> list[list[int]]:
        # Per prompt: the stored ids where the map knows the text (prompt_dataset keeps the
        # texts that do not round-trip), TRL's own tokenization for the others.
        known = [self.texts.get(p) if isinstance(p, str) else None for p in prompts]
        missing = [i for i, ids in enumerate(known) if ids is None]
        if missing:
            fresh = _tokenize(tok, [prompts[i] for i in missing], chat)
            for i, ids in zip(missing, fresh, strict=True):
                known[i] = ids
        return [list(ids) for ids in known if ids is not None]

    def generate(
        self, trainer: Any, prompt_ids: list[list[int]], g: int | None = None
    ) -> tuple[TensorDictBase, list[list[int]], list[list[float]]]:
        """One completion per entry of ``prompt_ids`` with the trainer's model and settings.

        Returns the LLM-layout items (group ids continue from :attr:`groups`, which the caller
        advances; ``g`` entries per group, default the trainer's ``num_generations``), the
        completion ids and their log-probs.
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        completion_ids, logprobs = _generate(trainer, model, trainer.processing_class, prompt_ids)
        g = int(trainer.num_generations) if g is None else g
        pad = trainer.processing_class.pad_token_id or 0
        items = self._items(prompt_ids, completion_ids, logprobs, self.version(trainer), g, pad)
        return items, completion_ids, logprobs

    def _items(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        logprobs: list[list[float]],
        version: int,
        g: int,
        pad: int,
    ) -> TensorDictBase:
        k = self.layout.key
        items = []
        for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, logprobs, strict=True)):
            n, m = len(p), len(c)
            w = self.width if self.width is not None else n + m
            if n + m > w:
                raise ValueError(
                    f"width={w}: item {i} has {n} prompt + {m} completion tokens; raise width"
                )
            tokens = torch.full((w,), pad, dtype=torch.long)
            tokens[: n + m] = torch.tensor([*p, *c], dtype=torch.long)
            pos = torch.arange(w)
            lps = torch.full((w,), math.nan)
            lps[n : n + m] = torch.tensor(lp, dtype=torch.float32)
            items.append(
                TensorDict(
                    {
                        k("tokens"): tokens,
                        k("attention_mask"): pos < n + m,
                        k("assistant_mask"): (pos >= n) & (pos < n + m),
                        k("sample_log_probs"): lps,
                        k("policy_version"): torch.tensor(version),
                        k("group_id"): torch.tensor(self.groups + i // g),
                    },
                    batch_size=[],
                )
            )
        if self.width is not None:
            return torch.stack(items)
        return LazyStackedTensorDict.lazy_stack(items, 0)


def _global_step(trainer: Any) -> int:
    return int(trainer.state.global_step)


def _tokenize(tok: Any, prompts: list[Any], chat_kwargs: dict[str, Any]) -> list[list[int]]:
    # The same calls as TRL's ``_tokenize_prompts`` (text: the processing class with its
    # defaults; messages: the chat template with a generation prompt).
    if all(isinstance(p, str) for p in prompts):
        ids: list[list[int]] = tok(text=prompts)["input_ids"]
        return ids
    out: list[list[int]] = tok.apply_chat_template(
        conversation=prompts,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **chat_kwargs,
    )["input_ids"]
    return out


def _generate(
    trainer: Any, model: Any, tok: Any, prompt_ids: list[list[int]]
) -> tuple[list[list[int]], list[list[float]]]:
    device = next(model.parameters()).device
    width = max(len(p) for p in prompt_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    config = getattr(trainer, "generation_config", None)
    if config is not None:
        config = copy.deepcopy(config)
    else:
        with optional_deps():
            from transformers import GenerationConfig

        make: Any = GenerationConfig  # untyped constructor
        config = make(max_new_tokens=trainer.args.max_completion_length, do_sample=True)
    config.return_dict_in_generate = True
    config.output_logits = True
    temperature = float(getattr(trainer, "temperature", 1.0) or 1.0)
    # The model stays in the mode TRL left it in (TRL generates without switching to eval).
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    completions = out.sequences[:, width:]
    # Step by step: one [B, V] float copy at a time, not three [B, T, V] ones.
    lps = torch.stack(
        [
            (step.float() / temperature).log_softmax(-1).gather(-1, completions[:, t, None])[:, 0]
            for t, step in enumerate(out.logits)
        ],
        dim=1,
    )
    eos = set(_as_list(getattr(trainer, "eos_token_ids", None) or tok.eos_token_id))
    completion_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    for c, lp in zip(completions.tolist(), lps.tolist(), strict=True):
        end = next((j + 1 for j, t in enumerate(c) if t in eos), len(c))
        completion_ids.append(c[:end])
        logprobs.append(lp[:end])
    return completion_ids, logprobs


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, list | tuple) else [int(x)]
