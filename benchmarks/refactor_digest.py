"""Digests of what an evaluation computes, to compare a refactor's before and after.

Runs nine plans (the named bundles the main job and the tests meet, with budgets cut so that
the whole takes a few minutes on 2 CPU cores) on the first 48 embedded test images, on the demo
adversarial CNN and on the randomized defence around it (a stochastic model), and prints per
plan a digest of every per-example array and one of the metrics (timings left out). Two
checkouts that print the same digests compute the same per-example results and report figures
on this machine (float results may differ in their last bits on another CPU)::

    python benchmarks/refactor_digest.py --out /tmp/after.json
    PYTHONPATH=/path/to/before python benchmarks/refactor_digest.py --out /tmp/before.json
    cmp /tmp/before.json /tmp/after.json

Used for issue 49 (the plan as nested records): identical before and after every step.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np

import jaxbundle
from jaxbundle import bundles, data, models


def _plans(apply_fn, randomized):
    return {
        "fast-linf": (apply_fn, bundles.fast("linf", 0.3, batch_size=24)),
        "pgd-l2": (apply_fn, bundles.pgd("l2", 1.5, steps=6, batch_size=48)),
        "default-linf": (apply_fn, bundles.default("linf", 0.3, steps=12, queries=200,
                                                   batch_size=48)),
        "default-l2": (apply_fn, bundles.default("l2", 1.5, steps=12, queries=200,
                                                 batch_size=48)),
        "autoattack-linf": (apply_fn, bundles.autoattack("linf", 0.3, steps=10, queries=100,
                                                         batch_size=48)),
        "minnorm-l2": (apply_fn, bundles.min_norm("l2", 1.5, steps=10, batch_size=48)),
        "broad-linf": (apply_fn, bundles.broad("linf", 0.3, steps=5, queries=60,
                                               batch_size=48)),
        "stochastic-fast": (randomized, bundles.fast("linf", 0.3, steps=5, eot=2,
                                                     batch_size=48)),
        "stochastic-default": (randomized, bundles.default("linf", 0.3, steps=8, queries=60,
                                                           eot=2, batch_size=48)),
    }


def _metrics_digest(metrics: dict) -> str:
    text = json.dumps(metrics, sort_keys=True, default=str)
    kept = "".join(part for part in text.split(', "') if "seconds" not in part)
    return hashlib.sha256(kept.encode()).hexdigest()[:16]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, metavar="JSON")
    args = parser.parse_args(argv)
    apply_fn, params = models.load_or_train(models.MODELS["adversarial"])
    randomized = models.DEFENCES["randomized"].wrap(apply_fn)
    source = data.head(data.open_source("mnist-sample"), 48)
    out = {}
    for name, (fn, plan) in _plans(apply_fn, randomized).items():
        ev = jaxbundle.evaluate(fn, params, source, plan, mesh=None, compile_cache=None)
        arrays = hashlib.sha256()
        for key in sorted(ev.per_example):
            arrays.update(key.encode())
            arrays.update(np.asarray(ev.per_example[key]).tobytes())
        out[name] = {"per_example": arrays.hexdigest()[:16],
                     "metrics": _metrics_digest(ev.metrics),
                     "plan": hashlib.sha256(json.dumps(plan.describe(), sort_keys=True)
                                            .encode()).hexdigest()[:16]}
        print(name, out[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
