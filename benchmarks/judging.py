"""Judged against float32 robust accuracy: does judging on the 8-bit grid void real successes?

The demo adversarially trained CNN (``jaxbundle.models.ADVERSARIAL``, trained or loaded from
the cache) on the first N embedded MNIST test images, in three versions of the data:

* ``on-grid``: the 8-bit images as they are;
* ``off-grid``: the same images moved by (0.37, 0.41) pixels with bilinear interpolation
  (``jaxbundle.data.translate``), so their pixels fall between the 8-bit levels, as after
  resizing or augmentation;
* ``off-grid, rounded``: the off-grid images rounded to the grid first (8-bit data again).

For Linf and L2, eps on a pixel level (51/255, 510/255) and between levels (0.3, 1.5), the
bundle (``fast``: APGD-CE and APGD-T with 3 targets, 20 steps each, plus Square with 500
queries, which searches on the grid) runs through ``jaxbundle.evaluate`` twice: with
``judging="auto"`` (the default: on the 8-bit grid where the clean image is on it, in float32
elsewhere) and with ``judging="float"``, and where eps lies between levels once more in float32
at the radius the grid allows (``norms.grid_radius``: 76/255 for Linf 0.3). The table gives
the robust accuracies, the difference between judged and float32 and how many examples were
judged on the grid; ``differ`` counts the examples whose success on the grid differs from
float32 at the grid's radius (0: the grid changes the figure by its radius, nothing else; for
off-grid data, from float32 at eps).

    python benchmarks/judging.py                 # N=256, ~6 min on 2 CPU cores
    python benchmarks/judging.py --n 64 --quick  # smoke test
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from jaxbundle import Plan, attacks, bundles, data, evaluate, models, norms

SETTINGS = (("linf", 51 / 255), ("linf", 0.3), ("l2", 510 / 255), ("l2", 1.5))


def datasets(n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    test = data.load_mnist_sample("test", n=n)
    moved = data.translate(test.x, 0.37, 0.41)
    rounded = (np.round(moved * 255) / np.float32(255)).astype(np.float32)
    return {"on-grid": (test.x, test.y), "off-grid": (moved, test.y),
            "off-grid, rounded": (rounded, test.y)}


def bundle_for(norm: str, queries: int) -> tuple:
    return bundles.bundle_attacks("fast", norm) + (attacks.square(norm, queries=queries),)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--queries", type=int, default=500, help="Square's queries")
    p.add_argument("--quick", action="store_true", help="Linf 51/255 only")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "judging.json"))
    args = p.parse_args(argv)

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    sets = datasets(args.n)
    rows = []
    settings = SETTINGS[:1] if args.quick else SETTINGS
    print("| data | norm | eps | grid radius | judged (auto) | float32 | difference | "
          "float32 at the grid radius | differ | judged on grid | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for norm, eps in settings:
        bundle = bundle_for(norm, args.queries)
        for name, (x, y) in sets.items():
            radius = norms.grid_radius(eps, norm)
            runs = {"auto": eps, "float": eps}
            if radius != eps and np.all(norms.on_grid(x)):  # off the grid, auto is float32
                runs["float@radius"] = radius
            out, success = {}, {}
            for run, e in runs.items():
                start = time.perf_counter()
                plan = Plan.of(eps=e, norm=norm, attacks=bundle, goals=("misclassify",),
                            judging=run.split("@")[0], batch_size=128)
                ev = evaluate(apply_fn, params, (x, y), plan)
                out[run], success[run] = ev.metrics, ev.per_example["success"]
                out[run]["seconds"] = time.perf_counter() - start
            auto, flt = out["auto"], out["float"]
            at_radius = out.get("float@radius", flt)
            differ = int(np.sum(success["auto"] != success.get("float@radius", success["float"])))
            row = {
                "data": name, "norm": norm, "eps": eps,
                "grid_radius": norms.grid_radius(eps, norm),
                "clean_accuracy": auto["clean_accuracy"],
                "judged_robust_accuracy": auto["robust_accuracy"],
                "float_robust_accuracy": flt["robust_accuracy"],
                "float_robust_accuracy_at_grid_radius": at_radius["robust_accuracy"],
                "differ_from_float_at_grid_radius": differ,
                "judged_mat": auto["mat"], "float_mat": flt["mat"],
                "grid_examples": auto["judging"]["grid_examples"],
                "statement": auto["judging"]["statement"],
                "seconds": sum(m["seconds"] for m in out.values()),
            }
            rows.append(row)
            print(f"| {name} | {norm} | {eps:.4g} | {row['grid_radius']:.4g} | "
                  f"{row['judged_robust_accuracy']:.1f} | {row['float_robust_accuracy']:.1f} | "
                  f"{row['judged_robust_accuracy'] - row['float_robust_accuracy']:+.1f} | "
                  f"{at_radius['robust_accuracy']:.1f} | {differ} | "
                  f"{row['grid_examples']}/{args.n} | {row['seconds']:.0f} |", flush=True)
    result = {
        "n": args.n, "queries": args.queries, "model": "jaxbundle.models.ADVERSARIAL",
        "bundle": [a.name for a in bundle_for("linf", args.queries)],
        "jax": jax.__version__, "backend": jax.default_backend(), "rows": rows,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
