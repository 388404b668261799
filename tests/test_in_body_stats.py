"""sv.all_walkers: statistics over every valid walker of every device, from inside a body."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated


def clip_window(e):
    mean = sv.all_walkers.mean(e)
    mad = sv.all_walkers.mean(jnp.abs(e - mean))
    return mean, mad


def clipped(e: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    mean, mad = jax.lax.stop_gradient(clip_window(e))
    return jnp.clip(e, mean - 5 * mad, mean + 5 * mad)


def numpy_clip(e):
    mean = e.mean()
    mad = np.abs(e - mean).mean()
    return np.clip(e, mean - 5 * mad, mean + 5 * mad)


def energies(n, n_valid):
    rng = np.random.default_rng(0)
    e = rng.normal(size=n)
    e[3] = 40.0  # an outlier to clip
    e[n_valid:] = 1e6  # padding that must not enter the window
    return e


@pytest.mark.parametrize("n, n_valid", [(24, 24), (24, 17), (13, 13)])
def test_ferminet_clipping_matches_numpy(mesh, n, n_valid):
    e = energies(n, n_valid)
    kernel = sv.walker_parallel(clipped, mesh=mesh)
    arg = sv.WalkerSet(jnp.asarray(e), n_valid) if n % mesh.devices.size == 0 else jnp.asarray(e[:n_valid])
    with pytest.warns(sv.PaddingWarning) if n % mesh.devices.size else _nothing():
        out = kernel(arg)
    data = out.data if isinstance(out, sv.WalkerSet) else out
    np.testing.assert_allclose(np.asarray(data)[:n_valid], numpy_clip(e[:n_valid]), rtol=1e-6)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_statistics_in_a_block_body_and_the_count(mesh):
    x = jnp.arange(24.0)

    @sv.walker_parallel(mesh=mesh, batched=True)
    def centred(x: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return x - sv.all_walkers.mean(x) + 0 * sv.all_walkers.count()

    @sv.walker_parallel(mesh=mesh)
    def count(x: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return sv.all_walkers.count() + 0 * x

    out = centred(sv.WalkerSet(x, 20))
    np.testing.assert_allclose(np.asarray(out.data), np.arange(24.0) - np.arange(20.0).mean())
    assert np.all(np.asarray(count(sv.WalkerSet(x, 20)).data) == 20)


def test_outer_gradient_is_that_of_the_global_statistic(mesh):
    """d/dtheta of mean_i (e_i - mean_j e_j)^2 (a variance), through all_walkers, against jax.grad."""
    r = jax.random.normal(jax.random.key(0), (24, 3))

    @sv.walker_parallel(mesh=mesh)
    def variance(theta: Replicated[jax.Array], r: PerWalker[jax.Array]) -> Mean[jax.Array]:
        e = jnp.sum(jnp.sin(theta * r))
        return (e - sv.all_walkers.mean(e)) ** 2

    def reference(theta, r):
        e = jnp.sum(jnp.sin(theta * r), axis=-1)[:20]
        return jnp.mean((e - e.mean()) ** 2)

    theta = jnp.array([0.3, 0.7, 1.1])
    np.testing.assert_allclose(
        jax.grad(lambda t: variance(t, sv.WalkerSet(r, 20)))(theta), jax.grad(reference)(theta, r), rtol=1e-5
    )


def test_per_walker_gradient_inside_follows_collective_semantics():
    """Inside the body, d/dx_i of walker i's output through a statistic is d/dx_i of the sum over walkers."""
    x = jnp.arange(16.0)

    @sv.walker_parallel
    def inside(x: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return jax.grad(lambda x: (x - sv.all_walkers.sum(x)) ** 2)(x)

    s = x.sum()
    expected = jax.grad(lambda x: jnp.sum((x - x.sum()) ** 2))(x)
    np.testing.assert_allclose(inside(x), expected)
    assert float(expected[0]) == pytest.approx(2 * (0 - s) - 2 * float(jnp.sum(x - s)))


def test_statistics_are_refused_outside_kernels_and_with_batch_size():
    with pytest.raises(sv.CallError, match=r"(?s)outside a walker-parallel kernel.*sv.walker_mean"):
        sv.all_walkers.mean(jnp.ones(3))

    @sv.walker_parallel(batch_size=2)
    def chunked(x: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return x - sv.all_walkers.mean(x)

    with pytest.raises(sv.CallError, match=r"(?s)batch_size=.*cannot see each other"):
        chunked(jnp.ones(8))
