"""Replay buffers as TRL / transformers datasets (posttrain.adapters.trl.dataset)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from posttrain.adapters.trl import BufferDataset, sft_dataset
from posttrain.adapters.trl.dataset import IGNORE_INDEX, WorkerRefused
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.reference_impls import RingBuffer
from posttrain.testing import item_uids, llm_batch, ragged_llm_batch

K = LLM_LAYOUT_V1.key


def _torchrl_buffer(data: TensorDictBase, *, ragged: bool = False) -> Any:
    from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    storage = LazyStackStorage(64) if ragged else LazyTensorStorage(64)
    rb = ReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement())
    rb.extend(data)
    return rb


class Counting:
    """A buffer that counts the samples drawn from it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.drawn = 0

    def sample(self, n: int) -> Any:
        self.drawn += n
        return self.inner.sample(n)

    def extend(self, data: TensorDictBase) -> Any:
        return self.inner.extend(data)

    def __len__(self) -> int:
        return len(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.inner.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.inner.load_state_dict(state_dict)


def _sft_rows(rb: Any, n: int) -> BufferDataset:
    """What sft_dataset samples, as torch rows (sft_dataset hands them to datasets)."""
    return BufferDataset(rb, n, columns={"input_ids": K("tokens")}, shape="ragged", labels="labels")


def test_padded_rows_are_the_sampled_items_with_flattened_keys() -> None:
    data = llm_batch(8, 6)
    ds = BufferDataset(_torchrl_buffer(data), 4, num_batches=2)
    rows = list(ds)
    assert len(rows) == 8
    assert "tokens.full" in rows[0]
    assert "next.reward" in rows[0]
    uids = sorted(int(r["tokens.full"][0]) for r in rows)
    assert uids == item_uids(data)  # without replacement: each item exactly once
    by_uid = {u: i for i, u in enumerate(item_uids(data))}
    for r in rows:
        i = by_uid[int(r["tokens.full"][0])]
        assert torch.equal(r["masks.all_attention_mask"], data.get(K("attention_mask"))[i])
        assert r["next.reward"].item() == data.get(K("reward"))[i].item()


def test_labels_ignore_everything_outside_the_assistant_mask() -> None:
    data = llm_batch(6, 8)
    ds = BufferDataset(
        _torchrl_buffer(data), 6, columns={"input_ids": K("tokens")}, labels="labels"
    )
    for r in ds:
        i = item_uids(data).index(int(r["input_ids"][0]))
        asst = data.get(K("assistant_mask"))[i]
        assert torch.equal(r["labels"][asst], r["input_ids"][asst])
        assert (r["labels"][~asst] == IGNORE_INDEX).all()


@pytest.mark.parametrize("storage", ["ring", "torchrl"])
def test_sft_rows_hold_real_tokens_only(storage: str) -> None:
    data = llm_batch(6, 8)
    rb: Any = _torchrl_buffer(data) if storage == "torchrl" else RingBuffer(6)
    if storage == "ring":
        rb.extend(data)
    rows = list(_sft_rows(rb, 6))
    attn = data.get(K("attention_mask"))
    for r in rows:
        i = item_uids(data).index(int(r["input_ids"][0]))
        n = int(attn[i].sum())
        assert len(r["input_ids"]) == len(r["labels"]) == n
        assert torch.equal(r["input_ids"], data.get(K("tokens"))[i, :n])
    assert any(int(a.sum()) < 8 for a in attn)  # some rows were padded in storage


def test_ragged_storage_is_padded_per_batch_or_kept_at_its_lengths() -> None:
    lengths = [5, 9, 6, 7]
    data = ragged_llm_batch(lengths)
    rb = _torchrl_buffer(data, ragged=True)
    cols = {"input_ids": K("tokens"), "mask": K("attention_mask"), "lp": K("sample_log_probs")}
    padded = list(BufferDataset(rb, 4, columns=cols, labels="labels", pad_token_id=0))
    assert {len(r["input_ids"]) for r in padded} == {9}
    for r in padded:
        item = data.tensordicts[int(r["input_ids"][0])]
        n = lengths[int(r["input_ids"][0])]
        assert torch.equal(r["mask"][:n], item.get(K("attention_mask")))
        assert not r["mask"][n:].any()
        assert (r["input_ids"][n:] == 0).all()
        assert (r["labels"][n:] == IGNORE_INDEX).all()
        assert (r["lp"][n:] == 0).all()
    ragged = list(BufferDataset(rb, 4, columns=cols, shape="ragged"))
    real = {i: int(x.get(K("attention_mask")).sum()) for i, x in enumerate(data.tensordicts)}
    assert {int(r["input_ids"][0]): len(r["input_ids"]) for r in ragged} == real
    assert all(r["mask"].all() for r in ragged)


def test_torchrl_dataset_fails_on_the_ragged_buffer_this_one_reads() -> None:
    # Published fact (docs/examples/trl.md): torchrl 0.14's TorchRLBufferDataset indexes the
    # lazy stack LLMCollector produces and fails. If this starts passing, update the docs.
    from torchrl.modules.llm.trl_interop import TorchRLBufferDataset

    rb = _torchrl_buffer(ragged_llm_batch([5, 9, 6]), ragged=True)
    with pytest.raises(RuntimeError, match="Failed to stack tensors"):
        list(TorchRLBufferDataset(rb, 3))
    assert len(list(sft_dataset(rb, 3))) == 3
    assert len(list(_sft_rows(rb, 3))) == 3


def test_missing_key_and_bad_arguments_name_what_was_expected() -> None:
    rb = RingBuffer(4)
    rb.extend(llm_batch(4))
    with pytest.raises(KeyError, match=r"column 'x': key \('no', 'such'\) is not in the sampled"):
        list(BufferDataset(rb, 2, columns={"x": ("no", "such")}))
    with pytest.raises(ValueError, match="batch_size: expected a positive int, found 0"):
        BufferDataset(rb, 0)
    with pytest.raises(ValueError, match="shape: expected 'padded' or 'ragged', found 'dense'"):
        BufferDataset(rb, 2, shape="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="columns=None cannot declare features"):
        BufferDataset(rb, 2).as_hf_dataset(typed=True)
    assert len(rb) == 4


def test_dataloader_workers_are_refused_with_the_reason() -> None:
    rb = RingBuffer(4)
    rb.extend(llm_batch(4))
    loader = torch.utils.data.DataLoader(_sft_rows(rb, 2), batch_size=None, num_workers=1)
    with pytest.raises(WorkerRefused, match="num_workers=0"):
        next(iter(loader))
    rows = list(torch.utils.data.DataLoader(_sft_rows(rb, 2), batch_size=None))
    assert len(rows) == 2


def test_hf_dataset_draws_nothing_until_iterated_and_stays_live_through_shuffle_and_map() -> None:
    rb = Counting(RingBuffer(8))
    rb.extend(llm_batch(2, uid_start=0))
    ds = sft_dataset(rb, 2, num_batches=1)
    ds = ds.shuffle(seed=0, buffer_size=4).map(lambda r: {"n": len(r["input_ids"])})
    assert rb.drawn == 0
    rb.extend(llm_batch(6, uid_start=100))  # a later extend must be visible: no snapshot
    seen: set[int] = set()
    for _ in range(20):
        seen |= {r["input_ids"][0] for r in ds}
    assert rb.drawn == 40
    assert any(u >= 100 for u in seen)
    row = next(iter(ds))
    assert type(row["input_ids"]).__name__ == "ndarray"
    assert row["n"] == len(row["labels"])
    typed = next(iter(sft_dataset(rb, 2, typed=True)))
    assert isinstance(typed["input_ids"], list)
    assert isinstance(typed["input_ids"][0], int)


def test_rows_drawn_but_not_read_go_to_the_next_iterator_and_a_peek_costs_nothing() -> None:
    rb = Counting(RingBuffer(8))
    rb.extend(llm_batch(8))
    ds = BufferDataset(rb, 4, num_batches=2, columns={"ids": K("tokens")})
    first = next(iter(ds))  # a peek: given back
    again = next(iter(ds))
    assert rb.drawn == 4
    assert torch.equal(first["ids"], again["ids"])
    it = iter(ds)
    read = [next(it)["ids"][0].item() for _ in range(2)]
    it.close()  # two rows read, two drawn and unread: kept
    pending = ds._carry[0]
    kept = pending.cols[0][pending.start :, 0].tolist()
    assert len(kept) == 2
    full = [r["ids"][0].item() for r in ds]
    assert len(full) == 8
    assert full[:2] == kept  # the next iterator starts with them (sampling is with replacement,
    assert len(read) == 2  # so uids may repeat: compare with what was kept, not with `read`)
    assert rb.drawn == 12
    hf = sft_dataset(rb, 4, num_batches=1, typed=True)
    peeked = next(iter(hf))
    assert rb.drawn == 16
    assert next(iter(hf)) == peeked
    assert next(r["input_ids"] for r in hf) == peeked["input_ids"]
    assert rb.drawn == 16


def test_a_batch_left_by_one_value_type_is_read_by_another() -> None:
    rb = Counting(_torchrl_buffer(llm_batch(8)))  # without replacement: 8 distinct rows
    ds = BufferDataset(rb, 4, num_batches=1, columns={"ids": K("tokens")})
    it = iter(ds)
    first = [int(next(it)["ids"][0]) for _ in range(2)]
    it.close()
    rest = [int(r["ids"][0]) for r in ds.as_hf_dataset()]
    assert len(rest) == 4  # the first batch's two unread rows, then two of a new batch
    assert rb.drawn == 8
    assert len(set(first + rest)) == 6
    carried = ds._carry[0].cols[0][ds._carry[0].start :, 0].tolist()
    assert sorted(first + rest + carried) == list(range(8))  # nothing lost, nothing twice


def _with_text(n: int, *, ragged: bool) -> Any:
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack

    data = llm_batch(n, 6)
    if ragged:
        items = list(data.unbind(0))
        for i, x in enumerate(items):
            x.set("solution", NonTensorData(f"s{i}"))
            x.set("tags", NonTensorData([f"a{i}", "b"]))
        return _torchrl_buffer(LazyStackedTensorDict.lazy_stack(items, 0), ragged=True)
    data.set("solution", NonTensorStack(*[NonTensorData(f"s{i}") for i in range(n)]))
    data.set("tags", NonTensorStack(*[NonTensorData([f"a{i}", "b"]) for i in range(n)]))
    return _torchrl_buffer(data)


@pytest.mark.parametrize("ragged", [False, True], ids=["LazyTensorStorage", "LazyStackStorage"])
@pytest.mark.parametrize("shape", ["padded", "ragged"])
def test_string_and_list_leaves_reach_every_row_type(ragged: bool, shape: Any) -> None:
    rb = _with_text(4, ragged=ragged)
    cols = {"ids": K("tokens"), "solution": ("solution",), "tags": ("tags",)}
    for values in ("tensor", "numpy", "list"):
        rows = list(BufferDataset(rb, 4, columns=cols, shape=shape).rows(values))
        assert len(rows) == 4
        for r in rows:
            uid = int(r["ids"][0])
            assert r["solution"] == f"s{uid}"
            assert r["tags"] == [f"a{uid}", "b"]
    for r in BufferDataset(rb, 4, shape=shape).as_hf_dataset():  # columns=None: every leaf
        uid = int(r["tokens.full"][0])
        assert (r["solution"], r["tags"]) == (f"s{uid}", [f"a{uid}", "b"])


def test_sft_dataset_is_a_plain_hf_dataset() -> None:
    import datasets

    rb = RingBuffer(4)
    rb.extend(llm_batch(4))
    ds = sft_dataset(rb, 2)
    assert isinstance(ds, datasets.IterableDataset)
    assert not hasattr(ds, "as_hf_dataset")  # nothing of BufferDataset's own API added
    assert sorted(next(iter(ds))) == ["input_ids", "labels"]


def test_a_shuffle_buffer_that_over_draws_the_replay_buffer_warns_with_the_figure() -> None:
    rb = Counting(RingBuffer(8))
    rb.extend(llm_batch(8))
    with pytest.warns(UserWarning, match=r"500 sample calls of 2 items"):
        sft_dataset(rb, 2, num_batches=None).shuffle(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sft_dataset(rb, 2, num_batches=1).shuffle(seed=0)  # one call fills it: silent
    assert rb.drawn == 0


@pytest.mark.parametrize("typed", [False, True])
def test_sft_rows_with_a_tokenizer_carry_the_assistant_mask_and_the_turns(typed: bool) -> None:
    from posttrain.adapters._hf import word_level_tokenizer
    from posttrain.testing import tiny_causal_lm

    tok = word_level_tokenizer(tiny_causal_lm().config)
    data = llm_batch(4, vocab_size=64)
    rb = RingBuffer(4)
    rb.extend(data)
    stored = {}
    for t, a, s in zip(data[K("tokens")], data[K("attention_mask")], data[K("assistant_mask")],
                       strict=True):  # fmt: skip
        stored[tuple(t[a].tolist())] = s[a].tolist()
    rows = list(sft_dataset(rb, 4, tokenizer=tok, typed=typed))
    assert len(rows) == 4
    for row in rows:
        assert sorted(row) == ["assistant_masks", "input_ids", "messages"]
        ids = [int(i) for i in row["input_ids"]]
        assert [bool(m) for m in row["assistant_masks"]] == stored[tuple(ids)]
        words = " ".join(m["content"] for m in row["messages"]).split()
        assert words == tok.convert_ids_to_tokens(ids)  # the turns are the row, decoded
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"]  # one prompt, one answer
