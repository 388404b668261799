"""``A^-1 b`` for Hermitian positive definite ``A`` by Cholesky, in a program whose size does not grow with ``A``.

On TPUs XLA expands its Cholesky and triangular-solve operations into programs that grow with
the matrix, and compiling them grows faster still. Measured on a TPU v5e (float32, ``"highest"``
products, factor and solve of one right-hand side; ``benchmarks/RESULTS.md``, "On a TPU"): 6.8 s
to compile at n = 2,048, 17.6 s at 4,096, 51.7 s at 8,192 and more than 150 s at 16,384 (then
1-14 ms to run). minSR's N x N matrix has one row per walker, so a 16,384-walker step spent minutes
compiling.

:func:`spd_solve` factors by blocks of columns inside ``lax.fori_loop``: the compiled program is the
same size for every n (13.6 s to compile at 16,384, 258 ms to run), and the work is matrix products,
which TPUs do fast. Each loop iteration updates the whole trailing matrix (a loop cannot change
shapes), so the columns are taken in phases, each working on its own, smaller trailing matrix
(one phase: 5.9 s to compile, 511 ms to run; two: 9.3 s, 331 ms). CPUs and GPUs (LAPACK, cuSOLVER)
and matrices of at most 4,096 rows, where XLA's compiles as fast and runs faster (3.2 ms against
6.5 ms at 4,096), keep XLA's Cholesky (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["blocked_cho_solve", "blocked_cholesky", "spd_solve"]

_BLOCK = 512  # columns per loop iteration: 512 ran 1.4x faster than 256 at n = 16,384 on the TPU
_PHASES = 4  # trailing matrices of n, 3n/4, n/2 and n/4: half the products of one loop over the whole matrix
_HIGHEST = lax.Precision.HIGHEST
_XLA_ROWS = 4096  # at most this many rows, XLA's Cholesky on TPUs too


def _factor_columns(a: jax.Array, count: int, block: int) -> jax.Array:
    """The first ``count`` column blocks of ``a``'s factor; the rest of ``a`` becomes their Schur complement."""
    rows = jnp.arange(a.shape[0])

    def step(k: jax.Array, a: jax.Array) -> jax.Array:
        start = k * block
        panel = lax.dynamic_slice_in_dim(a, start, block, axis=1)
        diagonal = jnp.linalg.cholesky(lax.dynamic_slice_in_dim(panel, start, block, axis=0))
        below = rows[:, None] >= start + block
        solved = lax.linalg.triangular_solve(
            diagonal, panel, left_side=False, lower=True, transpose_a=True, conjugate_a=True
        )
        under = jnp.where(below, solved, jnp.zeros((), a.dtype))
        a = a - jnp.matmul(under, jnp.conj(under).T, precision=_HIGHEST)
        column = lax.dynamic_update_slice_in_dim(under, diagonal, start, axis=0)
        return lax.dynamic_update_slice_in_dim(a, column, start, axis=1)

    return lax.fori_loop(0, count, step, a)


def _padded(a: jax.Array, size: int) -> jax.Array:
    """``a`` bordered by the identity up to ``size`` rows: its factor is ``a``'s bordered the same way."""
    extra = size - a.shape[0]
    if not extra:
        return a
    return jnp.pad(a, ((0, extra), (0, extra))) + jnp.diag((jnp.arange(size) >= a.shape[0]).astype(a.dtype))


def blocked_cholesky(a: jax.Array, block: int = _BLOCK, phases: int = _PHASES) -> jax.Array:
    """The lower Cholesky factor of ``a`` (n x n), padded to whole blocks of ``block`` columns."""
    blocks = -(-a.shape[0] // block)
    a = _padded(a, blocks * block)
    bounds = sorted({round(q * blocks / phases) for q in range(phases + 1)})
    for first, last in zip(bounds, bounds[1:], strict=False):
        start = first * block  # the columns before are final; this phase works on the trailing matrix only
        a = a.at[start:, start:].set(_factor_columns(a[start:, start:], last - first, block))
    return jnp.tril(a)


def blocked_cho_solve(factor: jax.Array, b: jax.Array, block: int = _BLOCK) -> jax.Array:
    """``(L L^H)^-1 b`` from :func:`blocked_cholesky`'s padded ``L``, by blocks of rows."""
    n, size = b.shape[0], factor.shape[0]
    y = jnp.pad(b.reshape(n, -1), ((0, size - n), (0, 0)))
    rows = jnp.arange(size)[:, None]
    blocks = size // block

    def substitute(triangle: jax.Array, lower: bool, rhs: jax.Array) -> jax.Array:
        def step(i: jax.Array, x: jax.Array) -> jax.Array:
            start = (i if lower else blocks - 1 - i) * block
            band = lax.dynamic_slice_in_dim(triangle, start, block, axis=0)
            known = rows < start if lower else rows >= start + block
            r = lax.dynamic_slice_in_dim(rhs, start, block, axis=0)
            r = r - jnp.matmul(band, jnp.where(known, x, jnp.zeros((), x.dtype)), precision=_HIGHEST)
            diagonal = lax.dynamic_slice_in_dim(band, start, block, axis=1)
            solved = lax.linalg.triangular_solve(diagonal, r, left_side=True, lower=lower)
            return lax.dynamic_update_slice_in_dim(x, solved, start, axis=0)

        return lax.fori_loop(0, blocks, step, jnp.zeros_like(rhs))

    z = substitute(factor, True, y)
    x = substitute(jnp.conj(factor).T, False, z)
    return x[:n].reshape(b.shape)


def _blocked_solve(a: jax.Array, b: jax.Array) -> jax.Array:
    return blocked_cho_solve(blocked_cholesky(a), b)


def _xla_solve(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(a), True), b)


def spd_solve(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a^-1 b`` for Hermitian positive definite ``a`` (n x n) and ``b`` (n,) or (n, k), by Cholesky.

    Blocked (:func:`blocked_cholesky`) on TPUs above 4,096 rows; XLA's Cholesky elsewhere.
    """
    if a.shape[0] <= _XLA_ROWS:
        return _xla_solve(a, b)
    return lax.platform_dependent(a, b, tpu=_blocked_solve, default=_xla_solve)
