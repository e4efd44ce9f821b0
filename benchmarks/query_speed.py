"""Black-box attacks: queries per second as a ratio to the model's raw forward throughput.

Each black-box attack runs alone through ``jaxbundle.bundle`` (verification included) on
``jaxbundle.models.SmallCNN()`` with random-init params and the first N real MNIST test images.
Its floor is (queries per example) x (one forward pass of the batch), the forward time measured
as a ``lax.fori_loop`` of ``--floor-queries`` chained forward passes. A ratio of 1.0 means the
attack runs as fast as the bare model answers queries; above that is the attack's own work
(proposals, projections, the bundler's scoring, and for decision-based attacks the evaluator's
logits on every candidate). Interleaved rounds, medians (``harness.py``).

    python benchmarks/query_speed.py            # N=256, 1,000 queries, 5 rounds
    python benchmarks/query_speed.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from harness import machine_facts, model_description, run_interleaved

from jaxbundle import attacks, bundler
from jaxbundle.data import load_mnist_sample
from jaxbundle.models import SmallCNN


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--floor-queries", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.queries, args.floor_queries, args.repeats = 16, 40, 20, 1
    out_path = args.out or pathlib.Path(__file__).resolve().parent / "results" / (
        "query_speed_quick.json" if args.quick else "query_speed.json")

    module = SmallCNN()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1), jnp.float32))
    ds = load_mnist_sample("test", n=args.n)
    x, y = jnp.asarray(ds.x), jnp.asarray(ds.y)
    key = jax.random.PRNGKey(1)

    @jax.jit
    def forwards(p, xa):
        def body(_, v):  # chained so that nothing is hoisted or dropped
            return v + 1e-9 * jnp.mean(module.apply(p, v))
        return jax.lax.fori_loop(0, args.floor_queries, body, xa)

    q = args.queries
    built = {
        "square-linf": (attacks.square("linf", queries=q), "linf", 0.3),
        "square-l2": (attacks.square("l2", queries=q), "l2", 2.0),
        "rays": (attacks.rays(steps=q - 1), "linf", 0.3),
        "surfree": (attacks.surfree(queries=q), "l2", 2.0),
        "spsa (128 probes/step)": (attacks.spsa(steps=max(q // 129, 1)), "linf", 0.3),
    }
    variants = {"floor_forwards": lambda: forwards(params, x)}
    for name, (attack, norm, eps) in built.items():
        variants[name] = (
            lambda a=attack, nm=norm, e=eps: bundler.bundle(
                [a], module.apply, params, x, y, key, eps=e, norm=nm)
        )
    res = run_interleaved(variants, args.repeats, f"queries N={args.n}")
    loads = res.pop("_load_avg_per_round")
    per_query = res["floor_forwards"]["median_s"] / args.floor_queries
    per_query_min = res["floor_forwards"]["min_s"] / args.floor_queries
    rows = {}
    print(f"\nN={args.n}: one forward pass {per_query * 1e3:.2f} ms (median), load {loads}")
    for name, (attack, _, _) in built.items():
        r = res[name]
        rows[name] = {
            "queries": attack.queries, "median_s": r["median_s"], "min_s": r["min_s"],
            "compile_s": r["compile_s"],
            "queries_per_second_per_example": attack.queries / r["median_s"],
            "ratio_to_floor": r["median_s"] / (attack.queries * per_query),
            "ratio_min_to_floor_min": r["min_s"] / (attack.queries * per_query_min),
            "times_s": r["times_s"],
        }
        print(f"{name:24s} {attack.queries:5d} queries  median {r['median_s'] * 1e3:8.1f} ms  "
              f"ratio {rows[name]['ratio_to_floor']:5.2f}  "
              f"ratio(min) {rows[name]['ratio_min_to_floor_min']:5.2f}")
    out = {"machine": machine_facts(), "model_facts": model_description(module, params),
           "n": args.n, "per_query_s": per_query, "per_query_min_s": per_query_min,
           "load_avg_per_round": loads, "floor": res["floor_forwards"], "attacks": rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
