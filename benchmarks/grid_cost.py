"""What rounding to the 8-bit grid costs: grid values by table lookup against computed.

``jaxbundle.norms.quantize`` turns levels ``k`` into the float32 values ``uint8 / 255`` gives.
It used to look them up in a 256-entry table; inside XLA:CPU's fused loops that lookup is a
gather, many times slower than the arithmetic around it. ``norms._grid_value`` now computes
the same values (``k * float32(1/255)``, one ulp down where that product is one too high).
This times, in one process, medians over ``--repeats`` interleaved rounds
(``harness.run_interleaved``), ``--batch`` colour images 32x32x3 on the grid:

* ``quantize`` in Linf (8/255) and L2 (0.5) with each grid value (the table swapped in for
  the "before" rows, the same function otherwise);
* the Square attack's step loop (``--queries`` queries, Linf and L2, every query rounded to the
  grid) through ``jaxbundle.evaluate`` on a freshly initialised colour CNN, milliseconds per
  query, with each grid value.

    python benchmarks/grid_cost.py --batch 128 --queries 300 --repeats 10
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jaxbundle
from fab_cost import _ColourCNN
from harness import medians, run_interleaved
from jaxbundle import AttackSpec, norms

_COMPUTED = norms._grid_value


def _table(k: jax.Array) -> jax.Array:
    """The lookup ``norms._grid_value`` replaced: a gather from ``norms._GRID``."""
    return jnp.asarray(norms._GRID)[jnp.clip(k, 0, norms.PIXEL_LEVELS).astype(jnp.int32)]


def _with(grid_value, fn):
    """``fn`` run with ``grid_value`` in ``norms`` (each variant jitted under its own)."""
    def call():
        norms._grid_value = grid_value
        try:
            return fn()
        finally:
            norms._grid_value = _COMPUTED
    return call


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (args.batch, 32, 32, 3)
    x0 = rng.integers(0, 256, shape).astype(np.float32) / np.float32(255)
    y = rng.integers(0, 10, args.batch).astype(np.int32)
    results = {}
    for norm, eps in (("linf", 8 / 255), ("l2", 0.5)):
        delta = np.asarray(norms.random_in_ball(jax.random.split(jax.random.key(0), args.batch),
                                                shape[1:], jnp.full(args.batch, eps), norm))
        x = np.clip(x0 + delta, 0, 1)
        variants = {}
        for label, grid_value in (("table", _table), ("computed", _COMPUTED)):
            round_fn = jax.jit(lambda a, b, gv=grid_value: _with(
                gv, lambda: norms.quantize(a, b, eps, norm))())
            variants[f"quantize {label}"] = lambda f=round_fn: f(x, x0)
        res = run_interleaved(variants, args.repeats, f"quantize {norm}")
        results[f"quantize {norm}"] = {k: v * 1e3 for k, v in medians(res).items()}
        module = _ColourCNN()
        params = module.init(jax.random.key(1), x0[:1])
        plan = jaxbundle.Plan.of(eps=eps, norm=norm, goals=("misclassify",), batch_size=args.batch,
                              attacks=(AttackSpec("square-aa", queries=args.queries),))
        variants = {}
        for label, grid_value in (("table", _table), ("computed", _COMPUTED)):
            def apply_fn(v, a, m=module):  # a fresh one per variant: each compiles anew
                return m.apply(v, a)

            variants[f"square {label}"] = _with(grid_value, lambda f=apply_fn: jaxbundle.evaluate(
                f, params, (x0, y), plan, mesh=None, keep_images=False).metrics["robust_accuracy"])
        res = run_interleaved(variants, args.repeats, f"square {norm}")
        results[f"square {norm}"] = {k: v * 1e3 / args.queries for k, v in medians(res).items()}
    for name, row in results.items():
        unit = "ms per query" if name.startswith("square") else "ms"
        print(name, {k: round(v, 3) for k, v in row.items()}, unit)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"batch": args.batch, "queries": args.queries,
                                "repeats": args.repeats, "results": results}) + "\n")


if __name__ == "__main__":
    main()
