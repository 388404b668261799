"""Reductions over the valid walkers, outside kernels: one local product and one all-reduce each.

Each reduction is a ``batched=True`` kernel of the one engine, whose block function
calls the same :func:`~shardvmc._stats.reduce_blocks` as ``Mean``/``Sum`` outputs and
:data:`~shardvmc.all_walkers` do: padding, masking and the all-reduce live there once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ._caches import bounded
from ._decorator import WalkerParallel, kernel_of
from ._errors import CallError, message
from ._kernel import Options
from ._markers import Kind, Layout, Param
from ._stats import all_walkers, current_body, reduce_blocks, rmatvec
from ._walkerset import WalkerSet

__all__ = ["jtj", "jtv", "walker_mean", "walker_sum"]


@bounded(64)
def _kernel(block: Callable[..., Any], names: tuple[str, ...], where: str) -> Callable[..., Any]:
    """The reduction ``block(*blocks)`` as a kernel ``(mesh, axis_name) -> WalkerParallel``."""
    signature = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])
    layout = Layout(tuple(Param(n, Kind.PER_WALKER) for n in names), Kind.REPLICATED, signature)

    @bounded(16)
    def on(mesh: Mesh | None, axis_name: str | tuple[str, ...]) -> WalkerParallel:
        options = Options(axis_name=axis_name, batched=True)
        return kernel_of(block, layout, mesh=mesh, options=options, qualname=where)

    return on


def _reduce(
    where: str,
    block: Callable[..., Any],
    names: tuple[str, ...],
    args: tuple[Any, ...],
    n_valid: Any,
    mesh: Any,
    axis_name: Any,
) -> Any:
    return _kernel(block, names, where)(mesh, axis_name)(*args, n_valid=n_valid)


def _sum_block(x: Any) -> Any:
    return all_walkers.sum(x)


def _mean_block(x: Any) -> Any:
    return all_walkers.mean(x)


def _valid_products(local: Callable[..., Any]) -> Callable[..., Any]:
    """A block function: ``local`` of this device's valid rows, summed over devices."""

    def block(*blocks: Any) -> Any:
        body = current_body()
        assert body is not None  # a block function of this module runs only as the body of its kernel
        return reduce_blocks(local, blocks, body.valid, body.axes)

    return block


def _jtj_local(jac: jax.Array) -> jax.Array:
    return gram_of_rows(jac.T)


def gram_of_rows(t: jax.Array) -> jax.Array:
    """``conj(t) @ t.T`` (``J^H J`` for ``t = J.T``), from the blocks on and above the diagonal only.

    A matrix product does not know that its result is Hermitian and XLA has no ``syrk``: for
    256 rows or more, 4 row blocks take 10 of the 16 block products; the blocks below the
    diagonal are the conjugate transposes of those above. The rows of ``t`` are the columns
    of ``J``: a product over the contiguous axis of both operands is the layout CPUs multiply
    fastest (a third faster than over the leading axis of ``J``). The products run at
    ``HIGHEST`` whatever the caller's default: a TPU's (one bfloat16 pass) leaves a Gram
    matrix 1e-3 off, which a covariance (a difference of such sums) or a damped solve cannot afford.
    """
    p = t.shape[0]
    k = 4 if p >= 256 else 2 if p >= 128 else 1
    b = -(-p // k)
    rows = [t[i * b : (i + 1) * b] for i in range(k)]  # the last one shorter
    highest = jax.lax.Precision.HIGHEST
    upper = {(a, c): jnp.matmul(jnp.conj(rows[a]), rows[c].T, precision=highest) for a in range(k) for c in range(a, k)}
    return jnp.block([[upper[a, c] if a <= c else jnp.conj(upper[c, a]).T for c in range(k)] for a in range(k)])


def _jtv_local(jac: jax.Array, v: jax.Array) -> jax.Array:
    return rmatvec(jac, v)


_JTJ = _valid_products(_jtj_local)
_JTV = _valid_products(_jtv_local)


def walker_sum(x: Any, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers") -> Any:
    """Sum of a sharded per-walker pytree over its valid walkers, replicated everywhere.

    One local sum per device and one all-reduce; nothing is gathered.

    Args:
        x: a pytree whose leaves have the walker axis first.
        n_valid: the number of real walkers (the first ones); ``None``: all.
        mesh: the mesh; defaults to the ``use_mesh`` one, else all devices.
        axis_name: the walker axis of ``mesh``.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> float(sv.walker_sum(jnp.arange(8.0), n_valid=3))
        3.0
    """
    return _reduce("walker_sum", _sum_block, ("x",), (x,), n_valid, mesh, axis_name)


def walker_mean(x: Any, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers") -> Any:
    """Mean of a sharded per-walker pytree over its valid walkers, replicated everywhere.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> float(sv.walker_mean(jnp.arange(8.0), n_valid=3))
        1.0
    """
    return _reduce("walker_mean", _mean_block, ("x",), (x,), n_valid, mesh, axis_name)


def jtj(jac: jax.Array, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers") -> jax.Array:
    """``J^H J`` summed over the valid walkers, for ``J`` of shape ``(n_walkers, P)``.

    ``J^H`` is the conjugate transpose, so the result is the Hermitian SR matrix for a
    complex log-psi (and ``J^T J`` for a real one). ``J`` may be a :class:`WalkerSet`,
    whose count is used. The curvature of stochastic reconfiguration and Gauss-Newton (divide by the walker
    count for the mean, and centre ``J`` first for the covariance). Each device
    multiplies its own rows and one all-reduce adds the ``(P, P)`` results: ``J`` is
    never gathered.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> sv.jtj(jnp.ones((8, 2))).tolist()
        [[8.0, 8.0], [8.0, 8.0]]
    """
    _check_rank("jtj", "J", jac, 2, "(n_walkers, P): flatten the parameters, e.g. with jax.flatten_util.ravel_pytree")
    return _reduce("jtj", _JTJ, ("J",), (jac,), n_valid, mesh, axis_name)


def jtv(
    jac: jax.Array, v: jax.Array, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers"
) -> jax.Array:
    """``J^H v`` over the valid walkers, for ``J`` of shape ``(n_walkers, P)`` and ``v`` of ``(n_walkers,)``.

    ``J^H`` is the conjugate transpose (``J^T`` for real ``J``); ``J`` and ``v`` may be
    :class:`WalkerSet` objects. The energy gradient of VMC is ``2 jtv(J - mean J, E_loc - mean E) / n``.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> sv.jtv(jnp.ones((8, 2)), jnp.arange(8.0)).tolist()
        [28.0, 28.0]
    """
    _check_rank("jtv", "J", jac, 2, "(n_walkers, P): flatten the parameters, e.g. with jax.flatten_util.ravel_pytree")
    _check_rank("jtv", "v", v, 1, "(n_walkers,): one value per walker")
    return _reduce("jtv", _JTV, ("J", "v"), (jac, v), n_valid, mesh, axis_name)


def _check_rank(where: str, name: str, x: Any, ndim: int, expected: str) -> None:
    x = x.data if isinstance(x, WalkerSet) else x
    if jnp.ndim(x) != ndim:
        raise CallError(
            message(
                where,
                f"{name} has {jnp.ndim(x)} dimensions, not {ndim}.",
                got=f"shape {jnp.shape(x)}",
                expected=f"shape {expected}",
            )
        )
