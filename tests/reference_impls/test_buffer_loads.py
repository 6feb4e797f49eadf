"""Every bundled buffer refuses a bad state or checkpoint whole, and runs no code on load.

For each buffer, a deterministic list of corrupted, truncated, deleted-file and mismatched
states and checkpoint directories (at least 50 per buffer) must each be refused with the
buffer's own state exactly as before; a pickle planted in each file of a checkpoint
directory must run nothing; and a checkpoint taken after wrap-around, in both sampling
modes, must round-trip bit-exactly.
"""

from __future__ import annotations

import copy
import pathlib
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from posttrain._checkpoint import MANIFEST, reseal
from posttrain.adapters.nemo_rl.replay_buffer import NemoReplayBuffer
from posttrain.adapters.nemo_rl.train_data import from_layout
from posttrain.adapters.ray.buffer import BufferHost
from posttrain.reference_impls import RingBuffer
from posttrain.testing import item_uids, llm_batch, ragged_llm_batch

CAP = 8
MIN_REFUSED = 50


# -- the buffers -------------------------------------------------------------------------------
def _torchrl(kind: str, sampling: str, cap: int = CAP) -> Callable[[], Any]:
    def make() -> Any:
        from torchrl.data import (
            LazyMemmapStorage,
            LazyStackStorage,
            LazyTensorStorage,
            RandomSampler,
            SamplerWithoutReplacement,
            TensorDictReplayBuffer,
        )

        from posttrain.adapters.torchrl import ValidatedReplayBuffer

        makers: dict[str, Callable[[], Any]] = {
            "tensor": lambda: LazyTensorStorage(cap),
            "memmap": lambda: LazyMemmapStorage(cap, scratch_dir=tempfile.mkdtemp()),
            "stack": lambda: LazyStackStorage(cap),
        }
        storage = makers[kind]()
        smp = RandomSampler() if sampling == "with_replacement" else SamplerWithoutReplacement()
        rb = TensorDictReplayBuffer(storage=storage, sampler=smp)
        return ValidatedReplayBuffer(rb, ragged=kind == "stack")

    return make


def _ring(sampling: str, cap: int = CAP) -> Callable[[], Any]:
    return lambda: RingBuffer(cap, sampling=sampling, seed=0)


BUFFERS: dict[str, Callable[..., Callable[[], Any]]] = {
    "RingBuffer": _ring,
    "Validated(LazyTensorStorage)": lambda s, cap=CAP: _torchrl("tensor", s, cap),
    "Validated(LazyMemmapStorage)": lambda s, cap=CAP: _torchrl("memmap", s, cap),
    "Validated(LazyStackStorage)": lambda s, cap=CAP: _torchrl("stack", s, cap),
}


def _batch(name: str, n: int, uid: int) -> TensorDict:
    if "Stack" in name:
        return ragged_llm_batch([6 + (i % 3) for i in range(n)], uid_start=uid)
    return llm_batch(n, 6, uid_start=uid)


def _filled(name: str, sampling: str) -> Any:
    rb = BUFFERS[name](sampling)()
    rb.extend(_batch(name, 5, 100))
    rb.extend(_batch(name, 5, 200))  # wraps around: cursor 2, 10 written
    rb.sample(3)  # a without-replacement epoch under way
    return rb


def _same(a: Any, b: Any) -> bool:
    """Deep equality of two states (tensors bit-exactly, dtypes and shapes included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False

        def raw(t: torch.Tensor) -> torch.Tensor:  # bits, so that NaN equals NaN
            return (
                torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1).view(torch.uint8)
            )

        return bool(torch.equal(raw(a), raw(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "state_dict") and hasattr(b, "state_dict"):
        return _same(a.state_dict(), b.state_dict())
    return bool(a == b)


# -- bad states --------------------------------------------------------------------------------
Path_ = tuple[Any, ...]


def _paths(state: Any, depth: int = 3, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every key path of nested dicts (not into lists or tensors), to ``depth`` levels."""
    if not isinstance(state, dict) or depth == 0:
        return
    for k, v in state.items():
        yield (*prefix, k)
        yield from _paths(v, depth - 1, (*prefix, k))


def _get(state: Any, path: Path_) -> Any:
    for k in path:
        state = state[k]
    return state


def _with(state: Any, path: Path_, value: Any = ..., *, delete: bool = False) -> Any:
    out = copy.deepcopy(state)
    parent = _get(out, path[:-1])
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def _generic(state: dict[str, Any], skip: Callable[[Path_], bool]) -> list[tuple[str, Any]]:
    """Each key deleted, and each key's value replaced by a string, a negative and a huge
    int: none of which a saved state ever holds."""
    cases: list[tuple[str, Any]] = [("an extra top-level key", {**state, "surprise": 1})]
    for p in _paths(state):
        if skip(p):
            continue
        cases.append((f"{p} deleted", _with(state, p, delete=True)))
        cases.append((f"{p} a string", _with(state, p, "garbage")))
        if isinstance(_get(state, p), int) and not isinstance(_get(state, p), bool):
            cases.append((f"{p} = -1", _with(state, p, -1)))
            cases.append((f"{p} = 10**9", _with(state, p, 10**9)))
    return cases


def _ring_states(st: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: torch.Tensor = st["rows"]
    schema = st["schema"]
    cases = _generic(st, lambda p: False)
    cases += [
        ("rows on meta", {**st, "rows": rows.to("meta")}),
        ("rows as float32", {**st, "rows": rows.float()}),
        ("rows one short", {**st, "rows": rows[:-1]}),
        ("rows one byte short", {**st, "rows": rows[:, :-1]}),
        ("rows sparse", {**st, "rows": rows.to_sparse()}),
        ("rows None", {**st, "rows": None}),
        ("schema None", {**st, "schema": None}),
        (
            "schema dtype 'manual_seed'",
            {**st, "schema": [(schema[0][0], "manual_seed", schema[0][2]), *schema[1:]]},
        ),
        (
            "schema dtype 'Tensor'",
            {**st, "schema": [(schema[0][0], "Tensor", schema[0][2]), *schema[1:]]},
        ),
        ("schema one key more", {**st, "schema": [*schema, (("extra",), "float64", (3,))]}),
        ("schema one key less", {**st, "schema": schema[1:]}),
        ("schema repeats a key", {**st, "schema": [*schema, schema[0]]}),
        ("schema wider item", {**st, "schema": [(schema[0][0], schema[0][1], (99,)), *schema[1:]]}),
        ("epoch repeats an index", {**st, "epoch": [0, 0, 1]}),
        ("epoch out of range", {**st, "epoch": [CAP]}),
        ("epoch of floats", {**st, "epoch": [0.5]}),
        ("rng too short", {**st, "rng": st["rng"][:-1]}),
        ("cursor inconsistent with write_count", {**st, "cursor": (st["cursor"] + 1) % CAP}),
        ("len below capacity after wrap", {**st, "len": CAP - 1}),
        ("write_count below len", {**st, "write_count": 3}),
        ("capacity True", {**st, "capacity": True}),
        ("cursor True", {**st, "cursor": True}),
        ("sampling 'prioritized'", {**st, "sampling": "prioritized"}),
        ("a list, not a dict", [st]),
    ]
    return cases


def _torchrl_states(st: dict[str, Any], ragged: bool) -> list[tuple[str, Any]]:
    rb, schema = st["rb"], st["schema"]
    inner = rb["_storage"]["_storage"]
    cases = _generic(
        st,
        # TorchRL's own 'index' column is optional here; a column's value is a tensor whose
        # replacements are below; a None is a valid value for these.
        lambda p: p[-1] == "index" or p[-1] in ("_batch_size", "_consume_after_n_samples", "_rng"),
    )
    sampler = rb["_sampler"]
    if "_sample_list" in sampler:
        sl = sampler["_sample_list"]
        for what, v in (
            ("repeats an index", torch.cat([sl, sl[:1]])),
            ("out of range", torch.tensor([CAP + 3])),
            ("of floats", sl.float()),
            ("on meta", sl.to("meta")),
        ):
            cases.append((f"sample list {what}", _with(st, ("rb", "_sampler", "_sample_list"), v)))
        cases.append(
            ("len_storage above len", _with(st, ("rb", "_sampler", "len_storage"), CAP + 1))
        )
    w = ("rb", "_writer")
    cases += [
        ("cursor inconsistent", _with(st, (*w, "_cursor"), (rb["_writer"]["_cursor"] + 1) % CAP)),
        ("write count below len", _with(st, (*w, "_write_count"), 3)),
        (
            "schema dtype 'manual_seed'",
            {**st, "schema": [(schema[0][0], "manual_seed", schema[0][2]), *schema[1:]]},
        ),
        ("schema one key more", {**st, "schema": [*schema, (("extra",), "float32", ())]}),
        ("schema one key less", {**st, "schema": schema[1:]}),
        ("schema wider item", {**st, "schema": [(schema[0][0], schema[0][1], (99,)), *schema[1:]]}),
        (
            "schema as float64",
            {**st, "schema": [(schema[0][0], "float64", schema[0][2]), *schema[1:]]},
        ),
        ("schema None", {**st, "schema": None}),
        ("a prefetch queue", _with(st, ("rb", "_prefetch_state", "queue"), (1,))),
        ("transforms of another buffer", _with(st, ("rb", "_transforms"), {"0": {}})),
    ]
    if not ragged:
        cases.append(
            (
                "a ragged schema",
                {**st, "schema": [(k, d, tuple(-1 for _ in s)) for k, d, s in schema]},
            )
        )
        s = ("rb", "_storage")
        cases += [
            ("len -1", _with(st, (*s, "_len"), -1)),
            ("len above capacity", _with(st, (*s, "_len"), CAP + 1)),
            ("a list storage's items", _with(st, (*s, "_storage"), [])),
        ]
        for key, col in list(inner.items())[:3]:
            col_at = (*s, "_storage", key)
            cases += [
                (f"{key} on meta", _with(st, col_at, col.to("meta"))),
                (f"{key} one row short", _with(st, col_at, col[:-1])),
                (f"{key} as float64", _with(st, col_at, col.double())),
                (f"{key} requires grad", _with(st, col_at, col.double().requires_grad_())),
            ]
    else:
        at = ("rb", "_storage", "_storage")
        items = inner
        cases += [
            ("one item more than the capacity", _with(st, at, [*items, items[0]] * 2)),
            (
                "an item without a key",
                _with(
                    st, at, [{k: v for k, v in items[0].items() if k != "advantage"}, *items[1:]]
                ),
            ),
            (
                "an item with a float64 column",
                _with(
                    st, at, [{**items[0], "advantage": items[0]["advantage"].double()}, *items[1:]]
                ),
            ),
            (
                "an item on meta",
                _with(
                    st,
                    at,
                    [{**items[0], "advantage": items[0]["advantage"].to("meta")}, *items[1:]],
                ),
            ),
            ("a tensor storage's columns", _with(st, at, {})),
        ]
    return cases


def _states(name: str, rb: Any) -> list[tuple[str, Any]]:
    st = rb.state_dict()
    return _ring_states(st) if name == "RingBuffer" else _torchrl_states(st, "Stack" in name)


# -- bad checkpoint directories ----------------------------------------------------------------
def _disk_damages(saved: Path, other: Path) -> list[tuple[str, Callable[[Path], None]]]:
    """Truncated, deleted, altered, added and swapped files of a checkpoint (some resealed)."""
    files = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    out: list[tuple[str, Callable[[Path], None]]] = []
    for f in files:

        def truncate(d: Path, f: str = f) -> None:
            p = d / f
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

        def empty(d: Path, f: str = f) -> None:
            (d / f).write_bytes(b"")

        def delete(d: Path, f: str = f) -> None:
            (d / f).unlink()

        def flip(d: Path, f: str = f) -> None:
            b = bytearray((d / f).read_bytes())
            b[len(b) // 2] ^= 1
            (d / f).write_bytes(bytes(b))

        def garbage_resealed(d: Path, f: str = f) -> None:
            (d / f).write_bytes(b"not what was written")
            reseal(d)

        out += [
            (f"{f} truncated", truncate),
            (f"{f} emptied", empty),
            (f"{f} deleted", delete),
            (f"{f} one bit flipped", flip),
            (f"{f} garbage, manifest resealed", garbage_resealed),
        ]

    def extra(d: Path) -> None:
        (d / "extra.pt").write_bytes(b"x")

    def swapped(d: Path) -> None:  # another buffer's checkpoint, resealed: a mismatched state
        for f in files:
            if f != MANIFEST and (other / f).exists():
                shutil.copy(other / f, d / f)
        reseal(d)

    out += [("an extra file", extra), ("another buffer's state, resealed", swapped)]
    return out


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


# -- the tests ---------------------------------------------------------------------------------
def _refusals(
    load: Callable[[Any], None],
    cases: list[tuple[str, Any]],
    unchanged: Callable[[], bool],
    restore: Callable[[], None],
) -> list[str]:
    """What went wrong for each case: accepted, another error than ValueError, or a change
    (after which the buffer is restored, so that each case is judged on its own)."""
    problems = []
    for what, bad in cases:
        try:
            load(bad)
        except ValueError as e:
            if not str(e):
                problems.append(f"{what}: refused without a message")
        except Exception as e:
            problems.append(f"{what}: {type(e).__name__}: {e}")
        else:
            problems.append(f"{what}: accepted")
        if not unchanged():
            problems.append(f"{what}: changed the buffer")
            restore()
    return problems


@pytest.mark.parametrize("name", sorted(BUFFERS))
def test_bad_states_and_checkpoints_are_refused_with_the_buffer_unchanged(
    name: str, tmp_path: Path
) -> None:
    src = _filled(name, "without_replacement")
    cases = _states(name, src)
    target = _filled(name, "without_replacement")
    target.extend(_batch(name, 3, 900))
    before = target.state_dict()
    refused = 0
    problems = _refusals(
        target.load_state_dict,
        cases,
        lambda: _same(target.state_dict(), before),
        lambda: target.load_state_dict(before),
    )
    assert not problems, problems
    refused += len(cases)
    src.dumps(tmp_path / "saved")
    other = BUFFERS[name]("without_replacement", 2 * CAP)()  # another capacity: mismatched
    other.extend(_batch(name, CAP + 4, 700))  # more items than this capacity holds
    other.dumps(tmp_path / "other")
    for i, (what, damage) in enumerate(_disk_damages(tmp_path / "saved", tmp_path / "other")):
        case = tmp_path / f"case-{i}"
        shutil.copytree(tmp_path / "saved", case)
        damage(case)
        with pytest.raises(ValueError, match=r"\S"):  # CheckpointError is a ValueError
            target.loads(case)
        assert _same(target.state_dict(), before), f"{name}: {what} changed the buffer"
        refused += 1
    assert refused >= MIN_REFUSED, refused


@pytest.mark.parametrize("name", sorted(BUFFERS))
def test_a_pickle_in_each_checkpoint_file_runs_nothing(name: str, tmp_path: Path) -> None:
    src = _filled(name, "with_replacement")
    src.dumps(tmp_path / "saved")
    files = sorted(
        p.relative_to(tmp_path / "saved") for p in (tmp_path / "saved").rglob("*") if p.is_file()
    )
    target = _filled(name, "with_replacement")
    before = target.state_dict()
    tried = 0
    for i, f in enumerate(files):
        for as_torch in (True, False):
            case, marker = tmp_path / f"case-{i}-{as_torch}", tmp_path / f"ran-{i}-{as_torch}"
            shutil.copytree(tmp_path / "saved", case)
            (case / f).unlink()
            if as_torch:
                torch.save({"state": _Payload(marker)}, case / f)
            else:
                (case / f).write_bytes(pickle.dumps(_Payload(marker), protocol=2))
            for resealed in (False, True):
                if resealed and f.as_posix() != MANIFEST:
                    reseal(case)
                with pytest.raises(ValueError, match=r"\S"):
                    target.loads(case)
                assert not marker.exists(), f"{name}: a pickle in {f} ran on load"
                assert _same(target.state_dict(), before)
                tried += 1
    assert len(files) == 2  # the state file and the manifest
    assert tried == 4 * len(files)


@pytest.mark.parametrize("sampling", ["with_replacement", "without_replacement"])
@pytest.mark.parametrize("name", sorted(BUFFERS))
def test_checkpoints_round_trip_bit_exactly_after_wrap_around(
    name: str, sampling: str, tmp_path: Path
) -> None:
    src = _filled(name, sampling)
    src.dumps(tmp_path / "ck")
    fresh = BUFFERS[name](sampling)()
    fresh.loads(tmp_path / "ck")
    assert _same(fresh.state_dict(), src.state_dict())
    assert len(fresh) == len(src) == CAP
    for i in range(CAP):
        one = torch.tensor([i])
        assert _same(
            fresh.read(one).exclude("index").to_dict(), src.read(one).exclude("index").to_dict()
        )
    if sampling == "without_replacement":  # the epoch under way goes on where it was
        assert sorted(item_uids(fresh.sample(5))) == sorted(item_uids(src.sample(5)))
    nxt = _batch(name, 3, 500)
    assert fresh.extend(nxt).tolist() == src.extend(nxt).tolist()


# -- NeMo-RL's replay buffer and a served buffer -----------------------------------------------
def _nemo() -> NemoReplayBuffer:
    nemo = NemoReplayBuffer(RingBuffer(4, seed=0), max_size=8, chunk_bytes=2048)
    for v in range(3):
        nemo.add({"batch": dict(from_layout(llm_batch(2, 6, uid_start=10 * v))), "t": v}, v, v + 1)
    return nemo


def _nemo_states(st: dict[str, Any]) -> list[tuple[str, Any]]:
    """The replay buffer's state (NeMo-RL's keys; each group an encoded payload) spoiled."""
    required = (
        "trajectories",
        "trajectory_versions",
        "target_weight_versions",
        "last_target_weight_already_generated",
    )
    t, p = st["trajectories"], st["trajectories"][0]
    cases: list[tuple[str, Any]] = [
        (f"{k} deleted", {x: v for x, v in st.items() if x != k}) for k in required
    ]
    cases += [(f"{k} a string", {**st, k: "garbage"}) for k in (*required, "task_indices")]
    cases += [
        ("another format", {**st, "format": "posttrain-nemo-trajectory/0"}),
        ("a version a string", {**st, "trajectory_versions": ["0", 1, 2]}),
        ("a target a float", {**st, "target_weight_versions": [1.0, 2, 3]}),
        ("a version a bool", {**st, "trajectory_versions": [True, 1, 2]}),
        ("lists of other lengths", {**st, "trajectory_versions": [0]}),
        ("task indices of another length", {**st, "task_indices": [None]}),
        ("a task index a string", {**st, "task_indices": ["0", None, None]}),
        ("a payload of floats", {**st, "trajectories": [p.float(), *t[1:]]}),
        ("a payload cut short", {**st, "trajectories": [p[:-1], *t[1:]]}),
        ("a payload of zeros", {**st, "trajectories": [torch.zeros_like(p), *t[1:]]}),
        ("a payload 2-D", {**st, "trajectories": [p[None], *t[1:]]}),
        ("a trajectory a string", {**st, "trajectories": ["garbage", *t[1:]]}),
        ("more groups than the backing ring holds", {**st, "trajectories": [*t, *t],
         "trajectory_versions": [0, 1, 2] * 2, "target_weight_versions": [1, 2, 3] * 2,
         "task_indices": [None] * 6}),
    ]  # fmt: skip
    return cases


def test_nemo_refuses_bad_states_with_nothing_changed() -> None:
    src, target = _nemo(), _nemo()
    target.sample(1, current_weight_version=1, max_age_steps=1)
    before = target.state_dict()
    cases = _nemo_states(src.state_dict())
    problems = _refusals(
        target.load_state_dict,
        cases,
        lambda: _same(target.state_dict(), before),
        lambda: target.load_state_dict(before),
    )
    assert not problems, problems
    assert len(cases) >= 20, len(cases)


def test_a_served_buffer_refuses_bad_states_in_its_host_with_nothing_changed(
    tmp_path: Path,
) -> None:
    # The actor body itself (BufferHost runs one call at a time in the actor): what a
    # RemoteBuffer's load_state_dict / loads reach.
    host = BufferHost()
    host.create("src", RingBuffer, (CAP,))
    host.create("dst", RingBuffer, (CAP,))
    for key in ("src", "dst"):
        host.call(key, "extend", (llm_batch(5, 6, uid_start=100),))
        host.call(key, "extend", (llm_batch(5, 6, uid_start=200),))
    before = host.call("dst", "state_dict", ())
    cases = _ring_states(host.call("src", "state_dict", ()))
    problems = _refusals(
        lambda st: host.call("dst", "load_state_dict", (st,)),
        cases,
        lambda: _same(host.call("dst", "state_dict", ()), before),
        lambda: host.call("dst", "load_state_dict", (before,)),
    )
    assert not problems, problems
    host.call("src", "dumps", (str(tmp_path / "saved"),))
    marker = tmp_path / "ran"
    (tmp_path / "saved" / "ring_buffer.pt").unlink()
    torch.save({"x": _Payload(marker)}, tmp_path / "saved" / "ring_buffer.pt")
    reseal(tmp_path / "saved")
    with pytest.raises(ValueError, match="could not be read as tensors and plain data"):
        host.call("dst", "loads", (str(tmp_path / "saved"),))
    assert not marker.exists()
    assert _same(host.call("dst", "state_dict", ()), before)
    assert len(cases) >= MIN_REFUSED, len(cases)
