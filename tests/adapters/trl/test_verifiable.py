"""GRPOTrainer on prompts from a replay buffer, TRL's default generation path, with a tokenizer
that adds BOS and a ground-truth column reaching a verifiable reward (CPU, tiny model)."""

from __future__ import annotations

import collections
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.trl import RewardModule, prompt_dataset, trl_reward_func
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import tiny_causal_lm

K = LLM_LAYOUT_V1.key
BOS = 1
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Stored as a BOS-adding tokenizer wrote them: one BOS, prompt words, then the answer.
PROMPTS = [[BOS, 8, 9], [BOS, 10, 11, 12], [BOS, 13], [BOS, 14, 15]]


def bos_tokenizer() -> Any:
    """The word-level tokenizer with a post-processor that prepends BOS (as Llama's does)."""
    from tokenizers import processors

    tok = word_level_tokenizer(tiny_causal_lm().config)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tok.padding_side = "left"
    return tok


def _item(prompt: list[int], answer: list[int], solution: str) -> TensorDict:
    n, m = len(prompt), len(answer)
    td = TensorDict(
        {
            K("tokens"): torch.tensor(prompt + answer),
            K("attention_mask"): torch.ones(n + m, dtype=torch.bool),
            K("assistant_mask"): torch.arange(n + m) >= n,
        },
        batch_size=[],
    )
    td.set("solution", NonTensorData(solution))
    return td


def _buffer(storage: str) -> Any:
    from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    items = [_item(p, [20, 21], f"t{30 + i}") for i, p in enumerate(PROMPTS)]
    if storage == "stack":
        rb = ReplayBuffer(storage=LazyStackStorage(8), sampler=SamplerWithoutReplacement())
        rb.extend(LazyStackedTensorDict.lazy_stack(items, 0))
    else:  # one width: right-pad answers so the items stack densely
        width = max(len(p) for p in PROMPTS) + 2
        dense = []
        for x in items:
            n = x.get(K("tokens")).numel()
            pad = width - n
            y = TensorDict(
                {
                    K("tokens"): torch.nn.functional.pad(x.get(K("tokens")), (0, pad)),
                    K("attention_mask"): torch.arange(width) < n,
                    K("assistant_mask"): torch.nn.functional.pad(
                        x.get(K("assistant_mask")), (0, pad)
                    ),
                },
                batch_size=[],
            )
            y.set("solution", x.get("solution"))
            dense.append(y)
        rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=SamplerWithoutReplacement())
        rb.extend(torch.stack(dense))
    return rb


def test_prompt_text_leaves_out_the_bos_the_tokenizer_adds_back() -> None:
    tok = bos_tokenizer()
    rows = list(prompt_dataset(_buffer("stack"), tok, 4, columns={"solution": "solution"}))
    assert sorted(tuple(r["prompt_ids"]) for r in rows) == sorted(map(tuple, PROMPTS))
    for r in rows:
        assert not r["prompt"].startswith("<s>")
        assert tok(r["prompt"])["input_ids"] == r["prompt_ids"]  # TRL's call gives them back
        assert r["solution"] == f"t{30 + PROMPTS.index(r['prompt_ids'])}"


def test_a_prompt_the_tokenizer_cannot_give_back_warns_once() -> None:
    tok = bos_tokenizer()
    rb = _buffer("stack")
    rb.extend(LazyStackedTensorDict.lazy_stack([_item([8, 9], [20], "x")], 0))  # no BOS stored
    ds = prompt_dataset(rb, tok, 5)
    with pytest.warns(UserWarning, match="does not survive decode"):
        rows = list(ds)
    assert [r["prompt_ids"] for r in rows if r["prompt_ids"][0] != BOS] == [[8, 9]]
    assert ds.posttrain_mismatched == [[8, 9]] * ds.posttrain_decode_stats["mismatched"]


@pytest.mark.parametrize("storage", ["stack", "tensor"])
def test_grpo_generates_from_the_stored_ids_and_the_solution_reaches_the_reward(
    storage: str, tmp_path: Path
) -> None:
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    tok = bos_tokenizer()
    prompts = prompt_dataset(
        _buffer(storage), tok, 2, num_batches=2, columns={"solution": "solution"}
    )
    generated: list[list[int]] = []
    scored: list[list[int]] = []
    seen: list[tuple[list[int], str, int]] = []

    def correct(
        completions: list[str], solution: list[str], prompt_ids: list[list[int]], **kw: Any
    ) -> list[float | None]:
        # A verifiable reward written for TRL: the ground truth arrives as a dataset column.
        state = kw["trainer_state"]
        seen.extend(
            (list(p), s, int(state.global_step)) for p, s in zip(prompt_ids, solution, strict=True)
        )
        return [float(s in c.split()) for c, s in zip(completions, solution, strict=True)]

    def record(td: Any) -> torch.Tensor:
        for x in td.tensordicts:
            t, a = x.get(K("tokens")), x.get(K("assistant_mask"))
            scored.append(t[~a].tolist())
        return torch.zeros(td.batch_size)

    model = tiny_causal_lm()
    generate = model.generate

    def recording_generate(*args: Any, **kwargs: Any) -> Any:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"].bool()
        generated.extend(row[m].tolist() for row, m in zip(ids, mask, strict=True))
        return generate(*args, **kwargs)

    model.generate = recording_generate
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=3,
        shuffle_dataset=False,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[correct, trl_reward_func(RewardModule(record), tok, name="scored")],
            args=args,
            train_dataset=prompts,
            processing_class=tok,
        )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2
    assert all(math.isfinite(x) for x in losses)
    stored = sorted(map(tuple, PROMPTS))
    # Each stored prompt generated twice (one group), from its ids exactly: one BOS, not two.
    assert sorted(map(tuple, generated)) == sorted(stored * 2)
    assert sorted(map(tuple, scored)) == sorted(map(tuple, generated))  # scored = generated
    assert sorted((tuple(p), s) for p, s, _ in seen) == sorted(
        (tuple(p), f"t{30 + i}") for i, p in enumerate(PROMPTS) for _ in range(2)
    )
    assert [g for _, _, g in seen] == [0] * 4 + [1] * 4  # trainer_state reached the reward


def test_the_text_to_ids_map_stays_bounded_on_an_endless_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from posttrain.adapters.trl import dataset as dataset_module

    monkeypatch.setattr(dataset_module, "PROMPT_IDS_KEPT", 3)
    tok = bos_tokenizer()
    # Every other prompt is stored without the BOS the tokenizer adds: its text does not
    # give its ids back, so only a map can. The others round-trip and need no entry.
    items = [_item([10 + i] if i % 2 else [BOS, 10 + i], [40], "s") for i in range(20)]
    ds = prompt_dataset(_Cycle(items), tok, 4, num_batches=None)  # type: ignore[arg-type]
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for row in ds:
            rows.append(row)
            assert len(ds.posttrain_prompt_ids) <= 3  # never more, however long the stream
            if len(rows) == 60:
                break
    known = ds.posttrain_prompt_ids
    assert list(known.values()) == [[25], [27], [29]]  # the latest mismatched ones
    assert ds.posttrain_decode_stats["mismatched"] == 30
    assert ds.posttrain_decode_stats["evicted"] == 27  # 30 new keys through a map of 3
    assert ds.posttrain_decode_stats["collided"] == 0  # each text has one stored prompt
    # No doubled BOS from the map or without it: a known text gives its stored ids, a text
    # that round-trips gives its ids by tokenizing it (CaptureRollouts' fallback).
    for row in rows[-6:]:  # the map's window: 3 mismatched prompts, 3 that round-trip
        ids = known.get(row["prompt"]) or tok(row["prompt"])["input_ids"]
        assert ids == row["prompt_ids"]
        assert ids.count(BOS) <= 1


def test_the_map_counts_what_it_drops() -> None:
    from posttrain.adapters.trl.dataset import _Recent

    stats: collections.Counter[str] = collections.Counter()
    known = _Recent(2, stats)
    known["a"], known["b"], known["c"] = [1], [2], [3]
    assert list(known) == ["b", "c"]
    assert stats["evicted"] == 1


class _Cycle:
    """A buffer whose samples walk its items in order, round and round (an endless stream)."""

    def __init__(self, items: list[TensorDict]) -> None:
        self.items, self.next = items, 0

    def sample(self, n: int) -> Any:
        out = [self.items[(self.next + i) % len(self.items)] for i in range(n)]
        self.next += n
        return LazyStackedTensorDict.lazy_stack(out, 0)
