"""The blocked Cholesky solve TPUs run above 4,096 rows (tested here on the CPU) and its dispatch, against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import equations

from shardvmc import _cholesky, _natgrad


def _spd(n: int, dtype: type, seed: int) -> np.ndarray:
    """A minSR-like matrix: ``J J^H / columns`` plus a small damping (condition number about 1e3)."""
    rng = np.random.default_rng(seed)
    j = rng.normal(size=(n, 2 * n))
    if np.issubdtype(dtype, np.complexfloating):
        j = j + 1j * rng.normal(size=(n, 2 * n))
    return (j @ j.conj().T / (2 * n) + 1e-3 * np.eye(n)).astype(dtype)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    ("n", "dtype", "rhs", "block", "phases"),
    [
        (700, np.float64, (), 64, 4),  # 11 blocks in 4 phases, the last block padded by the identity
        (640, np.float64, (3,), 128, 1),  # whole blocks, one phase, three right-hand sides
        (500, np.complex128, (2,), 64, 3),  # Hermitian: the conjugates in the update and the back substitution
        (40, np.float64, (), 64, 4),  # less than one block
    ],
)
def test_blocked_factor_and_solve_match_numpy(n, dtype, rhs, block, phases):
    a = _spd(n, dtype, n)
    b = np.random.default_rng(1).normal(size=(n, *rhs)).astype(dtype)
    factor = np.asarray(_cholesky.blocked_cholesky(jnp.asarray(a), block, phases))
    size = -(-n // block) * block
    assert factor.shape == (size, size)
    np.testing.assert_allclose(factor[:n, :n], np.linalg.cholesky(a), atol=1e-13)
    np.testing.assert_array_equal(factor[n:, n:], np.eye(size - n))  # the padding stays out of the factor
    np.testing.assert_array_equal(factor[:n, n:], 0)
    x = np.asarray(_cholesky.blocked_cho_solve(jnp.asarray(factor), jnp.asarray(b), block))
    expected = np.linalg.solve(a, b)
    assert x.shape == b.shape
    np.testing.assert_allclose(x, expected, rtol=0, atol=1e-11 * np.abs(expected).max())


def test_blocked_solve_in_float32_is_as_accurate_as_xlas():
    """The TPU's float32 program (default block and phases) against XLA's Cholesky, both against float64."""
    n = 1500
    a64 = _spd(n, np.float64, 3)
    b64 = np.random.default_rng(4).normal(size=n)
    expected = np.linalg.solve(a64, b64)
    a, b = jnp.asarray(a64, jnp.float32), jnp.asarray(b64, jnp.float32)
    ours = np.linalg.norm(np.asarray(jax.jit(_cholesky._blocked_solve)(a, b)) - expected)
    xla = np.linalg.norm(np.asarray(jax.jit(_cholesky._xla_solve)(a, b)) - expected)
    assert ours <= 2 * xla + 1e-6 * np.linalg.norm(expected), (ours, xla)


def _primitives(jaxpr) -> set[str]:
    """The primitives of ``jaxpr`` and of every program inside it (loops, ``jit``), a Cholesky named by its size."""
    names = set()
    for eqn in equations(jaxpr):
        shape = getattr(eqn.invars[0].aval, "shape", ()) if eqn.invars else ()
        names.add(f"cholesky {shape[-1]}" if eqn.primitive.name == "cholesky" else eqn.primitive.name)
    return names


def _branches(n: int) -> list[set[str]]:
    """The primitives of each branch of ``spd_solve``'s platform switch at n rows (empty: no switch)."""
    spec = jax.ShapeDtypeStruct((n, n), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32)
    # minSR's solve, as sv.natural_gradient calls it (traced only: nothing of size n is computed)
    jaxpr = jax.make_jaxpr(lambda t, b: _natgrad._solve(t, 1e-3, jnp.zeros(n, bool), b, "cholesky", 0.0))(*spec)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    return [_primitives(branch.jaxpr) for c in conds for branch in c.params["branches"]]


def test_natural_gradients_solve_is_blocked_on_tpus_above_4096_rows():
    """Above 4,096 rows one branch of the switch (the TPU's) loops over blocks of 512 and has no Cholesky of the
    whole matrix, the other is XLA's; at 4,096 there is no switch, XLA's Cholesky everywhere."""
    above = _branches(4097)
    assert len(above) == 2
    loops = {"while", "scan"}  # lax.fori_loop's, by whether its trip count is static
    blocked, xla = sorted(above, key=lambda names: bool(names & loops), reverse=True)
    assert blocked & loops and "cholesky 512" in blocked and "cholesky 4097" not in blocked, blocked
    assert "cholesky 4097" in xla and not xla & loops, xla
    assert _branches(4096) == []
