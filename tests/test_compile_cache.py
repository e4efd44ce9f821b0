"""jaxbundle.evaluate keeps its compiled programs on disk by default: a second process reads
them back instead of compiling, with the same results; JAX's own cache setting, an explicit
directory and the opt-out are respected."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax

from jaxbundle.run import compile_cache

_RUN = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxbundle

    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits"
        else None)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (8, 4, 4, 1)).astype(np.float32) / 255
    w = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
    y = np.asarray(jnp.argmax(x.reshape(8, -1) @ w, -1))
    apply_fn = lambda p, xb: xb.reshape(xb.shape[0], -1) @ p
    plan = jaxbundle.Plan.of(eps=0.1, attacks=("fgsm", "pgd-ce"), steps=3, batch_size=8,
                             goals=("misclassify",))
    ev = jaxbundle.evaluate(apply_fn, w, (x, y), plan, mesh=None)
    print(json.dumps({"hits": len(hits), "success": ev.per_example["success"].tolist(),
                      "dir": jax.config.jax_compilation_cache_dir}))
""")


def _run(tmp_path: pathlib.Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "JAXBUNDLE_COMPILE_CACHE"}
    environ.update(JAXBUNDLE_CACHE=str(tmp_path / "cache"), **env)
    done = subprocess.run([sys.executable, "-c", _RUN], env=environ, capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_programs_back(tmp_path):
    first = _run(tmp_path)
    programs = list((tmp_path / "cache" / "xla").iterdir())
    assert first["hits"] == 0 and programs, "the first run writes its programs"
    second = _run(tmp_path)
    assert second["hits"] >= 2 and second["success"] == first["success"]
    assert len(list((tmp_path / "cache" / "xla").iterdir())) == len(programs)
    assert first["dir"] is None  # JAX's configuration restored after the run


def test_the_opt_out_and_an_explicit_directory(tmp_path):
    off = _run(tmp_path, JAXBUNDLE_COMPILE_CACHE="off")
    assert not (tmp_path / "cache" / "xla").exists() and off["hits"] == 0
    _run(tmp_path, JAXBUNDLE_COMPILE_CACHE=str(tmp_path / "mine"))
    assert list((tmp_path / "mine").iterdir()) and not (tmp_path / "cache" / "xla").exists()


def test_which_directory_a_run_uses(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXBUNDLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("JAXBUNDLE_CACHE", str(tmp_path))
    assert compile_cache.directory("auto") == str(tmp_path / "xla")
    assert compile_cache.directory(None) is None
    assert compile_cache.directory(tmp_path / "d") == str(tmp_path / "d")
    monkeypatch.setenv("JAXBUNDLE_COMPILE_CACHE", "OFF")
    assert compile_cache.directory("auto") is None
    monkeypatch.delenv("JAXBUNDLE_COMPILE_CACHE")
    previous = jax.config.jax_compilation_cache_dir
    with compile_cache.compilation_cache(tmp_path / "users"):  # JAX has one: left as it is
        assert compile_cache.directory("auto") is None
    assert jax.config.jax_compilation_cache_dir == previous
