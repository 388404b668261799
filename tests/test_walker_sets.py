"""WalkerSet: walkers that carry their count, through kernels, reductions and initialisation."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardvmc as sv
from shardvmc import Mean, PerWalker, Sum, WalkerKey


@sv.walker_parallel
def r2(r: PerWalker[jax.Array]) -> Mean[jax.Array]:
    return jnp.sum(r**2)


@sv.walker_parallel
def move(r: PerWalker[jax.Array], key: WalkerKey) -> tuple[PerWalker[jax.Array], Sum[jax.Array]]:
    new = r + 0.1 * jax.random.normal(key, r.shape)
    return new, jnp.sum(new**2)


def init(key):
    return jax.random.normal(key, (2, 3))


def test_initialised_walkers_carry_their_count_and_cannot_bias_a_mean(mesh):
    walkers = sv.initialize_walkers_sharded(init, 10, mesh, key=jax.random.key(0))
    assert isinstance(walkers, sv.WalkerSet) and walkers.n_valid == 10
    assert walkers.n_walkers == sv.pad_n_walkers(10, mesh.devices.size)
    assert walkers.data.sharding.spec == P("walkers")
    host = np.asarray(walkers.data)[:10]
    exact = np.mean(np.sum(host**2, axis=(1, 2)))
    with sv.use_mesh(mesh):
        # no n_valid anywhere: the count travels with the walkers
        np.testing.assert_allclose(float(r2(walkers)), exact, rtol=1e-5)
        np.testing.assert_allclose(sv.walker_mean(walkers), host.mean(axis=0), rtol=1e-5, atol=1e-6)
        if walkers.n_padding:  # the plain array is averaged over every row: the bias the WalkerSet removes
            assert not np.isclose(float(r2(walkers.data)), exact, rtol=1e-5)


def test_a_step_loops_without_bookkeeping(mesh):
    walkers = sv.initialize_walkers_sharded(init, 13, mesh, key=jax.random.key(1))
    ref = np.asarray(walkers.data)
    with sv.use_mesh(mesh):
        for step in range(3):
            key = jax.random.fold_in(jax.random.key(2), step)
            walkers, total = move(walkers, key)
            keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(ref.shape[0]))
            ref = ref + 0.1 * np.asarray(jax.vmap(lambda k, r: jax.random.normal(k, r.shape))(keys, ref))
            np.testing.assert_allclose(float(total), np.sum(ref[:13] ** 2), rtol=1e-5)
    assert isinstance(walkers, sv.WalkerSet) and walkers.n_valid == 13
    assert walkers.data.sharding.spec == P("walkers")
    np.testing.assert_allclose(np.asarray(walkers.data), ref, rtol=1e-5, atol=1e-6)


def test_walker_sets_through_jit_and_tree_map(mesh):
    walkers = sv.initialize_walkers_sharded(init, 10, mesh, key=jax.random.key(0))

    @jax.jit
    def step(walkers, key):
        new, _ = move(walkers, key)
        return jax.tree.map(lambda x: 2 * x, new)

    with sv.use_mesh(mesh):
        out = step(walkers, jax.random.key(3))
    assert isinstance(out, sv.WalkerSet) and out.n_valid == 10


def test_explicit_n_valid_must_agree_with_the_walker_set():
    walkers = sv.WalkerSet(jnp.ones((8, 2, 3)), 6)
    assert float(r2(walkers, n_valid=6)) == pytest.approx(6.0)
    with pytest.raises(sv.CallError, match="disagrees with the count the WalkerSet"):
        r2(walkers, n_valid=5)


def test_reductions_take_walker_sets():
    j = jnp.arange(16.0).reshape(8, 2)
    ws = sv.WalkerSet(j, 5)
    np.testing.assert_allclose(sv.jtj(ws), np.asarray(j[:5]).T @ np.asarray(j[:5]))
    np.testing.assert_allclose(sv.jtv(ws, jnp.arange(8.0)), np.asarray(j[:5]).T @ np.arange(5.0))
    np.testing.assert_allclose(sv.walker_sum(ws), np.asarray(j[:5]).sum(0))


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: sv.WalkerSet(jnp.ones((4, 3)), 5), "n_valid=5 is outside 1..4"),
        (lambda: sv.WalkerSet(jnp.ones((4, 3)), 0), "n_valid=0 is outside 1..4"),
        (lambda: sv.WalkerSet(jnp.ones((4, 3)), 2.5), "n_valid must be a Python int"),
        (lambda: sv.WalkerSet(sv.WalkerSet(jnp.ones((4, 3))), 2), "already a WalkerSet"),
    ],
)
def test_walker_set_rejects_bad_counts(make, fragment):
    with pytest.raises(sv.CallError, match=fragment):
        make()


def test_n_valid_numpy_scalars_are_accepted_everywhere():
    x = jnp.arange(8.0)
    for n in (3, np.int64(3), np.array(3), jnp.array(3)):
        assert float(sv.walker_mean(x, n)) == 1.0
        assert float(r2(x[:, None], n_valid=n)) == pytest.approx(5.0 / 3.0)


def test_n_valid_of_any_integer_type_runs_one_program():
    traces = []

    @sv.walker_parallel
    def f(r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        traces.append(1)
        return jnp.sum(r**2)

    x = jnp.arange(8.0)[:, None]
    values = [float(f(x, n_valid=n)) for n in (3, np.int64(3), np.array(3), jnp.array(3), 3, 4)]
    assert values == pytest.approx([5.0 / 3.0] * 5 + [14.0 / 4.0])
    assert len(traces) == 1  # a Python int and integer arrays give the program the same int32 count


def test_padding_warning_names_the_walker_set_fix():
    with pytest.warns(sv.PaddingWarning, match="sv.WalkerSet"):
        r2(jnp.ones((10, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r2(sv.WalkerSet(jnp.ones((16, 3)), 10))  # a padded set: no warning
