"""FAB-T fidelity on a network (issue 28): jaxbundle's FAB-T against the reference order.

jaxbundle's FAB takes one gradient per step: where the iterate ``x_new`` is misclassified, the
next step moves back to ``x0 + beta (x_new - x0)`` and linearises at ``x_new`` (the gradient of
the forward pass that checked it). The reference (fra31/auto-attack ``fab_base.py``, and
torchattacks' ``FAB``, which follows it) checks ``x_new`` with a forward pass and takes a fresh
gradient at the moved-back point. On a linear model the two are the same; this measures them on
networks, per example: AutoAttack's FAB-T (9 targets x 100 steps, its original parameters) from
torchattacks on a torch copy of the same weights, and jaxbundle's ``fab-t`` (the ``autoattack``
bundle's) through ``jaxbundle.bundle``, every image of both re-judged by the JAX model in
float32 (in the box, in the ball, misclassified); model passes counted on both sides.

Needs torch and torchattacks (the benchmark-only environment of benchmarks/README.md)::

    python experiments/fidelity_fab.py --out experiments/results/fidelity_fab.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from autoattack_compare import Counted, torch_network  # noqa: E402

import jaxbundle  # noqa: E402
from jaxbundle import attacks, data, models  # noqa: E402

SETTINGS = (("adversarial", "l2", 1.5), ("adversarial", "l2", 2.0), ("adversarial", "linf", 0.3),
            ("standard", "l2", 1.0), ("standard", "linf", 0.1))


def reference_fab(net, x, y, eps, norm):
    import torch
    import torchattacks as ta

    counted = Counted(net)
    attack = ta.FAB(counted, norm={"linf": "Linf", "l2": "L2"}[norm], eps=eps, steps=100,
                    n_restarts=1, multi_targeted=True, n_classes=10, seed=0)
    xt = torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    start = time.perf_counter()
    adv = attack(xt, torch.tensor(y.astype(np.int64)))
    seconds = time.perf_counter() - start
    passes = (counted.forward_rows + counted.backward_rows) / len(y)
    return adv.detach().numpy().transpose(0, 2, 3, 1), seconds, passes


def jaxbundle_fab(apply_fn, params, x, y, eps, norm, fresh):
    fab = attacks.fab(norm, steps=100, targets=9, fresh_gradient=fresh)
    run = lambda: jaxbundle.bundle([fab], apply_fn, params, x, y, jax.random.key(0),  # noqa
                                   eps=eps, norm=norm, judging="float")
    jax.block_until_ready(run())  # compiled
    start = time.perf_counter()
    result = jax.block_until_ready(run())
    seconds = time.perf_counter() - start
    x_adv = np.asarray(result.best["misclassify"].x)
    # a forward and a backward per gradient, and the fresh order's check: one forward more
    return x_adv, seconds, fab.gradients * 2 + (fab.num_restarts * fab.num_steps if fresh else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--out", default=None)
    parser.add_argument("--settings", default=None,
                        help="comma-separated indices into SETTINGS (default: all)")
    args = parser.parse_args()
    settings = SETTINGS if args.settings is None else [
        SETTINGS[int(i)] for i in args.settings.split(",")]
    ds = data.load_mnist_sample("test", n=args.n)
    x, y = np.asarray(ds.x), np.asarray(ds.y)
    loaded = {}
    for name, norm, eps in settings:
        if name not in loaded:
            loaded[name] = models.load_or_train(getattr(models, name.upper()))
        apply_fn, params = loaded[name]
        net = torch_network(params)
        cache = f"/tmp/fidelity_fab_{name}_{norm}_{eps}_{args.n}.npz"
        if os.path.exists(cache):
            with np.load(cache) as c:
                ref_adv, ref_s, ref_passes = c["x"], float(c["s"]), float(c["passes"])
        else:
            ref_adv, ref_s, ref_passes = reference_fab(net, x, y, eps, norm)
            np.savez(cache, x=ref_adv, s=ref_s, passes=ref_passes)
        ok = np.asarray(apply_fn(params, x)).argmax(1) == y

        def fooled(adv):
            delta = (adv - x).reshape(len(y), -1)
            dist = np.abs(delta).max(1) if norm == "linf" else np.linalg.norm(delta, axis=1)
            wrong = np.asarray(apply_fn(params, adv)).argmax(1) != y
            inside = (adv >= 0).all((1, 2, 3)) & (adv <= 1).all((1, 2, 3))
            return ok & wrong & inside & (dist <= eps * (1 + 1e-5))

        ref = fooled(ref_adv)
        row = {"model": name, "norm": norm, "eps": eps, "n": args.n,
               "clean_accuracy": round(100 * ok.mean(), 2),
               "robust_reference": round(100 * (ok & ~ref).mean(), 2),
               "passes_reference": round(ref_passes, 1), "seconds_reference": round(ref_s, 1)}
        for fresh in (False, True):
            adv, seconds, passes = jaxbundle_fab(apply_fn, params, x, y, eps, norm, fresh)
            mine, tag = fooled(adv), "fresh" if fresh else "jaxbundle"
            row.update({f"robust_{tag}": round(100 * (ok & ~mine).mean(), 2),
                        f"reference_only_{tag}": int((ref & ~mine).sum()),
                        f"{tag}_only": int((mine & ~ref).sum()),
                        f"passes_{tag}": passes, f"seconds_{tag}_warm": round(seconds, 1)})
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
