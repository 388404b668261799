"""The user's own errors surface as themselves, and no path returns a wrong number without a word.

Each test here failed on shardvmc 0.2.0 (issue 17 names the measurements).
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, Sum, WalkerKey

# ---- 1. the user's own error, under every transform ----------------------------------------------


@sv.walker_parallel
def shape_bug(theta: Replicated[jax.Array], r: PerWalker[jax.Array]) -> Mean[jax.Array]:
    return jnp.dot(r, theta)  # (3,) . (5,): the user's bug


THETA, R16 = jnp.ones(5), jnp.ones((16, 3))


@pytest.mark.parametrize(
    "call",
    [
        lambda: shape_bug(THETA, R16),
        lambda: jax.jit(shape_bug)(THETA, R16),
        lambda: jax.grad(shape_bug)(THETA, R16),
        lambda: jax.jit(jax.value_and_grad(shape_bug))(THETA, R16),
        lambda: jax.jit(lambda t, r: shape_bug(t, sv.WalkerSet(r, 13)))(THETA, R16),
    ],
    ids=["eager", "jit", "grad", "jit-value_and_grad", "jit-walker_set"],
)
def test_a_shape_bug_in_the_body_surfaces_as_jax_reports_it(call):
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions") as err:
        call()
    assert not isinstance(err.value, sv.ShardvmcError)
    notes = "\n".join(getattr(err.value, "__notes__", []))
    # The context shardvmc adds: the kernel, and what its body saw for ONE walker.
    assert "shape_bug" in notes and "one walker" in notes and "r: float32[3]" in notes and "theta: float32[5]" in notes


def test_an_argument_on_other_devices_is_still_named():
    """The error path still explains JAX refusing the arguments, from concrete arguments only."""
    mesh = sv.create_mesh(jax.devices()[:2])
    elsewhere = jax.device_put(jnp.float32(1.0), jax.devices()[5])
    with pytest.raises(sv.CallError, match=r"(?s)Replicated parameter 'theta'.*other devices"):
        sv.walker_parallel(shape_bug.__wrapped__, mesh=mesh)(elsewhere, jnp.ones((4, 5)))


# ---- 2. Explicit meshes with a walker count they do not divide -------------------------------------


@pytest.mark.filterwarnings("ignore::shardvmc.PaddingWarning")
@pytest.mark.parametrize("how", ["set_mesh", "mesh="])
def test_explicit_mesh_with_an_uneven_count(how):
    mesh = jax.make_mesh((8,), ("walkers",))  # Explicit axes: jax.make_mesh's default
    x = np.arange(13 * 3, dtype=np.float32).reshape(13, 3) / 10
    v = np.arange(13, dtype=np.float32)

    def e(r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
        return jnp.sum(r**2), jnp.sum(r**2)

    kernel = sv.walker_parallel(e, mesh=mesh) if how == "mesh=" else sv.walker_parallel(e)
    options = {"mesh": mesh} if how == "mesh=" else {}
    with jax.set_mesh(mesh) if how == "set_mesh" else _nothing():
        per, mean = kernel(x)
        results = {
            "walker_mean": sv.walker_mean(x, **options),
            "walker_sum": sv.walker_sum(x, **options),
            "jtj": sv.jtj(x, **options),
            "jtv": sv.jtv(x, v, **options),
            "shard_vmap": sv.shard_vmap(lambda r: jnp.sum(r), mesh=mesh if options else None)(x),
            "jit": jax.jit(kernel)(x)[1],
        }
    np.testing.assert_allclose(per, np.sum(x**2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(mean, np.mean(np.sum(x**2, axis=1)), rtol=1e-6)
    np.testing.assert_allclose(results["walker_mean"], x.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(results["walker_sum"], x.sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(results["jtj"], x.T @ x, rtol=1e-5)
    np.testing.assert_allclose(results["jtv"], x.T @ v, rtol=1e-5)
    np.testing.assert_allclose(results["shard_vmap"], x.sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(results["jit"], mean, rtol=1e-6)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- 3. walker sets whose count no longer fits -----------------------------------------------------


def _sliced() -> sv.WalkerSet:
    return jax.tree.map(lambda a: a[:8], sv.WalkerSet(jnp.arange(16.0), 13))  # keeps n_valid=13


@sv.walker_parallel
def identity_mean(r: PerWalker[jax.Array]) -> Mean[jax.Array]:
    return r


@pytest.mark.parametrize(
    "entry",
    [
        lambda w: identity_mean(w),
        lambda w: sv.walker_mean(w),
        lambda w: sv.walker_sum(w),
        lambda w: sv.jtj(jax.tree.map(lambda a: a[:, None], w)),
        lambda w: sv.natural_gradient(jax.tree.map(lambda a: a[:, None], w), w, damping=1e-3),
        lambda w: sv.gather_walkers(w),
    ],
    ids=["kernel", "walker_mean", "walker_sum", "jtj", "natural_gradient", "gather_walkers"],
)
def test_every_entry_point_refuses_a_count_that_does_not_fit(entry):
    with pytest.raises(sv.CallError, match=r"(?s)n_valid=13 but holds 8 walkers.*walkers\[a:b\]"):
        entry(_sliced())


def test_walker_sets_refuse_leaves_of_different_walker_counts():
    with pytest.raises(sv.CallError, match=r"(?s)different numbers of walkers.*\['a'\] has 8.*\['b'\] has 7"):
        sv.WalkerSet({"a": jnp.ones((8, 3)), "b": jnp.ones((7, 3))}, 5)


def test_slices_concatenations_and_splits_keep_the_count_right():
    x = jnp.arange(16.0)
    walkers = sv.WalkerSet(x, 13)
    head, tail = walkers[:8], walkers[8:]
    assert (head.n_walkers, head.n_valid, tail.n_walkers, tail.n_valid) == (8, 8, 8, 5)
    assert float(sv.walker_mean(head)) == 3.5  # 0.2.0 gave 2.154 for the tree.map slice
    assert float(sv.walker_mean(tail)) == float(np.mean(np.arange(8, 13)))
    both = sv.WalkerSet.concatenate([sv.WalkerSet(x[:8]), sv.WalkerSet(x[8:])])
    assert both.n_valid == 16  # 0.2.0's tree.map concatenation kept n_valid=8
    joined = sv.WalkerSet.concatenate([walkers, sv.WalkerSet(jnp.arange(100.0, 104.0), 2)])
    np.testing.assert_array_equal(joined.data[: joined.n_valid], np.r_[np.arange(13.0), 100, 101])
    assert float(sv.walker_mean(joined)) == pytest.approx(np.mean(np.r_[np.arange(13.0), 100, 101]))
    parts = walkers.split([4, 9])
    assert [(p.n_walkers, p.n_valid) for p in parts] == [(4, 4), (9, 9)]
    np.testing.assert_array_equal(np.concatenate([p.data for p in parts]), np.arange(13.0))
    np.testing.assert_array_equal(walkers.valid().data, np.arange(13.0))
    padded = parts[1].pad_to(16)
    assert (padded.n_walkers, padded.n_valid) == (16, 9) and float(sv.walker_mean(padded)) == 8.0
    with pytest.raises(sv.CallError, match="no real walker"):
        walkers[13:]
    with pytest.raises(sv.CallError, match="add up"):
        walkers.split([4, 4])


# ---- 4. a device-local value marked Replicated -----------------------------------------------------


def test_a_device_local_replicated_output_is_refused_at_trace_time():
    @sv.walker_parallel(batched=True)
    def local_sum(r: PerWalker[jax.Array]) -> Replicated[jax.Array]:
        return r.sum()  # this device's block only

    with pytest.raises(sv.CallError, match=r"(?s)the return is marked Replicated, but it differs between devices"):
        local_sum(jnp.arange(16.0))
    with pytest.raises(sv.CallError, match="differs between devices"):
        jax.jit(local_sum)(jnp.arange(16.0))


def test_a_replicated_output_from_all_walkers_passes():
    @sv.walker_parallel(batched=True)
    def total(r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Replicated[jax.Array]]:
        return r, sv.all_walkers.sum(r)

    assert float(total(jnp.arange(16.0))[1]) == 120.0
    assert float(total(sv.WalkerSet(jnp.arange(16.0), 10))[1]) == 45.0


def _laplacian_block(local: bool) -> sv.WalkerParallel:
    """A jvp-of-grad Laplacian (linearize + fori_loop), which JAX's varying-axes check rejects."""

    def laplacian(x: jax.Array) -> jax.Array:
        _, hessian_vp = jax.linearize(jax.grad(lambda y: jnp.sum(jnp.tanh(y)) ** 2), x)
        eye = jnp.eye(x.size)
        return jax.lax.fori_loop(0, x.size, lambda i, acc: acc + hessian_vp(eye[i])[i], 0.0)

    def block(r: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Replicated[jax.Array]]:
        lap = jax.vmap(laplacian)(r)
        return lap, (jnp.sum(lap) if local else sv.all_walkers.sum(lap))

    return sv.walker_parallel(block, batched=True)


def test_when_jax_cannot_tell_the_values_are_compared_at_the_first_call():
    """A body that does not trace under JAX's varying-axes check: the bits are compared across devices."""
    r = jax.random.normal(jax.random.key(0), (16, 3))
    good = _laplacian_block(local=False)
    lap, total = good(r)
    np.testing.assert_allclose(total, np.sum(lap), rtol=1e-5)
    plan, _, _ = good._plan_for(r)
    assert plan.replicated_check == "values"
    with pytest.raises(sv.CallError, match=r"return\[1\] is marked Replicated, but it differs between devices"):
        _laplacian_block(local=True)(r)

    # Inside another jit nothing can be raised from the program: the call's outputs come out as NaN.
    traced = jax.jit(_laplacian_block(local=True))(r)
    assert np.isnan(np.asarray(traced[1])) and np.isnan(np.asarray(traced[0])).all()
    np.testing.assert_allclose(jax.jit(good)(r)[1], total, rtol=1e-6)  # a replicated one passes


# ---- 6. one all-reduce for Mean/Sum outputs of every dtype ----------------------------------------


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_mixed_dtypes_take_one_all_reduce(x64):
    with jax.enable_x64(x64):

        @sv.walker_parallel
        def step(r: PerWalker[jax.Array]) -> tuple[Mean[jax.Array], Sum[jax.Array], Sum[jax.Array]]:
            accepted = (r[0] > 0).astype(jnp.int32)
            return jnp.sum(r**2), accepted, jnp.asarray(2**20, jnp.int32) + accepted  # sums past float32's 2**24

        r = jax.random.normal(jax.random.key(1), (64, 3))
        explanation = step.explain(sv.WalkerSet(r, 61))
        assert explanation.collectives == {"all-reduce": 1}
        e, accepted, big = step(sv.WalkerSet(r, 61))
        host = np.asarray(r)[:61]
        np.testing.assert_allclose(e, np.mean(np.sum(host**2, axis=1)), rtol=1e-5)
        assert jnp.issubdtype(accepted.dtype, jnp.integer) and int(accepted) == int(np.sum(host[:, 0] > 0))
        assert int(big) == 61 * 2**20 + int(np.sum(host[:, 0] > 0))  # exact, not rounded


def test_complex_means_in_the_same_all_reduce():
    @sv.walker_parallel
    def m(r: PerWalker[jax.Array]) -> tuple[Mean[jax.Array], Mean[jax.Array]]:
        return jnp.exp(1j * r[0]), r[1]

    r = jax.random.normal(jax.random.key(2), (24, 2))
    assert m.explain(r).collectives == {"all-reduce": 1}
    z, y = m(r)
    np.testing.assert_allclose(z, np.mean(np.exp(1j * np.asarray(r)[:, 0])), rtol=1e-5)
    np.testing.assert_allclose(y, np.mean(np.asarray(r)[:, 1]), rtol=1e-5)


# ---- 7. keys -------------------------------------------------------------------------------------


@sv.walker_parallel
def draw(key: WalkerKey, r: PerWalker[jax.Array]) -> PerWalker[jax.Array]:
    return jax.random.normal(key, (2,))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_keys_whose_draws_depend_on_the_batch_are_refused(impl):
    with pytest.raises(sv.CallError, match=rf"(?s)WalkerKey parameter 'key' is a key of the {impl}.*threefry"):
        draw(jax.random.key(4, impl=impl), jnp.zeros((6, 1)))


def test_a_raw_key_of_the_wrong_shape_is_a_call_error():
    with pytest.raises(sv.CallError, match=r"(?s)WalkerKey parameter 'key' is not a single PRNG key.*uint32\[3\]"):
        draw(jnp.zeros(3, jnp.uint32), jnp.zeros((6, 1)))


# ---- 11. aliasing and caches -----------------------------------------------------------------------


def test_replicate_never_shares_the_callers_buffer():
    x = jnp.arange(3.0)
    for mesh in (sv.create_mesh(jax.devices()[:1]), sv.create_mesh()):
        placed = sv.replicate(x, mesh)
        jax.jit(lambda p: p * 2, donate_argnums=0)(placed)  # a step that donates its parameters
        np.testing.assert_array_equal(x, [0.0, 1.0, 2.0])  # the caller's array is alive


def test_initialisation_kernels_do_not_outlive_their_function():
    def init(k):
        return jax.random.normal(k, (2, 3))

    probe = weakref.ref(init)
    sv.initialize_walkers_sharded(init, 8, key=jax.random.key(0))
    a = sv.initialize_walkers_sharded(init, 8, key=jax.random.key(0))  # the same function: the cached kernel
    np.testing.assert_array_equal(a.data, sv.initialize_walkers_sharded(init, 8, key=jax.random.key(0)).data)
    del init
    gc.collect()
    assert probe() is None


def test_explain_reports_the_chunk_that_ran():
    @sv.walker_parallel(batch_size="auto", memory_budget=1 << 40)
    def e(r: PerWalker[jax.Array]) -> Mean[jax.Array]:
        return jnp.sum(r**2)

    for walkers in (sv.WalkerSet(jnp.ones((16, 3)), 11), jnp.ones((16, 3))):
        e(walkers)
        plan, _, _ = e._plan_for(walkers)
        assert e.explain(walkers).batch_size == plan.batch_size
    assert len(e.chosen_batch_sizes) == 1  # one argument signature: the two counts share one abstract shape
