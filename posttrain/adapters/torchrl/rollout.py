"""TorchRL's ``LLMCollector`` as a rollout source: raw (keys mapped only) and adapted.

TorchRL 0.14 ships no environment that takes prompts as token ids of different lengths
(``ChatEnv``'s token mode goes through a chat template and fails to stack ragged prompts), so
:func:`token_prompt_env` is the smallest ``ChatEnv`` subclass that does. Everything else is
TorchRL's: ``DataLoadingPrimer``, ``StepCounter``, ``TransformersWrapper`` generating,
``LLMCollector(track_policy_version=True)`` and its ``update_policy_weights_``.
"""

from __future__ import annotations

import contextlib
import math
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.adapters._hf import word_level_tokenizer as word_level_tokenizer  # its tokenizer
from posttrain.adapters.torchrl.loss import transformers_actor
from posttrain.adapters.torchrl.weight_sync import weight_problems, weight_signature
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.errors import SourceClosed

K = LLM_LAYOUT_V1.key


def _list_to_stack() -> Any:
    """TorchRL's LLM envs need tensordict's list-to-stack mode; set it only around our calls."""
    from tensordict import set_list_to_stack

    return set_list_to_stack(True)


def token_prompt_env(prompts: list[list[int]]) -> Any:
    """A single-turn TorchRL env whose every reset loads ``prompts`` (token ids) as one batch.

    Example:
        >>> env = token_prompt_env([[5, 6, 7], [8, 9]])
        >>> env.batch_size
        torch.Size([2])
    """
    from tensordict import lazy_stack

    with optional_deps():
        from torchrl.envs import StepCounter
        from torchrl.envs.llm import ChatEnv, DataLoadingPrimer
        from torchrl.modules.llm.policies import Tokens

    class TokenPromptChatEnv(ChatEnv):
        def _reset(self, tensordict: TensorDictBase, **kwargs: Any) -> TensorDictBase:
            ids = tensordict.get(self.data_key)
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            toks = lazy_stack([Tokens(prompt=torch.as_tensor(t, dtype=torch.long)) for t in ids])
            out: TensorDictBase = tensordict.empty(device=self.device).set("tokens", toks)
            return out.to_lazystack(0)

        def _step_tokens(self, tensordict: TensorDictBase) -> TensorDictBase:
            # ChatEnv's own reads ("tokens", "full") as one dense tensor: ragged prompts fail.
            full = tensordict.get(("tokens", "full"), as_list=True)
            nxt = lazy_stack([Tokens(prompt=f) for f in full])
            out: TensorDictBase = tensordict.empty(device=self.device).set("tokens", nxt)
            return out

        def _post_step_mdp_hooks(
            self, tensordict: TensorDictBase, tensordict_: TensorDictBase
        ) -> tuple[TensorDictBase, TensorDictBase]:
            # The policy's outputs are in no spec, so step_mdp carries them past a reset, and
            # the wrapper then prefers the stale attention mask to the new prompt's.
            drop = ("masks", "log_probs", ("tokens", "response"), ("tokens", "full"))
            return tensordict, tensordict_.exclude(*drop)

    batch = [list(map(int, p)) for p in prompts]

    class Prompts:
        batch_size = len(batch)

        def __iter__(self) -> Iterator[dict[str, list[torch.Tensor]]]:
            while True:
                yield {"query": [torch.tensor(p) for p in batch]}

    tokens: Any = "tokens"  # ChatEnv's annotation omits the token mode its docs describe
    size = torch.Size([len(batch)])
    env = TokenPromptChatEnv(input_mode=tokens, batch_size=size)
    env = env.append_transform(DataLoadingPrimer(dataloader=Prompts(), batch_size=size))
    return env.append_transform(StepCounter(max_steps=1))


def _to_layout(
    prompts: list[torch.Tensor],
    responses: list[torch.Tensor],
    versions: torch.Tensor,
    log_probs: list[torch.Tensor] | None,
) -> LazyStackedTensorDict:
    """Per-item prompt and response tokens (ragged) as LLM-layout items.

    ``log_probs``: per item, the log-probs of the response tokens (or of every token).
    """
    items = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n, m = p.shape[-1], r.shape[-1]
        item = {
            K("tokens"): torch.cat([p, r]),
            K("attention_mask"): torch.ones(n + m, dtype=torch.bool),
            K("assistant_mask"): torch.arange(n + m) >= n,
            K("policy_version"): versions[i].to(torch.int64),
        }
        if log_probs is not None:
            lp = log_probs[i].detach().float()[-m:]
            item[K("sample_log_probs")] = torch.cat([torch.full((n,), math.nan), lp])
        items.append(TensorDict(item, batch_size=[]))
    return LazyStackedTensorDict.lazy_stack(items, 0)


class LayoutOnlyCollector:
    """The raw row: TorchRL's ``LLMCollector`` with only its keys mapped to the LLM layout.

    Items keep TorchRL's own values: the root ``policy_version`` TorchRL stamps, the response
    log-probs it returns; the assistant mask (``None`` in TorchRL's token mode) is the
    response span. Weights go to ``LLMCollector.update_policy_weights_`` untouched.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = llm_collector(tiny_causal_lm(), [[5, 6, 7]], 1, max_new_tokens=1)
        >>> [batch] = src
        >>> item = batch.tensordicts[0]
        >>> item["masks", "all_assistant_mask"].tolist(), item["policy_version"].item()
        ([False, False, False, True], 0)
        >>> bool(item["log_probs", "full"][3] == 0)  # TorchRL's generating wrapper writes 0 here
        True
    """

    version_key: Any = "policy_version"

    def __init__(self, collector: Any) -> None:
        self.collector = collector

    def _tokens(self, td: TensorDictBase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per item: TorchRL's prompt and response tokens."""
        prompts = td.get(("tokens", "prompt"), as_list=True)
        responses = td.get(("tokens", "response"), as_list=True)
        fulls = td.get(("tokens", "full"), as_list=True)
        for i, (p, r, f) in enumerate(zip(prompts, responses, fulls, strict=True)):
            if f.shape[-1] != p.shape[-1] + r.shape[-1]:
                raise ValueError(
                    f"item {i}: ('tokens', 'full') has {f.shape[-1]} tokens, expected prompt "
                    f"{p.shape[-1]} + response {r.shape[-1]}"
                )
        return prompts, responses

    def _log_probs(
        self, td: TensorDictBase, fulls: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        out: list[torch.Tensor] = td.get(("log_probs", "response"), as_list=True)
        return out

    def __iter__(self) -> Iterator[TensorDictBase]:
        it = iter(self.collector)
        while True:
            with _list_to_stack():
                try:
                    td = next(it)
                except StopIteration:
                    return
                prompts, responses = self._tokens(td)
                fulls = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
                lps = self._log_probs(td, fulls)
            yield _to_layout(prompts, responses, td.get(self.version_key).reshape(-1), lps)

    def update_policy_weights_(self, weights: Any = None, /) -> None:
        """``LLMCollector.update_policy_weights_(weights)``."""
        self.collector.update_policy_weights_(weights)

    @property
    def policy_version(self) -> int:
        """``LLMCollector.policy_version``."""
        return int(self.collector.policy_version)

    def shutdown(self) -> None:
        """``LLMCollector.shutdown()``."""
        self.collector.shutdown()


class ContractCollector(LayoutOnlyCollector):
    """``LLMCollector`` made to conform to ``RolloutSourceV1`` (thin: keys, versions, weights).

    - Stamps the version TorchRL writes at the step that generated the response
      (``("next", "policy_version")``); the root stamp is the version at prompt load, which
      lags an update made between reset and step.
    - ``update_policy_weights_`` takes a plain state dict (as the contract and
      ``nn.Module.state_dict()`` give it), checks names, shapes and dtypes against the
      generating model before any write, and hands TorchRL the nested TensorDict it expects.
    - Scores the generated sequences once more with a non-generating ``TransformersWrapper``
      of the same model (one forward pass per batch): the generating wrapper sets the first
      response token's log-prob to 0 (``_log_probs_generate``), which would bias every
      importance ratio computed from it.
    - Pads prompts with an id one past the vocabulary: ``TransformersWrapper`` derives its
      masks as ``tokens != pad_token_id``, so a prompt token equal to the model's pad id
      would be dropped from what the model sees and from the batch. While TorchRL runs the
      model, the embedding reads that id as the model's own pad id (the attention mask hides
      it). A response is then every generated token up to and including the first EOS:
      what ``generate`` writes after it is padding (an EOS that is also the pad token, or a
      generated pad id, is no longer taken for padding).
    - Iterating after ``shutdown()`` raises :class:`SourceClosed`; ``shutdown`` is idempotent.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = llm_collector(tiny_causal_lm(), [[5, 6, 7]], 1, max_new_tokens=2, adapted=True)
        >>> [(b.batch_size, b.tensordicts[0]["tokens", "full"][:3].tolist()) for b in src]
        [(torch.Size([1]), [5, 6, 7])]
        >>> src.shutdown(); src.shutdown()
    """

    version_key = ("next", "policy_version")

    def __init__(
        self, collector: Any, model: Any, prefix: str = "model.", *, max_new_tokens: int = 0
    ) -> None:
        super().__init__(collector)
        self.model = model
        self.prefix = prefix
        self.max_new_tokens = max_new_tokens
        self.closed = False
        self._scorer = transformers_actor(model, pad_output=False)

    def _tokens(self, td: TensorDictBase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        prompts, responses = super()._tokens(td)
        eos = self.model.config.eos_token_id
        if not isinstance(eos, int):
            return prompts, responses
        cut = []
        for r in responses:
            ends = (r == eos).nonzero()
            cut.append(r[: int(ends[0, 0]) + 1] if len(ends) else r)
        return prompts, cut

    def _log_probs(
        self, td: TensorDictBase, fulls: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        # Every token is real: an explicit mask, or the scorer would take a pad id for padding.
        items = [
            TensorDict(
                {("tokens", "full"): f, ("masks", "all_attention_mask"): torch.ones_like(f).bool()},
                batch_size=[],
            )
            for f in fulls
        ]
        with torch.no_grad():
            out = self._scorer(LazyStackedTensorDict.lazy_stack(items, 0))
        lps: list[torch.Tensor] = out.get(("log_probs", "full"), as_list=True)
        return lps

    def __iter__(self) -> Iterator[TensorDictBase]:
        if self.closed:
            raise SourceClosed("the collector was shut down; create a new one to generate again")
        batches = super().__iter__()
        while True:
            with outside_pad_embedded(self.model):
                td = next(batches, None)
            if td is None:
                return
            yield td
            if self.closed:
                raise SourceClosed(
                    "the collector was shut down; create a new one to generate again"
                )

    def update_policy_weights_(self, weights: Mapping[str, torch.Tensor] | None = None, /) -> None:
        """Check ``weights`` against the model, then let TorchRL load them and bump the version."""
        if weights is None:
            self.collector.update_policy_weights_()
            return
        problems = weight_problems(weight_signature(self.model), weights)
        if problems:
            raise ValueError("weights rejected (model unchanged): " + "; ".join(problems))
        nested = TensorDict({self.prefix + k: v for k, v in weights.items()}).unflatten_keys(".")
        self.collector.update_policy_weights_(nested)

    def shutdown(self) -> None:
        """Shut the collector down once; later calls do nothing."""
        if not self.closed:
            self.closed = True
            self.collector.shutdown()


def outside_pad_tokenizer(config: Any) -> Any:
    """The word-level tokenizer of ``config`` whose pad id is ``vocab_size``: no token's id.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> tok = outside_pad_tokenizer(tiny_causal_lm(vocab_size=64).config)
        >>> tok.pad_token_id, tok.eos_token_id
        (64, 2)
    """
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else 2
    bos = config.bos_token_id if isinstance(config.bos_token_id, int) else 1
    outside = types.SimpleNamespace(
        vocab_size=config.vocab_size + 1,
        pad_token_id=config.vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    return word_level_tokenizer(outside)


@contextlib.contextmanager
def outside_pad_embedded(model: Any) -> Iterator[None]:
    """While open, ``model``'s input embedding reads the id ``vocab_size`` as its pad id.

    The positions holding it are padding the attention mask hides; the embedding only needs a
    row to read for them.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> m = tiny_causal_lm(vocab_size=64)
        >>> with outside_pad_embedded(m):
        ...     m(input_ids=torch.tensor([[64, 5]])).logits.shape
        torch.Size([1, 2, 64])
    """
    outside = int(model.config.vocab_size)
    pad = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0

    def read_as_pad(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids = args[0]
        return (ids.masked_fill(ids == outside, pad), *args[1:])

    handle = model.get_input_embeddings().register_forward_pre_hook(read_as_pad)
    try:
        yield
    finally:
        handle.remove()


def llm_collector(
    policy: Any,
    prompts: list[list[int]],
    total_batches: int | None = None,
    *,
    max_new_tokens: int = 4,
    adapted: bool = False,
) -> LayoutOnlyCollector:
    """An ``LLMCollector`` answering every prompt once per batch, as a rollout source.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> src = llm_collector(tiny_causal_lm(), [[5, 6, 7], [8, 9]], 2)
        >>> sum(1 for _ in src)
        2
    """
    with optional_deps():
        from torchrl.collectors.llm import LLMCollector

    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": True}
    # adapted: prompts padded with an id no token has (ContractCollector embeds it as the pad)
    tokenizer = outside_pad_tokenizer(policy.config) if adapted else None
    wrapper = transformers_actor(policy, tokenizer, generate_kwargs=kwargs, pad_output=False)
    n = len(prompts)
    with _list_to_stack(), warnings.catch_warnings():
        # 0.14 warns that 0.15 will append InitTracker; this single-turn env needs none.
        warnings.filterwarnings("ignore", "The env passed to LLMCollector", FutureWarning)
        collector = LLMCollector(
            token_prompt_env(prompts),
            policy=wrapper,
            dialog_turns_per_batch=n,
            total_dialog_turns=-1 if total_batches is None else total_batches * n,
            flatten_data=True,
            track_policy_version=True,
        )
    if adapted:
        return ContractCollector(collector, policy, max_new_tokens=max_new_tokens)
    return LayoutOnlyCollector(collector)
