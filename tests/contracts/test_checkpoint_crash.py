"""A save killed at any step leaves the old or the new checkpoint, and the next save cleans up.

Process death is simulated by patching the filesystem steps of ``posttrain._checkpoint`` (each
fsync, rename, exchange, directory removal and the manifest write): the k-th step raises, and
every step after it raises too, so nothing runs that a dead process would not run (not even
the clean-up of the temporary directory). For every bundled buffer, with the directory
exchange and without it (a filesystem that has none), a fresh buffer's ``loads`` must then
yield the old checkpoint or the new one exactly, and the next save must leave nothing but the
checkpoint beside it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import posttrain._checkpoint as ck
from posttrain._checkpoint import MANIFEST, CheckpointNotFound, save_state, verify_dir
from posttrain.reference_impls import RingBuffer
from posttrain.testing import item_uids, llm_batch, ragged_llm_batch
from tests.paths import ROOT

CAP = 6


def _torchrl(kind: str) -> Callable[[], Any]:
    def make() -> Any:
        from torchrl.data import (
            LazyMemmapStorage,
            LazyStackStorage,
            LazyTensorStorage,
            TensorDictReplayBuffer,
        )

        from posttrain.adapters.torchrl import ValidatedReplayBuffer

        makers: dict[str, Callable[[], Any]] = {
            "tensor": lambda: LazyTensorStorage(CAP),
            "memmap": lambda: LazyMemmapStorage(CAP, scratch_dir=tempfile.mkdtemp()),
            "stack": lambda: LazyStackStorage(CAP),
        }
        storage = makers[kind]()
        return ValidatedReplayBuffer(
            TensorDictReplayBuffer(storage=storage), ragged=kind == "stack"
        )

    return make


BUFFERS: dict[str, Callable[[], Any]] = {
    "RingBuffer": lambda: RingBuffer(CAP, seed=0),
    "Validated(LazyTensorStorage)": _torchrl("tensor"),
    "Validated(LazyMemmapStorage)": _torchrl("memmap"),
    "Validated(LazyStackStorage)": _torchrl("stack"),
}


def _filled(name: str, uid: int, n: int) -> Any:
    rb = BUFFERS[name]()
    if "Stack" in name:
        rb.extend(ragged_llm_batch([4 + i % 3 for i in range(n)], uid_start=uid))
    else:
        rb.extend(llm_batch(n, 5, uid_start=uid))
    return rb


def _uids(rb: Any) -> list[int]:
    return sorted(item_uids(rb.read(torch.arange(len(rb)))))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)  # NaN equals NaN


def _same(a: Any, b: Any) -> bool:
    """Deep equality of two states, tensors bit-exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(_bits(a), _bits(b)))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "state_dict") and hasattr(b, "state_dict"):
        return _same(a.state_dict(), b.state_dict())
    return bool(a == b)


class _Died(BaseException):
    """The simulated death of the saving process (not an Exception: nothing catches it)."""


STEPS = ("_fsync", "_rename", "_rmtree", "_exchange", "_write_manifest")


class _Reaper:
    """Counts the filesystem steps of a save; kills the save at step ``at`` (None: never)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int | None, exchange: bool) -> None:
        self.at, self.steps, self.dead = at, list[str](), False
        for name in STEPS:
            real = getattr(ck, name)
            if name == "_exchange" and not exchange:
                real = _no_exchange
            monkeypatch.setattr(ck, name, self._step(name, real))

    def _step(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any) -> Any:
            if self.dead:
                raise _Died(f"already dead at {name}")
            if len(self.steps) == self.at:
                self.dead = True
                if name == "_rmtree":  # dies half-way through removing a directory
                    files = sorted(p for p in Path(args[0]).rglob("*") if p.is_file())
                    for p in files[: max(1, len(files) // 2)]:
                        p.unlink()
                raise _Died(f"killed at step {self.at} ({name})")
            self.steps.append(name)
            return real(*args)

        return step


def _no_exchange(a: Path, b: Path) -> bool:
    return False  # a filesystem without RENAME_EXCHANGE (NFS, not Linux)


def _beside(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.parent.iterdir())


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("name", sorted(BUFFERS))
def test_a_save_killed_at_every_step_leaves_the_old_or_the_new_checkpoint(
    name: str, exchange: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new, next_ = _filled(name, 100, 4), _filled(name, 200, 5), _filled(name, 300, 3)
    want_old, want_new, want_next = old.state_dict(), new.state_dict(), _uids(next_)
    seen: dict[str, list[int]] = {"old": [], "new": []}
    for k in range(100):
        ckpt = tmp_path / f"k{k}" / "ckpt"
        old.dumps(ckpt)
        with monkeypatch.context() as mp:
            reaper = _Reaper(mp, k, exchange)
            try:
                new.dumps(ckpt)
            except _Died:
                died = True
            else:
                died = False
        if exchange:  # no window at all: the path is a whole checkpoint at every step
            assert ckpt.is_dir(), f"step {k}: no directory at the path"
            verify_dir(ckpt)
        fresh = BUFFERS[name]()
        fresh.loads(ckpt)
        got = fresh.state_dict()
        is_old, is_new = _same(got, want_old), _same(got, want_new)
        assert is_old or is_new, f"step {k} ({reaper.steps[-1:]}): {_uids(fresh)}"
        seen["old" if is_old else "new"].append(k)
        next_.dumps(ckpt)  # the next save succeeds and leaves nothing else beside it
        assert _beside(ckpt) == ["ckpt"], f"step {k}: debris left: {_beside(ckpt)}"
        again = BUFFERS[name]()
        again.loads(ckpt)
        assert _uids(again) == want_next
        if not died:
            break
    else:
        pytest.fail("the save never finished within 100 steps")
    # The kills straddle the swap: early ones keep the old checkpoint, later ones the new.
    assert seen["old"], seen
    assert seen["new"], seen
    assert max(seen["old"]) < min(seen["new"]), seen
    assert k >= 5  # fsyncs, the manifest, the swap and the removal were all stepped through


def test_loads_recovers_the_checkpoint_an_earlier_swap_left_aside(tmp_path: Path) -> None:
    """What a save killed between the two renames of a swap left (posttrain before it had the
    exchange, or a filesystem without one): no directory at the path, the previous checkpoint
    renamed aside. ``loads`` reads it; the next save removes it."""
    rb = _filled("RingBuffer", 100, 4)
    ckpt = tmp_path / "ckpt"
    rb.dumps(ckpt)
    aside = tmp_path / ".ckpt.old-0123456789ab"
    os.rename(ckpt, aside)
    (tmp_path / ".ckpt.tmp-ba9876543210").mkdir()  # a new one killed before its manifest
    fresh = RingBuffer(CAP)
    fresh.loads(ckpt)
    assert _uids(fresh) == _uids(rb)
    _filled("RingBuffer", 200, 2).dumps(ckpt)
    assert _beside(ckpt) == ["ckpt"]


def test_a_missing_checkpoint_with_only_broken_leftovers_is_not_found(tmp_path: Path) -> None:
    save_state(tmp_path / "ckpt", "x.pt", {"x": torch.ones(2)})
    os.rename(tmp_path / "ckpt", tmp_path / ".ckpt.old-0123456789ab")
    (tmp_path / ".ckpt.old-0123456789ab" / "x.pt").write_bytes(b"cut")
    with pytest.raises(CheckpointNotFound, match="a crashed save left 1 broken") as got:
        RingBuffer(CAP).loads(tmp_path / "ckpt")
    assert isinstance(got.value, FileNotFoundError)


def test_a_save_while_the_path_is_missing_keeps_the_leftover_until_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no directory at the path, the leftover may be the only whole copy: a save that
    dies too must not have removed it."""
    rb, newer = _filled("RingBuffer", 100, 4), _filled("RingBuffer", 200, 2)
    ckpt = tmp_path / "ckpt"
    rb.dumps(ckpt)
    aside = tmp_path / ".ckpt.old-0123456789ab"
    os.rename(ckpt, aside)
    for k in range(3):  # killed before its manifest, after it, and after its first fsync
        with monkeypatch.context() as mp:
            _Reaper(mp, k, exchange=True)
            with pytest.raises(_Died):
                newer.dumps(ckpt)
        assert verify_dir(aside)  # still there, still whole
        fresh = RingBuffer(CAP)
        fresh.loads(ckpt)
        assert _uids(fresh) in (_uids(rb), _uids(newer))
    newer.dumps(ckpt)
    assert _beside(ckpt) == ["ckpt"]


def test_saves_from_threads_to_one_path_take_turns(tmp_path: Path) -> None:
    import threading

    ckpt = tmp_path / "ckpt"
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            for j in range(5):
                save_state(ckpt, "x.pt", {"i": torch.full((64,), i * 10 + j)})
        except BaseException as e:  # pragma: no cover - the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _beside(ckpt) == ["ckpt"]
    assert verify_dir(ckpt) == {"x.pt": (ckpt / "x.pt").stat().st_size}
    assert (ckpt / MANIFEST).is_file()


def test_the_exchange_keeps_a_real_directory_at_the_path(tmp_path: Path) -> None:
    """No link, no pointer file: the checkpoint stays a plain directory that can be copied or
    moved like any other."""
    ckpt = tmp_path / "ckpt"
    for i in range(3):
        save_state(ckpt, "x.pt", TensorDict({"x": torch.full((2,), i)}, [2]).to_dict())
        assert ckpt.is_dir()
        assert not ckpt.is_symlink()
    assert _beside(ckpt) == ["ckpt"]


_SAVER = """
import sys
from posttrain.reference_impls import RingBuffer
from posttrain.testing import llm_batch
bufs = []
for uid in (100, 200):
    rb = RingBuffer(6, seed=0)
    rb.extend(llm_batch(4, 5, uid_start=uid))
    bufs.append(rb)
bufs[0].dumps(sys.argv[1])
print("ready", flush=True)
i = 1
while True:
    bufs[i % 2].dumps(sys.argv[1])
    i += 1
"""


def test_a_process_killed_while_it_saves_over_and_over_leaves_a_whole_checkpoint(
    tmp_path: Path,
) -> None:
    """The same with a real SIGKILL, at whatever point of a save it lands."""
    import signal
    import subprocess
    import sys
    import time

    ckpt = tmp_path / "ckpt"
    want = [list(range(100, 104)), list(range(200, 204))]
    for delay in (0.05, 0.17, 0.31):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(ckpt)],
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        assert ckpt.is_dir()
        fresh = RingBuffer(6)
        fresh.loads(ckpt)
        assert _uids(fresh) in want
    _filled("RingBuffer", 300, 2).dumps(ckpt)
    assert _beside(ckpt) == ["ckpt"]
