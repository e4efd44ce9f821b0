"""The held-out model zoo (benchmarks/heldout/zoo.py): its data sets, architectures, adversarial
example generators, training recipes, weight cache and torch copy, on tiny budgets."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HELDOUT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "heldout"
sys.path.insert(0, str(HELDOUT))

import zoo  # noqa: E402

from jaxbundle import losses, norms  # noqa: E402

SHAPES = {"grey28": (28, 28, 1), "grey32-off": (32, 32, 1), "colour32": (32, 32, 3),
          "colour32-off": (30, 30, 3)}


def _exactly_on_grid(x: np.ndarray) -> bool:
    """Every pixel is exactly ``uint8 / 255`` in float32."""
    return bool(np.array_equal(x, np.round(x * 255).astype(np.uint8) / np.float32(255)))


def test_data_sets_have_their_shapes_grids_and_are_deterministic():
    """Each data set: its shape, labels equal to MNIST's, pixels in [0, 1]; grey28 and colour32
    exactly on the 8-bit grid, the resized ones off it (every image); the same arrays when
    computed again from scratch."""
    first = {name: zoo.dataset(name, "test", start=zoo.EVAL_START, n=zoo.EVAL_N)
             for name in zoo.DATA_NAMES}
    zoo._split_images.cache_clear()
    for name, (x, y) in first.items():
        assert x.shape == (zoo.EVAL_N,) + SHAPES[name] and x.dtype == np.float32
        assert y.dtype == np.int32 and np.array_equal(y, first["grey28"][1])
        assert 0.0 <= x.min() and x.max() <= 1.0
        assert _exactly_on_grid(x) == (name in ("grey28", "colour32"))
        if name.endswith("-off"):
            assert not np.asarray(norms.on_grid(x)).any(), name
        again = zoo.dataset(name, "test", start=zoo.EVAL_START, n=zoo.EVAL_N)
        assert np.array_equal(x, again[0]) and np.array_equal(y, again[1])


def test_colours_are_seeded_and_far_apart():
    """Foreground and background differ by at least 0.4 on average (digits stay visible), the
    two splits get different colours, and an image's colours do not depend on how many are
    drawn."""
    fg, bg = zoo.colours(500, zoo.COLOUR_SEEDS["test"])
    assert np.abs(fg - bg).mean(axis=1).min() >= zoo.MIN_COLOUR_GAP
    assert not np.array_equal(fg, zoo.colours(500, zoo.COLOUR_SEEDS["train"])[0])
    assert np.array_equal(fg[:100], zoo.colours(100, zoo.COLOUR_SEEDS["test"])[0])
    x, _ = zoo.dataset("colour32", "test", n=8)
    corner = x[:, 0, 0, :]  # background, up to 8-bit rounding
    assert np.abs(corner - bg[:8]).max() <= 0.5 / 255 + 1e-6


@pytest.mark.parametrize("arch,data", [("mlp", "grey28"), ("cnn", "grey28"),
                                       ("cnn", "grey32-off"), ("cnn", "colour32-off"),
                                       ("resnet", "colour32")])
def test_architectures_map_images_to_ten_logits(arch, data):
    x, _ = zoo.dataset(data, "test", n=3)
    variables = zoo.init_variables(arch, x.shape[1:], 0)
    logits = jax.jit(zoo.module_for(arch).apply)(variables, x)
    assert logits.shape == (3, 10) and bool(jnp.all(jnp.isfinite(logits)))
    assert ("batch_stats" in variables) == (arch == "resnet")


@pytest.fixture(scope="module")
def resnet():
    """A ResNet whose running averages are not the batch's statistics (one training-mode pass
    over 32 images updates them), and 8 colour32 images."""
    x, _ = zoo.dataset("colour32", "test", n=32)
    module = zoo.module_for("resnet")
    variables = zoo.init_variables("resnet", x.shape[1:], 0)
    _, stats = jax.jit(lambda v, xb: module.apply(v, xb, train=True, mutable=["batch_stats"])
                       )(variables, x)
    return module, {"params": variables["params"], **stats}, x[:8]


def test_resnet_inference_uses_running_statistics_not_the_batch(resnet):
    """Evaluation-mode logits of three images are the same alone and among five others (and
    apply needs no mutable collection); training-mode logits are not (the check has teeth)."""
    module, variables, x = resnet
    infer = jax.jit(module.apply)
    np.testing.assert_allclose(infer(variables, x[:3]), infer(variables, x)[:3], atol=1e-5,
                               rtol=1e-5)

    @jax.jit
    def train_mode(xb):
        return module.apply(variables, xb, train=True, mutable=["batch_stats"])[0]

    assert float(jnp.max(jnp.abs(train_mode(x[:3]) - train_mode(x)[:3]))) > 1e-3


@pytest.mark.parametrize("recipe,norm,eps", [("pgd", "linf", 0.1), ("pgd", "l2", 1.5),
                                             ("trades", "linf", 0.2)])
def test_adversarial_examples_stay_in_the_ball_and_box_and_raise_the_loss(recipe, norm, eps):
    """The training-time generators (PGD Linf, PGD L2, TRADES) return images inside the eps
    ball around the clean ones and inside [0, 1], moved away from them, with a higher loss
    (cross-entropy for PGD, KL to the clean prediction for TRADES) than the clean images."""
    x, y = zoo.dataset("grey28", "train", n=32)
    x, y = jnp.asarray(x), jnp.asarray(y)
    variables = zoo.init_variables("cnn", x.shape[1:], 0)
    logits_fn = jax.jit(lambda xb: zoo.module_for("cnn").apply(variables, xb))
    key = jax.random.PRNGKey(0)
    if recipe == "pgd":
        x_adv = zoo.pgd_examples(logits_fn, x, y, key, eps, 3, norm)
        before = losses.cross_entropy(logits_fn(x), y)
        after = losses.cross_entropy(logits_fn(x_adv), y)
    else:
        x_adv = zoo.trades_examples(logits_fn, x, key, eps, 3)
        before = zoo.kl_divergence(logits_fn(x), logits_fn(x))
        after = zoo.kl_divergence(logits_fn(x), logits_fn(x_adv))
    assert bool(jnp.all(norms.in_ball(x_adv - x, eps, norm)))
    assert float(x_adv.min()) >= 0.0 and float(x_adv.max()) <= 1.0
    assert float(jnp.min(norms.norm(x_adv - x, norm))) > 0.3 * eps
    assert float(jnp.mean(after)) > float(jnp.mean(before))


@pytest.mark.parametrize("name", ["mlp-std", "mlp-pgd", "cnn-l2", "cnn-trades"])
def test_each_recipe_trains_briefly_and_changes_the_parameters(name):
    """Standard, PGD Linf, PGD L2 and TRADES: two steps on 256 images (MLP, 2 PGD steps) move
    every parameter array, stay finite, and are deterministic for the seed."""
    spec = zoo.ZOO[name]._replace(arch="mlp", n_train=256, epochs=1, pgd_steps=2)
    trained = zoo.train(spec)
    fresh = zoo.init_variables("mlp", (28, 28, 1), spec.seed)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(fresh)):
        assert a.shape == b.shape and bool(jnp.all(jnp.isfinite(a)))
        assert float(jnp.max(jnp.abs(a - b))) > 0
    if name == "cnn-trades":
        again = zoo.train(spec)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained),
                                                        jax.tree.leaves(again)))


def test_training_the_resnet_updates_weights_and_running_statistics():
    """One training step of the ResNet (on grey28, whose training split loads at once) moves
    every parameter and every BatchNorm running average."""
    spec = zoo.ZOO["resnet-std"]._replace(data="grey28", n_train=128, epochs=1)
    trained = zoo.train(spec)
    fresh = zoo.init_variables("resnet", (28, 28, 1), spec.seed)
    assert set(trained) == {"params", "batch_stats"}
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(fresh)):
        assert bool(jnp.all(jnp.isfinite(a))) and float(jnp.max(jnp.abs(a - b))) > 0


def test_resnet_training_inputs_stay_in_the_ball_and_box(resnet):
    """The PGD examples a ResNet training step fits (attacked through the batch's statistics,
    the running averages left alone) are inside the Linf ball and the box."""
    module, variables, x = resnet
    state = {"batch_stats": variables["batch_stats"]}
    y = jnp.zeros((x.shape[0],), jnp.int32)
    x_adv = zoo.adversarial_inputs(module, state, variables["params"], jnp.asarray(x), y,
                                   jax.random.PRNGKey(1), jnp.float32(8 / 255),
                                   zoo._Step("pgd", "linf", 2, 0.0))
    assert bool(jnp.all(norms.in_ball(x_adv - x, 8 / 255, "linf")))
    assert float(x_adv.min()) >= 0.0 and float(x_adv.max()) <= 1.0 and bool(jnp.any(x_adv != x))


def test_load_trains_once_caches_and_retrains_a_changed_recipe(tmp_path, monkeypatch):
    """The first load trains and writes the weights under $JAXBUNDLE_CACHE/heldout; the second
    reads the same weights back; a changed recipe has another cache key."""
    monkeypatch.setenv("JAXBUNDLE_CACHE", str(tmp_path))
    spec = zoo.Spec("mlp", "grey28", n_train=128, epochs=1, seed=3)
    monkeypatch.setitem(zoo.ZOO, "tiny", spec)
    apply_fn, first = zoo.load("tiny")
    path = zoo.cache_path("tiny")
    assert path.parent == tmp_path / "heldout" and path.exists()
    assert zoo.metadata("tiny")["spec"] == spec._asdict()
    monkeypatch.setattr(zoo, "train", lambda *a, **k: pytest.fail("retrained a cached model"))
    _, second = zoo.load("tiny")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first),
                                                    jax.tree.leaves(second)))
    assert apply_fn(second, jnp.zeros((2, 28, 28, 1))).shape == (2, 10)
    changed = spec._replace(recipe="pgd", eps=0.1, pgd_steps=2)
    assert zoo.spec_hash(changed) != zoo.spec_hash(spec)
    assert len({zoo.spec_hash(s) for s in zoo.ZOO.values()}) == len(zoo.ZOO)


@pytest.mark.parametrize("name", ["mlp-std", "cnn-colour-l2", "resnet-std"])
def test_torch_copy_computes_the_same_logits(name, resnet):
    """Runs where torch is installed (the benchmark venv): the torch copy of each architecture
    matches the JAX logits, BatchNorm running statistics included."""
    pytest.importorskip("torch")
    spec = zoo.ZOO[name]
    x, _ = zoo.dataset(spec.data, "test", n=8)
    if spec.arch == "resnet":
        module, variables, x = resnet
    else:
        module = zoo.module_for(spec.arch)
        variables = zoo.init_variables(spec.arch, x.shape[1:], 0)
    import torch_copy

    assert torch_copy.check_torch_copy(name, module.apply, variables, x) < 1e-4


def test_agreement_counts_reference_disagreement_and_consensus_misses(tmp_path):
    """benchmarks/heldout/agreement.py: pairwise disagreement of the reference runs, the
    consensus (fooled by every reference run) and a candidate's misses against each, on
    verdicts whose answers are counted by hand."""
    import json

    import agreement

    torch_aa = np.array([0, 0, 0, 1, 1, 0], bool)  # robust per example
    seed0 = np.array([0, 0, 1, 1, 0, 0], bool)  # example 2 kept, example 4 fooled
    candidate = np.array([1, 0, 1, 1, 0, 0], bool)  # example 0: fooled by both references
    out = agreement.compare({"torchattacks": torch_aa, "autoattack seed 0": seed0},
                            {"default seed 0": candidate})
    assert out["pairs"] == [{"first": "torchattacks", "second": "autoattack seed 0",
                             "first_only": 1, "second_only": 1}]
    assert out["fooled_by_every_reference"] == 3 and out["fooled_by_any_reference"] == 5
    assert out["candidates"]["default seed 0"] == {
        "robust_accuracy": 50.0, "missed": 2, "missed_of_consensus": 1}
    # The files: torchattacks' verdicts from the cache, the bundle's rows by seed.
    key = "heldout_m_l2_1.500000_n6"
    (tmp_path / f"{key}.json").write_text(json.dumps({"robust": torch_aa.astype(int).tolist()}))
    rows = [{"set": "heldout", "model": "m", "norm": "l2", "eps": 1.5, "n": 6, "candidate": c,
             "seed": 0, "robust": "".join("1" if v else "0" for v in r)}
            for c, r in (("autoattack", seed0), ("default", candidate))]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = agreement.load([str(tmp_path / "rows.jsonl")], [str(tmp_path), str(tmp_path / "none")])
    references, candidates = loaded[key]
    assert list(references) == ["torchattacks", "autoattack seed 0"]
    assert agreement.compare(references, candidates) == out


def test_a_cached_autoattack_run_is_tied_to_the_weights_it_attacked(tmp_path):
    """run.py: a run is stored under the weights' fingerprint; an older entry without one is
    used only while its clean mistakes are the model's, and refused in one line otherwise."""
    import json

    import run

    params = {"w": np.arange(6, dtype=np.float32)}
    digest = run.weights_digest(params)
    assert digest == run.weights_digest({"w": np.arange(6, dtype=np.float32)})
    assert digest != run.weights_digest({"w": np.arange(6, dtype=np.float32) + 1})
    wrong = np.array([False, True, False])
    legacy = {"robust": [1, 0, 0], "fooled_by": [-1, -1, 2]}  # example 1: clean mistake
    (tmp_path / "k.json").write_text(json.dumps(legacy))
    calls = []

    def compute():
        calls.append(1)
        return {"robust": [0, 0, 1], "fooled_by": [0, -1, -1]}

    assert run.cached_autoattack(str(tmp_path), "k", compute, digest, wrong)["robust"] == [1, 0, 0]
    with pytest.raises(SystemExit, match="other weights"):
        run.cached_autoattack(str(tmp_path), "k", compute, digest, ~wrong)
    assert not calls
    (tmp_path / "k.json").unlink()
    entry = run.cached_autoattack(str(tmp_path), "k", compute, digest, wrong)
    assert calls == [1] and entry["weights"] == digest
    assert (tmp_path / f"k_w{digest}.json").exists()
    with pytest.raises(SystemExit, match="other weights"):
        run.cached_autoattack(str(tmp_path), "k", compute, digest, np.array([True, True, False]))


def test_candidates_can_be_judged_as_autoattack_is(tmp_path):
    """run.py --judging: the candidate's plan judges as asked (the CLI's "auto" by default,
    float32 as AutoAttack's images are judged), rows already run are told apart by it and by
    their seed, and
    agreement.py names a row judged otherwise than the CLI judges."""
    import json

    import agreement
    import run

    assert run._plan("default", "l2", 0.5, 8, {}).threat.judging == "auto"
    assert run._plan("default", "l2", 0.5, 8, {}, judging="float").threat.judging == "float"
    rows = [{"set": "heldout", "model": "m", "norm": "l2", "eps": 0.5, "n": 2, "candidate": c,
             "seed": 0, "robust": "10", **extra}
            for c, extra in (("default", {}), ("default", {"judging": "float"}),
                             ("autoattack", {"judging": "float"}))]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert run._done([str(path)]) == {("m", "l2", "0.500000", "default", "auto", 0),
                                      ("m", "l2", "0.500000", "default", "float", 0),
                                      ("m", "l2", "0.500000", "autoattack", "float", 0)}
    # a row of another seed is another run (AutoAttack's spread is measured over seeds)
    other = tmp_path / "seed1.jsonl"
    other.write_text(json.dumps(dict(rows[2], seed=1)) + "\n")
    assert run._done([str(other)]) == {("m", "l2", "0.500000", "autoattack", "float", 1)}
    key = "heldout_m_l2_0.500000_n2"
    (tmp_path / f"{key}.json").write_text(json.dumps({"robust": [1, 0]}))
    references, candidates = agreement.load([str(path)], [str(tmp_path)])[key]
    assert list(references) == ["torchattacks", "autoattack seed 0, judged float"]
    assert list(candidates) == ["default seed 0", "default seed 0, judged float"]
