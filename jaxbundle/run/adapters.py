"""Models as people write them, adapted at the edge to ``apply_fn(params, x) -> logits``.

The library runs one protocol: ``apply_fn(params, x) -> logits`` for images ``x`` float32
``[B, H, W, C]`` in ``[0, 1]``, with ``params`` a jit argument (never a compiled-in constant).
:func:`as_apply_fn` turns each of the four styles a model is written in into it, once, where the
model enters the library (``jaxbundle.evaluate``, ``jaxbundle.models.load_model``):

* ``(apply_fn, params)``: as it is;
* a flax linen module with its variables, ``(module, variables)``: ``module.apply(variables,
  x)`` with nothing mutable (``batch_stats`` are read, never updated);
* a flax NNX module: ``nnx.split`` into its graph (static) and its state (the params); the
  adapted ``apply_fn`` merges them and calls the module;
* an Equinox module: ``eqx.partition(model, eqx.is_array)``: its arrays are the params, the
  rest is static; the adapted ``apply_fn`` combines them and calls the model.

A module maps a batch ``[B, H, W, C]`` to logits ``[B, K]`` (an Equinox model written for one
image is wrapped with ``jax.vmap`` by its author). A module in training mode (dropout on,
BatchNorm on batch statistics, randomness drawn at call time) is refused with one line naming
the model and the cure: layers are inspected where the framework shows them (NNX, Equinox),
and the framework's own error on the first trace is translated otherwise (linen), the original
chained.

Example::

    from jaxbundle.run.adapters import as_apply_fn

    net.eval()                              # a flax NNX module, in inference mode
    apply_fn, params = as_apply_fn(net)     # params: its nnx.State
    logits = jax.jit(apply_fn)(params, x)

Neither flax nor Equinox is imported here: a module is recognised through the frameworks the
program already imported (``sys.modules``), so a program without Equinox never loads it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable

import jax

from jaxbundle.core import sampling

__all__ = ["STYLES", "AdaptedModel", "ModelStyleError", "as_apply_fn", "describe_value",
           "is_equinox_module", "is_linen_module", "is_nnx_module"]

STYLES = ("(apply_fn, params), (linen_module, variables), an NNX module or an Equinox module")


class ModelStyleError(ValueError):
    """A model jaxbundle cannot evaluate as given (a module in training mode, a linen module
    without its variables): one line naming the model and the cure."""


class AdaptedModel:
    """``apply_fn(params, x) -> logits`` of a module: ``call(static, params, x, where)``.

    Hashed by identity (one adaptation, one compiled program per shape) and described in a
    checkpoint's identity by its class alone: the static part's repr holds object addresses,
    and the params' digest already tells models apart.

    Attributes:
      style: ``"linen"``, ``"nnx"`` or ``"equinox"``.
      static: what is not a jit argument: the linen module, the NNX graph (and its unused rng
        state), the Equinox model's non-array part.
      where: the model's name in error messages, e.g. ``"model 'cnn'"``.
    """

    def __init__(self, style: str, static: Any, call: Callable[..., Any], where: str):
        self.style, self.static, self.where, self._call = style, static, where, call

    def __call__(self, params: Any, x: jax.Array) -> jax.Array:
        return self._call(self.static, params, x, self.where)

    def __repr__(self) -> str:
        return f"AdaptedModel({self.style}, {self.where})"


def _instance(obj: Any, module: str, cls: str) -> bool:
    framework = sys.modules.get(module)  # not imported: obj cannot be one of its classes
    kind = getattr(framework, cls, None) if framework is not None else None
    return isinstance(kind, type) and isinstance(obj, kind)


def is_linen_module(obj: Any) -> bool:
    """Whether ``obj`` is a flax linen module (without importing flax)."""
    return _instance(obj, "flax.linen", "Module")


def is_nnx_module(obj: Any) -> bool:
    """Whether ``obj`` is a flax NNX module (without importing flax)."""
    return _instance(obj, "flax.nnx", "Module")


def is_equinox_module(obj: Any) -> bool:
    """Whether ``obj`` is an Equinox module (without importing Equinox)."""
    return _instance(obj, "equinox", "Module")


def as_apply_fn(model: Any, params: Any = None, *, name: str | None = None,
                origin: str | None = None) -> tuple[Callable[[Any, jax.Array], jax.Array], Any]:
    """``(apply_fn, params)`` with ``apply_fn(params, x) -> logits`` for a model of any style.

    Args:
      model: an ``apply_fn(params, x)`` (or a :func:`jaxbundle.stochastic` model), a flax
        linen module, a flax NNX module or an Equinox module.
      params: the apply_fn's params; a linen module's variables (``module.init``'s whole dict,
        ``batch_stats`` included); ``None`` for an NNX or Equinox module (they hold their own).
      name: the model's name in error messages (default: a module's class name).
      origin: where it came from (e.g. ``"MODULE:FUNCTION"``), also for error messages.

    Returns:
      ``(apply_fn, params)``: the model's own for the first style; else an
      :class:`AdaptedModel` and the module's arrays (a linen module's variables, an NNX
      module's ``nnx.State``, an Equinox module's array part): the very arrays of the module,
      passed to ``apply_fn`` as a jit argument.

    Raises:
      ModelStyleError: (a ``ValueError``) a module in training mode, a linen module without
        its variables, params given with an NNX or Equinox module, or a model of no known
        style. An error found only when the model first runs (a linen model asking for a
        dropout rng or a mutable ``batch_stats``) is raised then, as the same one line.
    """
    modular = is_nnx_module(model) or is_equinox_module(model) or is_linen_module(model)
    label = name if name is not None else type(model).__name__ if modular else "model"
    where = f"model {label!r}" + (f" ({origin})" if origin else "")
    if is_nnx_module(model):
        return _nnx(model, params, where)
    if is_equinox_module(model):
        return _equinox(model, params, where)
    if is_linen_module(model):
        return _linen(model, params, where)
    if sampling.is_stochastic(model) or callable(model):
        return model, params
    raise ModelStyleError(f"{where}: expected {STYLES}, got {describe_value(model)}")


def describe_value(obj: Any) -> str:
    """A short description of a value for an error message: 'None', 'a tuple of 3 items'."""
    if obj is None:
        return "None"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items"
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"an array of shape {list(obj.shape)} {obj.dtype}"
    kind = type(obj).__name__
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"


def _no_params(params: Any, kind: str, where: str) -> None:
    if params is not None:
        raise ModelStyleError(
            f"{where}: an {kind} module holds its own arrays: give the module alone (params "
            f"None), got {describe_value(params)} as params")


def _path(keys: Any) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in keys) or "the model"


# ----------------------------------------------------------------------------- linen


def _linen(module: Any, variables: Any, where: str) -> tuple[AdaptedModel, Any]:
    if variables is None or (isinstance(variables, Mapping) and not variables):
        raise ModelStyleError(
            f"{where}: a flax linen module needs its variables: return or pass (module, "
            "variables) or (module.apply, variables), variables as module.init returns them")
    if isinstance(variables, Mapping) and "params" not in variables:
        keys = ", ".join(repr(k) for k in list(variables)[:4])
        raise ModelStyleError(
            f"{where}: a linen module's variables are the whole dict module.init returns "
            f"({{'params': ..., 'batch_stats': ...}}), got a dict with keys {keys} (the "
            "'params' collection alone?)")
    return AdaptedModel("linen", module, _linen_call, where), variables


_INFERENCE = ("pass train=False / use_running_average=True / deterministic=True, e.g. "
              "(functools.partial(module.apply, train=False), variables) or a module built "
              "for inference")


def _linen_call(module: Any, variables: Any, x: jax.Array, where: str) -> jax.Array:
    from flax import errors  # loaded already: module is a flax module

    try:
        return module.apply(variables, x)  # mutable=False: nothing is updated
    except errors.ModifyScopeVariableError as e:
        raise ModelStyleError(
            f"{where} is in training mode: it updates its variables when called (BatchNorm "
            f"on batch statistics updating 'batch_stats'?); {_INFERENCE}") from e
    except errors.InvalidRngError as e:
        rng = str(e).split('"')[1] if str(e).count('"') >= 2 else "?"
        raise ModelStyleError(
            f"{where} is in training mode: it asks for a {rng!r} rng when called (Dropout "
            f"with deterministic=False?); {_INFERENCE}") from e
    except errors.ScopeCollectionNotFound as e:
        raise ModelStyleError(
            f"{where}: its variables lack a collection it reads ({_first_line(e)}); give the "
            "whole dict module.init returns, 'batch_stats' included") from e


# ----------------------------------------------------------------------------- NNX


def _nnx(model: Any, params: Any, where: str) -> tuple[AdaptedModel, Any]:
    from flax import nnx  # loaded already: model is an NNX module

    _no_params(params, "NNX", where)
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        layer = f"{type(node).__name__} at {_path(path)}"
        if getattr(node, "deterministic", None) is False:
            raise ModelStyleError(f"{where} is in training mode ({layer} is not deterministic): "
                                  "call model.eval() before giving it to jaxbundle")
        if getattr(node, "use_running_average", None) is False:
            raise ModelStyleError(
                f"{where} is in training mode ({layer} uses batch statistics, not its running "
                "averages): call model.eval() before giving it to jaxbundle")
    # The rng streams (used by nothing in inference mode) stay out of the params: keys are
    # no arrays to digest or shard.
    graph, rng_state, state = nnx.split(model, nnx.RngState, ...)
    return AdaptedModel("nnx", (graph, rng_state), _nnx_call, where), state


def _nnx_call(static: Any, state: Any, x: jax.Array, where: str) -> jax.Array:
    from flax import errors, nnx

    graph, rng_state = static
    module = nnx.merge(graph, rng_state, state)
    before = jax.tree_util.tree_flatten_with_path(nnx.state(module))[0]
    try:
        logits = module(x)
    except errors.TraceContextError as e:  # the rng streams are constants of the trace
        if "Rng" not in str(e):
            raise
        raise ModelStyleError(
            f"{where} draws random numbers from nnx.Rngs when called: call model.eval() (for "
            "Dropout); a model random on purpose is declared with jaxbundle.stochastic(fn), "
            "fn(params, x, key) drawing from key") from e
    after = jax.tree_util.tree_leaves(nnx.state(module))
    changed = [_path(p) for (p, a), b in zip(before, after) if a is not b]
    if changed or len(after) != len(before):
        what = ", ".join(changed[:3]) or "new variables"
        raise ModelStyleError(
            f"{where} changes its own state when called ({what}: BatchNorm in training "
            "mode?): call model.eval(); jaxbundle runs it as a pure function of its state")
    return logits


# ----------------------------------------------------------------------------- Equinox


def _equinox(model: Any, params: Any, where: str) -> tuple[AdaptedModel, Any]:
    import equinox as eqx  # loaded already: model is an Equinox module

    _no_params(params, "Equinox", where)
    training = [leaf for leaf in jax.tree_util.tree_leaves(model, is_leaf=_in_training)
                if _in_training(leaf)]
    if training:
        raise ModelStyleError(
            f"{where} is in training mode ({type(training[0]).__name__} with inference=False):"
            " give eqx.nn.inference_mode(model)")
    arrays, static = eqx.partition(model, eqx.is_array)
    return AdaptedModel("equinox", static, _equinox_call, where), arrays


def _in_training(node: Any) -> bool:
    return is_equinox_module(node) and getattr(node, "inference", None) is False


def _equinox_call(static: Any, arrays: Any, x: jax.Array, where: str) -> jax.Array:
    import equinox as eqx

    model = eqx.combine(arrays, static)
    try:
        return model(x)
    except TypeError as e:
        stateful = getattr(eqx.nn, "StatefulLayer", ())
        layers = sorted({type(leaf).__name__ for leaf in jax.tree_util.tree_leaves(
            model, is_leaf=lambda n: isinstance(n, stateful)) if isinstance(leaf, stateful)})
        if "state" not in str(e) or not layers:
            raise
        raise ModelStyleError(
            f"{where} has stateful layers ({', '.join(layers)}) that need their state: fold "
            "it in (a module holding eqx.nn.inference_mode(model) and its eqx.nn.State, "
            "calling model(x, state)[0])") from e
    except RuntimeError as e:
        if "key" not in str(e):
            raise
        raise ModelStyleError(f"{where} asks for a random key when called (Dropout in "
                              "training mode?): give eqx.nn.inference_mode(model)") from e


def _first_line(e: BaseException) -> str:
    """The first line of an error's message, without flax's link to its documentation."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return lines[0].split(" (https://")[0] if lines else type(e).__name__
