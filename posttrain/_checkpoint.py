"""posttrain's on-disk checkpoint directory: written whole or not at all, verified before a read.

A checkpoint is a directory holding the writer's files and ``manifest.json``, which lists every
file with its size and SHA-256. :func:`atomic_dir` gives the writer an empty temporary
directory beside the destination; when the writer is done the manifest is written, every file
and directory is fsynced, and the directory is renamed into place, so a crash or an error
leaves either the previous checkpoint or the new one, never a mixture. :func:`verify_dir`
reads nothing the manifest does not vouch for: a missing, extra, truncated or altered file is
refused by name before any loader sees it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError

MANIFEST = "manifest.json"
_FORMAT = "posttrain-checkpoint/1"
_CHUNK = 1 << 20


class CheckpointError(PosttrainError, ValueError):
    """A checkpoint directory that is not what its manifest says (or has no manifest).

    Example:
        >>> str(CheckpointError("ring_buffer.pt: size 10, the manifest says 12"))
        'ring_buffer.pt: size 10, the manifest says 12'
    """


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> dict[str, Path]:
    """Every regular file under ``root`` by its '/'-separated relative name (the manifest's)."""
    out: dict[str, Path] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            raise CheckpointError(f"{p.relative_to(root).as_posix()}: a link, not a file")
        if p.is_file():
            out[p.relative_to(root).as_posix()] = p
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a checkpoint directory at ``path`` whole, or leave what was there untouched.

    Yields an empty temporary directory beside ``path``; write the checkpoint's files into it.
    On a clean exit the manifest is added, everything is fsynced and the directory replaces
    ``path``; on an exception the temporary directory is removed and ``path`` is as before.
    ``path`` must be new, empty or an earlier checkpoint: a directory of other files is refused
    (:class:`CheckpointError`) rather than replaced.

    Example:
        >>> import tempfile
        >>> dest = Path(tempfile.mkdtemp()) / "ckpt"
        >>> with atomic_dir(dest) as tmp:
        ...     _ = (tmp / "state.bin").write_bytes(b"abc")
        >>> sorted(p.name for p in dest.iterdir())
        ['manifest.json', 'state.bin']
        >>> verify_dir(dest)
        {'state.bin': 3}
    """
    dest = Path(path)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise CheckpointError(f"{dest}: exists and is not a directory; refusing to replace it")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MANIFEST).is_file():
        # The whole directory is replaced: never delete files a checkpoint did not write.
        raise CheckpointError(
            f"{dest}: holds files that are not a posttrain checkpoint (no {MANIFEST}); "
            "refusing to replace them: give a new or empty directory"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        files = _files(tmp)
        if MANIFEST in files:
            raise CheckpointError(f"{MANIFEST}: reserved for the checkpoint's own manifest")
        _write_manifest(tmp, files)
        for p in [*files.values(), tmp / MANIFEST]:
            _fsync(p)
        for d in sorted({p.parent for p in files.values()} | {tmp}, reverse=True):
            _fsync(d)
        _swap_in(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_manifest(root: Path, files: dict[str, Path]) -> None:
    manifest = {
        "format": _FORMAT,
        "files": {
            name: {"size": p.stat().st_size, "sha256": _digest(p)} for name, p in files.items()
        },
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def reseal(path: str | os.PathLike[str]) -> bool:
    """Rewrite the manifest of the checkpoint at ``path`` to match its files as they are now.

    What someone who altered a checkpoint would do: the manifest catches accidents (a
    truncated copy, a flipped bit), not a forger, so the kit reseals a tampered directory to
    check that a load refuses it on its own terms too. Returns False (and writes nothing) when
    ``path`` holds no posttrain manifest.

    Example:
        >>> import tempfile
        >>> dest = Path(tempfile.mkdtemp()) / "ckpt"
        >>> with atomic_dir(dest) as tmp:
        ...     _ = (tmp / "state.bin").write_bytes(b"abc")
        >>> _ = (dest / "state.bin").write_bytes(b"abcd")
        >>> reseal(dest), verify_dir(dest)
        (True, {'state.bin': 4})
    """
    root = Path(path)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return False
    _write_manifest(root, {n: p for n, p in _files(root).items() if n != MANIFEST})
    return True


def _swap_in(tmp: Path, dest: Path) -> None:
    # A directory cannot replace a non-empty one in one rename: move the old one aside first,
    # and put it back if the second rename fails.
    old: Path | None = None
    if dest.exists() or dest.is_symlink():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if old is not None:
            os.replace(old, dest)
        raise
    _fsync(dest.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def verify_dir(path: str | os.PathLike[str]) -> dict[str, int]:
    """Check every file of the checkpoint at ``path`` against its manifest; sizes by name.

    Raises :class:`CheckpointError` naming the first file that is missing, extra, of another
    size or another SHA-256, and for a missing or malformed manifest; ``FileNotFoundError``
    when ``path`` is not a directory.

    Example:
        >>> import tempfile
        >>> dest = Path(tempfile.mkdtemp()) / "ckpt"
        >>> with atomic_dir(dest) as tmp:
        ...     _ = (tmp / "state.bin").write_bytes(b"abc")
        >>> _ = (dest / "state.bin").write_bytes(b"abd")
        >>> verify_dir(dest)
        Traceback (most recent call last):
        ...
        posttrain._checkpoint.CheckpointError: ... state.bin: its SHA-256 differs from the manifest's (the file was altered after it was written)
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no checkpoint directory there")
    mfile = root / MANIFEST
    if not mfile.is_file():
        raise CheckpointError(
            f"{root}: no {MANIFEST} (not a posttrain checkpoint, or one whose write did not finish)"
        )
    try:
        manifest: Any = json.loads(mfile.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mfile}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{mfile}: expected format {_FORMAT!r}, found {found!r}")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(
        isinstance(v, dict)
        and isinstance(v.get("size"), int)
        and not isinstance(v.get("size"), bool)
        and isinstance(v.get("sha256"), str)
        for v in listed.values()
    ):
        raise CheckpointError(f"{mfile}: 'files' must map each name to {{size: int, sha256: str}}")
    present = {n: p for n, p in _files(root).items() if n != MANIFEST}
    for name in sorted(set(listed) | set(present)):
        where = f"{root}: {name}"
        if name not in present:
            raise CheckpointError(f"{where}: listed in the manifest, missing from the directory")
        if name not in listed:
            raise CheckpointError(f"{where}: not in the manifest (added after the write)")
        size = present[name].stat().st_size
        if size != listed[name]["size"]:
            raise CheckpointError(
                f"{where}: {size} bytes, the manifest says {listed[name]['size']} "
                "(truncated or rewritten)"
            )
        if _digest(present[name]) != listed[name]["sha256"]:
            raise CheckpointError(
                f"{where}: its SHA-256 differs from the manifest's (the file was altered after "
                "it was written)"
            )
    return {name: int(listed[name]["size"]) for name in sorted(listed)}


def why_unsafe(error: BaseException) -> str:
    """What a ``torch.load(weights_only=True)`` refusal was about, in a few words.

    Example:
        >>> why_unsafe(Exception("Weights only load failed... Unsupported global: GLOBAL a.B was..."))
        'it holds an instance of a.B'
    """
    what = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    return f"it holds an instance of {what.group(1)}" if what else str(error).splitlines()[0]


def load_verified(path: str | os.PathLike[str], name: str) -> Any:
    """The tensors and plain data in file ``name`` of the checkpoint directory ``path``.

    The manifest is verified before anything is read, and the file is read with
    ``torch.load(weights_only=True)``: a refusal or a corrupt archive is one ``CheckpointError``
    that says which.

    Example:
        >>> import tempfile, torch
        >>> d = Path(tempfile.mkdtemp()) / "ckpt"
        >>> with atomic_dir(d) as tmp:
        ...     torch.save({"x": torch.ones(2)}, tmp / "state.pt")
        >>> load_verified(d, "state.pt")["x"].tolist()
        [1.0, 1.0]
    """
    import torch

    files = verify_dir(path)
    if name not in files:
        raise CheckpointError(f"{path}: no {name} in this checkpoint: {sorted(files)}")
    try:
        return torch.load(Path(path, name), weights_only=True)
    except Exception as e:  # an unpickler refusal or a corrupt archive, said as one error
        raise CheckpointError(
            f"{path}: {name} could not be read as tensors and plain data: " + why_unsafe(e)
        ) from None


def save_state(path: str | os.PathLike[str], name: str, state: Any) -> None:
    """Write ``state`` as file ``name`` of a new checkpoint directory ``path``, atomically.

    What :func:`load_verified` reads back: ``torch.save`` into a fresh directory, sealed by a
    manifest and swapped in whole (an earlier checkpoint at ``path`` is replaced).

    Example:
        >>> import tempfile, torch
        >>> d = Path(tempfile.mkdtemp()) / "ckpt"
        >>> save_state(d, "state.pt", {"x": torch.zeros(1)})
        >>> load_verified(d, "state.pt")["x"].tolist()
        [0.0]
    """
    import torch

    with atomic_dir(path) as tmp:
        torch.save(state, tmp / name)
