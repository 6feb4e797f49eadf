"""NemoReplayBuffer: the replay buffer for groups of NeMo-RL train data, checked on the way in."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain._checkpoint import CheckpointError, verify_dir
from posttrain.adapters.nemo_rl import NemoFormatError, from_layout
from posttrain.adapters.nemo_rl.mirror.batching import flatten_message_logs
from posttrain.adapters.nemo_rl.payload import encode_payload
from posttrain.adapters.nemo_rl.replay_buffer import STATE_FILE, NemoReplayBuffer
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch


def _group(seed: int, n: int = 2, t: int = 6) -> dict[str, torch.Tensor]:
    return dict(from_layout(llm_batch(n, t, seed=seed, uid_start=seed * 10)))


def _torchrl(capacity: int) -> Any:
    from torchrl.data import LazyStackStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer

    return ValidatedReplayBuffer(
        TensorDictReplayBuffer(storage=LazyStackStorage(capacity)), ragged=True
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


CHUNK = 2048  # bytes per backing item: a group of two rows takes one


def test_nemo_batches_go_through_a_torchrl_buffer_and_come_back_unchanged() -> None:
    logs = [
        [
            {"role": "user", "token_ids": [11, 12, 13]},
            {"role": "assistant", "token_ids": [21, 22], "generation_logprobs": [-0.5, -1.0]},
        ],
        [
            {"role": "user", "token_ids": [11, 12, 13]},
            {
                "role": "assistant",
                "token_ids": [31, 32, 33],
                "generation_logprobs": [-0.1, -0.2, -0.3],
            },
        ],
    ]
    flat = flatten_message_logs(logs, make_sequence_length_divisible_by=4)
    group_a = {
        "input_ids": flat["token_ids"],
        "input_lengths": flat["input_lengths"],
        "token_mask": flat["token_loss_mask"],
        "generation_logprobs": flat["generation_logprobs"],
        "prev_logprobs": flat["generation_logprobs"] - 0.01,
        "reference_policy_logprobs": flat["generation_logprobs"] - 0.02,
        "advantages": torch.tensor([[0.5] * 8, [-0.5] * 8]),
        "sample_mask": torch.tensor([1.0, 0.0]),
    }
    group_b = {k: v.clone() for k, v in group_a.items()}
    group_b["input_ids"] = torch.cat(
        [group_b["input_ids"], torch.zeros(2, 4, dtype=torch.int64)], 1
    )
    for k in (
        "token_mask",
        "generation_logprobs",
        "prev_logprobs",
        "reference_policy_logprobs",
        "advantages",
    ):
        group_b[k] = torch.cat([group_b[k], torch.zeros(2, 4, dtype=group_b[k].dtype)], 1)
    nemo = NemoReplayBuffer(_torchrl(16), max_size=4, chunk_bytes=CHUNK)
    assert nemo.add({"batch": group_a, "timestamp": 1.0}, 0, 1) == "success"
    assert nemo.add({"batch": group_b, "timestamp": 2.0}, 0, 1) == "success"  # wider: ragged
    out = nemo.sample(2, current_weight_version=1, max_age_steps=1)
    assert out is not None
    assert [t["timestamp"] for t in out["trajectories"]] == [1.0, 2.0]
    _same(dict(out["trajectories"][0]["batch"]), group_a)
    _same(dict(out["trajectories"][1]["batch"]), group_b)
    assert out["avg_trajectory_age"] == 1.0
    assert nemo.size() == 0


def test_staleness_rules_follow_nemo_rl() -> None:
    nemo = NemoReplayBuffer(RingBuffer(64), max_size=8, chunk_bytes=CHUNK)
    for i, (v, target) in enumerate([(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]):
        assert nemo.add({"batch": _group(i), "i": i}, v, target) == "success"
    assert nemo.sample(1, current_weight_version=0, max_age_steps=2) is None  # none meant for 0
    assert nemo.sample(3, current_weight_version=2, max_age_steps=2) is None  # only 2 meant for 2
    out = nemo.sample(2, current_weight_version=2, max_age_steps=2)
    assert out is not None
    assert [t["i"] for t in out["trajectories"]] == [1, 2]
    assert out["avg_trajectory_age"] == pytest.approx(1.5)
    # At version 3 with max age 1, entries generated before version 2 are dropped for good.
    out = nemo.sample(1, current_weight_version=3, max_age_steps=1)
    assert out is not None
    assert [t["i"] for t in out["trajectories"]] == [4]
    assert nemo.size() == 0  # entry 0 (v0) and entry 3 (v1) were too old
    assert nemo.last_target_weight_already_generated == 3


def test_full_at_max_size_or_when_the_backing_buffer_has_no_room() -> None:
    nemo = NemoReplayBuffer(RingBuffer(3), max_size=2, chunk_bytes=CHUNK)
    assert nemo.add({"batch": _group(0)}, 0, 1) == "success"
    assert nemo.add({"batch": _group(1)}, 0, 1) == "success"
    assert nemo.add({"batch": _group(2)}, 0, 1) == "full"  # max_size entries
    assert nemo.sample(1, 1, 1) is not None
    big = _group(3, n=8, t=16)
    assert -(-encode_payload({"batch": big}).numel() // CHUNK) == 3  # the ring holds one
    assert nemo.add({"batch": big}, 0, 1) == "full"
    assert nemo.size() == 1
    assert nemo.add({"batch": _group(4)}, 0, 1) == "success"
    out = nemo.sample(2, 1, 1)
    assert out is not None
    _same(dict(out["trajectories"][0]["batch"]), _group(1))
    _same(dict(out["trajectories"][1]["batch"]), _group(4))


def test_a_bad_trajectory_is_refused_and_nothing_changes() -> None:
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    nemo.add({"batch": _group(0)}, 0, 1)
    with pytest.raises(KeyError, match="expected a 'batch' key"):
        nemo.add({"data": _group(1)}, 0, 1)
    bad = _group(1)
    bad["input_ids"] = bad["input_ids"].to(torch.int32)
    with pytest.raises(NemoFormatError, match="'input_ids': expected int64"):
        nemo.add({"batch": bad}, 0, 1)
    assert nemo.size() == 1
    assert len(nemo.buffer) == 1  # the one group's one chunk
    with pytest.raises(TypeError, match=r"with read\(indices\)"):
        NemoReplayBuffer(object(), max_size=1)


def test_state_dict_round_trip_and_clear() -> None:
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    nemo.add({"batch": _group(0), "t": 0}, 0, 1)
    nemo.add({"batch": _group(1), "t": 1}, 1, 2)
    copy = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    copy.load_state_dict(nemo.state_dict())
    assert copy.size() == 2
    out = copy.sample(1, 2, 1)
    assert out is not None
    assert out["trajectories"][0]["t"] == 1
    _same(dict(out["trajectories"][0]["batch"]), _group(1))
    nemo.clear()
    assert nemo.size() == 0
    with pytest.raises(ValueError, match="expected one length"):
        copy.load_state_dict({**nemo.state_dict(), "trajectory_versions": [1]})


def test_real_replay_buffer_where_nemo_rl_imports() -> None:
    impl = pytest.importorskip(
        "nemo_rl.algorithms.async_utils.replay_buffer",
        reason="nemo_rl is not on the package index (0.0.0 placeholder); its rules are "
        "reproduced from replay_buffer.py at 7ea279a instead",
    )
    real = impl.ReplayBufferImpl(max_size=8, drop_incomplete_targets_on_restore=False)
    ours = NemoReplayBuffer(RingBuffer(64), max_size=8, chunk_bytes=CHUNK)
    plan = [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]
    for i, (v, target) in enumerate(plan):
        assert real.add({"batch": _group(i), "i": i}, v, target) == ours.add(
            {"batch": _group(i), "i": i}, v, target
        )
    for current, age, n in [(0, 2, 1), (2, 2, 2), (3, 1, 1)]:
        a, b = real.sample(n, current, age), ours.sample(n, current, age)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert [t["i"] for t in a["trajectories"]] == [t["i"] for t in b["trajectories"]]
            assert a["avg_trajectory_age"] == pytest.approx(b["avg_trajectory_age"])
    assert real.size() == ours.size()


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 0, 1), ValueError, r"num_prompt_groups: expected >= 1, found 0"),
        ((-1, 0, 1), ValueError, r"num_prompt_groups: expected >= 1, found -1"),
        ((1.5, 0, 1), ValueError, r"num_prompt_groups: expected an int, found 1.5"),
        ((1, 5, -1), ValueError, r"max_age_steps: expected >= 0, found -1"),
    ],
)
def test_sample_refuses_bad_counts_and_drops_nothing(
    args: tuple[Any, int, int], error: type[Exception], message: str
) -> None:
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    for i in range(3):
        nemo.add({"batch": _group(i), "i": i}, 0, 0)
    with pytest.raises(error, match=message):
        nemo.sample(*args)
    assert nemo.size() == 3
    out = nemo.sample(3, current_weight_version=0, max_age_steps=1)
    assert out is not None
    assert [t["i"] for t in out["trajectories"]] == [0, 1, 2]


def _odd_values_group() -> dict[str, torch.Tensor]:
    """A group whose log-probs hold NaN and both infinities, without prev_logprobs."""
    group = _group(7)
    del group["prev_logprobs"]
    lp = group["generation_logprobs"].clone()
    lp[0, 1], lp[0, 2], lp[1, 0] = float("nan"), float("-inf"), float("inf")
    group["generation_logprobs"] = lp
    ref = lp.clone()
    ref[1, 3] = float("nan")
    group["reference_policy_logprobs"] = ref
    return group


def _bits_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)  # the same keys, in the same order: nothing derived added
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        x, y = a[k].contiguous(), b[k].contiguous()
        if x.is_floating_point():
            x, y = (
                x.view(torch.int32 if x.dtype == torch.float32 else torch.int64),
                y.view(torch.int32 if y.dtype == torch.float32 else torch.int64),
            )
        assert torch.equal(x, y), k


@pytest.mark.parametrize("backing", ["ring", "torchrl"])
def test_nan_and_infinite_log_probs_come_back_bit_exactly(backing: str) -> None:
    group = _odd_values_group()
    buffer = RingBuffer(16) if backing == "ring" else _torchrl(16)
    nemo = NemoReplayBuffer(buffer, max_size=4, chunk_bytes=CHUNK)
    assert nemo.add({"batch": group}, 0, 1) == "success"
    out = nemo.sample(1, current_weight_version=1, max_age_steps=1)
    assert out is not None
    _bits_equal(dict(out["trajectories"][0]["batch"]), group)


def _two_entries() -> NemoReplayBuffer:
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    assert nemo.add({"batch": _group(0, n=2), "i": 0}, 0, 1) == "success"
    assert nemo.add({"batch": _group(1, n=3), "i": 1}, 0, 1) == "success"
    return nemo


def test_checkpoint_directory_round_trip_is_bit_exact(tmp_path: Path) -> None:
    nemo = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    odd = _odd_values_group()
    nemo.add({"batch": odd, "timestamp": 2.5, "m": {"x": float("nan")}}, 0, 1)
    other = {k: v for k, v in _group(1).items() if k != "prev_logprobs"}  # the same schema
    assert nemo.add({"batch": other, "timestamp": 3.0}, 1, 2) == "success"
    path = tmp_path / "replay_buffer"
    assert nemo.save_to_path(path) == 2
    assert sorted(os.listdir(path)) == ["manifest.json", STATE_FILE]
    verify_dir(path)
    copy = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    assert copy.load_from_path(path) == {"num_trajectories": 2, "next_ng_task_index": 0}
    out = copy.sample(1, 1, 1)
    assert out is not None
    got = out["trajectories"][0]
    _bits_equal(dict(got["batch"]), odd)
    assert got["timestamp"] == 2.5
    assert math.isnan(got["m"]["x"])


def _held(nemo: NemoReplayBuffer) -> tuple[int, torch.Tensor]:
    return nemo.size(), nemo.buffer.state_dict()["rows"].clone()


def test_a_checkpoint_with_one_flipped_byte_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    src = _two_entries()
    path = tmp_path / "replay_buffer"
    src.save_to_path(path)
    data = bytearray((path / STATE_FILE).read_bytes())
    at = len(data) // 2  # somewhere in the stored rows
    data[at] ^= 0x01
    (path / STATE_FILE).write_bytes(bytes(data))
    dst = NemoReplayBuffer(RingBuffer(16), max_size=4, chunk_bytes=CHUNK)
    dst.add({"batch": _group(9), "i": 9}, 0, 1)
    before = _held(dst)
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        dst.load_from_path(path)
    assert dst.size() == before[0]
    assert torch.equal(_held(dst)[1], before[1])


def test_every_failed_save_or_load_is_a_checkpoint_error_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nemo = _two_entries()
    # nothing there
    with pytest.raises(CheckpointError, match="no checkpoint directory there") as missing:
        nemo.load_from_path(tmp_path / "absent")
    # nothing to chain: the error is itself a FileNotFoundError, or chains one
    assert isinstance(missing.value, FileNotFoundError) or isinstance(
        missing.value.__cause__, FileNotFoundError
    )
    # a file (NeMo-RL's own format is a torch.save file)
    torch.save(nemo.state_dict(), tmp_path / "replay_buffer.pt")
    with pytest.raises(CheckpointError, match="a file, not a checkpoint directory"):
        nemo.load_from_path(tmp_path / "replay_buffer.pt")
    # a directory without a manifest
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        nemo.load_from_path(tmp_path / "plain")
    # the disk fills up while writing: the previous checkpoint stays, whole
    path = tmp_path / "ckpt"
    nemo.save_to_path(path)
    before = (path / STATE_FILE).read_bytes()

    def full(*a: Any, **k: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match=r"disk full|No space left on device") as failed:
        nemo.save_to_path(path)
    monkeypatch.undo()
    assert isinstance(failed.value.__cause__, OSError)
    assert (path / STATE_FILE).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "plain", "replay_buffer.pt"]
    # a parent that is a file
    with pytest.raises(CheckpointError) as blocked:
        nemo.save_to_path(tmp_path / "replay_buffer.pt" / "ckpt")
    assert isinstance(blocked.value.__cause__, OSError)
