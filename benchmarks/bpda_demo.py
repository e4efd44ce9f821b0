"""BPDA against a defence whose gradients are broken by design: the evidence, in numbers.

The model is the demo ``quantized`` defence (``jaxbundle.models.quantized``: bit-depth
reduction to 2 bits and JPEG-like compression at quality 90 in front of the adversarially
trained demo CNN, whose weights it reuses). One plan, in full mode so that every attack's own
figure is reported (the many-attack table): APGD-CE and APGD-T (white-box) and Square
(black-box), Linf ``--eps`` on the first ``--n`` images of the embedded MNIST test sample. It
is run on

* ``naive``: the defence attacked straight through its preprocessing, whose gradient is
  exactly zero (what a naive evaluation does);
* ``bpda``: the same model attacked with BPDA (``jaxbundle.with_bpda``: the preprocessing
  forward, the identity's gradient backward);
* ``undefended``: the adversarial CNN alone, for reference.

For each: the clean accuracy, the white-box, black-box and bundled robust accuracy, each
attack's, the checks that failed, and a re-check that every reported adversarial image is
misclassified by the true defended model (judging never uses BPDA's backward pass).

    python benchmarks/bpda_demo.py               # n = 256, about 3 minutes on 2 CPU cores
    python benchmarks/bpda_demo.py --quick       # n = 64
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from harness import machine_facts, parse_run_args, write_results

import jaxbundle
from jaxbundle import models
from jaxbundle.data import load_mnist_sample

ATTACKS = (jaxbundle.AttackSpec("apgd-ce", steps=100), jaxbundle.AttackSpec("apgd-t", steps=100),
           jaxbundle.AttackSpec("square", queries=1000))


def _images(x_adv: np.ndarray) -> np.ndarray:
    return x_adv.astype(np.float32) / 255 if x_adv.dtype == np.uint8 else x_adv


def run(name: str, model, params, x, y, plan) -> dict:
    """One model under the plan: its figures, failed checks and the re-judged successes."""
    start = time.perf_counter()
    ev = jaxbundle.evaluate(model, params, (x, y), plan, mesh=None)
    seconds = time.perf_counter() - start
    m, pe = ev.metrics, ev.per_example
    defended = model if name == "undefended" else jaxbundle.with_bpda(model, False)
    predicted = np.asarray(jnp.argmax(defended(params, jnp.asarray(_images(pe["x_adv"]))), -1))
    success = np.asarray(pe["success"], bool)
    return {
        "clean_accuracy": m["clean_accuracy"],
        "white_box_robust_accuracy": m["white_box_robust_accuracy"],
        "black_box_robust_accuracy": m["black_box_robust_accuracy"],
        "robust_accuracy": m["robust_accuracy"],
        "mat": m["mat"],
        "failed_checks": {k: c["examples"] for k, c in m["checks"].items() if not c["passed"]},
        "preprocessing_check": m["checks"].get("preprocessing", {}).get("saw"),
        "fooled": int(success.sum()),
        "fooled_misclassified_by_true_model": int(np.sum(success & (predicted != y))),
        "seconds": round(seconds, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--eps", type=float, default=0.3)
    args = parse_run_args(p, argv, "bpda_demo", {"n": 64})
    base, params = models.load_or_train(models.ADVERSARIAL)
    defence = models.DEFENCES["quantized"]
    naive = defence.wrap(base)
    ds = load_mnist_sample("test", n=args.n)
    x, y = np.asarray(ds.x, np.float32), np.asarray(ds.y)
    plan = jaxbundle.Plan.of(eps=args.eps, attacks=ATTACKS, batch_size=128)
    results = {
        "setting": {"n": args.n, "eps": args.eps, "norm": "linf", "defence": defence._asdict(),
                    "attacks": [a._asdict() for a in ATTACKS], "mode": plan.schedule.mode},
        "machine": machine_facts(),
        "models": {},
    }
    for name, model in (("naive", naive), ("bpda", jaxbundle.with_bpda(naive)),
                        ("undefended", base)):
        results["models"][name] = r = run(name, model, params, x, y, plan)
        print(f"{name:10s} clean {r['clean_accuracy']:.1f}  white-box "
              f"{r['white_box_robust_accuracy']:.1f}  black-box "
              f"{r['black_box_robust_accuracy']:.1f}  bundled {r['robust_accuracy']:.1f}  "
              f"failed {r['failed_checks']}  ({r['seconds']} s)")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
