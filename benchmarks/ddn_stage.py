"""DDN as the default bundle's L2 minimum-norm stage, against FAB-T 3 x 50 (issue 50), on the
tuning set's demo models (benchmarks/heldout/PROTOCOL.md: a tuning measurement, not evidence).

Per L2 setting, the ``default`` bundle as the CLI runs it, and the same plan with its
``fab-t3`` stage replaced by ``ddn`` (100 steps; the escalation to AutoAttack's FAB-T then
follows DDN's success instead), both judged in float32 (AutoAttack's threat model), goal
misclassify, one batch: robust accuracy, the examples each fools that the other does not,
model passes per example counted at the model boundary (forward and backward rows), and what
the stage itself fooled of the survivors it ran on::

    python benchmarks/ddn_stage.py --n 256 --out benchmarks/results/ddn_stage.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autoattack_compare import counting  # noqa: E402

import jaxbundle  # noqa: E402
from jaxbundle import AttackSpec, bundles, data, models  # noqa: E402

SETTINGS = (("adversarial", 1.5), ("adversarial", 2.0), ("standard", 0.5), ("standard", 1.0))


def plans(eps: float, n: int) -> dict[str, jaxbundle.Plan]:
    base = bundles.default("l2", eps, goals=("misclassify",), batch_size=n, judging="float")
    attacks = tuple(AttackSpec("ddn") if a.name == "fab-t3" else a for a in base.suite.attacks)
    return {"default (fab-t3 x 50)": base,
            "ddn instead of fab-t3": base.replace(attacks=attacks, bundle=None)}


def run(apply_fn, params, x, y, plan) -> dict:
    counts = {"forward": 0, "backward": 0}
    ev = jaxbundle.evaluate(counting(apply_fn, counts), params, (x, y), plan, mesh=None,
                            keep_images=False)
    pe = ev.per_example
    robust = (pe["clean_prediction"] == pe["label"]) & ~pe["success"].astype(bool)
    stages = ev.metrics["schedule"]["stages"]
    return {"robust": robust, "robust_accuracy": 100 * float(robust.mean()),
            "passes_per_example": (counts["forward"] + counts["backward"]) / len(y),
            "stages": [{k: s[k] for k in ("attack", "examples", "survivors", "robust_accuracy")}
                       for s in stages]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    x, y = data.head(data.open_source("mnist-sample"), args.n).read(0, args.n)
    x, y = data.to_unit_float(x), np.asarray(y, np.int32)
    rows = []
    for name, eps in SETTINGS:
        apply_fn, params = models.load_or_train(models.MODELS[name])
        out = {label: run(apply_fn, params, x, y, plan)
               for label, plan in plans(eps, args.n).items()}
        (a, ra), (b, rb) = ((k, v["robust"]) for k, v in out.items())
        row = {"model": name, "eps": eps, "n": args.n,
               "only_fab_t3_fools": int(np.sum(rb & ~ra)),
               "only_ddn_fools": int(np.sum(ra & ~rb)),
               **{k: {f: v for f, v in r.items() if f != "robust"} for k, r in out.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
