"""Every bundled buffer's write path, fuzzed against a plain-Python FIFO model.

Bad batches (a key missing, an extra or nested key, a wrong dtype or item shape, a leaf on
``meta``, sparse or in another non-strided layout, a leaf that requires grad, a leaf that
is not a tensor) are interleaved with good ones (some of them non-contiguous views, which
are fine: the write copies them). After every call the buffer's whole contents, read back
by index, must equal the model's: a refused batch changes nothing (0 partial writes), and
every refusal is a ``ValueError`` or ``TypeError`` that names the key. A first write that
is refused must not fix the schema.

Deterministic (``derandomize=True``). The normal test run takes ``FUZZ_BAD`` = 150 bad
batches per buffer (50 for the Ray-served one); ``make fuzz`` sets
``POSTTRAIN_FUZZ_BAD=1000``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from posttrain.reference_impls import RingBuffer

FUZZ_BAD = int(os.environ.get("POSTTRAIN_FUZZ_BAD", "150"))
RAY_BAD = min(FUZZ_BAD, 50)
CAP = 5
T = 4
STEPS = 12  # calls per example, about half of them bad
KEYS: tuple[tuple[str, ...], ...] = (("id",), ("tokens",), ("m", "mask"), ("m", "lp"))
BAD_KINDS = (
    "missing",
    "extra",
    "extra_nested",
    "leaf_to_td",
    "td_to_leaf",
    "dtype",
    "shape",
    "meta",
    "sparse",
    "sparse_csr",
    "mkldnn",
    "grad_leaf",
    "grad_graph",
    "not_a_tensor",
)
# Faults a first write (no schema yet) must refuse as well.
FIRST_WRITE_KINDS = ("meta", "sparse", "sparse_csr", "mkldnn", "grad_leaf", "grad_graph")


def _fields(ids: torch.Tensor) -> dict[tuple[str, ...], torch.Tensor]:
    """Every field of the items ``ids``, derived from the id alone (a torn item shows)."""
    n = ids.shape[0]
    tok = ids[:, None] * 10 + torch.arange(T)
    return {
        ("id",): ids.clone(),
        ("tokens",): tok,
        ("m", "mask"): tok % 3 == 0,
        ("m", "lp"): -(ids[:, None].float() + torch.arange(T).float() / 8).reshape(n, T),
    }


def _td(leaves: dict[tuple[str, ...], Any], n: int) -> TensorDict:
    nested: dict[str, Any] = {}
    for k, v in leaves.items():
        d = nested
        for part in k[:-1]:
            d = d.setdefault(part, {})
        d[k[-1]] = v
    return TensorDict(nested, batch_size=[n])


def _good(ids: list[int], view: bool) -> TensorDict:
    f = _fields(torch.tensor(ids, dtype=torch.int64))
    if view:  # the same values through non-contiguous views (strided is all a write needs)
        f = {k: _noncontiguous(v) for k, v in f.items()}
    return _td(f, len(ids))


def _noncontiguous(v: torch.Tensor) -> torch.Tensor:
    wide = torch.empty((v.shape[0] * 2, *v.shape[1:]), dtype=v.dtype)
    wide[::2] = v
    out = wide[::2]
    assert v.numel() <= 1 or not out.is_contiguous() or v.shape[0] <= 1
    return out


def _bad(kind: str, key: tuple[str, ...], ids: list[int]) -> tuple[TensorDict, str]:
    """A batch broken in one way at ``key``; and the key part the error must name."""
    n = len(ids)
    f: dict[tuple[str, ...], Any] = dict(_fields(torch.tensor(ids, dtype=torch.int64)))
    v = f[key]
    name = key[-1]
    if kind == "missing":
        del f[key]
    elif kind == "extra":
        f[("extra",)] = torch.zeros(n, 2)
        name = "extra"
    elif kind == "extra_nested":
        f[("m", "extra")] = torch.zeros(n, dtype=torch.int64)
        name = "extra"
    elif kind == "leaf_to_td":  # the key becomes a sub-TensorDict: missing + extra
        del f[key]
        f[(*key, "inner")] = v
    elif kind == "td_to_leaf":  # the sub-TensorDict 'm' becomes one leaf
        f = {k: x for k, x in f.items() if k[0] != "m"}
        f[("m",)] = torch.zeros(n, T)
        name = "m"
    elif kind == "dtype":
        f[key] = v.to(torch.float64 if v.dtype != torch.float64 else torch.int32)
    elif kind == "shape":
        f[key] = torch.cat([v.reshape(n, -1)] * 2, dim=1) if v.ndim > 1 else v[:, None]
    elif kind == "meta":
        f[key] = torch.empty_like(v, device="meta")
    elif kind == "sparse":
        f[key] = v.to_sparse()
    elif kind == "sparse_csr":
        f[key] = (v if v.ndim == 2 else v.reshape(n, -1)).to_sparse_csr()
    elif kind == "mkldnn":  # a non-strided dense layout (float32 only)
        key = ("m", "lp")
        name = "lp"
        f[key] = f[key].to_mkldnn()
    elif kind in ("grad_leaf", "grad_graph"):
        key = ("m", "lp")  # only floating leaves can require grad
        name = "lp"
        w = f[key].clone().requires_grad_(True)
        f[key] = w if kind == "grad_leaf" else w * 1.0
    elif kind == "not_a_tensor":
        td = _td({k: x for k, x in f.items() if k != key}, n)
        td.set_non_tensor(key, "text")
        return td, name
    return _td(f, n), name


@dataclass
class Fifo:
    """The model: what each storage index holds, the write position, the length."""

    cap: int
    slots: list[int | None] = field(default_factory=list)
    cursor: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        self.slots = [None] * self.cap

    def write(self, ids: list[int]) -> list[int]:
        out = []
        for i in ids:
            self.slots[self.cursor] = i
            out.append(self.cursor)
            self.cursor = (self.cursor + 1) % self.cap
            self.length = min(self.cap, self.length + 1)
        return out


@dataclass
class Tally:
    bad: int = 0
    good: int = 0
    first_refused: int = 0
    partial: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


def _contents(rb: Any, model: Fifo) -> str | None:
    """None when ``rb`` holds exactly the model's items, index by index, bit-exact."""
    if len(rb) != model.length:
        return f"len {len(rb)}, the model holds {model.length}"
    if not model.length:
        return None
    got = rb.read(torch.arange(model.length))
    want = _fields(torch.tensor(model.slots[: model.length], dtype=torch.int64))
    for k, w in want.items():
        g = got.get(k)
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            return f"key {k}: stored {g.tolist()}, the model holds {w.tolist()}"
    return None


def _names(err: BaseException, name: str) -> bool:
    return f"'{name}'" in str(err)


class Fuzzer:
    """Drives one buffer: each Hypothesis example is one sequence of calls."""

    def __init__(self, make: Callable[[], Any], *, fresh: bool) -> None:
        self.make = make
        self.fresh = fresh  # a new buffer per example (local), or one for all (served)
        self.rb: Any = None
        self.model = Fifo(CAP)
        self.next_id = 0
        self.tally = Tally()

    def ids(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out

    def first(self, kind: str | None) -> None:
        if self.rb is not None and not self.fresh:
            return
        self.rb, self.model = self.make(), Fifo(CAP)
        if kind is not None:
            batch, name = _bad(kind, ("m", "lp"), self.ids(3))
            self.refused(batch, name, kind)
            self.tally.first_refused += 1
            assert len(self.rb) == 0, f"a refused first write ({kind}) left len {len(self.rb)}"
        self.step(("good", 2, False))  # fixes the schema the bad batches then break

    def refused(self, batch: TensorDict, name: str, kind: str) -> None:
        with pytest.raises((ValueError, TypeError)) as refusal:
            self.rb.extend(batch)
        e = refusal.value
        assert _names(e, name), f"{kind}: the error does not name '{name}': {e}"
        self.tally.bad += 1
        self.tally.kinds[kind] = self.tally.kinds.get(kind, 0) + 1
        diff = _contents(self.rb, self.model)
        if diff is not None:
            self.tally.partial += 1
            raise AssertionError(f"a refused batch ({kind} at '{name}') changed the buffer: {diff}")

    def step(self, op: tuple[Any, ...]) -> None:
        if op[0] == "good":
            _, n, view = op
            ids = self.ids(n)
            idx = self.rb.extend(_good(ids, view))
            want = self.model.write(ids)
            assert [int(i) for i in idx] == want, (idx, want)
            self.tally.good += 1
        else:
            _, kind, key, n = op
            self.refused(*_bad(kind, key, self.ids(n)), kind)
        diff = _contents(self.rb, self.model)
        assert diff is None, diff


_GOOD = st.tuples(st.just("good"), st.integers(0, 4), st.booleans())
_BAD = st.tuples(
    st.just("bad"), st.sampled_from(BAD_KINDS), st.sampled_from(KEYS), st.integers(1, 4)
)
_OPS = st.lists(st.one_of(_GOOD, _BAD, _BAD), min_size=STEPS, max_size=STEPS)
_FIRST = st.one_of(st.none(), st.sampled_from(FIRST_WRITE_KINDS))


def _fuzz(fz: Fuzzer, bad_wanted: int) -> Tally:
    # About half of the calls are bad (plus first writes): enough examples, checked below.
    examples = math.ceil(bad_wanted / (STEPS * 0.45))

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(first=_FIRST, ops=_OPS)
    def run(first: str | None, ops: list[tuple[Any, ...]]) -> None:
        fz.first(first)
        for op in ops:
            fz.step(op)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR is "beta"; TorchRL's info logs
        run()
    t = fz.tally
    assert t.partial == 0
    assert t.bad >= bad_wanted, f"only {t.bad} bad batches were tried, wanted {bad_wanted}"
    assert set(t.kinds) == set(BAD_KINDS), sorted(set(BAD_KINDS) - set(t.kinds))
    print(
        f"\n{t.bad} bad batches refused (first writes {t.first_refused}), {t.good} good "
        f"stored, 0 partial writes; by kind {dict(sorted(t.kinds.items()))}"
    )
    return t


def _torchrl(storage: str) -> Callable[[], Any]:
    pytest.importorskip("torchrl")
    from torchrl.data import LazyStackStorage, LazyTensorStorage, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer

    kind = {"tensor": LazyTensorStorage, "stack": LazyStackStorage}[storage]
    return lambda: ValidatedReplayBuffer(TensorDictReplayBuffer(storage=kind(CAP)))


def _maker(name: str) -> Callable[[], Any]:
    if name == "RingBuffer":
        return lambda: RingBuffer(CAP, seed=0)
    return _torchrl("tensor" if "LazyTensorStorage" in name else "stack")


@pytest.mark.parametrize(
    "name",
    [
        "RingBuffer",
        "ValidatedReplayBuffer(LazyTensorStorage)",
        "ValidatedReplayBuffer(LazyStackStorage)",
    ],
)
def test_fuzzed_writes_are_all_or_nothing(name: str) -> None:
    make = _maker(name)
    _fuzz(Fuzzer(make, fresh=True), FUZZ_BAD)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    pytest.importorskip("ray")
    from posttrain.adapters._ray import ensure_cluster

    ray = ensure_cluster()
    yield ray
    ray.shutdown()


def test_fuzzed_writes_to_a_served_buffer_are_all_or_nothing(ray_cluster: Any) -> None:
    from posttrain.adapters.ray import serve_buffer

    served = serve_buffer(RingBuffer, CAP)
    try:
        fz = Fuzzer(lambda: served, fresh=False)
        fz.first("meta")  # one refused first write, then the schema is fixed for good
        _fuzz(fz, RAY_BAD)
    finally:
        served.close()


# -- defence in depth: a write that fails anyway, part-way, changes nothing -----------------


class _Boom(torch.Tensor):
    """A leaf that passes every check and raises as the buffer copies it: a failure injected
    in the middle of a write, after the keys before it were copied."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("__setitem__", "copy_", "index_put_", "index_copy_"):
            raise RuntimeError("injected failure in the middle of a write")
        out = super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]
        return out


def _booby(ids: list[int]) -> TensorDict:
    f = _fields(torch.tensor(ids, dtype=torch.int64))
    f[("m", "lp")] = f[("m", "lp")].as_subclass(_Boom)  # copied after 'id' and 'tokens'
    return _td(f, len(ids))


@pytest.mark.parametrize(
    "name",
    ["RingBuffer", "ValidatedReplayBuffer(LazyTensorStorage)"],
)
def test_a_write_failing_part_way_restores_rows_cursor_length_and_schema(name: str) -> None:
    make = _maker(name)
    rb, model, next_id = make(), Fifo(CAP), 0
    with pytest.raises(RuntimeError, match="injected"):
        rb.extend(_booby([100, 101, 102]))
    assert len(rb) == 0
    # The failed first write fixed no schema: another one is taken.
    other = TensorDict({"z": torch.zeros(2)}, batch_size=[2])
    assert make().extend(other).tolist() == [0, 1]
    # While the ring fills (3 items), once full (3 more wrap it), and overwriting again.
    for n in (3, 3, 4, 2):
        ids = list(range(next_id, next_id + n))
        next_id += n
        rb.extend(_good(ids, False))
        model.write(ids)
        for bad_n in (2, CAP, CAP + 2):
            with pytest.raises(RuntimeError, match="injected"):
                rb.extend(_booby(list(range(1000, 1000 + bad_n))))
            assert _contents(rb, model) is None
        # ... and the next write goes where it would have gone.
        probe = [next_id]
        next_id += 1
        assert [int(i) for i in rb.extend(_good(probe, False))] == model.write(probe)
        assert _contents(rb, model) is None


def test_adapter_list_storage_failing_part_way_puts_back_its_items() -> None:
    rb = _torchrl("stack")()
    model = Fifo(CAP)
    rb.extend(_good([0, 1, 2, 3], False))
    model.write([0, 1, 2, 3])
    st = rb.rb._storage
    real, calls = st._set_item, [0]

    def third_fails(cursor: int, item: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected failure in the middle of a write")
        real(cursor, item)

    st._set_item = third_fails
    with pytest.raises(RuntimeError, match="injected"):
        rb.extend(_good([10, 11, 12, 13], False))  # the 2nd item wraps: 1 appended, 1 replaced
    del st._set_item
    assert _contents(rb, model) is None
    assert [int(i) for i in rb.extend(_good([20, 21], False))] == model.write([20, 21])
    assert _contents(rb, model) is None


def test_adapter_with_a_rank_writer_does_not_unwind_a_failed_write() -> None:
    # TensorDictMaxValueWriter places items by rank and keeps a heap of its own: a cursor
    # cannot put that back, so the adapter leaves a failed write as TorchRL left it, exactly as
    # a raw twin shows, rather than moving a cursor that did not move.
    pytest.importorskip("torchrl")
    from torchrl.data import LazyTensorStorage, TensorDictMaxValueWriter, TensorDictReplayBuffer

    from posttrain.adapters.torchrl import ValidatedReplayBuffer

    def make() -> Any:
        return TensorDictReplayBuffer(
            storage=LazyTensorStorage(CAP), writer=TensorDictMaxValueWriter(rank_key="id")
        )

    raw, adapted = make(), ValidatedReplayBuffer(make())
    for ids in ([3, 1, 4], [1, 5, 9]):
        raw.extend(_good(ids, False))
        adapted.extend(_good(ids, False))

    def state(rb: Any) -> tuple[Any, ...]:
        w = rb._writer
        return (w._cursor, w._write_count, sorted(w._current_top_values), len(rb))

    for target, rb in ((raw, raw), (adapted, adapted.rb)):
        st = rb._storage
        real = st.set

        def fails_after_moving(cursor: Any, data: Any, st: Any = st, **kw: Any) -> None:
            st._set_last_cursor(cursor)
            raise RuntimeError("injected failure in the middle of a write")

        st.set = fails_after_moving
        with pytest.raises(RuntimeError, match="injected"):
            target.extend(_good([7, 8], False))
        st.set = real
    assert state(adapted.rb) == state(raw)


def test_adapter_plain_batch_failing_in_torchrl_puts_back_cursor_count_and_length() -> None:
    # The plain path takes no copy of the rows (see ValidatedReplayBuffer.extend): what a
    # failure there puts back is the write position and the length.
    rb = _torchrl("tensor")()
    model = Fifo(CAP)
    for ids in ([0, 1, 2], [3, 4, 5]):
        rb.extend(_good(ids, False))
        model.write(ids)
    st = rb.rb._storage
    real = st.set

    def fails_after_moving(cursor: Any, data: Any, **kw: Any) -> None:
        st._set_last_cursor(cursor)
        st._get_new_len(data, cursor)
        raise RuntimeError("injected failure in the middle of a write")

    st.set = fails_after_moving
    with pytest.raises(RuntimeError, match="injected"):
        rb.extend(_good([10, 11], False))
    st.set = real
    assert len(rb) == model.length
    assert rb.rb._writer._write_count == 6
    assert [int(i) for i in rb.extend(_good([20, 21], False))] == model.write([20, 21])
    assert _contents(rb, model) is None
