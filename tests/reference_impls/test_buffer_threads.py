"""4 writer and 4 reader threads on every bundled buffer that declares ``thread_safe``.

Every item's fields are derived from its id, so a sample mixing two items' keys (a torn
item) shows. Without eviction every written item must be stored exactly once; with eviction
under way (the ring wraps ~12 times) the final contents must hold ``capacity`` distinct,
whole items, each at the index its extend returned, none older than a later write of the
same writer to that index, and every sample taken meanwhile only whole, written items.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from posttrain.contracts.implementation import Implementation
from posttrain.reference_impls import RING_BUFFER

WRITERS = READERS = 4
BATCHES, B, T = 50, 4, 8  # per writer: 800 items in all
SEED = [-4, -3, -2, -1]  # written first: a sampler without replacement draws 4 at once


def _bundled() -> list[Implementation]:
    out = [RING_BUFFER]
    try:
        from posttrain.adapters.torchrl import implementations as trl
    except ImportError:  # pragma: no cover - only without the extra
        return out
    names = [
        "RAW_LAZY_TENSOR",
        "RAW_LAZY_TENSOR_NO_REPLACEMENT",
        "RAW_LAZY_MEMMAP",
        "RAW_LAZY_STACK",
        "ADAPTED_LAZY_TENSOR",
        "ADAPTED_LAZY_TENSOR_NO_REPLACEMENT",
        "ADAPTED_LAZY_MEMMAP",
        "ADAPTED_LAZY_STACK",
    ]
    return out + [getattr(trl, n) for n in names]


def _served() -> list[Implementation]:
    try:
        from posttrain.adapters.ray.implementations import SERVED_RING_BUFFER
    except ImportError:  # pragma: no cover
        return []
    return [SERVED_RING_BUFFER]


def _batch(ids: list[int]) -> TensorDict:
    t = torch.tensor(ids, dtype=torch.int64)
    tok = t[:, None] * 100 + torch.arange(T)
    return TensorDict(
        {"id": t, "tokens": tok, "m": {"lp": -tok.float() / 7, "mask": tok % 2 == 0}},
        batch_size=[len(ids)],
    )


def _torn(td: Any) -> list[int]:
    """Ids of items whose fields do not all come from that id."""
    want = _batch(td["id"].tolist())
    bad = torch.zeros(td["id"].shape[0], dtype=torch.bool)
    for k in (("tokens",), ("m", "lp"), ("m", "mask")):
        g, w = td.get(k), want.get(k)
        bad |= (g != w).reshape(g.shape[0], -1).any(1)
    out: list[int] = td["id"][bad].tolist()
    return out


def _read_all(rb: Any, n: int) -> Any:
    if hasattr(rb, "read"):
        return rb.read(torch.arange(n))
    return rb[torch.arange(n)]  # a raw TorchRL buffer: its own indexing


def _hammer(rb: Any, *, evicting: bool) -> tuple[list[tuple[int, list[int], list[int]]], int]:
    """Run the threads; return each extend (writer, ids, indices) in each writer's order and
    the number of items the readers checked."""
    rb.extend(_batch(SEED))  # fixes the schema (and items to sample) before the threads
    log: list[list[tuple[int, list[int], list[int]]]] = [[] for _ in range(WRITERS)]
    errors: list[str] = []
    done = threading.Event()
    checked = [0] * READERS
    written_ids = set(SEED) | set(range(WRITERS * BATCHES * B))

    def writer(w: int) -> None:
        try:
            for b in range(BATCHES):
                ids = [(w * BATCHES + b) * B + i for i in range(B)]
                idx = rb.extend(_batch(ids))
                log[w].append((w, ids, [int(i) for i in idx]))
        except Exception as e:  # reported below: a thread's exception is otherwise lost
            errors.append(f"writer {w}: {type(e).__name__}: {e}")

    def reader(r: int) -> None:
        try:
            while not done.is_set():
                s = rb.sample(4)
                ids = s["id"].tolist()
                if not set(ids) <= written_ids:
                    errors.append(f"reader {r}: sampled ids never written {ids}")
                torn = _torn(s)
                if torn:
                    errors.append(f"reader {r}: torn items {torn[:10]}")
                checked[r] += len(ids)
        except Exception as e:
            errors.append(f"reader {r}: {type(e).__name__}: {e}")

    readers = [threading.Thread(target=reader, args=(r,)) for r in range(READERS)]
    writers = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(120)
    done.set()
    for t in readers:
        t.join(30)
    assert not errors, errors[:10]
    assert all(len(x) == BATCHES for x in log), [len(x) for x in log]
    return [e for x in log for e in x], sum(checked)


def _check(rb: Any, capacity: int, evicting: bool) -> str:
    extends, sampled = _hammer(rb, evicting=evicting)
    total = WRITERS * BATCHES * B + len(SEED)
    assert len(rb) == min(capacity, total)
    stored = _read_all(rb, len(rb))
    ids = stored["id"].tolist()
    assert not _torn(stored), _torn(stored)[:10]
    assert len(set(ids)) == len(ids), "duplicated items"
    slot_of = {i: s for _, xs, ss in extends for i, s in zip(xs, ss, strict=True)}
    if not evicting:
        assert set(ids) == set(SEED) | set(slot_of), "lost items"
        assert len(set(slot_of.values())) == len(slot_of), "one index returned for two items"
        return f"{total} written, {total} stored once each, {sampled} sampled items whole"
    # Each stored item sits where its extend said, and no writer's later write to that
    # index is missing (a later write lost under an older one).
    latest: dict[tuple[int, int], int] = {}
    for w, xs, ss in extends:
        for i, s in zip(xs, ss, strict=True):
            latest[(w, s)] = i
    for pos, i in enumerate(ids):
        if i < 0:
            continue
        assert slot_of[i] == pos, f"item {i} stored at {pos}, its extend returned {slot_of[i]}"
        w = i // (BATCHES * B)
        assert latest[(w, pos)] == i, (
            f"index {pos}: {i} stored, writer {w} wrote {latest[(w, pos)]} later"
        )
    return f"{total} written, {len(ids)} stored distinct and whole, {sampled} sampled items whole"


@pytest.mark.parametrize("impl", _bundled(), ids=lambda i: i.name)
@pytest.mark.parametrize("evicting", [False, True], ids=["no-eviction", "eviction"])
def test_writers_and_readers_lose_nothing_and_tear_nothing(
    impl: Implementation, evicting: bool
) -> None:
    assert "thread_safe" in impl.capabilities
    capacity = 64 if evicting else 1024
    rb = impl.factory(capacity)
    print("\n" + impl.name, _check(rb, capacity, evicting))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    pytest.importorskip("ray")
    from posttrain.adapters._ray import ensure_cluster

    ray = ensure_cluster()
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("impl", _served(), ids=lambda i: i.name)
def test_served_buffer_with_threads_loses_nothing(ray_cluster: Any, impl: Implementation) -> None:
    rb = impl.factory(64)
    try:
        print("\n" + impl.name, _check(rb, 64, True))
    finally:
        close = getattr(rb, "close", None)
        if callable(close):
            close()
