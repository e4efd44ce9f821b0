"""PGD-40 through the library on an ordinary flax ``nn.Conv`` CNN, against the bare floor.

The model is :class:`jaxbundle.models.LinenCNN` (two stride-2 3x3 ``nn.Conv`` layers, as a user
writes them), on the embedded MNIST sample. Variants, interleaved in one process (timing
``harness.py``), medians over ``--repeats`` rounds:

* ``floor_*``: 40 chained forward+backward passes of the plain model (async, chained,
  unrolled, ``fori_loop``); the best median is the floor;
* ``bundle``: ``bundler.bundle([pgd], ...)`` as a user calls it (``unroll=1``; on CPU the
  bundler computes the model's convolutions with canonical-gradient VJPs,
  :func:`jaxbundle.canonical.canonical_convolutions`);
* ``bundle_unroll=True``;
* ``evaluate``: :func:`jaxbundle.evaluate` on the same batch (one batch, misclassify);
* ``before_*``: the same two bundle calls on the model with its convolutions hidden from that
  rewrite (wrapped in a ``custom_jvp`` whose rule is the model's own JVP: same numbers, JAX's
  own transposed convolutions), i.e. what the library did before the rewrite.

    python benchmarks/linen_overhead.py --n 512 64 --out benchmarks/results/linen_overhead.json
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from harness import EPS, STEP_SIZE, machine_facts, make_floors, run_interleaved

from jaxbundle import Plan, bundler, evaluate
from jaxbundle.attacks import pgd
from jaxbundle.data import load_mnist_sample
from jaxbundle.models import LinenCNN

TARGET = {512: 1.10, 64: 1.15}  # issue 12: library path / best floor on an nn.Conv model


def opaque(apply_fn):
    """``apply_fn`` behind a ``custom_jvp`` (rule: its own JVP), which the convolution rewrite
    does not enter: the library's behaviour before it, with the same numbers."""

    @jax.custom_jvp
    def f(params, x):
        return apply_fn(params, x)

    @f.defjvp
    def f_jvp(primals, tangents):
        return jax.jvp(apply_fn, primals, tangents)

    return f


def bench(n: int, steps: int, repeats: int) -> dict:
    ds = load_mnist_sample("test", n=n)
    x, y = jnp.asarray(ds.x), jnp.asarray(ds.y)
    module = LinenCNN()
    params = module.init(jax.random.PRNGKey(0), x[:1])
    apply_fn = module.apply
    hidden = opaque(apply_fn)
    key = jax.random.PRNGKey(1)
    attack = pgd(norm="linf", loss="ce", steps=steps, step_size=STEP_SIZE, random_start=True)

    def call(fn, **kw):
        return lambda: bundler.bundle([attack], fn, params, x, y, key, eps=EPS,
                                      goals=("misclassify",), **kw).best["misclassify"].x

    variants = make_floors(apply_fn, params, x, y, steps)
    variants["bundle"] = call(apply_fn)
    variants["bundle_unroll=True"] = call(apply_fn, unroll=True)
    variants["before_bundle"] = call(hidden)
    variants["before_bundle_unroll=True"] = call(hidden, unroll=True)
    xn, yn = np.asarray(x), np.asarray(y)
    plan = Plan.of(eps=EPS, attacks=(attack,), goals=("misclassify",), batch_size=n)
    variants["evaluate"] = lambda: evaluate(
        apply_fn, params, (xn, yn), plan, keep_images=False,
    ).metrics["robust_accuracy"]
    same = bool(jnp.all(variants["bundle"]() == variants["before_bundle"]()))

    res = run_interleaved(variants, repeats, f"N={n}")
    loads = res.pop("_load_avg_per_round")
    floors = {k: v["median_s"] for k, v in res.items() if k.startswith("floor_")}
    best = min(floors.values())
    best_min = min(v["min_s"] for k, v in res.items() if k.startswith("floor_"))
    return {
        "n": n,
        "steps": steps,
        "best_floor": min(floors, key=floors.get),
        "best_floor_s": best,
        "target_ratio": TARGET.get(n),
        "same_images_as_before": same,
        "load_avg_per_round": loads,
        "variants": {
            k: {
                "median_s": v["median_s"], "min_s": v["min_s"], "first_s": v["first_s"],
                "compile_s": v["compile_s"], "ratio": v["median_s"] / best,
                "ratio_min": v["min_s"] / best_min, "times_s": v["times_s"],
            }
            for k, v in res.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[512, 64])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    out = {"machine": machine_facts(), "model": "LinenCNN (flax nn.Conv 3x3 s2 32/64, dense 128)",
           "sections": [bench(n, args.steps, args.repeats) for n in args.n]}
    for sec in out["sections"]:
        print(f"N={sec['n']}: floor {sec['best_floor']} {sec['best_floor_s']:.3f} s, "
              f"target {sec['target_ratio']}, "
              f"same images as before: {sec['same_images_as_before']}")
        for k, v in sec["variants"].items():
            print(f"  {k:28s} {v['median_s']:8.3f} s  x{v['ratio']:.2f} (min x{v['ratio_min']:.2f})"
                  f"  compile {v['compile_s']:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
