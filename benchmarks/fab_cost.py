"""What FAB's projection costs, and what a FAB-T step costs beside the model's passes.

FAB projects twice per step onto the linearised boundary within the box
(:func:`jaxbundle.attacks.white_box.fab.project_hyperplane`). This times, in one process,
medians over ``--repeats`` calls:

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
import statistics
import time

import flax.linen as nn
import jax
import numpy as np

import jaxbundle
from jaxbundle import AttackSpec
from jaxbundle.attacks.white_box.fab import project_hyperplane


class _ColourCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def projections(batch: int, repeats: int) -> list[dict]:
    rows = []
    for dim in (28 * 28, 32 * 32 * 3):
        k = jax.random.split(jax.random.key(0), 3)
        t = jax.random.uniform(k[0], (batch, dim))
        w = jax.random.normal(k[1], (batch, dim))
        r = jax.random.normal(k[2], (batch,))
        for norm in ("linf", "l2"):
            f = jax.jit(lambda t, w, r, norm=norm: project_hyperplane(t, w, r, norm))
            rows.append({"what": "projection", "dim": dim, "norm": norm,
                         "ms": 1e3 * _median_seconds(lambda: f(t, w, r), repeats)})
    return rows


def attacks(batch: int, steps: int, repeats: int) -> list[dict]:
    module = _ColourCNN()
    x = jax.random.uniform(jax.random.key(1), (batch, 32, 32, 3))
    params = module.init(jax.random.key(2), x[:1])
    apply_fn = jax.jit(module.apply)
    y = np.asarray(apply_fn(params, x)).argmax(1)  # every example correct: every one attacked
    floor = jax.jit(jax.grad(lambda p, xb: apply_fn(p, xb).sum(), argnums=1))
    floor_s = _median_seconds(lambda: floor(params, x), repeats)
    rows = []
    for norm, eps in (("linf", 8 / 255), ("l2", 0.5)):
        for spec in (AttackSpec("apgd-t", steps=steps), AttackSpec("fab-t", steps=steps)):
            plan = jaxbundle.Plan(eps=eps, norm=norm, attacks=(spec,), goals=("misclassify",),
                                  batch_size=batch)

            def run(plan=plan):
                return jaxbundle.evaluate(apply_fn, params, (x, y), plan, mesh=None,
                                          keep_images=False)

            gradients = int(run().per_example["gradients"].sum())
            seconds = _median_seconds(lambda run=run: run().metrics, max(1, repeats // 10))
            rows.append({"what": spec.name, "norm": norm, "seconds": seconds,
                         "us_per_gradient": 1e6 * seconds / gradients,
                         "floor_us_per_gradient": 1e6 * floor_s / batch})
    return rows


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
