"""The batch size that fits a device's memory: ``--batch-size auto``.

An evaluation's memory is the model's forward and backward pass on a batch, times what runs at
once, plus each example's attack state and best candidates. :func:`per_example_bytes` measures
the first from XLA's own account of the model's compiled input gradient at batch sizes 1 and 2
(``memory_analysis``: nothing is run, a compile of the model alone), and adds the rest from the
plan:

    per example = R x E x (gradient bytes per example + STATE_IMAGES x image bytes)

where ``R`` is the most restarts an attack of the plan runs at once (``restart_mode="vmap"``;
one in a cascade of restarts) and ``E`` its EOT samples. :func:`auto_batch_size` fits
``FRACTION`` of the free memory of the device (an accelerator's ``memory_stats``; on a CPU the
host's available memory), less the fixed part (parameters, the program's own buffers), to that.

Calibrated on a ResNet-18 at 224x224x3 on the CPU (``benchmarks/imagenet_overhead.py
--memory``): the gradient takes 27.4 MB per example; the ``default`` bundle's compiled programs
per example: APGD-CE 36.4 MB, APGD-T's 5 restarts at once 186.7 MB, FAB-T3 127.1 MB and FAB-T's
9 targets at once (L2) 363.1 MB, Square 14.8-17.3 MB; the rule gives 42.9, 214.3, 128.6 and
385.8 MB: an upper bound on every attack measured.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["FRACTION", "STATE_IMAGES", "auto_batch_size", "free_bytes", "gradient_bytes",
           "per_example_bytes"]

FRACTION = 0.5  # of the free memory a batch may take: XLA's fragmentation, host copies
STATE_IMAGES = 27  # images per example besides the gradient's: attack state, candidates, bests
MAX_BATCH = 4096


def gradient_bytes(apply_fn: Callable, params: Any, image_shape: Sequence[int],
                   batch: int) -> int:
    """Bytes XLA plans for the input gradient of the summed cross-entropy of ``apply_fn`` on a
    batch of ``batch`` float32 images (temporaries and outputs; nothing is run)."""
    from jaxbundle.core import sampling  # light; keeps this module's import free of the bundler

    fixed = sampling.fixed(apply_fn)

    def loss(x, p):
        logits = sampling.float32_logits(fixed(p, x))
        return -jnp.sum(jax.nn.log_softmax(logits)[:, 0])

    x = jax.ShapeDtypeStruct((batch, *image_shape), jnp.float32)
    m = jax.jit(jax.grad(loss)).lower(x, params).compile().memory_analysis()
    if m is None:
        raise ValueError("this backend does not report compiled memory; set --batch-size")
    return int(m.temp_size_in_bytes + m.output_size_in_bytes)


def per_example_bytes(attacks: Sequence[Any], restart_mode: str, apply_fn: Callable,
                      params: Any, image_shape: Sequence[int]) -> tuple[int, int]:
    """``(bytes per example, fixed bytes)`` of an evaluation running ``attacks`` (see the
    module docstring); the fixed part is the parameters and the gradient program's own."""
    one, two = (gradient_bytes(apply_fn, params, image_shape, b) for b in (1, 2))
    slope = max(two - one, 1)
    image = 4 * math.prod(image_shape)
    at_once = max(a.eot * (a.num_restarts if restart_mode == "vmap" else 1) for a in attacks)
    leaves = jax.tree_util.tree_leaves(params)
    weights = sum(math.prod(jnp.shape(a)) * jnp.result_type(a).itemsize for a in leaves)
    return at_once * (slope + STATE_IMAGES * image), max(one - slope, 0) + weights


def free_bytes(device: Any = None) -> int:
    """Memory free on ``device`` (default the first): an accelerator's ``bytes_limit`` less
    ``bytes_in_use``; a CPU's: the host's available memory (``MemAvailable``)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_batch_size(attacks: Sequence[Any], restart_mode: str, apply_fn: Callable,
                    params: Any, image_shape: Sequence[int], devices: int = 1,
                    free: int | None = None) -> int:
    """The largest batch (a multiple of ``devices``, each holding an equal share) whose
    evaluation takes at most :data:`FRACTION` of each device's ``free`` memory
    (:func:`free_bytes`), between ``devices`` and :data:`MAX_BATCH` (the largest multiple of
    ``devices`` up to it, for 3, 6 or 12 devices too)."""
    per_example, fixed = per_example_bytes(attacks, restart_mode, apply_fn, params, image_shape)
    free = free_bytes() if free is None else free
    per_device = int((FRACTION * free - fixed) // per_example)
    return max(devices, min(MAX_BATCH // devices, per_device) * devices)
