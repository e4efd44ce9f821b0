"""Sound bounds (jaxbundle.certify.bounds): exact on linear toys, known answers on one ReLU, equal
to a float64 NumPy reference of the papers' formulas, and containing the network's outputs at
sampled points of the input set on random nets of every supported layer (hypothesis)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbundle.certify import bounds, crown, ibp, sets
from jaxbundle.certify import graph as graphs
from jaxbundle.certify.bounds import METHODS, UnsupportedPrimitive, logit_bounds, margin_bounds
from jaxbundle.models.architectures import LinenCNN, SmallCNN

SHAPE = (4, 4, 2)  # a small image: 32 inputs


def _images(key, count, shape=SHAPE, low=0.2, high=0.8):
    return jax.random.uniform(key, (count, *shape), minval=low, maxval=high)


def _wrong(bound):
    """The wrong classes' bounds (-inf in the true class's column, where they are +inf)."""
    return jnp.where(jnp.isinf(bound), -jnp.inf, bound)


def _margins(logits, y):
    return jnp.take_along_axis(logits, y[:, None], axis=1) - logits


# ----------------------------------------------------------------------------------------
# analytic toys
# ----------------------------------------------------------------------------------------


def _linear(params, x):
    return x.reshape(x.shape[0], -1) @ params["w"] + params["b"][None]


def test_linear_model_bounds_are_the_exact_minimum_for_every_method():
    w = jax.random.normal(jax.random.key(0), (32, 5))
    params = {"w": w, "b": jnp.arange(5.0) / 10}
    x = _images(jax.random.key(1), 3, low=0.0, high=1.0)  # some pixels clipped by the box
    y = jnp.array([0, 2, 4])
    eps = 0.3
    lo, hi = jnp.clip(x - eps, 0, 1).reshape(3, -1), jnp.clip(x + eps, 0, 1).reshape(3, -1)
    gap = w[:, y].T[:, :, None] - w[None]  # [B, 32, 5]: w_y - w_j
    exact = (jnp.sum(jnp.minimum(gap * lo[..., None], gap * hi[..., None]), axis=1)
             + params["b"][y][:, None] - params["b"][None])  # [B, 5]
    magnitude = jnp.abs(w).T @ hi.T + jnp.abs(params["b"])[:, None]  # [5, B]: terms' |sum|
    scale = magnitude[y].diagonal()[:, None] + magnitude.T
    for method in METHODS:
        got = margin_bounds(_linear, params, x, y, eps=eps, method=method)
        off = got - exact
        assert jnp.all(jnp.isinf(got) == (jnp.arange(5)[None] == y[:, None])), method
        assert jnp.all(jnp.where(jnp.isinf(got), 0, off) <= 0), method  # never above the truth
        # below it by at most the float32 safety term (a few 1e-5 of the terms' absolute sum)
        assert jnp.all(jnp.where(jnp.isinf(got), 0, -off) < 1e-4 * scale), method
        low, high = logit_bounds(_linear, params, lo.reshape(x.shape), hi.reshape(x.shape),
                                 method=method)
        exact_low = jnp.sum(jnp.minimum(w[None] * lo[..., None], w[None] * hi[..., None]), 1)
        exact_low = exact_low + params["b"][None]
        assert jnp.all((low <= exact_low) & (low >= exact_low - 1e-4 * magnitude.T)), method


def test_linear_model_l2_bounds_are_the_exact_minimum():
    params = {"w": jax.random.normal(jax.random.key(2), (32, 3)), "b": jnp.zeros(3)}
    x = _images(jax.random.key(3), 2, low=0.4, high=0.6)
    y = jnp.array([0, 1])
    eps = 0.05  # the ball stays inside [0, 1]: the minimum is <w_y - w_j, x> - eps |w_y - w_j|
    gap = params["w"][:, y].T[:, :, None] - params["w"][None]
    exact = jnp.einsum("bdk,bd->bk", gap, x.reshape(2, -1)) - eps * jnp.linalg.norm(gap, axis=1)
    got = margin_bounds(_linear, params, x, y, eps=eps, norm="l2", method="crown")
    finite = ~jnp.isinf(got)
    assert jnp.all(jnp.where(finite, got - exact, 0) <= 0)
    magnitude = jnp.abs(params["w"]).T @ jnp.ones(32)  # >= the terms' absolute sum per logit
    scale = magnitude[y][:, None] + magnitude[None]
    assert jnp.all(jnp.where(finite, exact - got, 0) < 1e-4 * scale)


def _sum_net(params, x):
    """z0 = relu(s), z1 = s with s = x1 + x2: the margin z0 - z1 = relu(-s) >= 0, min 0."""
    del params
    s = x[:, 0, 0, :1] + x[:, 0, 1, :1]
    return jnp.concatenate([jax.nn.relu(s), s], axis=1)


def _just_below(bound, answer):
    """The answer, less at most the float32 safety term (1e-4 of the magnitudes here)."""
    return answer - 1e-3 <= float(bound) <= answer


def test_one_relu_net_has_the_known_answers():
    x = jnp.zeros((1, 1, 2, 1))
    got = {m: margin_bounds(_sum_net, {}, x, jnp.array([0]), eps=1.0, method=m, lower=-1.0,
                            upper=1.0)[0, 1] for m in METHODS}
    # s in [-2, 2]; IBP: relu(s) in [0, 2] and -s >= -2 apart: -2. CROWN: relu(s) >= s: 0.
    assert _just_below(got["ibp"], -2.0)
    assert _just_below(got["crown-ibp"], 0.0) and _just_below(got["crown"], 0.0)
    # The other margin s - relu(s) = min(s, 0) >= -2: IBP -2 - 2; CROWN's chord (s + 2) / 2
    # above relu(s) gives s / 2 - 1 >= -2, exact.
    for m, answer in zip(METHODS, (-4.0, -2.0, -2.0)):
        assert _just_below(margin_bounds(_sum_net, {}, x, jnp.array([1]), eps=1.0, method=m,
                                         lower=-1.0, upper=1.0)[0, 0], answer), m


def test_l2_minimum_over_a_ball_in_a_box_matches_a_solver():
    rng = np.random.default_rng(0)
    for trial in range(4):
        center = rng.uniform(0, 1, 6).astype(np.float32)
        radius = np.float32(rng.uniform(0.1, 0.8))
        coefficients = rng.normal(size=(3, 6)).astype(np.float32)
        region = sets.input_set(jnp.asarray(center), radius, "l2", 0.0, 1.0)
        got = np.asarray(sets.minimise(jnp.asarray(coefficients), region))
        box = list(zip(np.asarray(region.lower, np.float64), np.asarray(region.upper, np.float64)))
        center64, radius64 = center.astype(np.float64), float(radius)
        for row, value in zip(coefficients.astype(np.float64), got):
            best = scipy.optimize.minimize(
                lambda z: row @ z, center64, jac=lambda z: row, method="SLSQP", bounds=box,
                constraints=[{"type": "ineq",
                              "fun": lambda z: radius64**2 - np.sum((z - center64)**2),
                              "jac": lambda z: -2 * (z - center64)}],
            ).fun
            assert value <= best + 1e-5, trial  # a lower bound
            assert value >= best - 1e-3, trial  # and a tight one (the dual is exact)


def _first_relu_input(pre_activation, params, x, eps):
    """IBP's bounds on the first ReLU's input over the L2 ball of ``x`` (no box), and the
    exact ones: ``c -+ eps |J_i|_2`` from the Jacobian's rows."""
    def apply(p, v):
        return jax.nn.relu(pre_activation(p, v)).reshape(1, -1)

    graph = graphs.trace(apply, params, x.shape)
    region = sets.input_set(x, jnp.float32(eps), "l2", -jnp.inf, jnp.inf)
    state = ibp.sweep(graph, jax.tree.leaves(params), region, rounding=False)
    (lower, upper), = state.pre.values()
    center = pre_activation(params, x).reshape(-1)
    rows = jax.jacobian(lambda v: pre_activation(params, v).reshape(-1))(x).reshape(
        center.size, -1)
    reach = eps * jnp.linalg.norm(rows, axis=1)
    return (lower.reshape(-1), upper.reshape(-1)), (center - reach, center + reach)


def test_l2_ibp_bounds_a_first_layer_by_its_rows_norms_exactly():
    """Normalisation, a padded strided convolution and a bias: IBP on an L2 ball bounds the
    first ReLU's input by the ball itself (each row's norm, fewer taps at the borders), not by
    the ball's Linf hull (about 7 times wider here)."""
    kernel = jax.random.normal(jax.random.key(0), (3, 3, 2, 4))

    def pre(p, v):
        v = (v - 0.5) / jnp.array([0.25, 0.5])[None, None, None]
        out = jax.lax.conv_general_dilated(v, p["k"], (2, 2), "SAME",
                                           dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return out + p["b"][None, None, None]

    params = {"k": kernel, "b": jnp.arange(4.0)}
    x = _images(jax.random.key(1), 1, shape=(5, 5, 2))
    (lower, upper), (low, high) = _first_relu_input(pre, params, x, 0.3)
    np.testing.assert_allclose(lower, low, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(upper, high, rtol=1e-5, atol=1e-5)


def test_l2_ibp_sums_repeated_pixels_by_the_triangle_inequality():
    """A pixel used twice (broadcast, or the input added to itself) has a row along one
    direction, not two orthogonal ones: the root of the squared terms (sqrt 2 |w|) would be
    below the truth (2 |w|). The bounds must contain it (they are the hull's here)."""
    w = jax.random.normal(jax.random.key(2), (32, 6))
    twice = jnp.concatenate([w, w])  # the same weights on both copies of every pixel

    def broadcast(p, v):
        flat = v.reshape(1, -1)
        return jnp.broadcast_to(flat[:, None], (1, 2, 32)).reshape(1, -1) @ p

    def doubled(p, v):
        flat = v.reshape(1, -1)
        return (flat + flat) @ p[:32]

    x = _images(jax.random.key(3), 1)
    for pre in (broadcast, doubled):
        (lower, upper), (low, high) = _first_relu_input(pre, twice, x, 0.2)
        assert jnp.all(lower <= low + 1e-5) and jnp.all(upper >= high - 1e-5), pre.__name__


# ----------------------------------------------------------------------------------------
# float64 reference (Gowal et al. 2018; Zhang et al. 2018; Zhang et al. 2020)
# ----------------------------------------------------------------------------------------


def _reference(layers, lower, upper, spec, method, sparse=True):
    """Lower bounds of ``spec @ f(x)`` over the box, f = layers[-1] o relu o ... o layers[0]
    (each an (W, b) in float64): IBP with the spec merged into the last layer; CROWN-IBP's
    backward pass over IBP's pre-activation bounds; CROWN's over CROWN's (each intersected
    with IBP's, and IBP continuing from the intersection; with ``sparse`` only the neurons
    behind a ReLU that IBP leaves unstable get CROWN's), the result the better of IBP's."""

    def crown_lower(count, pre, rows):
        coefficients, constant = rows, np.zeros(len(rows))
        for k in reversed(range(count)):
            w, b = layers[k]
            constant = constant + coefficients @ b
            coefficients = coefficients @ w
            if k:
                low, high = pre[k - 1]
                unstable = (low < 0) & (high > 0)
                chord = np.where(unstable, high / np.where(unstable, high - low, 1), low >= 0)
                slope = np.where(unstable, high >= -low, chord)
                positive, negative = np.maximum(coefficients, 0), np.minimum(coefficients, 0)
                constant = constant + negative @ np.where(unstable, -chord * low, 0)
                coefficients = positive * slope + negative * chord
        return (np.maximum(coefficients, 0) @ lower + np.minimum(coefficients, 0) @ upper
                + constant)

    center, radius, pre = (lower + upper) / 2, (upper - lower) / 2, []
    for k, (w, b) in enumerate(layers[:-1]):
        center, radius = w @ center + b, np.abs(w) @ radius
        low, high = center - radius, center + radius
        if method == "crown":
            eye = np.eye(len(b))
            wanted = (low < 0) & (high > 0) if sparse and k else True
            low = np.where(wanted, np.maximum(low, crown_lower(k + 1, pre, eye)), low)
            high = np.where(wanted, np.minimum(high, -crown_lower(k + 1, pre, -eye)), high)
        pre.append((low, high))
        low, high = np.maximum(low, 0), np.maximum(high, 0)
        center, radius = (low + high) / 2, (high - low) / 2
    w, b = layers[-1]
    merged = spec @ w
    bound = merged @ center - np.abs(merged) @ radius + spec @ b
    if method != "ibp":
        bound = np.maximum(bound, crown_lower(len(layers), pre, spec))
    return bound


def _dense_layers(functions, params, shape):
    """(W, b) of each affine ``function(params, h)`` in float64, W by jax.jacfwd (one jitted
    program a layer, not one per operation)."""
    layers = []
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
        for function in functions:
            zero = np.zeros((1, *shape), np.float64)
            out, jacobian = jax.jit(lambda p, h, f=function: (f(p, h), jax.jacfwd(
                lambda v: f(p, v))(h)))(params64, zero)
            layers.append((np.asarray(jacobian).reshape(out.size, -1),
                           np.asarray(out).reshape(-1)))
            shape = out.shape[1:]
    return layers


def _normal(key, shape, divisor):
    return jax.random.normal(key, shape) / divisor


def _conv(x, kernel, stride, padding):
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), padding,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


REFERENCE_NETS = {
    "mlp": (
        lambda k: {"w1": _normal(k[0], (32, 12), 4), "b1": _normal(k[1], (12,), 4),
                   "w2": _normal(k[2], (12, 8), 3), "b2": _normal(k[3], (8,), 4),
                   "w3": _normal(k[4], (8, 4), 3), "b3": jnp.zeros(4)},
        [lambda p, h: h.reshape(h.shape[0], -1) @ p["w1"] + p["b1"][None],
         lambda p, h: h @ p["w2"] + p["b2"][None], lambda p, h: h @ p["w3"] + p["b3"][None]],
    ),
    "cnn": (
        lambda k: {"k1": _normal(k[0], (3, 3, 2, 4), 3), "c1": _normal(k[1], (4,), 4),
                   "k2": _normal(k[2], (2, 2, 4, 4), 3), "c2": _normal(k[3], (4,), 4),
                   "w3": _normal(k[4], (16, 3), 3), "b3": jnp.zeros(3)},
        [lambda p, h: _conv(h, p["k1"], 2, "SAME") + p["c1"][None, None, None],
         lambda p, h: _conv(h, p["k2"], 1, "SAME") + p["c2"][None, None, None],
         lambda p, h: h.reshape(h.shape[0], -1) @ p["w3"] + p["b3"][None]],
    ),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_NETS))
def test_bounds_equal_a_float64_reference_of_the_papers(name, monkeypatch):
    init, functions = REFERENCE_NETS[name]
    params = jax.jit(init)(jax.random.split(jax.random.key(4), 5))  # one program, not six

    def apply(p, x):
        h = x
        for k, function in enumerate(functions):
            h = function(p, h) if k == 0 else function(p, jax.nn.relu(h))
        return h

    x, eps = _images(jax.random.key(5), 2, low=0.0, high=1.0), 0.15
    logits = apply(params, x)
    y = jnp.argmax(logits, axis=1)
    layers = _dense_layers(functions, params, SHAPE)
    classes = logits.shape[1]
    every_neuron, exact = functools.partial(crown.refinement, sparse=False), {}
    for method, sparse in [(m, True) for m in METHODS] + [("crown", False)]:
        if not sparse:  # CROWN for every neuron (a fresh function: not the cached program)
            monkeypatch.setattr(crown, "refinement", every_neuron)
        got = exact[method, sparse] = margin_bounds(functools.partial(apply), params, x, y,
                                                    eps=eps, method=method, rounding=False)
        for b in range(2):
            image = np.asarray(x[b], np.float64).reshape(-1)
            spec = np.eye(classes)[int(y[b])][None] - np.eye(classes)
            want = _reference(layers, np.clip(image - eps, 0, 1), np.clip(image + eps, 0, 1),
                              spec, method, sparse)
            want[int(y[b])] = np.inf
            np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{method} sparse={sparse}")
    monkeypatch.undo()
    if name == "mlp":
        got = exact["crown", True]
        widened = margin_bounds(lambda p, v: apply(p, v), params, x, y, eps=eps, method="crown")
        assert jnp.all(widened <= got) and jnp.all(widened >= got - 0.02)  # the safety term


# ----------------------------------------------------------------------------------------
# random nets of every supported layer: bounds contain the outputs at points of the set
# ----------------------------------------------------------------------------------------


class _ConvNet(nn.Module):
    """Strided, padded and grouped convolutions, batch norm in inference mode, leaky ReLU, clip,
    average and max pooling, flax layers."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), strides=2, padding=((1, 0), (0, 1)))(x)
        x = nn.BatchNorm(use_running_average=True)(x)
        x = nn.leaky_relu(nn.relu(x) - 0.3 * x, 0.2)
        x = nn.Conv(4, (2, 2), feature_group_count=2, kernel_dilation=1, padding="SAME")(x)
        x = nn.avg_pool(jnp.clip(x, 0.0, 1.5), (2, 2), strides=(1, 1), padding="SAME")
        x = nn.max_pool(x, (2, 2), strides=(1, 1))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _conv_net():
    module = _ConvNet()
    variables = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, *SHAPE)))

    def init(key):
        leaves, tree = jax.tree.flatten(variables)
        keys = jax.random.split(key, len(leaves))
        leaves = [jax.random.normal(k, a.shape) * 0.6 for k, a in zip(keys, leaves)]
        params = jax.tree.unflatten(tree, leaves)
        stats = params["batch_stats"]["BatchNorm_0"]
        stats["var"] = jnp.abs(stats["var"]) + 0.5
        return params

    return init, module.apply


def _residual_net():
    """Plain JAX: normalisation inside, remat, an NCHW convolution, a residual add, mean,
    where-ReLU (``h @ w`` computed twice) and abs."""

    def init(key):
        k = jax.random.split(key, 5)
        return {"k1": _normal(k[0], (3, 2, 3, 3), 3), "k2": _normal(k[1], (3, 3, 3, 3), 3),
                "w1": _normal(k[2], (3, 6), 1), "w2": _normal(k[3], (6, 4), 2),
                "b": _normal(k[4], (6,), 4)}

    def apply(params, x):
        x = (x - jnp.array([[[[0.4, 0.6]]]])) / jnp.array([[[[0.3, 0.2]]]])
        x = jnp.transpose(x, (0, 3, 1, 2))
        h = jax.lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME")
        h = jax.checkpoint(lambda v: jnp.maximum(v, 0.0))(h)
        h = h + jax.lax.conv_general_dilated(jax.nn.relu(h), params["k2"], (1, 1), "SAME")
        h = jnp.mean(h, axis=(2, 3)) @ params["w1"] + params["b"][None]
        return jnp.abs(jnp.where(h > 0, h, 0.0) - 0.5) @ params["w2"]

    return init, apply


NETS = {"conv": _conv_net, "residual": _residual_net}
NETS = {name: functools.cache(factory) for name, factory in NETS.items()}  # one apply_fn: one
# compilation per net for all hypothesis examples


def _points(key, x, eps, norm, count):
    """``count`` points per example of the set: corners/sphere points and interior ones."""
    k1, k2 = jax.random.split(key)
    direction = jax.random.normal(k1, (count, *x.shape))
    if norm == "linf":
        corner = jnp.sign(direction) * eps
        inner = jax.random.uniform(k2, direction.shape, minval=-eps, maxval=eps)
    else:
        flat = direction.reshape(count, x.shape[0], -1)
        corner = (flat / jnp.linalg.norm(flat, axis=-1, keepdims=True) * eps).reshape(
            direction.shape)
        inner = corner * jax.random.uniform(k2, (count, x.shape[0], 1, 1, 1))
    return jnp.clip(x[None] + jnp.concatenate([corner, inner]), 0.0, 1.0)


@functools.partial(jax.jit, static_argnames=("apply", "norm"))
def _sampled(apply, params, x, radius, key, norm):
    """The logits at 64 points of each example's set (one program per net and norm)."""
    return jax.vmap(lambda v: apply(params, v))(_points(key, x, radius, norm, 32))


@functools.partial(jax.jit, static_argnames=("apply", "norm"))
def _every_bound(apply, params, x, y, radius, norm):
    """Every method's margin bounds, and (Linf) IBP's and CROWN-IBP's logit bounds, in one
    program. CROWN's logit bounds are CROWN-IBP's backward pass over CROWN's refined sweep, and
    the margins' CROWN runs that sweep: two more CROWN sweeps (half the compiling) would run
    no code the others do not."""
    margins = {m: margin_bounds(apply, params, x, y, eps=radius, norm=norm, method=m)
               for m in METHODS}
    low, high = jnp.clip(x - radius, 0, 1), jnp.clip(x + radius, 0, 1)
    logits = ({m: logit_bounds(apply, params, low, high, method=m) for m in ("ibp", "crown-ibp")}
              if norm == "linf" else {})
    return margins, logits


@pytest.mark.parametrize("norm", sets.NORMS)
@pytest.mark.parametrize("name", sorted(NETS))
@settings(max_examples=6)
@given(seed=st.integers(0, 2**16), eps=st.floats(0.01, 0.3))
def test_bounds_contain_the_outputs_at_points_of_the_set(name, norm, seed, eps):
    init, apply = NETS[name]()
    params = jax.jit(init)(jax.random.key(seed))  # jitted: one program per net, not per op
    x = _images(jax.random.key(seed + 1), 2, low=0.0, high=1.0)
    y = jnp.argmax(jax.jit(apply)(params, x), axis=1)
    radius = jnp.float32(eps if norm == "linf" else 3 * eps)
    logits = _sampled(apply, params, x, radius, jax.random.key(seed + 2), norm)
    worst = jnp.min(jax.vmap(lambda z: _margins(z, y))(logits), axis=0)
    found, logit_found = _every_bound(apply, params, x, y, radius, norm)
    for method, bound in found.items():
        assert jnp.all(_wrong(bound) <= worst), (method, jnp.min(worst - bound))
    ibp_bound = jnp.where(jnp.isinf(found["ibp"]), 0.0, found["ibp"])
    for method in ("crown-ibp", "crown"):  # never looser than IBP (intersected with it)
        bound = jnp.where(jnp.isinf(found[method]), 0.0, found[method])
        assert jnp.all(bound >= ibp_bound - 1e-5 * (1 + jnp.abs(ibp_bound))), method
    for method, (lower, upper) in logit_found.items():
        assert jnp.all(lower <= logits.min(0)) and jnp.all(upper >= logits.max(0)), method


# ----------------------------------------------------------------------------------------
# unsupported operations, demo models, jit
# ----------------------------------------------------------------------------------------


def test_unsupported_operations_raise_naming_the_primitive_and_line():
    x, y = _images(jax.random.key(0), 1), jnp.array([0])

    def softish(params, v):
        return jnp.exp(v.reshape(1, -1)[:, :3])  # this line

    with pytest.raises(UnsupportedPrimitive, match=r"cannot bound `exp` \(test_certify_bounds"
                       r"\.py:\d+\): certify supports"):
        margin_bounds(softish, {}, x, y, eps=0.1)
    with pytest.raises(UnsupportedPrimitive, match="`mul`"):
        margin_bounds(lambda p, v: (v * v).reshape(1, -1)[:, :3], {}, x, y, eps=0.1)
    with pytest.raises(UnsupportedPrimitive, match="`select_n`"):
        margin_bounds(lambda p, v: jnp.where(v > 0.5, v, 0.0).reshape(1, -1)[:, :3], {}, x, y,
                      eps=0.1)
    assert issubclass(UnsupportedPrimitive, ValueError)


def test_arguments_are_checked():
    x, y = _images(jax.random.key(0), 2), jnp.array([0, 1])
    with pytest.raises(ValueError, match="method must be one of"):
        margin_bounds(_linear, {}, x, y, eps=0.1, method="deeppoly")
    with pytest.raises(ValueError, match="norm must be one of"):
        margin_bounds(_linear, {}, x, y, eps=0.1, norm="l1")
    with pytest.raises(ValueError, match="labels must be integers"):
        margin_bounds(_linear, {}, x, y[:1], eps=0.1)
    with pytest.raises(ValueError, match=r"images must be \[B, H, W, C\]"):
        logit_bounds(_linear, {}, x[0], x[0])


@pytest.mark.parametrize("module", [SmallCNN(conv1=4, conv2=4, hidden=8, kernel=3),
                                    LinenCNN(conv1=4, conv2=4, hidden=8)])
def test_demo_models_are_bounded_soundly(module):
    x = _images(jax.random.key(0), 2, shape=(28, 28, 1), low=0.0, high=1.0)
    params = jax.jit(module.init)(jax.random.key(1), x)  # jitted: one program, not per op
    y = jnp.argmax(jax.jit(module.apply)(params, x), axis=1)
    points = _points(jax.random.key(2), x, 0.02, "linf", 8)
    worst = jax.jit(lambda p, v: jnp.min(jax.vmap(lambda u: _margins(module.apply(p, u), y))(
        v), axis=0))(params, points)  # one program, not one per operation
    for method in METHODS:
        bound = margin_bounds(module.apply, params, x, y, eps=0.02, method=method)
        assert jnp.all(_wrong(bound) <= worst), method
        assert jnp.all(jnp.isfinite(jnp.where(jnp.isinf(bound), 0, bound)))


@pytest.mark.slow  # two CROWN-IBP programs
def test_parameters_are_jit_arguments_and_batches_do_not_matter():
    """CROWN's own batch independence (its refinement per group) is test_certify_sparse's."""
    traces = []
    module = SmallCNN(conv1=2, conv2=2, hidden=4, kernel=3)

    def apply(params, x):
        traces.append(x.shape)
        return module.apply(params, x)

    x = _images(jax.random.key(0), bounds.GROUP + 3, shape=(28, 28, 1), low=0.0, high=1.0)
    first, second = (module.init(jax.random.key(k), x) for k in (1, 2))
    y = jnp.zeros(len(x), jnp.int32)  # more than a GROUP: a loop over padded groups
    run = jax.jit(lambda p, v, t: margin_bounds(apply, p, v, t, eps=0.05, method="crown-ibp"))
    a, b = run(first, x, y), run(second, x, y)
    assert len(traces) == 1 and not jnp.allclose(a, b)  # one trace, the parameters not baked in
    part = margin_bounds(apply, first, x[:2], y[:2], eps=jnp.array([0.05, 0.05]),
                         method="crown-ibp")  # a radius per example, or one for all: the same
    np.testing.assert_allclose(part, a[:2], rtol=1e-5, atol=1e-6)


def test_logit_bounds_are_differentiable_in_the_parameters():
    init, apply = REFERENCE_NETS["cnn"][0], None
    del apply
    params = jax.jit(init)(jax.random.split(jax.random.key(6), 5))
    functions = REFERENCE_NETS["cnn"][1]

    def apply(p, x):
        return functions[2](p, jax.nn.relu(functions[1](p, jax.nn.relu(functions[0](p, x)))))

    x = _images(jax.random.key(7), 3)
    for method in ("ibp", "crown-ibp"):
        def loss(p):
            lower, upper = logit_bounds(apply, p, x - 0.05, x + 0.05, method=method)
            return jnp.sum(upper - lower)

        value_and_grad = jax.jit(jax.value_and_grad(loss))  # one program: value and gradient
        value, gradient = value_and_grad(params)
        assert all(jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(gradient))
        assert jnp.any(gradient["k1"] != 0)
        step = jax.tree.map(lambda p, g: p - 1e-3 * g, params, gradient)
        assert value_and_grad(step)[0] < value  # the gradient points downhill


def test_negative_radius_gives_nan_rows():
    x, y = _images(jax.random.key(0), 2), jnp.array([0, 1])
    params = {"w": jnp.ones((32, 3)), "b": jnp.zeros(3)}
    got = margin_bounds(_linear, params, x, y, eps=jnp.array([0.1, -0.1]), method="ibp")
    assert jnp.all(jnp.isfinite(got[0, 1:])) and jnp.all(jnp.isnan(got[1, jnp.array([0, 2])]))


def test_logits_that_do_not_depend_on_the_input_are_bounded_exactly():
    """Exact up to the allowance for the bound's own float32 sums (a few ulps), and below."""
    x, y = _images(jax.random.key(0), 2), jnp.array([0, 2])

    def constant(params, v):
        return jnp.zeros((v.shape[0], 3)) + params["b"][None]

    params = {"b": jnp.array([1.0, -1.0, 0.5])}
    exact = np.array([[np.inf, 2.0, 0.5], [-0.5, 1.5, np.inf]])
    for method in METHODS:
        got = margin_bounds(constant, params, x, y, eps=0.1, method=method)
        np.testing.assert_allclose(got, exact, rtol=1e-5)
        assert np.all(np.asarray(got) <= exact)
        np.testing.assert_array_equal(
            margin_bounds(constant, params, x, y, eps=0.1, method=method, rounding=False), exact)
        lower, upper = logit_bounds(constant, params, x, x, method=method)
        np.testing.assert_allclose(lower, upper, rtol=1e-5)
        assert np.all(lower <= params["b"][None]) and np.all(upper >= params["b"][None])


def test_bounds_module_exports_the_api():
    assert bounds.METHODS == ("ibp", "crown-ibp", "crown")
    assert set(bounds.__all__) >= {"METHODS", "UnsupportedPrimitive", "logit_bounds",
                                   "margin_bounds"}


def test_the_float_margin_leaves_a_tiny_ball_nearly_exact():
    """At a radius where the network is almost linear, CROWN is nearly the clean margin: the
    widening for float32's rounding is a few ulps of each layer's sums, not a product of
    |weights| through the layers (which left -1.2 here, and 2 of 100 trained-CNN examples
    certified at Linf 0.05 where 69 are)."""
    module = SmallCNN()
    params = jax.jit(module.init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    x = jax.random.uniform(jax.random.key(1), (3, 28, 28, 1))
    logits = jax.jit(module.apply)(params, x)  # jitted: one program, not one per operation
    top2 = jnp.sort(logits, axis=1)[:, -2:]
    clean = top2[:, 1] - top2[:, 0]
    y = jnp.argmax(logits, axis=1)
    lower = jnp.min(bounds.margin_bounds(module.apply, params, x, y, eps=0.002, method="crown"),
                    axis=1)
    assert jnp.all(lower <= clean) and jnp.all(lower >= 0.5 * clean)
