"""Crash-safe file writes: a reader sees the old file or the new one, never a partial one; and
an exclusive lock for work that several processes must not do twice."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import BinaryIO, Callable, Iterator

import numpy as np

__all__ = ["atomic_write", "exclusive", "save_npz"]


def _atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Calls ``write`` on a temporary file in ``path``'s directory, syncs it and renames it to
    ``path``; the temporary file is removed if anything fails."""
    directory = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically."""
    _atomic(path, lambda f: f.write(data))


def save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """``np.savez`` (uncompressed) straight into the file, atomically (no copy in memory)."""
    _atomic(path, lambda f: np.savez(f, **arrays))


@contextlib.contextmanager
def exclusive(path: str | os.PathLike) -> Iterator[None]:
    """Holds an exclusive advisory lock on ``path`` (created if missing) while the block runs:
    a second process entering the block for the same path waits until the first leaves it.
    Where the platform has no ``fcntl`` (Windows) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
