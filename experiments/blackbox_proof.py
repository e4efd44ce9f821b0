"""Issue 4's proof on the adversarially trained CNN of the main job.

Part 1 (Linf eps 0.3, the first ``--n`` test images): robust accuracy under Square (5,000
queries), under APGD-CE (100 steps) and under both bundled, each through ``jaxbundle.bundle``
(verified, quantised). Claim: Square is within a few points of APGD; more would mean a weak
implementation (or, below APGD, gradient masking).

Part 2 (L2, the first ``--n-l2`` test images the model classifies correctly): SurFree's median
smallest adversarial L2 distortion at 1,000 / 3,000 / 5,000 queries (each a fresh run: the
schedule depends on the budget), beside FMN-1000's white-box median as a reference.

    python experiments/blackbox_proof.py      # ~6 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import attacks, data, models
from jaxbundle.bundler import bundle

from _results import write_results


def run(attack_list, apply_fn, params, x, y, eps, norm, batch, judging="auto"):
    """Per example: fooled within eps (misclassify goal) and smallest adversarial distortion."""
    fooled, dist = [], []
    for i in range(0, len(y), batch):
        r = bundle(attack_list, apply_fn, params, jnp.asarray(x[i : i + batch]),
                   jnp.asarray(y[i : i + batch]), jax.random.key(0), eps=eps, norm=norm,
                   example_id=jnp.arange(i, i + len(y[i : i + batch]), dtype=jnp.int32),
                   judging=judging)
        fooled.append(np.asarray(r.best["misclassify"].score.misclassified))
        if "min_norm" in r.best:
            s = r.best["min_norm"].score
            dist.append(np.where(np.asarray(s.misclassified), np.asarray(s.distortion), np.inf))
    return np.concatenate(fooled), (np.concatenate(dist) if dist else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--n-l2", type=int, default=100)
    p.add_argument("--batch", type=int, default=250)
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path("experiments/results/blackbox_proof.json"))
    args = p.parse_args(argv)

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    ds = data.load_mnist_sample("test", n=max(args.n, 2 * args.n_l2))
    x, y = ds.x[: args.n], ds.y[: args.n]
    clean = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(x)), -1)) == y
    out = {"linf": {"clean_accuracy": 100 * clean.mean(), "n": args.n}, "l2": {}}
    sq, ap = attacks.square("linf", queries=5000), attacks.apgd("linf", "ce", steps=100)
    for name, lst in {"square-5000": [sq], "apgd-ce-100": [ap], "apgd-ce+square": [ap, sq]}.items():
        start = time.perf_counter()
        fooled, _ = run(lst, apply_fn, params, x, y, 0.3, "linf", args.batch)
        acc = 100 * float(np.mean(clean & ~fooled))
        out["linf"][name] = {"robust_accuracy": acc, "seconds": time.perf_counter() - start}
        print(f"linf 0.3 {name:15s} robust {acc:5.1f}%  {time.perf_counter() - start:6.1f} s",
              flush=True)

    ok = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(ds.x)), -1)) == ds.y
    idx = np.flatnonzero(ok)[: args.n_l2]
    xm, ym = ds.x[idx], ds.y[idx]
    rows = {}
    for name, attack in {
        "surfree-1000": attacks.surfree(queries=1000),
        "surfree-3000": attacks.surfree(queries=3000),
        "surfree-5000": attacks.surfree(queries=5000),
        "fmn-1000 (white-box reference)": attacks.fmn("l2", steps=1000),
    }.items():
        start = time.perf_counter()
        _, d = run([attack], apply_fn, params, xm, ym, 0.0, "l2", args.batch, judging="float")
        rows[name] = {"queries": attack.queries, "gradients": attack.gradients,
                      "success_rate": float(np.isfinite(d).mean()),
                      "median_l2": float(np.median(d)),
                      "seconds": time.perf_counter() - start}
        print(f"l2 {name:32s} success {np.isfinite(d).mean():.3f}  median {np.median(d):.3f}  "
              f"{time.perf_counter() - start:6.1f} s", flush=True)
    out["l2"] = {"n": int(len(idx)), **rows}
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
