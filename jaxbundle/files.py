"""Crash-safe file writes: a reader sees the old file or the new one, never a partial one."""

from __future__ import annotations

import io
import os
import tempfile

import numpy as np

__all__ = ["atomic_write", "save_npz"]


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a synced temporary file in the same directory and an
    atomic rename; the temporary file is removed if anything fails."""
    directory = os.path.dirname(os.fspath(path)) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """``np.savez`` (uncompressed), written atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write(path, buffer.getvalue())
