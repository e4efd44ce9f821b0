"""Every attack passes the protocol's conformance suite and the linear-model oracles."""

from __future__ import annotations

import functools
import importlib
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle import attacks, norms, suites
from jaxbundle.attacks.base import KINDS, Attack, Candidate, WhiteBoxModel, threat_model
from jaxbundle.bundler import bundle
from attack_checks import assert_refused
from toys import KEY, images, linear_apply, linear_problem, min_distance, trajectory

# (factory call, norm) for every attack and norm the skeleton offers.
ATTACKS = [
    pytest.param(lambda: attacks.fgsm("linf"), "linf", id="fgsm-linf"),
    pytest.param(lambda: attacks.fgsm("l2"), "l2", id="fgm-l2"),
    pytest.param(lambda: attacks.pgd("linf", steps=5), "linf", id="pgd-linf"),
    pytest.param(lambda: attacks.pgd("l2", steps=5, loss="margin"), "l2", id="pgd-l2-margin"),
    pytest.param(
        lambda: attacks.pgd("linf", steps=5, loss="dlr", restarts=3), "linf", id="pgd-dlr"
    ),
    pytest.param(
        lambda: attacks.pgd("linf", steps=5, random_start=False, step_size=0.02), "linf", id="bim"
    ),
    pytest.param(lambda: attacks.apgd("linf", steps=6), "linf", id="apgd-ce-linf"),
    pytest.param(
        lambda: attacks.apgd("l2", loss="dlr", steps=6, restarts=2), "l2", id="apgd-dlr-l2"
    ),
    pytest.param(
        lambda: attacks.apgd("linf", loss="dlr-targeted", steps=6, targets=3), "linf", id="apgd-t"
    ),
    pytest.param(lambda: attacks.bp(steps=6), "l2", id="bp"),
    pytest.param(lambda: attacks.fmn("linf", steps=6), "linf", id="fmn-linf"),
    pytest.param(lambda: attacks.fmn("l2", steps=6), "l2", id="fmn-l2"),
    pytest.param(lambda: attacks.fmn("l1", steps=6), "l1", id="fmn-l1"),
    pytest.param(
        lambda: attacks.deepfool("linf", steps=4, candidates=3), "linf", id="deepfool-linf"
    ),
    pytest.param(lambda: attacks.deepfool("l2", steps=4, candidates=3), "l2", id="deepfool-l2"),
    pytest.param(lambda: attacks.cw(steps=3, search_steps=2), "l2", id="cw-l2"),
    pytest.param(lambda: attacks.spsa(steps=3, samples=4), "linf", id="spsa"),
    pytest.param(lambda: attacks.rays(steps=6), "linf", id="rays"),
    pytest.param(lambda: attacks.square("linf", queries=6), "linf", id="square-linf"),
    pytest.param(lambda: attacks.square("l2", queries=6), "l2", id="square-l2"),
    # SurFree's steps compile slowly: its conformance runs in the whole suite only (its own
    # tests, tests/test_surfree.py, run in the fast tier).
    pytest.param(lambda: attacks.surfree(queries=60, history=4), "l2", id="surfree",
                 marks=pytest.mark.slow),
]
EPS = {"linf": 0.1, "l2": 0.5, "l1": 1.0}
# The attacks of ATTACKS whose iterates depend on their keys (random starts, proposals or
# directions); the others (and RayS's first restart, from the all-ones direction) are
# deterministic functions of the images.
RANDOMISED = {"pgd-linf", "pgd-l2-margin", "pgd-dlr", "apgd-ce-linf", "apgd-dlr-l2", "apgd-t",
              "spsa", "square-linf", "square-l2", "surfree"}


def _setup(norm, attack=None):
    """The linear toy, seen as the attack's threat model allows (white-box by default)."""
    params, x, y = linear_problem(n=16)
    x = images(x)
    eps = jnp.full((16,), EPS[norm], jnp.float32)
    keys = attacks.per_example_keys(KEY, jnp.arange(16))
    kind = "white-box" if attack is None else attack.kind
    return threat_model(kind, linear_apply, params), x, jnp.asarray(y), eps, keys


def _run(attack: Attack, model, keys, x, y, eps):
    state = attack.init(attack.config, keys, x, y, eps, model, 0)
    return trajectory(state, lambda s: attack.step(attack.config, s, model), attack.num_steps)


@functools.cache
def _runner(attack: Attack, norm: str):
    """``keys -> (states, candidates)`` of ``attack`` on :func:`_setup`'s toy, as one jitted
    program per attack (equal attacks hash alike, so the tests below share it)."""
    model, x, y, eps, _ = _setup(norm, attack)
    return jax.jit(lambda keys: _run(attack, model, keys, x, y, eps))


@functools.cache
def _trail(attack: Attack, norm: str, seed: int | None = None):
    """Every state and candidate of ``attack``'s run from :func:`_setup`'s keys (or from the
    per-example keys of ``seed``); computed once per attack and shared by the tests that read
    them."""
    keys = _setup(norm, attack)[4] if seed is None else attacks.per_example_keys(
        jax.random.key(seed), jnp.arange(16))
    return _runner(attack, norm)(keys)


def _plain(a: jax.Array) -> np.ndarray:
    """An array on the host; PRNG keys as their raw data."""
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


@pytest.mark.parametrize("make, norm", ATTACKS)
class TestConformance:
    def test_factory_output(self, make, norm):
        attack = make()
        assert isinstance(attack, Attack)
        assert attack.norm == norm and attack.kind in KINDS
        assert attack == make(), "building an attack twice must give an equal (cache-hit) attack"
        assert {attack: "cached"}.get(make()) == "cached"  # equal attacks hash alike (jit key)

    def test_state_type_stable_and_jittable(self, make, norm):
        attack = make()
        model, x, y, eps, keys = _setup(norm, attack)
        params = linear_problem(n=16)[0]
        seen = lambda p: threat_model(attack.kind, linear_apply, p)  # noqa: E731
        init = jax.jit(lambda k, x, y, e, p: attack.init(attack.config, k, x, y, e, seen(p), 0))
        step = jax.jit(lambda s, p: attack.step(attack.config, s, seen(p)))
        state = init(keys, x, y, eps, params)
        new_state, cand = step(state, params)
        assert jax.tree.structure(state) == jax.tree.structure(new_state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
            assert a.shape == b.shape and a.dtype == b.dtype
        assert isinstance(cand, Candidate)
        assert cand.x.shape == x.shape
        assert (cand.logits is None) == (attack.kind == "decision-based")
        assert cand.logits is None or cand.logits.shape == (16, 4)
        assert hasattr(state, "x") and state.x.shape == x.shape

    def test_candidates_in_box_and_ball(self, make, norm):
        """Every iterate is in the box; a fixed-budget attack's are in the eps ball too."""
        attack = make()
        x = _setup(norm, attack)[1]
        states, cands = _trail(attack, norm)
        for point in [s.x for s in states] + [c.x for c in cands]:
            assert float(point.min()) >= 0.0 and float(point.max()) <= 1.0
            if attack.goal != "min_norm":
                assert np.all(np.asarray(norms.norm(point - x, norm))
                              <= EPS[norm] * (1 + 1e-5) + 1e-6)

    def test_candidate_logits_are_the_models(self, make, norm):
        attack = make()
        _, cands = _trail(attack, norm)
        white = WhiteBoxModel(linear_apply, linear_problem(n=16)[0])
        for cand in cands:
            if cand.logits is not None:  # label-only attacks have none
                np.testing.assert_allclose(cand.logits, white.logits(cand.x), rtol=1e-5, atol=1e-5)

    def test_randomness_comes_from_the_keys_only(self, make, norm, request):
        """A randomised attack draws from the per-example keys it is given (other keys, other
        iterates; a fixed key inside the attack would give the same), a deterministic one
        ignores them (:data:`RANDOMISED` lists which is which)."""
        attack = make()

        def trail(seed):  # one program for both keys (SurFree's eager steps retrace every call)
            states, cands = _trail(attack, norm, seed)
            return np.stack([np.asarray(p.x) for p in (*states, *cands)])

        randomised = request.node.callspec.id in RANDOMISED
        differ = not np.array_equal(trail(None), trail(99))
        assert differ == randomised

    def test_rows_can_be_gathered_mid_run(self, make, norm):
        """Every state leaf has the batch axis first, and rows step independently: stepping
        some rows of a state (repeated, as a cascade pads a bucket) equals taking those rows
        of the stepped batch. A segmented cascade relies on both."""
        attack = make()
        model, x, y, eps, keys = _setup(norm, attack)
        rows = jnp.asarray([3, 0, 7, 7])
        take = lambda tree: jax.tree.map(lambda a: a[rows], tree)  # noqa: E731
        step = lambda s: attack.step(attack.config, s, model)[0]  # noqa: E731

        @jax.jit  # one program (op by op, each attack's steps compiled every primitive apart)
        def stepped(keys, x, y, eps):
            state = step(attack.init(attack.config, keys, x, y, eps, model, 0))
            return state, take(step(state)), step(take(state))

        state, whole, part = stepped(keys, x, y, eps)
        for leaf in jax.tree.leaves(state):
            assert leaf.shape[:1] == (16,), f"a state leaf of shape {leaf.shape}"
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(part)):
            np.testing.assert_allclose(_plain(a), _plain(b), rtol=1e-5, atol=1e-6)

    def test_vmappable_over_restarts(self, make, norm):
        attack = make()
        model, x, y, eps, keys = _setup(norm, attack)

        def run(r):
            k = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, r)
            state = attack.init(attack.config, k, x, y, eps, model, r)
            return attack.step(attack.config, state, model)[0].x

        batched, alone = jax.jit(lambda: (jax.vmap(run)(jnp.arange(2)), run(1)))()
        np.testing.assert_allclose(batched[1], alone, rtol=1e-6, atol=1e-6)

    def test_no_retracing(self, make, norm):
        attack = make()
        params, x, y = linear_problem(n=8, seed=3)
        run = lambda xx, e, k: bundle(  # noqa: E731
            [attack], linear_apply, params, images(xx), jnp.asarray(y), k, eps=e, norm=norm
        )
        from jaxbundle.bundler import run as program

        run(x, EPS[norm], KEY)  # compiles (or finds the program of an earlier test)
        before = program._cache_size()
        run(x[::-1].copy(), EPS[norm] / 2, jax.random.key(5))  # new images, eps and key
        params = jax.tree.map(lambda p: p * 2, params)  # new parameter values
        run(x, EPS[norm], KEY)
        assert program._cache_size() == before


def test_random_start_differs_between_keys():
    attack = attacks.pgd("linf", steps=1)
    model, x, y, eps, keys = _setup("linf")
    s1 = attack.init(attack.config, keys, x, y, eps, model, 0)
    s2 = attack.init(attack.config, attacks.per_example_keys(jax.random.key(1), jnp.arange(16)),
                     x, y, eps, model, 0)
    assert not np.allclose(s1.x, s2.x)
    assert not np.allclose(s1.x[0], s1.x[1] - x[1] + x[0]), "examples must not share noise"


# ---------------------------------------------------------------------------------------------
# Analytic oracles on linear models.


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_fgsm_is_exact_on_binary_linear_model(norm):
    """With two classes the CE gradient is parallel to w_1 - w_0, so FGSM is the worst case."""
    params, x, y = linear_problem(n=200, k=2, seed=1)
    dist = min_distance(params, x, y, norm)
    eps = float(np.median(dist))
    r = bundle(
        [attacks.fgsm(norm)], linear_apply, params, images(x), jnp.asarray(y), KEY,
        eps=eps, norm=norm, judging="float",
    )
    success = np.asarray(r.attack_success[0])
    clear = np.abs(dist - eps) > 1e-3 * eps
    assert clear.sum() > 150
    np.testing.assert_array_equal(success[clear], (dist < eps)[clear])


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("classes", [2, 5])
def test_pgd_succeeds_where_the_analytic_distance_allows(norm, classes):
    """Binary: success exactly below the analytic distance. Multi-class: untargeted PGD can end
    in the corner of a class that is not the nearest one (a local maximum of the margin), so
    it must find nearly all, and can never beat the analytic distance."""
    params, x, y = linear_problem(n=200, k=classes, seed=2)
    dist = min_distance(params, x, y, norm)
    eps = float(np.quantile(dist, 0.8))
    attack = attacks.pgd(norm, loss="margin", steps=50, restarts=2)
    r = bundle(
        [attack], linear_apply, params, images(x), jnp.asarray(y), KEY, eps=eps, norm=norm,
        judging="float",
    )
    success = np.asarray(r.attack_success[0])
    # Sound: nothing can succeed beyond the exact minimal distance.
    assert not np.any(success & (dist > eps * (1 + 1e-4)))
    # Strong: what lies clearly inside the ball is found. (From a random start on the L2
    # sphere, 50 fixed-size steps turn towards the optimal direction only geometrically.)
    inside = dist < (0.98 if norm == "linf" else 0.95) * eps
    assert inside.sum() >= 50
    assert success[inside].mean() >= (1.0 if classes == 2 else 0.9)


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("judging", ["float", "grid"])
def test_min_norm_goal_never_beats_the_analytic_minimum(norm, judging):
    params, x, y = linear_problem(n=100, k=4, seed=4)
    dist = min_distance(params, x, y, norm)
    eps = float(np.quantile(dist, 0.8))
    r = bundle(
        [attacks.pgd(norm, loss="margin", steps=30, restarts=2)], linear_apply, params,
        images(x), jnp.asarray(y), KEY, eps=eps, norm=norm, goals=("min_norm",),
        judging=judging,
    )
    best = r.best["min_norm"].score
    found = np.asarray(best.misclassified)
    # Rounding to the pixel grid costs up to 1/255 per pixel; these toy distances are tightly
    # clustered just below eps, so only the unquantised run must find most of them.
    assert found.sum() > (60 if judging == "float" else 30)
    assert np.all(np.asarray(best.distortion)[found] >= dist[found] * (1 - 1e-4))
    # The min-norm goal keeps at least every success of the misclassify goal.
    assert np.all(found[np.asarray(r.attack_success[0])])


def test_fgsm_l2_step_is_scaled_by_eps():
    """Contrast 10 of the style guide: an L2 step that forgets eps would move by 1, not eps."""
    params, x, y = linear_problem(n=8, seed=5)
    model = WhiteBoxModel(linear_apply, params)
    attack = attacks.fgsm("l2")
    eps = jnp.full((8,), 0.037, jnp.float32)
    x = images(x)
    state = attack.init(attack.config, None, x, jnp.asarray(y), eps, model, 0)
    state, _ = attack.step(attack.config, state, model)
    np.testing.assert_allclose(norms.norm(state.x - x, "l2"), 0.037, rtol=1e-5)


def test_factories_reject_bad_arguments():
    assert_refused(attacks.pgd, [
        (("l3",), "norm"), (dict(loss="hinge"), "loss"), (dict(steps=0), "steps"),
        (dict(step_size=-0.1), "step_size"),
    ])
    assert_refused(attacks.fgsm, [(("l1",), "fgsm supports")])


# Every factory's count arguments, as (factory, keyword, smallest allowed value).
COUNTS = [
    (attacks.pgd, "steps", 1), (attacks.pgd, "restarts", 1),
    (lambda **k: attacks.apgd("linf", **k), "steps", 1),
    (lambda **k: attacks.apgd("linf", **k), "restarts", 1),
    (lambda **k: attacks.apgd("linf", "dlr-targeted", **k), "targets", 1),
    (attacks.bp, "steps", 1), (attacks.cw, "steps", 1), (attacks.cw, "search_steps", 1),
    (lambda **k: attacks.deepfool("l2", **k), "steps", 1),
    (lambda **k: attacks.deepfool("l2", **k), "candidates", 1),
    (lambda **k: attacks.fab("l2", **k), "steps", 1),
    (lambda **k: attacks.fab("l2", **k), "restarts", 1),
    (lambda **k: attacks.fmn("l2", **k), "steps", 1),
    (lambda **k: attacks.rays(**k), "steps", 1), (lambda **k: attacks.rays(**k), "restarts", 1),
    (lambda **k: attacks.rays(**k), "search_steps", 1), (attacks.spsa, "steps", 1),
    (lambda **k: attacks.square("linf", **k), "queries", 2),
    (attacks.surfree, "queries", 1), (attacks.surfree, "restarts", 1),
    (attacks.surfree, "search_steps", 0),
]


@pytest.mark.parametrize("factory, label, smallest", COUNTS)
def test_every_factory_checks_its_counts_alike(factory, label, smallest):
    """A float, a bool or a count below the minimum is refused with the argument's name; a
    numpy integer is accepted as the int it is."""
    for bad in (2.5, True, smallest - 1, "3"):
        with pytest.raises(ValueError, match=f"{label}.*integer >= {smallest}"):
            factory(**{label: bad})
    factory(**{label: np.int64(max(smallest, 2) if label != "queries" else 5000)})


def test_black_box_oracles_expose_only_what_the_threat_model_allows():
    from jaxbundle.attacks.base import LabelOracle, ScoreOracle

    params, x, y = linear_problem(n=8)
    x = images(x)
    scores, labels = ScoreOracle(linear_apply, params), LabelOracle(linear_apply, params)
    for oracle in (scores, labels):
        assert not hasattr(oracle, "apply_fn") and not hasattr(oracle, "params")
        assert not hasattr(oracle, "__dict__")
    assert not hasattr(labels, "logits") and not hasattr(scores, "loss_and_grad")
    np.testing.assert_allclose(scores.logits(x), linear_apply(params, x), rtol=1e-6)
    np.testing.assert_array_equal(labels.label(x), jnp.argmax(linear_apply(params, x), axis=1))
    # No gradient leaks through a score oracle.
    g = jax.grad(lambda v: jnp.sum(scores.logits(v)))(x)
    assert float(jnp.abs(g).max()) == 0.0
    assert isinstance(threat_model("score-based", linear_apply, params), ScoreOracle)
    assert isinstance(threat_model("decision-based", linear_apply, params), LabelOracle)


def test_an_unknown_kind_is_an_error_not_white_box_access():
    """A typo in an attack's kind must never hand it gradients (it used to fail open)."""
    from jaxbundle.bundler import check_attacks

    params = linear_problem(n=4)[0]
    with pytest.raises(ValueError, match="unknown attack kind 'score based'"):
        threat_model("score based", linear_apply, params)
    typo = attacks.square(queries=10)._replace(kind="scorebased")
    with pytest.raises(ValueError, match="'square' has unknown kind 'scorebased'"):
        check_attacks([typo], "linf")


def _factory_modules():
    """(paper, module, factory names) of every factory: its subpackage is its kind."""
    factories = {"cw": ("cw", "cw_reference")}
    for family, paper in suites.PAPERS.items():
        record = next(r for r in suites.ATTACKS.values() if r.family == family)
        package = record.made().kind.replace("-", "_")
        yield paper, f"jaxbundle.attacks.{package}.{family}", factories.get(family, (family,))


@pytest.mark.parametrize("paper,module_name,factory_names", list(_factory_modules()),
                         ids=list(suites.PAPERS))
def test_attack_modules_and_factories_are_apart(paper, module_name, factory_names):
    module = importlib.import_module(module_name)
    package, stem = module_name.rsplit(".", 1)
    # The subpackage attribute is the module itself, not rebound to the factory: help() on it
    # shows the algorithm, which opens with the paper's authors.
    assert isinstance(getattr(importlib.import_module(package), stem), types.ModuleType)
    first_author = paper.split(",")[0].split(" ")[0]
    assert first_author in module.__doc__.split("\n\n")[0] and len(module.__doc__) > 300
    for name in factory_names:
        factory = getattr(attacks, name)
        assert factory.__module__ == module_name and getattr(module, name) is factory
        doc = factory.__doc__
        assert "Args:" in doc and "Returns:" in doc
        assert f":mod:`{module_name}`" in doc, "the factory points to its algorithm"
        authors_year = re.match(r"(.*? (19|20)\d\d),", paper).group(1)
        assert " ".join(authors_year.split()) in " ".join(doc.split()), "and names its paper"


def test_every_attack_module_has_a_named_attack():
    root = pathlib.Path(attacks.__file__).parent
    # Private modules (an attack's helpers, such as _surfree_geometry) are no attacks.
    found = {f"jaxbundle.attacks.{p.parent.name}.{p.stem}"
             for p in root.glob("*/*.py") if not p.stem.startswith("_")}
    assert found == {m for _, m, _ in _factory_modules()}
