"""Across processes on a local Ray cluster: remote buffers and weight sync, against local.

- extend/sample of an LLM batch through a Ray actor (posttrain's RemoteBuffer around the
  reference RingBuffer; TorchRL's ``service_backend="ray"``) against the same buffer in this
  process, at B=64, T=512 (throughput) and B=1 (latency per call);
- one weight sync through TorchRL's ``RayWeightSyncScheme`` (checked, gloo over loopback)
  for 1M to 100M float32 parameters, against memcpy of the same bytes in this process.

Every ratio is measured in this run. The cluster is started here with a 2 GiB object store
(the 100M-parameter receiving model travels to its actor through it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from benchmarks.conftest import REMOTE, record
from posttrain.contracts.keys import leaf_items
from posttrain.testing import llm_batch

T = 512
PARAMS = (1_000_000, 10_000_000, 100_000_000)


def _median(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _nbytes(td: Any) -> int:
    return sum(v.numel() * v.element_size() for v in leaf_items(td).values())


def _memcpy_s_per_byte() -> float:
    src = torch.empty(64 * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return _median(lambda: dst.copy_(src), 10) / src.numel()


def _buffers(ray: Any) -> None:
    from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

    from posttrain.adapters.ray import serve_buffer
    from posttrain.reference_impls import RingBuffer

    capacity = 16 * 64
    pairs: dict[str, tuple[Any, Any]] = {
        "RingBuffer": (
            RingBuffer(capacity),
            serve_buffer(RingBuffer, capacity),
        ),
        "TorchRL LazyTensorStorage": (
            TensorDictReplayBuffer(storage=LazyTensorStorage(capacity)),
            TensorDictReplayBuffer(
                storage=partial(LazyTensorStorage, capacity),
                sampler=RandomSampler,
                service_backend="ray",
                service_backend_options={"remote_config": {"num_cpus": 0}},
            ),
        ),
    }
    for b in (64, 1):
        batch = llm_batch(b, T)
        nbytes = _nbytes(batch)
        shape = f"B={b}, T={T}"
        for name, (local, remote) in pairs.items():
            for rb in (local, remote):
                for _ in range(3):
                    rb.extend(batch)
            med = _time_ops(local, remote, batch, 30 if b == 64 else 200)
            for (op, where), s in med.items():
                record(op, f"{name} ({where})", shape, s, nbytes, b)
            for op in ("extend", "sample"):
                REMOTE[f"Ray-served / local {name} {op} time ({shape})"] = (
                    med[(op, "remote")] / med[(op, "local")]
                )
                if b == 1:
                    REMOTE[f"Ray-served {name} {op} latency, ms (B=1)"] = med[(op, "remote")] * 1e3
    for _, remote in pairs.values():
        remote.close()


def _time_ops(local: Any, remote: Any, batch: Any, rounds: int) -> dict[tuple[str, str], float]:
    b = int(batch.batch_size[0])
    return {
        (op, where): _median(
            partial(rb.extend, batch) if op == "extend" else partial(rb.sample, b), rounds
        )
        for op in ("extend", "sample")
        for where, rb in (("local", local), ("remote", remote))
    }


def _model(n_params: int) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(n_params / (width * width + width)))
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def _sync(sender: Any, receiver: Any, weights: Any, versions: Iterator[int]) -> None:
    sender.send(weights, version=next(versions))
    receiver.receive(timeout=120)


def _weight_sync() -> None:
    from posttrain.adapters.torchrl.ray_weight_sync import ray_weight_sync_pair

    per_byte = _memcpy_s_per_byte()
    for n in PARAMS:
        receiver_model, trainer = _model(n), _model(n)
        weights = {k: v.detach() for k, v in trainer.state_dict().items()}
        nbytes = sum(v.numel() * v.element_size() for v in weights.values())
        count = sum(v.numel() for v in weights.values())
        sender, receiver = ray_weight_sync_pair(receiver_model, adapted=True)
        versions = itertools.count(1)
        sync = partial(_sync, sender, receiver, weights, versions)
        sync()
        s = _median(sync, 7 if n < 50_000_000 else 3)
        label = f"{count / 1e6:.0f}M params"
        record("sync", "RayWeightSyncScheme (checked)", label, s, nbytes, 1)
        REMOTE[f"Ray weight sync, {label}: ms"] = s * 1e3
        REMOTE[f"Ray weight sync / memcpy of the same bytes, {label}"] = s / (per_byte * nbytes)
        receiver.close()
        del sender, receiver


def test_remote(benchmark: Any) -> None:
    from posttrain.adapters._ray import ensure_cluster

    torch.set_num_threads(1)
    ray = ensure_cluster(object_store_memory=2 * 2**30)

    def both() -> None:
        _buffers(ray)
        _weight_sync()

    benchmark.pedantic(both, rounds=1, iterations=1)
