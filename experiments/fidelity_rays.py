"""Issue 14, RayS block order: blocks are cut over the channels-first (C, H, W) flattening, as
in the reference (uclaml/RayS flattens PyTorch's NCHW tensors), not over jaxbundle's
channels-last (H, W, C) one.

Before: ``jaxbundle/attacks/rays.py`` at commit ``d5f2fb3`` (channels-last blocks), read with
``git show`` and imported under another name. After: the working tree's ``rays.py``.

1. The demo adversarially trained CNN on the first ``--n`` correctly classified MNIST test
   images: median smallest Linf distortion with ``--steps`` queries. MNIST has one channel,
   where both orders are the same flattening, so the numbers must match exactly (checked).
2. Colour: a randomly initialised SmallCNN on ``--n-colour`` random uniform 32x32x3 images
   labelled by itself: the same numbers, where the block hierarchy does differ.

    python experiments/fidelity_rays.py      # ~1-2 min on 2 CPU cores
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

BEFORE = "d5f2fb3"  # the last commit with channels-last blocks


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


def compare(before, after, apply_fn, params, x, y) -> dict:
    out = {}
    for label, attack in (("before", before), ("after", after)):
        t0 = time.perf_counter()
        d = min_linf(attack, apply_fn, params, x, y)
        out[label] = {"median_linf": float(np.median(d)), "mean_linf": float(np.mean(d)),
                      "success_rate": float(np.isfinite(d).mean()),
                      "seconds": time.perf_counter() - t0}
        out[label + "_per_example"] = d
    b, a = out.pop("before_per_example"), out.pop("after_per_example")
    out["identical_per_example"] = bool(np.array_equal(b, a))
    out["after_better_share"] = float(np.mean(a < b))
    out["after_worse_share"] = float(np.mean(a > b))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--n-colour", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path("experiments/results/fidelity_rays.json"))
    args = p.parse_args(argv)
    old = old_module(BEFORE, "jaxbundle/attacks/rays.py", "rays_before")
    before = old.rays(steps=args.steps, name="rays-before")
    after = rays_new(steps=args.steps, name="rays-after")
    out = {"before": f"rays.py at {BEFORE} (channels-last blocks)",
           "after": "working tree (channels-first blocks, the reference's)",
           "queries": after.queries, "steps": args.steps}

    apply_fn, params = models.load_or_train(models.ADVERSARIAL)
    ds = data.load_mnist_sample("test", n=min(2000, 2 * args.n + 50))
    ok = np.asarray(jnp.argmax(apply_fn(params, jnp.asarray(ds.x)), -1)) == ds.y
    idx = np.flatnonzero(ok)[: args.n]
    mnist = compare(before, after, apply_fn, params, ds.x[idx], ds.y[idx])
    mnist["n"] = int(len(idx))
    mnist["note"] = ("MNIST has one channel: (C, H, W) and (H, W, C) flatten alike, so the "
                     "change is a no-op here (identical_per_example)")
    out["mnist_adversarial_cnn"] = mnist
    print("mnist", json.dumps(mnist), flush=True)

    net = SmallCNN(num_classes=10)
    rng = np.random.default_rng(0)
    xc = (np.round(rng.uniform(size=(args.n_colour, 32, 32, 3)) * 255) / 255).astype(np.float32)
    cparams = net.init(jax.random.key(0), jnp.asarray(xc[:1]))
    yc = np.asarray(jnp.argmax(net.apply(cparams, jnp.asarray(xc)), -1)).astype(np.int32)
    colour = compare(before, after, net.apply, cparams, xc, yc)
    colour["n"] = args.n_colour
    colour["model"] = "SmallCNN(num_classes=10), random init (key 0), random uniform 32x32x3 images"
    out["colour_random_cnn"] = colour
    print("colour", json.dumps(colour), flush=True)

    assert mnist["identical_per_example"], "one channel: the block order must not matter"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
