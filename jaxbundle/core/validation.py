"""Checks at the boundary: images, labels, the model's outputs, a bundle's attacks and goals.

Each raises ``ValueError`` (or ``TypeError``) with one line naming the problem. The bundler
and the evaluation plan (:meth:`jaxbundle.Plan.check`) share them; nothing here runs an attack.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle.core import arithmetic
from jaxbundle.core import goals as goals_lib
from jaxbundle.core import norms
from jaxbundle.core import sampling
from jaxbundle.attacks.base import KINDS, Attack
from jaxbundle.core.judge import check_judging

__all__ = ["check_attacks", "check_eot", "check_inputs", "check_labels", "check_pixels",
           "goals_for"]


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    """A finite real number, not a bool."""
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))


def as_plain(record: Any, floats: tuple[str, ...] = (), ints: tuple[str, ...] = ()) -> None:
    """numpy and JAX scalars of a frozen record's fields as plain Python numbers (hashable)."""
    for field in floats:
        if is_number(getattr(record, field)):
            object.__setattr__(record, field, float(getattr(record, field)))
    for field in ints:
        if is_int(getattr(record, field)):
            object.__setattr__(record, field, int(getattr(record, field)))


def check_pixels(x) -> None:
    """Checks that images (numpy or jax, any shape) are floating point, finite and in [0, 1].

    Raises ``ValueError`` naming the first problem; shared by the datasets and the bundler.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"images must have a floating dtype with pixels in [0, 1], got dtype "
                         f"{x.dtype} (divide uint8 images by 255)")
    xh = np.asarray(x)
    finite = np.isfinite(xh)
    if not finite.all():
        raise ValueError(f"images contain {int(xh.size - np.count_nonzero(finite))} non-finite "
                         "values (NaN or inf)")
    lo, hi = float(xh.min()), float(xh.max())
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"pixels must lie in [0, 1], found min {lo} and max {hi}")


def check_labels(y, n: int, num_classes: int) -> None:
    """Checks that labels are 1-D integers, ``n`` of them, in ``[0, num_classes)``."""
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be 1-D integers, got shape {y.shape} dtype {y.dtype}")
    if len(y) != n:
        raise ValueError(f"length mismatch: {n} images but {len(y)} labels")
    values = np.unique(y[(y < 0) | (y >= num_classes)])
    if values.size:
        more = f" (and {len(values) - 10} more)" if len(values) > 10 else ""
        raise ValueError(f"labels must lie in [0, {num_classes}) for {num_classes} classes, "
                         f"found out-of-range values {values[:10].tolist()}{more}")


def check_attacks(attacks: Sequence[Attack], norm: str) -> tuple[Attack, ...]:
    """Validates a bundle's attacks: a non-empty sequence of known kinds, unique names, the
    threat norm."""
    attacks = tuple(attacks)
    if not attacks:
        raise ValueError("a bundle needs at least one attack")
    for a in attacks:
        if not isinstance(a, Attack):
            raise TypeError(f"expected Attack objects (e.g. jaxbundle.attacks.pgd()), got {a!r}")
        if a.kind not in KINDS:
            raise ValueError(
                f"attack {a.name!r} has unknown kind {a.kind!r}; expected one of {KINDS}"
            )
        if a.norm != norm:
            raise ValueError(
                f"attack {a.name!r} works in norm {a.norm!r} but the threat model is {norm!r}"
            )
        # A schedule in the config (step sizes, checkpoints) is built for its own length.
        planned = getattr(a.config, "num_steps", a.num_steps)
        if planned != a.num_steps:
            raise ValueError(
                f"attack {a.name!r} runs {a.num_steps} steps but its config is built for "
                f"{planned}; build it again with the factory (steps={a.num_steps})"
            )
    names = [a.name for a in attacks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"attack names must be unique in a bundle, repeated: {duplicates}; "
            "use attack.rename('...')"
        )
    return attacks


def check_eot(attacks: Sequence[Attack], apply_fn: Callable) -> None:
    """EOT samples a stochastic model's randomness: ``eot > 1`` on a deterministic model
    would only multiply the cost (and the budget's count), so it is an error."""
    if sampling.is_stochastic(apply_fn):
        return
    for a in attacks:
        if a.eot != 1:
            raise ValueError(
                f"attack {a.name!r} has eot={a.eot} but the model is deterministic; EOT averages "
                "over a stochastic model's randomness (declare it with jaxbundle.stochastic)"
            )


def goals_for(goals: Sequence[str] | str, attacks: Sequence[Attack]) -> tuple[str, ...]:
    """The goals a bundle tracks: ``goals``, ``misclassify`` first, and each attack's own goal."""
    goals = (goals,) if isinstance(goals, str) else tuple(goals)
    return goals_lib.check_goals(goals + tuple(a.goal for a in attacks))


_OUTPUT_SHAPES: dict = {}  # (apply_fn, params' structure and shapes, x shape) -> output struct


def _output_shape(apply_fn: Callable, params: Any, x_shape: tuple[int, ...]) -> Any:
    """``jax.eval_shape`` of the model on float32 ``x_shape``, remembered per model and shapes.

    Tracing a flax model takes ~10 ms, which every :func:`bundle` call with ``validate=True``
    would otherwise pay again (about 5 % of PGD-40 on 64 MNIST images on a CPU).
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    spec = (treedef, tuple((np.shape(a), jnp.result_type(a)) for a in leaves), x_shape)
    try:
        key = (apply_fn, spec)
        hash(key)
    except TypeError:  # an unhashable apply_fn: no caching
        key = None
    if key is not None and key in _OUTPUT_SHAPES:
        return _OUTPUT_SHAPES[key]
    out = jax.eval_shape(sampling.fixed(apply_fn), params,
                         jax.ShapeDtypeStruct(x_shape, jnp.float32))
    if key is not None:
        if len(_OUTPUT_SHAPES) >= 256:
            _OUTPUT_SHAPES.clear()
        _OUTPUT_SHAPES[key] = out
    return out


def check_inputs(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: Any,
    y: Any,
    eps: Any,
    *,
    judging: str = "auto",
) -> int:
    """Checks shapes, dtypes and values at the boundary; returns the number of classes.

    Raises ``ValueError`` (or ``TypeError``) naming the problem: shapes, images failing
    :func:`jaxbundle.data.check_pixels` (non-float, NaN or infinite, outside [0, 1]), labels
    failing :func:`jaxbundle.data.check_labels` (not integers, wrong length, out of range for
    the model), negative or non-finite eps, a model whose output is not ``[B, K]`` logits, and
    (for ``judging="grid"``) images off the 8-bit grid.
    """
    if not hasattr(x, "shape") or not hasattr(y, "shape"):
        raise TypeError("x and y must be arrays")
    if x.ndim < 2:
        raise ValueError(f"x must be a batch of images [B, ...], got shape {tuple(x.shape)}")
    check_pixels(x)
    out = _output_shape(apply_fn, params, tuple(x.shape))
    if len(out.shape) != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(
            f"apply_fn(params, x) must return logits [B, K] = [{x.shape[0]}, K], "
            f"got shape {tuple(out.shape)}"
        )
    num_classes = int(out.shape[1])
    check_labels(y, x.shape[0], num_classes)
    eps_host = np.asarray(eps, dtype=np.float64)
    if eps_host.ndim > 1 or (eps_host.ndim == 1 and eps_host.shape[0] != x.shape[0]):
        raise ValueError(f"eps must be a scalar or shape [{x.shape[0]}], got {eps_host.shape}")
    if not np.all(np.isfinite(eps_host)) or np.any(eps_host < 0):
        raise ValueError(
            f"eps must be finite and >= 0, got {eps_host.min() if eps_host.size else eps_host}"
        )
    if check_judging(judging) == "grid":
        off = int(np.sum(~norms.on_grid(np.asarray(x, np.float32))))
        if off:
            raise ValueError(
                f"judging='grid' needs clean images on the 8-bit grid (k/255), but {off} of "
                f"{x.shape[0]} are not (resized or augmented?); use judging='auto' to judge "
                "those in float32, or round them to the grid first"
            )
    return num_classes


_MATMULS = ("dot_general", "conv_general_dilated")


def _matmuls(jaxpr: Any) -> list:
    """Every matrix product and convolution in ``jaxpr`` and the jaxprs inside it (jit, custom
    gradients, scans, conditionals)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _MATMULS:
            found.append(eqn)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own jaxpr
                if hasattr(inner, "eqns"):
                    found += _matmuls(inner)
    return found


def _precision_name(precision: Any) -> str:
    if isinstance(precision, (tuple, list)):
        return "/".join(dict.fromkeys(_precision_name(p) for p in precision))
    return getattr(precision, "name", str(precision))


def model_dtypes(apply_fn: Callable, params: Any, x_shape: tuple[int, ...]) -> dict:
    """What a report says of a model's precision: ``{"logits", "params", "compute",
    "precision", "statement"}``: the dtype of its logits, of its parameters' floating leaves,
    of the operands of its matrix products and convolutions (traced on float32 images
    ``x_shape``, nothing is computed), the precisions the model sets on them itself (empty:
    none, the verdicts' :data:`jaxbundle.core.arithmetic.PRECISION` applies), and one line for the
    console. Whatever the model computes in, margins, probabilities and judging use its logits
    widened to float32 exactly (:func:`jaxbundle.core.sampling.float32_logits`)."""
    image = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    closed = jax.make_jaxpr(sampling.fixed(apply_fn))(params, image)
    logits = str(closed.out_avals[0].dtype)
    leaves = [jnp.result_type(a) for a in jax.tree_util.tree_leaves(params)]
    params_dtypes = sorted({str(d) for d in leaves if jnp.issubdtype(d, jnp.floating)})
    matmuls = _matmuls(closed.jaxpr)
    compute = sorted({str(v.aval.dtype) for e in matmuls for v in e.invars}) or [logits]
    own = sorted({_precision_name(e.params.get("precision")) for e in matmuls
                  if e.params.get("precision") is not None})
    narrow = [d for d in dict.fromkeys(compute + [logits]) if jnp.dtype(d).itemsize < 4]
    held = ", ".join(params_dtypes) or "none"
    statement = f"model computes in {', '.join(compute)} (params {held}), logits {logits}"
    if narrow:
        statement += ("; margins and judging on its logits widened to float32 exactly, near "
                      f"ties as its own {narrow[0]} argmax decides them")
    statement += f"; {arithmetic.STATEMENT}"
    if own:
        statement += f" (the model's own precision, {', '.join(own)}, where it sets one)"
    return {"logits": logits, "params": params_dtypes, "compute": compute, "precision": own,
            "statement": statement}
