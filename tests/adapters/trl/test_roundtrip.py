"""The issue's round trips, with real TRL trainers, TorchRL's LLMCollector and HF models (CPU).

1. "TRL trainer with TorchRL buffer": a TorchRL ReplayBuffer filled by a real LLMCollector
   (ragged) feeds GRPOTrainer and SFTTrainer through the adapter.
2. "TorchRL GRPO with HF reward model": TorchRL's GRPOLoss trains a tiny policy with rewards
   from a locally built sequence-classification model through the adapter.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters._layout import to_padded
from posttrain.adapters.torchrl.loss import make_loss
from posttrain.adapters.torchrl.rollout import llm_collector
from posttrain.adapters.trl import (
    CaptureRollouts,
    hf_reward_model,
    prompt_dataset,
    sft_dataset,
    trl_reward_func,
)
from posttrain.adapters.trl.dataset import IGNORE_INDEX
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import tiny_causal_lm, tiny_reward_model

K = LLM_LAYOUT_V1.key
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15], [16], [17, 18, 19], [20, 21], [22]]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def collected() -> list[TensorDictBase]:
    """One ragged batch from a real LLMCollector over eight distinct prompts of different lengths."""
    torch.manual_seed(0)
    src = llm_collector(tiny_causal_lm(), PROMPTS, 1, max_new_tokens=4, adapted=True)
    batches = [b for b in src]
    src.shutdown()
    return batches


def _torchrl_buffer(batches: list[TensorDictBase]) -> Any:
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    rb = ReplayBuffer(storage=LazyStackStorage(64), sampler=SamplerWithoutReplacement())
    for b in batches:
        rb.extend(b)
    return rb


def _real_tokens(batches: list[TensorDictBase]) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for b in batches:
        for x in b.tensordicts:
            out[tuple(x.get(K("tokens"))[x.get(K("attention_mask"))].tolist())] += 1
    return out


def _prompts(batches: list[TensorDictBase]) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for b in batches:
        for x in b.tensordicts:
            out[tuple(x.get(K("tokens"))[~x.get(K("assistant_mask"))].tolist())] += 1
    return out


def _tokenizer() -> Any:
    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.padding_side = "left"
    return tok


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def completion_words(completion_ids: list[list[int]], **kw: Any) -> list[float | None]:
    return [float(len(c)) for c in completion_ids]


def test_grpo_trainer_consumes_exactly_the_torchrl_buffer_and_its_generations_are_captured(
    collected: list[TensorDictBase], tmp_path: Path
) -> None:
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    rb = _torchrl_buffer(collected)
    n = len(rb)
    assert n == 8
    tok = _tokenizer()
    captured = ReplayBuffer(storage=LazyStackStorage(64))
    prompts = prompt_dataset(rb, tok, 4, num_batches=2)
    capture = CaptureRollouts(captured, prompt_ids=prompts)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    rm = trl_reward_func(hf_reward_model(tiny_reward_model()), tok, name="reward_model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=tiny_causal_lm(),
            reward_funcs=[rm, completion_words],
            args=args,
            train_dataset=prompts,
            processing_class=tok,
            rollout_func=capture,
        )
        trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 4
    assert all(math.isfinite(x) for x in losses)
    # Exactly the buffer's samples: each of the 8 stored prompts became one GRPO group of 2.
    assert len(captured) == 16
    assert capture.groups == 8
    got = captured.storage.get(list(range(16)))  # storage order = generation order
    groups: dict[int, list[tuple[int, ...]]] = {}
    for x in got.tensordicts:
        prompt = tuple(x.get(K("tokens"))[~x.get(K("assistant_mask"))].tolist())
        groups.setdefault(int(x.get(K("group_id"))), []).append(prompt)
    assert sorted(groups) == list(range(8))
    assert all(len(set(v)) == 1 and len(v) == 2 for v in groups.values())
    assert set(_prompts(collected).values()) == {1}  # 8 distinct prompts: no lookalikes
    assert Counter(v[0] for v in groups.values()) == _prompts(collected)
    versions = [int(x.get(K("policy_version"))) for x in got.tensordicts]
    assert versions == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    lp = got.tensordicts[0].get(K("sample_log_probs"))
    asst = got.tensordicts[0].get(K("assistant_mask"))
    assert torch.isfinite(lp[asst]).all()
    assert (lp[asst] <= 0).all()
    assert torch.isnan(lp[~asst]).all()


def test_sft_trainer_trains_on_real_tokens_of_the_torchrl_buffer_only(
    collected: list[TensorDictBase], tmp_path: Path
) -> None:
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    rb = _torchrl_buffer(collected)
    tok = _tokenizer()
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=tiny_causal_lm(),
            args=args,
            train_dataset=sft_dataset(rb, 4, num_batches=2),
            processing_class=tok,
        )
        seen: list[dict[str, torch.Tensor]] = []
        collate = trainer.data_collator

        def recording(examples: list[dict[str, Any]]) -> Any:
            batch = collate(examples)
            seen.append(batch)
            return batch

        trainer.data_collator = recording
        trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)
    rows: Counter[tuple[int, ...]] = Counter()
    for b in seen:
        attn = b["attention_mask"].bool()
        labels = b["labels"]
        assert (labels[~attn] == IGNORE_INDEX).all()  # padding never trains
        for ids, m, lab in zip(b["input_ids"], attn, labels, strict=True):
            rows[tuple(ids[m].tolist())] += 1
            assert (lab[m][: _prompt_len(ids[m], collected)] == IGNORE_INDEX).all()
    assert rows == _real_tokens(collected)  # every stored sample once, nothing else


def _prompt_len(ids: torch.Tensor, batches: list[TensorDictBase]) -> int:
    for b in batches:
        for x in b.tensordicts:
            real = x.get(K("tokens"))[x.get(K("attention_mask"))]
            if torch.equal(real, ids):
                return int((~x.get(K("assistant_mask"))).sum())
    raise AssertionError(f"row {ids.tolist()} is not in the buffer")


def test_torchrl_grpo_trains_with_an_hf_reward_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    policy = tiny_causal_lm()
    src = llm_collector(policy, [[5, 6, 7]] * 4, 3, max_new_tokens=4, adapted=True)
    reward = hf_reward_model(tiny_reward_model())
    loss_fn = make_loss("GRPOLoss", adapted=True)(policy)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    policy.train(True)
    steps = 0
    for batch in src:
        batch = reward(batch)  # one group: the same prompt answered 4 times
        r = batch.get(K("reward"))
        assert r.dtype == torch.float32
        assert r.shape == (4,)
        assert not r.is_inference()
        dense = to_padded(batch)
        adv = (r - r.mean()) / (r.std() + 1e-6)
        dense.set(K("advantage"), adv)
        opt.zero_grad()
        loss_fn(dense).get("loss_objective").backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        assert grads
        assert sum(float(g.abs().sum()) for g in grads.values()) > 0
        # The reward reaches the gradient: the opposite advantage gives the opposite gradient
        # (first step, ratio 1: the objective is linear in the advantage).
        if steps == 0:
            opt.zero_grad()
            flipped = dense.clone()
            flipped.set(K("advantage"), -adv)
            loss_fn(flipped).get("loss_objective").backward()
            for name, p in policy.named_parameters():
                if name in grads and p.grad is not None:
                    torch.testing.assert_close(p.grad, -grads[name], atol=1e-6, rtol=1e-4)
            for name, p in policy.named_parameters():
                p.grad = grads.get(name)
        opt.step()
        steps += 1
    src.shutdown()
    assert steps == 3


def _sft_args(tmp_path: Path, **kw: Any) -> Any:
    from trl.trainer.sft_config import SFTConfig

    common: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_steps": 1,
    }
    return SFTConfig(**{**common, **kw})


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_sft_packing_that_over_draws_is_refused_by_what_it_reads_and_one_sample_packs(
    collected: list[TensorDictBase], tmp_path: Path, strategy: str
) -> None:
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import SFTTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The trainer's config: packing=True over an endless stream reads 1,000 rows first.
        with pytest.raises(ValueError, match=r"250 sample calls of 4 items.*padding_free=True"):
            SFTTrainer(
                model=tiny_causal_lm(),
                args=_sft_args(tmp_path, packing=True, packing_strategy=strategy, max_length=32),
                train_dataset=sft_dataset(_torchrl_buffer(collected), 4, num_batches=None),
                processing_class=_tokenizer(),
            )
        # The behaviour, whatever the function is called: TRL's packing called directly, and
        # a batched map of the caller's own.
        endless = sft_dataset(_torchrl_buffer(collected), 4, num_batches=3)
        with pytest.raises(ValueError, match="3 sample calls"):
            pack_dataset(endless.select_columns(["input_ids", "labels"]), 32, strategy)
        with pytest.raises(ValueError, match="batch_size<=4"):
            endless.map(lambda rows: rows, batched=True)
        endless.map(lambda rows: rows, batched=True, batch_size=4)  # one sample call: fine
        # Packing one sample reads what one step trains on: allowed, and it trains.
        calls: list[int] = []
        rb = _torchrl_buffer(collected)
        sample = rb.sample

        def counted(*a: Any, **k: Any) -> Any:
            calls.append(1)
            return sample(*a, **k)

        patched: Any = rb  # the stored buffer's class varies with TorchRL's typing
        patched.sample = counted
        trainer = SFTTrainer(
            model=tiny_causal_lm(),
            args=_sft_args(tmp_path, packing=True, packing_strategy=strategy, max_length=32),
            train_dataset=sft_dataset(rb, 8),
            processing_class=_tokenizer(),
        )
        trainer.train()
    assert len(_losses(trainer)) == 1
    assert len(calls) == 1


def test_sft_padding_free_trains(collected: list[TensorDictBase], tmp_path: Path) -> None:
    from trl.trainer.sft_trainer import SFTTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=tiny_causal_lm(),
            args=_sft_args(tmp_path, padding_free=True, max_length=None),
            train_dataset=sft_dataset(_torchrl_buffer(collected), 4, num_batches=None),
            processing_class=_tokenizer(),
        )
        trainer.train()
    assert len(_losses(trainer)) == 1


# A chat template with TRL's generation markers: SFTTrainer(assistant_only_loss=True) checks
# for them, though the pre-tokenized rows never go through the template.
CHAT = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }} "
    "{% endif %}{% endfor %}"
)


def test_sft_assistant_only_loss_trains_on_the_buffers_assistant_tokens_only(
    collected: list[TensorDictBase], tmp_path: Path
) -> None:
    import copy

    from trl.trainer.sft_trainer import SFTTrainer

    tok = _tokenizer()
    tok.chat_template = CHAT
    torch.manual_seed(0)
    model = tiny_causal_lm()
    before = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=model,
            args=_sft_args(tmp_path, assistant_only_loss=True, per_device_train_batch_size=8),
            train_dataset=sft_dataset(_torchrl_buffer(collected), 8, tokenizer=tok),
            processing_class=tok,
        )
        seen: list[dict[str, torch.Tensor]] = []
        collate = trainer.data_collator

        def recording(examples: list[dict[str, Any]]) -> Any:
            seen.append(collate(examples))
            return seen[-1]

        trainer.data_collator = recording
        trainer.train()
    (batch,) = seen
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]  # messages dropped
    # Labels: the stored ids where the buffer's assistant mask holds, -100 everywhere else.
    stored = {
        tuple(x.get(K("tokens"))[x.get(K("attention_mask"))].tolist()): x.get(K("assistant_mask"))[
            x.get(K("attention_mask"))
        ]
        for b in collected
        for x in b.tensordicts
    }
    attn = batch["attention_mask"].bool()
    expected = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    for i, (ids, m) in enumerate(zip(batch["input_ids"], attn, strict=True)):
        asst = stored[tuple(ids[m].tolist())]
        expected[i, : int(m.sum())] = torch.where(asst, ids[m], IGNORE_INDEX)
    assert torch.equal(batch["labels"], expected)
    assert sorted(stored) == sorted(
        tuple(ids[m].tolist()) for ids, m in zip(batch["input_ids"], attn, strict=True)
    )
    # The logged loss is the mean next-token NLL over assistant tokens, computed here from
    # the model as it was and the buffer's masks alone.
    with torch.no_grad():
        logits = before(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = logits[:, :-1].float().log_softmax(-1)
    target = expected[:, 1:]
    keep = target != IGNORE_INDEX
    nll = -logp.gather(-1, target.clamp_min(0)[..., None])[..., 0][keep]
    assert 0 < keep.sum() < attn.sum() - len(attn)  # prompt tokens left out
    assert _losses(trainer)[0] == pytest.approx(float(nll.mean()), abs=1e-4)
