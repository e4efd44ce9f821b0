"""Torch copies of the held-out zoo's models, for AutoAttack in torch (benchmark-only).

``torch_network(name, variables)`` computes the JAX model's function on NCHW input in
``[0, 1]`` (convolutions padded as flax pads them, the extra pixel of an odd 'SAME' padding at
the high end; flattened in NHWC order; BatchNorm on the running averages). Run as a script in
an environment with torch, it prints each zoo model's largest logit gap::

    python benchmarks/heldout/torch_copy.py --models all
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from zoo import (EVAL_N, EVAL_START, MLP, RESNET_STAGES, ZOO, ApplyFn, Variables, dataset, load,
                 names)

from jaxbundle.canonical import _same_padding


def torch_network(name: str, variables: Variables):
    """Zoo model ``name`` with ``variables`` as a torch module in eval mode, on NCHW input in
    ``[0, 1]``: the same logits (convolutions padded as flax pads them, flattened in NHWC
    order, BatchNorm on the running averages with epsilon 1e-5)."""
    import torch
    import torch.nn.functional as F

    arch = ZOO[name].arch if name in ZOO else name
    params = jax.tree.map(np.asarray, variables["params"])
    stats = jax.tree.map(np.asarray, variables.get("batch_stats", {}))

    def t(a: np.ndarray):
        return torch.tensor(np.ascontiguousarray(a), dtype=torch.float32)

    def conv(x, p, stride=1):
        w = t(p["kernel"].transpose(3, 2, 0, 1))  # HWIO -> OIHW
        (ht, hb), (wl, wr) = (_same_padding(x.shape[d], w.shape[d], stride)[1:] for d in (2, 3))
        b = t(p["bias"]) if "bias" in p else None
        return F.conv2d(F.pad(x, (wl, wr, ht, hb)), w, b, stride=stride)

    def bn(x, p, s):
        return F.batch_norm(x, t(s["mean"]), t(s["var"]), t(p["scale"]), t(p["bias"]),
                            training=False, eps=1e-5)

    def dense(x, p):
        return F.linear(x, t(p["kernel"].T), t(p["bias"]))

    def flatten_nhwc(x):
        return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)

    def mlp(x):
        x = flatten_nhwc(x)
        for i in range(len(MLP.hidden)):
            x = F.relu(dense(x, params[f"dense{i}"]))
        return dense(x, params["logits"])

    def cnn(x):
        x = F.relu(conv(x, params["conv1"], 2))
        x = F.relu(conv(x, params["conv2"], 2))
        x = F.relu(dense(flatten_nhwc(x), params["hidden"]))
        return dense(x, params["logits"])

    def block(x, p, s, stride):
        h = F.relu(bn(conv(x, p["conv1"], stride), p["bn1"], s["bn1"]))
        h = bn(conv(h, p["conv2"]), p["bn2"], s["bn2"])
        if "shortcut_conv" in p:
            x = bn(conv(x, p["shortcut_conv"], stride), p["shortcut_bn"], s["shortcut_bn"])
        return F.relu(h + x)

    def resnet(x):
        x = F.relu(bn(conv(x, params["stem_conv"]), params["stem_bn"], stats["stem_bn"]))
        for i, (_, stride) in enumerate(RESNET_STAGES):
            x = block(x, params[f"block{i}"], stats[f"block{i}"], stride)
        return dense(x.mean(dim=(2, 3)), params["logits"])

    forward = {"mlp": mlp, "cnn": cnn, "resnet": resnet}[arch]

    class Net(torch.nn.Module):
        def forward(self, x):  # NCHW in [0, 1]
            return forward(x)

    return Net().eval()


def check_torch_copy(name: str, apply_fn: ApplyFn, variables: Variables, x: np.ndarray
                     ) -> float:
    """Largest absolute gap between the JAX logits and the torch copy's on images ``x``
    (NHWC); the copy is good when it is far below the logits' scale (under 1e-3)."""
    import torch

    net = torch_network(name, variables)
    with torch.no_grad():
        ours = net(torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))).numpy()
    return float(np.max(np.abs(ours - np.asarray(apply_fn(variables, jnp.asarray(x))))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="all", help="'all' or a comma list of zoo models")
    worst = 0.0
    for name in names(parser.parse_args(argv).models):
        apply_fn, variables = load(name)
        x, _ = dataset(ZOO[name].data, "test", start=EVAL_START, n=EVAL_N)
        gap = check_torch_copy(name, apply_fn, variables, x)
        worst = max(worst, gap)
        print(f"{name:14s} torch logit gap {gap:.2e}", flush=True)
    return 1 if worst >= 1e-3 else 0


if __name__ == "__main__":
    sys.exit(main())
