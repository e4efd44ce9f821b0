"""At what precision should the attacks search? Their strength when their matrix products run
as an accelerator runs them (issue 48).

Verdicts and certificates run at float32 ``Precision.HIGHEST`` (``jaxbundle.arithmetic``); the
attacks only propose candidates, so they may run faster and narrower. Here the ``default``
bundle runs with its model passes in float32, and under an emulated GPU (TF32) and TPU
(bfloat16 passes) at the backend's default (one pass on a TPU) and at ``Precision.HIGH``, what
jaxbundle's attacks use (TF32 on a GPU, three bfloat16 passes on a TPU; ``tests/emulation.py``:
XLA:CPU rounds the operands of every such product), the judge in float32 every time, on a
tuning model (the PGD-trained demo ``adversarial`` SmallCNN, embedded test images 0..``n``,
Linf 0.3) and a held-out one (the zoo's ``cnn-pgd-0.3``, its 256 evaluation images, Linf 0.3):
robust accuracy, and the examples each emulated run fools that the float32 run does not and
the reverse. Speed is not measured here (XLA:CPU has no narrower units): on an accelerator the
narrower products are the faster ones.

    python benchmarks/attack_precision.py            # about 25 minutes on 2 CPU cores
    python benchmarks/attack_precision.py --quick    # n = 64
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

import jax
import numpy as np

from harness import machine_facts, parse_run_args, write_results

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "heldout"))
sys.path.insert(0, str(HERE.parent / "tests"))
import emulation  # noqa: E402
import zoo  # noqa: E402

import jaxbundle  # noqa: E402
from jaxbundle import bundles, models  # noqa: E402
from jaxbundle.data import load_mnist_sample  # noqa: E402


def run(name: str, apply_fn, params, x, y, eps: float) -> dict:
    """The default bundle under each emulated default, judged in float32."""
    plan = bundles.plan("default", "linf", eps)
    out, success = {"n": int(len(y)), "eps": eps}, {}
    for fmt, search in (("float32", "high"), ("tf32", "default"), ("tf32", "high"),
                        ("bfloat16", "default"), ("bfloat16", "high")):
        label = fmt if fmt == "float32" else f"{fmt}/{search}"
        start = time.perf_counter()
        forced = contextlib.nullcontext() if search == "high" else (
            jax.default_matmul_precision(search))  # the search at the default; verdicts not
        with emulation.default_precision(fmt), forced:
            ev = jaxbundle.evaluate(apply_fn, params, (x, y), plan, mesh=None)
        success[label] = ev.per_example["success"].astype(bool)
        out[label] = {"robust_accuracy": ev.metrics["robust_accuracy"],
                      "clean_accuracy": ev.metrics["clean_accuracy"],
                      "seconds": round(time.perf_counter() - start, 1)}
        if label != "float32":
            out[label]["fooled_only_here"] = int(np.sum(success[label] & ~success["float32"]))
            out[label]["fooled_only_in_float32"] = int(
                np.sum(success["float32"] & ~success[label]))
        print(name, label, out[label], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    args = parse_run_args(p, argv, "attack_precision", {"n": 64})
    results = {"machine": machine_facts(), "models": {}}
    sample = load_mnist_sample("test", args.n)
    apply_fn, params = models.load_or_train(models.MODELS["adversarial"])
    results["models"]["adversarial (tuning)"] = run("adversarial", apply_fn, params, sample.x,
                                                     sample.y, 0.3)
    apply_fn, variables = zoo.load("cnn-pgd-0.3")
    x, y = zoo.dataset(zoo.ZOO["cnn-pgd-0.3"].data, "test", start=zoo.EVAL_START,
                       n=min(args.n, zoo.EVAL_N))
    results["models"]["cnn-pgd-0.3 (held out)"] = run("cnn-pgd-0.3", apply_fn, variables, x, y,
                                                       0.3)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
