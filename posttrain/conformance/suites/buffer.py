"""The buffer suite: one check per BUF requirement (specs/buffer-v1.md).

Every check builds fresh buffers with ``ctx.make(capacity)`` and LLM-layout batches whose
items carry unique ids, so a sample can be traced back to the write it came from.
"""

from __future__ import annotations

import io
import itertools
import threading
import time
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain._deps import optional_deps
from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.data import item_uids, llm_batch, ragged_llm_batch
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._compare import Table, leaves
from posttrain.contracts.layout import LLM_LAYOUT_V1, key_str

CAP = 8
T = 8
_UID_BASES = itertools.count(1)


def _fail(msg: str) -> ConformanceError:
    return ConformanceError(msg)


class _Run:
    """A buffer under test plus the model of what it should hold (FIFO of uids)."""

    def __init__(self, ctx: Context, capacity: int = CAP) -> None:
        self.ctx = ctx
        self.capacity = capacity
        self.rb: Any = ctx.make(capacity)
        self.table = Table()
        self.fifo: list[int] = []
        # Fresh uids per run: a buffer's unwritten memory may hold another run's rows, which
        # must never pass for this run's items.
        self.next_uid = next(_UID_BASES) * 100_000

    def batch(self, n: int, t: int = T) -> TensorDictBase:
        td = llm_batch(n, t, uid_start=self.next_uid, seed=self.ctx.seed)
        self.next_uid += n
        return td

    def write(self, n: int) -> torch.Tensor:
        return self.put(self.batch(n))

    def put(self, td: TensorDictBase) -> torch.Tensor:
        idx: torch.Tensor = self.rb.extend(td)
        self.table.add(td)
        self.fifo = (self.fifo + item_uids(td))[-self.capacity :]
        return idx

    def stored(self) -> set[int]:
        """The uids the buffer holds, found by sampling (and each sample checked bit-exactly).

        Draws ``sample(len)`` at least 10 and at most 60 times, until every expected item showed
        up: never more than ``len`` at once, so only BUF-007 depends on drawing beyond ``len``.
        """
        n = len(self.rb)
        if n == 0:
            return set()
        seen: set[int] = set()
        allowed, want = set(self.table.items), set(self.fifo)
        for draw in range(60):
            seen.update(self.table.check_sample(self.rb.sample(n), allowed))
            if draw >= 9 and seen >= want:  # at least 10 draws, so stray rows get their chance
                break
        return seen

    def expect_stored(self, what: str) -> None:
        got = self.stored()
        want = set(self.fifo)
        if got != want:
            raise _fail(
                f"{what}: buffer holds uids {sorted(got)}, expected {sorted(want)} "
                f"(missing {sorted(want - got)}, unexpected {sorted(got - want)})"
            )


def _indices(idx: Any, n: int, what: str) -> list[int]:
    if not isinstance(idx, torch.Tensor):
        raise _fail(f"{what}: extend returned {type(idx).__name__}, expected a 1-D integer tensor")
    if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dtype.is_complex:
        raise _fail(
            f"{what}: extend returned indices of dtype {idx.dtype}, expected an integer dtype"
        )
    if idx.ndim != 1 or idx.shape[0] != n:
        raise _fail(f"{what}: extend returned indices of shape {list(idx.shape)}, expected [{n}]")
    return [int(i) for i in idx.tolist()]


@requirement("BUF-001")
def extend_returns_indices(ctx: Context) -> None:
    r = _Run(ctx)
    a = _indices(r.write(3), 3, "first extend of 3 items")
    b = _indices(r.write(4), 4, "second extend of 4 items")
    if len(set(a + b)) != 7:
        raise _fail(
            f"7 items written below capacity {CAP} got indices {a} and {b}: not all distinct"
        )
    if any(not 0 <= i < CAP for i in a + b):
        raise _fail(f"indices {a + b} fall outside [0, capacity={CAP})")
    c = _indices(r.write(3), 3, "extend that wraps around")
    if len(set(c)) != 3:
        raise _fail(f"3 items written in one extend got indices {c}: not distinct")


@requirement("BUF-002")
def len_counts_items(ctx: Context) -> None:
    r = _Run(ctx)
    if len(r.rb) != 0:
        raise _fail(f"a fresh buffer has len {len(r.rb)}, expected 0")
    total = 0
    for n in (3, 4, 5, 9):
        r.write(n)
        total += n
        want = min(total, CAP)
        if len(r.rb) != want:
            raise _fail(
                f"after writing {total} items into capacity {CAP}: len is {len(r.rb)}, expected {want}"
            )


@requirement("BUF-003")
def fifo_eviction(ctx: Context) -> None:
    r = _Run(ctx)
    for n in (5, 5):
        r.write(n)
    r.expect_stored(f"after 10 writes into capacity {CAP}")
    r.write(CAP + 3)  # a batch longer than the buffer: only its tail survives
    r.expect_stored(f"after one extend of {CAP + 3} items into capacity {CAP}")
    _stateful_fifo(ctx)


def _stateful_fifo(ctx: Context) -> None:
    """Hypothesis drives random extend/sample sequences against the FIFO model."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        invariant,
        rule,
        run_state_machine_as_test,
    )

    class FifoMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run = _Run(ctx, capacity=5)

        @rule(n=st.integers(min_value=1, max_value=7))
        def extend(self, n: int) -> None:
            self.run.write(n)

        @rule()
        def sample(self) -> None:
            if len(self.run.rb):
                self.run.table.check_sample(self.run.rb.sample(3), set(self.run.fifo))

        @invariant()
        def length(self) -> None:
            if len(self.run.rb) != len(self.run.fifo):
                raise _fail(f"len is {len(self.run.rb)}, the FIFO model holds {len(self.run.fifo)}")

        def teardown(self) -> None:
            self.run.expect_stored("at the end of a random extend/sample sequence")

    run_state_machine_as_test(
        FifoMachine,
        settings=settings(
            max_examples=12,
            stateful_step_count=8,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


@requirement("BUF-004")
def sample_batch_size(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(5)
    for n in (1, 3, 5):
        s = r.rb.sample(n)
        if not isinstance(s, TensorDictBase):
            raise _fail(f"sample({n}) returned {type(s).__name__}, expected a TensorDict")
        if tuple(s.batch_size) != (n,):
            raise _fail(f"sample({n}) has batch size {list(s.batch_size)}, expected [{n}]")


@requirement("BUF-005")
def sample_schema(ctx: Context) -> None:
    r = _Run(ctx)
    written = r.batch(4)
    r.rb.extend(written)
    want = {k: (v.dtype, tuple(v.shape[1:])) for k, v in leaves(written).items()}
    got = {k: (v.dtype, tuple(v.shape[1:])) for k, v in leaves(r.rb.sample(3)).items()}
    problems = [f"key {key_str(k)} missing" for k in want if k not in got]
    problems += [
        f"key {key_str(k)}: expected {want[k][0]} {list(want[k][1])}, found {got[k][0]} {list(got[k][1])}"
        for k in want
        if k in got and got[k] != want[k]
    ]
    if problems:
        raise _fail("sample does not match the stored schema: " + "; ".join(problems))


@requirement("BUF-006")
def sample_holds_stored_items(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(6)
    r.expect_stored("after writing 6 items")
    r.write(6)
    r.expect_stored(f"after writing 12 items into capacity {CAP}")


@requirement("BUF-007")
def sampling_with_replacement(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(3)
    s = r.rb.sample(10)
    if tuple(s.batch_size) != (10,):
        raise _fail(
            f"sample(10) from 3 stored items has batch size {list(s.batch_size)}, expected [10]"
        )
    r.table.check_sample(s, set(r.fifo))
    r.expect_stored("repeated sampling from 3 items")


@requirement("BUF-008")
def sample_is_a_copy(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(4)
    s = r.rb.sample(4)
    for v in leaves(s).values():
        v.fill_(True if v.dtype == torch.bool else 99)
    r.expect_stored("after filling a sample's tensors in place with 99")


def _rejects(ctx: Context, make_bad: Any, what: str, key_name: str) -> None:
    """A bad extend must raise naming the key, and leave everything exactly as before."""
    r, twin = _Run(ctx), _Run(ctx)
    for run in (r, twin):
        run.write(6)
    bad = make_bad(r.batch(3))
    before = len(r.rb)
    problems: list[str] = []
    try:
        r.rb.extend(bad)
    except Exception as e:  # any exception type; the message must name the key
        if key_name not in str(e):
            problems.append(
                f"raised {type(e).__name__} without naming {key_name!r}: {str(e)[:200]}"
            )
    else:
        problems.append("was accepted")
    if len(r.rb) != before:
        problems.append(f"len went from {before} to {len(r.rb)}")
    try:
        r.expect_stored("contents")
    except ConformanceError as e:
        problems.append(str(e))
    twin.next_uid = r.next_uid
    nxt = r.batch(4)
    a, b = r.rb.extend(nxt).tolist(), twin.rb.extend(nxt).tolist()
    if a != b:
        problems.append(f"the next extend wrote at {a}; an untouched buffer writes at {b}")
    if problems:
        raise _fail(f"extend with {what}: " + "; ".join(problems))


@requirement("BUF-009")
def missing_key_rejected(ctx: Context) -> None:
    key = LLM_LAYOUT_V1.key("attention_mask")
    _rejects(ctx, lambda td: td.exclude(key), f"key {key_str(key)} missing", key[-1])


@requirement("BUF-010")
def extra_key_rejected(ctx: Context) -> None:
    _rejects(
        ctx,
        lambda td: td.set(("extra", "surprise_key"), torch.zeros(td.batch_size[0])),
        "an extra key ('extra', 'surprise_key')",
        "surprise_key",
    )


@requirement("BUF-011")
def wrong_dtype_rejected(ctx: Context) -> None:
    key = LLM_LAYOUT_V1.key("sample_log_probs")

    def bad(td: TensorDictBase) -> TensorDictBase:
        return td.set(key, td.get(key).double())

    _rejects(ctx, bad, f"key {key_str(key)} as float64 instead of float32", key[-1])


@requirement("BUF-012")
def wrong_shape_rejected(ctx: Context) -> None:
    key = LLM_LAYOUT_V1.key("tokens")

    def bad(td: TensorDictBase) -> TensorDictBase:
        v = td.get(key)
        return td.set(key, torch.cat([v, v[:, :1]], dim=1), inplace=False)

    _rejects(ctx, bad, f"key {key_str(key)} of item shape [{T + 1}] instead of [{T}]", "tokens")


@requirement("BUF-013")
def empty_sample_raises(ctx: Context) -> None:
    rb = ctx.make(CAP)
    try:
        s = rb.sample(2)
    except Exception:
        return
    raise _fail(f"sample(2) on an empty buffer returned {type(s).__name__} instead of raising")


def _roundtrip(ctx: Context, save_load: Any, what: str) -> None:
    r = _Run(ctx)
    for n in (5, 6):  # wraps around: the write position is not trivially len
        r.write(n)
    fresh = _Run(ctx)
    save_load(r.rb, fresh.rb)
    fresh.table, fresh.fifo, fresh.next_uid = r.table, list(r.fifo), r.next_uid
    if len(fresh.rb) != len(r.rb):
        raise _fail(f"{what}: restored len is {len(fresh.rb)}, original {len(r.rb)}")
    fresh.expect_stored(f"{what}: restored buffer")
    nxt = r.batch(3)
    a = fresh.put(nxt).tolist()
    b = r.rb.extend(nxt).tolist()
    if a != b:
        raise _fail(
            f"{what}: the restored buffer's next extend wrote at {a}; the original writes at {b}"
        )
    fresh.expect_stored(f"{what}: restored buffer after one more extend")


@requirement("BUF-014")
def state_roundtrip(ctx: Context) -> None:
    def via_state_dict(src: Any, dst: Any) -> None:
        buf = io.BytesIO()
        torch.save(src.state_dict(), buf)
        buf.seek(0)
        dst.load_state_dict(torch.load(buf, weights_only=False))

    _roundtrip(ctx, via_state_dict, "state_dict/load_state_dict")


@requirement("BUF-015")
def empty_extend(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(3)
    idx = r.rb.extend(llm_batch(0, T))
    if not isinstance(idx, torch.Tensor) or idx.numel() != 0:
        raise _fail(f"extend of 0 items returned {idx!r}, expected an empty index tensor")
    if len(r.rb) != 3:
        raise _fail(f"extend of 0 items changed len from 3 to {len(r.rb)}")


@requirement("BUF-016")
def epochs_without_replacement(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(6)
    # Five epochs, not one: a sampler drawing with replacement passes a single epoch by chance
    # 1.5% of the time (6!/6**6); all five, about once in a billion runs.
    for epoch in range(5):
        got: list[int] = []
        for _ in range(3):
            got += r.table.check_sample(r.rb.sample(2), set(r.fifo))
        if sorted(got) != sorted(r.fifo):
            raise _fail(
                f"epoch {epoch}: three samples of 2 from 6 items drew uids {got}; "
                f"an epoch must visit each of {sorted(r.fifo)} once"
            )


@requirement("BUF-017")
def priorities_steer_sampling(ctx: Context) -> None:
    r = _Run(ctx)
    idx = r.write(2)
    r.rb.update_priority(idx, torch.tensor([10.0, 1.0]))
    uids = item_uids(r.rb.sample(2000))
    hi, lo = uids.count(r.fifo[0]), uids.count(r.fifo[1])
    if hi < 3 * max(lo, 1):
        raise _fail(
            f"priorities 10 and 1: drawn {hi} and {lo} times in 2000 draws; expected at least 3x as often"
        )


@requirement("BUF-018")
def dumps_loads_roundtrip(ctx: Context) -> None:
    def via_disk(src: Any, dst: Any) -> None:
        with ctx.tmpdir() as d:
            src.dumps(d / "buffer")
            dst.loads(d / "buffer")

    _roundtrip(ctx, via_disk, "dumps/loads")


@requirement("BUF-019")
def thread_safety(ctx: Context) -> None:
    writers, per_writer, n = 4, 10, 2
    total = writers * per_writer * n
    r = _Run(ctx, capacity=total)
    batches = [[r.batch(n) for _ in range(per_writer)] for _ in range(writers)]
    for bs in batches:
        for b in bs:
            r.table.add(b)
    errors: list[str] = []
    done = threading.Event()

    def write(bs: list[TensorDictBase]) -> None:
        try:
            for b in bs:
                r.rb.extend(b)
        except Exception as e:
            errors.append(f"writer raised {type(e).__name__}: {e}")

    def read() -> None:
        try:
            while not done.is_set():
                n = min(4, len(r.rb))  # len only grows here; never ask beyond it
                if n:
                    r.table.check_sample(r.rb.sample(n), set(r.table.items))
        except Exception as e:
            errors.append(f"reader raised {type(e).__name__}: {e}")

    ws = [threading.Thread(target=write, args=(bs,)) for bs in batches]
    rs = [threading.Thread(target=read) for _ in range(4)]
    for t in ws + rs:
        t.start()
    for t in ws:
        t.join(timeout=60)
    done.set()
    for t in rs:
        t.join(timeout=60)
    if errors:
        raise _fail("; ".join(errors[:3]))
    if len(r.rb) != total:
        raise _fail(
            f"4 writers x {per_writer} extends of {n}: len is {len(r.rb)}, expected {total}"
        )
    r.fifo = list(r.table.items)
    r.expect_stored("after concurrent writes")


@requirement("BUF-020")
def ragged_items(ctx: Context) -> None:
    rb = ctx.make(CAP)
    table = Table()
    base = next(_UID_BASES) * 100_000
    for i, lengths in enumerate(([5, 7, 6, 9], [8, 4, 10, 6])):  # the second extend too
        td = ragged_llm_batch(lengths, uid_start=base + 4 * i, seed=ctx.seed)
        try:
            rb.extend(td)
        except Exception as e:
            raise _fail(
                f"extend #{i + 1} of 4 ragged items (lengths {lengths}) raised {type(e).__name__}: {e}"
            ) from None
        table.add(td)
    seen: set[int] = set()
    for _ in range(40):
        seen.update(table.check_sample(rb.sample(4), set(table.items)))
    if seen != set(table.items):
        raise _fail(f"160 draws from 8 ragged items reached only uids {sorted(seen)}")


@requirement("BUF-021")
def cuda_storage(ctx: Context) -> None:
    if not torch.cuda.is_available():
        raise NotApplicable("capability 'cuda' declared, but this machine has no CUDA device")
    r = _Run(ctx)
    r.write(4)
    s = r.rb.sample(4)
    devs = {v.device.type for v in leaves(s).values()}
    if devs != {"cuda"}:
        raise _fail(f"a sample from CUDA storage lives on {sorted(devs)}, expected cuda")
    r.expect_stored("CUDA storage")


@requirement("BUF-022")
def read_by_index(ctx: Context) -> None:
    r = _Run(ctx)
    first = r.batch(5)
    idx_a = _indices(r.put(first), 5, "extend of 5 items")
    second = r.batch(6)
    idx_b = _indices(r.put(second), 6, f"extend of 6 more items into capacity {CAP}")
    latest: dict[int, int] = {}
    for i, u in zip(idx_a + idx_b, item_uids(first) + item_uids(second), strict=True):
        latest[i] = u
    ask = sorted(latest, key=lambda i: (i * 7919) % 101)  # a scrambled order
    got = r.rb.read(torch.tensor(ask, dtype=torch.int64))
    if tuple(got.batch_size) != (len(ask),):
        raise _fail(f"read of {len(ask)} indices returned batch size {list(got.batch_size)}")
    uids = r.table.check_sample(got, set(r.fifo))
    want = [latest[i] for i in ask]
    if uids != want:
        raise _fail(
            f"read({ask}) returned uids {uids}, expected {want} (the latest write per index)"
        )
    fresh = _Run(ctx)
    written = set(_indices(fresh.write(3), 3, "extend of 3 items"))
    bad = max(i for i in range(CAP) if i not in written)
    try:
        fresh.rb.read(torch.tensor([bad]))
    except Exception as e:
        if str(bad) not in str(e):
            raise _fail(
                f"read([{bad}]) of an index holding no item raised without naming it: {e}"
            ) from None
        return
    raise _fail(f"read([{bad}]) returned data for an index that holds no item (3 of {CAP} written)")


PRODUCERS, EXTENDS_PER_PRODUCER, PER_EXTEND = 3, 4, 3
PRODUCERS_WAIT_S = 120.0


class _Gate:
    """BUF-023's start line, run as a Ray actor: no producer extends before all have started.

    Ray starts the producers' worker processes seconds apart on a small machine; without a
    start line the first could finish before the last begins, and writes would never race.
    """

    def __init__(self) -> None:
        self.arrived = 0

    def arrive(self) -> None:
        self.arrived += 1

    def count(self) -> int:
        return self.arrived


def _produce(
    handle: Any, batches: list[TensorDictBase], bad: TensorDictBase | None, gate: Any
) -> tuple[list[list[int]], str]:
    """One producer, run as a Ray task: extend each batch (the bad one half-way); report.

    Returns the indices each good extend returned, and what the bad extend did:
    ``"raised <type>: <message>"``, ``"accepted"``, or ``""`` when there was none.
    """
    with optional_deps():
        import ray

    ray.get(gate.arrive.remote())
    deadline = time.monotonic() + PRODUCERS_WAIT_S / 2
    while ray.get(gate.count.remote()) < PRODUCERS and time.monotonic() < deadline:
        time.sleep(0.005)
    written: list[list[int]] = []
    outcome = ""
    for i, b in enumerate(batches):
        if bad is not None and i == len(batches) // 2:
            try:
                handle.extend(bad)
                outcome = "accepted"
            except Exception as e:  # any type; the message must name the key
                outcome = f"raised {type(e).__name__}: {e}"
        written.append([int(j) for j in handle.extend(b).tolist()])
    return written, outcome


@requirement("BUF-023")
def many_producers(ctx: Context) -> None:
    try:
        import ray
    except ImportError:
        raise _fail("capability remote_writers declared, but ray is not installed") from None
    n_items = PRODUCERS * EXTENDS_PER_PRODUCER * PER_EXTEND
    total = 2 + n_items
    r = _Run(ctx, capacity=total + 8)  # room to spare: a duplicated write shows in len
    learner_idx = _indices(r.write(2), 2, "the learner's first extend of 2 items")
    if not ray.is_initialized():
        raise _fail("capability remote_writers declared, but the buffer started no Ray cluster")
    client = getattr(r.rb, "client", None)
    if not callable(client):
        raise _fail("capability remote_writers declared, but the buffer has no client()")
    batches = [[r.batch(PER_EXTEND) for _ in range(EXTENDS_PER_PRODUCER)] for _ in range(PRODUCERS)]
    for bs in batches:
        for b in bs:
            r.table.add(b)
    key = LLM_LAYOUT_V1.key("attention_mask")
    bad = r.batch(PER_EXTEND).exclude(key)  # its uids never enter the table: must never show
    gate: Any = ray.remote(num_cpus=0)(_Gate).remote()
    task = ray.remote(num_cpus=0)(_produce)
    refs = [
        task.remote(client(), bs, bad if i == 0 else None, gate) for i, bs in enumerate(batches)
    ]
    allowed, pending, draws, stray = set(r.table.items), list(refs), 0, ""
    deadline = time.monotonic() + PRODUCERS_WAIT_S
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
        try:
            r.table.check_sample(r.rb.sample(min(4, len(r.rb))), allowed)
        except ConformanceError as e:
            stray = stray or f"a sample drawn while they wrote: {e}"
        draws += 1
    if pending:
        for ref in pending:  # never leave a producer writing into a buffer the check dropped
            ray.cancel(ref, force=True)
        raise _fail(
            f"{len(pending)} of {PRODUCERS} producers did not finish within {PRODUCERS_WAIT_S:.0f} s"
        )
    try:
        results = ray.get(refs)
    except Exception as e:
        raise _fail(f"a producer's good extend raised {type(e).__name__}: {str(e)[:300]}") from None
    finally:
        ray.kill(gate, no_restart=True)
    problems = [stray] if stray else []
    outcome = results[0][1]
    if not outcome.startswith("raised"):
        problems.append(
            f"a producer's extend with key {key_str(key)} missing was {outcome or 'never sent'}"
        )
    elif key[-1] not in outcome:
        problems.append(
            f"a producer's extend with key {key_str(key)} missing {outcome[:200]} without naming it"
        )
    idx = learner_idx + [i for written, _ in results for ix in written for i in ix]
    if len(set(idx)) != len(idx) or any(not 0 <= i < r.capacity for i in idx):
        dup = sorted(i for i in set(idx) if idx.count(i) > 1)
        problems.append(
            f"{total} items written below capacity {r.capacity} got indices {sorted(idx)} "
            f"(repeated: {dup}): writes landed on each other"
        )
    if len(r.rb) != total:
        problems.append(
            f"len is {len(r.rb)}, expected {total} (2 by the learner, {n_items} by producers)"
        )
    if problems:
        raise _fail(
            f"{PRODUCERS} producers extending while the learner sampled ({draws} draws): "
            + "; ".join(problems)
        )
    r.fifo = list(r.table.items)
    r.expect_stored(f"after {PRODUCERS} producers extended concurrently")
