"""Mesh resolution (JAX's own mesh context, Explicit axes, several walker axes) and no silent surprises."""

import contextlib
import inspect
import io
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, WalkerKey


def energy(alpha: Replicated[jax.Array], r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
    e = alpha * jnp.sum(r**2)
    return e, e


R = jnp.arange(48.0).reshape(16, 3) / 10


def check(out, mesh):
    e, m = out
    ref = 0.5 * np.sum(np.asarray(R) ** 2, axis=1)
    np.testing.assert_allclose(np.asarray(e), ref, rtol=1e-6)
    np.testing.assert_allclose(float(m), ref.mean(), rtol=1e-6)
    assert dict(e.sharding.mesh.shape) == dict(mesh.shape)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_jax_set_mesh_is_the_default_mesh(explicit):
    devices = jax.devices()[:4]
    mesh = jax.make_mesh((4,), ("walkers",), devices=devices) if explicit else sv.create_mesh(devices)
    kernel = sv.walker_parallel(energy)
    with jax.set_mesh(mesh):
        out = kernel(jnp.float32(0.5), np.asarray(R))  # host input
        walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (3,)), 10, key=jax.random.key(0))
    check(out, mesh)
    assert len(out[0].sharding.device_set) == 4
    assert walkers.data.sharding.mesh.shape["walkers"] == 4


def test_explicit_mesh_passed_directly():
    mesh = jax.make_mesh((8,), ("walkers",))
    out = sv.walker_parallel(energy, mesh=mesh)(jnp.float32(0.5), np.asarray(R))
    check(out, mesh)
    assert out[0].sharding.spec == P("walkers")


def test_a_mesh_option_inside_another_jax_mesh_context():
    mine = sv.create_mesh(jax.devices()[:2])
    alpha = jnp.float32(0.5)  # made outside: under an Explicit jax.set_mesh, new arrays live on that mesh
    with jax.set_mesh(jax.make_mesh((8,), ("walkers",))):
        out = sv.walker_parallel(energy, mesh=mine)(alpha, R)
        with sv.use_mesh(sv.create_mesh(jax.devices()[:4])):
            out4 = sv.walker_parallel(energy)(alpha, R)
    assert len(out[0].sharding.device_set) == 2 and len(out4[0].sharding.device_set) == 4
    check(out, mine)


def test_walkers_split_over_two_mesh_axes():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("hosts", "local"))
    kernel = sv.walker_parallel(energy, mesh=mesh, axis_name=("hosts", "local"))
    out = kernel(jnp.float32(0.5), R)
    check(out, mesh)
    assert out[0].sharding.spec == P(("hosts", "local"))

    @sv.walker_parallel(mesh=mesh, axis_name=("hosts", "local"))
    def draw(key: WalkerKey, r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return jax.random.normal(key, r.shape)

    flat = sv.walker_parallel(draw.__wrapped__, mesh=sv.create_mesh())(jax.random.key(0), R)
    np.testing.assert_array_equal(np.asarray(draw(jax.random.key(0), R)), np.asarray(flat))


def test_a_jax_mesh_without_the_walker_axis_runs_the_kernel_over_its_axes():
    # Another library's mesh (NetKet sets ("S",) at import): the walkers are split over its axes.
    expected = sv.walker_parallel(energy, mesh=sv.create_mesh(jax.devices()[:1]))(jnp.float32(0.5), R)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    with jax.set_mesh(mesh):
        kernel = sv.walker_parallel(energy)
        for got in (kernel(jnp.float32(0.5), R), jax.jit(kernel)(jnp.float32(0.5), R)):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
        assert kernel.explain(jnp.float32(0.5), R).walker_axis == ("data",)
    with pytest.raises(sv.CallError, match=r"(?s)no axis named 'walkers'.*axis_name="):
        sv.walker_parallel(energy, mesh=mesh)(jnp.float32(0.5), R)  # a mesh given to the kernel must have it


# ---- no silent surprises ---------------------------------------------------------------------


def test_batched_with_batch_size_is_refused():
    with pytest.raises(sv.DecorationError, match=r"(?s)batched=True with batch_size=4.*drop batch_size"):
        sv.walker_parallel(batched=True, batch_size=4)


def test_variadic_tuple_of_means_is_refused():
    def f(r: PerWalker[jax.Array]) -> tuple[sv.Mean[jax.Array], ...]:
        return (r, r)

    with pytest.raises(sv.DecorationError, match=r"(?s)variadic tuple.*Mean\[tuple\[\.\.\.\]\]"):
        sv.walker_parallel(f)


def test_replicated_return_needs_batched():
    def f(r: PerWalker[jax.Array]) -> Replicated[jax.Array]:
        return r

    with pytest.raises(sv.DecorationError, match="only a batched=True function"):
        sv.walker_parallel(f)


def test_nested_calls_meet_the_body_at_its_granularity():
    @sv.walker_parallel(batched=True)
    def block_norm(r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        assert r.ndim == 2  # always a block, also when called for one walker
        return jnp.sum(r**2, axis=1)

    @sv.walker_parallel
    def walker_norm(r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        assert r.ndim == 1
        return jnp.sum(r**2)

    @sv.walker_parallel
    def per_walker(r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return block_norm(r) + walker_norm(r)

    @sv.walker_parallel(batched=True)
    def per_block(r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
        return block_norm(r) + walker_norm(r)

    ref = 2 * np.sum(np.asarray(R) ** 2, axis=1)
    np.testing.assert_allclose(per_walker(R), ref, rtol=1e-6)
    np.testing.assert_allclose(per_block(R), ref, rtol=1e-6)


def test_replicated_args_object_applies_to_several_functions_without_global_state():
    shared = sv.replicated_args("alpha")

    def f(alpha, r):
        return alpha * jnp.sum(r)

    def g(alpha, r):
        return alpha * jnp.sum(r**2)

    kf, kg = sv.walker_parallel(shared(f)), sv.walker_parallel(shared(g))
    np.testing.assert_allclose(kf(2.0, R), 2 * np.asarray(R).sum(1), rtol=1e-6)
    np.testing.assert_allclose(kg(2.0, R), 2 * (np.asarray(R) ** 2).sum(1), rtol=1e-6)

    @shared  # stacked above: applied after walker_parallel
    @sv.walker_parallel
    def h(alpha, r):
        return alpha * r

    assert h(2.0, R).shape == R.shape

    @sv.walker_parallel
    def unmarked(alpha, r):
        return alpha * r

    with pytest.raises(sv.CallError, match="no shardvmc marker"):
        unmarked(2.0, R)


def test_complex_jtj_and_jtv_conjugate(mesh):
    rng = np.random.default_rng(0)
    j = rng.normal(size=(13, 4)) + 1j * rng.normal(size=(13, 4))
    v = rng.normal(size=13) + 1j * rng.normal(size=13)
    with jax.enable_x64(True), sv.use_mesh(mesh):
        n_pad = sv.pad_n_walkers(13, mesh.devices.size)
        jp = sv.WalkerSet(jnp.asarray(np.concatenate([j, np.full((n_pad - 13, 4), 1e3 + 1e3j)])), 13)
        vp = jnp.asarray(np.concatenate([v, np.zeros(n_pad - 13)]))
        s = sv.jtj(jp)
        g = sv.jtv(jp, vp)
        m = sv.walker_mean(jp)
    np.testing.assert_allclose(s, j.conj().T @ j, rtol=1e-12)
    np.testing.assert_allclose(g, j.conj().T @ v, rtol=1e-12)
    np.testing.assert_allclose(m, j.mean(0), rtol=1e-12)
    np.testing.assert_allclose(s, np.asarray(s).conj().T)  # Hermitian


@pytest.mark.parametrize("context", ["use_mesh", "set_mesh", "given"])
def test_replicate_needs_no_walker_axis(context):
    """Replication splits over no axis, so a mesh without a ``walkers`` axis serves, given or current."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tree = {"w": np.arange(6.0).reshape(2, 3), "b": 0.5}
    if context == "given":
        p = sv.replicate(tree, mesh)
    else:
        with sv.use_mesh(mesh) if context == "use_mesh" else jax.set_mesh(mesh):
            p = sv.replicate(tree)
    for leaf, want in ((p["w"], tree["w"]), (p["b"], tree["b"])):
        assert leaf.sharding.mesh == mesh and leaf.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(leaf), want)


def test_replicate_without_any_mesh_uses_the_default_mesh():
    p = sv.replicate(np.ones(3))
    assert p.sharding.is_fully_replicated and dict(p.sharding.mesh.shape) == {"walkers": len(jax.devices())}


# ---- one rule for meshes: placement follows the kernels under a mesh without the walker axis -----------


@pytest.fixture(params=["auto", "explicit"])
def global_mesh(request):
    """A global mesh of all devices without a ``walkers`` axis, as NetKet sets at import (Explicit: its option)."""
    kind = jax.sharding.AxisType.Explicit if request.param == "explicit" else jax.sharding.AxisType.Auto
    mesh = Mesh(np.array(jax.devices()), ("S",), axis_types=(kind,))
    jax.sharding.set_mesh(mesh)
    try:
        yield mesh
    finally:
        jax.sharding.set_mesh(None)


def test_placement_under_a_global_mesh_without_the_walker_axis_splits_over_its_axes(global_mesh, tmp_path):
    """Every placement function puts walkers where the kernels compute: split over all of the mesh's axes."""
    n = len(jax.devices())
    host = np.arange(30.0, dtype=np.float32).reshape(10, 3)
    padded = sv.pad_walker(host, sv.pad_n_walkers(10, n))[0]
    key = jax.random.key(0)
    drawn = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (3,)))(np.arange(10))
    sv.save_walkers(tmp_path / "walkers", sv.WalkerSet(padded, 10))
    like = {"w": sv.WalkerSet(padded, 10), "alpha": np.float32(0.5)}
    sv.save_state(tmp_path / "state", like)
    placed = {  # name: (walkers, the first 10 as they should be)
        "shard_walker": (sv.shard_walker(padded), host),
        "initialize_walkers_sharded, key": (sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (3,)), 10,
                                                                          key=key).data, drawn),
        "initialize_walkers_sharded, walkers": (sv.initialize_walkers_sharded(None, 10, initial_walkers=host).data,
                                                host),
        "assemble_sharded": (sv.assemble_sharded(np.split(padded, n)), host),
        "load_walkers": (sv.load_walkers(tmp_path / "walkers", padded[:1])[0].data, host),
        "load_state": (sv.load_state(tmp_path / "state", like)[0]["w"].data, host),
    }  # fmt: skip
    alpha = sv.replicate(jnp.float32(0.5))
    assert alpha.sharding.is_equivalent_to(jax.sharding.NamedSharding(global_mesh, P()), 0)
    kernel = sv.walker_parallel(energy)
    for name, (walkers, first) in placed.items():
        assert walkers.sharding.is_equivalent_to(jax.sharding.NamedSharding(global_mesh, P("S")), 2), name
        sv.testing.assert_walker_sharded(walkers)  # (the same rule)
        np.testing.assert_allclose(np.asarray(sv.slice_walkers(walkers, 0, 10)), first, rtol=1e-6, err_msg=name)
        e, mean = kernel(alpha, walkers, n_valid=10)  # the kernels take them where they are
        np.testing.assert_allclose(float(mean), 0.5 * np.mean(np.sum(np.asarray(first) ** 2, 1)), rtol=1e-5)
    # slicing and padding walkers split over the mesh's axes (JAX refuses x[:n] of Explicit ones)
    again = sv.pad_walker(sv.slice_walkers(placed["shard_walker"][0], 0, n), 2 * n)[0]
    np.testing.assert_array_equal(np.asarray(again), sv.pad_walker(padded[:n], 2 * n)[0])


def _vmc_job(steps: int) -> dict:
    """docs/vmc.md's Hooke's atom job, run as the page has it for ``steps`` steps: its namespace afterwards."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "vmc.md").read_text()
    block = re.search(r"^```python\n(.*?)^```", text, re.M | re.S).group(1)
    run, evaluation = "sv.driver.run(vmc.step, state, 100,", "vmc.expect(result.state, 50,"
    assert run in block and evaluation in block  # the job's optimisation and evaluation, shortened here
    block = block.replace(run, run.replace("100", str(steps))).replace(evaluation, evaluation.replace("50", "2"))
    namespace: dict = {"__name__": "vmc_job"}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        exec(compile(block, "docs/vmc.md", "exec"), namespace)
    return namespace


def test_the_vmc_job_runs_under_use_mesh_after_a_global_mesh_without_the_walker_axis():
    """docs/vmc.md's job under sv.use_mesh(sv.create_mesh()) after a global ("S",) mesh (NetKet's, Explicit axes):
    the same devices, so it runs on the global mesh, as without any mesh. A use_mesh of other devices cannot meet
    the global mesh inside the job's jax.jit: a CallError names both meshes and the fix."""
    expected = _vmc_job(2)
    jax.sharding.set_mesh(jax.make_mesh((len(jax.devices()),), ("S",)))  # Explicit axes
    try:
        with sv.use_mesh(sv.create_mesh()):
            got = _vmc_job(2)
        with sv.use_mesh(sv.create_mesh(jax.devices()[:2])), pytest.raises(sv.CallError) as info:
            _vmc_job(1)
    finally:
        jax.sharding.set_mesh(None)
    for a, b in zip(
        jax.tree.leaves((got["result"].state.params, got["energy"].mean)),
        jax.tree.leaves((expected["result"].state.params, expected["energy"].mean)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
    text = str(info.value)
    assert f"{{'S': {len(jax.devices())}}}" in text and "mesh of 2 devices" in text and "jax.set_mesh" in text


# ---- warnings point at the user's call, once per call ----------------------------------------------------


def test_a_padding_warning_points_at_the_users_call_once_per_call():
    """For a kernel, walker_mean, statistics, StatsAccumulator and a kernel inside the user's jax.jit: the file and
    line of the call, not the decorator's nor one of shardvmc's, and one warning per call."""
    sv.clear_caches()  # traced afresh here: a kernel warns when it traces
    x = np.ones((11, 3), np.float32)  # 11 walkers: padded on 8 devices (and 3)
    series = np.ones((11, 12), np.float32)
    accumulator = sv.StatsAccumulator.create(series[:, 0]).update(series[:, 1])

    @sv.walker_parallel
    def kernel(r: PerWalker[jax.Array]) -> Mean[jax.Array]:
        return jnp.sum(r**2)

    @sv.walker_parallel
    def traced(r: PerWalker[jax.Array]) -> Mean[jax.Array]:
        return jnp.sum(r)

    def step(r):
        return traced(r * 2.0)  # the call inside the user's jit

    in_jit = step.__code__.co_firstlineno + 1
    here = inspect.currentframe().f_lineno + 2  # the line of the first call, below
    calls = [
        (lambda: kernel(x), here),
        (lambda: sv.walker_mean(x), here + 1),
        (lambda: sv.statistics(series), here + 2),
        (lambda: accumulator.statistics(), here + 3),
        (lambda: jax.jit(step)(x), in_jit),
    ]
    for call, line in calls:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            call()
        padding = [w for w in record if issubclass(w.category, sv.PaddingWarning)]
        assert [(w.filename, w.lineno) for w in padding] == [(__file__, line)], [str(w.message) for w in padding]
