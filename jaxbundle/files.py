"""Crash-safe file writes: a reader sees the old file or the new one, never a partial one."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable

import numpy as np

__all__ = ["atomic_write", "save_npz"]


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
