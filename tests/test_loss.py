"""sv.loss: FermiNet's and DeepQMC's clippings against their formulas in numpy, on any device count and padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv


def _log_squeeze(x):  # deepqmc.utils.log_squeeze, in numpy
    return np.sign(x) * np.log1p((np.abs(x) + x**2 / 2 + np.abs(x) ** 3) / (1 + x**2))


def _ferminet(e, width, center):
    c = np.mean(e) if center == "mean" else np.median(e)
    mad = np.mean(np.abs(e - c))
    return np.clip(e, c - width * mad, c + width * mad)


def _deepqmc(e, width, quantile, exclude):  # deepqmc.loss.clip.median_log_squeeze_and_mask on one device
    median = np.median(e)
    q = np.quantile(np.abs(e - median), quantile)
    w = width * q
    return median + 2 * w * _log_squeeze((e - median) / (2 * w)), np.abs(e - median) / q < exclude


def _energies(n):
    rng = np.random.default_rng(n)
    e = rng.normal(size=n) - 7.4
    e[::5] += rng.standard_cauchy(size=e[::5].shape) * 3  # heavy tails, as near nodes
    return e


@pytest.mark.parametrize("n_devices", (1, 3, 8))
@pytest.mark.parametrize("n", (13, 24))
def test_clippings_equal_their_formulas_over_the_valid_walkers(n_devices, n):
    e = _energies(n)
    mesh = sv.create_mesh(jax.devices()[:n_devices])
    clippings = (sv.loss.ClipMAD(5.0), sv.loss.ClipMAD(2.0, center="median"), sv.loss.ClipLogSqueeze(1.0, 0.5, 2.0))

    @sv.walker_parallel(mesh=mesh)
    def clip(x: sv.PerWalker[jax.Array]) -> tuple[sv.PerWalker, ...]:
        return tuple(out for c in clippings for out in c(x))

    padded = sv.WalkerSet(jnp.concatenate([jnp.asarray(e, jnp.float32), jnp.full((3,), 1e6, jnp.float32)]), n)
    result = clip(padded)  # a WalkerSet of the outputs
    out = [np.asarray(x)[:n] for x in result.data]  # 3 padding walkers of 1e6 must change nothing
    np.testing.assert_allclose(out[0], _ferminet(e, 5.0, "mean"), rtol=1e-5)
    np.testing.assert_allclose(out[2], _ferminet(e, 2.0, "median"), rtol=1e-5)
    clipped, keep = _deepqmc(e, 1.0, 0.5, 2.0)
    np.testing.assert_allclose(out[4], clipped, rtol=1e-5)
    assert out[5].tolist() == keep.tolist() and not keep.all()  # some walkers leave the gradient
    assert out[1].all() and out[3].all()  # ClipMAD keeps every walker by default


def test_an_eigenstates_energies_pass_unchanged():
    """Every local energy equal (an exact wavefunction): DeepQMC's formula divides by a zero quantile."""

    @sv.walker_parallel
    def clip(x: sv.PerWalker[jax.Array]) -> tuple[sv.PerWalker, sv.PerWalker, sv.PerWalker]:
        squeezed, keep = sv.loss.ClipLogSqueeze()(x)
        return squeezed, keep, sv.loss.ClipMAD()(x)[0]

    squeezed, keep, mad = clip(jnp.full((16,), 1.5))
    assert np.asarray(squeezed).tolist() == [1.5] * 16 and np.asarray(mad).tolist() == [1.5] * 16
    assert np.asarray(keep).all()


def test_bad_settings_are_refused():
    for bad in (lambda: sv.loss.ClipMAD(0.0), lambda: sv.loss.ClipMAD(center="mode"),
                lambda: sv.loss.ClipLogSqueeze(quantile=1.5), lambda: sv.loss.ClipLogSqueeze(width=-1)):  # fmt: skip
        with pytest.raises(sv.CallError):
            bad()


def test_vmc_clips_the_same_with_and_without_batch_size():
    """The clipping's statistics see every walker also when the measurement runs in chunks (batch_size=)."""
    import optax

    import shardvmc.optax as svx

    log_psi = lambda a, r: -a * jnp.sum(r**2)  # noqa: E731
    opt = optax.chain(svx.natural_gradient(damping=1e-3), optax.scale_by_learning_rate(0.1))
    walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 13, key=jax.random.key(0))
    moved = []
    for batch_size in (None, 1):
        vmc = sv.driver.VMC(log_psi, opt, lambda r: 0.5 * jnp.sum(r**2), batch_size=batch_size,
                            clipping=sv.loss.ClipMAD(1.0))  # fmt: skip
        state, stats = vmc.step(vmc.init(jnp.float32(0.4), walkers), jax.random.key(1))
        moved.append(float(state.params))
    unclipped = sv.driver.VMC(log_psi, opt, lambda r: 0.5 * jnp.sum(r**2))
    plain, _ = unclipped.step(unclipped.init(jnp.float32(0.4), walkers), jax.random.key(1))
    assert abs(moved[0] - moved[1]) <= 1e-6 and abs(moved[0] - float(plain.params)) > 1e-6  # a width of 1 MAD bites


def test_log_squeeze_takes_float32_accurate_functions_on_a_tpu():
    """On a TPU ``log_squeeze`` runs the rewrite's log1p (the TPU's own is up to thousands of ulps off: the docs'
    comparison with DeepQMC's formula failed there at 1e-4); elsewhere it is jnp.log1p's, bit for bit."""
    from shardvmc import _numerics, loss

    x = np.concatenate([-np.geomspace(1e-6, 1e6, 100), np.geomspace(1e-6, 1e6, 100)]).astype(np.float32)
    eqns = jax.make_jaxpr(sv.loss.log_squeeze)(x).jaxpr.eqns
    (cond,) = [e for e in eqns if e.primitive.name == "cond"]  # lax.platform_dependent: one branch per platform
    has_log1p = [any(q.primitive.name == "log1p" for q in b.jaxpr.eqns) for b in cond.params["branches"]]
    assert sorted(has_log1p) == [False, True], has_log1p
    expected = _log_squeeze(x.astype(np.float64))
    tpu_branch = np.asarray(jax.jit(_numerics._rewrite(loss._log_squeeze))(x))
    np.testing.assert_allclose(tpu_branch, expected, rtol=2e-6)
    assert np.array_equal(np.asarray(jax.jit(sv.loss.log_squeeze)(x)), np.asarray(jax.jit(loss._log_squeeze)(x)))
