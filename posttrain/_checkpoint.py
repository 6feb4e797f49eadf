"""posttrain's on-disk checkpoint directory: written whole or not at all, verified before a read.

A checkpoint is a directory holding the writer's files and ``manifest.json``, which lists every
file with its size and SHA-256. :func:`atomic_dir` gives the writer an empty temporary
directory beside the destination; when the writer is done the manifest is written, every file
and directory is fsynced, and the new directory takes the destination's place in one step
(an exchange of the two directories, so the path always holds the old or the new checkpoint).
:func:`verify_dir` reads nothing the manifest does not vouch for: a missing, extra, truncated or
altered file is refused by name before any loader sees it. A save that dies part-way leaves
temporaries beside the path (``.<name>.tmp-*``, ``.<name>.old-*``); the next save removes them,
and where a crash left no directory at the path, :func:`resolve` finds the complete checkpoint
among them. Every failure is a :class:`CheckpointError` that says what happened in words, with
the operating system's error chained.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import io
import json
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError

MANIFEST = "manifest.json"
_FORMAT = "posttrain-checkpoint/1"
_CHUNK = 1 << 20
_MARGIN = 1 << 20  # what a save needs beyond its tensors' bytes (archive records, manifest)


class CheckpointError(PosttrainError, ValueError):
    """A checkpoint that could not be saved or loaded: said in words, the OS error chained.

    Raised for a directory that is not what its manifest says (or has no manifest), a file
    that is not tensors and plain data, and a save or load the operating system refused.

    Example:
        >>> str(CheckpointError("ring_buffer.pt: size 10, the manifest says 12"))
        'ring_buffer.pt: size 10, the manifest says 12'
    """


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint at the path (nor one a crashed save left beside it).

    Also a ``FileNotFoundError``, as a missing checkpoint always was.

    Example:
        >>> import tempfile
        >>> try:
        ...     verify_dir(Path(tempfile.mkdtemp()) / "nothing")
        ... except CheckpointNotFound as e:
        ...     print(str(e).split(": ", 1)[1])
        no checkpoint directory there
    """


class CheckpointDiskFull(CheckpointError):
    """A save that did not fit: how much it needed, where, and how much was free.

    Example:
        >>> str(CheckpointDiskFull("disk full: 12.0 MiB needed at /ckpt, 3.0 MiB free"))
        'disk full: 12.0 MiB needed at /ckpt, 3.0 MiB free'
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


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _free(where: Path) -> int | None:
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def _os_error(e: OSError, doing: str, where: Path, need: int | None = None) -> CheckpointError:
    """``e`` said in words: what was being done, where, and (for a full disk) how much."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free(where)
        needed = f"{_mib(need)} needed" if need is not None else "no room"
        left = "" if free is None else f", {_mib(free)} free"
        quota = " (over quota)" if e.errno == errno.EDQUOT else ""
        return CheckpointDiskFull(f"disk full{quota}: {needed} at {where}{left}, while {doing}")
    what = {
        errno.EACCES: "permission denied",
        errno.EPERM: "not permitted",
        errno.EROFS: "a read-only filesystem",
        errno.EIO: "an input/output error (a failing disk?)",
    }.get(e.errno or 0, e.strerror or type(e).__name__)
    if isinstance(e, FileNotFoundError) and doing.startswith("reading"):
        return CheckpointNotFound(f"{where}: {doing}: {what}")
    return CheckpointError(f"{where}: {doing}: {what}")


# -- the filesystem steps of a save, one function each (the crash tests stop a save at each) --


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:  # pragma: no cover - a libc that cannot be opened
        return None


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the system or the filesystem cannot (then :func:`_swap_in` uses two renames)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


# -- debris a crashed save leaves, and what a load finds among it -----------------------------

_DEBRIS = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-[0-9a-f]{12}")
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _debris(dest: Path) -> list[Path]:
    """The temporaries earlier saves to ``dest`` left beside it (a crash's, or a kill's)."""
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return []
    out = []
    for e in entries:
        m = _DEBRIS.fullmatch(e.name)
        if m and m.group("name") == dest.name:
            out.append(dest.parent / e.name)
    return sorted(out)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        _rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _candidates(dest: Path) -> list[Path]:
    """Complete-looking checkpoints a crashed save left beside a missing ``dest``, newest first.

    Only where ``dest`` itself is gone: a save interrupted between the two renames of a swap
    (on a filesystem without an exchange, or by posttrain before it had one) left the previous
    checkpoint as ``.<name>.old-*`` and the new one as ``.<name>.tmp-*``; either is whole."""
    found = []
    for d in _debris(dest):
        m = d / MANIFEST
        try:
            if d.is_dir() and not d.is_symlink() and m.is_file():
                found.append((m.stat().st_mtime_ns, d.name, d))
        except OSError:
            continue
    return [d for _, _, d in sorted(found, reverse=True)]


def resolve(path: str | os.PathLike[str]) -> Path:
    """The directory a load of ``path`` reads: ``path`` itself, or, where a crash left no
    directory there, the newest whole checkpoint the interrupted save left beside it.

    Raises :class:`CheckpointNotFound` when there is neither, :class:`CheckpointError` when
    ``path`` is something other than a directory.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "ckpt"
        >>> save_state(d, "x.pt", {})
        >>> resolve(d) == d
        True
    """
    root = Path(path)
    if root.is_dir():
        return root
    if root.exists() or root.is_symlink():
        raise CheckpointError(f"{root}: not a directory (a checkpoint is one)")
    problems = []
    for c in _candidates(root):
        try:
            _verify(c)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        return c
    left = f" (a crashed save left {len(problems)} broken: {'; '.join(problems)})"
    raise CheckpointNotFound(f"{root}: no checkpoint directory there" + left * bool(problems))


def _lock_for(dest: Path) -> threading.Lock:
    key = os.path.abspath(dest)
    with _LOCKS_LOCK:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.Lock()
        return lock


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a checkpoint directory at ``path`` whole, or leave what was there untouched.

    Yields an empty temporary directory beside ``path``; write the checkpoint's files into it.
    On a clean exit the manifest is added, everything is fsynced and the directory takes the
    place of ``path`` in one step; on an exception the temporary directory is removed and
    ``path`` is as before. ``path`` must be new, empty or an earlier checkpoint: a directory
    of other files is refused (:class:`CheckpointError`) rather than replaced. Temporaries an
    interrupted save left beside ``path`` are removed (one that may be the only whole copy,
    where ``path`` is gone, once the new checkpoint is in place). Saves to one path from
    several threads of a process take turns; from several processes at once they are not
    supported. An ``OSError`` on the way (a full disk, no permission) is raised as a
    :class:`CheckpointError` saying so (:class:`CheckpointDiskFull` for a full disk).

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
    with _lock_for(dest):
        try:
            tmp = _begin(dest)
        except OSError as e:
            raise _os_error(e, "preparing the save", dest.parent) from e
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
        except BaseException as e:
            _rmtree(tmp)
            if isinstance(e, OSError):
                raise _os_error(e, f"writing the checkpoint {dest.name}", dest.parent) from e
            raise
        for d in _debris(dest):  # what earlier interrupted saves left: not needed any more
            with contextlib.suppress(OSError):  # the save is done; the next one tries again
                _remove(d)


def _begin(dest: Path) -> Path:
    """Check ``dest`` may be replaced, clear what earlier crashes left, make the temporary."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise CheckpointError(f"{dest}: exists and is not a directory; refusing to replace it")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MANIFEST).is_file():
        # The whole directory is replaced: never delete files a checkpoint did not write.
        raise CheckpointError(
            f"{dest}: holds files that are not a posttrain checkpoint (no {MANIFEST}); "
            "refusing to replace them: give a new or empty directory"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    # With ``dest`` in place every temporary is debris; without it, one may be the only whole
    # copy (a swap interrupted between its renames): those wait until the new one is in.
    keep = set() if dest.is_dir() else set(_candidates(dest))
    for d in _debris(dest):
        if d not in keep:
            _remove(d)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def _write_manifest(root: Path, files: dict[str, Path]) -> None:
    manifest = {
        "format": _FORMAT,
        "files": {
            name: {"size": p.stat().st_size, "sha256": _digest(p)} for name, p in files.items()
        },
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _read_manifest(mfile: Path) -> Any:
    """The parsed manifest, or :class:`CheckpointError` saying why not."""
    try:
        text = mfile.read_bytes()
    except OSError as e:
        raise _os_error(e, f"reading {MANIFEST}", mfile.parent) from e
    try:
        return json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{mfile}: not valid JSON (not UTF-8: {e.reason})") from e
    except RecursionError as e:
        raise CheckpointError(f"{mfile}: not valid JSON (nested too deeply to read)") from e
    except ValueError as e:  # JSONDecodeError, or a number too long to convert
        raise CheckpointError(f"{mfile}: not valid JSON ({e})") from e


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
        manifest = _read_manifest(root / MANIFEST)
    except CheckpointError:
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return False
    _write_manifest(root, {n: p for n, p in _files(root).items() if n != MANIFEST})
    return True


def _swap_in(tmp: Path, dest: Path) -> None:
    """Put the whole directory ``tmp`` at ``dest``: at every instant ``dest`` holds the old
    checkpoint or the new one.

    Into a missing or empty ``dest``, one rename. Over an earlier checkpoint, one exchange of
    the two directories, after which the old one is removed from where the new one was. Where
    the filesystem has no exchange (not Linux, or NFS), the old one is renamed aside first:
    a crash between the two renames leaves no directory at ``dest``, and :func:`resolve`
    reads the new one (or, had it not been complete, the old one) from beside it.
    """
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        _rename(tmp, dest)  # over an empty directory, rename(2) replaces it in one step
        _fsync(dest.parent)
        return
    if _exchange(tmp, dest):
        _fsync(dest.parent)
        _rmtree(tmp)  # now the old checkpoint
        return
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:12]}"
    _rename(dest, old)
    try:
        _rename(tmp, dest)
    except BaseException:
        _rename(old, dest)
        raise
    _fsync(dest.parent)
    _rmtree(old)


def verify_dir(path: str | os.PathLike[str]) -> dict[str, int]:
    """Check every file of the checkpoint at ``path`` against its manifest; sizes by name.

    Raises :class:`CheckpointError` naming the first file that is missing, extra, of another
    size or another SHA-256, and for a missing or malformed manifest;
    :class:`CheckpointNotFound` (a ``FileNotFoundError`` too) when there is no checkpoint
    directory at ``path``. Where a crash left none there, the one :func:`resolve` finds beside
    it is checked.

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
    return _verify(resolve(path))


def _verify(root: Path) -> dict[str, int]:
    mfile = root / MANIFEST
    if not mfile.is_file():
        raise CheckpointError(
            f"{root}: no {MANIFEST} (not a posttrain checkpoint, or one whose write did not finish)"
        )
    manifest: Any = _read_manifest(mfile)
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
    try:
        present = {n: p for n, p in _files(root).items() if n != MANIFEST}
        for name in sorted(set(listed) | set(present)):
            where = f"{root}: {name}"
            if name not in present:
                raise CheckpointError(
                    f"{where}: listed in the manifest, missing from the directory"
                )
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
                    f"{where}: its SHA-256 differs from the manifest's (the file was altered "
                    "after it was written)"
                )
    except OSError as e:
        raise _os_error(e, "reading the checkpoint's files", root) from e
    return {name: int(listed[name]["size"]) for name in sorted(listed)}


def why_unsafe(error: BaseException) -> str:
    """What a ``torch.load(weights_only=True)`` refusal was about, in a few words.

    Example:
        >>> why_unsafe(Exception("Weights only load failed... Unsupported global: GLOBAL a.B was..."))
        'it holds an instance of a.B'
        >>> why_unsafe(EOFError())
        'EOFError (the file ends early: empty or cut short)'
    """
    what = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if what:
        return f"it holds an instance of {what.group(1)}"
    lines = str(error).strip().splitlines()
    if lines:
        return lines[0]
    if isinstance(error, EOFError):
        return "EOFError (the file ends early: empty or cut short)"
    return type(error).__name__


def load_verified(path: str | os.PathLike[str], name: str) -> Any:
    """The tensors and plain data in file ``name`` of the checkpoint directory ``path``.

    The manifest is verified before anything is read, and the file is read with
    ``torch.load(weights_only=True)``: a refusal or a corrupt archive is one ``CheckpointError``
    that says which (the reader's error chained). Where a crash left no directory at ``path``,
    the whole checkpoint :func:`resolve` finds beside it is read.

    Example:
        >>> import tempfile, torch
        >>> d = Path(tempfile.mkdtemp()) / "ckpt"
        >>> with atomic_dir(d) as tmp:
        ...     torch.save({"x": torch.ones(2)}, tmp / "state.pt")
        >>> load_verified(d, "state.pt")["x"].tolist()
        [1.0, 1.0]
    """
    import torch

    root = resolve(path)
    files = _verify(root)
    if name not in files:
        raise CheckpointError(f"{path}: no {name} in this checkpoint: {sorted(files)}")
    try:
        return torch.load(root / name, weights_only=True)
    except OSError as e:
        raise _os_error(e, f"reading {name}", root) from e
    except Exception as e:  # an unpickler refusal or a corrupt archive, said as one error
        raise CheckpointError(
            f"{path}: {name} could not be read as tensors and plain data: " + why_unsafe(e)
        ) from e


def _nbytes(state: Any) -> int:
    """The bytes ``torch.save`` writes for the tensors in ``state`` (each storage once)."""
    import torch

    seen: dict[tuple[str, int], int] = {}

    def walk(x: Any, depth: int) -> None:
        if depth > 64:
            return
        if isinstance(x, torch.Tensor):
            try:
                st = x.untyped_storage()
                seen[(str(x.device), st.data_ptr())] = st.nbytes()
            except (RuntimeError, NotImplementedError):
                seen[(str(x.device), id(x))] = x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v, depth + 1)
        else:
            items = getattr(x, "items", None)  # a TensorDict: its leaves
            if callable(items) and hasattr(x, "batch_size"):
                for _, v in items(include_nested=True, leaves_only=True):
                    walk(v, depth + 1)

    walk(state, 0)
    return sum(seen.values())


class _Recording(io.FileIO):
    """A file that keeps the ``OSError`` a write raised: ``torch.save`` reports it only as
    ``RuntimeError: [enforce fail ...] unexpected pos``."""

    error: OSError | None = None

    def write(self, b: Any, /) -> int:
        try:
            return super().write(b)
        except OSError as e:
            self.error = e
            raise


def save_state(path: str | os.PathLike[str], name: str, state: Any) -> None:
    """Write ``state`` as file ``name`` of a new checkpoint directory ``path``, atomically.

    What :func:`load_verified` reads back: ``torch.save`` into a fresh directory, sealed by a
    manifest and swapped in whole (an earlier checkpoint at ``path`` is replaced). A state
    larger than the free space is refused before anything is written
    (:class:`CheckpointDiskFull`: how much it needs, where, how much is free), and so is one
    the disk runs out during.

    Example:
        >>> import tempfile, torch
        >>> d = Path(tempfile.mkdtemp()) / "ckpt"
        >>> save_state(d, "state.pt", {"x": torch.zeros(1)})
        >>> load_verified(d, "state.pt")["x"].tolist()
        [0.0]
    """
    import torch

    need = _nbytes(state) + _MARGIN
    with atomic_dir(path) as tmp:
        free = _free(tmp)
        if free is not None and free < need:
            raise CheckpointDiskFull(
                f"disk full: {_mib(need)} needed at {tmp.parent}, {_mib(free)} free "
                f"(nothing written; {Path(path).name} is as it was)"
            )
        f = _Recording(tmp / name, "wb")
        try:
            with f:
                torch.save(state, f)
        except RuntimeError:
            if f.error is None:
                raise
            raise _os_error(f.error, f"writing {name}", tmp.parent, need) from f.error
        except OSError as e:
            raise _os_error(e, f"writing {name}", tmp.parent, need) from e
