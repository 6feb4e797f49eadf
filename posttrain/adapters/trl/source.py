"""TRL's GRPO generation as a ``RolloutSourceV1`` (pull batches, update weights, versions)."""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain._args import non_negative_int, token_prompts
from posttrain._deps import optional_deps
from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl.rollout import CaptureRollouts
from posttrain.errors import SourceClosed


class _Discard:
    """The source yields its batches instead of storing them."""

    def extend(self, data: TensorDictBase) -> None:
        pass


class TRLRolloutSource:
    """A real ``GRPOTrainer`` generating for ``prompts`` (token ids), as a rollout source.

    Generation goes through :class:`CaptureRollouts` with the trainer's model, processing
    class and generation config (``GRPOConfig(num_generations, max_completion_length, ...)``);
    each batch answers every prompt ``num_generations`` times: ragged items with group ids and
    the sampling log-probs. ``update_policy_weights_`` checks names, shapes and dtypes before
    loading (a rejected update changes nothing) and bumps :attr:`policy_version`.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = TRLRolloutSource(tiny_causal_lm(), [[5, 6, 7]], 1, max_new_tokens=2)
        >>> [b.batch_size for b in src]
        [torch.Size([2])]
        >>> src.shutdown(); src.shutdown()
    """

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None = None,
        *,
        max_new_tokens: int = 4,
        num_generations: int = 2,
        tokenizer: Any = None,
        seed: int = 0,
        use_cpu: bool = True,
    ) -> None:
        prompts = token_prompts(prompts)
        if total_batches is not None:
            total_batches = non_negative_int("total_batches", total_batches)
        with optional_deps():
            from datasets import Dataset
            from trl.trainer.grpo_config import GRPOConfig
            from trl.trainer.grpo_trainer import GRPOTrainer

        # A copy: TRL wants left padding, and the caller's tokenizer keeps its own side.
        tok = (
            copy.deepcopy(tokenizer)
            if tokenizer is not None
            else word_level_tokenizer(policy.config)
        )
        tok.padding_side = "left"
        self._dir = tempfile.mkdtemp(prefix="posttrain-trl-")
        args = GRPOConfig(
            output_dir=self._dir,
            num_generations=num_generations,
            per_device_train_batch_size=num_generations,
            max_completion_length=max_new_tokens,
            report_to=[],
            use_cpu=use_cpu,
            save_strategy="no",
            seed=seed,
        )
        self.trainer: Any = GRPOTrainer(
            model=policy,
            reward_funcs=[_no_reward],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [""]}),
            processing_class=tok,
        )
        self.prompts = prompts
        self.total_batches = total_batches
        self.num_generations = num_generations
        self._capture = CaptureRollouts(_Discard(), version=lambda _: self._version)  # type: ignore[arg-type]
        self._version = 0
        self._batches = 0
        self._closed = False

    @property
    def policy_version(self) -> int:
        """The version stamped on batches generated from now on."""
        return self._version

    def __iter__(self) -> Iterator[TensorDictBase]:
        if self._closed:
            raise SourceClosed("this rollout source was shut down; create a new one")
        while self.total_batches is None or self._batches < self.total_batches:
            if self._closed:
                raise SourceClosed("this rollout source was shut down while iterating")
            ids = [p for p in self.prompts for _ in range(self.num_generations)]
            items, _, _ = self._capture.generate(self.trainer, ids)
            self._capture.groups += len(self.prompts)
            self._batches += 1
            yield items

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        """Load ``weights`` into the trainer's model (``None``: updated in place); bump the version."""
        if self._closed:
            raise SourceClosed("update_policy_weights_ after shutdown()")
        if weights is not None:
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            own = model.state_dict()
            problems = [f"unknown {n!r}" for n in weights if n not in own]
            problems += [f"missing {n!r}" for n in own if n not in weights]
            problems += [
                f"{n!r}: expected {tuple(own[n].shape)} {own[n].dtype}, found "
                f"{tuple(w.shape)} {w.dtype}"
                for n, w in weights.items()
                if n in own and (w.shape != own[n].shape or w.dtype != own[n].dtype)
            ]
            if problems:
                raise ValueError("weights rejected (model unchanged): " + "; ".join(problems))
            model.load_state_dict(dict(weights), strict=True)
        self._version += 1

    def shutdown(self) -> None:
        """Stop; idempotent. Iterating afterwards raises :class:`SourceClosed`."""
        if not self._closed:
            self._closed = True
            shutil.rmtree(self._dir, ignore_errors=True)


def _no_reward(completions: list[Any], **kw: Any) -> list[float | None]:
    """GRPOTrainer needs a reward function; a rollout source never computes rewards."""
    return [None] * len(completions)
