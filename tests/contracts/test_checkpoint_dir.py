"""posttrain's checkpoint directory: atomic replacement and a manifest verified before reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain._checkpoint import MANIFEST, CheckpointError, atomic_dir, verify_dir


def _write(dest: Path, files: dict[str, bytes]) -> None:
    with atomic_dir(dest) as tmp:
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)


def test_round_trip_with_subdirectories(tmp_path: Path) -> None:
    dest = tmp_path / "ck"
    _write(dest, {"a.pt": b"x" * 10, "storage/b.memmap": b"y" * 3})
    assert verify_dir(dest) == {"a.pt": 10, "storage/b.memmap": 3}
    assert json.loads((dest / MANIFEST).read_text())["format"] == "posttrain-checkpoint/1"


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    dest = tmp_path / "ck"
    _write(dest, {"a.pt": b"old"})

    def dies() -> None:
        with atomic_dir(dest) as tmp:
            (tmp / "a.pt").write_bytes(b"new, half")
            raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        dies()
    assert (dest / "a.pt").read_bytes() == b"old"
    assert verify_dir(dest) == {"a.pt": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary left behind


def test_a_new_write_replaces_the_old_one_whole(tmp_path: Path) -> None:
    dest = tmp_path / "ck"
    _write(dest, {"a.pt": b"old", "gone.pt": b"1"})
    _write(dest, {"a.pt": b"newer"})
    assert verify_dir(dest) == {"a.pt": 5}
    assert not (dest / "gone.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "a.pt").unlink(), "a.pt: listed in the manifest, missing"),
        (lambda d: (d / "a.pt").write_bytes(b"xx"), "a.pt: 2 bytes, the manifest says 4"),
        (lambda d: (d / "a.pt").write_bytes(b"xxxy"), "a.pt: its SHA-256 differs"),
        (lambda d: (d / "evil.pkl").write_bytes(b"c"), "evil.pkl: not in the manifest"),
        (lambda d: (d / MANIFEST).unlink(), "no manifest.json"),
        (lambda d: (d / MANIFEST).write_text("{"), "manifest.json: not valid JSON"),
        (lambda d: (d / MANIFEST).write_text('{"format": "x"}'), "expected format"),
        (
            lambda d: (d / MANIFEST).write_text(
                '{"format": "posttrain-checkpoint/1", "files": {"a.pt": {"size": "4"}}}'
            ),
            "'files' must map",
        ),
        (lambda d: (d / "link").symlink_to(d / "a.pt"), "link: a link, not a file"),
    ],
)
def test_every_damage_is_refused_by_name(tmp_path: Path, damage: object, message: str) -> None:
    dest = tmp_path / "ck"
    _write(dest, {"a.pt": b"xxxx"})
    damage(dest)  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        verify_dir(dest)


def test_no_directory_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        verify_dir(tmp_path / "nothing")


def test_the_writer_may_not_write_its_own_manifest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="reserved"):
        _write(tmp_path / "ck", {MANIFEST: b"{}"})
    assert not (tmp_path / "ck").exists()
