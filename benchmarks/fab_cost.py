"""What FAB's projection costs, and what a FAB-T step costs beside the model's passes.

FAB projects twice per step onto the linearised boundary within the box
(:func:`jaxbundle.attacks.white_box.fab.project_hyperplane`). This times, in one process,
medians over ``--repeats`` interleaved rounds (``harness.run_interleaved``):

* ``projection``: one jitted projection of ``--batch`` rows of ``D`` pixels (28x28 grey and
  32x32x3 colour), Linf and L2;
* ``fab-t`` beside ``apgd-t``: each alone through ``jaxbundle.evaluate`` (9 targets x
  ``--steps`` steps) on a freshly initialised colour CNN (flax ``nn.Conv``), microseconds per
  gradient the attack declares (per example and step), against one forward+backward pass of
  the same model per row (the floor).

    python benchmarks/fab_cost.py --batch 128 --steps 20 --repeats 20
"""

from __future__ import annotations

import argparse
import json

import flax.linen as nn
import jax
import numpy as np

import jaxbundle
from jaxbundle import AttackSpec
from harness import medians, run_interleaved
from jaxbundle.attacks.white_box.fab import project_hyperplane


class _ColourCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def projections(batch: int, repeats: int) -> list[dict]:
    variants = {}
    for dim in (28 * 28, 32 * 32 * 3):
        k = jax.random.split(jax.random.key(0), 3)
        t = jax.random.uniform(k[0], (batch, dim))
        w = jax.random.normal(k[1], (batch, dim))
        r = jax.random.normal(k[2], (batch,))
        for norm in ("linf", "l2"):
            f = jax.jit(lambda t, w, r, norm=norm: project_hyperplane(t, w, r, norm))
            variants[(dim, norm)] = lambda f=f, t=t, w=w, r=r: f(t, w, r)
    seconds = medians(run_interleaved({f"{d} {n}": v for (d, n), v in variants.items()},
                                      repeats, "projection"))
    return [{"what": "projection", "dim": d, "norm": n, "ms": 1e3 * seconds[f"{d} {n}"]}
            for d, n in variants]


def attacks(batch: int, steps: int, repeats: int) -> list[dict]:
    module = _ColourCNN()
    x = jax.random.uniform(jax.random.key(1), (batch, 32, 32, 3))
    params = module.init(jax.random.key(2), x[:1])
    apply_fn = jax.jit(module.apply)
    y = np.asarray(apply_fn(params, x)).argmax(1)  # every example correct: every one attacked
    floor = jax.jit(jax.grad(lambda p, xb: apply_fn(p, xb).sum(), argnums=1))
    floor_s = medians(run_interleaved({"floor": lambda: floor(params, x)}, repeats,
                                      "floor"))["floor"]
    runs, gradients = {}, {}
    for norm, eps in (("linf", 8 / 255), ("l2", 0.5)):
        for spec in (AttackSpec("apgd-t", steps=steps), AttackSpec("fab-t", steps=steps)):
            plan = jaxbundle.Plan.of(eps=eps, norm=norm, attacks=(spec,), goals=("misclassify",),
                                  batch_size=batch)

            def run(plan=plan):
                return jaxbundle.evaluate(apply_fn, params, (x, y), plan, mesh=None,
                                          keep_images=False)

            gradients[(spec.name, norm)] = int(run().per_example["gradients"].sum())
            runs[f"{spec.name} {norm}"] = lambda run=run: run().metrics
    seconds = medians(run_interleaved(runs, max(1, repeats // 10), "attacks"))
    return [{"what": name, "norm": norm, "seconds": seconds[f"{name} {norm}"],
             "us_per_gradient": 1e6 * seconds[f"{name} {norm}"] / count,
             "floor_us_per_gradient": 1e6 * floor_s / batch}
            for (name, norm), count in gradients.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    for row in projections(args.batch, args.repeats) + attacks(args.batch, args.steps,
                                                               args.repeats):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
