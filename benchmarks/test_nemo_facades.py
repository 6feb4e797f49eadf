"""NeMo-RL facades against the raw calls they end in, and against memcpy.

One GRPO step at B=64, T=512 arrives as 8 prompt groups of 8 sequences in NeMo-RL's train-data
format. ``NemoReplayBuffer.add`` (the train-data check, the non-pickle encoding and a
validated TorchRL extend of one chunk per group) is timed against a raw TorchRL ``extend`` of
the same LLM-layout items, and ``sample`` of 8 groups (one indexed read + decoding) against a
raw TorchRL ``sample(64)``; blocks alternate within one run. The buffer holds 512 groups, the
4096 items of the raw buffer: the timed adds fill it after 64 steps and are then answered
``"full"`` (the train-data check and the encoding's size, no write), so the first figure mixes
stored and refused groups; ``every group stored`` times adds into a buffer emptied first.
A sample is timed alone, the adds that feed it untimed before it.

The newer facades, each against the one call it wraps (ratios printed, never asserted):
``NemoAsyncReplayBuffer.add`` / ``sample`` of a group as NeMo-RL's collector pushes it against
the backing ``RingBuffer``'s ``extend`` / ``read`` of the same chunks (each timed alone); a
``NemoGroupSlots`` reserve + commit + remove against the data-plane ``put_samples`` it makes;
``NemoShardedWeightSynchronizer.sync_weights`` over 3 worker shards against one ``send`` +
``receive`` of the whole state through the reference weight sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.conftest import PAIRED, block_medians
from posttrain.adapters.nemo_rl import NemoReplayBuffer, from_layout, to_layout
from posttrain.contracts.keys import leaf_items
from posttrain.testing import llm_batch

B, T, G, ROUNDS = 64, 512, 8, 60


def _alternating(
    ops: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], rounds: int, blocks: int = 5
) -> dict[str, float]:
    """Median seconds of each op's timed call, blocks alternating as in ``block_medians``;
    each timed call follows the op's untimed setup (a sample after the adds that feed it, so
    the sample is timed alone, not as a difference of two larger medians)."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(blocks):
        for name, (setup, fn) in ops.items():
            for _ in range(rounds):
                setup()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _facades() -> None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer

    torch.set_num_threads(1)
    step = llm_batch(B, T)
    groups = [dict(from_layout(step[i : i + G])) for i in range(0, B, G)]
    items = to_layout(groups[0])  # one group in the layout, to size the raw calls
    capacity = 64 * B
    raw = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity))
    raw_batch = torch.cat([to_layout(g) for g in groups], 0)

    # One 160 KiB chunk per group (8 x 512 tokens of train data, about 130 KB encoded);
    # capacity // G chunks: the groups the raw buffer's items would hold.
    def make() -> NemoReplayBuffer:
        return NemoReplayBuffer(
            ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(capacity // G))),
            max_size=10**6,
            chunk_bytes=160 * 1024,
        )

    nemo, empty = make(), make()
    version = [0]

    def stored_step() -> None:
        empty.clear()  # room for every group: each add writes
        for g in groups:
            empty.add({"batch": g}, 0, 1)

    def add_step() -> None:
        for g in groups:
            nemo.add({"batch": g}, version[0], version[0] + 1)

    def feed() -> None:  # the next step's groups, then the step they are meant for
        add_step()
        version[0] += 1

    def sample_step() -> None:
        assert nemo.sample(G, version[0], 1) is not None

    for _ in range(4):
        raw.extend(raw_batch)
        add_step()
        stored_step()
    nbytes = sum(v.numel() * v.element_size() for v in leaf_items(raw_batch).values())
    src = torch.empty(64 * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    med = block_medians(
        {
            "raw extend": lambda: raw.extend(raw_batch),
            "nemo add": add_step,
            "nemo add, stored": stored_step,
        },
        ROUNDS,
    )
    draws = _alternating(
        {"raw sample": (lambda: None, lambda: raw.sample(B)), "nemo sample": (feed, sample_step)},
        ROUNDS // 2,
    )
    copy = block_medians({"memcpy": lambda: dst.copy_(src)}, 10)["memcpy"] / src.numel()
    nemo_sample = draws["nemo sample"]
    PAIRED["nemo add / raw TorchRL extend time (B=64, T=512, 8 groups)"] = (
        med["nemo add"] / med["raw extend"]
    )
    PAIRED["nemo add, every group stored / raw TorchRL extend time"] = (
        med["nemo add, stored"] / med["raw extend"]
    )
    PAIRED["nemo sample / raw TorchRL sample time (8 groups = 64 items)"] = (
        nemo_sample / draws["raw sample"]
    )
    PAIRED["nemo add x memcpy"] = copy * nbytes / med["nemo add"]
    PAIRED["nemo sample x memcpy"] = copy * nbytes / nemo_sample
    assert int(items.batch_size[0]) == G


def test_nemo_facades(benchmark: Any) -> None:
    benchmark.pedantic(_facades, rounds=1, iterations=1)


def _collector_group(i: int, n: int = G, gen: int = T // 2) -> dict[str, Any]:
    """One prompt group shaped as NeMo-RL's collector pushes it (7ea279a)."""
    from posttrain.adapters.nemo_rl.mirror.batched_data_dict import BatchedDataDict

    logs = [
        [
            {"role": "user", "token_ids": torch.arange(gen) % 97},
            {
                "role": "assistant",
                "token_ids": torch.arange(gen) % 89,
                "generation_logprobs": -torch.rand(gen),
            },
        ]
        for _ in range(n)
    ]
    batch = BatchedDataDict(
        {
            "message_log": logs,
            "length": torch.full((n,), 2 * gen, dtype=torch.int32),
            "loss_multiplier": torch.ones(n),
            "idx": [i] * n,
            "total_reward": torch.rand(n),
        }
    )
    return {"batch": batch, "rollout_metrics": {"trajectory_duration_s": 1.0}, "timestamp": 0.0}


def _async_buffer() -> None:
    from posttrain.adapters.nemo_rl.payload import encode_payload
    from posttrain.adapters.nemo_rl.replay_buffer import NemoAsyncReplayBuffer
    from posttrain.reference_impls import RingBuffer

    torch.set_num_threads(1)
    group = _collector_group(0)
    rb = NemoAsyncReplayBuffer(64, chunk_bytes=1 << 16, chunks_per_entry=16)
    chunks = rb._chunks(encode_payload(group))  # the items one add writes
    raw = RingBuffer(64 * 16)
    idx = raw.extend(chunks)
    step = [0]

    def add() -> None:
        step[0] += 1
        rb.add(group, step[0], step[0])

    def drain() -> None:
        assert rb.sample(1, step[0], 1) is not None

    for _ in range(3):
        add()
        drain()
    # Each add alone (the sample after it untimed: the buffer stays small), each sample alone
    # (the add before it untimed).
    med = _alternating(
        {
            "raw extend": (lambda: None, lambda: raw.extend(chunks)),
            "add": (lambda: rb.sample(1, step[0], 1), add),
            "raw read": (lambda: None, lambda: raw.read(idx)),
            "sample": (add, drain),
        },
        ROUNDS // 2,
    )
    PAIRED["nemo async add / RingBuffer extend of its chunks (8 seqs)"] = (
        med["add"] / med["raw extend"]
    )
    PAIRED["nemo async sample / RingBuffer read of its chunks"] = med["sample"] / med["raw read"]


def test_nemo_async_buffer_facade(benchmark: Any) -> None:
    benchmark.pedantic(_async_buffer, rounds=1, iterations=1)


def _group_slots() -> None:
    from tensordict import TensorDict

    from posttrain.adapters.nemo_rl.data_plane import NemoDataPlaneClient
    from posttrain.adapters.nemo_rl.group_slots import NemoGroupSlots
    from posttrain.reference_impls import RingBuffer

    torch.set_num_threads(1)
    fields = TensorDict(
        {
            "input_ids": torch.randint(0, 1000, (G, T)),
            "input_lengths": torch.full((G,), T, dtype=torch.int32),
            "advantages": torch.rand(G, T),
        },
        [G],
    )
    raw = NemoDataPlaneClient(RingBuffer, capacity=4096, full="evict_oldest")
    dp = NemoDataPlaneClient(RingBuffer, capacity=4096, full="evict_oldest")
    slots = NemoGroupSlots(dp, "train")
    n = [0]

    def ids() -> list[str]:
        n[0] += 1
        return [f"g{n[0]}_{j}" for j in range(G)]

    def put() -> None:
        raw.put_samples(ids(), "train", fields)

    def commit() -> None:
        gid = slots.reserve(weight_version=0, target_step=1)
        slots.commit(gid, ids(), fields, 0, 1)
        slots.remove_group(gid)  # the slot list stays short; the rows stay live

    for _ in range(600):  # both stores wrapped once: live ids at capacity, as in a long run
        put()
        commit()
    med = block_medians({"put_samples": put, "slots": commit}, ROUNDS)
    PAIRED["group slots reserve+commit+remove / put_samples (8 x 512)"] = (
        med["slots"] / med["put_samples"]
    )


def test_nemo_group_slots_facade(benchmark: Any) -> None:
    benchmark.pedantic(_group_slots, rounds=1, iterations=1)


def _sharded_sync() -> None:
    from posttrain.adapters.nemo_rl.weight_sync import (
        NemoShardedWeightSynchronizer,
        ShardAssembler,
    )
    from posttrain.reference_impls import in_process_weight_sync

    torch.set_num_threads(1)
    trainer = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    names = sorted(trainer.state_dict())

    class Worker:
        def __init__(self, mine: list[str]) -> None:
            self.mine = mine

        def state_shard(self) -> dict[str, torch.Tensor]:
            sd = trainer.state_dict()
            return {k: sd[k] for k in self.mine}

    sender, receiver = in_process_weight_sync(
        torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    )
    v = [0]

    def raw() -> None:
        v[0] += 1
        sender.send(trainer.state_dict(), version=v[0])
        receiver.receive(timeout=0)

    inner, recv2 = in_process_weight_sync(
        torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    )
    workers = [Worker(names[r::3]) for r in range(3)]
    sync = NemoShardedWeightSynchronizer(workers, ShardAssembler(inner, 3), recv2)
    sync.init_communicator()
    med = block_medians({"send+receive": raw, "sharded sync": sync.sync_weights}, ROUNDS // 2)
    PAIRED["sharded sync (3 workers) / send+receive of the whole (6.3 MB)"] = (
        med["sharded sync"] / med["send+receive"]
    )


def test_nemo_sharded_sync_facade(benchmark: Any) -> None:
    benchmark.pedantic(_sharded_sync, rounds=1, iterations=1)
