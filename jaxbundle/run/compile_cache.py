"""JAX's persistent compilation cache for a run: programs compiled once are read back by every
later process with the same shapes, code, compiler options and JAX version.

``jaxbundle evaluate`` and :func:`jaxbundle.evaluate` use one by default, in the cache
directory of the demo weights: ``$JAXBUNDLE_CACHE/xla`` (default ``~/.cache/jaxbundle/xla``).
:func:`directory` says which one a run uses: the one asked for, or for ``"auto"``
``$JAXBUNDLE_COMPILE_CACHE`` if set (``off``: none), none where JAX already has a cache
directory configured (the user's own, or the CLI's: left as it is), else the default.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Iterator

import jax

__all__ = ["cache_root", "compilation_cache", "directory"]

_NAMES = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")


def cache_root() -> pathlib.Path:
    """``$JAXBUNDLE_CACHE`` if set, else ``~/.cache/jaxbundle``: the demo weights' cache and,
    in ``xla/``, the compiled programs'."""
    env = os.environ.get("JAXBUNDLE_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "jaxbundle"


def directory(choice: str | os.PathLike | None) -> str | None:
    """The compilation cache a run uses for ``choice`` (see the module docstring); None: JAX's
    configuration is left as it is."""
    if choice is None:
        return None
    if os.fspath(choice) != "auto":
        return os.fspath(choice)
    env = os.environ.get("JAXBUNDLE_COMPILE_CACHE")
    if env:
        return None if env.strip().lower() == "off" else env
    if jax.config.jax_compilation_cache_dir:
        return None
    return os.fspath(cache_root() / "xla")


@contextlib.contextmanager
def compilation_cache(path: str | os.PathLike | None) -> Iterator[None]:
    """JAX's persistent compilation cache in ``path`` while the block runs (``None``: no
    change), every program written however fast it compiled. The previous settings are
    restored afterwards, so a run inside another program (a test, a notebook) leaves its JAX
    configuration as it was."""
    settings = (None if path is None else os.fspath(path), 0.0, 0)
    if path is None or tuple(getattr(jax.config, name) for name in _NAMES) == settings:
        yield  # nothing to change (the CLI's cache, entered again by jaxbundle.evaluate)
        return
    from jax._src import compilation_cache as cache_lib

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    previous = {name: getattr(jax.config, name) for name in _NAMES}
    for name, value in zip(_NAMES, (path, 0.0, 0)):
        jax.config.update(name, value)
    cache_lib.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        cache_lib.reset_cache()
