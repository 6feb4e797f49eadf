"""NemoAsyncReplayBuffer: what NeMo-RL's collector pushes, NeMo-RL's answers, checkpoints, Ray."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain._checkpoint import CheckpointError, reseal, verify_dir
from posttrain.adapters.nemo_rl.mirror.batched_data_dict import BatchedDataDict
from posttrain.adapters.nemo_rl.payload import PayloadError, decode_payload, encode_payload
from posttrain.adapters.nemo_rl.replay_buffer import CHUNK_KEY, STATE_FILE, NemoAsyncReplayBuffer
from posttrain.reference_impls import RingBuffer
from tests.paths import DATA

V = json.loads((DATA / "nemo_rl_replay_buffer.json").read_text())


def collector_group(i: int, n: int = 2, task: int | None = None) -> dict[str, Any]:
    """A prompt group shaped as ``_enqueue_rollout_group`` pushes it (7ea279a)."""
    g = torch.Generator().manual_seed(i)
    logs = []
    for r in range(n):
        gen = 2 + r + i % 3
        logs.append(
            [
                {"role": "user", "content": f"q{i}", "token_ids": torch.tensor([1, 2, 3 + i])},
                {
                    "role": "assistant",
                    "content": "a",
                    "token_ids": torch.randint(5, 50, (gen,), generator=g),
                    "generation_logprobs": -torch.rand(gen, generator=g),
                },
            ]
        )
    batch = BatchedDataDict(
        {
            "message_log": logs,
            "length": torch.tensor([3 + len(m[1]["token_ids"]) for m in logs], dtype=torch.int32),
            "loss_multiplier": torch.ones(n),
            "idx": [i] * n,
            "extra_env_info": [{"ground_truth": str(i), "nested": (1, None)}] * n,
            "task_name": ["math"] * n,
            "stop_strings": [None] * n,
            "total_reward": torch.rand(n, generator=g),
            "truncated": torch.zeros(n, dtype=torch.bool),
            "bf16": torch.rand(n, 2, generator=g).to(torch.bfloat16),
        }
    )
    out: dict[str, Any] = {
        "batch": batch,
        "rollout_metrics": {"mean_gen_tokens_per_sample": 3.5, "trajectory_duration_s": 0.25},
        "timestamp": 1733350000.0 + i,
    }
    if task is not None:
        out["_ng_task_index"] = task
    return out


def same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        assert a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict | BatchedDataDict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_takes_what_the_collector_pushes_and_gives_it_back_bit_exactly() -> None:
    rb = NemoAsyncReplayBuffer(max_size=4, buffer=RingBuffer(64), chunk_bytes=256)
    groups = [collector_group(i, task=100 + i) for i in range(3)]
    for i, g in enumerate(groups):
        assert rb.add(g, 0, 1 if i < 2 else 2) == "success"
    out = rb.sample(num_prompt_groups=2, current_weight_version=1, max_age_steps=1)
    assert out is not None
    assert out["avg_trajectory_age"] == 1.0
    for got, want in zip(out["trajectories"], groups[:2], strict=True):
        same(got, want)
    merged = BatchedDataDict.from_batches([t["batch"] for t in out["trajectories"]])
    assert merged.size == 4
    assert rb.size() == 1


@pytest.mark.parametrize("case", sorted(k for k in V if not k.startswith("_")))
def test_answers_as_nemo_rls_replay_buffer_impl(case: str, tmp_path: Path) -> None:
    """Every op of a scripted sequence run on NeMo-RL 7ea279a's ReplayBufferImpl, replayed."""
    c = V[case]
    # Chunks of 512 bytes over a 24-item ring: the tiny groups still wrap the ring here.
    rb = NemoAsyncReplayBuffer(c["max_size"], c["drop"], buffer=RingBuffer(24), chunk_bytes=512)
    path = str(tmp_path / "replay_buffer.pt")
    for step in c["trace"]:
        name, *args = step["op"]
        if name == "add":
            group = {"batch": {"id": [args[0]]}, "rollout_metrics": {}, "timestamp": 0.0}
            if len(args) > 3:
                group["_ng_task_index"] = args[3]
            out: Any = rb.add(group, args[1], args[2])
        elif name == "sample":
            s = rb.sample(*args)
            out = (
                None
                if s is None
                else {
                    "ids": [t["batch"]["id"][0] for t in s["trajectories"]],
                    "avg_trajectory_age": s["avg_trajectory_age"],
                }
            )
        elif name == "save":
            out = rb.save_to_path(path)
        elif name == "restore":
            rb = NemoAsyncReplayBuffer(args[0], args[1], buffer=RingBuffer(24), chunk_bytes=512)
            meta = rb.load_from_path(path, **args[2])
            assert meta["next_ng_task_index"] == 17
            out = None
        else:
            out = getattr(rb, name)(*args)
            if isinstance(out, set):
                out = sorted(out)
        assert out == step["out"], (step["op"], out, step["out"])
        assert rb.trajectory_versions == step["versions"], step["op"]
        assert rb.target_weight_versions == step["targets"], step["op"]
        ids = [decode_payload(p)["batch"]["id"][0] for p in rb.state_dict()["trajectories"]]
        assert ids == step["ids"], step["op"]
        assert rb.get_last_target_weight_already_generated() == step["last"], step["op"]


def test_full_is_explicit_and_out_of_order_consumption_loses_no_rows() -> None:
    ring = RingBuffer(6)
    rb = NemoAsyncReplayBuffer(8, buffer=ring, chunk_bytes=1024)
    size = int(encode_payload(collector_group(0)).numel())
    k = -(-size // 1024)
    assert k == 2  # three groups fill the ring
    a = collector_group(0)
    assert rb.add(a, 0, 5) == "success"  # meant for a late step: stays while others pass
    fulls = 0
    held = 1
    for i in range(1, 12):
        g = collector_group(i)
        status = rb.add(g, 1, 2)
        if status == "full":  # the ring has no room beside the live groups: nothing changed
            fulls += 1
            assert rb.size() == held
            out = rb.sample(1, 2, 5)
            assert out is not None
            held -= 1
            assert rb.add(g, 1, 2) == "success"
        held += 1
    assert fulls == 9  # 34 items written through a 6-item ring
    assert ring.write_count == 34
    out = rb.sample(1, 5, 5)
    assert out is not None
    same(out["trajectories"][0], a)  # written long ago, moved past by the ring, intact


def test_checkpoint_is_atomic_and_loads_weights_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rb = NemoAsyncReplayBuffer(4, buffer=RingBuffer(64), chunk_bytes=256)
    g = collector_group(1, task=7)
    rb.add(g, 0, 1)
    path = tmp_path / "replay_buffer.pt"
    assert rb.save_to_path(str(path)) == 1
    assert os.listdir(tmp_path) == ["replay_buffer.pt"]
    assert sorted(os.listdir(path)) == ["manifest.json", STATE_FILE]
    verify_dir(path)  # every file listed with its size and SHA-256
    before = (path / STATE_FILE).read_bytes()

    def boom(*a: Any, **k: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    rb.add(collector_group(2), 0, 1)
    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(CheckpointError, match=r"disk full|No space left on device") as failed:
        rb.save_to_path(str(path))
    monkeypatch.undo()
    assert isinstance(failed.value.__cause__, OSError)  # the OS error, chained
    assert (path / STATE_FILE).read_bytes() == before  # the old checkpoint, whole
    assert os.listdir(tmp_path) == ["replay_buffer.pt"]  # no temporary left
    torch.load(path / STATE_FILE, weights_only=True)  # plain tensors, lists and ints only
    fresh = NemoAsyncReplayBuffer(4)
    assert fresh.load_from_path(str(path)) == {"num_trajectories": 1, "next_ng_task_index": 8}
    out = fresh.sample(1, 1, 1)
    assert out is not None
    same(out["trajectories"][0], g)


def _holding_one() -> tuple[NemoAsyncReplayBuffer, dict[str, Any]]:
    rb = NemoAsyncReplayBuffer(4, buffer=RingBuffer(64), chunk_bytes=256)
    g = collector_group(5, task=3)
    assert rb.add(g, 0, 1) == "success"
    return rb, g


def _still_holds(rb: NemoAsyncReplayBuffer, g: dict[str, Any]) -> None:
    assert rb.size() == 1
    assert rb.get_last_target_weight_already_generated() == -1
    out = rb.sample(1, 1, 1)
    assert out is not None
    same(out["trajectories"][0], g)


def test_a_bad_task_index_in_a_checkpoint_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    src = NemoAsyncReplayBuffer(4, buffer=RingBuffer(64), chunk_bytes=256)
    src.add(collector_group(1, task=7), 0, 1)
    path = tmp_path / "replay_buffer"
    src.save_to_path(str(path))
    state = torch.load(path / STATE_FILE, weights_only=True)
    for bad in (["seven"], [1.5], [True], [7, 8]):
        torch.save({**state, "task_indices": bad}, path / STATE_FILE)
        assert reseal(path)  # past the manifest: the state itself must be refused
        rb, g = _holding_one()
        with pytest.raises(CheckpointError, match=r"state\['task_indices'\]") as refused:
            rb.load_from_path(str(path))
        assert "buffer unchanged" in str(refused.value)
        _still_holds(rb, g)
    rb, g = _holding_one()
    with pytest.raises(ValueError, match=r"state\['task_indices'\]\[0\]: expected an int"):
        rb.load_state_dict({**state, "task_indices": ["seven"]})
    _still_holds(rb, g)


def test_a_checkpoint_with_one_flipped_payload_byte_is_refused(tmp_path: Path) -> None:
    src = NemoAsyncReplayBuffer(4, buffer=RingBuffer(64), chunk_bytes=256)
    g = collector_group(1, task=7)
    src.add(g, 0, 1)
    path = tmp_path / "replay_buffer"
    src.save_to_path(str(path))
    data = bytearray((path / STATE_FILE).read_bytes())
    reward = g["batch"]["total_reward"].numpy().tobytes()
    at = data.find(reward)
    assert at > 0  # the payload's raw tensor bytes lie in the file as they are
    data[at] ^= 0x01  # one bit of total_reward[0]
    (path / STATE_FILE).write_bytes(bytes(data))
    rb, held = _holding_one()
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        rb.load_from_path(str(path))
    _still_holds(rb, held)


def test_every_failed_load_is_a_checkpoint_error_in_words(tmp_path: Path) -> None:
    rb, g = _holding_one()
    with pytest.raises(CheckpointError, match="no checkpoint directory there") as missing:
        rb.load_from_path(str(tmp_path / "absent"))
    assert isinstance(missing.value, FileNotFoundError) or isinstance(
        missing.value.__cause__, FileNotFoundError
    )
    torch.save(rb.state_dict(), tmp_path / "replay_buffer.pt")  # the earlier one-file format
    with pytest.raises(CheckpointError, match="a file, not a checkpoint directory"):
        rb.load_from_path(str(tmp_path / "replay_buffer.pt"))
    path = tmp_path / "ckpt"
    rb.save_to_path(str(path))
    (path / STATE_FILE).write_bytes((path / STATE_FILE).read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        rb.load_from_path(str(path))
    _still_holds(rb, g)


def test_refuses_what_it_cannot_encode_and_malformed_states() -> None:
    rb = NemoAsyncReplayBuffer(2)
    with pytest.raises(PayloadError, match=r"trajectory\['batch'\]\['f'\]"):
        rb.add({"batch": {"f": object()}}, 0, 0)
    assert rb.size() == 0
    with pytest.raises(
        ValueError,
        match=r"state keys: expected .* \(without \['last_target_weight_already_generated'",
    ):
        rb.load_state_dict({"trajectories": []})
    with pytest.raises(ValueError, match="state lists: expected one length"):
        rb.load_state_dict(
            {
                "trajectories": [encode_payload({})],
                "trajectory_versions": [],
                "target_weight_versions": [],
                "last_target_weight_already_generated": -1,
            }
        )
    with pytest.raises(PayloadError):
        decode_payload(torch.zeros(20, dtype=torch.uint8))


def test_runs_as_a_ray_actor_called_as_nemo_rl_calls_it(tmp_path: Path) -> None:
    """``replay_buffer.add.remote`` / ``ray.get(...sample.remote(...))`` as grpo.py does."""
    from posttrain.adapters._ray import ensure_cluster
    from posttrain.adapters.nemo_rl.replay_buffer import nemo_replay_buffer_actor

    ray = ensure_cluster()
    try:
        rb = nemo_replay_buffer_actor(
            4, False, buffer_factory=RingBuffer, buffer_args=(64,), chunk_bytes=256
        )
        g = collector_group(3, task=5)
        assert ray.get(rb.add.remote(g, 0, 1)) == "success"
        assert ray.get(rb.size.remote()) == 1
        assert ray.get(rb.has_complete_batch.remote(1, 1, 1)) is True
        assert ray.get(rb.get_trajectories_needed.remote(2, 1, 1)) == 1
        path = str(tmp_path / "replay_buffer.pt")
        assert ray.get(rb.save_to_path.remote(path)) == 1
        out = ray.get(
            rb.sample.remote(num_prompt_groups=1, current_weight_version=1, max_age_steps=1)
        )
        same(out["trajectories"][0], g)
        meta = ray.get(
            rb.load_from_path.remote(
                path, num_prompts_per_step=1, current_training_step=1, max_age_steps=1
            )
        )
        assert meta == {"num_trajectories": 1, "next_ng_task_index": 6}
        assert ray.get(rb.get_last_target_weight_already_generated.remote()) == 0
        ray.kill(rb)
    finally:
        ray.shutdown()


def test_backed_by_torchrl_storage_the_ring_wraps_without_loss() -> None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer

    trl = ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(6)))
    rb = NemoAsyncReplayBuffer(8, buffer=trl, chunk_bytes=1024)
    assert rb.capacity == 6
    a = collector_group(0)
    assert rb.add(a, 0, 5) == "success"
    fulls = 0
    for i in range(1, 8):
        g = collector_group(i)
        if rb.add(g, 1, 2) == "full":
            fulls += 1
            assert rb.sample(1, 2, 5) is not None
            assert rb.add(g, 1, 2) == "success"
    assert fulls > 0
    out = rb.sample(1, 5, 5)
    assert out is not None
    same(out["trajectories"][0], a)


def _add_with_timeout(rb: NemoAsyncReplayBuffer, group: dict[str, Any], target: int) -> str:
    """``rb.add`` in a daemon thread, so a regression that loops forever fails, not hangs."""
    import threading

    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(rb.add(group, 1, target)), daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "add did not return within 20 s (the write position loops)"
    return out[0]


def test_fragmented_free_items_are_compacted_and_no_group_is_lost() -> None:
    # NeMo-RL answers "full" only at max_size: a group that fits in the free items must be
    # taken even when no run of free items is long enough (live rows are moved instead).
    ring = RingBuffer(4)
    rb = NemoAsyncReplayBuffer(8, buffer=ring, chunk_bytes=1024)
    small: list[dict[str, Any]] = [
        {"batch": {"x": torch.tensor([i])}, "timestamp": float(i)} for i in range(4)
    ]
    assert all(encode_payload(g).numel() <= 1024 for g in small)
    for g, target in zip(small, (1, 2, 1, 2), strict=True):
        assert rb.add(g, 1, target) == "success"
    out = rb.sample(2, current_weight_version=1, max_age_steps=5)
    assert out is not None  # items 0 and 2 freed; 1 and 3 live: no two free items in a row
    big = collector_group(0)
    assert -(-encode_payload(big).numel() // 1024) == 2
    writes = ring.write_count
    assert _add_with_timeout(rb, big, 2) == "success"
    assert ring.write_count == writes + 4  # the 2 live items rewritten, then the 2 new ones
    assert rb.size() == 3
    assert _add_with_timeout(rb, small[0], 2) == "full"  # 4 of 4 items live: truly full
    assert rb.size() == 3
    rest = rb.sample(3, current_weight_version=2, max_age_steps=5)
    assert rest is not None
    for got, want in zip(rest["trajectories"][:2], (small[1], small[3]), strict=True):
        assert torch.equal(got["batch"]["x"], want["batch"]["x"])
    same(rest["trajectories"][2], big)


class _FailsOnRow(RingBuffer):
    """A ring whose extend fails, changing nothing, when the batch holds ``row``."""

    row: torch.Tensor | None = None

    def extend(self, data: Any, /) -> torch.Tensor:
        row = self.row
        if row is not None and bool((data[CHUNK_KEY].view(torch.uint8) == row).all(1).any()):
            raise RuntimeError("injected: the backing buffer refused the write")
        return super().extend(data)


def test_a_compaction_whose_write_fails_leaves_every_group_intact() -> None:
    # Live groups at items 1 and 3, write position 3: compaction moves the first onto the
    # second's old row before the second moves. Should the write carrying the second fail,
    # both must still read back as themselves.
    ring = _FailsOnRow(4)
    rb = NemoAsyncReplayBuffer(8, buffer=ring, chunk_bytes=1024)

    def one(i: int) -> dict[str, Any]:
        return {"batch": {"x": torch.tensor([i])}, "timestamp": float(i)}

    for i, target in enumerate((1, 9, 1, 9)):
        assert rb.add(one(i), 1, target) == "success"
    assert rb.sample(2, current_weight_version=1, max_age_steps=50) is not None
    for i, cur in ((10, 2), (11, 3)):  # each added then sampled: the position moves to 3
        assert rb.add(one(i), cur, cur) == "success"
        assert rb.sample(1, current_weight_version=cur, max_age_steps=50) is not None
    assert [e.indices for e in rb._entries] == [[1], [3]]
    assert rb._written % 4 == 3
    third = encode_payload(one(3))
    ring.row = torch.zeros(1024, dtype=torch.uint8)
    ring.row[: third.numel()] = third
    big = collector_group(0)
    with pytest.raises(RuntimeError, match="injected"):
        rb.add(big, 9, 9)  # 2 live + 2 new items fit, but no two free items lie in a row
    ring.row = None
    assert rb.size() == 2
    out = rb.sample(2, current_weight_version=9, max_age_steps=50)
    assert out is not None
    assert [int(t["batch"]["x"]) for t in out["trajectories"]] == [1, 3]


def test_compaction_keeps_fifo_order_over_many_out_of_order_samples() -> None:
    ring = RingBuffer(8)
    rb = NemoAsyncReplayBuffer(16, buffer=ring, chunk_bytes=1024)
    big = collector_group(1)
    k = -(-encode_payload(big).numel() // 1024)
    assert k == 2
    pushed: dict[int, list[int]] = {}
    for round_ in range(6):
        # one-item groups for two targets, interleaved, fill the ring; consuming one target
        # leaves every other item free: no two free items in a row
        for i in range(8):
            tgt = 10 + round_ * 2 + i % 2
            g = {"batch": {"x": torch.tensor([round_ * 10 + i])}, "timestamp": 0.0}
            assert rb.add(g, 10 + round_ * 2, tgt) == "success"
            pushed.setdefault(tgt, []).append(round_ * 10 + i)
        cur = 10 + round_ * 2
        got = rb.sample(4, current_weight_version=cur, max_age_steps=100)
        assert got is not None
        assert [int(t["batch"]["x"]) for t in got["trajectories"]] == pushed.pop(cur)
        assert rb.add(big, cur, cur + 1) == "success"  # 4 live + 2 <= 8, but fragmented
        got = rb.sample(5, current_weight_version=cur + 1, max_age_steps=100)
        assert got is not None
        assert [int(t["batch"]["x"]) for t in got["trajectories"][:4]] == pushed.pop(cur + 1)
        same(got["trajectories"][4], big)
        assert rb.size() == 0


def test_bad_task_index_and_malformed_headers_change_nothing() -> None:
    rb = NemoAsyncReplayBuffer(2)
    with pytest.raises((TypeError, ValueError)):
        rb.add({"batch": {}, "_ng_task_index": "not an int"}, 0, 0)
    assert rb.size() == 0
    assert rb._written == 0  # raised before any chunk was written

    def raw(head: dict[str, Any], body: bytes = b"") -> torch.Tensor:
        h = json.dumps(head).encode()
        data = len(h).to_bytes(8, "little") + h + body
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    fmt = "posttrain-nemo-trajectory/1"
    with pytest.raises(PayloadError, match="'tensors'"):
        decode_payload(raw({"format": fmt, "tree": None}))
    with pytest.raises(PayloadError, match="expected 8 bytes"):
        decode_payload(
            raw(
                {"format": fmt, "tree": {"$t": 0}, "tensors": [["torch.int64", [2], 0, 8]]},
                b"\0" * 16,
            )
        )
    with pytest.raises(PayloadError, match="malformed tree"):
        decode_payload(raw({"format": fmt, "tree": {"$t": 3}, "tensors": []}))
