"""Issue 13's proof: how a randomised defence fools a naive evaluation, in numbers.

The defence is the main job's ``--models randomized``: the adversarially trained demo CNN
behind Gaussian input noise (std 0.1) and a random shift of up to 2 pixels, a fresh draw per
image and call. On the first ``--n`` test images of the embedded MNIST sample (Linf eps 0.3),
APGD-CE runs through ``jaxbundle.evaluate`` in four settings:

* ``single call, no EOT``: the attack's gradients are single draws and each candidate is
  judged by one call of the model, as a deterministic evaluation would treat it;
* ``32 calls, no EOT``: the same attack, judged by the success rate over 32 fresh calls
  (fooled in more than half of them);
* ``32 calls, EOT-8``: every gradient averaged over 8 samples (a vmap axis; 8 model passes);
* ``32 calls, EOT-8, 2 restarts``: the best of two restarts *on average* over the judge's
  calls (the bundling paper's rule), not the luckiest.

For the single-call run the script also re-judges its adversarial images with 32 fresh calls:
how many of the examples it counted as fooled are still fooled in more than half of the calls
(a single lucky call does not survive redeployment). The deterministic CNN without the defence
is the reference.

    python experiments/randomized_proof.py --n 200   # ~15 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import Plan, data, evaluate, models, sampling, suites
from jaxbundle.models.randomized import DEFENCES

EPS = 0.3


def rejudged_rate(model, params, x_adv, y, calls, seed=123):
    """Each image's success rate over ``calls`` fresh calls (keys no evaluation used)."""
    keys = jax.random.split(jax.random.key(seed), (calls, len(y)))
    x_adv = data.to_unit_float(x_adv)  # uint8 when judged on the 8-bit grid
    logits = sampling.sample_logits(model, params, jnp.asarray(x_adv), keys)
    return np.mean(np.asarray(jnp.argmax(logits, -1)) != np.asarray(y)[None], axis=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--eot", type=int, default=8)
    p.add_argument("--out", default="experiments/results/randomized_proof.json")
    args = p.parse_args(argv)

    base, params = models.load_or_train(models.ADVERSARIAL)
    d = DEFENCES["randomized"]
    ds = data.load_mnist_sample("test", n=args.n)
    x, y = np.asarray(ds.x), np.asarray(ds.y)
    apgd = suites.attack("apgd-ce", "linf", steps=args.steps)
    settings = {
        "single call, no EOT": (1, 1, 1),
        f"{args.calls} calls, no EOT": (args.calls, 1, 1),
        f"{args.calls} calls, EOT-{args.eot}": (args.calls, args.eot, 1),
        f"{args.calls} calls, EOT-{args.eot}, 2 restarts": (args.calls, args.eot, 2),
    }
    rows = {}
    start = time.perf_counter()
    plan = Plan.of(eps=EPS, attacks=(apgd,), goals=("misclassify",), batch_size=100)
    ref = evaluate(base, params, (x, y), plan)
    rows["deterministic CNN (no defence)"] = dict(
        clean_accuracy=ref.metrics["clean_accuracy"],
        robust_accuracy=ref.metrics["robust_accuracy"],
        seconds=time.perf_counter() - start)
    for label, (calls, eot, restarts) in settings.items():
        model = models.randomized(base, noise=d.noise, shift=d.shift, calls=calls)
        start = time.perf_counter()  # every attack averages eot samples per call (with_eot)
        ev = evaluate(model, params, (x, y),
                      plan.replace(attacks=(apgd._replace(num_restarts=restarts),), eot=eot))
        pe = ev.per_example
        row = dict(clean_accuracy=ev.metrics["clean_accuracy"],
                   robust_accuracy=ev.metrics["robust_accuracy"],
                   gradients_per_example=float(np.mean(pe["gradients"])),
                   mean_success_rate=ev.metrics["stochastic"]["mean_success_rate"],
                   robust_accuracy_at_threshold=ev.metrics["stochastic"][
                       "robust_accuracy_at_threshold"],
                   randomness_check=ev.metrics["checks"]["randomness"]["passed"],
                   seconds=time.perf_counter() - start)
        if calls == 1:
            rate = rejudged_rate(model, params, pe["x_adv"], y, args.calls)
            fooled = pe["success"].astype(bool)
            row["fooled_by_one_call"] = int(fooled.sum())
            row[f"of_those_fooled_in_most_of_{args.calls}_fresh_calls"] = int(
                np.sum(fooled & (rate > 0.5)))
            correct = pe["clean_prediction"] == y
            row[f"robust_accuracy_rejudged_{args.calls}_calls"] = 100.0 * float(
                np.mean(correct & ~(rate > 0.5)))
        rows[label] = row
        print(label, json.dumps(row), flush=True)
    record = dict(config=vars(args), eps=EPS, defence=d._asdict(), rows=rows)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
