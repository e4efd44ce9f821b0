"""Issue 14, SurFree against the reference (t-maho/SurFree, ``_alpha_binary_search``):

(a) after a success at the largest angle the upper end of the angle bisection is searched
    (the angle steps on by θ_max / T while it stays adversarial) instead of assumed at
    θ_max + θ_max / T, so the angle can grow past θ_max;
(b) the bisections stop by the reference's rule (angle: |cos hi - cos lo| <= gamma = 0.01),
    and the queries saved go to the next direction.

Variants, each at the same query budget on the demo adversarially trained CNN and the first
``--n`` correctly classified MNIST test images (median smallest L2 distortion, float judging
as in experiments/blackbox_proof.py):

* before: ``jaxbundle/attacks/surfree.py`` at commit ``d5f2fb3`` (read with ``git show``);
* (a): the working tree with ``gamma=0`` (no early stop: the upper-end search only);
* (a)+(b): the working tree's defaults.

    python experiments/fidelity_surfree.py      # ~4-5 min on 2 CPU cores
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

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _results import write_results  # noqa: E402
from fidelity_rays import old_module  # noqa: E402

BEFORE = "d5f2fb3"  # the last commit without (a) and (b)


def min_l2(attack, apply_fn, params, x, y, batch) -> np.ndarray:
    out = []
    for i in range(0, len(y), batch):
        r = bundle([attack], apply_fn, params, jnp.asarray(x[i : i + batch]),
                   jnp.asarray(y[i : i + batch]), jax.random.key(0), eps=0.0, norm="l2",
                   goals=("min_norm",), judging="float",
                   example_id=jnp.arange(i, i + len(y[i : i + batch]), dtype=jnp.int32))
        assert np.all(np.asarray(r.queries) == attack.queries)
        s = r.best["min_norm"].score
        out.append(np.where(np.asarray(s.misclassified), np.asarray(s.distortion), np.inf))
    return np.concatenate(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--queries", type=int, nargs="+", default=[1000, 2500])
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path("experiments/results/fidelity_surfree.json"))
    args = p.parse_args(argv)
    old = old_module(BEFORE, "jaxbundle/attacks/surfree.py", "surfree_before")

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    ds = data.load_mnist_sample("test", n=min(2000, 2 * args.n + 50))
    ok = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(ds.x)), -1)) == ds.y
    idx = np.flatnonzero(ok)[: args.n]
    x, y = ds.x[idx], ds.y[idx]
    out = {"n": int(len(idx)), "model": "models.ADVERSARIAL (demo adversarially trained CNN)",
           "data": "first n correctly classified images of data.load_mnist_sample('test')",
           "judging": "float", "before": f"surfree.py at {BEFORE}", "budgets": {}}
    for q in args.queries:
        variants = {
            "before": old.surfree(queries=q, name="surfree-before"),
            "(a) upper-end search, gamma=0": attacks.surfree(queries=q, gamma=0.0,
                                                             name="surfree-a"),
            "(a)+(b) defaults (gamma=0.01)": attacks.surfree(queries=q, name="surfree-ab"),
        }
        rows, dists = {}, {}
        for name, attack in variants.items():
            t0 = time.perf_counter()
            d = min_l2(attack, apply_fn, params, x, y, args.batch)
            dists[name] = d
            rows[name] = {"queries": attack.queries, "success_rate": float(np.isfinite(d).mean()),
                          "median_l2": float(np.median(d)), "mean_l2": float(np.mean(d)),
                          "seconds": time.perf_counter() - t0}
            print(f"{q} {name:32s} median L2 {np.median(d):.4f}  mean {np.mean(d):.4f}  "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        base = dists["before"]
        for name, d in dists.items():
            rows[name]["better_than_before_share"] = float(np.mean(d < base))
            rows[name]["median_ratio_to_before"] = float(np.median(d / base))
        out["budgets"][str(q)] = rows
    write_results(args.out, out, end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
