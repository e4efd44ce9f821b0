"""Certified vs bundled vs exact robust accuracy, and what certification costs (issue 30).

Two parts, on the embedded MNIST test sample (the first ``--n`` images), Linf:

* **the sandwich**: for each model, the bundled robust accuracy of the ``default`` bundle and
  the certified one of each bound method, the examples neither decides, and (small ReLU
  networks) the complete mode's exact answer, each with its seconds. Models: the demo CNNs
  (``standard``, ``adversarial``: PGD-trained, ``certified``: IBP-trained) at eps 0.3, and
  three one-hidden-layer MLPs (784-64-10, standard, PGD- and IBP-trained here, cached like the
  demo models) at eps 0.1, small enough for the complete mode to decide every example;
* **the cost**: IBP, CROWN-IBP and CROWN margin bounds of the two robust demo SmallCNNs
  (PGD- and IBP-trained) on ``--cost-n`` images at eps 0.3 against PGD-10's floor (10
  forward+backward passes of the same model on the same images), medians of ``--repeats``
  rounds; CROWN also with every hidden neuron refined (not only the unstable ones).

    python benchmarks/certify.py                # about 20 minutes on 2 CPU cores
    python benchmarks/certify.py --quick        # n = 32, a few minutes
    python benchmarks/certify.py --cost-only    # the cost part alone (results/certify_cost.json)
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness import (machine_facts, median_seconds, parse_run_args, results_path,
                     write_results)

import jaxbundle
from jaxbundle import bundles, models
from jaxbundle.certify import bounds, crown
from jaxbundle.data import load_mnist_sample

MLPS = {
    "mlp-standard": models.TrainConfig(arch="mlp", epochs=4),
    "mlp-pgd": models.TrainConfig(arch="mlp", adversarial=True, eps=0.1, epochs=8),
    "mlp-ibp": models.TrainConfig(arch="mlp", certified="ibp", eps=0.15, epochs=20,
                                  batch_size=50, learning_rate=2e-3, eps_warmup=0.4,
                                  kappa_start=0.0, kappa_end=0.0),
}


def sandwich(name: str, apply_fn, params, x, y, eps: float, methods: tuple[str, ...],
             time_limit: float) -> dict:
    """One model: the bundled figure once (the attacks do not depend on the method) and each
    method's certified figure with its seconds."""
    out: dict = {"eps": eps, "methods": {}}
    for method in methods:
        plan = bundles.plan("default", "linf", eps).replace(
            certify=method, certify_time_limit=time_limit if method == "complete" else None)
        start = time.perf_counter()
        ev = jaxbundle.evaluate(apply_fn, params, (x, y), plan, mesh=None)
        c = ev.metrics["certified"]
        out.update(clean_accuracy=ev.metrics["clean_accuracy"],
                   robust_accuracy=ev.metrics["robust_accuracy"])
        out["methods"][method] = {
            "certified_robust_accuracy": c["certified_robust_accuracy"],
            "undecided": c["undecided"], "certified_and_fooled": c["certified_and_fooled"],
            "exact": c["exact"], "certify_seconds": round(c["seconds"], 2),
            "run_seconds": round(time.perf_counter() - start, 2),
        }
        print(name, method, out["robust_accuracy"], out["methods"][method], flush=True)
    return out


def cost(n: int, repeats: int) -> dict:
    """Margin bounds of the two robust demo SmallCNNs against PGD-10's forward+backward floor
    on the same model and images, and CROWN with every neuron refined, in the same run."""
    sample = load_mnist_sample("test", n)
    x, y = jnp.asarray(sample.x), jnp.asarray(sample.y)
    out = {"n": n}
    for name in ("adversarial", "certified"):
        apply_fn, params = models.load_or_train(models.MODELS[name])
        gradient = jax.jit(jax.grad(lambda p, v, f=apply_fn: jnp.sum(
            jax.nn.log_softmax(f(p, v))[jnp.arange(n), y]), argnums=1))

        def floor(gradient=gradient, params=params):
            v = x
            for _ in range(10):
                v = jnp.clip(v + 0.01 * jnp.sign(gradient(params, v)), 0, 1)
            return v

        record = out[name] = {"pgd10_floor_seconds": median_seconds(floor, repeats)}
        # "crown-every-neuron": CROWN's bounds on every hidden neuron, not only on those IBP
        # leaves unstable (crown.refinement's sparse=False), traced with a fresh apply_fn.
        variants = [(m, m, True) for m in bounds.METHODS] + [("crown-every-neuron", "crown",
                                                              False)]
        for label, method, sparse in variants:
            refinement = crown.refinement
            crown.refinement = functools.partial(refinement, sparse=sparse)
            fn = jax.jit(lambda p, v, t, m=method, f=functools.partial(apply_fn):
                         bounds.margin_bounds(f, p, v, t, eps=0.3, method=m))
            try:
                seconds = median_seconds(lambda f=fn: f(params, x, y), repeats)
                certified = int(np.sum(np.min(np.asarray(fn(params, x, y)), axis=1) > 0))
            finally:
                crown.refinement = refinement
            record[label] = {"seconds": seconds, "certified": certified,
                             "ratio": seconds / record["pgd10_floor_seconds"]}
            print("cost", name, label, record[label], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--cost-n", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--cost-only", action="store_true", help="only the cost part")
    args = parse_run_args(p, argv, "certify", {"n": 32, "cost_n": 200, "repeats": 1})
    results = {"machine": machine_facts(), "n": args.n, "models": {}}
    if args.cost_only:
        results["cost"] = cost(args.cost_n, args.repeats)
        if args.out == results_path(None, "certify", args.quick):  # no --out given
            args.out = results_path(None, "certify_cost", args.quick)
        write_results(args.out, results)
        return 0
    sample = load_mnist_sample("test", args.n)
    x, y = sample.x, sample.y
    for name in ("standard", "adversarial", "certified"):
        apply_fn, params = models.load_or_train(models.MODELS[name])
        results["models"][name] = sandwich(name, apply_fn, params, x, y, 0.3,
                                           ("ibp", "crown-ibp", "crown"), args.time_limit)
    for name, config in MLPS.items():
        apply_fn, params = models.load_or_train(config)
        results["models"][name] = sandwich(name, apply_fn, params, x, y, 0.1,
                                           ("crown-ibp", "crown", "complete"), args.time_limit)
    results["cost"] = cost(args.cost_n, args.repeats)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
