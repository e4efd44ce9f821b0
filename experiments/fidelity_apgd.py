"""APGD fidelity (issue 14): robust accuracy of APGD-CE on the demo adversarial CNN (Linf 0.3)
before and after matching the reference code (fra31/auto-attack ``autopgd_base.py``).

"before" is the previous implementation, loaded from git (``git show cb7ed30~1:...``): the
paper's ceil(p_j N) checkpoints and the momentum dropped after a halving. "after" is the
default now: the reference code's floored checkpoints, its halving rule and the momentum kept.
Two ablations of the new code separate the two changes. Each run is one APGD-CE of ``steps``
iterations, 1 restart, through ``jaxbundle.bundle`` (verified on the 8-bit grid).

    python experiments/fidelity_apgd.py --n 500    # ~2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import attacks, data, models
from jaxbundle.bundler import bundle

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEFORE = "cb7ed30~1"  # the last commit with the previous APGD


def old_apgd():
    """The previous ``apgd`` factory, from git."""
    source = subprocess.run(["git", "show", f"{BEFORE}:jaxbundle/attacks/apgd.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    path = pathlib.Path("/tmp/jaxbundle_apgd_before.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("apgd_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.apgd


def robust_accuracy(attack, apply_fn, params, x, y, batch=250):
    start, correct = time.perf_counter(), 0
    for i in range(0, len(y), batch):
        r = bundle([attack], apply_fn, params, jnp.asarray(x[i:i + batch]),
                   jnp.asarray(y[i:i + batch]), jax.random.key(0), eps=0.3, norm="linf",
                   example_id=jnp.arange(i, i + len(y[i:i + batch]), dtype=jnp.int32))
        correct += int(jnp.sum(~r.best["misclassify"].score.misclassified))
    return 100.0 * correct / len(y), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--out", default=str(ROOT / "experiments/results/fidelity_apgd.json"))
    args = parser.parse_args()
    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    test = data.load_mnist_sample("test", n=args.n)
    before = old_apgd()
    rows = {}
    for steps in args.steps:
        new = attacks.apgd("linf", "ce", steps=steps)
        variants = {
            "before (paper checkpoints, momentum dropped)": before("linf", "ce", steps=steps),
            "after (reference checkpoints, momentum kept)": new,
            "after, paper checkpoints": attacks.apgd("linf", "ce", steps=steps,
                                                     schedule="paper"),
            "after, momentum dropped": new._replace(
                config=new.config._replace(keep_momentum=False)),
        }
        rows[steps] = {}
        for label, attack in variants.items():
            acc, seconds = robust_accuracy(attack, apply_fn, params, test.x, test.y)
            rows[steps][label] = {"robust_accuracy": acc, "seconds": round(seconds, 1)}
            print(f"APGD-CE {steps:>3} steps  {label:<46} {acc:6.2f}%  {seconds:5.1f} s",
                  flush=True)
    result = {
        "model": "demo adversarial CNN (models.ADVERSARIAL)", "eps": 0.3, "norm": "linf",
        "n": args.n, "restarts": 1, "before": BEFORE, "jax": jax.__version__,
        "clean_accuracy": 100.0 * float(np.mean(
            np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(test.x)), -1)) == test.y)),
        "robust_accuracy": rows,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
