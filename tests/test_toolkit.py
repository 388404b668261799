"""The walker-sharding toolkit: values against unsharded references, and the shardings."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardvmc as sv
from shardvmc.testing import assert_replicated, assert_walker_sharded

WALKER = P("walkers")


def walkers(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"r": rng.normal(size=(n, 2, 3)).astype(np.float32), "spin": np.arange(n, dtype=np.int32), "t": 0.5}


# ---------------------------------------------------------------- meshes


def test_create_mesh_spans_all_devices_with_auto_axis():
    mesh = sv.create_mesh()
    assert mesh.axis_names == ("walkers",)
    assert mesh.devices.size == jax.device_count() == 8
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_create_mesh_over_subset_and_custom_axis():
    mesh = sv.create_mesh(jax.devices()[2:5], axis_name="w")
    assert dict(mesh.shape) == {"w": 3}
    assert list(mesh.devices.flat) == jax.devices()[2:5]


def test_create_mesh_rejects_no_devices():
    with pytest.raises(sv.CallError, match="no devices"):
        sv.create_mesh([])


def test_device_counts_are_local():
    assert sv.n_devices() == jax.local_device_count() == 8
    assert sv.is_multi_gpu()


def test_shardings(mesh):
    assert sv.get_walker_sharding(mesh).spec == WALKER
    assert sv.get_walker_sharding(mesh).mesh == mesh
    assert sv.get_replicated_sharding(mesh).spec == P()


def test_use_mesh_sets_and_restores_default():
    small = sv.create_mesh(jax.devices()[:3])
    with sv.use_mesh(small):
        x = sv.shard_walker(np.zeros((6, 2)))
        assert x.sharding.mesh == small
        with pytest.raises(RuntimeError):
            with sv.use_mesh(sv.create_mesh(jax.devices()[:1])):
                raise RuntimeError
        assert sv.shard_walker(np.zeros((6, 2))).sharding.mesh == small
    assert sv.shard_walker(np.zeros((8, 2))).sharding.mesh.devices.size == 8


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_shard_walker(mesh, on_device):
    n = 3 * 8
    tree = walkers(n)
    src = jax.device_put(tree, jax.devices()[0]) if on_device else tree
    out = sv.shard_walker(src, mesh)
    np.testing.assert_array_equal(out["r"], tree["r"])
    np.testing.assert_array_equal(out["spin"], tree["spin"])
    assert out["r"].sharding.spec == WALKER and out["spin"].sharding.spec == WALKER
    assert out["t"].sharding.spec == P() and float(out["t"]) == 0.5
    assert_walker_sharded(out, mesh)
    # each device holds only its own walkers
    per = n // mesh.devices.size
    assert {s.data.shape for s in out["r"].addressable_shards} == {(per, 2, 3)}


def test_shard_walker_names_leaf_and_sizes():
    bad = {"a": np.zeros((8, 2)), "b": {"c": np.zeros((6,))}}
    with pytest.raises(sv.CallError) as err:
        sv.shard_walker(bad, sv.create_mesh())
    text = str(err.value)
    assert "shard_walker" in text and "['b']['c']" in text and "8" in text and "6" in text


def test_shard_walker_indivisible_points_to_pad_walker():
    with pytest.raises(ValueError) as err:
        sv.shard_walker(np.zeros((10, 3)), sv.create_mesh(jax.devices()[:4]))
    text = str(err.value)
    assert "10 walkers" in text and "4 devices" in text and "pad_walker" in text and "12" in text


def test_replicate(mesh):
    params = {"w": np.arange(6.0).reshape(2, 3), "b": 1.5}
    out = sv.replicate(params, mesh)
    assert out["w"].sharding.spec == P() and out["w"].sharding.mesh == mesh
    np.testing.assert_array_equal(out["w"], params["w"])
    assert_replicated(out)
    assert all(s.data.shape == (2, 3) for s in out["w"].addressable_shards)


def test_replicate_uses_default_mesh():
    out = sv.replicate(jnp.ones(3))
    assert out.sharding.mesh.devices.size == 8 and out.sharding.is_fully_replicated


def test_replicate_on_a_current_mesh_with_any_axis_names():
    # A full copy needs no walker axis: a use_mesh or jax.set_mesh mesh (NetKet sets one with axis "S" at import)
    # serves as it is, where replicate used to ask for a "walkers" axis and to "pass axis_name=", which it has not.
    other = sv.create_mesh(jax.devices()[:4], axis_name="x")
    with sv.use_mesh(other):
        assert sv.replicate(jnp.ones(3)).sharding.mesh == other
    explicit = jax.make_mesh((8,), ("S",))
    with jax.set_mesh(explicit):
        out = sv.replicate({"w": np.ones(3)})
    assert out["w"].sharding.mesh == explicit and out["w"].sharding.is_fully_replicated
    with pytest.raises(sv.CallError, match=r"^replicate: mesh is not a jax.sharding.Mesh") as err:
        sv.replicate(jnp.ones(3), "walkers")
    assert "axis_name" not in str(err.value)


@pytest.mark.parametrize(("n", "d", "expected"), [(10, 4, 12), (8, 4, 8), (1, 4, 4), (100, 3, 102), (0, 3, 0)])
def test_pad_n_walkers(n, d, expected):
    assert sv.pad_n_walkers(n, d) == expected


@pytest.mark.parametrize("as_jax", [False, True])
def test_pad_walker_any_pytree(as_jax):
    tree = walkers(5)
    if as_jax:
        tree = jax.tree_util.tree_map(jnp.asarray, tree)
    padded, n = sv.pad_walker(tree, 8)
    assert n == 5
    assert padded["r"].shape == (8, 2, 3) and padded["spin"].shape == (8,)
    np.testing.assert_array_equal(padded["r"][:5], tree["r"])
    np.testing.assert_array_equal(padded["r"][5:], np.repeat(np.asarray(tree["r"][:1]), 3, axis=0))
    assert float(padded["t"]) == 0.5
    assert isinstance(padded["r"], jax.Array if as_jax else np.ndarray)


def test_pad_walker_smaller_target_is_identity():
    tree = walkers(5)
    padded, n = sv.pad_walker(tree, 3)
    assert padded is tree and n == 5


def test_pad_walker_dataclass():
    @chex.dataclass
    class State:
        r: np.ndarray
        logpsi: np.ndarray

    padded, n = sv.pad_walker(State(r=np.ones((3, 2)), logpsi=np.arange(3.0)), 4)
    assert n == 3 and padded.r.shape == (4, 2) and padded.logpsi.tolist() == [0, 1, 2, 0]


def test_slice_walkers():
    tree = walkers(6)
    part = sv.slice_walkers(tree, 2, 5)
    np.testing.assert_array_equal(part["r"], tree["r"][2:5])
    assert part["t"] == 0.5


def test_assemble_sharded(mesh):
    d = mesh.devices.size
    local = [walkers(2, seed=i) for i in range(d)]
    out = sv.assemble_sharded(local, mesh)
    expected = np.concatenate([t["r"] for t in local])
    np.testing.assert_array_equal(out["r"], expected)
    assert out["r"].sharding.spec == WALKER and out["t"].sharding.spec == P()
    for shard in out["r"].addressable_shards:
        i = list(mesh.devices.flat).index(shard.device)
        np.testing.assert_array_equal(shard.data, local[i]["r"])


def test_assemble_sharded_checks_count_and_sizes():
    mesh = sv.create_mesh(jax.devices()[:3])
    with pytest.raises(sv.CallError, match="expected: 3"):
        sv.assemble_sharded([walkers(2)] * 2, mesh)
    with pytest.raises(sv.CallError, match="local pytree 2"):
        sv.assemble_sharded([walkers(2), walkers(2), walkers(3)], mesh)


def init_walker(key):
    return {"r": jax.random.normal(key, (2, 3)), "id": jax.random.randint(key, (), 0, 1000)}


@pytest.mark.parametrize("n", [12, 10, 1])
def test_initialize_walkers_sharded_is_device_count_invariant(mesh, n):
    key = jax.random.key(42)
    walker_set = sv.initialize_walkers_sharded(init_walker, n, mesh, key=key)
    assert isinstance(walker_set, sv.WalkerSet) and walker_set.n_valid == n
    out = walker_set.data
    d = mesh.devices.size
    assert out["r"].shape[0] == sv.pad_n_walkers(n, d)
    assert out["r"].sharding.spec == WALKER and out["r"].sharding.mesh == mesh
    reference = jax.vmap(lambda i: init_walker(jax.random.fold_in(key, i)))(jnp.arange(n))
    np.testing.assert_array_equal(np.asarray(out["r"])[:n], reference["r"])
    np.testing.assert_array_equal(np.asarray(out["id"])[:n], reference["id"])


def test_initialize_walkers_sharded_raw_key_and_no_global_materialisation():
    mesh = sv.create_mesh(jax.devices()[:4])
    out = sv.initialize_walkers_sharded(lambda k: jax.random.uniform(k, (3,)), 8, mesh, key=jax.random.PRNGKey(1)).data
    ref = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(1), i), (3,)))(jnp.arange(8))
    np.testing.assert_array_equal(out, ref)
    assert {s.data.shape for s in out.addressable_shards} == {(2, 3)}


def test_initialize_walkers_from_host_walkers(mesh):
    host = walkers(7)
    walker_set = sv.initialize_walkers_sharded(None, 7, mesh, initial_walkers=host)
    assert walker_set.n_valid == 7
    out = walker_set.data
    assert out["r"].shape[0] == sv.pad_n_walkers(7, mesh.devices.size)
    np.testing.assert_array_equal(np.asarray(out["r"])[:7], host["r"])
    assert out["r"].sharding.spec == WALKER


def test_initialize_walkers_requires_key():
    with pytest.raises(sv.CallError, match="key="):
        sv.initialize_walkers_sharded(init_walker, 8)
    with pytest.raises(sv.CallError, match="another number of walkers"):
        sv.initialize_walkers_sharded(None, 8, initial_walkers=walkers(7))


def test_gather_walkers(mesh):
    tree = walkers(24)
    host = sv.gather_walkers(sv.shard_walker(tree, mesh))
    assert isinstance(host["r"], np.ndarray)
    np.testing.assert_array_equal(host["r"], tree["r"])
    assert host["t"] == 0.5
