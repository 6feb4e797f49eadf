"""The reference rollout source: Hugging Face ``generate`` in process, LLM layout out."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDict

from posttrain._args import non_negative_int, token_prompts
from posttrain.contracts.alignment import token_log_probs
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.errors import SourceClosed


class HFRolloutSource:
    """Generates responses to ``prompts`` with an HF causal LM; conforms to ``RolloutSourceV1``.

    Every batch holds each prompt ``num_samples`` times, right-padded: prompt, response (up to
    and including EOS), padding. ``sample_log_probs`` are recomputed from the final sequences
    with the generating weights; ``group_id`` numbers prompt instances across batches.
    ``update_policy_weights_`` loads new weights (strictly) and bumps ``policy_version``.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = HFRolloutSource(tiny_causal_lm(), [[5, 6, 7], [8, 9]], total_batches=1)
        >>> batch = next(iter(src))
        >>> batch.batch_size, int(batch["policy_version"][0])
        (torch.Size([2]), 0)
        >>> src.shutdown(); src.shutdown()
    """

    def __init__(
        self,
        policy: Any,
        prompts: list[list[int]],
        total_batches: int | None = None,
        *,
        max_new_tokens: int = 4,
        num_samples: int = 1,
        greedy: bool = False,
        seed: int = 0,
    ) -> None:
        prompts = token_prompts(prompts)
        if total_batches is not None:
            total_batches = non_negative_int("total_batches", total_batches)
        self.policy = policy
        self.prompts = prompts
        self.total_batches = total_batches
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.greedy = greedy
        self._gen = torch.Generator().manual_seed(seed)
        self._version = 0
        self._batches = 0
        self._closed = False
        cfg = policy.config
        self.eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    @property
    def policy_version(self) -> int:
        """The version stamped on batches generated from now on."""
        return self._version

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        """Load ``weights`` into the policy (``None``: it was updated in place) and bump the version."""
        if self._closed:
            raise SourceClosed("update_policy_weights_ after shutdown()")
        if weights is not None:
            weights = dict(weights)
            # Checked before any write: load_state_dict(strict=True) copies every tensor it
            # knows and only then raises for a name it does not, leaving the policy changed
            # under the old version.
            own = self.policy.state_dict()
            problems = [f"unknown name {n!r}" for n in weights if n not in own]
            problems += [f"missing name {n!r}" for n in own if n not in weights]
            problems += [
                f"{n!r}: expected {own[n].dtype} {list(own[n].shape)}, found "
                f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))}"
                for n, w in weights.items()
                if n in own
                and (
                    not isinstance(w, torch.Tensor)
                    or w.shape != own[n].shape
                    or w.dtype != own[n].dtype
                )
            ]
            if problems:
                raise ValueError(
                    "update_policy_weights_: weights rejected (policy unchanged): "
                    + "; ".join(problems[:10])
                )
            self.policy.load_state_dict(weights, strict=True)
        self._version += 1

    def shutdown(self) -> None:
        """Stop; idempotent. Iterating afterwards raises :class:`SourceClosed`."""
        self._closed = True

    def __iter__(self) -> Iterator[TensorDict]:
        if self._closed:
            raise SourceClosed("this rollout source was shut down; create a new one")
        while self.total_batches is None or self._batches < self.total_batches:
            if self._closed:
                raise SourceClosed("this rollout source was shut down while iterating")
            yield self._generate()
            self._batches += 1

    @torch.no_grad()
    def _generate(self) -> TensorDict:
        prompts = [p for p in self.prompts for _ in range(self.num_samples)]
        n, width = len(prompts), max(map(len, prompts))
        left = torch.full((n, width), self.pad, dtype=torch.int64)
        left_mask = torch.zeros(n, width, dtype=torch.int64)
        for i, p in enumerate(prompts):  # HF batched generation wants left padding
            left[i, width - len(p) :] = torch.tensor(p)
            left_mask[i, width - len(p) :] = 1
        seed = int(torch.randint(2**31 - 1, (1,), generator=self._gen))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.policy.generate(
                input_ids=left,
                attention_mask=left_mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=not self.greedy,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=self.pad,
                eos_token_id=self.eos,
            )
        new = out[:, width:]
        rows = []
        for i, p in enumerate(prompts):
            resp = new[i].tolist()
            if self.eos is not None and self.eos in resp:
                resp = resp[: resp.index(self.eos) + 1]
            rows.append((p, resp))
        t = max(len(p) + len(r) for p, r in rows)
        tokens = torch.full((n, t), self.pad, dtype=torch.int64)
        attn = torch.zeros(n, t, dtype=torch.bool)
        asst = torch.zeros(n, t, dtype=torch.bool)
        for i, (p, r) in enumerate(rows):
            tokens[i, : len(p) + len(r)] = torch.tensor(p + r)
            attn[i, : len(p) + len(r)] = True
            asst[i, len(p) : len(p) + len(r)] = True
        logits = self.policy(input_ids=tokens, attention_mask=attn.long()).logits
        lp = torch.where(asst, token_log_probs(logits, tokens), float("nan"))
        k = LLM_LAYOUT_V1.key
        first_group = self._batches * len(self.prompts)
        return TensorDict(
            {
                k("tokens"): tokens,
                k("attention_mask"): attn,
                k("assistant_mask"): asst,
                k("sample_log_probs"): lp,
                k("policy_version"): torch.full((n,), self._version, dtype=torch.int64),
                k("group_id"): first_group + torch.arange(n) // self.num_samples,
            },
            batch_size=[n],
        )
