"""The buffer suite's state machine: random call sequences compared, after every call, with a
FIFO model of the uids the buffer must hold (BUF-001, 002, 003, 006, 007, 014, 018, 022)."""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from posttrain.conformance.context import ConformanceError, Context
from posttrain.conformance.explore import run_machine
from posttrain.conformance.suites._buffer_run import Run, indices, keys_for, scribble
from posttrain.conformance.suites._compare import leaves
from posttrain.conformance.suites._fail import fail as _fail
from posttrain.contracts.buffer import BUFFER
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.testing import PROMPT_LEN, item_uids

_F32_EDGES = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4028235e38,
              -3.4028235e38, 1.1754944e-38, 1.0, -1.0)  # fmt: skip
_I64_EDGES = (0, -1, 1, 2**63 - 1, -(2**63), 2**31, -(2**31) - 1, 2**53 + 1)
VALUE_REGIMES = ("ordinary", "random bits", "edges")
"""How an item's values are drawn: as ``llm_batch`` writes them; every bit pattern of each
column's dtype (NaN payloads, infinities, subnormals, -0.0, the integer extremes); the boundary
values of each dtype alone."""
_UID_KEY = LLM_LAYOUT_V1.key("tokens")


def wild_values(td: TensorDictBase, regime: str, seed: int) -> TensorDictBase:
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


def column_major(td: TensorDictBase) -> TensorDictBase:
    """The same values with every 2-D leaf non-contiguous (column-major strides)."""
    return td.apply(lambda v: v.t().contiguous().t() if v.ndim == 2 else v)


def keys_reordered(td: TensorDictBase, seed: int) -> TensorDictBase:
    """The same items with their keys, nested ones too, inserted in a shuffled order."""
    order = list(leaves(td).items())
    perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(seed)).tolist()
    out = TensorDict({}, batch_size=td.batch_size)
    for i in perm:
        out.set(order[i][0], order[i][1])
    return out


Broken = Callable[[str, str], ConformanceError]
"""``broken(req, what)``: the failure of requirement ``req`` a call sequence ran into."""


def model_machine(ctx: Context, focus: str, root: Path | None) -> type[Any]:
    """A state machine comparing the buffer with a FIFO model of uids after every call.

    ``focus`` is the requirement it checks: BUF-001 the indices extend returns, BUF-002 len,
    BUF-003 the contents (sampled at the end), BUF-006 every sample, BUF-007 samples of up to
    16 items whatever len is (with replacement); it also chooses which operations join extend,
    sample and len (:func:`_focus_rules`). Each sequence's items hold one of the key sets
    ``focus``'s domain allows beside the layout's keys (``keys_for``).
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

    replacement = ctx.options["sampling"] == "with_replacement"
    broken = _breaker(focus)

    class BufferModel(RuleBasedStateMachine):
        run: Run
        t: int
        where: dict[int, int]  # uid -> the index extend returned, for every stored item
        last: TensorDictBase | None

        @initialize(
            capacity=st.sampled_from([1, 2, 3, 5, 8]),
            t=st.integers(PROMPT_LEN + 1, 12),
            keys=st.sampled_from(keys_for(focus)),
        )
        def fresh(self, capacity: int, t: int, keys: tuple[tuple[str, ...], ...]) -> None:
            self.run = Run(ctx, capacity=capacity, keys=keys)
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
            _extend(self, broken, n, regime, strided, data_seed, shuffled)

        def check_len(self, after: str) -> None:
            if len(self.run.rb) != len(self.run.fifo):
                raise broken(
                    "BUF-002",
                    f"after {after}: len is {len(self.run.rb)}, expected {len(self.run.fifo)}",
                )

        @precondition(lambda self: len(self.run.fifo) > 0)
        @rule(k=st.integers(1, 16))
        def sample(self, k: int) -> None:
            # Beyond len (with replacement) is BUF-007's own domain
            k = k if focus == "BUF-007" and replacement else min(k, len(self.run.fifo))
            _sample(self, broken, focus, k)

        def carry_on(self, load: Callable[[Any], None]) -> None:
            """Go on with a fresh buffer ``load`` restored; the model goes on unchanged."""
            _carry_on(self, ctx, focus, broken, load)

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

    for name, fn in _focus_rules(focus, root, broken).items():
        setattr(BufferModel, name, fn)
    BufferModel.__name__ = BufferModel.__qualname__ = f"BufferModel{focus[4:]}"
    return BufferModel


def _breaker(focus: str) -> Broken:
    """The failure of a requirement; a sequence that breaks another requirement than ``focus``
    is dropped (that requirement's own check reports it), so a verdict names the requirement
    broken."""
    from hypothesis import reject

    def broken(req: str, what: str) -> ConformanceError:
        if req != focus:
            reject()
        return _fail(f"{BUFFER.requirement(req).title}: {what}")

    return broken


def _focus_rules(focus: str, root: Path | None, broken: Broken) -> dict[str, Any]:
    """The rule ``focus`` adds to extend, sample and len, by name: ``BUF-006`` overwrites the
    batch last extended, as a caller reusing its tensors does; ``BUF-014`` restores
    ``state_dict()`` (through ``torch.save``) into a fresh buffer that carries on; ``BUF-018``
    the same through ``dumps``/``loads`` under ``root``; ``BUF-022`` reads stored indices in
    random orders, repeats included."""
    from hypothesis import strategies as st
    from hypothesis.stateful import precondition, rule

    saves = itertools.count()

    @precondition(lambda self: self.last is not None)
    @rule()
    def caller_reuses_its_batch(self: Any) -> None:
        assert self.last is not None
        scribble(self.last)

    @rule()
    def restore_state_dict(self: Any) -> None:
        buf = io.BytesIO()
        torch.save(self.run.rb.state_dict(), buf)
        buf.seek(0)
        self.carry_on(lambda rb: rb.load_state_dict(torch.load(buf, weights_only=True)))

    @rule()
    def dumps_loads(self: Any) -> None:
        assert root is not None
        path = root / f"save-{next(saves)}"
        self.run.rb.dumps(path)
        self.carry_on(lambda rb: rb.loads(path))

    @precondition(lambda self: len(self.run.fifo) > 0)
    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=10))
    def read(self: Any, picks: list[int]) -> None:
        _read(self, broken, picks)

    by_focus = {
        "BUF-006": caller_reuses_its_batch,
        "BUF-014": restore_state_dict,
        "BUF-018": dumps_loads,
        "BUF-022": read,
    }
    return {by_focus[focus].__name__: by_focus[focus]} if focus in by_focus else {}


def _extend(
    m: Any, broken: Broken, n: int, regime: str, strided: bool, data_seed: int, shuffled: bool
) -> None:
    """The machine ``m``'s extend: the indices it returns address the items written (never
    one of the items still stored), and len follows the model."""
    r = m.run
    td = wild_values(r.batch(n, m.t), regime, data_seed)
    td = column_major(td) if strided else td
    td = keys_reordered(td, data_seed) if shuffled else td
    before = list(r.fifo)
    what = (
        f"extend of {n} items ({regime} values{', column-major' * strided}"
        f"{', keys in another order' * shuffled}) into "
        f"capacity {r.capacity} holding {len(before)}"
    )
    got = indices(r.put(td), n, what)
    m.last = td
    kept = set(r.fifo)
    live = [(u, i) for u, i in zip(item_uids(td), got, strict=True) if u in kept]
    mine = [i for _, i in live]
    survivors = {m.where[u] for u in before if u in kept}
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
    m.where = {u: m.where[u] for u in before if u in kept} | dict(live)
    m.check_len(what)


def _sample(m: Any, broken: Broken, focus: str, k: int) -> None:
    """The machine ``m``'s sample of ``k``: that many items, each one stored, bit-exact."""
    r = m.run
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


def _read(m: Any, broken: Broken, picks: list[int]) -> None:
    """The machine ``m``'s read of stored indices ``picks`` chooses: the items written there."""
    at = {i: u for u, i in m.where.items()}
    order = sorted(at)
    ask = [order[p % len(order)] for p in picks]
    got = m.run.rb.read(torch.tensor(ask, dtype=torch.int64))
    try:
        uids = m.run.table.check_sample(got, set(m.run.fifo))
    except ConformanceError as e:
        raise broken("BUF-022", f"read({ask}): {e}") from None
    if uids != [at[i] for i in ask]:
        raise broken(
            "BUF-022",
            f"read({ask}) returned uids {uids}, expected {[at[i] for i in ask]}",
        )


def _carry_on(
    m: Any, ctx: Context, focus: str, broken: Broken, load: Callable[[Any], None]
) -> None:
    """The machine ``m`` goes on with a fresh buffer ``load`` restored, holding the model's
    items; the model goes on unchanged."""
    r = m.run
    fresh = Run(ctx, capacity=r.capacity, keys=r.keys)
    load(fresh.rb)
    fresh.table, fresh.fifo, fresh.next_uid = r.table, list(r.fifo), r.next_uid
    m.run = fresh
    if len(fresh.rb) != len(fresh.fifo):
        raise broken(focus, f"restored len is {len(fresh.rb)}, expected {len(fresh.fifo)}")
    if fresh.fifo and not fresh.holds_fifo():
        try:
            fresh.expect_stored("the restored buffer")
        except ConformanceError as e:
            raise broken(focus, str(e)) from None


def drive_model(ctx: Context, focus: str, examples: int = 6, steps: int = 10) -> None:
    """Random call sequences against the FIFO model, each failure named by its requirement."""
    with ctx.tmpdir() as root:
        run_machine(ctx, model_machine(ctx, focus, root), examples=examples, steps=steps)
