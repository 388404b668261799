"""``sv.linalg.slogdet``: the elimination a TPU runs (tested here directly) and the public function, against NumPy."""

from __future__ import annotations

import folx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc.linalg import _eliminate

pytestmark = pytest.mark.usefixtures("x64")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 16])
def test_the_elimination_gives_numpys_determinant_and_inverse(n):
    """The TPU's branch, on the CPU: sign, log|det| and the inverse of random and of pivot-needing matrices."""
    rng = np.random.default_rng(n)
    a = rng.normal(size=(20, n, n))
    if n > 1:
        a[0, 0, 0] = 0.0  # no pivot in the first column's first row: a row swap is needed
        a[1] = a[1][::-1]  # a permuted matrix
    sign, logdet, inverse = _eliminate(jnp.asarray(a), inverse=True)
    sign2, logdet2, _ = _eliminate(jnp.asarray(a), inverse=False)
    ref_sign, ref_logdet = np.linalg.slogdet(a)
    np.testing.assert_array_equal(np.asarray(sign), ref_sign)
    np.testing.assert_array_equal(np.asarray(sign2), ref_sign)
    np.testing.assert_allclose(np.asarray(logdet), ref_logdet, atol=1e-11)
    np.testing.assert_allclose(np.asarray(logdet2), ref_logdet, atol=1e-11)
    np.testing.assert_allclose(np.asarray(inverse), np.linalg.inv(a), atol=1e-8, rtol=1e-8)


def test_a_singular_matrix_has_minus_infinite_log_determinant():
    a = jnp.asarray([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]])
    assert float(_eliminate(a, inverse=False)[1]) == -np.inf
    assert float(sv.linalg.slogdet(a)[1]) == -np.inf


@pytest.mark.parametrize("n", [2, 3, 6])
def test_derivatives_match_jnp_linalg(n):
    """Gradient, Hessian trace and folx's forward Laplacian through ``sv.linalg.slogdet``, against ``jnp.linalg``."""
    rng = np.random.default_rng(n)
    w, b = jnp.asarray(rng.normal(size=(n * n, 5))), jnp.asarray(rng.normal(size=(n * n,)))

    def f(det, x):
        return det(jnp.tanh(w @ x + b).reshape(n, n))[1]

    x = jnp.asarray(rng.normal(size=5))
    ours, theirs = (lambda x: f(sv.linalg.slogdet, x)), (lambda x: f(jnp.linalg.slogdet, x))
    np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(theirs)(x), atol=1e-12)
    lap = jnp.trace(jax.hessian(theirs)(x))
    assert abs(float(jnp.trace(jax.hessian(ours)(x)) - lap)) < 1e-9
    out = folx.forward_laplacian(ours)(x)
    assert abs(float(out.laplacian - lap)) < 1e-9
    np.testing.assert_allclose(out.jacobian.dense_array, jax.grad(theirs)(x), atol=1e-12)


def test_batches_large_and_complex_matrices():
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.normal(size=(2, 3, 4, 4)))
    np.testing.assert_allclose(sv.linalg.slogdet(batch)[1], np.linalg.slogdet(np.asarray(batch))[1], atol=1e-12)
    big = jnp.asarray(rng.normal(size=(17, 17)))  # beyond MAX_UNROLLED: jnp.linalg.slogdet
    np.testing.assert_allclose(sv.linalg.slogdet(big)[1], np.linalg.slogdet(np.asarray(big))[1], atol=1e-12)
    z = jnp.asarray(rng.normal(size=(3, 3)) + 1j * rng.normal(size=(3, 3)))
    sign, logdet = sv.linalg.slogdet(z)
    ref_sign, ref_logdet = np.linalg.slogdet(np.asarray(z))
    np.testing.assert_allclose(complex(sign), ref_sign, atol=1e-12)
    np.testing.assert_allclose(float(logdet), ref_logdet, atol=1e-12)
    assert sv.linalg.slogdet(jnp.eye(3, dtype=jnp.int32))[1] == 0.0
