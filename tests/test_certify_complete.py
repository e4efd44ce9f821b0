"""The complete mode: exact verification of small ReLU networks by a MIP, checked against an
independent brute force (one LP per activation pattern), closed forms and the time limit."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import numpy as np
import pytest
import scipy.sparse
from scipy.optimize import linprog

from jaxbundle.certify import complete as complete_lib
from jaxbundle.certify.program import INPUT, Affine, ReluProgram

# --- small explicit networks and their programs ---------------------------------------------


def random_net(seed: int, inputs: int, hidden: tuple[int, ...], classes: int = 3,
               skip: bool = True) -> list[dict]:
    """Dense layers ``[{source: W}, b]``: hidden layer k reads layer k - 1 (the input for
    k = 0) and, with ``skip``, the input too; the last entry is the logits' layer."""
    rng = np.random.default_rng(seed)
    layers, previous = [], (INPUT, inputs)
    for k, width in enumerate((*hidden, classes)):
        terms = {previous[0]: rng.normal(size=(width, previous[1]))}
        if skip and previous[0] != INPUT:
            terms[INPUT] = 0.5 * rng.normal(size=(width, inputs))
        layers.append({"terms": terms, "bias": 0.3 * rng.normal(size=width)})
        previous = (k, width)
    return layers


def interval(terms: dict, bias: np.ndarray, boxes: dict) -> tuple[np.ndarray, np.ndarray]:
    """Interval arithmetic of ``sum W @ v + b`` over the sources' boxes, in float64."""
    low, high = bias.copy(), bias.copy()
    for source, w in terms.items():
        lo, hi = boxes[source]
        low += np.maximum(w, 0) @ lo + np.minimum(w, 0) @ hi
        high += np.maximum(w, 0) @ hi + np.minimum(w, 0) @ lo
    return low, high


def program_of(net: list[dict], center: np.ndarray, y: int, eps: float, lower: float = 0.0,
               upper: float = 1.0) -> ReluProgram:
    """The network's program over the Linf ball around ``center`` within the box (interval
    bounds: sound, and loose enough to leave unstable neurons)."""
    low, high = np.maximum(center - eps, lower), np.minimum(center + eps, upper)
    boxes = {INPUT: (low, high)}
    layers, pre_lower, pre_upper = [], [], []
    for k, layer in enumerate(net[:-1]):
        lo, hi = interval(layer["terms"], layer["bias"], boxes)
        boxes[k] = (np.maximum(lo, 0), np.maximum(hi, 0))
        layers.append(affine(layer["terms"], layer["bias"]))
        pre_lower.append(lo)
        pre_upper.append(hi)
    last = net[-1]
    wrong = np.array([j for j in range(len(last["bias"])) if j != y])
    rows = {s: w[[y]] - w[wrong] for s, w in last["terms"].items()}
    margins = affine(rows, last["bias"][y] - last["bias"][wrong])
    return ReluProgram(low, high, center, tuple(layers), tuple(pre_lower), tuple(pre_upper),
                       margins, wrong)


def affine(terms: dict, bias: np.ndarray) -> Affine:
    return Affine(tuple((s, scipy.sparse.csr_array(w)) for s, w in terms.items()),
                  np.asarray(bias, np.float64))


def unstable_count(program: ReluProgram) -> int:
    return int(sum(np.sum((lo < 0) & (hi > 0))
                   for lo, hi in zip(program.pre_lower, program.pre_upper)))


# --- the independent oracle: one LP per activation pattern ----------------------------------


def brute_force(program: ReluProgram) -> float:
    """The exact smallest margin: every activation pattern of the unstable neurons, each an LP
    over the input and every ReLU output with each neuron's sign constraint (``linprog``)."""
    d = np.size(program.lower)
    widths = [d] + [len(b) for b in program.pre_lower]
    starts = np.concatenate([[0], np.cumsum(widths)])
    columns = int(starts[-1])

    def dense(a: Affine) -> np.ndarray:
        out = np.zeros((len(a.bias), columns))
        for source, w in a.terms:
            out[:, starts[source + 1]:starts[source + 1] + w.shape[1]] = w.toarray()
        return out

    weights = [dense(layer) for layer in program.layers]
    unstable = [np.flatnonzero((lo < 0) & (hi > 0))
                for lo, hi in zip(program.pre_lower, program.pre_upper)]
    flat = [(k, i) for k, idx in enumerate(unstable) for i in idx]
    objective = dense(program.margins)
    best = np.inf
    for pattern in itertools.product((False, True), repeat=len(flat)):
        on = {key: value for key, value in zip(flat, pattern)}
        a_eq, b_eq, a_ub, b_ub = [], [], [], []
        bounds = [(lo, hi) for lo, hi in zip(program.lower, program.upper)]
        for k, (w, layer) in enumerate(zip(weights, program.layers)):
            for i in range(len(layer.bias)):
                active = on.get((k, i), program.pre_lower[k][i] >= 0)
                own = np.zeros(columns)
                own[starts[k + 1] + i] = 1.0
                if active:  # a = z >= 0
                    a_eq.append(own - w[i])
                    b_eq.append(layer.bias[i])
                    a_ub.append(-w[i])
                    b_ub.append(layer.bias[i])
                    bounds.append((None, None))
                else:  # a = 0, z <= 0
                    a_ub.append(w[i])
                    b_ub.append(-layer.bias[i])
                    bounds.append((0.0, 0.0))
        for row, bias in zip(objective, program.margins.bias):
            result = linprog(row, A_ub=np.array(a_ub) if a_ub else None,
                             b_ub=b_ub if b_ub else None, A_eq=np.array(a_eq) if a_eq else None,
                             b_eq=b_eq if b_eq else None, bounds=bounds, method="highs")
            if result.status == 0:
                best = min(best, result.fun + bias)
            else:
                assert result.status == 2, result.message  # infeasible patterns only
    return best


def sampled_minimum(program: ReluProgram, samples: int = 400, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    points = rng.uniform(program.lower, program.upper, size=(samples, np.size(program.lower)))
    return min(float(np.min(complete_lib.forward(program, p)[0])) for p in points)


def logits_of(net: list[dict], x: np.ndarray) -> np.ndarray:
    """The network's logits at ``x`` (float64, true ReLUs)."""
    values = {INPUT: x}
    for k, layer in enumerate(net):
        z = layer["bias"] + sum(w @ values[s] for s, w in layer["terms"].items())
        values[k] = np.maximum(z, 0)
    return z


def tiny_examples(seed: int, inputs: int, hidden: tuple[int, ...], skip: bool, count: int = 4,
                  max_unstable: int = 9) -> list[ReluProgram]:
    """``count`` programs of one random net with 1 to ``max_unstable`` unstable neurons: random
    centres and radii, labelled by the net's own prediction except every third (misclassified
    at its centre), some boxes cut by the data's box."""
    net = random_net(seed, inputs, hidden, skip=skip)
    rng = np.random.default_rng(1000 + seed)
    programs = []
    while len(programs) < count:
        center, eps = rng.uniform(0, 1, inputs), rng.uniform(0.05, 0.6)
        y = int(np.argmax(logits_of(net, center)))
        if len(programs) % 3 == 2:
            y = (y + 1) % 3
        program = program_of(net, center, y, eps)
        if 1 <= unstable_count(program) <= max_unstable:
            programs.append(program)
    return programs


TINY = [(0, 2, (4,), False), (1, 3, (3, 3), True), (2, 4, (4, 3), True), (3, 2, (3, 2), True),
        (4, 3, (5,), False), (5, 4, (3, 4), True), (6, 2, (6,), True), (7, 3, (4, 4), True)]


def check_against_exact(decision: complete_lib.Decision, program: ReluProgram, exact: float):
    """The decision agrees with the exact smallest margin ``exact``."""
    if exact > 1e-7:
        assert decision.status == "certified", (decision, exact)
        assert decision.margin <= exact + 1e-9  # a lower bound ...
        tolerance = complete_lib.certify_tolerance(program)  # subtracted from every bound
        assert decision.margin >= exact - tolerance - 1e-4 * max(1.0, abs(exact))  # tight
        assert decision.x is None
    elif exact < -1e-7:
        assert decision.status == "attacked", (decision, exact)
        assert exact - 1e-9 <= decision.margin < -complete_lib.ATTACK_ATOL
        assert np.all(decision.x >= program.lower) and np.all(decision.x <= program.upper)
        assert np.isclose(np.min(complete_lib.forward(program, decision.x)[0]), decision.margin)
    else:
        assert decision.status != "attacked" or decision.margin < 0


@functools.cache
def tiny_cases(seed: int, inputs: int, hidden: tuple[int, ...], skip: bool):
    """``tiny_examples`` of a config and each one's exact smallest margin (the brute force: one
    LP per activation pattern), computed once for the tests that share them."""
    programs = tiny_examples(seed, inputs, hidden, skip)
    return programs, [brute_force(program) for program in programs]


@pytest.mark.parametrize("seed,inputs,hidden,skip", TINY)
def test_decide_agrees_with_brute_force_on_random_tiny_nets(seed, inputs, hidden, skip):
    statuses = set()
    for program, exact in zip(*tiny_cases(seed, inputs, hidden, skip)):
        assert sampled_minimum(program) >= exact - 1e-9  # the oracle is a true minimum
        decision = complete_lib.decide(program, time_limit=10.0)
        check_against_exact(decision, program, exact)
        statuses.add(decision.status)
        quick = complete_lib.decide(program, time_limit=10.0, tighten=False)
        assert quick.status == decision.status
        assert quick.margin <= decision.margin + 1e-9 if quick.status == "certified" else True
    assert "attacked" in statuses  # every third example is misclassified at its centre


def test_both_statuses_and_unstable_neurons_are_covered():
    programs = [p for config in TINY for p in tiny_cases(*config)[0]]
    exact = np.array([e for config in TINY for e in tiny_cases(*config)[1]])
    assert np.sum(exact > 0) >= 10 and np.sum(exact < 0) >= 10
    # attacked beyond the centre: examples right at their centre that the MIP still breaks
    right = np.array([np.min(complete_lib.forward(p, p.center)[0]) > 0 for p in programs])
    assert np.sum(right & (exact < 0)) >= 3
    assert max(unstable_count(p) for p in programs) >= 5


# --- closed forms ---------------------------------------------------------------------------


def test_linear_margin_has_its_closed_form_minimum():
    """No ReLU layer: the margin ``c . x + b`` is smallest at the box's corner against ``c``."""
    rng = np.random.default_rng(0)
    for trial in range(6):
        d = 5
        c, lower = rng.normal(size=d), rng.uniform(0, 0.5, d)
        upper = lower + rng.uniform(0.2, 0.5, d)
        corner, best = np.where(c > 0, lower, upper), np.where(c > 0, upper, lower)
        bias = (0.3 if trial % 2 else -0.3) - c @ corner
        assert c @ best + bias > 0  # the example (the best corner) is classified right
        program = ReluProgram(lower, upper, best, (), (), (),
                              affine({INPUT: c[None]}, np.array([bias])), np.array([1]))
        decision = complete_lib.decide(program, time_limit=5.0)
        minimum = c @ corner + bias
        assert np.isclose(minimum, 0.3 if trial % 2 else -0.3)
        if trial % 2:
            assert decision.status == "certified"
            assert decision.margin == pytest.approx(minimum, abs=1e-5)
        else:
            assert decision.status == "attacked" and np.isclose(decision.margin, minimum)
            np.testing.assert_allclose(decision.x, corner)


@pytest.mark.parametrize("low,high,center,threshold,status,minimum", [
    (-1.0, 1.0, 0.8, 0.5, "attacked", -0.5),  # |x| - 0.5 is smallest at x = 0, inside
    (0.6, 1.0, 0.8, 0.5, "certified", 0.1),  # ... at the box's edge 0.6
    (-1.0, -0.2, -0.5, 0.1, "certified", 0.1),
    (-0.3, 0.4, 0.35, 0.25, "attacked", -0.25),
])
def test_absolute_value_margin(low, high, center, threshold, status, minimum):
    """``relu(x) + relu(-x) - t = |x| - t``: one or two unstable neurons, a kink inside; the
    centre is classified right, so an attack comes from an LP or the MIP."""
    lo, hi = np.array([low, -high]), np.array([high, -low])
    program = ReluProgram(np.array([low]), np.array([high]), np.array([center]),
                          (affine({INPUT: np.array([[1.0], [-1.0]])}, np.zeros(2)),),
                          (lo,), (hi,), affine({0: np.ones((1, 2))}, np.array([-threshold])),
                          np.array([1]))
    decision = complete_lib.decide(program, time_limit=5.0)
    assert decision.status == status
    if status == "attacked":
        assert minimum - 1e-9 <= decision.margin < 0
        assert abs(decision.x[0]) - threshold == pytest.approx(decision.margin, abs=1e-12)
    else:
        assert decision.margin == pytest.approx(minimum, abs=1e-5)


# --- the time limit ---------------------------------------------------------------------------


def harder_example(seed: int, inputs: int, hidden: tuple[int, ...], eps: float) -> ReluProgram:
    """A net with 20-40 unstable neurons that the MIP needs branching for (0.1-0.5 s)."""
    net = random_net(seed, inputs, hidden, classes=4)
    center = np.random.default_rng(seed).uniform(0, 1, inputs)
    return program_of(net, center, int(np.argmax(logits_of(net, center))), eps)


HARDER = [(2, 6, (16, 16), 0.15), (2, 10, (25, 25), 0.08)]  # certified / attacked


def test_time_limit_gives_unknown_never_a_wrong_status():
    for config, truth in zip(HARDER, ("certified", "attacked")):
        program = harder_example(*config)
        assert unstable_count(program) >= 20
        full = complete_lib.decide(program, time_limit=20.0)
        assert full.status == truth
        seen = set()
        for limit in (1e-4, 3e-3, 0.03):
            start = time.perf_counter()
            early = complete_lib.decide(program, time_limit=limit)
            assert time.perf_counter() - start < limit + 0.5  # HiGHS stops on time
            assert early.status in ("unknown", truth)
            if early.status != "attacked":
                assert early.margin <= full.margin + 1e-9  # still a sound lower bound
            seen.add(early.status)
        assert "unknown" in seen


def test_time_limit_must_be_positive():
    program = tiny_examples(*TINY[0], count=1)[0]
    for bad in (0.0, -1.0, True):
        with pytest.raises(ValueError, match="time_limit must be a positive number"):
            complete_lib.decide(program, time_limit=bad)


# --- attacks re-checked, ties and bad programs ------------------------------------------------


def one_input(c: float, bias: float, low: float = 0.0, high: float = 1.0) -> ReluProgram:
    """The margin ``c x + bias`` on ``[low, high]`` (no ReLU)."""
    return ReluProgram(np.array([low]), np.array([high]), np.array([high]), (), (), (),
                       affine({INPUT: np.array([[c]])}, np.array([bias])), np.array([1]))


@pytest.mark.parametrize("bias", [0.0, -1e-12, 1e-12, -5e-10])
def test_a_tie_is_neither_certified_nor_attacked(bias):
    """``x + bias`` on ``[0, 1]``: its minimum ``bias`` is within the tolerances of zero, so the
    solver's "optimum" proves nothing either way."""
    decision = complete_lib.decide(one_input(1.0, bias), time_limit=5.0)
    assert decision.status == "unknown" and decision.x is None
    assert decision.margin <= bias + 1e-12


def test_an_attack_is_the_exact_networks_not_the_solvers():
    """A MIP point is re-evaluated exactly: every attacked decision's ``x`` is in the box and
    misclassified by the float64 network, whatever the solver's tolerances."""
    for config in TINY[:4]:
        for program in tiny_examples(*config):
            decision = complete_lib.decide(program, time_limit=5.0)
            if decision.status == "attacked":
                assert np.all(program.lower <= decision.x) and np.all(decision.x <= program.upper)
                margins, _ = complete_lib.forward(program, decision.x)
                assert np.min(margins) == decision.margin < -complete_lib.ATTACK_ATOL


def test_certified_needs_more_than_the_solvers_tolerance():
    program = one_input(1.0, 0.5 * complete_lib.certify_tolerance(one_input(1.0, 0.0)))
    assert complete_lib.decide(program, time_limit=5.0).status == "unknown"
    assert complete_lib.decide(one_input(1.0, 1e-3), time_limit=5.0).status == "certified"


def test_unsound_or_malformed_programs_are_refused():
    program = tiny_examples(*TINY[1], count=1)[0]
    above = (program.pre_upper[0] + 1.0, *program.pre_lower[1:])  # excludes the centre
    with pytest.raises(ValueError, match="exclude the example's own pre-activations"):
        complete_lib.decide(dataclasses.replace(program, pre_lower=above), time_limit=1.0)
    infinite = (np.full_like(program.pre_lower[0], -np.inf), *program.pre_lower[1:])
    with pytest.raises(ValueError, match="must be finite"):
        complete_lib.decide(dataclasses.replace(program, pre_lower=infinite), time_limit=1.0)
    with pytest.raises(ValueError, match="input box is empty"):
        complete_lib.decide(one_input(1.0, 0.1, low=1.0, high=0.0), time_limit=1.0)
    wide = affine({INPUT: np.ones((1, 3))}, np.zeros(1))
    with pytest.raises(ValueError, match="has shape"):
        complete_lib.decide(dataclasses.replace(one_input(1.0, 0.1), margins=wide),
                            time_limit=1.0)
    with pytest.raises(ValueError, match="one class per margin row"):
        complete_lib.decide(dataclasses.replace(one_input(1.0, 0.1), classes=np.arange(2)),
                            time_limit=1.0)


def linear_model(params, x):
    """Two logits ``(0, x - 0.5)`` of a one-pixel image: class 1 wins above 0.5."""
    pixel = x.reshape(x.shape[0], -1)[:, :1]
    return np.concatenate([0.0 * pixel, pixel - params], axis=1)


def test_confirm_rechecks_the_model_in_float32_inside_ball_and_box():
    x, half = np.array([[0.3]], np.float32), np.float32(0.5)
    assert complete_lib.confirm(linear_model, half, x, 0, np.array([0.6]), eps=0.3) is not None
    # a tie on the boundary, a point outside the ball, a right prediction: not confirmed
    for point in (0.5, 0.7, 0.4):
        assert complete_lib.confirm(linear_model, half, x, 0, np.array([point]), eps=0.3) is None
    # a float64 point on the ball's edge rounds into it in float32
    edge = complete_lib.confirm(linear_model, half, x, 0, np.array([0.3 + 0.3]), eps=0.3)
    assert edge is not None and edge.dtype == np.float32
    assert abs(np.float64(edge[0]) - np.float64(x[0, 0])) <= 0.3


# --- the complete mode on flax models (programs from jaxbundle.certify.extract) ---------------


def flax_model(kind: str):
    """A random-init ReLU network on 3x3x1 images, 3 classes: an MLP or a small CNN."""
    import flax.linen as nn
    import jax

    bias = nn.initializers.normal(0.3)  # no all-zero biases: no exact ties between logits

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            if kind == "cnn":
                x = nn.relu(nn.Conv(2, (2, 2), padding="VALID", bias_init=bias)(x))
            h = x.reshape(x.shape[0], -1)
            h = nn.relu(nn.Dense(5, bias_init=bias)(h))
            return nn.Dense(3, bias_init=bias)(h)

    module = Net()
    images = np.random.default_rng(3).uniform(size=(8, 3, 3, 1)).astype(np.float32)
    params = module.init(jax.random.key(5), images[:1])
    return module.apply, params, images


def model_margins(apply_fn, params, points: np.ndarray, shape, y: int, classes) -> np.ndarray:
    import jax.numpy as jnp

    logits = np.asarray(apply_fn(params, jnp.asarray(points.reshape(-1, *shape), jnp.float32)))
    return logits[:, [y]] - logits[:, classes]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_complete_on_a_flax_model_agrees_with_brute_force_and_crown(kind):
    extract = pytest.importorskip("jaxbundle.certify.extract")
    import jax.numpy as jnp

    from jaxbundle.certify import bounds

    apply_fn, params, images = flax_model(kind)
    y = np.array(jnp.argmax(apply_fn(params, jnp.asarray(images)), axis=1))
    y[::4] = (y[::4] + 1) % 3  # some misclassified at their centre
    rng = np.random.default_rng(0)
    statuses = []
    for eps in (0.03, 0.12):
        programs = extract.relu_program(apply_fn, params, images, y, eps=eps)
        decisions = complete_lib.complete(apply_fn, params, images, y, eps=eps, time_limit=10.0)
        crown = np.min(np.asarray(bounds.margin_bounds(apply_fn, params, jnp.asarray(images),
                                                       jnp.asarray(y), eps=eps)), axis=1)
        for i, (program, decision) in enumerate(zip(programs, decisions)):
            # the program computes the model's margins (float32 against float64)
            points = rng.uniform(program.lower, program.upper, size=(16, program.lower.size))
            exact = np.stack([complete_lib.forward(program, p)[0] for p in points])
            np.testing.assert_allclose(exact, model_margins(
                apply_fn, params, points, images.shape[1:], int(y[i]), program.classes),
                atol=1e-4)
            if unstable_count(program) <= 7:
                check_against_exact(decision, program, brute_force(program))
            if decision.status == "certified":
                assert crown[i] <= decision.margin + 1e-4  # CROWN never beats the exact bound
            if crown[i] > 0:
                assert decision.status == "certified"
            if decision.status == "attacked":
                adv = decision.x.reshape(images.shape[1:])
                assert decision.x.dtype == np.float32
                assert np.max(np.abs(adv.astype(np.float64) - images[i])) <= eps
                assert adv.min() >= 0 and adv.max() <= 1
                fooled = model_margins(apply_fn, params, decision.x[None], images.shape[1:],
                                       int(y[i]), program.classes)
                assert np.min(fooled) < 0
            statuses.append(decision.status)
    assert "certified" in statuses and "attacked" in statuses


# --- complete(): programs in, decisions re-checked on the float32 model ---------------------


def use_programs(monkeypatch, programs_of):
    """``complete`` with ``relu_program`` replaced by ``programs_of(x, y, eps)``."""
    import sys
    import types

    fake = types.ModuleType("jaxbundle.certify.extract")
    fake.relu_program = lambda apply_fn, params, x, y, *, eps, lower=0.0, upper=1.0: (
        programs_of(x, y, eps))
    if hasattr(complete_lib, "relu_program"):
        monkeypatch.setattr(complete_lib, "relu_program", fake.relu_program)
    else:
        monkeypatch.setitem(sys.modules, "jaxbundle.certify.extract", fake)


def jnp_model(net: list[dict]):
    """The explicit network as ``apply_fn(params, x)`` in float32 (params unused)."""
    import jax.numpy as jnp

    def apply_fn(params, x):
        values = {INPUT: x.reshape(x.shape[0], -1)}
        for k, layer in enumerate(net):
            z = jnp.asarray(layer["bias"], jnp.float32)[None] + sum(
                values[s] @ jnp.asarray(w.T, jnp.float32) for s, w in layer["terms"].items())
            values[k] = jnp.maximum(z, 0)
        return z

    return apply_fn


def test_complete_rechecks_every_attack_on_the_float32_model(monkeypatch):
    net = random_net(11, 3, (4, 3), skip=True)
    rng = np.random.default_rng(2)
    x = rng.uniform(0, 1, (10, 3, 1, 1)).astype(np.float32)
    y = np.array([int(np.argmax(logits_of(net, v.ravel().astype(np.float64)))) for v in x])
    use_programs(monkeypatch, lambda x_, y_, eps: [
        program_of(net, v.ravel().astype(np.float64), int(c), eps) for v, c in zip(x_, y_)])
    apply_fn = jnp_model(net)
    decisions = complete_lib.complete(apply_fn, None, x, y, eps=0.25, time_limit=5.0)
    assert {d.status for d in decisions} == {"certified", "attacked"}
    for v, c, decision in zip(x, y, decisions):
        program = program_of(net, v.ravel().astype(np.float64), int(c), 0.25)
        check_against_exact(decision, program, brute_force(program))
        if decision.status == "attacked":
            assert decision.x.dtype == np.float32
            assert np.max(np.abs(decision.x.astype(np.float64) - v.ravel())) <= 0.25
            logits = np.asarray(apply_fn(None, decision.x.reshape(1, 3, 1, 1)))[0]
            assert np.max(np.delete(logits, c)) > logits[c]


def test_complete_downgrades_an_attack_the_float32_model_does_not_confirm(monkeypatch):
    """The float64 program says ``0.6 - 1e-8 - x < 0`` at ``x = 0.6``, the ball's edge; in
    float32 the threshold rounds to ``0.6`` and the model is not fooled: unknown, with a
    sound margin."""
    threshold = 0.6 - 1e-8
    program = ReluProgram(np.array([0.0]), np.array([0.6]), np.array([0.3]), (), (), (),
                          affine({INPUT: np.array([[-1.0]])}, np.array([threshold])),
                          np.array([1]))
    assert complete_lib.decide(program, time_limit=5.0).status == "attacked"
    use_programs(monkeypatch, lambda x_, y_, eps: [program])

    def apply_fn(params, x):
        import jax.numpy as jnp

        pixel = x.reshape(x.shape[0], 1)
        return jnp.concatenate([jnp.zeros_like(pixel), pixel - jnp.float32(threshold)], axis=1)

    (decision,) = complete_lib.complete(apply_fn, None, np.full((1, 1, 1, 1), 0.3, np.float32),
                                        np.array([0]), eps=0.3, time_limit=5.0)
    assert decision.status == "unknown" and decision.x is None
    assert decision.margin <= -1e-8  # a lower bound on the true minimum
