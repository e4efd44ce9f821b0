"""Before/after numbers for issue 14's CW, FMN and BP changes on the demo adversarial model.

On the first ``--n`` test images the model classifies correctly, through ``bundle`` with
``judging="float"`` (no grid rounding), per attack: the success rate and the median smallest
adversarial distortion (inf for a failure), in the attack's norm.

* CW-L2: the light budget (``cw()``, 100 steps/stage, c0 = 1e-2, no abort) against the
  reference budget (``cw_reference()``: abort_early, c0 = 1e-3, 9 stages, lr 1e-2) CAPPED at
  ``--cw-max-iterations`` steps per stage (default 1000, not the reference's 10,000) so that
  the script stays within a few minutes on 2 CPU cores.
* FMN-Linf: ``alpha_init=10`` (the old default) against 1 (the new default, both reference
  codes), 100 steps.
* BP: renamed only (``"bp-variant"``), the numbers of the default are given for the record.

Writes experiments/results/fidelity_cw_fmn_bp.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import attacks, data, models
from jaxbundle.attacks import cw_reference
from jaxbundle.bundler import bundle

OUT = pathlib.Path(__file__).parent / "results" / "fidelity_cw_fmn_bp.json"


def run(attack, apply_fn, params, x, y, norm):
    start = time.perf_counter()
    r = bundle([attack], apply_fn, params, x, y, jax.random.key(0), eps=0.0, norm=norm,
               judging="float")
    s = r.best["min_norm"].score
    d = np.where(np.asarray(s.misclassified), np.asarray(s.distortion), np.inf)
    return {"name": attack.name, "norm": norm, "success_rate": float(np.isfinite(d).mean()),
            "median_distortion": float(np.median(d)), "gradients": attack.gradients,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--cw-max-iterations", type=int, default=1000)
    args = parser.parse_args()
    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    ds = data.load_mnist_sample("test", n=4 * args.n)
    correct = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(ds.x)), -1) == jnp.asarray(ds.y))
    x, y = jnp.asarray(ds.x[correct][: args.n]), jnp.asarray(ds.y[correct][: args.n])
    runs = {
        "cw_light_before": (attacks.cw(), "l2"),
        "cw_reference_capped_after": (
            cw_reference(max_iterations=args.cw_max_iterations, name="cw-l2-reference-capped"),
            "l2"),
        "fmn_linf_alpha10_before": (attacks.fmn("linf", alpha_init=10.0, name="fmn-a10"), "linf"),
        "fmn_linf_alpha1_after": (attacks.fmn("linf"), "linf"),
        "bp_variant": (attacks.bp(), "l2"),
    }
    out = {"n": int(len(y)), "cw_max_iterations_cap": args.cw_max_iterations,
           "machine": {"jax": jax.__version__, "backend": jax.default_backend()}}
    for key, (attack, norm) in runs.items():
        out[key] = run(attack, apply_fn, params, x, y, norm)
        print(key, out[key], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
