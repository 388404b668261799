"""Determinants of the small matrices of the field, fast on every platform: ``slogdet``.

A FermiNet- or PsiFormer-style wavefunction takes the ``slogdet`` of one ``n x n`` orbital
matrix per spin and determinant, ``n`` the electrons of a spin (up to 16 for the
molecules such networks are trained on). ``jnp.linalg.slogdet`` factorises each by LU,
which on a TPU runs one tiny matrix after another: 54 ms for 65,536 matrices of 3 x 3 on
a TPU v5e, 132 ms at 8 x 8, and the inverse that derivatives need costs as much again
(``benchmarks/RESULTS.md``). :func:`slogdet` eliminates all matrices of a batch at once
(Gauss-Jordan elimination with partial pivoting, a loop over the ``n`` columns: only
elementwise arithmetic over the batch): 0.8 ms at 3 x 3, 1.7 ms at 8 x 8 there. Its
derivatives use ``d log|det A| = tr(A^-1 dA)`` with ``A^-1`` from the same elimination,
and folx's forward Laplacian takes the same route (a rule registered with folx).

On CPUs and GPUs the values and the inverse come from ``jnp.linalg`` (LAPACK and cuSOLVER
are fast there), chosen where the program is compiled (``jax.lax.platform_dependent``).
Matrices larger than 16 x 16 and complex ones go to ``jnp.linalg.slogdet`` everywhere.
"""

from __future__ import annotations

import folx
import jax
import jax.numpy as jnp
from folx.api import FwdJacobian, FwdLaplArray

__all__ = ["MAX_UNROLLED", "slogdet"]

MAX_UNROLLED = 16
"""The largest ``n`` whose determinant is eliminated column by column (beyond it: ``jnp.linalg.slogdet``)."""


def _eliminate(a: jax.Array, inverse: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(sign, log|det a|, a^-1 or None)`` of real ``(..., n, n)`` matrices, by elimination with partial pivoting.

    Each column is one step over the whole batch: pick the largest pivot at or below the
    diagonal, swap it up, eliminate (below the pivot for the determinant; above too, on
    ``[a | I]``, for the inverse). A singular matrix gives ``log|det| = -inf``. The columns
    are a ``fori_loop``: the program does not grow with ``n`` (unrolled, the local energy of
    30 electrons compiled its 15 steps per determinant, with their derivatives, one by one). A 1 x 1 or 2 x 2
    matrix takes the closed form instead (``_closed_form``): the loop's steps cost more than the arithmetic there.
    """
    n = a.shape[-1]
    if n <= 2:
        return _closed_form(a, inverse)
    m = jnp.concatenate([a, jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape)], axis=-1) if inverse else a
    rows = jnp.arange(n)

    def column(k: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, sign, logdet = carry
        is_k = (rows == k)[:, None]
        below = jnp.where(rows >= k, jnp.abs(jax.lax.dynamic_index_in_dim(m, k, axis=-1, keepdims=False)), -1.0)
        p = jnp.argmax(below, axis=-1)
        at_p = (rows == p[..., None])[..., :, None]
        pivot_row = jnp.sum(jnp.where(at_p, m, 0.0), axis=-2, keepdims=True)  # (..., 1, n or 2n)
        m = jnp.where(is_k, pivot_row, jnp.where(at_p, jax.lax.dynamic_slice_in_dim(m, k, 1, axis=-2), m))
        sign = jnp.where(p != k, -sign, sign)  # a row swap flips the sign
        pivot = jax.lax.dynamic_index_in_dim(pivot_row[..., 0, :], k, axis=-1, keepdims=False)
        col_k = jax.lax.dynamic_slice_in_dim(m, k, 1, axis=-1)  # (..., n, 1), after the swap
        if inverse:
            row = pivot_row / pivot[..., None, None]
            m = jnp.where(is_k, row, m - jnp.where(is_k, 0.0, col_k) * row)
        else:
            m = m - jnp.where(rows[:, None] > k, col_k / pivot[..., None, None], 0.0) * pivot_row
        return m, sign * jnp.sign(pivot), logdet + jnp.log(jnp.abs(pivot))

    init = (m, jnp.ones(a.shape[:-2], a.dtype), jnp.zeros(a.shape[:-2], a.dtype))
    m, sign, logdet = jax.lax.fori_loop(0, n, column, init)
    return sign, logdet, (m[..., n:] if inverse else None)


def _closed_form(a: jax.Array, inverse: bool) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``_eliminate`` of ``1 x 1`` and ``2 x 2`` matrices: ``det = ps - qr``, ``a^-1 = [[s, -q], [-r, p]] / det``.

    No loop, no pivot search: on a TPU v5e (4,096 walkers, 2026-12-07) the templates' Be local energy (2 x 2
    matrices for both spins) took 0.72 of its time with the loop, Li (2 x 2 and 1 x 1) 0.87.
    """
    if a.shape[-1] == 1:
        x = a[..., 0, 0]
        return jnp.sign(x), jnp.log(jnp.abs(x)), (1.0 / a if inverse else None)
    p, q, r, s = a[..., 0, 0], a[..., 0, 1], a[..., 1, 0], a[..., 1, 1]
    det = p * s - q * r
    inv = jnp.stack([jnp.stack([s, -q], -1), jnp.stack([-r, p], -1)], -2) / det[..., None, None] if inverse else None
    return jnp.sign(det), jnp.log(jnp.abs(det)), inv


def _slogdet_values(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    def eliminated(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        sign, logdet, _ = _eliminate(a, inverse=False)
        return sign, logdet

    return jax.lax.platform_dependent(a, tpu=eliminated, default=lambda a: tuple(jnp.linalg.slogdet(a)))


def _values_and_inverse(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sign, log|det a|, a^-1)``: on a TPU from one elimination (no derivative rules: folx's rule needs none)."""

    def by_jnp(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        sign, logdet = jnp.linalg.slogdet(a)
        return sign, logdet, jnp.linalg.inv(a)

    def eliminated(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        sign, logdet, inverse = _eliminate(a, inverse=True)
        assert inverse is not None
        return sign, logdet, inverse

    return jax.lax.platform_dependent(a, tpu=eliminated, default=by_jnp)


def _eliminated_inverse(a: jax.Array) -> jax.Array:
    inverse = _eliminate(a, inverse=True)[2]
    assert inverse is not None
    return inverse


@jax.custom_jvp
def _inverse(a: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(a, tpu=_eliminated_inverse, default=jnp.linalg.inv)


@_inverse.defjvp
def _inverse_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    (a,), (da,) = primals, tangents
    a_inv = _inverse(a)
    return a_inv, -a_inv @ da @ a_inv


@jax.custom_jvp
def _slogdet(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _slogdet_values(a)


@_slogdet.defjvp
def _slogdet_jvp(
    primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    (a,), (da,) = primals, tangents
    sign, logdet = _slogdet(a)
    return (sign, logdet), (jnp.zeros_like(sign), jnp.einsum("...ji,...ij->...", _inverse(a), da))


def shardvmc_slogdet(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The one entry folx sees (a ``jit`` by this name) and replaces by :func:`_forward_laplacian`."""
    return _slogdet(a)


_FOLX_NAME = shardvmc_slogdet.__name__
shardvmc_slogdet = jax.jit(shardvmc_slogdet)


def slogdet(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sign, log|det a|)`` of square matrices ``a`` (``(..., n, n)``), fast for small ``n`` on every platform.

    Equals ``jnp.linalg.slogdet(a)`` to round-off, with the same derivatives (``grad``,
    ``jvp``, the Laplacians of ``sv.hamiltonian`` and folx's forward Laplacian); see the
    module for how.

    Args:
        a: real or complex matrices, batch axes first.

    Returns:
        ``(sign, logabsdet)``, each of shape ``a.shape[:-2]``.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> sign, logdet = sv.linalg.slogdet(jnp.array([[2.0, 1.0], [1.0, 3.0]]))
        >>> float(sign), round(float(jnp.exp(logdet)), 5)
        (1.0, 5.0)
    """
    a = jnp.asarray(a)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] > MAX_UNROLLED or jnp.iscomplexobj(a):
        return tuple(jnp.linalg.slogdet(a))  # type: ignore[return-value]  # (jnp's own errors for non-square input)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.result_type(float))
    return shardvmc_slogdet(a)


MAX_BROADCAST = 4
"""The largest ``n`` whose forward-Laplacian products (``M_c = A^-1 dA/dx_c`` and its traces) are broadcast
products and sums rather than ``einsum``'s matrix products. A TPU lays a matrix product's operands out with
the two matrix axes innermost, padded to tiles of 8 x 128 (or 2 x 128): for 2 x 2 matrices those products
and the layout copies around them took about half of the 1.15 ms a TPU v5e spent on the templates' Li local
energy (4,096 walkers, 2026-12-07); as broadcast products the compiler puts the walkers innermost, and the
whole local energy ran 1.20 ms a call instead of 1.87 (wall clock, 3.4 M walker evaluations a second)."""


def _forward_laplacian(args: tuple, kwargs: dict, sparsity_threshold: int) -> tuple:
    """folx's rule for :func:`slogdet`: ``d_c log|det A| = tr(M_c)``, ``lap = tr(A^-1 lap A) - sum_c tr(M_c M_c)``.

    ``M_c = A^-1 dA/dx_c``, with ``A^-1`` from the same elimination as the values (the dense form of folx's own
    rule).
    """
    a = args[0]
    if not isinstance(a, FwdLaplArray):
        return _slogdet(a)
    sign, logdet, a_inv = _values_and_inverse(a.x)
    jac = a.jacobian.dense_array
    if a.x.shape[-1] <= MAX_BROADCAST:
        m = jnp.sum(a_inv[..., :, :, None] * jac[..., None, :, :], axis=-2)
        jacobian = jnp.trace(m, axis1=-2, axis2=-1)
        laplacian = jnp.sum(jnp.swapaxes(a_inv, -1, -2) * a.laplacian, axis=(-2, -1))
        laplacian = laplacian - jnp.sum(m * jnp.swapaxes(m, -1, -2), axis=(0, -2, -1))
    else:
        m = jnp.einsum("...ij,k...jl->k...il", a_inv, jac)
        jacobian = jnp.einsum("k...ii->k...", m)
        laplacian = jnp.einsum("...ji,...ij->...", a_inv, a.laplacian) - jnp.einsum("k...ij,k...ji->...", m, m)
    return sign, FwdLaplArray(logdet, FwdJacobian.from_dense(jacobian), laplacian)


folx.register_function(_FOLX_NAME, _forward_laplacian)
