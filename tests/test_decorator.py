"""walker_parallel against an unsharded jax.vmap reference, on meshes of 1, 3 and 8 devices."""

import sys
import warnings

import chex
import folx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helium import PARAMS, log_psi, positions
from jax.sharding import PartitionSpec as P

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, Static, Sum, WalkerKey

WALKER = P("walkers")


@sv.walker_parallel
def stats(params: Replicated[dict], r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Mean, Sum]:
    lp = log_psi(params, r)
    return lp, {"lp": lp, "r2": jnp.sum(r**2, axis=-1)}, lp


def reference(params, r, n_valid):
    lp = jax.vmap(log_psi, (None, 0))(params, r)
    v = slice(0, n_valid)
    return lp, {"lp": lp[v].mean(), "r2": jnp.sum(r**2, axis=-1)[v].mean(axis=0)}, lp[v].sum()


def check_against_reference(out, ref, mesh, n, sharded):
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-6)
    chex.assert_trees_all_close(out[1], ref[1], rtol=1e-5)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-5)
    assert out[0].shape == (n,)
    if sharded:
        assert out[0].sharding.spec == WALKER and out[0].sharding.mesh == mesh
    for leaf in jax.tree_util.tree_leaves(out[1:]):
        assert leaf.sharding.is_fully_replicated


@pytest.mark.parametrize("n", [24, 10, 13])
def test_outputs_match_reference(mesh, n):
    r = positions(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sv.PaddingWarning)
        out = sv.walker_parallel(stats.__wrapped__, mesh=mesh)(PARAMS, r)
    check_against_reference(out, reference(PARAMS, r, n), mesh, n, sharded=n % mesh.devices.size == 0)


@pytest.mark.parametrize("n_valid", [1, 7, 24])
def test_explicit_n_valid_excludes_padding(mesh, n_valid):
    r = positions(24)
    with sv.use_mesh(mesh):
        out = stats(PARAMS, r, n_valid=n_valid)
    check_against_reference(out, reference(PARAMS, r, n_valid), mesh, 24, sharded=True)


def test_persistent_padded_set_keeps_sharding_and_statistics():
    mesh = sv.create_mesh()
    r, n = sv.pad_walker(positions(13), sv.pad_n_walkers(13, 8))
    r = sv.shard_walker(r, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PaddingWarning: the set is already padded
        out = stats(PARAMS, r, n_valid=n)
    check_against_reference(out, reference(PARAMS, np.asarray(r), n), mesh, 16, sharded=True)


def test_internal_padding_warns_once_and_points_to_pad_walker():
    f = sv.walker_parallel(stats.__wrapped__, mesh=sv.create_mesh())
    r = positions(10)
    with pytest.warns(sv.PaddingWarning, match="pad_walker") as record:
        f(PARAMS, r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(PARAMS, r)  # same shapes: compiled once, warned once
    assert len(record) == 1 and "10 walkers" in str(record[0].message)


def test_traced_n_valid_inside_jit_and_no_retrace():
    traces = []

    @sv.walker_parallel
    def e(params: Replicated, r: PerWalker) -> Mean:
        traces.append(1)
        return log_psi(params, r)

    r = positions(16)
    step = jax.jit(lambda p, r, n: e(p, r, n_valid=n))
    for n in (3, 9, 16):
        np.testing.assert_allclose(step(PARAMS, r, n), jax.vmap(log_psi, (None, 0))(PARAMS, r)[:n].mean(), rtol=1e-5)
    assert len(traces) == 1
    e(PARAMS, r)
    e(PARAMS, r)
    e(PARAMS, r, n_valid=5)
    e(PARAMS, r, n_valid=6)  # a new n_valid value is data, not a new trace
    # two programs: all walkers valid, and a traced count (the jitted step's, whose trace these calls reuse)
    assert len(traces) == 2


def test_walker_key_streams_do_not_depend_on_device_count():
    @sv.walker_parallel
    def proposal(key: WalkerKey, r: PerWalker) -> tuple[PerWalker, Mean]:
        step = jax.random.normal(key, r.shape)
        return r + step, jnp.sum(step)

    r = positions(24)
    results = []
    for d in (1, 3, 8):
        with sv.use_mesh(sv.create_mesh(jax.devices()[:d])):
            results.append([np.asarray(x) for x in proposal(jax.random.key(7), r)])
    for other in results[1:]:
        np.testing.assert_array_equal(other[0], results[0][0])
        np.testing.assert_allclose(other[1], results[0][1], rtol=1e-5)
    # walker i sees fold_in(key, i), i its global index: no two walkers share a stream
    steps = results[0][0] - np.asarray(r)
    expected = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(jax.random.key(7), i), (2, 3)))(jnp.arange(24))
    np.testing.assert_allclose(steps, expected, atol=1e-6)


def test_raw_uint32_key_is_accepted():
    @sv.walker_parallel
    def u(key: WalkerKey, r: PerWalker) -> PerWalker:
        return jax.random.uniform(key)

    out = u(jax.random.PRNGKey(3), positions(8))
    ref = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(3), i)))(jnp.arange(8))
    np.testing.assert_array_equal(out, ref)


def test_gradient_through_mean_matches_unsharded(mesh):
    @sv.walker_parallel(mesh=mesh)
    def mean_log_psi(params: Replicated, r: PerWalker) -> Mean:
        return log_psi(params, r)

    r = positions(21)

    def ref(p):
        return jnp.mean(jax.vmap(log_psi, (None, 0))(p, r[:17]))

    g = jax.grad(lambda p: mean_log_psi(p, r, n_valid=17))(PARAMS)
    chex.assert_trees_all_close(g, jax.grad(ref)(PARAMS), rtol=1e-5)
    v, g2 = jax.jit(jax.value_and_grad(lambda p: mean_log_psi(p, r, n_valid=17)))(PARAMS)
    chex.assert_trees_all_close(g2, jax.grad(ref)(PARAMS), rtol=1e-5)
    np.testing.assert_allclose(v, ref(PARAMS), rtol=1e-6)


def test_per_walker_gradient_inside_body_is_the_walkers_own(mesh):
    @sv.walker_parallel(mesh=mesh)
    def jacobian_row(params: Replicated, r: PerWalker) -> PerWalker:
        return jax.grad(log_psi)(params, r)

    r = positions(24)
    out = jacobian_row(PARAMS, r)
    ref = jax.vmap(jax.grad(log_psi), (None, 0))(PARAMS, r)
    chex.assert_trees_all_close(out, ref, rtol=1e-5, atol=1e-6)
    assert out["alpha"].sharding.spec == WALKER


def local_energy(params, r):
    """Kinetic (folx forward Laplacian) plus Coulomb energy of helium for one walker."""
    f = folx.forward_laplacian(lambda x: log_psi(params, x.reshape(2, 3)))
    out = f(r.reshape(-1))
    kinetic = -0.5 * (out.laplacian + jnp.sum(out.jacobian.dense_array**2))
    d = jnp.linalg.norm(r, axis=-1)
    return kinetic - 2 * jnp.sum(1 / d) + 1 / jnp.linalg.norm(r[0] - r[1])


def reference_energy(params, r):
    def lp(x):
        return log_psi(params, x.reshape(2, 3))

    x = r.reshape(-1)
    kinetic = -0.5 * (jnp.trace(jax.hessian(lp)(x)) + jnp.sum(jax.grad(lp)(x) ** 2))
    d = jnp.linalg.norm(r, axis=-1)
    return kinetic - 2 * jnp.sum(1 / d) + 1 / jnp.linalg.norm(r[0] - r[1])


@pytest.mark.parametrize("batch_size", [None, 5])
def test_folx_kernel_with_batch_size(mesh, batch_size):
    kernel = sv.walker_parallel(mesh=mesh, batch_size=batch_size)(local_energy_annotated)
    r = positions(24)
    e, e_mean = kernel(PARAMS, r)
    ref = jax.vmap(reference_energy, (None, 0))(PARAMS, r)
    np.testing.assert_allclose(e, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(e_mean, ref.mean(), rtol=1e-4)
    assert e.sharding.spec == WALKER


def local_energy_annotated(params: Replicated, r: PerWalker) -> tuple[PerWalker, Mean]:
    e = local_energy(params, r)
    return e, e


def test_batch_size_bounds_the_vmapped_block():
    """With batch_size=k the per-device computation maps k walkers at a time (a scan over chunks)."""
    mesh = sv.create_mesh(jax.devices()[:2])
    r = positions(64)
    text = sv.walker_parallel(mesh=mesh, batch_size=4)(local_energy_annotated).lower(PARAMS, r).as_text()
    plain = sv.walker_parallel(mesh=mesh)(local_energy_annotated).lower(PARAMS, r).as_text()
    assert "while" in text and "while" not in plain
    assert "tensor<4x6xf32>" in text or "tensor<4x2x3xf32>" in text


def test_batched_mode(mesh):
    @sv.walker_parallel(mesh=mesh, batched=True)
    def block(params: Replicated, r: PerWalker, key: WalkerKey) -> tuple[PerWalker, Mean, Sum]:
        lp = jax.vmap(log_psi, (None, 0))(params, r)
        noise = jax.vmap(jax.random.uniform)(key)
        return lp + noise, lp, noise

    r = positions(24)
    key = jax.random.key(5)
    out, mean, total = block(PARAMS, r, key, n_valid=20)
    noise = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(jnp.arange(24))
    lp = jax.vmap(log_psi, (None, 0))(PARAMS, r)
    np.testing.assert_allclose(out, lp + noise, rtol=1e-6)
    np.testing.assert_allclose(mean, lp[:20].mean(), rtol=1e-5)
    np.testing.assert_allclose(total, noise[:20].sum(), rtol=1e-5)
    assert out.sharding.spec == WALKER


def test_batched_mode_checks_block_outputs():
    @sv.walker_parallel(batched=True)
    def wrong(r: PerWalker) -> Mean:
        return jnp.sum(r)  # reduced the block itself: no walker axis left

    with pytest.raises(sv.CallError, match="batched=True") as err:
        wrong(positions(8))
    assert "wrong" in str(err.value)


def test_static_arguments_compile_in():
    traces = []

    @sv.walker_parallel
    def power(r: PerWalker, k: Static[int], scale: Replicated) -> PerWalker:
        traces.append(k)
        return scale * jnp.sum(r**k)

    r = positions(8)
    np.testing.assert_allclose(power(r, 2, 1.0), jnp.sum(r**2, axis=(1, 2)), rtol=1e-6)
    np.testing.assert_allclose(power(r, k=3, scale=2.0), 2 * jnp.sum(r**3, axis=(1, 2)), rtol=1e-5)
    power(r, 2, 3.0)
    assert traces == [2, 3]


def test_replicated_args_below_and_above(mesh):
    def third_party(params, r):
        return log_psi(params, r)

    below = sv.walker_parallel(mesh=mesh)(sv.replicated_args("params")(third_party))

    @sv.replicated_args("params")
    @sv.walker_parallel(mesh=mesh)
    def above(params, r):
        return log_psi(params, r)

    r = positions(24)
    ref = jax.vmap(log_psi, (None, 0))(PARAMS, r)
    for f in (below, above):
        np.testing.assert_allclose(f(PARAMS, r), ref, rtol=1e-6)
        assert [p.kind for p in f.layout.params] == [sv._markers.Kind.REPLICATED, sv._markers.Kind.PER_WALKER]
    assert below.__wrapped__ is third_party
    # the original is untouched: no annotations or attributes were written onto it
    assert third_party.__annotations__ == {} and not hasattr(third_party, "__wrapped__")


def test_nested_call_is_the_plain_per_walker_function():
    @sv.walker_parallel
    def inner(params: Replicated, r: PerWalker) -> PerWalker:
        return log_psi(params, r)

    @sv.walker_parallel
    def outer(params: Replicated, r: PerWalker) -> Mean:
        return 2 * inner(params, r)  # one walker here: no nested shard_map

    r = positions(16)
    np.testing.assert_allclose(outer(PARAMS, r), 2 * jax.vmap(log_psi, (None, 0))(PARAMS, r).mean(), rtol=1e-5)


def test_works_inside_jit_and_exposes_lower_and_wrapped():
    r = sv.shard_walker(positions(16), sv.create_mesh())
    out = jax.jit(lambda p, r: stats(p, r)[1]["lp"])(PARAMS, r)
    np.testing.assert_allclose(out, jax.vmap(log_psi, (None, 0))(PARAMS, r).mean(), rtol=1e-5)
    assert isinstance(stats.lower(PARAMS, r), jax.stages.Lowered)
    assert stats.__name__ == "stats" and stats.__wrapped__.__name__ == "stats"


def _engine_calls(call):
    """The names of the shardvmc functions Python enters during ``call()``."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and "/shardvmc/" in frame.f_code.co_filename.replace("\\", "/"):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    return out, seen


def test_a_repeated_call_is_dispatched_by_jax_jit_without_the_plan_lookup():
    kernel = sv.walker_parallel(stats.__wrapped__, mesh=sv.create_mesh())
    r = sv.shard_walker(positions(16), sv.create_mesh())
    first, _ = _engine_calls(lambda: kernel(PARAMS, r))  # traced and compiled: the plan path, inside jax.jit
    again, seen = _engine_calls(lambda: kernel(PARAMS, r))
    assert "_prepare" not in seen and len(seen) <= 4, seen
    chex.assert_trees_all_equal(again, first)
    check_against_reference(again, reference(PARAMS, r, 16), sv.create_mesh(), 16, sharded=True)
    # keyword arguments are bound to the same positions: the same path and program, no new plan
    bound, seen = _engine_calls(lambda: kernel(PARAMS, r=r))
    assert "_prepare" not in seen, seen
    chex.assert_trees_all_equal(bound, first)
    # an int n_valid= is traced: one program for every count, checked in Python before the call
    kernel(PARAMS, r, n_valid=9)
    for n_valid in (9, 3):
        out, seen = _engine_calls(lambda: kernel(PARAMS, r, n_valid=n_valid))
        assert "_prepare" not in seen, seen
        check_against_reference(out, reference(PARAMS, r, n_valid), sv.create_mesh(), 16, sharded=True)
    for bad in (0, 17):
        with pytest.raises(sv.CallError, match=f"n_valid={bad} is outside 1..16"):
            kernel(PARAMS, r, n_valid=bad)
    with pytest.raises(sv.CallError, match="disagrees with the count"):
        kernel(PARAMS, sv.WalkerSet(r, 12), n_valid=9)


def test_arguments_jax_jit_refuses_run_on_the_plan_path():
    @sv.walker_parallel
    def scaled(model: Replicated, r: PerWalker) -> Mean:
        return model["act"](model["a"] * jnp.sum(r**2))

    model = {"a": jnp.float32(0.5), "act": jnp.tanh}  # a function: compiled in, which jax.jit cannot take
    r = positions(16)
    expected = jnp.mean(jax.vmap(lambda x: jnp.tanh(0.5 * jnp.sum(x**2)))(r))
    for _ in range(2):
        np.testing.assert_allclose(scaled(model, r), expected, rtol=1e-6)
    with pytest.raises(sv.CallError, match="unhashable"):  # a fresh kernel: from its fast path
        scaled.with_options()({"a": jnp.float32(0.5), "act": jnp.tanh, "bad": bytearray(b"x")}, r)


def test_mesh_is_resolved_at_call_time():
    @sv.walker_parallel
    def f(r: PerWalker) -> PerWalker:
        return jnp.sum(r)

    r = positions(12)
    with sv.use_mesh(sv.create_mesh(jax.devices()[:3])):
        assert f(r).sharding.mesh.devices.size == 3
    assert f(positions(16)).sharding.mesh.devices.size == 8
    explicit = sv.walker_parallel(f.__wrapped__, mesh=sv.create_mesh(jax.devices()[:2]))
    with sv.use_mesh(sv.create_mesh(jax.devices()[:3])):
        assert explicit(r).sharding.mesh.devices.size == 2


def test_pytree_outputs_under_one_marker():
    @sv.walker_parallel
    def f(r: PerWalker) -> Sum:
        return {"a": r, "n": jnp.ones((), jnp.int32), "flag": jnp.sum(r) > 0}

    r = positions(16)
    out = f(r, n_valid=11)
    np.testing.assert_allclose(out["a"], r[:11].sum(0), rtol=1e-5)
    assert int(out["n"]) == 11
    assert int(out["flag"]) == int(jnp.sum(jnp.sum(r[:11], axis=(1, 2)) > 0))


def test_methods_bind():
    class Model:
        def __init__(self, scale):
            self.scale = scale

        @sv.walker_parallel
        def energy(self: Static, r: PerWalker) -> Mean:
            return self.scale * jnp.sum(r**2)

        def __hash__(self):
            return hash(self.scale)

        def __eq__(self, other):
            return isinstance(other, Model) and other.scale == self.scale

    r = positions(8)
    np.testing.assert_allclose(Model(2.0).energy(r), 2 * jnp.mean(jnp.sum(r**2, axis=(1, 2))), rtol=1e-5)


def hlo_collectives(text):
    return {op: text.count(op + "(") + text.count(op + "-start(") for op in
            ("all-gather", "all-reduce", "all-to-all", "collective-permute")}  # fmt: skip


def test_compiled_communication():
    mesh = sv.create_mesh()
    r = sv.shard_walker(positions(64), mesh)
    params = sv.replicate(PARAMS, mesh)

    def compiled(kind):
        def f(params: Replicated, r: PerWalker):
            lp = log_psi(params, r)
            return lp if kind is None else (lp, {"a": lp, "b": 2 * lp})

        if kind is not None:
            f.__annotations__["return"] = tuple[PerWalker, kind]
        return hlo_collectives(sv.walker_parallel(f).lower(params, r).compile().as_text())

    assert compiled(None) == {"all-gather": 0, "all-reduce": 0, "all-to-all": 0, "collective-permute": 0}
    for kind in (Mean, Sum):
        counts = compiled(kind)
        assert counts["all-reduce"] >= 1
        assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0
