"""Rewards across the seam: HF reward models and TRL reward functions as contract rewards, and
contract rewards as TRL ``reward_funcs``.

A *contract reward* is a module ``td -> td`` that writes float32 per-sequence rewards, shape
``td.batch_size``, at the layout's reward key (in place, as TorchRL modules do) and returns
``td``. It reads the LLM layout: tokens, attention mask (real tokens) and assistant mask.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from posttrain._deps import optional_deps
from posttrain.contracts.keys import key_str
from posttrain.contracts.layout import LLM_LAYOUT_V1, Layout

Score = Callable[[TensorDictBase], torch.Tensor]


def sequences(
    td: TensorDictBase, layout: Layout = LLM_LAYOUT_V1
) -> tuple[torch.Size, list[torch.Tensor], list[torch.Tensor]]:
    """Batch shape, and per sequence its real tokens and their assistant mask.

    Real tokens are those inside the attention mask, so left, right or no padding all read
    the same. Dense batches may have any number of batch dims (flattened row-major); a ragged
    batch is a lazy stack along dim 0 of single items.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> td = llm_batch(2, 6)
        >>> shape, toks, asst = sequences(td)
        >>> shape, [len(t) for t in toks] == td["masks", "all_attention_mask"].sum(-1).tolist()
        (torch.Size([2]), True)
    """
    tok_k, attn_k, asst_k = (layout.key(n) for n in ("tokens", "attention_mask", "assistant_mask"))
    if isinstance(td, LazyStackedTensorDict):
        if td.stack_dim != 0 or any(x.batch_dims != 0 for x in td.tensordicts):
            raise ValueError(
                "a ragged batch must be a lazy stack along dim 0 of single items; found "
                f"stack_dim={td.stack_dim}, batch_size={tuple(td.batch_size)}"
            )
        toks, assts = [], []
        for i, x in enumerate(td.tensordicts):
            t, a, s = (_get(x, k, f"item {i}") for k in (tok_k, attn_k, asst_k))
            toks.append(t[a])
            assts.append(s[a])
        return td.batch_size, toks, assts
    t, a, s = (_get(td, k, "batch") for k in (tok_k, attn_k, asst_k))
    n_tok = t.shape[-1]
    flat_a = a.reshape(-1, n_tok)
    lengths = flat_a.sum(-1).tolist()
    return (
        td.batch_size,
        list(torch.split(t.reshape(-1, n_tok)[flat_a], lengths)),
        list(torch.split(s.reshape(-1, n_tok)[flat_a], lengths)),
    )


def _get(td: TensorDictBase, key: tuple[str, ...], where: str) -> torch.Tensor:
    v = td.get(key, None)
    if v is None:
        found = ", ".join(sorted(key_str(k) for k in td.keys(True, True)))
        raise KeyError(f"{where}: reward needs key {key_str(key)}, which is missing; found {found}")
    out: torch.Tensor = v
    return out


class RewardModule(torch.nn.Module):
    """A contract reward from a scoring function ``td -> float rewards of shape td.batch_size``.

    Checks the shape, casts to float32, writes the layout's reward key in place, returns ``td``.
    A failing score writes nothing. ``name`` (default: the score function's name) is what
    ``trl_reward_func`` reports to TRL's logs.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> lengths = RewardModule(lambda td: td["masks", "all_attention_mask"].sum(-1))
        >>> td = lengths(llm_batch(2, 6))
        >>> td["next", "reward"].dtype, td["next", "reward"].shape
        (torch.float32, torch.Size([2]))
    """

    def __init__(
        self, score: Score, *, layout: Layout = LLM_LAYOUT_V1, name: str | None = None
    ) -> None:
        super().__init__()
        self.score = score
        self.layout = layout
        self.name = name or getattr(score, "__name__", type(score).__name__)
        # What a TRL reward function run through ``trl_reward`` logged during the latest
        # trainer step (``log_extra``: a column per name; ``log_metric``: the values of each
        # call): cleared when a call comes with another ``trainer_state.global_step``, and at
        # every call without a trainer state, so a long run holds one step's logs, not all.
        self.extra_logs: dict[str, list[Any]] = {}
        self.logged_metrics: dict[str, list[float]] = {}
        self._logs_step: int | None = None

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Score ``td`` and write the rewards at the layout's reward key."""
        reward = self.score(td)
        if not isinstance(reward, torch.Tensor) or reward.shape != td.batch_size:
            found = tuple(reward.shape) if isinstance(reward, torch.Tensor) else type(reward)
            raise ValueError(
                f"reward {key_str(self.layout.key('reward'))}: expected shape "
                f"{tuple(td.batch_size)}, found {found}"
            )
        td.set(self.layout.key("reward"), reward.to(torch.float32))
        return td


def hf_reward_model(
    model: Any, *, layout: Layout = LLM_LAYOUT_V1, grad: bool = False
) -> RewardModule:
    """A decoder-only ``AutoModelForSequenceClassification`` (one label; Llama, Qwen, Mistral,
    GPT-2 ...) or any such model returning ``logits`` or ``rewards``, scoring the LLM layout as
    a contract reward. Encoders (BERT, RoBERTa ...) read the first token and are refused; the
    model must share the policy's vocabulary (TRL re-tokenizes text instead).

    Each sequence is scored on its real tokens alone: sequences are re-packed left-padded and
    fed as embeddings with explicit positions, so the score is read at the last real token.
    (Fed ``input_ids``, HF models pick the last token that differs from ``pad_token_id``,
    which misreads any sequence ending in that id: EOS used as pad is common.) Rewards never
    are inference tensors: ``grad=False`` scores under ``no_grad``, and a downstream
    backward through anything that saved them works; ``grad=True`` keeps the graph.

    Example:
        >>> from transformers import LlamaConfig, LlamaForSequenceClassification
        >>> from posttrain.testing import llm_batch
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                   num_hidden_layers=1, num_attention_heads=2, num_labels=1,
        ...                   pad_token_id=0)
        >>> rm = hf_reward_model(LlamaForSequenceClassification(cfg))
        >>> rm(llm_batch(3, 6, vocab_size=64))["next", "reward"].shape
        torch.Size([3])
    """

    kind = getattr(getattr(model, "config", None), "model_type", "")
    if kind in _ENCODERS:
        raise ValueError(
            f"hf_reward_model: {kind!r} is an encoder (it reads the first token and offsets "
            "positions); only decoder-only sequence classifiers (read at the last token) are "
            "supported"
        )

    def score(td: TensorDictBase) -> torch.Tensor:
        shape, toks, _ = sequences(td, layout)
        empty = [i for i, t in enumerate(toks) if t.numel() == 0]
        if empty:
            raise ValueError(
                f"{key_str(layout.key('attention_mask'))}: items {empty} have no real token to score"
            )
        if not toks:
            return torch.zeros(shape)
        device = next(model.parameters()).device
        width = max(t.numel() for t in toks)
        ids = torch.zeros(len(toks), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(toks), width, dtype=torch.long, device=device)
        for i, t in enumerate(toks):
            ids[i, width - t.numel() :] = t
            mask[i, width - t.numel() :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        with (
            torch.set_grad_enabled(grad and torch.is_grad_enabled()),
            _some_pad_id(model),
            _quiet(model),
        ):
            embeds = model.get_input_embeddings()(ids)
            out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions)
        scores = getattr(out, "logits", None)
        if scores is None:
            scores = getattr(out, "rewards", out)
        if not isinstance(scores, torch.Tensor):
            raise TypeError(
                f"reward model output: expected `logits` or `rewards`, found {type(out).__name__}"
            )
        if scores.ndim == 2 and scores.shape[-1] == 1:
            scores = scores[:, 0]
        if scores.shape != (len(toks),):
            raise ValueError(
                f"reward model output: expected one score per sequence, shape ({len(toks)},) "
                f"or ({len(toks)}, 1); found {tuple(scores.shape)} (num_labels must be 1)"
            )
        return scores.float().reshape(shape)

    return RewardModule(score, layout=layout, name=_model_name(model))


def _model_name(model: Any) -> str:
    # As TRL names a model reward function: the last part of its name or path.
    path = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    return path.rstrip("/").split("/")[-1] or type(model).__name__


@contextlib.contextmanager
def _quiet(model: Any) -> Iterator[None]:
    # Fed embeddings, HF classifiers warn that they "will not detect padding tokens": this
    # adapter left-packs and reads the last position itself, so the warning says nothing here.
    import logging

    names = {"transformers.modeling_layers", type(model).__module__}
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


_ENCODERS = frozenset(
    {"bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "distilbert", "electra",
     "albert", "modernbert", "camembert"}
)  # fmt: skip


@contextlib.contextmanager
def _some_pad_id(model: Any) -> Iterator[None]:
    # Fed embeddings, HF classifiers read position -1, but refuse a batch > 1 when the config
    # has no pad id at all; any id will do, it is never compared with a token.
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    if text is None or getattr(text, "pad_token_id", 0) is not None:
        yield
        return
    text.pad_token_id = 0
    try:
        yield
    finally:
        text.pad_token_id = None


TRLRewardFunc = Callable[
    ..., Sequence[float | None] | Awaitable[Sequence[float | None]]
]  # TRL 1.16 takes both


def trl_reward(
    func: TRLRewardFunc,
    tokenizer: Any,
    *,
    layout: Layout = LLM_LAYOUT_V1,
    conversational: bool = False,
    trainer_state: Any = None,
    **kwargs: Any,
) -> RewardModule:
    """A TRL reward function as a contract reward: TRL 1.16's reward-function protocol, whole.

    The function is called as GRPOTrainer calls it: ``f(prompts=, completions=,
    completion_ids=, prompt_ids=, trainer_state=, log_extra=, log_metric=, **kwargs)``, sync
    or ``async`` (awaited here; in a worker thread when an event loop already runs). The
    prompt is the real tokens before the assistant span and the completion the span (one
    span per item: multi-turn items are refused), decoded with ``tokenizer`` as GRPOTrainer
    does (completions without special tokens). ``conversational=True`` hands them as TRL's
    conversational format: ``[{"role": "user", "content": prompt}]`` and
    ``[{"role": "assistant", "content": completion}]``. ``trainer_state`` defaults to a fresh
    ``transformers.TrainerState`` (step 0); what the function logs lands in the module's
    ``extra_logs`` / ``logged_metrics``, which hold the latest trainer step's logs only (the
    latest call's without ``trainer_state``). ``None`` rewards become NaN (TRL's "unscored").
    Extra ``kwargs`` (dataset columns, one value per item) are passed on.

    Example:
        >>> from posttrain.testing import llm_batch
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.adapters._hf import word_level_tokenizer
        >>> async def n_tokens(completion_ids, trainer_state, log_metric, **kw):
        ...     log_metric("step", float(trainer_state.global_step))
        ...     return [float(len(c)) for c in completion_ids]
        >>> rm = trl_reward(n_tokens, word_level_tokenizer(tiny_causal_lm().config))
        >>> td = rm(llm_batch(2, 6, vocab_size=64))
        >>> td["next", "reward"].tolist() == td["masks", "all_assistant_mask"].sum(-1).float().tolist()
        True
        >>> rm.name, rm.logged_metrics
        ('n_tokens', {'step': [0.0]})
    """
    name = _callable_name(func)

    def score(td: TensorDictBase) -> torch.Tensor:
        shape, prompt_ids, completion_ids = _prompt_completion_ids(td, layout)
        prompts, completions = _texts(tokenizer, prompt_ids, completion_ids, conversational)
        state = trainer_state if trainer_state is not None else _fresh_state()
        step = None if trainer_state is None else int(trainer_state.global_step)
        if step is None or step != module._logs_step:
            module.extra_logs.clear()
            module.logged_metrics.clear()
        module._logs_step = step
        out = func(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            prompt_ids=prompt_ids,
            trainer_state=state,
            log_extra=lambda column, values: module.extra_logs.setdefault(column, []).extend(
                values
            ),
            log_metric=lambda metric, value: module.logged_metrics.setdefault(metric, []).append(
                float(value)
            ),
            **kwargs,
        )
        if inspect.isawaitable(out):
            out = _await(out)
        values = list(out)
        if len(values) != len(prompt_ids):
            raise ValueError(
                f"reward function {name!r}: expected {len(prompt_ids)} rewards, found {len(values)}"
            )
        return torch.tensor(
            [math.nan if v is None else float(v) for v in values], dtype=torch.float32
        ).reshape(shape)

    module = RewardModule(score, layout=layout, name=name)
    return module


def _prompt_completion_ids(
    td: TensorDictBase, layout: Layout
) -> tuple[torch.Size, list[list[int]], list[list[int]]]:
    """The reward's shape and each item's prompt ids (the real tokens before its assistant
    span) and completion ids (the span); an item of several spans is refused."""
    shape, toks, assts = sequences(td, layout)
    prompt_ids, completion_ids = [], []
    for i, (t, a) in enumerate(zip(toks, assts, strict=True)):
        span = a.nonzero()[:, 0]
        first = int(span[0]) if span.numel() else len(t)
        if span.numel() and int(span[-1]) - first + 1 != span.numel():
            raise ValueError(
                f"item {i}: the assistant mask is not one span (multi-turn); TRL's "
                "(prompt, completion) pair cannot hold it"
            )
        prompt_ids.append(t[:first].tolist())
        completion_ids.append(t[first : first + span.numel()].tolist())
    return shape, prompt_ids, completion_ids


def _texts(
    tokenizer: Any,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    conversational: bool,
) -> tuple[list[Any], list[Any]]:
    """Prompts and completions decoded as GRPOTrainer hands them to a reward function."""
    prompts: list[Any] = tokenizer.batch_decode(prompt_ids)
    # As GRPOTrainer decodes completions for its reward functions.
    completions: list[Any] = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    return prompts, completions


def _callable_name(func: Any) -> str:
    # TRL's get_callable_name: partials unwrapped, instances by their class.
    while isinstance(func, functools.partial):
        func = func.func
    return str(getattr(func, "__name__", type(func).__name__))


def _fresh_state() -> Any:
    with optional_deps():
        from transformers import TrainerState
    return TrainerState()


def _await(awaitable: Any) -> Any:
    """The result of ``awaitable``, run to completion from synchronous code."""

    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    # A loop already runs in this thread (a notebook, an async caller): run it beside it.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


RewardFunc = Callable[..., list[float | None]]
ContractReward = Callable[[TensorDictBase], TensorDictBase]


@overload
def trl_reward_func(
    reward: ContractReward,
    tokenizer: Any,
    *,
    layout: Layout = LLM_LAYOUT_V1,
    name: str | None = None,
) -> RewardFunc: ...


@overload
def trl_reward_func(
    reward: list[ContractReward] | tuple[ContractReward, ...],
    tokenizer: Any,
    *,
    layout: Layout = LLM_LAYOUT_V1,
    name: None = None,
) -> list[RewardFunc]: ...


def trl_reward_func(
    reward: ContractReward | list[ContractReward] | tuple[ContractReward, ...],
    tokenizer: Any,
    *,
    layout: Layout = LLM_LAYOUT_V1,
    name: str | None = None,
) -> RewardFunc | list[RewardFunc]:
    """A contract reward as an entry of TRL's ``reward_funcs`` (a list of them: the list).

    Each (prompt, completion) pair becomes one item of a ragged LLM-layout batch: prompt ids
    from TRL's ``prompt_ids`` column when the trainer passes one (a ``rollout_func`` or a
    dataset column), else the prompt text tokenized without special tokens; the assistant
    mask covers ``completion_ids``. Conversational prompts (lists of messages) go through the
    tokenizer's chat template with a generation prompt, as GRPOTrainer tokenizes them. TRL's
    other keyword arguments (``trainer_state``, ``log_extra``, columns) are accepted and
    ignored. The name TRL logs each reward under is ``name``, else the reward's ``name``
    (``hf_reward_model``: the model's name). Pass the list you hand to ``reward_funcs=`` to
    get names unique within it: a name already taken earlier in the list gets ``_2``,
    ``_3`` ... in list order, so two reward models never share a log column and the same list
    always gets the same names, whatever was wrapped before.

    Example:
        >>> from posttrain.testing import tiny_causal_lm
        >>> from posttrain.adapters._hf import word_level_tokenizer
        >>> tok = word_level_tokenizer(tiny_causal_lm().config)
        >>> lengths = RewardModule(lambda td: td["masks", "all_assistant_mask"].sum(-1))
        >>> f = trl_reward_func(lengths, tok, name="length")
        >>> f(prompts=["t5 t6"], completions=["t7 t8 t9"], completion_ids=[[7, 8, 9]])
        [3.0]
        >>> both = trl_reward_func([RewardModule(len, name="rm"), RewardModule(len, name="rm")], tok)
        >>> [f.__name__ for f in both]
        ['rm', 'rm_2']
    """
    if isinstance(reward, list | tuple):
        if name is not None:
            raise ValueError("name: a list of rewards takes each reward's own name; pass name=None")
        funcs = [_reward_func(r, tokenizer, layout, _reward_name(r)) for r in reward]
        for f, unique in zip(funcs, _unique(f.__name__ for f in funcs), strict=True):
            f.__name__ = unique
        return funcs
    return _reward_func(reward, tokenizer, layout, name or _reward_name(reward))


def _reward_name(reward: Any) -> str:
    return str(getattr(reward, "name", None) or _callable_name(reward))


def _reward_func(reward: ContractReward, tokenizer: Any, layout: Layout, name: str) -> RewardFunc:
    def func(
        prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any
    ) -> list[float | None]:
        prompt_ids = kw.get("prompt_ids")
        if prompt_ids is None:
            if all(isinstance(p, str) for p in prompts):
                prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
            else:  # conversational: TRL's own call (chat template, generation prompt)
                prompt_ids = [
                    list(
                        tokenizer.apply_chat_template(
                            p, add_generation_prompt=True, tokenize=True, return_dict=True
                        )["input_ids"]
                    )
                    for p in prompts
                ]
        items = []
        for p, c in zip(prompt_ids, completion_ids, strict=True):
            n, m = len(p), len(c)
            items.append(
                TensorDict(
                    {
                        layout.key("tokens"): torch.tensor([*p, *c], dtype=torch.long),
                        layout.key("attention_mask"): torch.ones(n + m, dtype=torch.bool),
                        layout.key("assistant_mask"): torch.arange(n + m) >= n,
                    },
                    batch_size=[],
                )
            )
        td = LazyStackedTensorDict.lazy_stack(items, 0)
        with torch.no_grad():
            out = reward(td)
        values: list[float | None] = out.get(layout.key("reward")).tolist()
        return values

    func.__name__ = name
    return func


def _unique(names: Iterable[str]) -> list[str]:
    # TRL logs each reward function under its name: two reward models both called
    # "RewardModule" would write one column. A name taken earlier in the list gets a suffix.
    seen: collections.Counter[str] = collections.Counter()
    taken: set[str] = set()
    out = []
    for name in names:
        seen[name] += 1
        unique = name if seen[name] == 1 else f"{name}_{seen[name]}"
        while unique in taken:  # "rm_2" given by the user, then a second "rm"
            seen[name] += 1
            unique = f"{name}_{seen[name]}"
        taken.add(unique)
        out.append(unique)
    return out
