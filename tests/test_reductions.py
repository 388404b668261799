"""Reductions outside kernels: values over the valid walkers, replicated; J is never gathered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv


def jacobian(n, p=5, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, p))


@pytest.mark.parametrize(("n", "n_valid"), [(24, None), (24, 17), (13, None), (13, 4)])
def test_values_match_numpy(mesh, n, n_valid):
    jac = jacobian(n)
    v = jax.random.normal(jax.random.key(1), (n,))
    k = n if n_valid is None else n_valid
    J, V = np.asarray(jac, np.float64)[:k], np.asarray(v, np.float64)[:k]
    with sv.use_mesh(mesh):
        if n % mesh.devices.size == 0:
            jac, v = sv.shard_walker((jac, v))
        results = {
            "mean": sv.walker_mean({"j": jac, "v": v}, n_valid),
            "sum": sv.walker_sum(v, n_valid),
            "jtj": sv.jtj(jac, n_valid),
            "jtv": sv.jtv(jac, v, n_valid),
        }
    np.testing.assert_allclose(results["mean"]["j"], J.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["mean"]["v"], V.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["sum"], V.sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results["jtj"], J.T @ J, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results["jtv"], J.T @ V, rtol=1e-5, atol=1e-5)
    for leaf in jax.tree_util.tree_leaves(results):
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.mesh == mesh


@pytest.mark.parametrize("p", [130, 301])  # 2 and 4 blocks of rows in the Gram product, the last one short
@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
def test_jtj_of_many_parameters_matches_numpy(mesh, p, complex_):
    rng = np.random.default_rng(p)
    j = rng.normal(size=(24, p)) + (1j * rng.normal(size=(24, p)) if complex_ else 0)
    with jax.enable_x64(True), sv.use_mesh(mesh):
        out = sv.jtj(sv.shard_walker(jnp.asarray(j)), 19)
    np.testing.assert_allclose(out, j[:19].conj().T @ j[:19], rtol=1e-12, atol=1e-12)
    assert out.shape == (p, p) and out.sharding.is_fully_replicated


def test_products_at_full_precision(mesh):
    """jtj and jtv multiply at HIGHEST whatever the caller's default (a TPU's is one bfloat16 pass).

    At one pass the docs' covariance ``jtj / n - outer(mean, mean)`` came out 4e-2 off on a TPU.
    """
    from jaxprs import equations

    jac, v = jacobian(301), jax.random.normal(jax.random.key(1), (301,))
    for fn, args in ((sv.jtj, (jac,)), (sv.jtv, (jac, v))):
        with jax.default_matmul_precision("bfloat16"), sv.use_mesh(mesh):
            traced = jax.make_jaxpr(fn)(*args)
        dots = [q for q in equations(traced.jaxpr) if q.primitive.name == "dot_general"]
        assert dots and all(q.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2 for q in dots), fn


def test_mean_of_integers_is_float():
    out = sv.walker_mean(jnp.arange(8, dtype=jnp.int32), 3)
    assert jnp.issubdtype(out.dtype, jnp.floating) and float(out) == 1.0


def test_padding_nan_never_enters():
    x = jnp.ones(16).at[12:].set(jnp.nan)
    assert float(sv.walker_sum(x, 12)) == 12.0
    jac = jnp.ones((16, 2)).at[12:].set(jnp.inf)
    np.testing.assert_array_equal(sv.jtj(jac, 12), np.full((2, 2), 12.0))


def test_one_local_product_and_one_all_reduce():
    mesh = sv.create_mesh()
    jac = sv.shard_walker(jacobian(64, 7), mesh)
    v = sv.shard_walker(jnp.ones(64), mesh)
    for text in (
        jax.jit(lambda j: sv.jtj(j)).lower(jac).compile().as_text(),
        jax.jit(lambda j, v: sv.jtv(j, v, 50)).lower(jac, v).compile().as_text(),
    ):
        assert "all-gather" not in text and "all-to-all" not in text and "collective-permute" not in text
        assert text.count("all-reduce(") + text.count("all-reduce-start(") == 1
        # the all-reduce moves the (P, P) or (P,) result, never the (n, P) Jacobian
        assert "f32[64,7]{1,0} all-reduce" not in text


def test_errors():
    with pytest.raises(sv.CallError, match="different walker counts"):
        sv.jtv(jnp.ones((8, 2)), jnp.ones(6))
    with pytest.raises(sv.CallError, match="n_valid=9 is outside 1..8"):
        sv.walker_mean(jnp.ones(8), 9)
    with pytest.raises(sv.CallError, match="J has 1 dimensions, not 2") as err:
        sv.jtj(jnp.ones(8))
    assert "ravel_pytree" in str(err.value)
    with pytest.raises(sv.CallError, match="v has 2 dimensions, not 1"):
        sv.jtv(jnp.ones((8, 2)), jnp.ones((8, 1)))
    with pytest.raises(sv.CallError, match="holds zero walkers"):
        sv.walker_sum(jnp.ones((0, 2)))
