"""shardvmc.optax: the natural gradient and the Fisher-norm constraint as optax transforms.

Each transform against ``sv.natural_gradient`` called directly (every method, padding,
pytree and flat Jacobians, SPRING's state over two steps), and the whole chain against
the neural example's hand-written step: ``params - min(lr_t, sqrt(max_norm / d.S.d)) d``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import shardvmc as sv

optax = pytest.importorskip("optax")
import shardvmc.optax as svx  # noqa: E402

N, N_VALID = 16, 13
PARAMS = {"a": jnp.zeros((3, 2)), "b": jnp.zeros((4,))}  # P = 10, fewer than the walkers: every method applies
P = 10
EXACT = {"tol": 1e-12, "maxiter": 200}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    j, e = rng.normal(size=(N, P)), rng.normal(size=N)
    j[N_VALID:], e[N_VALID:] = np.nan, np.nan  # padding: any leak shows
    with jax.enable_x64(True):
        return sv.WalkerSet(sv.shard_walker(j), N_VALID), sv.WalkerSet(sv.shard_walker(e), N_VALID)


def _tree_rows(j):
    """The same Jacobian as a pytree of (N, ...) leaves shaped like PARAMS (ravel_pytree order)."""
    _, unravel = ravel_pytree(PARAMS)
    return j.replace(data=jax.vmap(unravel)(j.data))


@pytest.mark.parametrize("method", ["dense", "minsr", "spring", "cg"])
def test_the_transform_is_natural_gradient_called_directly(data, method):
    j, e = data
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64), PARAMS)
        options = dict(damping=1e-2, method=method, momentum=0.5 if method == "spring" else 0.0, **EXACT)
        ng = svx.natural_gradient(**options)
        state = ng.init(params)
        # flat (N, P) rows in ravel order; for one method also the parameters' pytree (another compilation)
        for rows in (j, _tree_rows(j)) if method == "dense" else (j,):
            d, new_state = ng.update(params, state, params, jacobian=rows, local_energies=e)
            direct, info = sv.natural_gradient(j, e, **options)
            assert jax.tree.structure(d) == jax.tree.structure(params)
            np.testing.assert_allclose(ravel_pytree(d)[0], direct, rtol=1e-10, atol=1e-12)
            assert int(new_state.iterations) == int(info.iterations)
        if method == "spring":  # the second step uses the first direction as `previous`
            d2, _ = ng.update(params, new_state, params, jacobian=j, local_energies=e)
            direct2, _ = sv.natural_gradient(j, e, previous=direct, **options)
            np.testing.assert_allclose(ravel_pytree(d2)[0], direct2, rtol=1e-10, atol=1e-12)
            assert not np.allclose(direct2, sv.natural_gradient(j, e, **options)[0])  # the momentum matters
            np.testing.assert_array_equal(new_state.previous, direct)
        else:
            assert new_state.previous is None


def test_the_chain_is_the_neural_examples_step_under_jit(data):
    """natural_gradient | clip_by_fisher_norm | scale_by_learning_rate == the example's hand-written update."""
    j, e = data
    lr0, decay, max_norm, damping = 0.1, 3.0, 1e-3, 1e-2
    schedule = lambda t: lr0 / (1.0 + t / decay)  # noqa: E731
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64) + 0.5, PARAMS)
        opt = optax.chain(
            svx.natural_gradient(damping=damping, method="spring", momentum=0.5),
            svx.clip_by_fisher_norm(max_norm, schedule),
            optax.scale_by_learning_rate(schedule),
        )

        @jax.jit
        def step(params, state, j, e):
            updates, state = opt.update(params, state, params, jacobian=j, local_energies=e)
            return optax.apply_updates(params, updates), state

        state = opt.init(params)
        flat, unravel = ravel_pytree(params)
        previous = None
        for t in range(2):
            params, state = step(params, state, j, e)
            # the same step written by hand
            update, _ = sv.natural_gradient(j, e, damping=damping, method="spring", momentum=0.5, previous=previous)
            ju = j.data[:N_VALID] @ update
            u_s_u = jnp.mean(ju**2) - jnp.mean(ju) ** 2
            lr = jnp.minimum(schedule(t), jnp.sqrt(max_norm / jnp.maximum(u_s_u, 1e-30)))
            flat = flat - lr * update
            previous = update
            np.testing.assert_allclose(ravel_pytree(params)[0], flat, rtol=1e-10, atol=1e-13)
            assert float(state[1].scale) < 1.0  # the constraint binds here
    assert int(state[1].count) == 2


def test_clip_by_fisher_norm_leaves_short_steps_alone(data):
    j, _ = data
    with jax.enable_x64(True):
        clip = svx.clip_by_fisher_norm(1e6, 0.1)
        d = jnp.ones(P)
        out, state = clip.update(d, clip.init(d), jacobian=j)
        np.testing.assert_array_equal(out, d)
        assert float(state.scale) == 1.0


def test_missing_or_mismatched_jacobians_are_refused(data):
    j, e = data
    ng = svx.natural_gradient(damping=1e-2, method="dense")
    with jax.enable_x64(True), pytest.raises(sv.CallError, match="jacobian="):
        ng.update(PARAMS, ng.init(PARAMS), local_energies=e)
    with jax.enable_x64(True), pytest.raises(sv.CallError, match="as many entries as the parameters"):
        ng.update({"a": jnp.zeros(3)}, ng.init({"a": jnp.zeros(3)}), jacobian=j, local_energies=e)
    clip = svx.clip_by_fisher_norm(1.0, 0.1)
    with jax.enable_x64(True), pytest.raises(sv.CallError, match="do not match the updates"):
        clip.update(jnp.zeros(3), clip.init(jnp.zeros(3)), jacobian=j)
