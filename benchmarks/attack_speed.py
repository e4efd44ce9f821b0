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
import json
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

from harness import machine_facts, make_floors, model_description, run_interleaved

from jaxbundle import attacks, bundler
from jaxbundle.data import load_mnist_sample
from jaxbundle.models import SmallCNN


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
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.steps, args.floor_steps, args.repeats = 16, 9, 9, 1
    out_path = args.out or pathlib.Path(__file__).resolve().parent / "results" / (
        "attack_speed_quick.json" if args.quick else "attack_speed.json")

    module = SmallCNN()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1), jnp.float32))
    ds = load_mnist_sample("test", n=args.n)
    x, y = jnp.asarray(ds.x), jnp.asarray(ds.y)
    key = jax.random.PRNGKey(1)

    floors = make_floors(module.apply, params, x, y, args.floor_steps)
    variants = {"floor_fori": floors["floor_c_fori"], "floor_chain": floors["floor_a_chain"]}
    built = attack_list(args.steps)
    for name, (attack, norm, eps) in built.items():
        variants[name] = (
            lambda a=attack, nm=norm, e=eps: bundler.bundle(
                [a], module.apply, params, x, y, key, eps=e, norm=nm)
        )
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
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
