"""What one CERTIFY sample costs: randomised smoothing's counting against plain forward passes.

The model is the demo ``SmallCNN`` (random init: the cost does not depend on the weights) under
Gaussian noise (``jaxbundle.certify.smoothing.gaussian``). For ``B`` images, ``n0`` selection
and ``n`` estimation samples each, timed interleaved in one process (medians over
``--repeats`` rounds, compilation excluded):

* ``certify``: ``smoothing.certify`` (``B * (n0 + n)`` noisy images, ``--batch`` per call,
  the Clopper-Pearson bounds on the host);
* ``forward_whole``: the base classifier on ``B * n`` images in one call (no noise);
* ``forward_chunked``: the base classifier on ``B * (n0 + n)`` images in the calls ``certify``
  makes (``min(batch, B * n0)`` then ``min(batch, B * n)`` images per call);
* ``noisy_chunked``: the same with the Gaussian noise of the smoothed model drawn for every
  image (one key per call): what any smoothing needs.

The figure of merit is the cost per sample of ``certify`` over each floor's cost per image.

    python benchmarks/smoothing_cost.py --images 10 --n0 100 --n 1000 --batch 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from harness import machine_facts, medians, run_interleaved

from jaxbundle.certify import smoothing
from jaxbundle.models.architectures import SmallCNN

SIGMA = 0.25


def chunked(fn, params, x: jax.Array, phases: tuple[int, ...], batch: int, key: jax.Array):
    """``fn(params, chunk, key_c)`` over ``B * samples`` copies of the images for each phase's
    ``samples``, ``min(batch, B * samples)`` per call (the last chunk padded): the calls
    ``certify`` makes, without its bookkeeping."""
    step = jax.jit(fn)
    chunks = []
    for samples in phases:
        images = jnp.repeat(x, samples, axis=0)
        size = min(batch, images.shape[0])
        padded = jnp.concatenate([images, images[:(-images.shape[0]) % size]])
        chunks += list(padded.reshape(-1, size, *x.shape[1:]))

    def run():
        out = [step(params, c, jax.random.fold_in(key, i)) for i, c in enumerate(chunks)]
        return jax.block_until_ready(out)

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=10)
    p.add_argument("--n0", type=int, default=100)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/smoothing_cost.json")
    args = p.parse_args(argv)

    module = SmallCNN()
    x = jnp.asarray(np.random.default_rng(0).uniform(size=(args.images, 28, 28, 1)),
                    jnp.float32)
    params = module.init(jax.random.key(0), x[:1])
    model = smoothing.gaussian(module.apply, SIGMA)
    key = jax.random.key(1)
    samples = args.n0 + args.n
    whole = jnp.repeat(x, args.n, axis=0)
    forward = jax.jit(module.apply)
    variants = {
        "certify": lambda: smoothing.certify(model, params, x, key=key, n0=args.n0, n=args.n,
                                             batch=args.batch),
        "forward_whole": lambda: forward(params, whole),
        "forward_chunked": chunked(lambda p_, c, k: module.apply(p_, c), params, x,
                                   (args.n0, args.n), args.batch, key),
        "noisy_chunked": chunked(model.apply_fn, params, x, (args.n0, args.n), args.batch, key),
    }
    timing = run_interleaved(variants, args.repeats, "smoothing")
    med = medians(timing)
    per_image = {
        "certify": med["certify"] / (args.images * samples),
        "forward_whole": med["forward_whole"] / (args.images * args.n),
        "forward_chunked": med["forward_chunked"] / (args.images * samples),
        "noisy_chunked": med["noisy_chunked"] / (args.images * samples),
    }
    summary = {
        "seconds_per_sample": per_image,
        "certify_per_sample_over": {k: per_image["certify"] / v for k, v in per_image.items()
                                    if k != "certify"},
    }
    record = dict(config=vars(args), machine=machine_facts(), timing=timing, summary=summary)
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
