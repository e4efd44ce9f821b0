"""``--batch-size auto``: the memory an evaluation needs per example, and the batch that fits."""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from jaxbundle import bundler, memory
from jaxbundle.attacks import apgd, pgd
from jaxbundle.cli import main
from jaxbundle.models import LinenCNN

SHAPE = (28, 28, 1)


@functools.cache  # one apply_fn for the module: the programs built on it are compiled once
def _model():
    net = LinenCNN()
    return net.apply, net.init(jax.random.key(0), jnp.zeros((1, *SHAPE)))


def _compiled_per_example(apply_fn, params, attack, restart_mode):
    def planned(batch):
        s = lambda dtype, *rest: jax.ShapeDtypeStruct((batch, *rest), dtype)  # noqa: E731
        goals = bundler.goals_for(("misclassify", "max_confidence", "min_norm"), (attack,))
        m = bundler.run.lower(
            params, s(jnp.float32, *SHAPE), s(jnp.int32), jax.random.key(0), s(jnp.int32),
            s(jnp.float32), attacks=(attack,),
            rules=bundler.Rules(apply_fn, goals, "linf", "auto", restart_mode, 1),
        ).compile().memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    return (planned(16) - planned(8)) / 8


# Each case compiles the bundle twice (XLA's plan at two batch sizes). A cascade of restarts
# (restart_mode "cascade") runs one restart at a time: its rule is one restart's, asserted
# below for PGD without compiling a third program; that the rule bounds XLA's plan for a
# single restart is the APGD case's (one restart).
@pytest.mark.parametrize("attack", [pgd(norm="linf", steps=3, restarts=3, step_size=0.01),
                                    apgd(norm="linf", steps=4)], ids=["pgd", "apgd"])
def test_the_rule_bounds_what_xla_plans_for_the_bundle(attack):
    apply_fn, params = _model()
    compiled = _compiled_per_example(apply_fn, params, attack, "vmap")
    rule, fixed = memory.per_example_bytes([attack], "vmap", apply_fn, params, SHAPE)
    assert compiled <= rule <= 3 * compiled
    assert fixed > 0
    one, _ = memory.per_example_bytes([attack._replace(num_restarts=1)], "vmap", apply_fn,
                                      params, SHAPE)
    assert rule == attack.num_restarts * one
    cascade, _ = memory.per_example_bytes([attack], "cascade", apply_fn, params, SHAPE)
    assert cascade == one


def test_the_batch_fits_half_the_free_memory():
    apply_fn, params = _model()
    attacks = [pgd(norm="linf", steps=3, restarts=2, step_size=0.01)]
    per_example, fixed = memory.per_example_bytes(attacks, "vmap", apply_fn, params, SHAPE)
    for free in (fixed * 2 + 100 * per_example, fixed * 2 + 1000 * per_example + 7):
        size = memory.auto_batch_size(attacks, "vmap", apply_fn, params, SHAPE, free=free)
        assert size * per_example + fixed <= memory.FRACTION * free
        assert (size + 1) * per_example + fixed > memory.FRACTION * free
        four = memory.auto_batch_size(attacks, "vmap", apply_fn, params, SHAPE, devices=4,
                                      free=free)  # free memory of each of 4 devices
        assert four == 4 * size
    assert memory.auto_batch_size(attacks, "vmap", apply_fn, params, SHAPE, devices=2,
                                  free=0) == 2  # at least one example per device
    assert memory.auto_batch_size(attacks, "vmap", apply_fn, params, SHAPE,
                                  free=10**15) == memory.MAX_BATCH
    for devices in (3, 6, 12):  # the cap, 4096, is no multiple of these: the largest one is
        capped = memory.auto_batch_size(attacks, "vmap", apply_fn, params, SHAPE,
                                        devices=devices, free=10**15)
        assert capped % devices == 0 and memory.MAX_BATCH - devices < capped <= memory.MAX_BATCH
    assert 0 < memory.free_bytes()


def test_the_command_takes_auto(tmp_path, capsys):
    assert main(["evaluate", "--batch-size", "auto", "--dry-run", "--n", "8"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["batch_size_auto"] is True and shown["plan"]["run"]["batch_size"] == 250
    with pytest.raises(SystemExit):
        main(["evaluate", "--batch-size", "0", "--dry-run"])
    assert main(["evaluate", "--model", "examples/plain_model.py:model", "--n", "8",
                 "--attacks", "fgsm", "--eps", "0.05", "--batch-size", "auto", "--no-shifts",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "report.json").read_text())["models"]["model"]
    assert 8 <= record["plan"]["run"]["batch_size"] <= memory.MAX_BATCH


def test_a_fitted_batch_size_resumes_with_its_checkpoint(tmp_path, monkeypatch):
    """The free memory differs between a run and its resumption: the resumed run keeps the
    batch size its checkpoint was made with (a changed batch size is another run, refused)."""
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1] / "examples")
    argv = ["evaluate", "--model", "plain_model:model", "--n", "8", "--attacks", "fgsm",
            "--eps", "0.05", "--batch-size", "auto", "--no-shifts", "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # a dotted module: imported once
    for fitted in (8, 4):  # one batch of 8, then two of 4
        monkeypatch.setattr(memory, "auto_batch_size", lambda *a, size=fitted, **k: size)
        assert main(argv + ["--out", str(tmp_path / f"out{fitted}")]) == 0
        record = json.loads((tmp_path / f"out{fitted}" / "report.json").read_text())
        assert record["models"]["model"]["plan"]["run"]["batch_size"] == 8
