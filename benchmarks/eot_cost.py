"""What one EOT sample costs: jaxbundle's PGD with EOT against the forward+backward floor.

The model is the randomised demo defence (``jaxbundle.models.randomized``: Gaussian noise and a
random shift of up to 2 pixels in front of the adversarially trained demo CNN). For EOT
sample counts ``S``, timed interleaved in one process (medians over ``--repeats`` rounds):

* ``floor_S``: ``steps`` chained signed-gradient steps, each the plain forward and backward
  pass of the defended model on the ``B x S`` transformed images at once (one batched call,
  one key per image), averaged over the samples: what any EOT needs;
* ``floor_per_image_S``: the same with the network called one image at a time under
  ``vmap`` (how jaxbundle calls a stochastic model, so that each example's draws are its own
  whatever the batch);
* ``bundle_S``: ``jaxbundle.bundle`` with PGD (``steps`` steps, one restart) at ``eot=S``,
  the judge's calls set to 1 so that the judging does not hide the per-sample cost (its
  clean-image, final-iterate and verification calls are a fixed cost per example).

The figure of merit is the cost of one more sample: ``(bundle_S - bundle_1) / (floor_S -
floor_1)``, and the whole run's ratio ``bundle_S / floor_S``. Model passes are counted from
the attack's budget (``gradients`` per example) and checked against ``steps * S``.

    python benchmarks/eot_cost.py --n 64 --steps 10 --eot 1 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from harness import machine_facts, run_interleaved

import jaxbundle
from jaxbundle import losses, models
from jaxbundle.attacks import pgd
from jaxbundle.data import load_mnist_sample
from jaxbundle.models.randomized import DEFENCES, transform

EPS = 0.3


def make_floor(base_apply, params, x, y, key, steps, samples, noise, shift, per_image=False):
    """``steps`` signed steps on the mean gradient over ``samples`` draws per image, each step
    one batched forward+backward of the defended model on ``B x samples`` images (with
    ``per_image``: the network called on one image at a time under ``vmap``, as jaxbundle
    calls a stochastic model so that each example's draws are its own)."""
    b = x.shape[0]
    keys = jax.random.split(key, (steps, b * samples))

    def total(xa, k):
        rep = jnp.repeat(xa, samples, axis=0)
        seen = jax.vmap(lambda xi, ki: transform(xi[None], ki, noise, shift)[0])(rep, k)
        if per_image:
            logits = jax.vmap(lambda xi: base_apply(params, xi[None])[0])(seen)
        else:
            logits = base_apply(params, seen)
        return jnp.sum(losses.cross_entropy(logits, jnp.repeat(y, samples))) / samples

    @jax.jit
    def run(xa):
        def body(v, k):
            return jnp.clip(v + 1e-3 * jnp.sign(jax.grad(total)(v, k)), 0.0, 1.0), None

        return jax.lax.scan(body, xa, keys)[0]

    return lambda: run(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eot", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/eot_cost.json")
    args = p.parse_args(argv)

    base_apply, params = models.load_or_train(models.ADVERSARIAL)
    defence = DEFENCES["randomized"]
    ds = load_mnist_sample("test", n=args.n)
    x, y = jnp.asarray(ds.x), jnp.asarray(ds.y)
    key = jax.random.key(0)
    model = models.randomized(base_apply, noise=defence.noise, shift=defence.shift, calls=1)
    variants, passes = {}, {}
    for s in args.eot:
        for tag, per_image in (("floor", False), ("floor_per_image", True)):
            variants[f"{tag}_{s}"] = make_floor(
                models.canonical_convolutions(base_apply), params, x, y, key, args.steps, s,
                defence.noise, defence.shift, per_image)
        attack = jaxbundle.with_eot([pgd(steps=args.steps)], s)[0]
        variants[f"bundle_{s}"] = (
            lambda a=attack: jaxbundle.bundle([a], model, params, x, y, key, eps=EPS))
        res = variants[f"bundle_{s}"]()
        passes[s] = int(np.asarray(res.gradients)[0])
        assert passes[s] == args.steps * s, (passes[s], args.steps * s)
    timing = run_interleaved(variants, args.repeats, "eot")
    med = {k: v["median_s"] for k, v in timing.items() if not k.startswith("_")}
    lo, hi = min(args.eot), max(args.eot)
    marginal = lambda k: med[f"{k}_{hi}"] - med[f"{k}_{lo}"]  # noqa: E731
    summary = {
        "per_sample_ratio": marginal("bundle") / marginal("floor"),
        "per_sample_ratio_vs_per_image_floor": marginal("bundle") / marginal("floor_per_image"),
        "whole_run_ratio": {s: med[f"bundle_{s}"] / med[f"floor_{s}"] for s in args.eot},
        "seconds_per_sample_step": {
            k: med[k] / (args.steps * int(k.rsplit("_", 1)[1]) * args.n) for k in med},
        "gradients_per_example": passes,
    }
    record = dict(config=vars(args), machine=machine_facts(), timing=timing, summary=summary)
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps(summary, indent=1))
    print({k: round(v, 4) for k, v in med.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
