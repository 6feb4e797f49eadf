"""Rewards across the TRL seam (posttrain.adapters.trl.reward)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl import RewardModule, hf_reward_model, trl_reward, trl_reward_func
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import tiny_causal_lm, tiny_reward_model

K = LLM_LAYOUT_V1.key
SEQS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 0], [3, 4, 5]]  # the third ends in pad id 0
PROMPT = 2


def _alone(model: Any, seq: list[int]) -> float:
    """The reference: one sequence, no padding, read at its last token."""
    pad = model.config.pad_token_id
    model.config.pad_token_id = None  # batch of one: HF then reads position -1
    try:
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([seq])).logits[0, 0])
    finally:
        model.config.pad_token_id = pad


def _item(seq: list[int], width: int | None = None, left: bool = False) -> dict[Any, torch.Tensor]:
    n = len(seq)
    w = width or n
    tokens = torch.full((w,), 63)  # pads hold a real token id: only the mask says "pad"
    attn = torch.zeros(w, dtype=torch.bool)
    span = slice(w - n, w) if left else slice(0, n)
    tokens[span] = torch.tensor(seq)
    attn[span] = True
    asst = attn.clone()
    asst[span.start : span.start + PROMPT] = False
    return {K("tokens"): tokens, K("attention_mask"): attn, K("assistant_mask"): asst}


def _dense(seqs: list[list[int]], *, left: bool = False, shape: tuple[int, ...] = ()) -> TensorDict:
    w = max(map(len, seqs))
    items = [_item(s, w, left) for s in seqs]
    td = TensorDict({k: torch.stack([it[k] for it in items]) for k in items[0]}, [len(seqs)])
    return td.reshape(*shape) if shape else td


def _ragged(seqs: list[list[int]]) -> LazyStackedTensorDict:
    return LazyStackedTensorDict.lazy_stack([TensorDict(_item(s), []) for s in seqs], 0)


@pytest.mark.parametrize("form", ["right", "left", "ragged", "batch_dims"])
def test_hf_reward_reads_each_sequence_at_its_last_real_token(form: str) -> None:
    model = tiny_reward_model()
    expected = torch.tensor([_alone(model, s) for s in SEQS])
    td = {
        "right": lambda: _dense(SEQS),
        "left": lambda: _dense(SEQS, left=True),
        "ragged": lambda: _ragged(SEQS),
        "batch_dims": lambda: _dense(SEQS, shape=(2, 2)),
    }[form]()
    out = hf_reward_model(model)(td).get(K("reward"))
    assert out.dtype == torch.float32
    assert out.shape == td.batch_size
    torch.testing.assert_close(out.reshape(-1), expected, atol=1e-5, rtol=1e-5)


def test_torchrl_wrapper_misreads_a_sequence_ending_in_the_pad_id() -> None:
    # The deviation this adapter fixes (docs/examples/trl.md): HF's pad-id heuristic.
    from torchrl.modules.llm.trl_interop import HFRewardModelWrapper

    model = tiny_reward_model()
    td = _dense(SEQS)
    td.set(K("tokens"), torch.where(td.get(K("attention_mask")), td.get(K("tokens")), 0))
    theirs = HFRewardModelWrapper(model)(td.clone()).get("reward")
    ours = hf_reward_model(model)(td).get(K("reward"))
    assert abs(float(ours[2]) - _alone(model, SEQS[2])) < 1e-5
    assert abs(float(theirs[2].detach()) - _alone(model, SEQS[2])) > 1e-4


def test_rewards_are_never_inference_tensors_and_a_downstream_backward_works() -> None:
    # Regression for the bug found in review of torchrl PR #4070 (rewards made under
    # inference_mode cannot be saved for backward).
    model = tiny_reward_model()
    reward = hf_reward_model(model)(_dense(SEQS)).get(K("reward"))
    assert not reward.is_inference()
    assert not reward.requires_grad
    logp = torch.zeros(len(SEQS), requires_grad=True)
    ((reward - reward.mean()) * logp).sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, reward - reward.mean())


def test_grad_true_keeps_the_graph_to_the_reward_model() -> None:
    model = tiny_reward_model()
    reward = hf_reward_model(model, grad=True)(_ragged(SEQS)).get(K("reward"))
    reward.sum().backward()
    assert model.score.weight.grad is not None
    assert model.score.weight.grad.abs().sum() > 0


def test_bad_reward_inputs_fail_clearly_and_write_nothing() -> None:
    model = tiny_reward_model()
    td = _dense(SEQS)
    td.get(K("attention_mask"))[1] = False
    with pytest.raises(ValueError, match=r"all_attention_mask'\): items \[1\] have no real token"):
        hf_reward_model(model)(td)
    assert K("reward") not in td.keys(include_nested=True)
    with pytest.raises(KeyError, match=r"reward needs key \('masks', 'all_assistant_mask'\)"):
        hf_reward_model(model)(_dense(SEQS).exclude(K("assistant_mask")))
    two = tiny_reward_model()
    two.config.num_labels = 2
    two.score = torch.nn.Linear(32, 2, bias=False)
    with pytest.raises(ValueError, match=r"one score per sequence.*found \(4, 2\)"):
        hf_reward_model(two)(_dense(SEQS))


def _tokenizer() -> Any:
    return word_level_tokenizer(tiny_causal_lm().config)


def completion_length(
    prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any
) -> list[float | None]:
    return [
        None if not ids else float(len(ids)) + 0.5 * len(p.split())
        for p, ids in zip(prompts, completion_ids, strict=True)
    ]


def test_trl_reward_function_as_contract_reward() -> None:
    # SEQS[1] is a prompt alone: the function returns None, TRL's "unscored", read as NaN.
    reward = trl_reward(completion_length, _tokenizer())(_ragged(SEQS)).get(K("reward"))
    assert torch.isnan(reward[1])
    expected = [len(s) - PROMPT + 0.5 * PROMPT for s in SEQS]
    assert [reward[i].item() for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]

    def bad(**kw: Any) -> list[float]:
        return [1.0]

    module = trl_reward(bad, _tokenizer())
    with pytest.raises(ValueError, match="reward function 'bad': expected 4 rewards, found 1"):
        module(_dense(SEQS))


def test_contract_reward_as_trl_reward_func_both_ways_agree() -> None:
    tok = _tokenizer()
    func = trl_reward_func(trl_reward(completion_length, tok), tok, name="length")
    assert func.__name__ == "length"
    prompts = ["t5 t6", "t9 t10"]
    completion_ids = [[7, 8, 9], [11]]
    completions = tok.batch_decode(completion_ids)
    direct = completion_length(prompts, completions, completion_ids)
    assert func(prompts=prompts, completions=completions, completion_ids=completion_ids) == direct
    via_ids = func(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        prompt_ids=[[5, 6], [9, 10]],
    )
    assert via_ids == direct
    rm = trl_reward_func(hf_reward_model(tiny_reward_model()), tok)
    scores = rm(prompts=prompts, completions=completions, completion_ids=completion_ids)
    assert scores[0] == pytest.approx(_alone(tiny_reward_model(), [5, 6, 7, 8, 9]), abs=1e-5)
    # Conversational prompts: TRL's chat-template call (a generation prompt, here "t3").
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t3{% endif %}"
    )
    seen: list[list[int]] = []

    def record(td: Any) -> torch.Tensor:
        seen.extend(x.get(K("tokens")).tolist() for x in td.tensordicts)
        return torch.zeros(td.batch_size)

    chat = trl_reward_func(RewardModule(record), tok)
    chat(
        prompts=[[{"role": "user", "content": "t5 t6"}]],
        completions=[[{"role": "assistant", "content": "t7"}]],
        completion_ids=[[7]],
    )
    assert seen == [[5, 6, 3, 7]]


def test_reward_model_without_a_pad_id_and_encoders() -> None:
    model = tiny_reward_model()
    expected = torch.tensor([_alone(model, s) for s in SEQS])
    model.config.pad_token_id = None
    out = hf_reward_model(model)(_dense(SEQS)).get(K("reward"))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert model.config.pad_token_id is None
    from transformers import BertConfig, BertForSequenceClassification

    make_cfg: Any = BertConfig
    cfg = make_cfg(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=1,
    )  # fmt: skip
    bert: Any = BertForSequenceClassification
    with pytest.raises(ValueError, match="'bert' is an encoder"):
        hf_reward_model(bert(cfg))


def test_trl_reward_refuses_multi_turn_items_and_decodes_like_trl() -> None:
    td = _ragged(SEQS)
    asst = td.tensordicts[0].get(K("assistant_mask"))
    asst[3] = False  # [F, F, T, F]: then a second span would start after it
    td.tensordicts[0].get(K("tokens"))[2] = 2  # EOS inside the completion: skipped as TRL does
    seen: list[str] = []

    def record(completions: list[str], **kw: Any) -> list[float | None]:
        seen.extend(completions)
        return [0.0] * len(completions)

    trl_reward(record, _tokenizer())(td)
    assert seen[0] == ""  # "</s>" decoded without special tokens
    asst[3] = True
    asst[2] = False
    asst[1] = True  # [F, T, F, T]: two spans
    with pytest.raises(ValueError, match="item 0: the assistant mask is not one span"):
        trl_reward(record, _tokenizer())(td)


async def verifiable(
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    trainer_state: Any,
    log_extra: Any,
    log_metric: Any,
    solution: list[str],
    **kwargs: Any,
) -> list[float | None]:
    """Written for TRL 1.16: async, reads trainer_state, logs a column and a metric."""
    log_extra("solution", solution)
    log_metric("step", float(trainer_state.global_step))
    return [
        float(s in c.split()) if c else None for c, s in zip(completions, solution, strict=True)
    ]


def test_a_trl_1_16_reward_function_runs_unchanged_sync_async_and_inside_an_event_loop() -> None:
    import asyncio

    from transformers import TrainerState

    tok = word_level_tokenizer(tiny_causal_lm().config)
    items = [_item([5, 6, 7, 8]), _item([5, 6, 9, 10])]  # completions "t7 t8" / "t9 t10"
    td = LazyStackedTensorDict.lazy_stack([TensorDict(x, batch_size=[]) for x in items], 0)
    state = TrainerState()
    state.global_step = 3
    rm = trl_reward(verifiable, tok, trainer_state=state, solution=["t8", "t3"])
    assert rm.name == "verifiable"
    assert rm(td).get(K("reward")).tolist() == [1.0, 0.0]
    assert rm.extra_logs == {"solution": ["t8", "t3"]}
    assert rm.logged_metrics == {"step": [3.0]}
    rm(td)  # the same step: its logs add up
    assert rm.logged_metrics == {"step": [3.0, 3.0]}
    state.global_step = 4
    for _ in range(3):
        rm(td)  # a new step starts afresh: the logs stay one step long
    assert rm.logged_metrics == {"step": [4.0] * 3}
    assert rm.extra_logs == {"solution": ["t8", "t3"] * 3}

    async def inside_a_loop() -> list[float]:
        out: list[float] = rm(td.clone()).get(K("reward")).tolist()
        return out

    assert asyncio.run(inside_a_loop()) == [1.0, 0.0]
    seen: list[Any] = []

    def chat(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        seen.append((prompts[0], completions[0]))
        return [0.0] * len(prompts)

    trl_reward(chat, tok, conversational=True)(td)
    assert seen[0][1] == [{"role": "assistant", "content": "t7 t8"}]
    assert seen[0][0][0]["role"] == "user"


def test_reward_functions_get_distinct_names_and_hf_scoring_is_quiet(
    capfd: pytest.CaptureFixture[str],
) -> None:
    tok = word_level_tokenizer(tiny_causal_lm().config)
    a, b = trl_reward_func([hf_reward_model(tiny_reward_model()) for _ in range(2)], tok)
    assert (a.__name__, b.__name__) == (
        "LlamaForSequenceClassification",
        "LlamaForSequenceClassification_2",
    )
    assert trl_reward_func(hf_reward_model(tiny_reward_model()), tok, name="rm").__name__ == "rm"
    rm = hf_reward_model(tiny_reward_model())
    td = LazyStackedTensorDict.lazy_stack(
        [TensorDict(_item([5, 6, 7, 8]), batch_size=[]), TensorDict(_item([5, 9]), batch_size=[])],
        0,
    )
    capfd.readouterr()
    for _ in range(2):
        rm(td.clone())
    out, err = capfd.readouterr()
    assert "padding" not in out + err


def test_reward_names_depend_on_the_list_alone_not_on_earlier_wraps() -> None:
    tok = word_level_tokenizer(tiny_causal_lm().config)

    def names(rewards: list[Any]) -> list[str]:
        return [f.__name__ for f in trl_reward_func(rewards, tok)]

    def rm(name: str | None = None) -> RewardModule:
        return RewardModule(lambda td: td["masks", "all_assistant_mask"].sum(-1), name=name)

    first = names([rm("rm"), rm("rm"), rm("judge"), rm("rm")])
    for _ in range(3):  # wrapping again, for another trainer, gives the same names
        assert names([rm("rm"), rm("rm"), rm("judge"), rm("rm")]) == first
    assert first == ["rm", "rm_2", "judge", "rm_3"]
    assert names([rm("rm_2"), rm("rm"), rm("rm")]) == ["rm_2", "rm", "rm_3"]  # no clash
    assert trl_reward_func(rm(), tok).__name__ == trl_reward_func(rm(), tok).__name__ == "<lambda>"
    with pytest.raises(ValueError, match="name"):
        trl_reward_func([rm()], tok, name="x")  # type: ignore[call-overload]
    # A list runs as TRL runs it: each entry scores the pairs on its own.
    scores = [
        f(prompts=["t5"], completions=["t7 t8"], completion_ids=[[7, 8]])
        for f in trl_reward_func([rm("a"), rm("b")], tok)
    ]
    assert scores == [[2.0], [2.0]]
