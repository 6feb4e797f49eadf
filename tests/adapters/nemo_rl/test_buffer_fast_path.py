"""The NeMo-RL replay buffer's storage path: one read per sample, the room check kept up to
date through every change, chunks as int64 words, the payload decoding, and the earlier
checkpoint format refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from posttrain._checkpoint import CheckpointError, save_state
from posttrain.adapters.nemo_rl import NemoFormatError, from_layout, to_layout
from posttrain.adapters.nemo_rl.payload import (
    PAYLOAD_FORMAT,
    decode_payload,
    encode_payload,
    prepare_payload,
)
from posttrain.adapters.nemo_rl.replay_buffer import (
    CHUNK_KEY,
    EARLIER_STATE_FILE,
    NemoAsyncReplayBuffer,
    NemoReplayBuffer,
)
from posttrain.adapters.nemo_rl.train_data import check_train_data
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch

CHUNK = 2048


def _group(seed: int, n: int = 2, t: int = 6) -> dict[str, torch.Tensor]:
    return dict(from_layout(llm_batch(n, t, seed=seed, uid_start=seed * 10)))


class _CountingRing:
    """A RingBuffer that counts the reads made of it."""

    def __init__(self, capacity: int) -> None:
        self.inner = RingBuffer(capacity)
        self.capacity = capacity
        self.reads = 0

    def extend(self, data: TensorDict) -> torch.Tensor:
        return self.inner.extend(data)

    def read(self, indices: torch.Tensor) -> TensorDict:
        self.reads += 1
        return self.inner.read(indices)

    def __len__(self) -> int:
        return len(self.inner)


def test_sample_reads_the_backing_buffer_once_for_every_chosen_group() -> None:
    ring = _CountingRing(16)
    nemo = NemoReplayBuffer(ring, max_size=8, chunk_bytes=CHUNK)
    groups = [_group(i, n=2 + i % 2) for i in range(4)]
    for i, g in enumerate(groups):
        assert nemo.add({"batch": g, "i": i}, 0, 1) == "success"
    assert ring.reads == 0
    out = nemo.sample(3, current_weight_version=1, max_age_steps=1)
    assert out is not None
    assert ring.reads == 1
    for i, t in enumerate(out["trajectories"]):
        assert t["i"] == i
        for k, v in groups[i].items():
            assert torch.equal(t["batch"][k], v), k


def test_a_full_buffer_answers_before_copying_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    rb = NemoAsyncReplayBuffer(8, buffer=RingBuffer(2), chunk_bytes=1024)
    assert rb.add({"x": 0}, 0, 1) == "success"
    assert rb.add({"x": 1}, 0, 1) == "success"
    from posttrain.adapters.nemo_rl import payload

    def refuse(*a: Any) -> None:
        raise AssertionError("a group the buffer has no room for was copied")

    monkeypatch.setattr(payload.PreparedPayload, "rows", refuse)
    assert rb.add({"x": 2}, 0, 1) == "full"
    with pytest.raises(payload.PayloadError, match="cannot encode object"):
        rb.add({"x": object()}, 0, 1)  # a bad group is still refused when full
    assert rb.size() == 2


def _model_step(
    rb: NemoAsyncReplayBuffer, model: list[tuple[int, int, int]], rng: random.Random
) -> None:
    """One random call, checked against a list of (id, chunks, target) held in FIFO order.

    Groups meant for two targets leave out of order, so the free items fragment and some adds
    walk the write position past live groups or compact them.
    """
    op = rng.choices(["add", "sample", "clear", "restore"], [8, 4, 1, 1])[0]
    cap = rb.capacity
    assert cap is not None
    if op == "add":
        gid, size, target = (
            rng.randrange(10**6),
            rng.choice([10, 10, 10, 10, 1500, 2500]),
            rng.randint(0, 1),
        )
        group = {"id": gid, "pad": torch.zeros(size, dtype=torch.uint8)}
        k = prepare_payload(group).chunks(1024)
        full = len(model) >= rb.max_size or sum(n for _, n, _ in model) + k > cap
        assert rb.add(group, 0, target) == ("full" if full else "success")
        if not full:
            model.append((gid, k, target))
    elif op == "sample":
        target, n = rng.randint(0, 1), rng.randint(1, 3)
        mine = [m for m in model if m[2] == target][:n]
        out = rb.sample(n, target, 5)
        assert (out is None) == (len(mine) < n)
        if out is not None:
            assert [t["id"] for t in out["trajectories"]] == [g for g, _, _ in mine]
            model[:] = [m for m in model if m not in mine]
    elif op == "clear":
        rb.clear()
        model.clear()
    elif op == "restore":
        rb.load_state_dict(rb.state_dict())
    held = {i for e in rb._entries for i in e.indices}
    assert len(held) == sum(len(e.indices) for e in rb._entries) == sum(n for _, n, _ in model)


@pytest.mark.parametrize("seed", range(6))
def test_add_answers_full_exactly_when_the_live_items_leave_no_room(seed: int) -> None:
    """Whatever was sampled, cleared, restored or compacted before (a model of the rule)."""
    rng = random.Random(seed)
    rb = NemoAsyncReplayBuffer(6, buffer=RingBuffer(7), chunk_bytes=1024)
    model: list[tuple[int, int, int]] = []
    for _ in range(250):
        _model_step(rb, model, rng)
    for target in (0, 1):
        mine = [g for g, _, t in model if t == target]
        out = rb.sample(max(1, len(mine)), target, 5)
        assert (out is None) == (not mine)
        if out is not None:
            assert [t["id"] for t in out["trajectories"]] == mine


def test_decoded_tensors_have_memory_of_their_own() -> None:
    """Back to back, unaligned (a bool before a float) and overlapping spans alike."""
    obj = {
        "b": torch.tensor([True, False, True]),
        "f": torch.arange(5, dtype=torch.float32),
        "c": torch.randn(3, dtype=torch.complex128),
        "e": torch.zeros(0, dtype=torch.int64),
        "i": torch.arange(4, dtype=torch.int64),
    }
    payload = encode_payload(obj)
    back = decode_payload(payload)
    payload.fill_(0)
    for k, v in obj.items():
        assert back[k].dtype == v.dtype, k
        assert torch.equal(back[k], v), k
    # Two tensors whose header places them on the same bytes come back apart.
    head = json.dumps(
        {
            "format": PAYLOAD_FORMAT,
            "tree": [{"$t": 0}, {"$t": 1}],
            "tensors": [["torch.int32", [2], 0, 8], ["torch.int32", [2], 0, 8]],
        }
    ).encode()
    raw = len(head).to_bytes(8, "little") + head + bytes(range(8))
    a, b = decode_payload(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    a.fill_(-1)
    assert b.tolist() == torch.tensor(list(range(8)), dtype=torch.uint8).view(torch.int32).tolist()


def test_check_train_data_refuses_what_to_layout_refuses() -> None:
    good = _group(0)
    check_train_data(good)
    cases: list[tuple[dict[Any, Any], str]] = [
        ({**good, "input_ids": good["input_ids"].int()}, "'input_ids': expected int64"),
        ({k: v for k, v in good.items() if k != "input_lengths"}, "'input_lengths'"),
        ({**good, "token_mask": good["token_mask"] * 2}, "'token_mask': expected 0/1"),
        ({**good, 3: torch.ones(2)}, "3: expected a str key, found int"),
    ]
    for data, message in cases:
        for check in (check_train_data, to_layout):
            with pytest.raises(NemoFormatError, match=message):
                check(data)


def test_an_earlier_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "replay_buffer"
    state = {"format": "posttrain-nemo-replay-buffer/1", "state": {"trajectories": []}}
    save_state(path, EARLIER_STATE_FILE, state)
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    nemo.add({"batch": _group(0)}, 0, 1)
    with pytest.raises(
        CheckpointError,
        match=r"expected nemo_async_replay_buffer\.pt .*found nemo_replay_buffer\.pt: a "
        r"NemoReplayBuffer checkpoint of the earlier format",
    ):
        nemo.load_from_path(path)
    assert nemo.size() == 1


def test_an_earlier_state_dict_is_refused_and_nothing_changes() -> None:
    earlier = {
        "trajectories": [{"indices": [0, 1], "offset": 0, "width": 6, "extras": {}, "keys": None}],
        "trajectory_versions": [0],
        "target_weight_versions": [1],
        "last_target_weight_already_generated": -1,
        "max_size": 4,
        "written": 2,
        "buffer": {},
    }
    for rb in (
        NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK),
        NemoAsyncReplayBuffer(4),
    ):
        with pytest.raises(ValueError, match="found the earlier NemoReplayBuffer state"):
            rb.load_state_dict(earlier)
        assert rb.size() == 0


def test_a_restored_group_is_checked_as_add_checks_one() -> None:
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    nemo.add({"batch": _group(0), "i": 0}, 0, 1)
    bad = _group(1)
    bad["input_ids"] = bad["input_ids"].int()

    def state(trajectory: Any) -> dict[str, Any]:
        return {
            "trajectories": [encode_payload({"batch": _group(2)}), trajectory],
            "trajectory_versions": [0, 0],
            "target_weight_versions": [1, 1],
            "last_target_weight_already_generated": -1,
        }

    with pytest.raises(
        NemoFormatError, match=r"state\['trajectories'\]\[1\]\['batch'\]: 'input_ids'"
    ):
        nemo.load_state_dict(state({"batch": bad}))
    with pytest.raises(ValueError, match=r"\[1\]: expected a trajectory with a 'batch' key"):
        nemo.load_state_dict(state(encode_payload({"data": _group(1)})))
    out = nemo.sample(1, 1, 1)
    assert out is not None
    assert out["trajectories"][0]["i"] == 0
    # NemoAsyncReplayBuffer takes any group, as NeMo-RL's does.
    rb = NemoAsyncReplayBuffer(4)
    rb.load_state_dict(state({"data": 1}))
    assert rb.size() == 2


@pytest.mark.parametrize(("width", "dtype"), [(1024, torch.int64), (1001, torch.uint8)])
def test_chunks_are_stored_as_int64_words_where_the_width_allows(
    width: int, dtype: torch.dtype
) -> None:
    ring = RingBuffer(8)
    rb = NemoAsyncReplayBuffer(4, buffer=ring, chunk_bytes=width)
    group = {"batch": {"x": torch.arange(300)}, "t": 1.5}
    assert rb.add(group, 0, 0) == "success"
    items = ring.read(torch.tensor(rb._entries[0].indices))[CHUNK_KEY]
    assert items.dtype == dtype
    assert items.shape[0] == 3  # 2,400 bytes of tensor and a header
    assert items[0].numel() * items.element_size() == width
    out = rb.sample(1, 0, 0)
    assert out is not None
    assert torch.equal(out["trajectories"][0]["batch"]["x"], torch.arange(300))
    assert out["trajectories"][0]["t"] == 1.5
