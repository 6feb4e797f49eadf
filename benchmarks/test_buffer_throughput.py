"""Extend/sample throughput on LLM-shaped data against memcpy and TorchRL, padded and ragged.

Run with ``make bench`` (``--device cuda`` where a GPU is). Not part of ``make test``.
Shapes: B=64 at T=512 and T=4096, and B=16/256 at T=512 for the growth with batch size; the
ring holds about 75 MB in every case, so writes and random reads go to memory, not cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from benchmarks.conftest import record, synced, torchrl_missing
from posttrain.adapters.torchrl import ValidatedReplayBuffer
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.schema import ItemSchema
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch, ragged_llm_batch

SHAPES = [(64, 512), (64, 4096), (16, 512), (256, 512)]
RING_BYTES = 8192 * 9240  # 75 MB: the B=64, T=512 ring of 8192 items
torch.set_num_threads(1)


def _label(b: int, t: int, ragged: bool = False) -> str:
    return f"B={b},T{'<=' if ragged else '='}{t}{' ragged' if ragged else ''}"


def _nbytes(td: TensorDictBase) -> int:
    if isinstance(td, LazyStackedTensorDict):
        return sum(_nbytes(x) for x in td.tensordicts)
    return sum(v.numel() * v.element_size() for v in td.values(True, True))


def _capacity(b: int, t: int) -> int:
    return max(4 * b, RING_BYTES // (18 * t + 32))


def _median(benchmark: Any) -> float:
    return float(benchmark.stats.stats.median)


def test_memcpy(benchmark: Any, device: str) -> None:
    n = 64 * 2**20  # larger than the caches
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    benchmark(synced(dst.copy_, device), src)
    record("memcpy", "torch.Tensor.copy_", "64 MiB", _median(benchmark), n, 0)


def _torchrl(kind: str, capacity: int, adapted: bool, device: str = "cpu") -> Any:
    from torchrl.data import (
        LazyMemmapStorage,
        LazyStackStorage,
        LazyTensorStorage,
        TensorDictReplayBuffer,
    )

    storage = {"tensor": LazyTensorStorage, "memmap": LazyMemmapStorage, "stack": LazyStackStorage}
    # Only the in-memory storage is placed on an accelerator; memmap and stack stay on the CPU.
    where = {"device": device} if kind == "tensor" else {}
    rb = TensorDictReplayBuffer(storage=storage[kind](capacity, **where))
    return ValidatedReplayBuffer(rb, ragged=kind == "stack") if adapted else rb


PADDED: dict[str, Callable[[str, int], Any]] = {
    "posttrain.RingBuffer": lambda d, c: RingBuffer(c, device=d, seed=0),
    "torchrl LazyTensorStorage": lambda d, c: _torchrl("tensor", c, False, d),
    "torchrl LazyTensorStorage + adapter": lambda d, c: _torchrl("tensor", c, True, d),
    "torchrl LazyMemmapStorage": lambda d, c: _torchrl("memmap", c, False),
}
RAGGED: dict[str, Callable[[str, int], Any]] = {
    "torchrl LazyStackStorage": lambda d, c: _torchrl("stack", c, False),
    "torchrl LazyStackStorage + adapter": lambda d, c: _torchrl("stack", c, True),
}


def _cases() -> list[Any]:
    out = []
    for b, t in SHAPES:
        for name in PADDED:
            out.append(pytest.param(name, b, t, False, id=f"{name}-{_label(b, t)}"))
    for name in RAGGED:
        out.append(pytest.param(name, 64, 512, True, id=f"{name}-{_label(64, 512, True)}"))
    return out


def _batch(b: int, t: int, ragged: bool, device: str) -> TensorDictBase:
    if not ragged:
        return llm_batch(b, t).to(device)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g).tolist()
    return ragged_llm_batch(lengths)


ON_DEVICE = (
    "posttrain.RingBuffer",
    "torchrl LazyTensorStorage",
    "torchrl LazyTensorStorage + adapter",
)
"""The rows measured on an accelerator too; the others hold their data on the CPU."""


def _skip_off_cpu(device: str, name: str) -> None:
    if device == "cpu":
        return
    if name not in ON_DEVICE:
        pytest.skip(f"{name} keeps its data on the CPU")
    if name.startswith("torchrl") and (why := torchrl_missing()):
        pytest.skip(why)


@pytest.mark.parametrize(("name", "b", "t", "ragged"), _cases())
def test_extend(benchmark: Any, device: str, name: str, b: int, t: int, ragged: bool) -> None:
    _skip_off_cpu(device, name)
    batch = _batch(b, t, ragged, device)
    rb = (RAGGED if ragged else PADDED)[name](device, _capacity(b, t))
    rb.extend(batch)  # first write allocates
    benchmark(synced(rb.extend, device), batch)
    record("extend", name, _label(b, t, ragged), _median(benchmark), _nbytes(batch), b)


@pytest.mark.parametrize(("name", "b", "t", "ragged"), _cases())
def test_sample(benchmark: Any, device: str, name: str, b: int, t: int, ragged: bool) -> None:
    _skip_off_cpu(device, name)
    batch = _batch(b, t, ragged, device)
    capacity = _capacity(b, t)
    rb = (RAGGED if ragged else PADDED)[name](device, capacity)
    for _ in range(-(-capacity // b)):
        rb.extend(batch)
    benchmark(synced(rb.sample, device), b)
    record("sample", name, _label(b, t, ragged), _median(benchmark), _nbytes(batch), b)


@pytest.mark.parametrize(("b", "t"), SHAPES, ids=[_label(b, t) for b, t in SHAPES])
def test_validation_cost(benchmark: Any, b: int, t: int) -> None:
    batch = llm_batch(b, t)
    benchmark(LLM_LAYOUT_V1.violations, batch)
    record("validate", "LLM layout v1", _label(b, t), _median(benchmark), _nbytes(batch), b)


@pytest.mark.parametrize(("b", "t"), SHAPES, ids=[_label(b, t) for b, t in SHAPES])
def test_schema_check_cost(benchmark: Any, b: int, t: int) -> None:
    batch = llm_batch(b, t)
    schema = ItemSchema.of(batch)
    benchmark(schema.validated_leaves, batch)
    record("schema check", "ItemSchema", _label(b, t), _median(benchmark), _nbytes(batch), b)
