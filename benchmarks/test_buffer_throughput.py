"""Extend/sample throughput on LLM-shaped data (B=64, T=512) against memcpy and TorchRL.

Run with ``make bench`` (``--device cuda`` where a GPU is). Not part of ``make test``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from benchmarks.conftest import record
from posttrain.adapters.torchrl import ValidatedReplayBuffer
from posttrain.conformance.data import llm_batch
from posttrain.contracts import check
from posttrain.reference_impls import RingBuffer

B, T, CAPACITY = 64, 512, 8192
torch.set_num_threads(1)


def _nbytes(td: TensorDict) -> int:
    return sum(v.numel() * v.element_size() for v in td.values(True, True))


@pytest.fixture(scope="module")
def batch(device: str) -> TensorDict:
    return llm_batch(B, T).to(device)


def _median(benchmark: Any) -> float:
    return float(benchmark.stats.stats.median)


def test_memcpy(benchmark: Any, device: str) -> None:
    n = 64 * 2**20  # larger than the caches
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    record("memcpy", _median(benchmark), n, 0)


def _ring(device: str) -> RingBuffer:
    return RingBuffer(CAPACITY, device=device, seed=0)


def _torchrl(kind: str, adapted: bool) -> Any:
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

    storage = LazyTensorStorage(CAPACITY) if kind == "tensor" else LazyMemmapStorage(CAPACITY)
    rb = TensorDictReplayBuffer(storage=storage)
    return ValidatedReplayBuffer(rb) if adapted else rb


BUFFERS: dict[str, Callable[[str], Any]] = {
    "posttrain.RingBuffer": lambda d: _ring(d),
    "torchrl LazyTensorStorage": lambda d: _torchrl("tensor", False),
    "torchrl LazyTensorStorage + adapter": lambda d: _torchrl("tensor", True),
    "torchrl LazyMemmapStorage": lambda d: _torchrl("memmap", False),
}


@pytest.mark.parametrize("name", list(BUFFERS))
def test_extend(benchmark: Any, batch: TensorDict, device: str, name: str) -> None:
    if device != "cpu" and name != "posttrain.RingBuffer":
        pytest.skip("TorchRL rows are measured on CPU")
    rb = BUFFERS[name](device)
    rb.extend(batch)  # first write allocates
    benchmark(rb.extend, batch)
    record(f"extend {name}", _median(benchmark), _nbytes(batch), B)


@pytest.mark.parametrize("name", list(BUFFERS))
def test_sample(benchmark: Any, batch: TensorDict, device: str, name: str) -> None:
    if device != "cpu" and name != "posttrain.RingBuffer":
        pytest.skip("TorchRL rows are measured on CPU")
    rb = BUFFERS[name](device)
    for _ in range(CAPACITY // B):
        rb.extend(batch)
    benchmark(rb.sample, B)
    record(f"sample {name}", _median(benchmark), _nbytes(batch), B)


def test_validation_cost(benchmark: Any, batch: TensorDict) -> None:
    benchmark(check, batch)
    record("validate (metadata) LLM layout", _median(benchmark), _nbytes(batch), B)
