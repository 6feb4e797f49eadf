"""NeMo-RL facades against the raw TorchRL calls they end in, and against memcpy.

One GRPO step at B=64, T=512 arrives as 8 prompt groups of 8 sequences in NeMo-RL's train-data
format. ``NemoReplayBuffer.add`` (codec + validated TorchRL extend) is timed against a raw
TorchRL ``extend`` of the same LLM-layout items, and ``sample`` of 8 groups (indexed reads +
codec back) against a raw TorchRL ``sample(64)``; blocks alternate within one run.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.conftest import PAIRED, block_medians
from posttrain.adapters.nemo_rl import NemoReplayBuffer, from_layout, to_layout
from posttrain.contracts.layout import leaf_items
from posttrain.testing import llm_batch

B, T, G, ROUNDS = 64, 512, 8, 60


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
    nemo = NemoReplayBuffer(
        ValidatedReplayBuffer(TensorDictReplayBuffer(storage=LazyTensorStorage(capacity))),
        max_size=10**6,
        capacity=capacity,
    )
    version = [0]

    def add_step() -> None:
        for g in groups:
            nemo.add({"batch": g}, version[0], version[0] + 1)

    def sample_step() -> None:
        version[0] += 1
        nemo.sample(G, version[0], 1)
        add_step()  # keep the buffer fed for the next draw (timed apart below)

    for _ in range(4):
        raw.extend(raw_batch)
        add_step()
    nbytes = sum(v.numel() * v.element_size() for v in leaf_items(raw_batch).values())
    src = torch.empty(64 * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    med = block_medians(
        {
            "raw extend": lambda: raw.extend(raw_batch),
            "nemo add": add_step,
            "raw sample": lambda: raw.sample(B),
        },
        ROUNDS,
    )
    # sample_step also adds; time the add alone to subtract it.
    both = block_medians({"sample+add": sample_step, "add": add_step}, ROUNDS // 2)
    copy = block_medians({"memcpy": lambda: dst.copy_(src)}, 10)["memcpy"] / src.numel()
    nemo_sample = max(both["sample+add"] - both["add"], 1e-9)
    PAIRED["nemo add / raw TorchRL extend time (B=64, T=512, 8 groups)"] = (
        med["nemo add"] / med["raw extend"]
    )
    PAIRED["nemo sample / raw TorchRL sample time (8 groups = 64 items)"] = (
        nemo_sample / med["raw sample"]
    )
    PAIRED["nemo add x memcpy"] = copy * nbytes / med["nemo add"]
    PAIRED["nemo sample x memcpy"] = copy * nbytes / nemo_sample
    assert int(items.batch_size[0]) == G


def test_nemo_facades(benchmark: Any) -> None:
    benchmark.pedantic(_facades, rounds=1, iterations=1)
