"""What a buffer's checkpoint holds and how its saves and loads fail, for every bundled buffer.

Saved rows are the stored items and zeros (nothing of the memory they were allocated from);
the dtypes a save accepts are the dtypes a load accepts; a leaf without data is refused on
write; a snapshot taken while threads write holds whole items only; and every failed save or
load is a ``CheckpointError`` saying what happened, the operating system's error chained.
"""

from __future__ import annotations

import errno
import io
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

import posttrain._checkpoint as ck
from posttrain._checkpoint import MANIFEST, CheckpointDiskFull, CheckpointError, reseal
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch

CAP = 8
DIRTY = 0xA5  # what "freed memory" holds in these tests


def _torchrl(kind: str, cap: int = CAP) -> Callable[[], Any]:
    def make() -> Any:
        from torchrl.data import (
            LazyMemmapStorage,
            LazyStackStorage,
            LazyTensorStorage,
            TensorDictReplayBuffer,
        )

        from posttrain.adapters.torchrl import ValidatedReplayBuffer

        makers: dict[str, Callable[[], Any]] = {
            "tensor": lambda: LazyTensorStorage(cap),
            "memmap": lambda: LazyMemmapStorage(cap, scratch_dir=tempfile.mkdtemp()),
            "stack": lambda: LazyStackStorage(cap),
        }
        storage = makers[kind]()
        return ValidatedReplayBuffer(TensorDictReplayBuffer(storage=storage))

    return make


BUFFERS: dict[str, Callable[..., Callable[[], Any]]] = {
    "RingBuffer": lambda cap=CAP: lambda: RingBuffer(cap, seed=0),
    "Validated(LazyTensorStorage)": lambda cap=CAP: _torchrl("tensor", cap),
    "Validated(LazyMemmapStorage)": lambda cap=CAP: _torchrl("memmap", cap),
    "Validated(LazyStackStorage)": lambda cap=CAP: _torchrl("stack", cap),
}
NAMES = sorted(BUFFERS)


def _items(ids: list[int]) -> TensorDict:
    """Items whose every field is derived from the item's id; 13 bytes a row, so a packed
    row has padding."""
    t = torch.tensor(ids, dtype=torch.int64)
    return TensorDict(
        {"id": t, "x": t[:, None].float() + torch.tensor([0.25, 0.5, 0.75]), "f": t % 2 == 0},
        batch_size=[len(ids)],
    )


def _torn(td: Any) -> list[int]:
    want = _items(td["id"].tolist())
    bad = (td["x"] != want["x"]).any(1) | (td["f"] != want["f"])
    return list(td["id"][bad].tolist())


def _file_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())


# -- nothing of freed memory reaches disk ------------------------------------------------------
def _dirty(t: Any) -> Any:
    if isinstance(t, TensorDictBase):
        t.apply_(_dirty)
    elif isinstance(t, torch.Tensor) and t.is_contiguous() and t.numel():
        t.view(-1).view(torch.uint8).fill_(DIRTY)
    return t


@pytest.mark.parametrize("name", NAMES)
def test_saved_rows_are_the_stored_items_and_zeros(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty, empty_like = torch.empty, torch.empty_like
    with monkeypatch.context() as mp:  # an allocator handing back memory a freed buffer used
        mp.setattr(torch, "empty", lambda *a, **k: _dirty(empty(*a, **k)))
        mp.setattr(torch, "empty_like", lambda *a, **k: _dirty(empty_like(*a, **k)))
        rb = BUFFERS[name]()()
        rb.extend(_items([1, 2, 3]))
        rb.extend(_items([4, 5]))  # 5 of 8 rows stored
    inner = getattr(getattr(getattr(rb, "rb", None), "storage", None), "_storage", None)
    if isinstance(inner, TensorDictBase):  # a memmap file starts zeroed: dirty it by hand
        _dirty(inner[5:])
    rb.dumps(tmp_path / "ckpt")
    raw = _file_bytes(tmp_path / "ckpt")
    assert bytes([DIRTY]) * 3 not in raw
    buf = io.BytesIO()
    torch.save(rb.state_dict(), buf)
    assert bytes([DIRTY]) * 3 not in buf.getvalue()
    fresh = BUFFERS[name]()()
    fresh.loads(tmp_path / "ckpt")
    assert fresh.read(torch.arange(5))["id"].tolist() == [1, 2, 3, 4, 5]


# -- one dtype allowlist, on write and on load -------------------------------------------------
UNSTORABLE = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", UNSTORABLE, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_a_dtype_no_load_accepts_is_refused_on_the_first_write(
    name: str, dtype: torch.dtype
) -> None:
    rb = BUFFERS[name]()()
    bad = _items([1, 2])
    bad["odd"] = torch.zeros(2, 3).to(dtype)
    dname = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"key 'odd': expected a dtype of bool, .*found {dname}"):
        rb.extend(bad)
    assert len(rb) == 0
    rb.extend(_items([3]))  # the refused batch fixed no schema
    assert rb.read(torch.arange(1))["id"].tolist() == [3]


def test_the_write_and_the_load_share_one_dtype_table() -> None:
    from posttrain._dtypes import DTYPES, STORABLE
    from posttrain._state_checks import schema_from_state

    assert set(DTYPES.values()) == STORABLE
    for dtype in UNSTORABLE:
        with pytest.raises(ValueError, match="expected a dtype name of"):
            schema_from_state([(("x",), str(dtype).removeprefix("torch."), ())], "schema")


# -- leaves without data are refused on every write --------------------------------------------
def _fake(td: TensorDict) -> TensorDict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    return TensorDict({k: mode.from_tensor(v) for k, v in td.items()}, batch_size=td.batch_size)


@pytest.mark.parametrize("first", [True, False], ids=["first-write", "later-write"])
@pytest.mark.parametrize("name", NAMES)
def test_fake_tensors_are_refused_with_the_buffer_unchanged(name: str, first: bool) -> None:
    rb = BUFFERS[name]()()
    if not first:
        rb.extend(_items([1, 2]))
    with pytest.raises(
        ValueError, match=r"key '(id|x|f)': expected a tensor holding data, found a FakeTensor"
    ):
        rb.extend(_fake(_items([7, 8])))
    assert len(rb) == (0 if first else 2)
    rb.extend(_items([3]))
    assert rb.read(torch.arange(len(rb)))["id"].tolist() == ([3] if first else [1, 2, 3])


# -- snapshots under concurrent writes ---------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_snapshots_taken_while_8_threads_write_hold_whole_items(name: str, tmp_path: Path) -> None:
    rb = BUFFERS[name](64)()
    rb.extend(_items([0]))
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(w: int) -> None:
        i = 0
        try:
            while not stop.is_set():
                base = 1 + w * 1_000_000 + i * 16
                rb.extend(_items(list(range(base, base + 16))))
                i += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(8)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: a window in a snapshot shows up
    for t in threads:
        t.start()
    torn: list[str] = []
    try:
        for s in range(30):
            target = BUFFERS[name](64)()
            if s % 10 == 0:
                rb.dumps(tmp_path / f"s{s}")
                target.loads(tmp_path / f"s{s}")
                what = "dumps"
            else:
                target.load_state_dict(rb.state_dict())
                what = "state_dict"
            n = len(target)
            torn += [f"{what} {s}: {i}" for i in _torn(target.read(torch.arange(n)))]
            torn += [f"read {s}: {i}" for i in _torn(rb.read(torch.arange(len(rb))))]
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(switch)
    assert not errors
    assert not torn, torn[:10]


@pytest.mark.parametrize("how", ["state_dict", "read", "dumps"])
@pytest.mark.parametrize("name", ["Validated(LazyTensorStorage)", "Validated(LazyMemmapStorage)"])
def test_a_snapshot_taken_while_a_write_is_half_done_waits_for_it(
    name: str, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write paused after its first column (TorchRL writes columns one by one): a snapshot
    taken then must hold the whole write or none of it."""
    rb = BUFFERS[name](4)()
    rb.extend(_items([1, 2, 3, 4]))  # full: the next write overwrites rows 0 and 1
    storage = rb.rb.storage
    real_set = storage.set
    half = threading.Event()

    def slow_set(cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        storage._storage.get("id")[cursor] = data.get("id")
        half.set()
        time.sleep(0.3)
        return real_set(cursor, data, *args, **kwargs)

    monkeypatch.setattr(storage, "set", slow_set)
    writer = threading.Thread(target=rb.extend, args=(_items([5, 6]),))
    writer.start()
    assert half.wait(10)
    if how == "read":
        snap = rb.read(torch.arange(4))
    else:
        target = BUFFERS[name](4)()
        if how == "dumps":
            rb.dumps(tmp_path / "ckpt")
            target.loads(tmp_path / "ckpt")
        else:
            target.load_state_dict(rb.state_dict())
        snap = target.read(torch.arange(4))
    writer.join()
    assert _torn(snap) == []
    assert sorted(snap["id"].tolist()) in ([1, 2, 3, 4], [3, 4, 5, 6])


@pytest.mark.parametrize("name", ["Validated(LazyTensorStorage)", "Validated(LazyMemmapStorage)"])
def test_no_write_lands_while_a_state_dict_is_copied(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TorchRL's ``state_dict`` hands out its live tensors, and the copy is made after it
    returns: a write that starts then (here, right then) must wait for the copy."""
    rb = BUFFERS[name](4)()
    rb.extend(_items([1, 2, 3, 4]))
    storage = rb.rb.storage
    real_set, real_state = storage.set, rb.rb.state_dict
    half = threading.Event()

    def slow_set(cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        storage._storage.get("id")[cursor] = data.get("id")
        half.set()
        time.sleep(0.3)
        return real_set(cursor, data, *args, **kwargs)

    writer = threading.Thread(target=rb.extend, args=(_items([5, 6]),))

    def state_then_write() -> Any:
        live = real_state()
        writer.start()
        half.wait(1.0)  # unlocked, the write is half done by now
        return live

    monkeypatch.setattr(storage, "set", slow_set)
    monkeypatch.setattr(rb.rb, "state_dict", state_then_write)
    snap = rb.state_dict()
    writer.join()
    monkeypatch.undo()
    target = BUFFERS[name](4)()
    target.load_state_dict(snap)
    got = target.read(torch.arange(4))
    assert _torn(got) == []
    assert sorted(got["id"].tolist()) == [1, 2, 3, 4]
    assert sorted(rb.read(torch.arange(4))["id"].tolist()) == [3, 4, 5, 6]


# -- every failure is a CheckpointError that says what happened --------------------------------
def _saved(tmp_path: Path) -> Path:
    rb = RingBuffer(CAP)
    rb.extend(llm_batch(3, 5))
    rb.dumps(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_an_empty_state_file_behind_a_resealed_manifest(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    (ckpt / "ring_buffer.pt").write_bytes(b"")
    reseal(ckpt)
    with pytest.raises(CheckpointError, match="ends early: empty or cut short"):
        RingBuffer(CAP).loads(ckpt)


def test_a_deeply_nested_manifest(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    (ckpt / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply") as got:
        RingBuffer(CAP).loads(ckpt)
    assert isinstance(got.value.__cause__, RecursionError)
    assert not reseal(ckpt)


def test_a_state_that_does_not_fit_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _saved(tmp_path)
    before = _file_bytes(ckpt)
    monkeypatch.setattr(ck, "_free", lambda where: 3 << 20)
    rb = RingBuffer(200_000)
    rb.extend(llm_batch(200_000, 5))
    with pytest.raises(
        CheckpointDiskFull, match=r"disk full: \d+\.\d MiB needed at .*, 3\.0 MiB free"
    ):
        rb.dumps(ckpt)
    assert _file_bytes(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_disk_that_fills_during_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _saved(tmp_path)
    before = _file_bytes(ckpt)
    monkeypatch.setattr(ck, "_Recording", _FillingRecording)
    rb = RingBuffer(64)
    rb.extend(llm_batch(64, 5))
    with pytest.raises(
        CheckpointDiskFull, match=r"disk full: .* needed at .* free, while writing"
    ) as got:
        rb.dumps(ckpt)
    assert isinstance(got.value.__cause__, OSError)
    assert got.value.__cause__.errno == errno.ENOSPC
    assert "inline_container" not in str(got.value)
    assert _file_bytes(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class _Full(io.FileIO):
    """A file on a disk that fills after 4 KiB."""

    def write(self, b: Any, /) -> int:
        if self.tell() > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(b)


class _FillingRecording(ck._Recording, _Full):
    pass


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.EACCES, "permission denied"), (errno.EROFS, "read-only"), (errno.EIO, "input/output")],
)
def test_an_os_refusal_during_a_save_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    ckpt = _saved(tmp_path)

    def refuse(path: Path) -> None:
        raise OSError(code, "refused", str(path))

    monkeypatch.setattr(ck, "_fsync", refuse)
    with pytest.raises(CheckpointError, match=words) as got:
        RingBuffer(CAP).dumps(ckpt)
    assert isinstance(got.value.__cause__, OSError)
    monkeypatch.undo()
    RingBuffer(CAP).loads(ckpt)  # the previous checkpoint is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_os_refusal_during_a_load_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _saved(tmp_path)

    def refuse(*a: Any, **k: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied", "ring_buffer.pt")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError, match=r"reading ring_buffer\.pt: permission denied") as got:
        RingBuffer(CAP).loads(ckpt)
    assert isinstance(got.value.__cause__, PermissionError)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_whose_state_is_refused_is_a_checkpoint_error(
    name: str, tmp_path: Path
) -> None:
    big = BUFFERS[name](CAP)()
    big.extend(_items([1, 2, 3, 4, 5, 6]))
    big.dumps(tmp_path / "ckpt")
    small = BUFFERS[name](4)()  # 6 items do not fit it
    with pytest.raises(CheckpointError, match=r"buffer unchanged") as got:
        small.loads(tmp_path / "ckpt")
    assert isinstance(got.value.__cause__, ValueError)
    assert len(small) == 0


def test_the_manifest_written_is_json_with_every_file(tmp_path: Path) -> None:
    ckpt = _saved(tmp_path)
    listed = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["ring_buffer.pt"]
