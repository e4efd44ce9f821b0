"""DDN against its authors' code, per example, on the demo CNNs (issue 50).

The reference is ``ddn`` of jeromerony/adversarial-library (PyPI ``adv-lib``, 0.2.8), run in
torch on a copy of the same weights (``autoattack_compare.torch_network``, logits checked
equal), with its defaults (100 steps, gamma 0.05, init_norm 1, levels 256). jaxbundle's ``ddn``
runs alone in a bundle with the CLI's judging (the embedded test images are on the 8-bit grid,
so each iterate is rounded to it, as the reference's ``levels=256`` does). Per example: the
smallest L2 distortion found (inf: none), and how the two compare.

Needs the benchmark environment (benchmarks/README.md) plus ``pip install --no-deps
adv-lib==0.2.8``; adv-lib's package ``__init__`` imports torchvision and visdom for other
attacks, so the one module is loaded from its file with a stand-in for its plotting logger::

    python benchmarks/ddn_fidelity.py --n 256 --out benchmarks/results/ddn_fidelity.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autoattack_compare import torch_network  # noqa: E402

import jaxbundle  # noqa: E402
from jaxbundle import data, models  # noqa: E402
from jaxbundle.attacks import ddn  # noqa: E402


def reference_ddn():
    """adv-lib's ``ddn``, loaded from its module file (see the module docstring)."""
    import adv_lib

    logger = types.ModuleType("adv_lib.utils.visdom_logger")
    logger.VisdomLogger = object
    sys.modules.setdefault("adv_lib.utils.visdom_logger", logger)
    path = os.path.join(os.path.dirname(adv_lib.__file__), "attacks",
                        "decoupled_direction_norm.py")
    spec = importlib.util.spec_from_file_location("adv_lib_ddn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ddn


def run_reference(net, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    import torch

    xt = torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    yt = torch.tensor(y.astype(np.int64))
    start = time.perf_counter()
    adv = reference_ddn()(net, xt, yt)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        fooled = (net(adv).argmax(1) != yt).numpy()
    dist = (adv - xt).flatten(1).norm(dim=1).numpy().astype(np.float64)
    return np.where(fooled, dist, np.inf), seconds


def run_jaxbundle(apply_fn, params, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    r = jaxbundle.bundle([ddn()], apply_fn, params, jnp.asarray(x), jnp.asarray(y),
                         jax.random.key(0), eps=0.0, norm="l2", goals=("min_norm",))
    score = jax.block_until_ready(r.best["min_norm"].score)
    seconds = time.perf_counter() - start
    dist = np.asarray(score.distortion, np.float64)
    return np.where(np.asarray(score.misclassified), dist, np.inf), seconds


def compare(ours: np.ndarray, theirs: np.ndarray, correct: np.ndarray) -> dict:
    both = correct & np.isfinite(ours) & np.isfinite(theirs)
    rel = (ours[both] - theirs[both]) / theirs[both]
    return {
        "correct": int(correct.sum()),
        "found_jaxbundle": int(np.sum(correct & np.isfinite(ours))),
        "found_reference": int(np.sum(correct & np.isfinite(theirs))),
        "both": int(both.sum()),
        "median_distortion_jaxbundle": float(np.median(ours[both])),
        "median_distortion_reference": float(np.median(theirs[both])),
        "median_relative_difference": float(np.median(rel)),
        "within_1_percent": float(np.mean(np.abs(rel) <= 0.01)),
        "within_5_percent": float(np.mean(np.abs(rel) <= 0.05)),
        "jaxbundle_smaller": int(np.sum(rel < -1e-6)),
        "reference_smaller": int(np.sum(rel > 1e-6)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--models", default="adversarial,standard")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    x, y = data.head(data.open_source("mnist-sample"), args.n).read(0, args.n)
    x, y = data.to_unit_float(x), np.asarray(y, np.int32)
    results = {}
    for name in args.models.split(","):
        apply_fn, params = models.load_or_train(models.MODELS[name])
        net = torch_network(params)
        logits = np.asarray(apply_fn(params, jnp.asarray(x)))
        with torch.no_grad():
            theirs_logits = net(torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2))))
        gap = float(np.max(np.abs(theirs_logits.numpy() - logits)))
        correct = logits.argmax(-1) == y
        ours, ours_s = run_jaxbundle(apply_fn, params, x, y)
        theirs, theirs_s = run_reference(net, x, y)
        results[name] = {**compare(ours, theirs, correct), "logit_gap": gap,
                         "seconds_jaxbundle_cold": ours_s, "seconds_reference": theirs_s}
        print(name, json.dumps(results[name], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n": args.n, "steps": 100, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
