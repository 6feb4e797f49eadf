"""BUF-019's concurrent writers: four threads extending one buffer while four sample it, and
the check that the indices and the survivors are those of some order of the writes."""

from __future__ import annotations

import itertools
import threading
import time

from tensordict import TensorDictBase

from posttrain.conformance.context import Context
from posttrain.conformance.suites._buffer_run import Run, short_err
from posttrain.conformance.suites._compare import id_list
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.testing import item_uids


class _Write:
    """One extend of BUF-019: who made it, when (it took effect in between), what it got."""

    def __init__(self, writer: int, uids: list[int], t0: float, t1: float, idx: list[int]):
        self.writer, self.uids, self.t0, self.t1, self.idx = writer, uids, t0, t1, idx


def _clashes(log: list[_Write], capacity: int) -> list[str]:
    """Indices two extends returned that no order of the extends explains.

    Extend B may write at an index extend A's k-th item got only if B ran after A and evicted
    that item: at least ``capacity`` items written from it on, B's included. Between A and B
    can only come extends that overlap the span from A's start to B's end, so with fewer
    than that, B wrote over an item still stored (or both read one write position).
    """

    def evicts(a: _Write, k: int, b: _Write) -> bool:
        if a.t0 >= b.t1:  # b returned before a began: b cannot come after a
            return False
        between = sum(
            len(x.uids) for x in log if x is not a and x is not b and x.t1 > a.t0 and x.t0 < b.t1
        )
        return len(a.uids) - 1 - k + between + len(b.uids) >= capacity

    by_index: dict[int, list[tuple[_Write, int]]] = {}
    for w in log:
        for k, i in enumerate(w.idx):
            by_index.setdefault(i, []).append((w, k))
    out: list[str] = []
    for i, uses in sorted(by_index.items()):
        for (a, k), (b, j) in itertools.combinations(uses, 2):
            if a is b:
                out.append(f"one extend returned index {i} twice ({a.idx})")
            elif not evicts(a, k, b) and not evicts(b, j, a):
                out.append(f"index {i} for uids {a.uids[k]} and {b.uids[j]}")
    return out


def concurrent_writes(ctx: Context, capacity: int, per_writer: int) -> None:
    writers, n = 4, 2
    total = writers * per_writer * n
    what = f"4 writers x {per_writer} extends of {n} into capacity {capacity}"
    r = Run(ctx, capacity=capacity)
    batches = [[r.batch(n) for _ in range(per_writer)] for _ in range(writers)]
    for bs in batches:
        for b in bs:
            r.table.add(b)
    errors: list[str] = []
    log: list[_Write] = []
    done = threading.Event()
    start = threading.Barrier(writers)  # so that the writes really overlap

    def write(w: int, bs: list[TensorDictBase]) -> None:
        try:
            start.wait(timeout=30)
            for b in bs:
                uids = item_uids(b)
                t0 = time.perf_counter()
                idx = r.rb.extend(b)
                t1 = time.perf_counter()
                log.append(_Write(w, uids, t0, t1, [int(i) for i in idx.tolist()]))
        except Exception as e:
            errors.append(f"writer raised {short_err(e)}")

    def read() -> None:
        try:
            while not done.is_set():
                k = min(4, len(r.rb))  # len only grows here; never ask beyond it
                if k:
                    r.table.check_sample(r.rb.sample(k), set(r.table.items))
        except Exception as e:
            errors.append(f"reader raised {short_err(e)}")

    ws = [threading.Thread(target=write, args=(w, bs)) for w, bs in enumerate(batches)]
    rs = [threading.Thread(target=read) for _ in range(4)]
    for t in ws + rs:
        t.start()
    for t in ws:
        t.join(timeout=60)
    done.set()
    for t in rs:
        t.join(timeout=60)
    if errors:
        raise _fail(f"{what}: " + "; ".join(errors[:3]))
    want = min(total, capacity)
    if len(r.rb) != want:
        raise _fail(f"{what}: len is {len(r.rb)}, expected {want}")
    clashes = _clashes(log, capacity)
    if clashes:
        raise _fail(
            f"{what}: extends returned one index for two items that must both have been "
            f"stored: {'; '.join(clashes[:5])}"
            + (f" ... and {len(clashes) - 5} more" if len(clashes) > 5 else "")
        )
    if total <= capacity:
        r.fifo = list(r.table.items)
        r.expect_stored(f"{what}: after the concurrent writes")
        return
    # With eviction the survivors are the last `capacity` items of some order of the writes
    # that keeps each writer's own order: per writer, a suffix of what it wrote.
    seen: set[int] = set()
    for _ in range(60):
        seen.update(r.table.check_sample(r.rb.sample(want), set(r.table.items)))
        if len(seen) >= want:
            break
    if len(seen) != want:
        raise _fail(f"{what}: sampling found {len(seen)} distinct items, len is {want}")
    for w, bs in enumerate(batches):
        mine = [u for b in bs for u in item_uids(b)]
        kept = [u in seen for u in mine]
        if kept != sorted(kept):  # a False after a True: an older item outlived a newer one
            first = kept.index(True)
            lost = [u for u, k in zip(mine[first:], kept[first:], strict=True) if not k]
            raise _fail(
                f"{what}: writer {w}'s items {id_list(lost)} are gone while its older uid "
                f"{mine[first]} is stored: writes were lost, not evicted oldest first"
            )
