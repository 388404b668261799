"""Float32 at float32's accuracy on TPUs: the replacement functions, the program rewrite, the precision policy.

The TPU branch of ``_numerics.accurate`` (the rewrite) is a plain function and is tested here on the CPU
against float64; on a TPU the accelerator set (tests/test_accelerator.py) checks the whole local energy.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import equations

import shardvmc as sv
from shardvmc import _numerics

RANGES = {
    "exp": (-87.0, 88.0, np.exp),
    "log": (None, None, np.log),  # positive numbers over 70 binades
    "tanh": (-12.0, 12.0, np.tanh),
    "expm1": (-3.0, 3.0, np.expm1),
    "log1p": (-0.99, 5.0, np.log1p),
    "logistic": (-80.0, 80.0, lambda x: 1.0 / (1.0 + np.exp(-x))),
}


@pytest.mark.parametrize("name", sorted(RANGES))
def test_the_replacement_functions_are_within_three_ulps_of_float64(name):
    """Against NumPy in float64 on float32 inputs (the TPU's own reached 67 to 4,026 ulps; see the module)."""
    lo, hi, reference = RANGES[name]
    rng = np.random.default_rng(0)
    x = np.exp(rng.uniform(-80, 80, 2**16)) if lo is None else rng.uniform(lo, hi, 2**16)
    x = np.concatenate([x, rng.uniform(-1e-3, 1e-3, 2**12)]) if name in ("expm1", "log1p", "tanh") else x
    x = x.astype(np.float32)
    ref = reference(x.astype(np.float64))
    got = np.asarray(jax.jit(getattr(_numerics, name))(x), np.float64)
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - ref) / ulp) <= 3.0


def test_special_values():
    f32 = lambda *v: jnp.asarray(v, jnp.float32)  # noqa: E731
    np.testing.assert_array_equal(_numerics.exp(f32(0.0, jnp.inf, -jnp.inf, 100.0, -200.0)), [1, np.inf, 0, np.inf, 0])
    np.testing.assert_array_equal(_numerics.log(f32(1.0, 0.0, jnp.inf)), [0, -np.inf, np.inf])
    assert np.isnan(_numerics.log(f32(-1.0))) and np.isnan(_numerics.exp(f32(jnp.nan)))
    np.testing.assert_array_equal(_numerics.tanh(f32(0.0, 30.0, -30.0)), [0, 1, -1])
    np.testing.assert_array_equal(_numerics.log1p(f32(0.0, -1.0)), [0, -np.inf])


def _network(r: jax.Array, w: jax.Array) -> jax.Array:
    """A small per-walker program with everything the rewrite touches: products, exp, log, tanh, control flow."""
    h = jnp.tanh(r.reshape(-1) @ w)
    h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ w[: h.shape[0], : h.shape[0]]) + h, h)
    orbitals = jnp.outer(h[:3], jnp.exp(-jnp.abs(r[:, 0]))) + jnp.eye(3)
    return jnp.linalg.slogdet(orbitals)[1] + jnp.log1p(jnp.sum(h**2)) + jax.nn.sigmoid(h[0])


def test_the_rewrite_replaces_transcendentals_and_raises_every_product_to_highest():
    w = jax.random.normal(jax.random.key(0), (9, 9)) / 3
    r = jax.random.normal(jax.random.key(1), (3, 3))
    rewritten = jax.make_jaxpr(_numerics._rewrite(_network))(r, w)
    eqns = equations(rewritten.jaxpr)
    names = {e.primitive.name for e in eqns}
    assert not names & {"exp", "log", "tanh", "log1p", "logistic"}, names
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2 for e in dots)
    original = jax.make_jaxpr(_network)(r, w)
    assert {"tanh", "exp", "log1p", "logistic"} <= {e.primitive.name for e in equations(original.jaxpr)}


def test_the_rewrite_computes_the_same_function_and_derivatives():
    """Value, gradient and Laplacian of the rewritten program against float64 (on the CPU: the TPU's branch)."""
    w = np.asarray(jax.random.normal(jax.random.key(0), (9, 9)) / 3)
    r = np.asarray(jax.random.normal(jax.random.key(1), (5, 3, 3)))

    def derivatives(f, x):
        g = lambda y: f(y.reshape(3, 3), w.astype(y.dtype))  # noqa: E731
        flat = x.reshape(-1)
        return g(flat), jax.grad(g)(flat), jnp.trace(jax.hessian(g)(flat))

    with jax.enable_x64(True):
        ref = jax.jit(jax.vmap(lambda x: derivatives(_network, x)))(r.astype(np.float64))
    got = jax.jit(jax.vmap(_numerics._rewrite(lambda x: derivatives(_network, x))))(r.astype(np.float32))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)


def test_accurate_is_the_function_itself_off_a_tpu():
    """On CPUs the program is the original one, bit for bit (the rewrite is the TPU branch only)."""
    w = jax.random.normal(jax.random.key(0), (9, 9)) / 3
    r = jax.random.normal(jax.random.key(1), (3, 3))
    assert float(jax.jit(_numerics.accurate(_network))(r, w)) == float(jax.jit(_network)(r, w))
    other = _numerics.accurate(_network, elsewhere=lambda r, w: _network(r, w) + 1.0)
    assert float(jax.jit(other)(r, w)) == float(jax.jit(_network)(r, w)) + 1.0


def _mesh_on(platform: str) -> object:
    """A stand-in for a mesh on another platform (only its first device's platform is read)."""
    return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)]))


def test_the_precision_policy():
    cpu = sv.precision_policy()
    assert cpu.dtype == np.float64 and cpu.platform == "cpu" and cpu.matmul_precision is None
    assert str(cpu) == "float64 on cpu (the platform has float64)"
    tpu = sv.precision_policy(mesh=_mesh_on("tpu"))
    assert tpu.dtype == np.float32 and tpu.matmul_precision == "highest"
    assert "TPUs have no float64" in str(tpu) and "'highest'" in str(tpu)
    assert sv.precision_policy("float32", mesh=_mesh_on("gpu")).matmul_precision == "highest"
    assert sv.precision_policy("float32").matmul_precision is None  # a CPU's float32 products are float32
    with pytest.raises(sv.CallError, match=r"(?s)float64.*TPU.*no float64.*dtype='auto'"):
        sv.precision_policy("float64", mesh=_mesh_on("tpu"))
    with pytest.raises(sv.CallError, match="not a precision"):
        sv.precision_policy("bfloat16")
    with sv.precision_policy("float32").context():
        assert jnp.ones(1).dtype == jnp.float32
    with tpu.context():
        assert jax.config.jax_default_matmul_precision == "highest" and jnp.ones(1).dtype == jnp.float32
    assert jax.config.jax_default_matmul_precision is None  # nothing leaks out of the block
