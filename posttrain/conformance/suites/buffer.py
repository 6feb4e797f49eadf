"""The buffer suite: one check per BUF requirement (specs/buffer-v1.md).

Every check builds fresh buffers with ``ctx.make(capacity)`` and LLM-layout batches whose
items carry unique ids, so a sample can be traced back to the write it came from. What the
checks share lives beside them: the run of a buffer beside its FIFO model (``_buffer_run``),
the state machine driving random call sequences against that model (``_buffer_model``), the bad
extends BUF-009 to BUF-012 build (``_buffer_rejects``) and the concurrent writers of BUF-019
(``_buffer_threads``).
"""

from __future__ import annotations

import io
import itertools
import pathlib
import pickle
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from posttrain._checkpoint import MANIFEST, reseal, why_unsafe
from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.explore import for_all
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._buffer_model import drive_model
from posttrain.conformance.suites._buffer_rejects import (
    ITEM,
    REAL_DTYPES,
    RESHAPES,
    STORED,
    Bad,
    BadCase,
    bad_extends,
    naming,
    rejects,
    reshaped,
    retyped,
)
from posttrain.conformance.suites._buffer_run import (
    ALL_KEYS,
    CAP,
    UID_BASES,
    Run,
    T,
    indices,
    keys_for,
    scribble,
    short_err,
)
from posttrain.conformance.suites._buffer_threads import concurrent_writes
from posttrain.conformance.suites._compare import Table, id_list, leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._remote import (
    EXTENDS_PER_PRODUCER,
    PER_EXTEND,
    PRODUCERS,
    run_producers,
)
from posttrain.contracts.keys import key_str
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import item_uids, llm_batch, ragged_llm_batch


@requirement("BUF-001")
def extend_returns_indices(ctx: Context) -> None:
    r = Run(ctx)
    # uid -> the index extend returned for it, for every item the FIFO model says is stored
    where: dict[int, int] = {}
    for k, n in enumerate((3, 4, 3, 5, CAP, 2), 1):  # fills, wraps, replaces all, wraps again
        what = f"extend #{k} of {n} items into capacity {CAP}"
        td = r.batch(n)
        before = list(r.fifo)
        idx = indices(r.put(td), n, what)
        if len(set(idx)) != n:
            raise _fail(f"{what} returned indices {idx}: not distinct")
        if any(not 0 <= i < CAP for i in idx):
            raise _fail(f"{what} returned indices {idx}: outside [0, capacity={CAP})")
        kept = set(r.fifo)
        survivors = [u for u in before if u in kept]
        clash = sorted(u for u in survivors if where[u] in idx)
        # Two stored items cannot sit at one index: an extend must write where nothing stored
        # remains, and once full exactly where the items it evicts were. Blamed on the indices
        # only when the contents are the FIFO model's; a wrong eviction is BUF-003's to report.
        if clash and r.holds_fifo():
            evicted = [where[u] for u in before if u not in kept]
            raise _fail(
                f"{what} returned indices {idx}, but {[where[u] for u in clash]} are the indices "
                f"earlier extends returned for uids {clash}, still stored; the items it evicted "
                f"were at {evicted}: the indices do not address the items written"
            )
        if clash:
            return  # the contents left the FIFO model: BUF-003 says how
        where = {u: where[u] for u in survivors} | dict(zip(item_uids(td), idx, strict=True))
    drive_model(ctx, "BUF-001")


@requirement("BUF-002")
def len_counts_items(ctx: Context) -> None:
    r = Run(ctx)
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
    drive_model(ctx, "BUF-002")


@requirement("BUF-003")
def fifo_eviction(ctx: Context) -> None:
    r = Run(ctx)
    for n in (5, 5):
        r.write(n)
    r.expect_stored(f"after 10 writes into capacity {CAP}")
    r.write(CAP + 3)  # a batch longer than the buffer: only its tail survives
    r.expect_stored(f"after one extend of {CAP + 3} items into capacity {CAP}")
    drive_model(ctx, "BUF-003")


@requirement("BUF-004")
def sample_batch_size(ctx: Context) -> None:
    r = Run(ctx)
    r.write(5)
    for n in (1, 3, 5):
        s = r.rb.sample(n)
        if not isinstance(s, TensorDictBase):
            raise _fail(f"sample({n}) returned {type(s).__name__}, expected a TensorDict")
        if tuple(s.batch_size) != (n,):
            raise _fail(f"sample({n}) has batch size {list(s.batch_size)}, expected [{n}]")


@requirement("BUF-005")
def sample_schema(ctx: Context) -> None:
    r = Run(ctx)
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
    r = Run(ctx)
    r.write(6)
    r.expect_stored("after writing 6 items", complete=False)
    r.write(6)
    r.expect_stored(f"after writing 12 items into capacity {CAP}", complete=False)
    # A written item is what the batch held at the extend call: a buffer keeping references
    # to the caller's tensors hands back whatever the caller writes into them later.
    last = r.batch(5)
    r.put(last)
    scribble(last)
    r.expect_stored(
        "after an extend of 5 items, then filling that batch's tensors with 99", complete=False
    )
    drive_model(ctx, "BUF-006")


@requirement("BUF-007")
def sampling_with_replacement(ctx: Context) -> None:
    r = Run(ctx)
    r.write(3)
    s = r.rb.sample(10)
    if tuple(s.batch_size) != (10,):
        raise _fail(
            f"sample(10) from 3 stored items has batch size {list(s.batch_size)}, expected [10]"
        )
    r.table.check_sample(s, set(r.fifo))
    r.expect_stored("repeated sampling from 3 items")
    drive_model(ctx, "BUF-007")


@requirement("BUF-008")
def sample_is_a_copy(ctx: Context) -> None:
    r = Run(ctx)
    r.write(4)
    scribble(r.rb.sample(4))
    r.expect_stored("after filling a sample's tensors in place with 99")


@requirement("BUF-009")
def missing_key_rejected(ctx: Context) -> None:
    # Every stored key in turn, optional fields included: a buffer checking only the fields it
    # needs writes the new items with the evicted items' values for the missing one.
    first = LLM_LAYOUT_V1.key("attention_mask")
    stored = STORED
    cases: list[BadCase] = [
        (
            lambda td, key=key: td.exclude(key),  # type: ignore[misc]
            f"key {key_str(key)} missing",
            naming(key, stored),
        )
        for key in [first, *(k for k in stored if k != first)]
    ]
    rejects(ctx, cases)


@requirement("BUF-010")
def extra_key_rejected(ctx: Context) -> None:
    rejects(
        ctx,
        [
            (
                lambda td: td.set(("extra", "surprise_key"), torch.zeros(td.batch_size[0])),
                "an extra key ('extra', 'surprise_key')",
                ("surprise_key",),
            )
        ],
    )


@requirement("BUF-011")
def wrong_dtype_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    def one(case: Bad) -> None:
        key, dtype, n, fill = case
        stored = ITEM[key].dtype
        if dtype == stored:  # the stored dtype: the next one of the list is wrong
            dtype = REAL_DTYPES[(REAL_DTYPES.index(dtype) + 1) % len(REAL_DTYPES)]
        what = f"key {key_str(key)} as {str(dtype)[6:]} instead of {str(stored)[6:]}"
        rejects(ctx, [(retyped(key, dtype), what, naming(key, STORED))], fill=fill, n=n)

    lp = LLM_LAYOUT_V1.key("sample_log_probs")
    tokens = LLM_LAYOUT_V1.key("tokens")
    for_all(
        ctx,
        bad_extends(st.sampled_from(REAL_DTYPES)),
        one,
        examples=6,
        boundaries=[
            (lp, torch.float64, 3, 6),
            (tokens, torch.int32, 1, CAP),
            (lp, torch.bfloat16, 2, 2 * CAP),
        ],
    )


@requirement("BUF-012")
def wrong_shape_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    # A ragged buffer takes each item's T from the item: a T one longer or shorter on one key
    # is tried on the tokens only (which key such an error names is the design's choice).
    hows = [
        h for h in RESHAPES if "ragged" not in ctx.capabilities or h not in ("longer", "shorter")
    ]
    tokens = LLM_LAYOUT_V1.key("tokens")

    def one(case: Bad) -> None:
        key, how, n, fill = case
        bad, what = reshaped(key, how)
        rejects(ctx, [(bad, what, naming(key, STORED))], fill=fill, n=n)

    for_all(
        ctx,
        bad_extends(st.sampled_from(hows)),
        one,
        examples=6,
        boundaries=[
            (tokens, "longer", 3, 6),
            (tokens, "same count", 2, CAP),
            (LLM_LAYOUT_V1.key("advantage"), "extra dim", 1, 2 * CAP),
        ],
    )


# What BUF-013 takes for a clear error: the message says the buffer is empty. An exception
# from deep inside (torch's "index 0 is out of bounds for dimension 0 with size 0") does not.
_SAYS_EMPTY = re.compile(
    r"empty|\bno items?\b|nothing (is )?stored|\blen(gth)?\b\D{0,12}\b0\b|\b0 items\b", re.I
)


@requirement("BUF-013")
def empty_sample_raises(ctx: Context) -> None:
    rb = ctx.make(CAP)
    try:
        s = rb.sample(2)
    except Exception as e:
        if _SAYS_EMPTY.search(str(e)):
            return
        raise _fail(
            f"sample(2) on an empty buffer raised {short_err(e)}: the message does not say "
            "the buffer is empty (expected words such as 'empty', 'no items' or 'len 0')"
        ) from None
    raise _fail(f"sample(2) on an empty buffer returned {type(s).__name__} instead of raising")


def _names(keys: tuple[tuple[str, ...], ...]) -> str:
    return "[" + ", ".join(key_str(k) for k in keys) + "]"


def _restored(ctx: Context, src: Run, fifo: list[int], load: Any, what: str) -> Run:
    """A fresh buffer ``load`` fills, checked to hold exactly ``fifo`` (src's items)."""
    fresh = Run(ctx, keys=src.keys)
    try:
        load(fresh.rb)
    except ConformanceError:
        raise
    except Exception as e:  # what the buffer itself saved, of items it took: no bad input
        raise _fail(f"{what}: restoring raised {short_err(e)}; expected the saved items") from e
    fresh.table, fresh.fifo, fresh.next_uid = src.table, list(fifo), src.next_uid
    if len(fresh.rb) != len(fifo):
        raise _fail(f"{what}: restored len is {len(fresh.rb)}, expected {len(fifo)}")
    fresh.expect_stored(f"{what}: restored buffer")
    return fresh


def _roundtrip(
    ctx: Context, save: Any, load: Any, what: str, keys: tuple[tuple[str, ...], ...]
) -> None:
    """``save(src)`` into something ``load(snapshot, dst)`` restores in a fresh buffer: contents
    and the next write position must be the original's; then the original moves on (CAP more
    items, every slot overwritten) and the same snapshot, restored again, must still give the
    contents and write position of the moment it was taken. Items hold ``keys`` beside the
    layout's (the key names the requirement's domain allows, see ``KEY_SETS``)."""
    r = Run(ctx, keys=keys)
    what = f"{what} of items with keys {_names(keys)} beside the layout's" if keys else what
    for n in (5, 6):  # wraps around: the write position is not trivially len
        r.write(n)
    snapshot, fifo = save(r.rb), list(r.fifo)
    fresh = _restored(ctx, r, fifo, lambda rb: load(snapshot, rb), what)
    nxt = r.batch(3)
    a = fresh.put(nxt).tolist()
    b = r.put(nxt).tolist()
    if a != b:
        raise _fail(
            f"{what}: the restored buffer's next extend wrote at {a}; the original writes at {b}"
        )
    fresh.expect_stored(f"{what}: restored buffer after one more extend")
    r.write(CAP)
    what = f"{what}, restored after the original was extended by {3 + CAP} more items"
    late = _restored(ctx, r, fifo, lambda rb: load(snapshot, rb), what)
    c = late.put(nxt).tolist()
    if c != b:
        raise _fail(
            f"{what}: its next extend wrote at {c}; the original wrote at {b} after the snapshot"
        )


@requirement("BUF-014")
def state_roundtrip(ctx: Context) -> None:
    # The object state_dict() returned, kept as a caller keeps it: not a serialized copy, so a
    # snapshot that is a view of the live storage shows (it changes with the later writes).
    # A copy through torch.save on each load checks that the state also survives serialization,
    # read back as a checkpoint should be: weights_only, so the kit never runs the state's code.
    def via_state_dict(state: Any, dst: Any) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        try:
            copy = torch.load(buf, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _fail(
                "state_dict() holds objects that torch.load(weights_only=True) refuses (only "
                f"tensors and plain data load without running code): {why_unsafe(e)}"
            ) from None
        dst.load_state_dict(copy)

    _roundtrip(
        ctx,
        lambda rb: rb.state_dict(),
        via_state_dict,
        "state_dict/load_state_dict",
        keys_for("BUF-014")[-1],
    )
    drive_model(ctx, "BUF-014")


@requirement("BUF-015")
def empty_extend(ctx: Context) -> None:
    _empty_first_extend(ctx)
    r, twin = Run(ctx), Run(ctx)
    r.write(6)
    twin.write(6)
    epochs = ctx.options["sampling"] == "without_replacement"
    # Five epochs, each broken by an extend of 0 items after its first draw: a sampler that
    # restarts there still draws the 4 items left first by chance once in 15 epochs; in all
    # five, about once in 760,000 runs.
    for epoch in range(5 if epochs else 1):
        drawn: list[int] = []
        if epochs:
            drawn += r.table.check_sample(r.rb.sample(2), set(r.fifo))
        idx = r.rb.extend(llm_batch(0, T))
        if not isinstance(idx, torch.Tensor) or idx.numel() != 0:
            raise _fail(f"extend of 0 items returned {idx!r}, expected an empty index tensor")
        if len(r.rb) != 6:
            raise _fail(f"extend of 0 items changed len from 6 to {len(r.rb)}")
        if epochs:  # a no-op leaves the sampler alone too: the epoch under way goes on
            for _ in range(2):
                drawn += r.table.check_sample(r.rb.sample(2), set(r.fifo))
            if sorted(drawn) != sorted(r.fifo):
                raise _fail(
                    f"epoch {epoch}: samples of 2, 2 and 2 from 6 items, an extend of 0 items "
                    f"after the first, drew uids {drawn}: the epoch must still visit each of "
                    f"{sorted(r.fifo)} once"
                )
    r.expect_stored("after an extend of 0 items")
    twin.next_uid = r.next_uid
    nxt = r.batch(4)
    a, b = r.rb.extend(nxt).tolist(), twin.rb.extend(nxt).tolist()
    if a != b:
        raise _fail(
            f"after an extend of 0 items the next extend wrote at {a}; "
            f"a buffer without it writes at {b}"
        )


def _empty_first_extend(ctx: Context) -> None:
    """An extend of 0 items into a fresh buffer holds no item, so it fixes no schema: the first
    items, of another T, are the first written."""
    r = Run(ctx)
    try:
        r.rb.extend(llm_batch(0, T + 3))
    except Exception as e:
        raise _fail(f"an extend of 0 items into a fresh buffer raised {short_err(e)}") from None
    try:
        r.write(4)
    except Exception as e:
        raise _fail(
            f"after an extend of 0 items of T {T + 3} into a fresh buffer, an extend of 4 items of "
            f"T {T} raised {short_err(e)}: the empty batch fixed the schema (no item was written)"
        ) from None
    if len(r.rb) != 4:
        raise _fail(f"an extend of 0 items, then of 4: len is {len(r.rb)}, expected 4")
    r.expect_stored("an extend of 0 items into a fresh buffer, then of 4 items", complete=False)


@requirement("BUF-016")
def epochs_without_replacement(ctx: Context) -> None:
    r = Run(ctx)
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
    _epochs_across_extends(ctx)


def _epochs_across_extends(ctx: Context, trials: int = 8) -> None:
    """Items written mid-epoch are stored items too: none may wait while an old one repeats.

    Per trial: 4 items, one sample of 2, 4 more items, then samples of 2 until every new item
    came. Counting only the draws after that extend, no item may come twice before each new
    one came once. A sampler that restarts its epoch at the extend passes, and so does one
    that finishes the epoch under way with the new items added; one whose epoch was fixed when
    it began (the new items wait for the next, which re-draws the old ones) repeats one of the
    2 old items left before the 4 new ones came in 14 of 15 trials: all 8 pass about once in
    2.5 billion runs.
    """
    for trial in range(trials):
        r = Run(ctx, capacity=2 * CAP)  # no eviction: every item written stays stored
        r.write(4)
        r.table.check_sample(r.rb.sample(2), set(r.fifo))
        td = r.batch(4)
        new = item_uids(td)
        r.put(td)
        drawn: list[int] = []
        while not set(new) <= set(drawn) and len(drawn) < 2 * len(r.fifo):
            got = r.table.check_sample(r.rb.sample(2), set(r.fifo))
            for u in got:
                if u in drawn and not set(new) <= set(drawn):
                    waiting = sorted(set(new) - set(drawn))
                    raise _fail(
                        f"trial {trial}: after 4 items, a sample of 2 and an extend of 4 new "
                        f"items {new}, samples of 2 drew uids {drawn + got}: uid {u} came twice "
                        f"before new uids {waiting} came once (every stored item must be "
                        "visited once before any repeats)"
                    )
                drawn.append(u)
        if not set(new) <= set(drawn):
            raise _fail(
                f"trial {trial}: after an extend of 4 new items {new} mid-epoch, "
                f"{len(drawn)} draws reached only {sorted(set(drawn))}"
            )


@requirement("BUF-017")
def priorities_steer_sampling(ctx: Context) -> None:
    r = Run(ctx)
    first = indices(r.write(5), 5, "extend of 5 items")
    second = indices(r.write(6), 6, f"extend of 6 more into capacity {CAP}")
    # After a wrap, by the indices the extends returned: a priority must land on the item
    # written there, not on a slot by position or age.
    where = dict(zip(r.fifo, first[3:] + second, strict=True))
    hi_uid, lo_uid = r.fifo[2], r.fifo[3]  # the second extend's first two items
    prio = {where[hi_uid]: 10.0, where[lo_uid]: 1.0}
    ask = sorted(where.values(), key=lambda i: (i * 7919) % 101)  # a scrambled order
    r.rb.update_priority(
        torch.tensor(ask, dtype=torch.int64), torch.tensor([prio.get(i, 0.0) for i in ask])
    )
    uids = item_uids(r.rb.sample(2000))
    said = (
        f"priorities 10 and 1 for uids {hi_uid} and {lo_uid} at indices {where[hi_uid]} and "
        f"{where[lo_uid]}, 0 for the other 6 stored items, by the indices extend returned"
    )
    zero = sorted({u for u in uids if u not in (hi_uid, lo_uid)})
    if zero:
        n = sum(uids.count(u) for u in zero)
        raise _fail(f"{said}: 2000 draws drew zero-priority uids {id_list(zero)} ({n} times)")
    hi, lo = uids.count(hi_uid), uids.count(lo_uid)
    if hi < 3 * max(lo, 1):
        raise _fail(
            f"{said}: drawn {hi} and {lo} times in 2000 draws; expected at least 3x as often"
        )


@requirement("BUF-018")
def dumps_loads_roundtrip(ctx: Context) -> None:
    with ctx.tmpdir() as d:

        def save(src: Any) -> Any:
            src.dumps(d / "buffer")
            return d / "buffer"

        _roundtrip(ctx, save, lambda path, dst: dst.loads(path), "dumps/loads", ALL_KEYS)
    drive_model(ctx, "BUF-018")


class _Payload:
    """Unpickling this touches ``marker``: the proof that a load ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _plant(path: Path, marker: Path, as_torch: bool) -> None:
    """Replace ``path`` by a pickle that touches ``marker`` when unpickled: a torch.save
    archive (as a state file is) or a bare pickle stream."""
    path.unlink()
    if as_torch:
        torch.save({"state": _Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(_Payload(marker), protocol=2))


@requirement("BUF-024")
def loads_runs_no_code(ctx: Context) -> None:
    with ctx.tmpdir() as d:
        src = Run(ctx)
        src.write(5)
        src.write(6)  # wraps around
        saved = d / "saved"
        src.rb.dumps(saved)
        files = sorted(p.relative_to(saved) for p in saved.rglob("*") if p.is_file())
        if not files:
            raise _fail(f"dumps({saved}) wrote no file")
        target = Run(ctx)
        target.write(3)
        problems: list[str] = []
        for i, (rel, as_torch) in enumerate(itertools.product(files, (True, False))):
            case, marker = d / f"case-{i}", d / f"ran-{i}"
            shutil.copytree(saved, case, symlinks=True)
            _plant(case / rel, marker, as_torch)
            # A manifest of checksums stops accidents, not a forger: resealed, the load must
            # still refuse the file on its own terms.
            if rel.as_posix() != MANIFEST:
                reseal(case)
            what = f"{rel.as_posix()} replaced by a {'torch.save' if as_torch else 'bare'} pickle"
            try:
                target.rb.loads(case)
            except Exception:  # any error type: a refusal
                raised = True
            else:
                raised = False
            if marker.exists():
                problems.append(f"{what}: loads ran the pickle's code (it created {marker.name})")
            elif not raised:
                problems.append(f"{what}: loads accepted it")
            else:
                try:
                    target.expect_stored(f"{what}: after loads raised, the buffer")
                except ConformanceError as e:
                    problems.append(str(e))
            shutil.rmtree(case, ignore_errors=True)
            if problems:
                break
        if problems:
            names = [f.as_posix() for f in files]
            shown = ", ".join(names[:10]) + (
                f", ... and {len(names) - 10} more" * (len(names) > 10)
            )
            raise _fail(f"dumps wrote {len(names)} file(s) ({shown}); " + "; ".join(problems))


@requirement("BUF-019")
def thread_safety(ctx: Context) -> None:
    concurrent_writes(ctx, capacity=80, per_writer=10)  # no eviction: every item kept
    concurrent_writes(ctx, capacity=32, per_writer=10)  # 48 of the 80 writes evict


_SNAPSHOT_ROUNDS = 12
"""Rounds of snapshots BUF-025 takes while the writers extend (times --conformance-depth)."""

_SNAPSHOT_WRITES_MAX = 4000
"""Extends a BUF-025 writer makes at most, however long the snapshots take."""


@requirement("BUF-025")
def consistent_snapshots(ctx: Context) -> None:
    """Snapshots taken while 4 threads extend: each restores whole written items only."""
    capacity, writers, per_writer, n = 16, 4, 40, 2
    r = Run(ctx, capacity=capacity)
    r.write(capacity)  # full from the start: every write below overwrites a stored row
    batches = [[r.batch(n) for _ in range(per_writer)] for _ in range(writers)]
    for bs in batches:
        for b in bs:
            r.table.add(b)
    errors: list[str] = []
    start = threading.Barrier(writers + 1)
    stop = threading.Event()

    def write(bs: list[TensorDictBase]) -> None:
        # Every batch once, then on around them until the snapshots are taken: each snapshot
        # overlaps writes however the threads are scheduled (a busy machine included).
        try:
            start.wait(timeout=30)
            i = 0
            while i < len(bs) or (not stop.is_set() and i < _SNAPSHOT_WRITES_MAX):
                r.rb.extend(bs[i % len(bs)])
                i += 1
        except Exception as e:
            errors.append(f"writer raised {short_err(e)}")

    threads = [threading.Thread(target=write, args=(bs,)) for bs in batches]
    for t in threads:
        t.start()
    start.wait(timeout=30)
    snapshots: list[tuple[str, Any]] = []
    with ctx.tmpdir() as d:
        k = 0
        until = time.monotonic() + 30
        while k < _SNAPSHOT_ROUNDS * ctx.depth and time.monotonic() < until:
            snapshots.append(("state_dict()", r.rb.state_dict()))
            if "checkpoint" in ctx.capabilities:
                path = d / f"snap-{k}"
                r.rb.dumps(path)
                snapshots.append((f"dumps() #{k}", path))
            if "read" in ctx.capabilities:
                snapshots.append(("read()", r.rb.read(torch.arange(capacity))))
            k += 1
        stop.set()
        for t in threads:
            t.join(timeout=60)
        if errors:
            raise _fail("; ".join(errors[:3]))
        allowed = set(r.table.items)
        for what, snap in snapshots:
            try:
                if what == "read()":
                    r.table.check_sample(snap, allowed)
                    continue
                fresh = Run(ctx, capacity=capacity)
                if isinstance(snap, Path):
                    fresh.rb.loads(snap)
                else:
                    fresh.rb.load_state_dict(snap)
                if len(fresh.rb) != capacity:
                    raise ConformanceError(f"restores len {len(fresh.rb)}, expected {capacity}")
                for _ in range(8):
                    r.table.check_sample(fresh.rb.sample(capacity), allowed)
            except ConformanceError as e:
                raise _fail(
                    f"a {what} taken while {writers} threads extended a full buffer of "
                    f"{capacity} ({len(snapshots)} snapshots): {e} (a torn item: fields from "
                    "two different writes)"
                ) from None


@requirement("BUF-020")
def ragged_items(ctx: Context) -> None:
    rb = ctx.make(CAP)
    table = Table()
    base = next(UID_BASES) * 100_000
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
    r = Run(ctx)
    r.write(4)
    s = r.rb.sample(4)
    devs = {v.device.type for v in leaves(s).values()}
    if devs != {"cuda"}:
        raise _fail(f"a sample from CUDA storage lives on {sorted(devs)}, expected cuda")
    r.expect_stored("CUDA storage")


@requirement("BUF-022")
def read_by_index(ctx: Context) -> None:
    r = Run(ctx)
    first = r.batch(5)
    idx_a = indices(r.put(first), 5, "extend of 5 items")
    second = r.batch(6)
    idx_b = indices(r.put(second), 6, f"extend of 6 more items into capacity {CAP}")
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
    drive_model(ctx, "BUF-022")
    fresh = Run(ctx)
    written = set(indices(fresh.write(3), 3, "extend of 3 items"))
    unwritten = max(i for i in range(CAP) if i not in written)
    # Storage indices are what extend returns, 0..capacity-1: a negative index or one past the
    # capacity holds no item either (Python's wrap-around would read another item).
    for bad in (unwritten, -1, -CAP, CAP, CAP + 3):
        try:
            got = fresh.rb.read(torch.tensor([bad]))
        except Exception as e:
            if str(bad) not in str(e):
                raise _fail(
                    f"read([{bad}]) of an index holding no item raised without naming it: {e}"
                ) from None
            continue
        raise _fail(
            f"read([{bad}]) returned {type(got).__name__} for an index that holds no item "
            f"(3 of {CAP} written, at {sorted(written)})"
        )


@requirement("BUF-023")
def many_producers(ctx: Context) -> None:
    try:
        import ray
    except ImportError:
        raise _fail("capability remote_writers declared, but ray is not installed") from None
    n_items = PRODUCERS * EXTENDS_PER_PRODUCER * PER_EXTEND
    total = 2 + n_items
    r = Run(ctx, capacity=total + 8)  # room to spare: a duplicated write shows in len
    learner_idx = indices(r.write(2), 2, "the learner's first extend of 2 items")
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
    allowed, draws, stray = set(r.table.items), 0, ""

    def sample_once() -> None:  # the learner, between polls of the producers
        nonlocal draws, stray
        try:
            r.table.check_sample(r.rb.sample(min(4, len(r.rb))), allowed)
        except ConformanceError as e:
            stray = stray or f"a sample drawn while they wrote: {e}"
        draws += 1

    results = run_producers(client, batches, bad, sample_once)
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
            f"{total} items written below capacity {r.capacity} got indices "
            f"{id_list(sorted(idx))} (repeated: {id_list(dup)}): writes landed on each other"
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
