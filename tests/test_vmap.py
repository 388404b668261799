"""The functional kernels (shard_vmap & co): per-walker results stay sharded and equal jax.vmap."""

import functools
from typing import NamedTuple

import folx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helium import PARAMS, log_psi, positions
from jax.sharding import PartitionSpec as P

import shardvmc as sv


def per_walker_grad(params, r):
    return jax.grad(log_psi)(params, r)


@pytest.mark.parametrize("n", [24, 10])
def test_shard_vmap_matches_vmap_and_stays_sharded(mesh, n):
    r = positions(n)
    f = sv.shard_vmap(log_psi, mesh, in_axes=(None, 0))
    out = f(PARAMS, r)
    np.testing.assert_allclose(out, jax.vmap(log_psi, (None, 0))(PARAMS, r), rtol=1e-6)
    if n % mesh.devices.size == 0:
        assert out.sharding.spec == P("walkers") and out.sharding.mesh == mesh


def test_per_walker_gradient_wrt_replicated_is_not_summed_over_devices(mesh):
    """The check_vma trap: under check_vma=True without a cast to varying, this comes out summed over devices."""
    r = positions(24)
    jac = sv.shard_vmap(per_walker_grad, mesh, in_axes=(None, 0))(PARAMS, r)
    ref = jax.vmap(per_walker_grad, (None, 0))(PARAMS, r)
    for k in PARAMS:
        np.testing.assert_allclose(jac[k], ref[k], rtol=1e-5, atol=1e-6)
        assert jac[k].sharding.spec == P("walkers")


def test_the_trap_is_real_under_check_vma():
    """Guard for the test above: a hand-written check_vma=True shard_map without pcast gets it wrong on 8 devices."""
    mesh = sv.create_mesh()
    r = positions(24)
    naive = jax.shard_map(
        jax.vmap(per_walker_grad, (None, 0)),
        mesh=mesh,
        in_specs=(P(), P("walkers")),
        out_specs=P("walkers"),
        check_vma=True,
    )
    wrong = naive(PARAMS, r)
    ref = jax.vmap(per_walker_grad, (None, 0))(PARAMS, r)
    assert not np.allclose(wrong["alpha"], ref["alpha"], rtol=1e-3)


def test_sharded_batched_vmap_matches_and_bounds_chunks(mesh):
    r = positions(24)

    def laplacian(params, x):
        return folx.forward_laplacian(lambda y: log_psi(params, y.reshape(2, 3)))(x.reshape(-1)).laplacian

    f = sv.sharded_batched_vmap(laplacian, 2, mesh, in_axes=(None, 0))
    out = f(PARAMS, r)
    ref = jax.vmap(lambda x: jnp.trace(jax.hessian(lambda y: log_psi(PARAMS, y.reshape(2, 3)))(x.reshape(-1))))(r)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert out.sharding.spec == P("walkers")
    # the chunk loop runs inside each shard: a scan over chunks of 2 walkers
    if mesh.devices.size < 8:
        assert "while" in jax.jit(f).lower(PARAMS, r).as_text()


def test_shard_vmap_output_is_not_gathered():
    mesh = sv.create_mesh()
    r = sv.shard_walker(positions(64), mesh)
    hlo = jax.jit(sv.shard_vmap(log_psi, mesh, in_axes=(None, 0))).lower(PARAMS, r).compile().as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
        assert op not in hlo, op


def test_shard_vmap_rejects_unsupported_axes():
    with pytest.raises(ValueError, match="only 0"):
        sv.shard_vmap(log_psi, in_axes=(None, 1))(PARAMS, positions(8))
    with pytest.raises(ValueError, match="out_axes"):
        sv.shard_vmap(log_psi, out_axes=1)
    with pytest.raises(ValueError, match="max_batch_size"):
        sv.sharded_batched_vmap(log_psi, 0)


def test_get_vmap_fn_selection():
    mesh = sv.create_mesh(jax.devices()[:3])
    r = positions(9)
    for size in (0, 2):
        out = sv.get_vmap_fn(size, mesh)(log_psi, in_axes=(None, 0))(PARAMS, r)
        np.testing.assert_allclose(out, jax.vmap(log_psi, (None, 0))(PARAMS, r), rtol=1e-6)
        assert out.sharding.spec == P("walkers") and out.sharding.mesh == mesh
    # 8 devices in this process: the default is sharded over all of them
    out = sv.get_vmap_fn()(log_psi, in_axes=(None, 0))(PARAMS, positions(16))
    assert out.sharding.mesh.devices.size == 8


def test_shard_map_wrap_follows_the_engine_rule():
    """Code that check_vma=True breaks (folx over a jnp.eye mask; per-walker grads of P() inputs) runs and is right."""
    mesh = sv.create_mesh()
    r = positions(24)

    def laplacian(params, r):
        def f(x):
            x = x.reshape(2, 3)
            ee = x[:, None] - x[None]
            d = jnp.linalg.norm(ee + jnp.eye(2)[..., None], axis=-1) * (1.0 - jnp.eye(2))
            return log_psi(params, x) + jnp.sum(d)

        return folx.forward_laplacian(f)(r.reshape(-1)).laplacian

    f = sv.shard_map_wrap(jax.vmap(laplacian, (None, 0)), mesh, (P(), P("walkers")), P("walkers"))
    # atol: a Laplacian is a sum of terms of order 10 that can cancel to order 0.01 (float32 round-off, 1e-6)
    np.testing.assert_allclose(f(PARAMS, r), jax.vmap(laplacian, (None, 0))(PARAMS, r), rtol=1e-5, atol=2e-5)
    own = sv.shard_map_wrap(jax.vmap(per_walker_grad, (None, 0)), mesh, (P(), P("walkers")), P("walkers"))(PARAMS, r)
    np.testing.assert_allclose(own["alpha"], jax.vmap(per_walker_grad, (None, 0))(PARAMS, r)["alpha"], rtol=1e-5)


def test_functional_kernels_nest_inside_decorated_bodies():
    @sv.walker_parallel
    def total(params: sv.Replicated, r: sv.PerWalker) -> sv.Mean:
        # r is one walker here; the inner shard_vmap is a plain vmap over its electrons
        return sv.shard_vmap(lambda e: jnp.sum(e**2))(r).sum() * params["alpha"]

    r = positions(16)
    np.testing.assert_allclose(total(PARAMS, r), PARAMS["alpha"] * jnp.mean(jnp.sum(r**2, axis=(1, 2))), rtol=1e-6)


# ----------------------------------------------------------------------------- jax.vmap-style pytree axes


class FermiNetData(NamedTuple):
    """FermiNet's batch (``ferminet/networks.py``): per-walker positions and spins, per-run atoms and charges."""

    positions: jax.Array
    spins: jax.Array
    atoms: jax.Array
    charges: jax.Array


def _ferminet_data(n):
    rng = np.random.default_rng(0)
    return FermiNetData(
        positions=jnp.asarray(rng.normal(size=(n, 6)), jnp.float32),
        spins=jnp.asarray(np.tile([1.0, -1.0], (n, 1)), jnp.float32),
        atoms=jnp.asarray([[0.0, 0.0, 0.3], [0.0, 0.0, -0.3]], jnp.float32),
        charges=jnp.asarray([1.0, 1.0], jnp.float32),
    )


def ferminet_energy(params, data):
    """A FermiNet-style per-walker function of (params, FermiNetData): atoms and charges are per run."""
    r = data.positions.reshape(2, 3)
    r_ae = jnp.linalg.norm(r[:, None] - data.atoms[None], axis=-1)
    return log_psi(params, r) * jnp.sum(data.spins) - jnp.sum(data.charges / r_ae)


SPLIT = (None, FermiNetData(positions=0, spins=0, atoms=None, charges=None))


@pytest.mark.parametrize("n", [24, 10])
def test_pytree_in_axes_match_jax_vmap(mesh, n):
    data = _ferminet_data(n)
    ref = jax.vmap(ferminet_energy, in_axes=SPLIT)(PARAMS, data)
    out = sv.shard_vmap(ferminet_energy, mesh, in_axes=SPLIT)(PARAMS, data)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    if n % mesh.devices.size == 0:
        assert out.sharding.spec == P("walkers")
    # FermiNet's all-per-walker pytree entry, with atoms and charges given per walker
    stacked = data._replace(
        atoms=jnp.broadcast_to(data.atoms, (n, 2, 3)), charges=jnp.broadcast_to(data.charges, (n, 2))
    )
    every = (None, FermiNetData(positions=0, spins=0, atoms=0, charges=0))
    np.testing.assert_allclose(sv.shard_vmap(ferminet_energy, mesh, in_axes=every)(PARAMS, stacked), ref, rtol=1e-6)


def test_pytree_axes_in_every_vmap_and_inside_kernels():
    mesh = sv.create_mesh(jax.devices()[:3])
    data = _ferminet_data(9)
    ref = jax.vmap(ferminet_energy, in_axes=SPLIT)(PARAMS, data)
    for vmap in (sv.get_vmap_fn(mesh=mesh), sv.get_vmap_fn(2, mesh), functools.partial(sv.sharded_batched_vmap,
                 max_batch_size=2, mesh=mesh)):  # fmt: skip
        np.testing.assert_allclose(vmap(ferminet_energy, in_axes=SPLIT)(PARAMS, data), ref, rtol=1e-6)
    # a dict prefix, as in jax.vmap's documentation
    f = sv.shard_vmap(lambda d, x: d["a"] * x + d["b"], mesh, in_axes=({"a": None, "b": 0}, None))
    b = jnp.arange(9.0)
    np.testing.assert_allclose(f({"a": 2.0, "b": b}, 3.0), 6.0 + b)

    @sv.walker_parallel(mesh=mesh, batched=True)
    def block_mean(params: sv.Replicated, data: sv.PerWalker) -> sv.PerWalker:
        # inside a kernel's body the functional vmap is a plain jax.vmap over the block
        return sv.shard_vmap(ferminet_energy, in_axes=SPLIT)(params, data._replace(atoms=atoms, charges=charges))

    atoms, charges = data.atoms, data.charges
    walkers = data._replace(atoms=jnp.zeros((9, 1)), charges=jnp.zeros((9, 1)))
    np.testing.assert_allclose(block_mean(PARAMS, walkers), ref, rtol=1e-6)


def test_out_axes_none_returns_the_shared_value_once(mesh):
    def f(params, r):
        return log_psi(params, r), params["alpha"] * 2.0

    r = positions(10)
    walkers = sv.WalkerSet(r, 10)
    energy, shared = sv.shard_vmap(f, mesh, in_axes=(None, 0), out_axes=(0, None))(PARAMS, walkers)
    ref_energy, ref_shared = jax.vmap(f, in_axes=(None, 0), out_axes=(0, None))(PARAMS, r)
    assert isinstance(energy, sv.WalkerSet) and energy.n_valid == 10  # the mapped element stays a walker set
    np.testing.assert_allclose(energy.data, ref_energy, rtol=1e-6)
    assert np.shape(shared) == () and float(shared) == float(ref_shared)
    with pytest.raises(ValueError, match="out_axes"):  # like jax.vmap: a per-walker output cannot be None
        sv.shard_vmap(f, mesh, in_axes=(None, 0), out_axes=(None, None))(PARAMS, r)


def test_pytree_axes_errors():
    data = _ferminet_data(8)
    with pytest.raises(ValueError, match="a leaf of in_axes"):
        sv.shard_vmap(ferminet_energy, in_axes=(None, FermiNetData(0, 0, 1, None)))(PARAMS, data)
    with pytest.raises(ValueError, match="not a prefix"):
        sv.shard_vmap(ferminet_energy, in_axes=(None, {"positions": 0}))(PARAMS, data)
    with pytest.raises(sv.CallError, match="WalkerSet"):
        sv.shard_vmap(ferminet_energy, in_axes=SPLIT)(PARAMS, sv.WalkerSet(data.positions))
    with pytest.raises(ValueError, match="out_axes leaves"):
        sv.shard_vmap(ferminet_energy, out_axes=(0, 1))
