"""What the proof of float32 rounding costs, and what it excludes (issue 48).

Two parts:

* **the cost**: certified accuracy with the shipped bound (its allowance for float32's rounding
  a worst-case proof, ``jaxbundle.certify.rounding``) against the papers' formulas in float32
  (``rounding=False``: no allowance, not sound), per method, on the certified demo model (the
  first ``--n`` embedded test images, Linf 76/255, the grid's radius with the judge's slack)
  and three held-out zoo models (``benchmarks/heldout``: ``cnn-pgd-0.3`` at Linf 0.1,
  ``mlp-pgd`` at Linf 0.05, ``resnet-std`` at Linf 0.5/255, their 256 evaluation images); the
  largest widening relative to ``1 + |bound|``; warm seconds of both (medians of
  ``--repeats``);
* **what it excludes**: the Jia & Rinard (2021) search of ``tests/float_edges.py`` on networks
  built so that each ball's exact minimum margin is 2^-2 to 2^-33 of its scale, on the CPU in
  float32 and under an emulated TF32 or bfloat16 default (``tests/emulation.py``), a model with
  no precision of its own and one that asks for DEFAULT: examples certified, balls where the
  search found a misclassified point, and the two together, for the shipped bound and the
  papers' formulas.

    python benchmarks/certify_rounding.py            # about 15 minutes on 2 CPU cores
    python benchmarks/certify_rounding.py --quick    # n = 128, edges 64
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from harness import machine_facts, median_seconds, parse_run_args, write_results

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "heldout"))
sys.path.insert(0, str(HERE.parent / "tests"))  # the search and the emulation the tests use
import emulation  # noqa: E402
import float_edges  # noqa: E402
import zoo  # noqa: E402

from jaxbundle import models, norms  # noqa: E402
from jaxbundle.certify import bounds  # noqa: E402
from jaxbundle.data import load_mnist_sample  # noqa: E402

HELD_OUT = {"cnn-pgd-0.3": (0.1, bounds.METHODS), "mlp-pgd": (0.05, ("crown-ibp", "crown")),
            "resnet-std": (0.5 / 255, ("ibp", "crown-ibp"))}
FRACTIONS = 2.0 ** -np.arange(2, 34)


def cost(name: str, apply_fn, params, x, y, eps: float, methods, repeats: int) -> dict:
    """Certified counts, widening and seconds of the shipped bound and the papers' formulas."""
    out = {"n": int(len(y)), "eps": eps, "methods": {}}
    x, y = jnp.asarray(x), jnp.asarray(y)
    for method in methods:
        record = {}
        bound = {}
        for label, rounding in (("sound", True), ("papers", False)):
            fn = functools.partial(bounds.margin_bounds, functools.partial(apply_fn), params, x,
                                   y, eps=eps, method=method, rounding=rounding)
            record[f"{label}_seconds"] = median_seconds(fn, repeats)
            bound[label] = np.asarray(fn())
            record[f"{label}_certified"] = int(np.sum(np.min(bound[label], axis=1) > 0))
        finite = np.isfinite(bound["papers"])
        widening = (bound["papers"][finite] - bound["sound"][finite]) / (
            1.0 + np.abs(bound["papers"][finite]))
        record["max_widening"] = float(np.max(widening))
        record["median_widening"] = float(np.median(widening))
        record["sound_below_papers"] = bool(np.all(bound["sound"][finite]
                                                   <= bound["papers"][finite]))
        out["methods"][method] = record
        print(name, method, record, flush=True)
    return out


def edges(n: int, count: int) -> dict:
    """The search's counts per emulated default and model precision."""
    out = {"n": n, "points_per_ball": count + 1, "fractions": [2, 33], "settings": []}
    for fmt in sorted(emulation.FORMATS):
        for precision in (None, jax.lax.Precision.DEFAULT):
            with emulation.default_precision(fmt):
                problem = float_edges.edge_problem(0, n, FRACTIONS, precision)
                fooled = float_edges.fooled(problem, count)
                row = {"default": fmt, "model_precision": "none" if precision is None
                       else "DEFAULT", "balls_with_a_point": int(fooled.sum())}
                for label, rounding in (("sound", True), ("papers", False)):
                    lower = np.min(np.asarray(bounds.margin_bounds(
                        problem.apply_fn, problem.params, jnp.asarray(problem.x),
                        jnp.asarray(problem.y), eps=jnp.asarray(problem.eps),
                        method="crown-ibp", rounding=rounding)), axis=1)
                    certified = lower > 0
                    row[f"{label}_certified"] = int(certified.sum())
                    row[f"{label}_certified_with_a_point"] = int(np.sum(certified & fooled))
                    row[f"{label}_above_exact_minimum"] = int(np.sum(lower > problem.margin))
            out["settings"].append(row)
            print("edges", row, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--edges", type=int, default=256)
    p.add_argument("--points", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = parse_run_args(p, argv, "certify_rounding", {"n": 128, "edges": 64, "repeats": 1})
    results = {"machine": machine_facts(), "cost": {}}
    sample = load_mnist_sample("test", args.n)
    apply_fn, params = models.load_or_train(models.MODELS["certified"])
    radius = float(norms.ball_limit(norms.grid_radius(0.3, "linf")))
    results["cost"]["certified"] = cost("certified", apply_fn, params, sample.x, sample.y,
                                        radius, bounds.METHODS, args.repeats)
    for name, (eps, methods) in HELD_OUT.items():
        apply_fn, variables = zoo.load(name)
        x, y = zoo.dataset(zoo.ZOO[name].data, "test", start=zoo.EVAL_START, n=zoo.EVAL_N)
        results["cost"][name] = cost(name, apply_fn, variables, x, y, eps, methods,
                                     args.repeats)
    results["edges"] = edges(args.edges, args.points)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
