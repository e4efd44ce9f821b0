"""Issue 14, RayS blocks as the reference's (uclaml/RayS ``attack_hard_label``), in two changes:

* ``channels_first`` (commit ``46affa0``, against ``d5f2fb3``): blocks cut over the
  channels-first (C, H, W) flattening, as the reference (which flattens PyTorch's NCHW
  tensors), not over jaxbundle's channels-last (H, W, C) one;
* ``block_sizes`` (the working tree, against ``46affa0``): blocks of ``ceil(D / 2^s)`` pixels
  (the last shorter) instead of an even split into ``min(2^s, D)`` blocks, and single pixels
  for good after the single-pixel stage instead of a return to stage 0.

Each earlier version is ``jaxbundle/attacks/rays.py`` at its commit, read with ``git show`` and
imported under another name.

1. The demo adversarially trained CNN on the first ``--n`` correctly classified MNIST test
   images: median smallest Linf distortion with ``--steps`` queries. MNIST has one channel,
   where both orders are the same flattening, so the channels-first change must match exactly
   (checked).
2. Colour: a randomly initialised SmallCNN on ``--n-colour`` random uniform 32x32x3 images
   labelled by itself: the same numbers, where the block hierarchy does differ.

    python experiments/fidelity_rays.py      # ~3 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbundle import data, models
from jaxbundle.attacks import rays as rays_new
from jaxbundle.bundler import bundle
from jaxbundle.models.architectures import SmallCNN

from _results import write_results

CHANNELS_LAST = "d5f2fb3"  # the last commit with channels-last blocks
EVEN_SPLIT = "46affa0"  # channels first, min(2^s, D) evenly split blocks, back to stage 0
CHANGES = {"channels_first": ("channels_last", "even_split"),  # change: (before, after)
           "block_sizes": ("even_split", "reference_blocks")}


def old_module(commit: str, path: str, name: str):
    """``path`` as it was at ``commit``, imported as module ``name``."""
    src = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True,
                         text=True).stdout
    tmp = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location(name, tmp)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def min_linf(attack, apply_fn, params, x, y) -> np.ndarray:
    r = bundle([attack], apply_fn, params, jnp.asarray(x), jnp.asarray(y), jax.random.key(0),
               eps=0.0, norm="linf", goals=("min_norm",))
    s = r.best["min_norm"].score
    assert np.all(np.asarray(r.queries) == attack.queries)
    return np.where(np.asarray(s.misclassified), np.asarray(s.distortion), np.inf)


def summary(d: np.ndarray, seconds: float) -> dict:
    return {"median_linf": float(np.median(d)), "mean_linf": float(np.mean(d)),
            "success_rate": float(np.isfinite(d).mean()), "seconds": seconds}


def compare(versions: dict, apply_fn, params, x, y) -> dict:
    """Each version's figures, and each change (``before -> after``) per example."""
    out, per_example = {}, {}
    for label, attack in versions.items():
        t0 = time.perf_counter()
        per_example[label] = min_linf(attack, apply_fn, params, x, y)
        out[label] = summary(per_example[label], time.perf_counter() - t0)
    for change, (b, a) in CHANGES.items():
        before, after = per_example[b], per_example[a]
        out[change] = {"before": b, "after": a,
                       "identical_per_example": bool(np.array_equal(before, after)),
                       "after_better_share": float(np.mean(after < before)),
                       "after_worse_share": float(np.mean(after > before))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--n-colour", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path("experiments/results/fidelity_rays.json"))
    args = p.parse_args(argv)
    versions = {
        label: old_module(commit, "jaxbundle/attacks/rays.py", f"rays_{label}").rays(
            steps=args.steps, name=f"rays-{label}")
        for label, commit in (("channels_last", CHANNELS_LAST), ("even_split", EVEN_SPLIT))
    } | {"reference_blocks": rays_new(steps=args.steps, name="rays")}
    out = {"channels_last": f"rays.py at {CHANNELS_LAST} (channels last)",
           "even_split": f"rays.py at {EVEN_SPLIT} (channels first)",
           "reference_blocks": "working tree (channels first, the reference's block sizes)",
           "queries": versions["reference_blocks"].queries, "steps": args.steps}

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    ds = data.load_mnist_sample("test", n=min(2000, 2 * args.n + 50))
    ok = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(ds.x)), -1)) == ds.y
    idx = np.flatnonzero(ok)[: args.n]
    mnist = compare(versions, apply_fn, params, ds.x[idx], ds.y[idx])
    mnist["n"] = int(len(idx))
    mnist["note"] = ("MNIST has one channel: (C, H, W) and (H, W, C) flatten alike, so the "
                     "channels-first change is a no-op here (identical_per_example)")
    out["mnist_adversarial_cnn"] = mnist
    print("mnist", json.dumps(mnist), flush=True)

    net = SmallCNN(num_classes=10)
    rng = np.random.default_rng(0)
    xc = (np.round(rng.uniform(size=(args.n_colour, 32, 32, 3)) * 255) / 255).astype(np.float32)
    cparams = net.init(jax.random.key(0), jnp.asarray(xc[:1]))
    yc = np.asarray(jnp.argmax(net.apply(cparams, jnp.asarray(xc)), -1)).astype(np.int32)
    colour = compare(versions, net.apply, cparams, xc, yc)
    colour["n"] = args.n_colour
    colour["model"] = "SmallCNN(num_classes=10), random init (key 0), random uniform 32x32x3 images"
    out["colour_random_cnn"] = colour
    print("colour", json.dumps(colour), flush=True)

    assert mnist["channels_first"]["identical_per_example"], "one channel: the order is moot"
    write_results(args.out, out, end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
