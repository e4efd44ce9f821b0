"""Checks the attack tests share: a factory's attack, the arguments it refuses, the work of one
step on the linear toy model (multiply-adds, oracle queries), a state that keeps its shape,
determinism and restarts under vmap, and the toy problem of the black-box attacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbundle.attacks.base import Attack, per_example_keys
from toys import KEY, dot_flops, images, linear_apply, linear_problem, run_steps


def check_factory(factory, **fields) -> Attack:
    """``factory()``: an :class:`Attack`, equal to one built again and hashable, whose
    attributes (and properties such as ``queries``) named in ``fields`` have those values."""
    a = factory()
    assert isinstance(a, Attack) and a == factory()
    hash(a)
    assert {name: getattr(a, name) for name in fields} == fields
    return a


def assert_refused(factory, cases) -> None:
    """``factory`` raises a ``ValueError`` matching ``match`` for every ``(arguments, match)``
    of ``cases``: ``arguments`` a tuple of positional ones or a dict of keywords."""
    for arguments, match in cases:
        args, kwargs = (arguments, {}) if isinstance(arguments, tuple) else ((), arguments)
        with pytest.raises(ValueError, match=match):
            factory(*args, **kwargs)


def step_flops(attack, model, params, x, y) -> tuple[int, int]:
    """The multiply-adds of one forward pass of :func:`toys.linear_apply` on ``x``, and of one
    step of ``attack`` from its init (``params`` traced, so that nothing folds away)."""
    state = attack.init(attack.config, None, x, y, None, model, 0)
    forward = dot_flops(jax.make_jaxpr(lambda p, xx: linear_apply(p, xx))(params, x).jaxpr)
    step = jax.make_jaxpr(lambda s, p: attack.step(attack.config, s, model._replace(params=p)))
    return forward, dot_flops(step(state, params).jaxpr)


def oracle_problem(oracle, n, eps, seed=0, k=4):
    """:func:`toys.linear_problem` as ``n`` images: ``(params, oracle(linear_apply, params),
    x, y, eps [n], keys [n])``."""
    params, x, y = linear_problem(n=n, k=k, seed=seed)
    x = images(x)
    keys = per_example_keys(KEY, jnp.arange(n))
    eps = jnp.full((n,), eps, jnp.float32)
    return params, oracle(linear_apply, params), x, jnp.asarray(y), eps, keys


def traced_queries(attack, oracle, params, keys, x, y, eps) -> tuple[int, int]:
    """The rows the ``oracle`` (a class) of :func:`toys.linear_apply` is called on while
    ``attack``'s init is traced, and while one step is: a call on ``n * B`` images is ``n``
    queries per example."""
    rows = []

    def counting_apply(p, xx):
        rows.append(xx.shape[0])
        return linear_apply(p, xx)

    model = oracle(counting_apply, params)
    jax.make_jaxpr(lambda: attack.init(attack.config, keys, x, y, eps, model, 0))()
    init_rows = sum(rows)
    state = attack.init(attack.config, keys, x, y, eps, oracle(linear_apply, params), 0)
    rows.clear()
    jax.make_jaxpr(lambda s: attack.step(attack.config, s, model))(state)
    return init_rows, sum(rows)


def check_deterministic_and_vmappable(attack, model, x, y) -> None:
    """A minimum-norm ``attack`` that takes no keys nor eps: two runs of all its steps end in
    the same state, and a step of restart 1 under ``vmap`` over restarts is the lone one's."""
    a = run_steps(attack, model, None, x, y, None, attack.num_steps)[0][-1]
    b = run_steps(attack, model, None, x, y, None, attack.num_steps)[0][-1]
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(_plain(u), _plain(v)), a, b)

    def run(r):
        state = attack.init(attack.config, None, x, y, None, model, r)
        return attack.step(attack.config, state, model)[0].x

    np.testing.assert_allclose(jax.vmap(run)(jnp.arange(2))[1], run(1), rtol=1e-6, atol=1e-6)


def _plain(a):
    """An array as numpy; a PRNG key array as its key data."""
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def check_states_keep_shape(states, batch) -> None:
    """The last state has the first one's structure, shapes and dtypes, ``batch`` rows each."""
    assert jax.tree.structure(states[0]) == jax.tree.structure(states[-1])
    for s0, s1 in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[-1])):
        assert s0.shape == s1.shape and s0.dtype == s1.dtype and s0.shape[0] == batch
