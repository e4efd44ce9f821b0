"""Variants of the default bundle against a stored AutoAttack result, example by example.

Each variant is a bundle in :data:`jaxbundle.bundles.BUNDLES`' format with its own focus, run
as a cascade through ``jaxbundle.evaluate`` exactly as the CLI runs a named bundle, with the model
passes counted at the model boundary (``autoattack_compare.counting``). AutoAttack is not run
again: its per-example result comes from ``autoattack_compare.py --aa-cache DIR``, so the
variants see the same weights, images and AutoAttack verdicts. A variant file holds one JSON
object per line::

    {"name": "v1", "bundle": [["apgd-ce", {"steps": 20}], ["square-aa", {"queries": 5000}]],
     "focus": {"square-aa": 0.08}, "segments": 6}

    python benchmarks/default_variants.py --model adversarial --eps 0.3255 \\
        --aa-cache /tmp/aa --variants variants.jsonl --out results.jsonl

Needs only jaxbundle (torch is not imported).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from autoattack_compare import _cached_autoattack, counting, run_jaxbundle

from jaxbundle import AttackSpec, bundles, data, models


def run_variant(variant: dict, apply_fn, params, x, y, eps, robust_aa, aa) -> dict:
    """Registers ``variant`` as a named bundle, runs it counted, compares it with AutoAttack."""
    name = f"variant-{variant['name']}"
    schedule = (bundles.Cascade(focus=variant.get("focus", {}),
                                segments=variant.get("segments", 1))
                if variant.get("schedule", "cascade") == "cascade" else bundles.Full())
    bundles.BUNDLES[name] = bundles.Bundle(
        tuple((AttackSpec(a, **o), None) for a, o in variant["bundle"]), schedule)
    counts = {"forward": 0, "backward": 0}
    start = time.perf_counter()
    robust, result = run_jaxbundle(counting(apply_fn, counts), params, x, y, eps, name)
    jax.effects_barrier()
    seconds = time.perf_counter() - start
    passes = (counts["forward"] + counts["backward"]) / len(y)
    stages = (result.metrics.get("schedule") or {}).get("stages") or []
    return {
        **variant, "eps": eps, "n": len(y),
        "robust": 100 * float(robust.mean()), "autoattack_robust": aa["robust_accuracy"],
        "robust_here_fooled_by_autoattack": int(np.sum(robust & ~robust_aa)),
        "fooled_here_robust_under_autoattack": int(np.sum(~robust & robust_aa)),
        "passes_per_example": passes, "passes_ratio": passes / aa["passes_per_example"],
        "seconds_counted_cold": seconds,
        "stages": [[s["attack"], s["examples"], round(s["robust_accuracy"], 2)] for s in stages],
        "robust_idx": np.flatnonzero(robust).tolist(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="adversarial")
    parser.add_argument("--eps", required=True, help="comma-separated eps values")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--aa-cache", required=True, metavar="DIR")
    parser.add_argument("--variants", required=True, metavar="JSONL")
    parser.add_argument("--out", default=None, metavar="JSONL", help="results appended here")
    args = parser.parse_args(argv)
    apply_fn, params = models.load_or_train(models.MODELS[args.model])
    sample = data.load_mnist_sample("test", n=args.n)
    x, y = np.asarray(sample.x, np.float32), np.asarray(sample.y)
    with open(args.variants) as f:
        variants = [json.loads(line) for line in f if line.strip()]
    for eps in (float(e) for e in args.eps.split(",")):
        cached = _cached_autoattack(args.aa_cache, args.model, eps, args.n)
        if cached is None:
            raise SystemExit(f"no stored AutoAttack result for {args.model} at {eps} in "
                             f"{args.aa_cache}: run autoattack_compare.py --aa-cache first")
        aa, robust_aa = cached
        for variant in variants:
            row = {"model": args.model, **run_variant(variant, apply_fn, params, x, y, eps,
                                                      robust_aa, aa)}
            print(f"{args.model} {round(eps * 255)}/255 {variant['name']}: robust "
                  f"{row['robust']:.1f} (AA {aa['robust_accuracy']:.1f}), disagree "
                  f"{row['robust_here_fooled_by_autoattack']}/"
                  f"{row['fooled_here_robust_under_autoattack']}, passes "
                  f"{row['passes_per_example']:.0f} ({row['passes_ratio']:.3f}), "
                  f"{row['seconds_counted_cold']:.0f} s, stages {row['stages']}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
