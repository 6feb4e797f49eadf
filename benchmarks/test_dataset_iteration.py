"""Buffer -> dataset iteration: posttrain's BufferDataset vs torchrl's TorchRLBufferDataset.

Both read the same TorchRL buffer, with the same keys (every leaf, or two), as rows of tensors (what
``transformers.Trainer`` consumes) and as ``datasets.IterableDataset`` rows (what TRL's
trainers consume). Blocks of each alternate within one run; rows/s are medians over blocks.
torchrl's adapter cannot read a ragged buffer (it indexes the lazy stack row by row and fails
to stack), so the ragged rows compare against torchrl on the same items padded to T.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

import torch
from tensordict import TensorDictBase

from benchmarks.conftest import PAIRED
from posttrain.adapters._layout import to_padded
from posttrain.adapters.trl import BufferDataset
from posttrain.testing import llm_batch

B, T, ROWS, BLOCKS = 64, 512, 512, 5


def _buffer(data: TensorDictBase, ragged: bool) -> Any:
    from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyStackStorage(4 * B) if ragged else LazyTensorStorage(4 * B))
    for _ in range(4):
        rb.extend(data)
    return rb


def _ragged(n: int, t: int) -> TensorDictBase:
    from tensordict import LazyStackedTensorDict

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(t // 2, t + 1, (n,), generator=g).tolist()
    dense = llm_batch(n, t)
    items = [
        dense[i].apply(lambda x, n=n_: x[:n] if x.ndim == 1 else x) for i, n_ in enumerate(lengths)
    ]
    return LazyStackedTensorDict.lazy_stack(items, 0)


def _rate(make: Callable[[], Iterable[Any]]) -> float:
    t0 = time.perf_counter()
    n = sum(1 for _ in islice(make(), ROWS))
    return n / (time.perf_counter() - t0)


def _medians(groups: dict[str, Callable[[], Iterable[Any]]]) -> dict[str, float]:
    rates: dict[str, list[float]] = {k: [] for k in groups}
    for _ in range(BLOCKS):
        for name, make in groups.items():
            rates[name].append(_rate(make))
    return {k: sorted(v)[len(v) // 2] for k, v in rates.items()}


def _iteration() -> None:
    from torchrl.modules.llm.trl_interop import TorchRLBufferDataset

    torch.set_num_threads(1)
    padded_data = llm_batch(B, T)
    ragged_data = _ragged(B, T)
    padded, ragged, ragged_as_padded = (
        _buffer(padded_data, False),
        _buffer(ragged_data, True),
        _buffer(to_padded(ragged_data), False),
    )
    ours = {
        name: BufferDataset(rb, B, num_batches=None)
        for name, rb in (("padded", padded), ("ragged", ragged))
    }
    theirs = {
        name: TorchRLBufferDataset(rb, B, num_batches=None)
        for name, rb in (("padded", padded), ("ragged as padded", ragged_as_padded))
    }
    hf_cols = {"input_ids": ("tokens", "full"), "attention_mask": ("masks", "all_attention_mask")}
    ours_hf = BufferDataset(padded, B, num_batches=None, columns=hf_cols).as_hf_dataset()
    ours_hf_ragged = BufferDataset(ragged, B, num_batches=None, columns=hf_cols).as_hf_dataset()
    theirs_hf = TorchRLBufferDataset(
        padded, B, num_batches=None, keys=list(hf_cols.values())
    ).as_hf_dataset()
    ours_two = BufferDataset(padded, B, num_batches=None, columns=hf_cols)
    theirs_two = TorchRLBufferDataset(padded, B, num_batches=None, keys=list(hf_cols.values()))
    groups: dict[str, Callable[[], Iterable[Any]]] = {
        "posttrain padded": lambda: iter(ours["padded"]),
        "torchrl padded": lambda: iter(theirs["padded"]),
        "posttrain padded 2 keys": lambda: iter(ours_two),
        "torchrl padded 2 keys": lambda: iter(theirs_two),
        "posttrain ragged": lambda: iter(ours["ragged"]),
        "torchrl ragged as padded": lambda: iter(theirs["ragged as padded"]),
        "posttrain hf padded": lambda: iter(ours_hf),
        "posttrain hf ragged": lambda: iter(ours_hf_ragged),
        "torchrl hf padded": lambda: iter(theirs_hf),
    }
    try:
        next(iter(TorchRLBufferDataset(ragged, B)))
        torchrl_ragged = "reads it"
    except RuntimeError as e:
        torchrl_ragged = f"fails: {str(e).splitlines()[0][:60]}"
    med = _medians(groups)
    for name, rate in med.items():
        PAIRED[f"dataset rows/s {name} (B={B}, T={T})"] = rate
    PAIRED["dataset posttrain / torchrl rows/s, tensors, every leaf"] = (
        med["posttrain padded"] / med["torchrl padded"]
    )
    PAIRED["dataset posttrain / torchrl rows/s, tensors, 2 keys"] = (
        med["posttrain padded 2 keys"] / med["torchrl padded 2 keys"]
    )
    PAIRED["dataset posttrain ragged / torchrl same items padded, every leaf"] = (
        med["posttrain ragged"] / med["torchrl ragged as padded"]
    )
    PAIRED["dataset posttrain / torchrl rows/s, datasets.IterableDataset, 2 keys"] = (
        med["posttrain hf padded"] / med["torchrl hf padded"]
    )
    PAIRED["dataset posttrain ragged / torchrl same items padded, datasets, 2 keys"] = (
        med["posttrain hf ragged"] / med["torchrl hf padded"]
    )
    PAIRED["torchrl TorchRLBufferDataset on a ragged buffer reads it (1 yes, 0 fails)"] = float(
        torchrl_ragged == "reads it"
    )
    print(f"\ntorchrl TorchRLBufferDataset on the ragged buffer: {torchrl_ragged}")


def test_dataset_iteration(benchmark: Any) -> None:
    benchmark.pedantic(_iteration, rounds=1, iterations=1)
