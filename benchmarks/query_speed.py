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
import sys

import jax
import jax.numpy as jnp

from harness import (
    bundle_alone, machine_facts, mnist_batch, model_description, parse_run_args, run_interleaved,
    small_cnn, write_results,
)

from jaxbundle import attacks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--floor-queries", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = parse_run_args(p, argv, "query_speed",
                          dict(n=16, queries=40, floor_queries=20, repeats=1))

    module, params = small_cnn()
    x, y = mnist_batch(args.n)
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
    variants.update(bundle_alone(built, module.apply, params, x, y, key))
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
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
