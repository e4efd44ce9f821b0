"""Time per attack as a ratio to its floor: gradient evaluations x one forward+backward pass.

Each white-box attack runs alone through ``jaxbundle.bundle`` (verification included) on
``jaxbundle.models.SmallCNN()`` with random-init params and the first N real MNIST test images.
The floor of an attack that spends G gradients per example is G x (the median time of one
chained forward+backward pass of the same batch, measured as ``floor_fori``: a
``lax.fori_loop`` of ``--floor-steps`` gradients, divided by that count). All variants are timed
in one process, interleaved and rotated every round; medians and minima are reported (see
``harness.py``).

    python benchmarks/attack_speed.py                 # N=256, 7 rounds
    python benchmarks/attack_speed.py --quick         # N=16, 1 round, tiny budgets
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax

from harness import (
    bundle_alone, machine_facts, make_floors, mnist_batch, model_description, parse_run_args,
    run_interleaved, small_cnn, write_results,
)

from jaxbundle import attacks


def attack_list(steps: int) -> dict[str, tuple[Any, str, float]]:
    """name -> (attack, norm, eps); every attack at about ``steps`` gradients per example."""
    return {
        "pgd-ce": (attacks.pgd("linf", "ce", steps=steps), "linf", 0.3),
        "apgd-ce": (attacks.apgd("linf", "ce", steps=steps), "linf", 0.3),
        "apgd-t (3 targets)": (
            attacks.apgd("linf", "dlr-targeted", steps=steps, targets=3), "linf", 0.3),
        "fmn-linf": (attacks.fmn("linf", steps=steps), "linf", 0.3),
        "fmn-l2": (attacks.fmn("l2", steps=steps), "l2", 2.0),
        "bp": (attacks.bp(steps=steps), "l2", 2.0),
        "cw-l2": (attacks.cw(steps=max(steps // 4, 1), search_steps=4), "l2", 2.0),
        "deepfool-l2 (9 classes)": (attacks.deepfool("l2", steps=max(steps // 9, 1)), "l2", 2.0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="gradients per example per attack")
    p.add_argument("--floor-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=7)
    args = parse_run_args(p, argv, "attack_speed", dict(n=16, steps=9, floor_steps=9, repeats=1))

    module, params = small_cnn()
    x, y = mnist_batch(args.n)
    key = jax.random.PRNGKey(1)

    floors = make_floors(module.apply, params, x, y, args.floor_steps)
    variants = {"floor_fori": floors["floor_c_fori"], "floor_chain": floors["floor_a_chain"]}
    built = attack_list(args.steps)
    variants.update(bundle_alone(built, module.apply, params, x, y, key))
    res = run_interleaved(variants, args.repeats, f"attacks N={args.n}")
    loads = res.pop("_load_avg_per_round")
    per_grad = min(res["floor_fori"]["median_s"], res["floor_chain"]["median_s"]) / args.floor_steps
    per_grad_min = min(res["floor_fori"]["min_s"], res["floor_chain"]["min_s"]) / args.floor_steps
    rows = {}
    print(f"\nN={args.n}: one forward+backward {per_grad * 1e3:.2f} ms (median), load {loads}")
    for name, (attack, _, _) in built.items():
        g = attack.gradients
        r = res[name]
        rows[name] = {
            "gradients": g, "median_s": r["median_s"], "min_s": r["min_s"],
            "compile_s": r["compile_s"],
            "ratio_to_floor": r["median_s"] / (g * per_grad),
            "ratio_min_to_floor_min": r["min_s"] / (g * per_grad_min),
            "times_s": r["times_s"],
        }
        print(f"{name:24s} {g:4d} grads  median {r['median_s'] * 1e3:8.1f} ms  "
              f"ratio {rows[name]['ratio_to_floor']:5.2f}  "
              f"ratio(min) {rows[name]['ratio_min_to_floor_min']:5.2f}")
    out = {"machine": machine_facts(), "model_facts": model_description(module, params),
           "n": args.n, "floor_steps": args.floor_steps, "per_gradient_s": per_grad,
           "per_gradient_min_s": per_grad_min, "load_avg_per_round": loads,
           "floors": {k: res[k] for k in ("floor_fori", "floor_chain")}, "attacks": rows}
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
