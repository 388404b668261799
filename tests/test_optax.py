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
from optional_imports import import_or_skip

import shardvmc as sv

optax = import_or_skip("optax")
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


# ----------------------------------------------------------------------------- hyperparameters optax schedules


def _schedules():
    """optax's own schedules, whose values are float32 (at optax's int32 step counts) even in a float64 run."""
    return {
        "damping": optax.schedules.exponential_decay(1e-1, transition_steps=1, decay_rate=0.3),
        "momentum": optax.schedules.linear_schedule(0.3, 0.6, transition_steps=1),
        "max_norm": optax.schedules.exponential_decay(1e-3, transition_steps=1, decay_rate=0.5),
        "learning_rate": optax.schedules.exponential_decay(0.1, transition_steps=1, decay_rate=0.5),
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_numeric_hyperparameter_can_be_scheduled(data, jit):
    """damping, momentum, max_norm and the learning rate through optax.inject_hyperparams == the hand-written step.

    Under jit, J and e are closed over (concrete) while the scheduled values are traced.
    """
    j, e = data
    s = _schedules()
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64) + 0.5, PARAMS)
        opt = optax.chain(
            optax.inject_hyperparams(svx.natural_gradient)(
                damping=s["damping"], method="spring", momentum=s["momentum"]
            ),
            optax.inject_hyperparams(svx.clip_by_fisher_norm)(max_norm=s["max_norm"], learning_rate=s["learning_rate"]),
            optax.scale_by_learning_rate(s["learning_rate"]),
        )

        def step(params, state):
            updates, state = opt.update(params, state, params, jacobian=j, local_energies=e)
            return optax.apply_updates(params, updates), state

        step = jax.jit(step) if jit else step
        state = opt.init(params)
        flat, previous = ravel_pytree(params)[0], None
        for t in range(2):
            params, state = step(params, state)
            at = {k: f(jnp.asarray(t, jnp.int32)) for k, f in s.items()}  # what optax evaluates at step t
            assert at["damping"].dtype == jnp.float32  # the case of a float32 schedule in a float64 run
            update, _ = sv.natural_gradient(
                j, e, damping=at["damping"], method="spring", momentum=at["momentum"], previous=previous
            )
            ju = j.data[:N_VALID] @ update
            u_s_u = jnp.mean(ju**2) - jnp.mean(ju) ** 2
            lr = at["learning_rate"].astype(jnp.float64)
            step_size = jnp.minimum(lr, jnp.sqrt(at["max_norm"].astype(jnp.float64) / u_s_u))
            flat, previous = flat - step_size * update, update
            np.testing.assert_allclose(ravel_pytree(params)[0], flat, rtol=1e-12, atol=1e-14)
            assert float(state[1].inner_state.scale) < 1.0  # the constraint binds: max_norm matters
            assert float(state[0].hyperparams["damping"]) == float(at["damping"])
    assert float(at["damping"]) < 0.5 * float(s["damping"](0))  # the schedules moved between the two steps


def test_integer_settings_stay_static_under_inject_hyperparams(data):
    j, e = data
    damping = _schedules()["damping"]
    first = damping(jnp.zeros((), jnp.int32))  # float32, as optax evaluates it
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64), PARAMS)
        cg = optax.inject_hyperparams(svx.natural_gradient)(damping=damping, method="cg", tol=1e-12)
        state = cg.init(params)
        assert set(state.hyperparams) == {"damping", "momentum", "rcond", "tol"}  # maxiter, chunks: not injected
        d, _ = jax.jit(lambda state: cg.update(params, state, params, jacobian=j, local_energies=e))(state)
        direct, _ = sv.natural_gradient(j, e, damping=first, method="cg", tol=1e-12)
        np.testing.assert_allclose(ravel_pytree(d)[0], direct, rtol=1e-10, atol=1e-12)

        # passed explicitly, optax injects an integer too: refused at init, naming the fix
        with pytest.raises(sv.CallError, match=r'static_args=\("maxiter",\)'):
            optax.inject_hyperparams(svx.natural_gradient)(damping=1e-2, method="cg", maxiter=3).init(params)
        short = optax.inject_hyperparams(svx.natural_gradient, static_args=("maxiter",))(
            damping=damping, method="cg", maxiter=3, tol=1e-12
        )
        d, state = jax.jit(lambda state: short.update(params, state, params, jacobian=j, local_energies=e))(
            short.init(params)
        )
        direct, info = sv.natural_gradient(j, e, damping=first, method="cg", maxiter=3, tol=1e-12)
        assert int(state.inner_state.iterations) == int(info.iterations) == 3
        np.testing.assert_allclose(ravel_pytree(d)[0], direct, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("injected", [False, True], ids=["schedule", "inject_hyperparams"])
def test_clip_by_fisher_norm_keeps_float64_with_a_float32_schedule(data, injected):
    """The clipped step is sqrt(max_norm / d.S.d) d to float64 round-off, with optax's float32 learning rate."""
    j, _ = data
    lr = optax.schedules.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
    with jax.enable_x64(True):
        assert lr(jnp.zeros((), jnp.int32)).dtype == jnp.float32
        d = jnp.asarray(np.random.default_rng(1).normal(size=P))
        clip = (optax.inject_hyperparams(svx.clip_by_fisher_norm) if injected else svx.clip_by_fisher_norm)(1e-4, lr)
        opt = optax.chain(clip, optax.scale_by_learning_rate(lr, flip_sign=False))
        step, _ = opt.update(d, opt.init(d), d, jacobian=j)
        ju = j.data[:N_VALID] @ d
        d_s_d = jnp.mean(ju**2) - jnp.mean(ju) ** 2
        assert float(lr(0)) ** 2 * float(d_s_d) > 1e-4  # the constraint binds
        np.testing.assert_allclose(step, jnp.sqrt(1e-4 / d_s_d) * d, rtol=1e-14)
