"""jaxbundle's certified bounds against auto_LiRPA's on the same weights (issue 30's tightness
anchor: "if jax_verify or auto_LiRPA install here, compare against them too").

For each model, the first ``--n`` test images and each (norm, eps) setting, the lower bounds on
every margin ``z_y - z_j`` from :func:`jaxbundle.certify.margin_bounds` and from auto_LiRPA
(``BoundedModule.compute_bounds`` with the margins as its specification ``C``) on a torch copy
of the network with the same weights. Compared like for like:

* **IBP** against auto_LiRPA's ``IBP`` (the specification merged into the last linear layer).
* **CROWN-IBP** against the larger of auto_LiRPA's ``CROWN-IBP`` and ``IBP`` bounds: jaxbundle
  returns the larger of the two (both are sound), auto_LiRPA the CROWN one alone.
* **CROWN** likewise, with auto_LiRPA's ``compare_crown_with_ibp`` on: jaxbundle intersects
  every refined neuron's CROWN bounds with IBP's from the refined layers before it. Twice:
  as shipped (behind the first activation, CROWN only on the neurons IBP leaves unstable) and
  on every neuron (``crown-every``).
* **Sets**: Linf balls in the [0, 1] box (auto_LiRPA's ``x_L``/``x_U``, the same set); L2
  balls without the box (jaxbundle with ``lower=-inf, upper=inf``: auto_LiRPA bounds the ball
  alone).
* **Rounding**: jaxbundle widens every bound for float32's rounding (a relative margin,
  :mod:`jaxbundle.certify.ibp`); the papers' formulas are its bounds with that margin set to 0
  (``exact``), which is what is held to ``TOLERANCE``. The margin is reported beside.

Reported per setting: the largest absolute gap, and the margins where jaxbundle is looser or
tighter than auto_LiRPA by more than ``1e-4 * (1 + |bound|)``; the examples each certifies.

Models: the demo ``certified`` (SmallCNN with BatchNorm, IBP-trained) and ``adversarial``
(PGD-trained) CNNs, the three MLPs of ``certify.py`` (784-64-10), and, with ``--zoo``, the held
-out zoo's CNN and ResNet (BatchNorm, residual additions, global average pooling, colour 32x32):
trained on first use and cached. Benchmark-only environment (torch and auto_LiRPA are never
dependencies of the package)::

    python -m venv /work/lirpavenv && . /work/lirpavenv/bin/activate
    pip install torch==2.13.0 numpy appdirs pyyaml tqdm packaging -e .
    git clone https://github.com/Verified-Intelligence/auto_LiRPA /work/auto_LiRPA  # 0.7.1
    PYTHONPATH=/work/auto_LiRPA python benchmarks/lirpa_compare.py --zoo

PyPI's auto_LiRPA (0.3, 2022) requires torch < 1.13, which has no wheel for Python 3.11; the
repository's version (0.7.1) runs on torch 2.13.0 although its setup.py asks for < 2.9.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness import machine_facts, parse_run_args, write_results

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "heldout"))
import zoo  # noqa: E402  (benchmarks/heldout: the held-out models)
from zoo import RESNET_STAGES  # noqa: E402

from jaxbundle import models
from jaxbundle.canonical import _same_padding
from jaxbundle.certify import bounds, crown
from jaxbundle.data import load_mnist_sample

TOLERANCE = 1e-4
# jaxbundle's method -> auto_LiRPA's; "crown-every": CROWN on every hidden neuron, not only on
# those IBP leaves unstable (crown.refinement's sparse rule, the package's default).
LIRPA = {"ibp": "IBP", "crown-ibp": "CROWN-IBP", "crown": "CROWN", "crown-every": "CROWN"}

# (norm, eps) settings per model: radii where the certified fraction is neither 0 nor 100 %.
DEMO = {
    "certified": [("linf", 76 / 255), ("l2", 1.0)],
    "adversarial": [("linf", 0.05), ("l2", 0.5)],
    "mlp-standard": [("linf", 0.02), ("l2", 0.3)],
    "mlp-pgd": [("linf", 0.1), ("l2", 0.5)],
    "mlp-ibp": [("linf", 0.1), ("l2", 1.0)],
}
ZOO = {"cnn-pgd-0.3": [("linf", 0.1), ("l2", 0.5)],
       "resnet-std": [("linf", 0.5 / 255), ("l2", 0.02)]}
# CROWN on the ResNet is left out: auto_LiRPA 0.7.1's patches mode fails on its strided
# shortcut (patches of sizes 6 and 7 added) and its matrix mode ran out of 24 GB on 4 images.
ONLY = {"resnet-std": ("ibp", "crown-ibp")}


# ------------------------------------------------------------------------- torch copies


class _Layers:
    """torch layers holding a flax model's weights, for auto_LiRPA (which traces modules):
    'SAME' convolutions padded as flax pads them (a ``ZeroPad2d`` where the padding is
    uneven), BatchNorm on the stored statistics (epsilon 1e-5), features flattened in NHWC
    order."""

    def __init__(self, variables):
        import torch

        self.torch = torch
        self.params = jax.tree.map(np.asarray, variables["params"])
        self.stats = jax.tree.map(np.asarray, variables.get("batch_stats", {}))

    def tensor(self, a):
        return self.torch.tensor(np.ascontiguousarray(a), dtype=self.torch.float32)

    def dense(self, p):
        layer = self.torch.nn.Linear(*p["kernel"].shape)
        layer.weight.data, layer.bias.data = self.tensor(p["kernel"].T), self.tensor(p["bias"])
        return [layer]

    def conv(self, p, size: int, stride: int):
        kernel = p["kernel"].transpose(3, 2, 0, 1)  # HWIO -> OIHW
        _, low, high = _same_padding(size, kernel.shape[2], stride)
        layer = self.torch.nn.Conv2d(kernel.shape[1], kernel.shape[0], kernel.shape[2],
                                     stride=stride, padding=low if low == high else 0,
                                     bias="bias" in p)
        layer.weight.data = self.tensor(kernel)
        if "bias" in p:
            layer.bias.data = self.tensor(p["bias"])
        pad = [] if low == high else [self.torch.nn.ZeroPad2d((low, high, low, high))]
        return [*pad, layer]

    def norm(self, p, s, cls):
        layer = cls(len(s["mean"]), eps=1e-5)
        layer.weight.data, layer.bias.data = self.tensor(p["scale"]), self.tensor(p["bias"])
        layer.running_mean.data, layer.running_var.data = (self.tensor(s["mean"]),
                                                           self.tensor(s["var"]))
        return [layer]

    def sequential(self, *layers):
        return self.torch.nn.Sequential(*layers)


def torch_copy(variables, size: int) -> "torch.nn.Module":  # noqa: F821
    """The demo ``SmallCNN`` (with or without BatchNorm) and ``MLP``, and the zoo's MLP, CNN
    and ResNet, as torch modules with the same weights, on NCHW images of side ``size``."""
    f = _Layers(variables)
    nn, params, stats = f.torch.nn, f.params, f.stats

    class Flatten(nn.Module):  # NHWC order, as flax flattens
        def forward(self, x):
            return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)

    class Block(nn.Module):  # relu(main(x) + shortcut(x)), the zoo's BasicBlock
        def __init__(self, main, shortcut):
            super().__init__()
            self.main, self.shortcut = main, shortcut

        def forward(self, x):
            return f.torch.relu(self.main(x) + self.shortcut(x))

    class Pool(nn.Module):  # global average pooling
        def forward(self, x):
            return x.mean(dim=(2, 3))

    def norm(name, cls=nn.BatchNorm2d):
        return f.norm(params[name], stats[name], cls) if name in stats else []

    layers = []
    if "stem_conv" in params:  # the zoo's ResNet
        layers += [*f.conv(params["stem_conv"], size, 1), *norm("stem_bn"), nn.ReLU()]
        for i, (_, stride) in enumerate(RESNET_STAGES):
            p, st = params[f"block{i}"], stats[f"block{i}"]
            main = f.sequential(*f.conv(p["conv1"], size, stride),
                                *f.norm(p["bn1"], st["bn1"], nn.BatchNorm2d), nn.ReLU(),
                                *f.conv(p["conv2"], -(-size // stride), 1),
                                *f.norm(p["bn2"], st["bn2"], nn.BatchNorm2d))
            shortcut = nn.Identity() if "shortcut_conv" not in p else f.sequential(
                *f.conv(p["shortcut_conv"], size, stride),
                *f.norm(p["shortcut_bn"], st["shortcut_bn"], nn.BatchNorm2d))
            layers.append(Block(main, shortcut))
            size = -(-size // stride)
        layers.append(Pool())
    elif "conv1" in params:  # the demo SmallCNN, the zoo's CNN: two stride-2 convolutions
        layers += [*f.conv(params["conv1"], size, 2), *norm("norm1"), nn.ReLU(),
                   *f.conv(params["conv2"], -(-size // 2), 2), *norm("norm2"), nn.ReLU(),
                   Flatten(), *f.dense(params["hidden"]), *norm("norm3", nn.BatchNorm1d),
                   nn.ReLU()]
    else:  # the MLPs: hidden0, hidden1, ... (demo) or dense0, dense1, ... (zoo)
        layers.append(Flatten())
        for name in sorted(k for k in params if k != "logits"):
            layers += [*f.dense(params[name]), nn.ReLU()]
    return f.sequential(*layers, *f.dense(params["logits"])).eval()


def demo_model(name: str):
    """``(apply_fn, variables, torch copy, x, y)`` of a demo model on the embedded test set."""
    from certify import MLPS

    config = MLPS.get(name) or models.MODELS[name]
    apply_fn, variables = models.load_or_train(config)
    sample = load_mnist_sample("test")
    return apply_fn, variables, torch_copy(variables, 28), sample.x, sample.y


def zoo_model(name: str):
    """The same for a held-out zoo model on its evaluation images."""
    apply_fn, variables = zoo.load(name)
    x, y = zoo.dataset(zoo.ZOO[name].data, "test", start=zoo.EVAL_START, n=zoo.EVAL_N)
    return apply_fn, variables, torch_copy(variables, x.shape[1]), x, y


# ----------------------------------------------------------------------------- the bounds


def _patch_pad() -> None:
    """auto_LiRPA 0.7.1's ``BoundPad`` reads the pads from a second input; torch 2.13's ONNX
    export folds them into the node's ``pads`` attribute (``[0, 0, top, left, 0, 0, bottom,
    right]``), which it then ignores. Passes the attribute where the input is missing."""
    from auto_LiRPA.operators.convolution import BoundPad

    if getattr(BoundPad.forward, "patched", False):
        return
    original = BoundPad.forward

    def forward(self, x, pad=None, value=0.0):
        return original(self, x, self.attr["pads"] if pad is None else pad,
                        self.attr.get("value", value))

    forward.patched = True
    BoundPad.forward = forward



def lirpa_margins(net, x: np.ndarray, y: np.ndarray, eps: float, norm: str, method: str,
                  conv_mode: str = "patches") -> np.ndarray:
    """auto_LiRPA's ``[B, K]`` lower bounds on ``z_y - z_j`` (``+inf`` at ``y``): Linf in the
    [0, 1] box, L2 on the ball alone. ``conv_mode="matrix"`` where auto_LiRPA's patches fail
    (0.7.1 on the ResNet's strided shortcut: patch sizes 6 and 7 added)."""
    import torch
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    _patch_pad()
    images = torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    classes = net(images[:1]).shape[-1]
    wrong = np.array([[j for j in range(classes) if j != label] for label in y])
    spec = (np.eye(classes)[y][:, None, :] - np.eye(classes)[wrong]).astype(np.float32)
    if norm == "linf":
        low, high = torch.clamp(images - eps, 0.0, 1.0), torch.clamp(images + eps, 0.0, 1.0)
        region = PerturbationLpNorm(norm=float("inf"), eps=eps, x_L=low, x_U=high)
    else:
        region = PerturbationLpNorm(norm=2.0, eps=eps)
    options = {"compare_crown_with_ibp": True, "verbosity": 0, "conv_mode": conv_mode}
    module = BoundedModule(net, images, bound_opts=options, device="cpu")
    with torch.no_grad():
        lower, _ = module.compute_bounds(x=(BoundedTensor(images, region),),
                                         C=torch.tensor(spec), method=LIRPA[method],
                                         bound_upper=False)
        if method != "ibp":
            ibp_lower, _ = module.compute_bounds(x=(BoundedTensor(images, region),),
                                                 C=torch.tensor(spec), method="IBP",
                                                 bound_upper=False)
            lower = torch.maximum(lower, ibp_lower)
    out = np.full((len(y), classes), np.inf, np.float32)
    np.put_along_axis(out, wrong, lower.numpy(), axis=1)
    return out


def our_margins(apply_fn, variables, x, y, eps, norm, method, rounding=True) -> np.ndarray:
    """jaxbundle's bounds on the same sets (L2: the ball, not intersected with the box); without
    ``rounding``, the papers' formulas exactly (no widening for float32's rounding)."""
    box = (0.0, 1.0) if norm == "linf" else (-jnp.inf, jnp.inf)
    saved = crown.refinement
    if method == "crown-every":
        crown.refinement = functools.partial(saved, sparse=False)
    try:  # a fresh function: the compiled program of another setting is not reused
        out = bounds.margin_bounds(functools.partial(apply_fn), variables, jnp.asarray(x),
                                   jnp.asarray(y), eps=eps, norm=norm,
                                   method=method.removesuffix("-every"), lower=box[0],
                                   upper=box[1], rounding=rounding)
        return np.asarray(out)
    finally:
        crown.refinement = saved


def compare(exact: np.ndarray, shipped: np.ndarray, theirs: np.ndarray) -> dict:
    """The papers' formulas (``exact``) against auto_LiRPA: the largest gap and the margins
    where ours is looser or tighter beyond tolerance; what the rounding margin costs
    (``shipped``, what the package returns); the examples each certifies."""
    finite = np.isfinite(theirs)
    gap = exact[finite] - theirs[finite]
    slack = TOLERANCE * (1.0 + np.abs(theirs[finite]))
    widening = (exact[finite] - shipped[finite]) / (1.0 + np.abs(theirs[finite]))
    return {"margins": int(finite.sum()),
            "max_abs_gap": float(np.max(np.abs(gap))),
            "max_rel_gap": float(np.max(np.abs(gap) / (1.0 + np.abs(theirs[finite])))),
            "looser": int(np.sum(gap < -slack)), "tighter": int(np.sum(gap > slack)),
            "most_looser": float(-np.min(gap, initial=0.0)),
            "rounding_margin_rel": float(np.max(widening)),
            "certified_shipped": int(np.sum(np.all(shipped > 0, axis=1))),
            "certified_exact": int(np.sum(np.all(exact > 0, axis=1))),
            "certified_lirpa": int(np.sum(np.all(theirs > 0, axis=1)))}


def run_model(name: str, loader, settings, n: int, log) -> dict:
    """Every (norm, eps) and method of one model."""
    import torch

    apply_fn, variables, net, x, y = loader(name)
    x, y = np.asarray(x[:n], np.float32), np.asarray(y[:n], np.int32)
    with torch.no_grad():
        gap = float(np.max(np.abs(
            net(torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))).numpy()
            - np.asarray(apply_fn(variables, jnp.asarray(x))))))
    out = {"torch_logit_gap": gap, "settings": []}
    log(f"{name}: torch copy's largest logit gap {gap:.1e}")
    for norm, eps in settings:
        for method in ONLY.get(name, LIRPA):
            exact = our_margins(apply_fn, variables, x, y, eps, norm, method, rounding=False)
            start = time.perf_counter()
            shipped = our_margins(apply_fn, variables, x, y, eps, norm, method)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            theirs = lirpa_margins(net, x, y, eps, norm, method,
                                   "matrix" if name in ONLY else "patches")
            row = {"norm": norm, "eps": eps, "method": method,
                   **compare(exact, shipped, theirs), "seconds_ours": seconds,
                   "seconds_lirpa": time.perf_counter() - start}
            out["settings"].append(row)
            log(f"  {norm} {eps:.4f} {method:11s} gap {row['max_abs_gap']:.1e} (relative "
                f"{row['max_rel_gap']:.1e}), looser {row['looser']}, tighter {row['tighter']} "
                f"of {row['margins']}; rounding margin {row['rounding_margin_rel']:.1e}; "
                f"certified {row['certified_shipped']} / {row['certified_exact']} / "
                f"{row['certified_lirpa']} (ours / ours exact / auto_LiRPA)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=32, help="test images per model")
    p.add_argument("--models", default=",".join(DEMO), help="demo models, comma-separated")
    p.add_argument("--zoo", action="store_true", help="also the held-out zoo's CNN and ResNet")
    args = parse_run_args(p, argv, "lirpa_compare", {"n": 8})
    import torch

    torch.set_num_threads(2)
    results = {"machine": machine_facts(), "torch": torch.__version__,
               "auto_lirpa": __import__("auto_LiRPA").__version__, "n": args.n,
               "tolerance": TOLERANCE, "models": {}}
    worst = 0
    chosen = [(m, demo_model, DEMO[m]) for m in args.models.split(",") if m]
    chosen += [(m, zoo_model, s) for m, s in ZOO.items()] if args.zoo else []
    for name, loader, settings in chosen:
        results["models"][name] = run_model(name, loader, settings, args.n, print)
        worst += sum(r["looser"] for r in results["models"][name]["settings"])
    write_results(args.out, results)
    print(f"margins where jaxbundle is looser than auto_LiRPA beyond tolerance: {worst}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
