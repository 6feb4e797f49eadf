"""The headline ratios at B=64, T=512, measured in alternating blocks within one test.

Separate pytest-benchmark tests run a minute apart, and on this shared 2-core machine the
memory system drifts between them (a ratio of two separately measured medians moved by 30%
from run to run). Here every group of operations runs in several short blocks, alternating
with the other groups, and operations compared with each other (adapter vs raw, validation
vs extend) alternate call by call in ABBA order. Timing a 64 MiB copy between every call
would flush the caches before each one, so memcpy gets blocks of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.conftest import PAIRED, SPREAD, synced, torchrl_missing
from benchmarks.test_buffer_throughput import (
    ON_DEVICE,
    PADDED,
    RAGGED,
    _batch,
    _capacity,
    _nbytes,
)
from posttrain.adapters.torchrl import ValidatedReplayBuffer
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.contracts.schema import ItemSchema
from posttrain.testing import llm_batch

B, T, ROUNDS = 64, 512, 1000
REPEATS = 5  # whole measurements, each building its buffers afresh: median and range reported


ADAPTED = " + adapter"


def _wrap_raw(bufs: dict[str, Any], *, ragged: bool) -> None:
    """Put the adapter around the very TorchRL buffer its raw row uses: both then write into
    one storage, and the ratio is the adapter's own cost, not two storages' placement."""
    for name in [n for n in bufs if n.startswith("torchrl") and n + ADAPTED in PADDED | RAGGED]:
        bufs[name + ADAPTED] = ValidatedReplayBuffer(bufs[name], ragged=ragged)


def _medians(
    groups: list[dict[str, Callable[..., Any]]],
    calls: int,
    blocks: int = 5,
    make_arg: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Median time of each callable; with ``make_arg``, each call gets ``make_arg()``, made
    outside the timer."""
    times: dict[str, list[float]] = {k: [] for g in groups for k in g}
    for _ in range(blocks):
        for group in groups:
            names = list(group)
            n = max(2, calls // 10) if "memcpy" in group else calls
            for i in range(n):
                for name in names if i % 2 == 0 else reversed(names):
                    args = () if make_arg is None else (make_arg(),)
                    t0 = time.perf_counter()
                    group[name](*args)
                    times[name].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _paired(device: str, out: dict[str, float]) -> None:
    torch.set_num_threads(1)
    batch = llm_batch(B, T).to(device)
    nbytes = _nbytes(batch)
    n = 64 * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    cap = _capacity(B, T)
    on_device = [name for name in ON_DEVICE if "Ring" in name or not torchrl_missing()]
    bufs = {
        name: make(device, cap)
        for name, make in PADDED.items()
        if (device == "cpu" or name in on_device) and not name.endswith(ADAPTED)
    }
    _wrap_raw(bufs, ragged=False)
    for rb in bufs.values():
        for _ in range(-(-cap // B)):
            rb.extend(batch)
    schema = ItemSchema.of(batch)
    groups: list[dict[str, Callable[[], Any]]] = [{"memcpy": lambda: dst.copy_(src)}]
    ring = bufs["posttrain.RingBuffer"]
    groups.append(
        {
            "extend posttrain.RingBuffer": lambda: ring.extend(batch),
            "validate": lambda: LLM_LAYOUT_V1.violations(batch),
            "schema check": lambda: schema.validated_leaves(batch),
        }
    )
    groups.append({"sample posttrain.RingBuffer": lambda: ring.sample(B)})
    for op in ("extend", "sample"):
        group: dict[str, Callable[[], Any]] = {}
        for name, rb in bufs.items():
            if name.startswith("torchrl"):
                group[f"{op} {name}"] = partial(
                    rb.extend if op == "extend" else rb.sample, batch if op == "extend" else B
                )
        if group:
            groups.append(group)
    # Validation and the schema check read metadata on the host: no device work to wait for.
    host_only = {"validate", "schema check"}
    groups = [{k: f if k in host_only else synced(f, device) for k, f in g.items()} for g in groups]
    med = _medians(groups, ROUNDS // 5)
    if device == "cpu":
        _ragged(out)
    # The absolute figures behind the ratios: a ratio moves with either side.
    out["memcpy GB/s (its own blocks)"] = n / med["memcpy"] / 1e9
    out["extend posttrain.RingBuffer us"] = med["extend posttrain.RingBuffer"] * 1e6
    out["sample posttrain.RingBuffer us"] = med["sample posttrain.RingBuffer"] * 1e6
    out["validate us"] = med["validate"] * 1e6
    per_byte = {k: v / nbytes for k, v in med.items() if k != "memcpy"}
    memcpy_per_byte = med["memcpy"] / n
    for k, v in per_byte.items():
        if k.startswith(("extend", "sample")):
            out[f"{k} x memcpy"] = memcpy_per_byte / v
    for op in ("extend", "sample"):
        raw, wrapped = (
            med.get(f"{op} torchrl LazyTensorStorage"),
            med.get(f"{op} torchrl LazyTensorStorage + adapter"),
        )
        if raw and wrapped:
            out[f"adapter / raw TorchRL {op} time"] = wrapped / raw
    ring = med["extend posttrain.RingBuffer"]
    out["validate / RingBuffer extend time"] = med["validate"] / ring
    out["schema check / RingBuffer extend time"] = med["schema check"] / ring
    raw_extend = med.get("extend torchrl LazyTensorStorage")
    if raw_extend:
        out["validate / TorchRL extend time"] = med["validate"] / raw_extend
        out["schema check / TorchRL extend time"] = med["schema check"] / raw_extend


RAW_STACK = "extend torchrl LazyStackStorage"
SHARED = "extend torchrl LazyStackStorage + adapter(copy=False)"


def _ragged(out: dict[str, float]) -> None:
    """Ragged items (TorchRL's LazyStackStorage): milliseconds per call, so fewer calls.

    As in training, every extend gets a batch made just before it (a clone of one ragged
    batch, outside the timer: new TensorDicts and tensors, as a rollout step hands over).
    The headline rows write into a full buffer (its steady state), so each extend frees the
    items it overwrites. Two other cases are printed beside them: a buffer still filling
    (nothing freed, every batch in memory not touched before), and one batch object
    extended again and again (its metadata out of the caches at every call: the other rows
    ran in between). The adapter's check reads every leaf's metadata, which TorchRL's extend
    does not, so it is the part that moves with where that metadata sits.
    """
    base = _batch(B, T, True, "cpu")
    cap = _capacity(B, T)
    stacks = {name: make("cpu", cap) for name, make in RAGGED.items() if not name.endswith(ADAPTED)}
    _wrap_raw(stacks, ragged=True)
    rows: dict[str, Callable[[Any], Any]] = {f"extend {n}": rb.extend for n, rb in stacks.items()}
    raw_stack = stacks["torchrl LazyStackStorage"]
    # What the contract asks of a list storage done with TorchRL's own calls: the buffer
    # must not share the caller's tensors (BUF-006), so copy, then extend.
    rows["clone + extend torchrl LazyStackStorage"] = lambda b: raw_stack.extend(b.clone())
    rows[SHARED] = ValidatedReplayBuffer(raw_stack, ragged=True, copy=False).extend
    for _ in range(-(-cap // B)):  # full from the first timed call
        raw_stack.extend(base.clone())
    rag = _medians([rows], ROUNDS // 10, make_arg=base.clone)
    again = _medians(
        [{k: rows[k] for k in (RAW_STACK, SHARED)}], ROUNDS // 10, make_arg=lambda: base
    )
    # Room for every batch of the measurement: nothing is overwritten, nothing freed.
    calls, blocks = ROUNDS // 20, 5
    filling = RAGGED["torchrl LazyStackStorage"]("cpu", (2 * calls * blocks + 1) * B)
    filling.extend(base.clone())
    fill = _medians(
        [
            {
                RAW_STACK: filling.extend,
                SHARED: ValidatedReplayBuffer(filling, ragged=True, copy=False).extend,
            }
        ],
        calls,
        blocks,
        make_arg=base.clone,
    )
    raw_s = rag[RAW_STACK]
    out["ragged adapter / raw TorchRL clone + extend time"] = (
        rag[RAW_STACK + ADAPTED] / rag["clone + extend torchrl LazyStackStorage"]
    )
    out["ragged adapter(copy=False) / raw TorchRL extend time"] = rag[SHARED] / raw_s
    out["ragged adapter / raw TorchRL extend time"] = rag[RAW_STACK + ADAPTED] / raw_s
    out["ragged adapter(copy=False) / raw TorchRL extend time, one batch re-extended"] = (
        again[SHARED] / again[RAW_STACK]
    )
    out["ragged adapter(copy=False) / raw TorchRL extend time, buffer filling"] = (
        fill[SHARED] / fill[RAW_STACK]
    )
    out["ragged raw TorchRL extend us"] = raw_s * 1e6
    out["ragged raw TorchRL extend us, one batch re-extended"] = again[RAW_STACK] * 1e6
    out["ragged raw TorchRL extend us, buffer filling"] = fill[RAW_STACK] * 1e6


def _repeated(device: str) -> None:
    # This machine's memory system is shared: one measurement's ratios moved by 30% from one
    # run to the next minutes later, so each figure is the median of REPEATS, with its range.
    runs: list[dict[str, float]] = []
    for _ in range(REPEATS):
        runs.append({})
        _paired(device, runs[-1])
    assert all(r.keys() == runs[0].keys() for r in runs), [sorted(r) for r in runs]
    for name in runs[0]:
        values = sorted(r[name] for r in runs)
        PAIRED[name] = values[len(values) // 2]
        SPREAD[name] = (values[0], values[-1])


def test_paired_ratios(benchmark: Any, device: str) -> None:
    benchmark.pedantic(_repeated, args=(device,), rounds=1, iterations=1)
