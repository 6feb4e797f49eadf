"""Buffer checkpoints on disk: written whole, verified before reading, and no code run on load."""

from __future__ import annotations

import hashlib
import json
import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain._checkpoint import MANIFEST, CheckpointDiskFull, CheckpointError
from posttrain.reference_impls import RingBuffer
from posttrain.testing import item_uids, llm_batch


class _Payload:
    """Unpickling this creates a marker file: the proof that code ran on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _full(capacity: int = 4, sampling: str = "with_replacement") -> RingBuffer:
    rb = RingBuffer(capacity, sampling=sampling)
    rb.extend(llm_batch(3, 6, uid_start=100))
    rb.extend(llm_batch(3, 6, uid_start=200))  # wraps around
    return rb


def _reseal(ckpt: Path) -> None:
    """Rewrite the manifest to match the files, as someone who altered them would."""
    files = {p.relative_to(ckpt).as_posix(): p for p in sorted(ckpt.rglob("*")) if p.is_file()}
    files.pop(MANIFEST)
    manifest = {
        "format": "posttrain-checkpoint/1",
        "files": {
            n: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for n, p in files.items()
        },
    }
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _contents(rb: RingBuffer) -> dict[str, Any]:
    return {"len": len(rb), "uids": sorted(item_uids(rb.read(torch.arange(len(rb)))))}


def test_round_trip_after_wrap_around_in_both_sampling_modes(tmp_path: Path) -> None:
    for sampling in ("with_replacement", "without_replacement"):
        rb = _full(sampling=sampling)
        rb.sample(1)
        rb.dumps(tmp_path / sampling)
        fresh = RingBuffer(4, sampling=sampling)
        fresh.loads(tmp_path / sampling)
        assert _contents(fresh) == _contents(rb)
        assert item_uids(fresh.sample(3)) == item_uids(rb.sample(3))  # the same RNG state
        assert (
            fresh.extend(llm_batch(1, 6, uid_start=300)).tolist()
            == rb.extend(llm_batch(1, 6, uid_start=300)).tolist()
        )


def test_a_malicious_pickle_runs_nothing_and_changes_nothing(tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    _full().dumps(ckpt)
    torch.save({"x": _Payload(marker)}, ckpt / "ring_buffer.pt")
    (ckpt / "extra.pkl").write_bytes(b"\x80\x04c__builtin__\neval\n.")
    target = _full()
    before = _contents(target)
    with pytest.raises(CheckpointError):  # the manifest no longer matches
        target.loads(ckpt)
    _reseal(ckpt)  # a forger who rewrites the manifest too
    (ckpt / "extra.pkl").unlink()
    _reseal(ckpt)
    with pytest.raises(CheckpointError, match="could not be read as tensors and plain data"):
        target.loads(ckpt)
    assert not marker.exists()
    assert _contents(target) == before


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "delete", "extra", "no_manifest", "empty_file", "garbage_resealed"],
)
def test_a_damaged_checkpoint_is_refused_with_the_buffer_unchanged(
    tmp_path: Path, damage: str
) -> None:
    ckpt = tmp_path / "ckpt"
    _full().dumps(ckpt)
    state = ckpt / "ring_buffer.pt"
    data = state.read_bytes()
    if damage == "truncate":
        state.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        state.write_bytes(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
    elif damage == "delete":
        state.unlink()
    elif damage == "extra":
        (ckpt / "more.pt").write_bytes(b"x")
    elif damage == "no_manifest":
        (ckpt / MANIFEST).unlink()
    elif damage == "empty_file":
        state.write_bytes(b"")
    else:
        state.write_bytes(b"not a torch archive")
        _reseal(ckpt)
    target = RingBuffer(4)
    target.extend(llm_batch(2, 6, uid_start=900))
    before = _contents(target)
    with pytest.raises(CheckpointError):
        target.loads(ckpt)
    assert _contents(target) == before


def test_dumps_never_replaces_a_directory_of_other_files(tmp_path: Path) -> None:
    mine = tmp_path / "run"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(CheckpointError, match="not a posttrain checkpoint"):
        _full().dumps(mine)
    assert (mine / "model.safetensors").read_bytes() == b"weights"
    _full().dumps(mine / "buffer")  # beside them is fine
    _full().dumps(mine / "buffer")  # and so is replacing an earlier checkpoint


def test_a_failed_dumps_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    old = _full()
    old.dumps(ckpt)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    newer = _full()
    newer.extend(llm_batch(2, 6, uid_start=500))
    with pytest.raises(CheckpointDiskFull, match=r"disk full: .* needed at .*MiB free") as got:
        newer.dumps(ckpt)
    assert isinstance(got.value.__cause__, OSError)
    assert got.value.__cause__.errno == 28
    monkeypatch.undo()
    fresh = RingBuffer(4)
    fresh.loads(ckpt)
    assert _contents(fresh) == _contents(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
