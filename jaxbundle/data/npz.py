"""``npz:PATH``: arrays ``x`` (``[N, H, W, C]``, or ``[N, H, W]`` for one channel; uint8, or
floats in [0, 1]) and ``y`` (integer labels ``[N]``) in a NumPy ``.npz`` file.

An uncompressed file (``np.savez``) is memory-mapped, so a batch reads only its own rows; a
compressed one (``np.savez_compressed``) cannot be and is read into memory whole.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Any

import numpy as np

__all__ = ["NpzSource"]

_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


def _memmap_member(path: str, member: str) -> np.ndarray | None:
    """The ``.npy`` member as a read-only memmap, or None when it is compressed."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(_LOCAL_HEADER)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        f.seek(info.header_offset + _LOCAL_HEADER + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if dtype.hasobject:
        raise ValueError(f"{path}: {member} holds Python objects, not numbers")
    return np.memmap(path, dtype, "r", offset, shape, "F" if fortran else "C")


class NpzSource:
    """Images and labels from ``path`` (see the module docstring)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"npz data file {path!r} does not exist")
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path} is not a readable .npz file (not a zip archive)")
        try:
            with np.load(path) as npz:
                missing = [k for k in ("x", "y") if k not in npz.files]
                if missing:
                    raise ValueError(
                        f"{path} must hold arrays 'x' (images) and 'y' (labels); it has "
                        f"{sorted(npz.files)}"
                    )
                y = np.asarray(npz["y"])
                x = _memmap_member(path, "x.npy")
                if x is None:
                    x = npz["x"]
        except (zipfile.BadZipFile, OSError) as err:
            raise ValueError(f"{path} is not a readable .npz file ({err})") from None
        if x.ndim == 3:
            x = x[..., None]
        if x.ndim != 4:
            raise ValueError(f"{path}: x must be [N, H, W, C] images, got shape {x.shape}")
        if not (x.dtype == np.uint8 or np.issubdtype(x.dtype, np.floating)):
            raise ValueError(f"{path}: x must be uint8 or floats in [0, 1], got dtype {x.dtype}")
        if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(
                f"{path}: y must be [{x.shape[0]}] integer labels, got shape {y.shape} "
                f"dtype {y.dtype}"
            )
        self.path, self.x, self.y = os.path.abspath(path), x, y
        self.name = f"npz:{os.path.basename(path)}"
        self.num_classes = None
        self.shape, self.dtype = tuple(x.shape[1:]), x.dtype

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.x[start:stop]), self.y[start:stop]

    def describe(self) -> dict[str, Any]:
        stat = os.stat(self.path)
        return {
            "source": "npz", "path": self.path, "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
