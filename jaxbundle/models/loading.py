"""Bring your own model: load it from ``MODULE:FUNCTION`` and check what it computes.

A model spec is ``MODULE:FUNCTION`` or ``NAME=MODULE:FUNCTION``. MODULE is a dotted module name
importable from the current directory or ``sys.path`` (as with ``python -m``), or the path of a
``.py`` file (anything ending in ``.py`` or containing a path separator). ``FUNCTION()`` takes no
arguments and returns the model in one of four styles (:mod:`jaxbundle.run.adapters`): ``(apply_fn,
params)`` with ``apply_fn(params, x) -> logits``, ``(linen_module, variables)``, a flax NNX
module or an Equinox module, each mapping ``x`` float32 ``[B, H, W, C]`` in ``[0, 1]`` to logits
``[B, K]``. NAME defaults to FUNCTION.

Example::

    from jaxbundle import models

    name, apply_fn, params = models.load_model("cnn=examples/linen_model.py:model")
    num_classes = models.check_model(apply_fn, params, x[:8], num_classes=10, name=name)

Every mistake in a spec or a model is reported as one line (``ValueError``, or
``FileNotFoundError`` for a missing file) that names the model; the original exception, if any,
is chained.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import itertools
import os
import pathlib
import re
import sys
import types
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.run import adapters
from jaxbundle.core import sampling
from jaxbundle.run.adapters import describe_value as _describe
from jaxbundle.models.architectures import ApplyFn, Params
from jaxbundle.core.sampling import is_stochastic

__all__ = ["LoadedModel", "ModelSpec", "check_model", "load_model", "parse_spec"]

_FORM = "expected MODULE:FUNCTION or NAME=MODULE:FUNCTION"
_file_ids = itertools.count()


class ModelSpec(NamedTuple):
    """A parsed model spec.

    Attributes:
      name: the model's name in reports.
      module: a dotted module name or the path of a ``.py`` file.
      function: the name of the function in ``module`` that returns the model.
    """

    name: str
    module: str
    function: str


class LoadedModel(NamedTuple):
    """A user's model, ready to evaluate.

    Attributes:
      name: the model's name in reports.
      apply_fn: ``apply_fn(params, x) -> logits``.
      params: what ``apply_fn`` takes as its first argument (any pytree).
    """

    name: str
    apply_fn: ApplyFn
    params: Params


def parse_spec(spec: str) -> ModelSpec:
    """Parses ``MODULE:FUNCTION`` or ``NAME=MODULE:FUNCTION``; NAME defaults to FUNCTION.

    Raises:
      ValueError: ``spec`` is not of that form.
    """
    text = spec.strip()
    name, sep, rest = text.partition("=")
    if not sep or any(c in name for c in ":/\\"):  # an '=' inside MODULE is not a NAME
        name, rest = "", text
    elif not name.strip():
        raise ValueError(f"empty NAME in model spec {spec!r}; {_FORM}")
    module, colon, function = rest.rpartition(":")  # rpartition: C:\... paths keep their ':'
    module, function = module.strip(), function.strip()
    if not colon:
        raise ValueError(f"{_FORM}, got {spec!r}")
    if not module or not function:
        raise ValueError(f"{_FORM}, got {spec!r} (empty {'MODULE' if not module else 'FUNCTION'})")
    if not function.isidentifier():
        raise ValueError(f"{_FORM}, got {spec!r} (FUNCTION {function!r} is not a Python name)")
    if not _is_path(module) and not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(
            f"{_FORM}, got {spec!r} (MODULE {module!r} is neither a dotted module name nor a path "
            "to a .py file)"
        )
    return ModelSpec(name.strip() or function, module, function)


def load_model(spec: str | ModelSpec) -> LoadedModel:
    """Imports a user's model and calls its function.

    Args:
      spec: ``MODULE:FUNCTION``, ``NAME=MODULE:FUNCTION`` (see :func:`parse_spec`) or a
        :class:`ModelSpec`.

    Returns:
      ``(name, apply_fn, params)``: what ``FUNCTION()`` returned, a module adapted by
      :func:`jaxbundle.run.adapters.as_apply_fn` (``apply_fn`` is only checked to be callable;
      :func:`check_model` checks what it computes).

    Raises:
      FileNotFoundError: MODULE is a path and there is no such file.
      ValueError: any other problem: the spec, a module that is missing or fails to import, a
        missing function, ``FUNCTION()`` raising or returning none of
        :data:`jaxbundle.run.adapters.STYLES`, a module in training mode.
    """
    if isinstance(spec, str):
        spec = parse_spec(spec)
    where = f"model {spec.name!r} ({spec.module}:{spec.function})"
    if _is_path(spec.module):
        path = pathlib.Path(spec.module).expanduser().absolute()
        search_dir = path.parent  # as `python path/to/file.py` does: its siblings import
    else:
        path, search_dir = None, pathlib.Path.cwd()  # as `python -m` does

    with _on_sys_path(search_dir):
        module = _import_file(path, where) if path else _import_dotted(spec.module, where)
        fn = _function(module, spec, where)
        try:
            result = fn()
        except Exception as e:
            raise ValueError(f"{where}: {spec.function}() raised {_one_line(e)}") from e

    return LoadedModel(spec.name, *_as_apply_fn(result, spec, where))


def _as_apply_fn(result: Any, spec: ModelSpec, where: str) -> tuple[ApplyFn, Params]:
    """``FUNCTION()``'s ``result``, of any of the four styles, as ``(apply_fn, params)``
    (:func:`jaxbundle.run.adapters.as_apply_fn`, which also refuses a module given with params)."""
    modular = (adapters.is_nnx_module(result) or adapters.is_equinox_module(result)
               or adapters.is_linen_module(result))
    pair = not modular and isinstance(result, (tuple, list)) and len(result) == 2
    if not pair and not modular:
        raise ValueError(
            f"{where}: {spec.function}() must return {adapters.STYLES}, got {_describe(result)}"
        )
    model, params = result if pair else (result, None)
    if not modular and not callable(model):
        swapped = " (the order is (apply_fn, params))" if callable(params) else ""
        raise ValueError(
            f"{where}: {spec.function}() must return (apply_fn, params) with apply_fn callable, "
            f"got {_describe(model)} as apply_fn{swapped}"
        )
    return adapters.as_apply_fn(model, params, name=spec.name,
                                origin=f"{spec.module}:{spec.function}")


def check_model(
    apply_fn: ApplyFn,
    params: Params,
    x: Any,
    num_classes: int | None = None,
    name: str = "model",
) -> int:
    """Runs a model twice on a small batch and checks its logits.

    The model runs under ``jax.jit``, as evaluation runs it, twice in the same way: each run
    traces and compiles it afresh, so randomness drawn in Python (a counter, ``np.random``) is
    drawn again, while a deterministic model runs the same compiled program twice. The two
    logits must agree to float rounding (1e-6 of the largest logit), and so must those of the
    batch in reverse order (a model not declared stochastic): a model that draws noise for the
    whole batch from a key it holds gives an image other noise at another position, so that
    the attacks, the judge and certification (one image at a time) would each see another
    model.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits``.
      params: the model's parameters.
      x: a few sample images, float32 ``[B, H, W, C]`` in ``[0, 1]``.
      num_classes: the number of classes of the data, if known.
      name: the model's name in error messages.

    Returns:
      The number of classes ``K`` (logits per image).

    Raises:
      ValueError: ``apply_fn`` is not callable or fails on ``x`` under ``jax.jit``; the logits
        are not a finite floating ``[B, K]`` array with ``K >= 2`` (and ``K == num_classes`` if
        given); or two runs give different logits (a stochastic model); or an image's
        logits depend on where it sits in the batch (a model drawing noise from a key it
        holds).
    """
    where = f"model {name!r}"
    if not callable(apply_fn):
        raise ValueError(f"{where}: apply_fn is not callable (got {_describe(apply_fn)})")
    x = jnp.asarray(np.asarray(x, np.float32))
    batch = x.shape[0]
    declared = is_stochastic(apply_fn)
    apply_fn = sampling.fixed(apply_fn)  # a declared stochastic model: one fixed key per image
    expected = f"[{batch}, {num_classes if num_classes is not None else 'K'}]"
    logits = _jitted_run(apply_fn, params, x, where, expected)
    logits = _checked_logits(logits, batch, num_classes, where, expected)
    _check_repeatable(logits, _jitted_run(apply_fn, params, x, where, expected), declared, where)
    if not declared:  # each image's logits its own, wherever it sits in the batch
        reordered = _jitted_run(apply_fn, params, x[::-1], where, expected)[::-1]
        _check_row_independent(logits, reordered, where)
    return int(logits.shape[1])


def _jitted_run(apply_fn: ApplyFn, params: Params, x: jax.Array, where: str,
                expected: str) -> np.ndarray:
    """``apply_fn(params, x)`` under a fresh ``jax.jit`` trace, as a numpy array."""
    try:
        out = jax.jit(lambda p, images: apply_fn(p, images))(params, x)  # a fresh trace
    except adapters.ModelStyleError:  # one line naming the model already
        raise
    except Exception as e:
        raise ValueError(
            f"{where} fails under jax.jit on images of shape {list(x.shape)} float32: "
            f"{_one_line(e)}"
        ) from e
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise ValueError(f"{where} returned {_describe(out)}, expected logits {expected}")
    return np.asarray(out)


def _checked_logits(logits: np.ndarray, batch: int, num_classes: int | None, where: str,
                    expected: str) -> np.ndarray:
    """The first run's logits as float64 once they are a finite floating ``[batch, K]`` array
    with ``K >= 2`` (and ``K == num_classes`` if given), else ``ValueError``."""
    if logits.ndim != 2 or logits.shape[0] != batch:
        raise ValueError(
            f"{where} gives logits of shape {list(logits.shape)} for {batch} images, "
            f"expected {expected}"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"{where} gives logits of dtype {logits.dtype}, expected a floating dtype")
    logits = logits.astype(np.float64)
    k = logits.shape[1]
    if num_classes is not None and k != num_classes:
        raise ValueError(f"{where} has {k} outputs but the data has {num_classes} classes")
    if k < 2:
        raise ValueError(
            f"{where} gives logits of shape {list(logits.shape)}, expected [{batch}, K] with "
            "K >= 2 (a binary classifier with one logit z can return [0, z])"
        )
    finite = np.isfinite(logits).all(axis=1)
    if not finite.all():
        raise ValueError(
            f"{where} gives non-finite logits (NaN or inf) for {int((~finite).sum())} of {batch} "
            "sample images"
        )
    return logits


def _check_repeatable(logits: np.ndarray, again: np.ndarray, declared: bool, where: str) -> None:
    """``ValueError`` unless the second run's logits ``again`` agree with the first ones to float
    rounding (1e-6 of the largest logit)."""
    comparable = again.shape == logits.shape and jnp.issubdtype(again.dtype, jnp.floating)
    again = again.astype(np.float64) if comparable else again
    tol = 1e-6 * max(float(np.max(np.abs(logits))), 1.0)  # float rounding only, no real noise
    if not comparable or not np.allclose(again, logits, rtol=1e-6, atol=tol):
        diff = float(np.max(np.abs(again - logits))) if comparable else float("inf")
        if declared:
            raise ValueError(
                f"{where} is declared stochastic but two calls with the same keys gave different "
                f"logits (largest difference {diff:.3g}): it must draw all its randomness from "
                "its key argument (no np.random, no Python counters)"
            )
        raise ValueError(
            f"{where} looks stochastic: two calls on the same images gave different logits "
            f"(largest difference {diff:.3g}); it is random at test time (dropout left on, noise, "
            "random transforms?). Declare it: return (jaxbundle.stochastic(fn), params) with "
            "fn(params, x, key) drawing all its randomness from key (then use --eot), or make it "
            "deterministic (e.g. deterministic=True for dropout)"
        )


def _check_row_independent(logits: np.ndarray, reordered: np.ndarray, where: str) -> None:
    """``ValueError`` unless the logits of the batch in reverse order, put back in order, agree
    with the first run's to float rounding (1e-6 of the largest logit)."""
    reordered = np.asarray(reordered, np.float64)
    tol = 1e-6 * max(float(np.max(np.abs(logits))), 1.0)
    if reordered.shape != logits.shape or not np.allclose(reordered, logits, rtol=1e-6,
                                                          atol=tol):
        diff = float(np.max(np.abs(reordered - logits))) if reordered.shape == logits.shape \
            else float("inf")
        raise ValueError(
            f"{where} gives an image other logits at another position in the batch (largest "
            f"difference {diff:.3g}): each image's logits must depend on that image alone "
            "(noise drawn from a PRNG key the model holds, BatchNorm in training mode?). "
            "Declare randomness: return (jaxbundle.stochastic(fn), params) with fn(params, x, "
            "key) drawing it from key, or make the model deterministic"
        )


# ----------------------------------------------------------------------------- helpers


def _is_path(module: str) -> bool:
    """Whether MODULE names a file rather than a dotted module."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return module.endswith(".py") or any(s in module for s in seps)


@contextlib.contextmanager
def _on_sys_path(directory: pathlib.Path) -> Iterator[None]:
    """Puts ``directory`` first on ``sys.path`` (unless there already) for the duration."""
    entry = str(directory)
    present = entry in sys.path or (directory == pathlib.Path.cwd() and "" in sys.path)
    if not present:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if not present and entry in sys.path:
            sys.path.remove(entry)


def _import_dotted(module: str, where: str) -> types.ModuleType:
    importlib.invalidate_caches()  # the module may have been written after the last import
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module == missing or module.startswith(missing + "."):
            detail = "" if missing == module else f" (needed for {module!r})"
            raise ValueError(
                f"{where}: no module named {missing!r}{detail} in the current directory or "
                "sys.path (to load a file, give its path ending in .py)"
            ) from e
        raise ValueError(f"{where}: module {module!r} failed to import: {_one_line(e)}") from e
    except Exception as e:
        raise ValueError(f"{where}: module {module!r} failed to import: {_one_line(e)}") from e


def _import_file(path: pathlib.Path, where: str) -> types.ModuleType:
    if not path.exists():
        raise FileNotFoundError(f"{where}: no such file: {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{where}: not a file: {path}")
    # A unique name per load: two files called model.py never collide, and flax modules
    # (dataclasses) defined in the file find their module in sys.modules.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_jaxbundle_user_{next(_file_ids)}_{stem}"
    loader = importlib.machinery.SourceFileLoader(name, str(path))  # any suffix, not just .py
    module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert module_spec is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{where}: {path} failed to import: {_one_line(e)}") from e
    return module


def _function(module: types.ModuleType, spec: ModelSpec, where: str) -> Any:
    """``module.<spec.function>``, with the module's functions listed if it is missing."""
    fn = getattr(module, spec.function, None)
    if fn is None:
        own = [
            n
            for n, v in vars(module).items()
            if not n.startswith("_")
            and callable(v)
            and getattr(v, "__module__", None) == module.__name__
        ]
        listed = ", ".join(own[:8]) + (", ..." if len(own) > 8 else "")
        has = f"it defines {listed}" if own else "it defines no functions"
        raise ValueError(f"{where}: module has no function {spec.function!r}; {has}")
    if not callable(fn):
        raise ValueError(
            f"{where}: {spec.function!r} is {_describe(fn)}, not a function returning "
            "the model"
        )
    return fn


def _one_line(e: BaseException) -> str:
    """``"TypeError: first line of the message"`` (the full error stays chained)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
