"""The buffer suite: one check per BUF requirement (specs/buffer-v1.md).

Every check builds fresh buffers with ``ctx.make(capacity)`` and LLM-layout batches whose
items carry unique ids, so a sample can be traced back to the write it came from.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain._checkpoint import MANIFEST, reseal, why_unsafe
from posttrain.conformance.context import ConformanceError, Context, NotApplicable
from posttrain.conformance.explore import for_all, run_machine
from posttrain.conformance.registry import requirement
from posttrain.conformance.suites._compare import Table, id_list, leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.conformance.suites._remote import (
    EXTENDS_PER_PRODUCER,
    PER_EXTEND,
    PRODUCERS,
    run_producers,
)
from posttrain.contracts.buffer import BUFFER
from posttrain.contracts.layout import LLM_LAYOUT_V1, key_str
from posttrain.testing import PROMPT_LEN, item_uids, llm_batch, ragged_llm_batch

CAP = 8
T = 8
_UID_BASES = itertools.count(1)


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

    def expect_stored(self, what: str, *, complete: bool = True) -> None:
        """Sampling finds exactly the model's items; with ``complete=False`` only none other
        (that sampling reaches every stored item is BUF-007's and BUF-016's to say)."""
        try:
            got = self.stored()
        except ConformanceError as e:
            raise _fail(f"{what}: {e}") from None
        want = set(self.fifo)
        if got != want and (complete or not got <= want):
            raise _fail(
                f"{what}: buffer holds uids {id_list(sorted(got))}, expected "
                f"{id_list(sorted(want))} (missing {id_list(sorted(want - got))}, unexpected "
                f"{id_list(sorted(got - want))})"
            )

    def holds_fifo(self) -> bool:
        """Whether sampling finds exactly the FIFO model's items (uids only, never raising).

        Lets a check tell its own requirement's failure from a wrong eviction order, which
        BUF-003 reports: anything unexpected, an exception included, answers False.
        """
        want, seen = set(self.fifo), set()
        try:
            for _ in range(60):
                seen.update(item_uids(self.rb.sample(len(want))))
                if seen >= want:
                    break
        except Exception:  # a sample the kit cannot read is not this check's to report
            return False
        return seen == want


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
    # uid -> the index extend returned for it, for every item the FIFO model says is stored
    where: dict[int, int] = {}
    for k, n in enumerate((3, 4, 3, 5, CAP, 2), 1):  # fills, wraps, replaces all, wraps again
        what = f"extend #{k} of {n} items into capacity {CAP}"
        td = r.batch(n)
        before = list(r.fifo)
        idx = _indices(r.put(td), n, what)
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
    _drive_model(ctx, "BUF-001")


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
    _drive_model(ctx, "BUF-002")


@requirement("BUF-003")
def fifo_eviction(ctx: Context) -> None:
    r = _Run(ctx)
    for n in (5, 5):
        r.write(n)
    r.expect_stored(f"after 10 writes into capacity {CAP}")
    r.write(CAP + 3)  # a batch longer than the buffer: only its tail survives
    r.expect_stored(f"after one extend of {CAP + 3} items into capacity {CAP}")
    _drive_model(ctx, "BUF-003")


# ----------------------------------------------------------------------------------------------
# The model: a FIFO of uids, compared with the buffer after every call of a random sequence.

_F32_EDGES = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4028235e38,
              -3.4028235e38, 1.1754944e-38, 1.0, -1.0)  # fmt: skip
_I64_EDGES = (0, -1, 1, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1, 2**53 + 1)
VALUE_REGIMES = ("ordinary", "random bits", "edges")
"""How an item's values are drawn: as ``llm_batch`` writes them; every bit pattern of each
column's dtype (NaN payloads, infinities, subnormals, -0.0, the integer extremes); the boundary
values of each dtype alone."""
_UID_KEY = LLM_LAYOUT_V1.key("tokens")


def _wild_values(td: TensorDictBase, regime: str, seed: int) -> TensorDictBase:
    """``td`` with values from the whole range of each column's dtype (uids and masks kept)."""
    if regime == "ordinary":
        return td
    g = torch.Generator().manual_seed(seed)
    out = td.clone()
    for k, v in leaves(td).items():
        if v.dtype == torch.bool:
            continue
        if regime == "random bits":
            width = torch.int32 if v.element_size() == 4 else torch.int64
            info = torch.iinfo(width)
            bits = torch.randint(info.min, info.max, v.shape, generator=g).to(width)
            new = (
                bits.view(v.dtype) if v.element_size() == bits.element_size() else bits.to(v.dtype)
            )
        else:
            floats = v.is_floating_point()
            edges = torch.tensor(
                _F32_EDGES if floats else _I64_EDGES, dtype=torch.float64 if floats else torch.int64
            )
            new = edges[torch.randint(0, len(edges), v.shape, generator=g)].to(v.dtype)
        if k == _UID_KEY:
            new[..., 0] = v[..., 0]  # the uid stays: it traces a sample back to its write
        out.set(k, new)
    return out


def _column_major(td: TensorDictBase) -> TensorDictBase:
    """The same values with every 2-D leaf non-contiguous (column-major strides)."""
    return td.apply(lambda v: v.t().contiguous().t() if v.ndim == 2 else v)


def _keys_reordered(td: TensorDictBase, seed: int) -> TensorDictBase:
    """The same items with their keys, nested ones too, inserted in a shuffled order."""
    order = list(leaves(td).items())
    perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(seed)).tolist()
    out = TensorDict({}, batch_size=td.batch_size)
    for i in perm:
        out.set(order[i][0], order[i][1])
    return out


def _model_machine(ctx: Context, focus: str, root: Path | None) -> type[Any]:
    """A state machine comparing the buffer with a FIFO model of uids after every call.

    ``focus`` is the requirement it checks: BUF-001 the indices extend returns, BUF-002 len,
    BUF-003 the contents (sampled at the end), BUF-006 every sample, BUF-007 samples of up to
    16 items whatever len is (with replacement); it also chooses which
    operations join extend, sample and len: ``BUF-006`` overwrites the batch last extended, as a caller reusing its tensors
    does; ``BUF-014`` restores ``state_dict()`` (through ``torch.save``) into a fresh buffer
    that carries on; ``BUF-018`` the same through ``dumps``/``loads`` under ``root``;
    ``BUF-022`` reads stored indices in random orders, repeats included.
    """
    from hypothesis import reject
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    replacement = ctx.options["sampling"] == "with_replacement"
    saves = itertools.count()

    def broken(req: str, what: str) -> ConformanceError:
        """The failure of ``req``; a sequence that breaks another requirement is dropped
        (that requirement's own check reports it), so a verdict names the requirement broken."""
        if req != focus:
            reject()
        return _fail(f"{BUFFER.requirement(req).title}: {what}")

    class BufferModel(RuleBasedStateMachine):
        run: _Run
        t: int
        where: dict[int, int]  # uid -> the index extend returned, for every stored item
        last: TensorDictBase | None

        @initialize(capacity=st.sampled_from([1, 2, 3, 5, 8]), t=st.integers(PROMPT_LEN + 1, 12))
        def fresh(self, capacity: int, t: int) -> None:
            self.run = _Run(ctx, capacity=capacity)
            self.t, self.where, self.last = t, {}, None

        # n >= 1: an extend of 0 items is BUF-015's, a SHOULD
        @rule(
            n=st.one_of(st.sampled_from([1, 2, 9]), st.integers(1, 12)),
            regime=st.sampled_from(VALUE_REGIMES),
            strided=st.booleans(),
            data_seed=st.integers(0, 2**16),
            shuffled=st.booleans(),
        )
        def extend(
            self, n: int, regime: str, strided: bool, data_seed: int, shuffled: bool
        ) -> None:
            r = self.run
            td = _wild_values(r.batch(n, self.t), regime, data_seed)
            td = _column_major(td) if strided else td
            td = _keys_reordered(td, data_seed) if shuffled else td
            before = list(r.fifo)
            what = (
                f"extend of {n} items ({regime} values{', column-major' * strided}"
                f"{', keys in another order' * shuffled}) into "
                f"capacity {r.capacity} holding {len(before)}"
            )
            got = _indices(r.put(td), n, what)
            self.last = td
            kept = set(r.fifo)
            live = [(u, i) for u, i in zip(item_uids(td), got, strict=True) if u in kept]
            mine = [i for _, i in live]
            survivors = {self.where[u] for u in before if u in kept}
            if any(not 0 <= i < r.capacity for i in got):
                raise broken("BUF-001", f"{what} returned indices {got}: outside [0, capacity)")
            if len(set(mine)) != len(mine) or set(mine) & survivors:
                if not r.holds_fifo():  # the contents left the model: BUF-003's to report
                    raise broken("BUF-003", f"after {what} the contents are not the FIFO model's")
                raise broken(
                    "BUF-001",
                    f"{what} returned indices {got}: two stored items at one index (the items "
                    f"still stored from earlier extends are at {sorted(survivors)})",
                )
            self.where = {u: self.where[u] for u in before if u in kept} | dict(live)
            self.check_len(what)

        def check_len(self, after: str) -> None:
            if len(self.run.rb) != len(self.run.fifo):
                raise broken(
                    "BUF-002",
                    f"after {after}: len is {len(self.run.rb)}, expected {len(self.run.fifo)}",
                )

        @precondition(lambda self: len(self.run.fifo) > 0)
        @rule(k=st.integers(1, 16))
        def sample(self, k: int) -> None:
            r = self.run
            # Beyond len (with replacement) is BUF-007's own domain
            k = k if focus == "BUF-007" and replacement else min(k, len(r.fifo))
            s = r.rb.sample(k)
            if tuple(s.batch_size) != (k,):
                raise broken("BUF-004", f"sample({k}) has batch size {list(s.batch_size)}")
            try:
                r.table.check_sample(s, set(r.fifo))
            except ConformanceError as e:
                raise broken(
                    "BUF-007" if focus == "BUF-007" else "BUF-006",
                    f"sample({k}) of {len(r.fifo)} stored: {e}",
                ) from None

        if focus == "BUF-006":

            @precondition(lambda self: self.last is not None)
            @rule()
            def caller_reuses_its_batch(self) -> None:
                assert self.last is not None
                _scribble(self.last)

        if focus == "BUF-014":

            @rule()
            def restore_state_dict(self) -> None:
                buf = io.BytesIO()
                torch.save(self.run.rb.state_dict(), buf)
                buf.seek(0)
                self.carry_on(lambda rb: rb.load_state_dict(torch.load(buf, weights_only=True)))

        if focus == "BUF-018":

            @rule()
            def dumps_loads(self) -> None:
                assert root is not None
                path = root / f"save-{next(saves)}"
                self.run.rb.dumps(path)
                self.carry_on(lambda rb: rb.loads(path))

        if focus == "BUF-022":

            @precondition(lambda self: len(self.run.fifo) > 0)
            @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=10))
            def read(self, picks: list[int]) -> None:
                at = {i: u for u, i in self.where.items()}
                order = sorted(at)
                ask = [order[p % len(order)] for p in picks]
                got = self.run.rb.read(torch.tensor(ask, dtype=torch.int64))
                try:
                    uids = self.run.table.check_sample(got, set(self.run.fifo))
                except ConformanceError as e:
                    raise broken("BUF-022", f"read({ask}): {e}") from None
                if uids != [at[i] for i in ask]:
                    raise broken(
                        "BUF-022",
                        f"read({ask}) returned uids {uids}, expected {[at[i] for i in ask]}",
                    )

        def carry_on(self, load: Callable[[Any], None]) -> None:
            """Go on with a fresh buffer ``load`` restored; the model goes on unchanged."""
            r = self.run
            fresh = _Run(ctx, capacity=r.capacity)
            load(fresh.rb)
            fresh.table, fresh.fifo, fresh.next_uid = r.table, list(r.fifo), r.next_uid
            self.run = fresh
            if len(fresh.rb) != len(fresh.fifo):
                raise broken(focus, f"restored len is {len(fresh.rb)}, expected {len(fresh.fifo)}")
            if fresh.fifo and not fresh.holds_fifo():
                try:
                    fresh.expect_stored("the restored buffer")
                except ConformanceError as e:
                    raise broken(focus, str(e)) from None

        def teardown(self) -> None:
            if (
                focus in ("BUF-003", "BUF-014", "BUF-018")
                and hasattr(self, "run")
                and self.run.fifo
            ):
                try:
                    self.run.expect_stored("at the end of the sequence")
                except ConformanceError as e:
                    raise broken(focus, str(e)) from None

    BufferModel.__name__ = BufferModel.__qualname__ = f"BufferModel{focus[4:]}"
    return BufferModel


def _drive_model(ctx: Context, focus: str, examples: int = 6, steps: int = 10) -> None:
    """Random call sequences against the FIFO model, each failure named by its requirement."""
    with ctx.tmpdir() as root:
        run_machine(ctx, _model_machine(ctx, focus, root), examples=examples, steps=steps)


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


def _scribble(td: TensorDictBase) -> None:
    """Overwrite every tensor of ``td`` in place (uids included), as a caller reusing it would.

    Through ``apply_``, which reaches the tensors a lazy stack holds (a stacked view of them
    would be a copy, and filling it would reach nothing)."""
    td.apply_(lambda v: v.fill_(True if v.dtype == torch.bool else 99))


@requirement("BUF-006")
def sample_holds_stored_items(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(6)
    r.expect_stored("after writing 6 items", complete=False)
    r.write(6)
    r.expect_stored(f"after writing 12 items into capacity {CAP}", complete=False)
    # A written item is what the batch held at the extend call: a buffer keeping references
    # to the caller's tensors hands back whatever the caller writes into them later.
    last = r.batch(5)
    r.put(last)
    _scribble(last)
    r.expect_stored(
        "after an extend of 5 items, then filling that batch's tensors with 99", complete=False
    )
    _drive_model(ctx, "BUF-006")


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
    _drive_model(ctx, "BUF-007")


@requirement("BUF-008")
def sample_is_a_copy(ctx: Context) -> None:
    r = _Run(ctx)
    r.write(4)
    _scribble(r.rb.sample(4))
    r.expect_stored("after filling a sample's tensors in place with 99")


_BadCase = tuple[Callable[[TensorDictBase], TensorDictBase], str, tuple[str, ...]]
"""A bad batch for ``_rejects``: (make it from a good one, what it gets wrong, names the error
must contain)."""


def _short_err(e: BaseException) -> str:
    from posttrain.conformance.runner import remote_cause  # a Ray error: the actor's own error

    cause = remote_cause(e)
    return f"{type(cause).__name__}: {str(cause)[:200]}"


def _rejects(ctx: Context, cases: list[_BadCase], fill: int = 6, n: int = 3) -> None:
    """Each bad extend must raise naming the key, and leave everything exactly as before.

    The cases go to one buffer holding ``fill`` writes, each a batch of ``n`` items, and an
    untouched twin says where the next write must land. A case that was accepted ends the run:
    what it did to len, contents and the next write is reported, including exceptions the
    kit's own later calls then raise.
    """
    r, twin = _Run(ctx), _Run(ctx)
    for run in (r, twin):
        run.write(fill)
    before = len(r.rb)
    problems: list[str] = []
    for make_bad, what, names in cases:
        bad = make_bad(r.batch(n))
        accepted = False
        try:
            r.rb.extend(bad)
        except Exception as e:  # any exception type; the message must name the key
            if not all(name in str(e) for name in names):
                named = " and ".join(repr(name) for name in names)
                problems.append(
                    f"extend with {what}: raised {type(e).__name__} without naming {named}: "
                    f"{str(e)[:200]}"
                )
        else:
            accepted = True
            problems.append(f"extend with {what}: was accepted")
        if len(r.rb) != before:
            problems.append(f"len went from {before} to {len(r.rb)}")
            break  # the buffer changed: later cases would only report that again
        if accepted:
            break
    try:
        r.expect_stored("contents")
    except ConformanceError as e:
        problems.append(str(e))
    except Exception as e:  # the kit's own sample, after a bad batch went in: still a FAIL
        problems.append(f"then sample raised {_short_err(e)}")
    twin.next_uid = r.next_uid
    nxt = r.batch(4)
    try:
        a = r.rb.extend(nxt).tolist()
    except Exception as e:
        problems.append(f"then the next (good) extend raised {_short_err(e)}")
    else:
        b = twin.rb.extend(nxt).tolist()
        if a != b:
            problems.append(f"the next extend wrote at {a}; an untouched buffer writes at {b}")
    if problems:
        if not problems[0].startswith("extend with"):  # every bad extend raised, naming its key
            head = (
                f"extend with {cases[0][1]}"
                if len(cases) == 1
                else f"{len(cases)} extends, each with one stored key missing, all raised"
            )
            raise _fail(f"{head}: " + "; ".join(problems))
        raise _fail("; ".join(problems))


def _naming(key: tuple[str, ...], stored: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The parts of ``key`` an error must contain to name it among ``stored``: its shortest
    suffix no other stored key ends with (``('log_probs', 'full')``: both parts, since
    ``('tokens', 'full')`` ends with ``'full'`` too)."""
    for m in range(1, len(key) + 1):
        if sum(1 for k in stored if k[-m:] == key[-m:]) == 1:
            return key[-m:]
    return key


_ITEM = leaves(llm_batch(1, T))
"""One stored item's leaves: the schema every bad extend starts from."""
_STORED = list(_ITEM)


@requirement("BUF-009")
def missing_key_rejected(ctx: Context) -> None:
    # Every stored key in turn, optional fields included: a buffer checking only the fields it
    # needs writes the new items with the evicted items' values for the missing one.
    first = LLM_LAYOUT_V1.key("attention_mask")
    stored = _STORED
    cases: list[_BadCase] = [
        (
            lambda td, key=key: td.exclude(key),  # type: ignore[misc]
            f"key {key_str(key)} missing",
            _naming(key, stored),
        )
        for key in [first, *(k for k in stored if k != first)]
    ]
    _rejects(ctx, cases)


@requirement("BUF-010")
def extra_key_rejected(ctx: Context) -> None:
    _rejects(
        ctx,
        [
            (
                lambda td: td.set(("extra", "surprise_key"), torch.zeros(td.batch_size[0])),
                "an extra key ('extra', 'surprise_key')",
                ("surprise_key",),
            )
        ],
    )


_REAL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fmt: skip
_Bad = tuple[tuple[str, ...], Any, int, int]
"""A generated bad extend: (key, what is wrong with it, items in the batch, items written before)."""


def _bad_extends(what: Any) -> Any:
    """(key, ``what``, batch size 1..CAP+2, fill 0..2*CAP) for every stored key."""
    from hypothesis import strategies as st

    return st.tuples(
        st.sampled_from(_STORED), what, st.integers(1, CAP + 2), st.integers(1, 2 * CAP)
    )


def _retyped(
    key: tuple[str, ...], dtype: torch.dtype
) -> Callable[[TensorDictBase], TensorDictBase]:
    def bad(td: TensorDictBase) -> TensorDictBase:
        return td.set(key, td.get(key).to(dtype), inplace=False)

    return bad


@requirement("BUF-011")
def wrong_dtype_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    def one(case: _Bad) -> None:
        key, dtype, n, fill = case
        stored = _ITEM[key].dtype
        if dtype == stored:  # the stored dtype: the next one of the list is wrong
            dtype = _REAL_DTYPES[(_REAL_DTYPES.index(dtype) + 1) % len(_REAL_DTYPES)]
        what = f"key {key_str(key)} as {str(dtype)[6:]} instead of {str(stored)[6:]}"
        _rejects(ctx, [(_retyped(key, dtype), what, _naming(key, _STORED))], fill=fill, n=n)

    lp = LLM_LAYOUT_V1.key("sample_log_probs")
    tokens = LLM_LAYOUT_V1.key("tokens")
    for_all(
        ctx,
        _bad_extends(st.sampled_from(_REAL_DTYPES)),
        one,
        examples=6,
        boundaries=[
            (lp, torch.float64, 3, 6),
            (tokens, torch.int32, 1, CAP),
            (lp, torch.bfloat16, 2, 2 * CAP),
        ],
    )


_RESHAPES = ("longer", "shorter", "same count", "extra dim")
"""How BUF-012 changes one key's trailing shape: its last dim one longer or one shorter (a key
of shape [N] becomes [N, 2] or [N, 1]), its elements regrouped ([N, T] as [N, T/2, 2] or
[N, 1, T]: the element count kept) or a trailing dim of 1 added."""


def _reshaped(
    key: tuple[str, ...], how: str
) -> tuple[Callable[[TensorDictBase], TensorDictBase], str]:
    def new(v: torch.Tensor) -> torch.Tensor:
        rest = v.shape[1:]
        if how == "longer":
            return torch.cat([v, v[..., :1]], dim=-1) if rest else v[:, None].expand(-1, 2).clone()
        if how == "shorter":
            return v[..., :-1].clone() if rest and rest[-1] > 1 else v[:, None].clone()
        if how == "same count":
            if rest and rest[-1] % 2 == 0:
                return v.reshape(v.shape[0], *rest[:-1], rest[-1] // 2, 2).clone()
            return v.reshape(v.shape[0], 1, *rest).clone()
        return v[..., None].clone()

    def bad(td: TensorDictBase) -> TensorDictBase:
        return td.set(key, new(td.get(key)), inplace=False)

    shape = list(_ITEM[key].shape[1:])
    found = list(new(_ITEM[key]).shape[1:])
    return bad, f"key {key_str(key)} of item shape {found} instead of {shape}"


@requirement("BUF-012")
def wrong_shape_rejected(ctx: Context) -> None:
    from hypothesis import strategies as st

    # A ragged buffer takes each item's T from the item: a T one longer or shorter on one key
    # is tried on the tokens only (which key such an error names is the design's choice).
    hows = [
        h for h in _RESHAPES if "ragged" not in ctx.capabilities or h not in ("longer", "shorter")
    ]
    tokens = LLM_LAYOUT_V1.key("tokens")

    def one(case: _Bad) -> None:
        key, how, n, fill = case
        bad, what = _reshaped(key, how)
        _rejects(ctx, [(bad, what, _naming(key, _STORED))], fill=fill, n=n)

    for_all(
        ctx,
        _bad_extends(st.sampled_from(hows)),
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
            f"sample(2) on an empty buffer raised {_short_err(e)}: the message does not say "
            "the buffer is empty (expected words such as 'empty', 'no items' or 'len 0')"
        ) from None
    raise _fail(f"sample(2) on an empty buffer returned {type(s).__name__} instead of raising")


def _restored(ctx: Context, src: _Run, fifo: list[int], load: Any, what: str) -> _Run:
    """A fresh buffer ``load`` fills, checked to hold exactly ``fifo`` (src's items)."""
    fresh = _Run(ctx)
    load(fresh.rb)
    fresh.table, fresh.fifo, fresh.next_uid = src.table, list(fifo), src.next_uid
    if len(fresh.rb) != len(fifo):
        raise _fail(f"{what}: restored len is {len(fresh.rb)}, expected {len(fifo)}")
    fresh.expect_stored(f"{what}: restored buffer")
    return fresh


def _roundtrip(ctx: Context, save: Any, load: Any, what: str) -> None:
    """``save(src)`` into something ``load(snapshot, dst)`` restores in a fresh buffer: contents
    and the next write position must be the original's; then the original moves on (CAP more
    items, every slot overwritten) and the same snapshot, restored again, must still give the
    contents and write position of the moment it was taken."""
    r = _Run(ctx)
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

    _roundtrip(ctx, lambda rb: rb.state_dict(), via_state_dict, "state_dict/load_state_dict")
    _drive_model(ctx, "BUF-014")


@requirement("BUF-015")
def empty_extend(ctx: Context) -> None:
    _empty_first_extend(ctx)
    r, twin = _Run(ctx), _Run(ctx)
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
    r = _Run(ctx)
    try:
        r.rb.extend(llm_batch(0, T + 3))
    except Exception as e:
        raise _fail(f"an extend of 0 items into a fresh buffer raised {_short_err(e)}") from None
    try:
        r.write(4)
    except Exception as e:
        raise _fail(
            f"after an extend of 0 items of T {T + 3} into a fresh buffer, an extend of 4 items of "
            f"T {T} raised {_short_err(e)}: the empty batch fixed the schema (no item was written)"
        ) from None
    if len(r.rb) != 4:
        raise _fail(f"an extend of 0 items, then of 4: len is {len(r.rb)}, expected 4")
    r.expect_stored("an extend of 0 items into a fresh buffer, then of 4 items", complete=False)


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
        r = _Run(ctx, capacity=2 * CAP)  # no eviction: every item written stays stored
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
    r = _Run(ctx)
    first = _indices(r.write(5), 5, "extend of 5 items")
    second = _indices(r.write(6), 6, f"extend of 6 more into capacity {CAP}")
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

        _roundtrip(ctx, save, lambda path, dst: dst.loads(path), "dumps/loads")
    _drive_model(ctx, "BUF-018")


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
        src = _Run(ctx)
        src.write(5)
        src.write(6)  # wraps around
        saved = d / "saved"
        src.rb.dumps(saved)
        files = sorted(p.relative_to(saved) for p in saved.rglob("*") if p.is_file())
        if not files:
            raise _fail(f"dumps({saved}) wrote no file")
        target = _Run(ctx)
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


def _concurrent_writes(ctx: Context, capacity: int, per_writer: int) -> None:
    writers, n = 4, 2
    total = writers * per_writer * n
    what = f"4 writers x {per_writer} extends of {n} into capacity {capacity}"
    r = _Run(ctx, capacity=capacity)
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
            errors.append(f"writer raised {_short_err(e)}")

    def read() -> None:
        try:
            while not done.is_set():
                k = min(4, len(r.rb))  # len only grows here; never ask beyond it
                if k:
                    r.table.check_sample(r.rb.sample(k), set(r.table.items))
        except Exception as e:
            errors.append(f"reader raised {_short_err(e)}")

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


@requirement("BUF-019")
def thread_safety(ctx: Context) -> None:
    _concurrent_writes(ctx, capacity=80, per_writer=10)  # no eviction: every item kept
    _concurrent_writes(ctx, capacity=32, per_writer=10)  # 48 of the 80 writes evict


@requirement("BUF-025")
def consistent_snapshots(ctx: Context) -> None:
    """Snapshots taken while 4 threads extend: each restores whole written items only."""
    capacity, writers, per_writer, n = 16, 4, 40, 2
    r = _Run(ctx, capacity=capacity)
    r.write(capacity)  # full from the start: every write below overwrites a stored row
    batches = [[r.batch(n) for _ in range(per_writer)] for _ in range(writers)]
    for bs in batches:
        for b in bs:
            r.table.add(b)
    errors: list[str] = []
    start = threading.Barrier(writers + 1)

    def write(bs: list[TensorDictBase]) -> None:
        try:
            start.wait(timeout=30)
            for b in bs:
                r.rb.extend(b)
        except Exception as e:
            errors.append(f"writer raised {_short_err(e)}")

    threads = [threading.Thread(target=write, args=(bs,)) for bs in batches]
    for t in threads:
        t.start()
    start.wait(timeout=30)
    snapshots: list[tuple[str, Any]] = []
    with ctx.tmpdir() as d:
        k = 0
        while any(t.is_alive() for t in threads) or k < 3:
            snapshots.append(("state_dict()", r.rb.state_dict()))
            if "checkpoint" in ctx.capabilities:
                path = d / f"snap-{k}"
                r.rb.dumps(path)
                snapshots.append((f"dumps() #{k}", path))
            if "read" in ctx.capabilities:
                snapshots.append(("read()", r.rb.read(torch.arange(capacity))))
            k += 1
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
                fresh = _Run(ctx, capacity=capacity)
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
    _drive_model(ctx, "BUF-022")
    fresh = _Run(ctx)
    written = set(_indices(fresh.write(3), 3, "extend of 3 items"))
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
