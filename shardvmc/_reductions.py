"""Reductions over the valid walkers: inside kernels (``Mean``/``Sum``) and outside them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from . import _compat
from ._errors import CallError, message
from ._mesh import resolve_mesh
from ._placement import leading_size, pad_n_walkers, pad_walker

__all__ = ["jtj", "jtv", "local_valid_mask", "masked_sum", "mean_of", "walker_mean", "walker_sum"]


def local_valid_mask(axis_name: str, n_local: int, n_valid: Any) -> jax.Array:
    """Inside ``shard_map``: which of this device's ``n_local`` walkers are valid.

    Walker ``j`` of device ``d`` has global index ``d * n_local + j``; it is valid when
    that index is below ``n_valid``.
    """
    first = jax.lax.axis_index(axis_name) * n_local
    return first + jnp.arange(n_local) < n_valid


def masked_sum(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Sum over axis 0 of the rows where ``mask`` holds (``None``: all rows).

    ``where`` rather than a product, so a NaN in a padding walker cannot leak in.
    """
    return jnp.sum(_masked(x, mask), axis=0)


def mean_of(total: Any, count: Any) -> Any:
    """``total / count`` leaf by leaf; integer and boolean sums become the default float."""

    def divide(t: jax.Array) -> jax.Array:
        dtype = t.dtype if jnp.issubdtype(t.dtype, jnp.inexact) else jnp.result_type(float)
        return t.astype(dtype) / count

    return jax.tree_util.tree_map(divide, total)


@functools.cache
def _reducer(local: Callable[..., Any], mesh: Mesh, axis_name: str, n_args: int, mean: bool) -> Callable[..., Any]:
    """A jitted ``psum`` of ``local(mask, *shards)`` over the valid walkers."""
    size = _compat.axis_size(mesh, axis_name)
    spec = PartitionSpec(axis_name)

    def run(args: tuple[Any, ...], n_valid: Any) -> Any:
        n = jax.tree_util.tree_leaves(args[0])[0].shape[0]
        args = tuple(pad_walker(a, pad_n_walkers(n, size))[0] for a in args)
        n_local = pad_n_walkers(n, size) // size
        count = n if n_valid is None else n_valid

        def body(shards: tuple[Any, ...], count: Any) -> Any:
            mask = None if (n_valid is None and n_local * size == n) else local_valid_mask(axis_name, n_local, count)
            return jax.tree_util.tree_map(lambda y: jax.lax.psum(y, axis_name), local(mask, *shards))

        total = _compat.shard_map(body, mesh, in_specs=((spec,) * n_args, PartitionSpec()), out_specs=PartitionSpec())(
            args, jnp.asarray(count)
        )
        if mean:
            total = mean_of(total, count)
        return total

    return jax.jit(run)


def _reduce(
    where: str,
    local: Callable[..., Any],
    args: tuple[Any, ...],
    n_valid: Any,
    mesh: Mesh | None,
    axis_name: str,
    mean: bool = False,
) -> Any:
    mesh = resolve_mesh(mesh, axis_name, where=where)
    sizes = [leading_size(a, where, f"argument {i}") for i, a in enumerate(args)]
    if len(set(sizes)) > 1:
        raise CallError(message(where, "the arguments hold different numbers of walkers.", got=str(sizes)))
    check_n_valid(where, n_valid, sizes[0])
    return _reducer(local, mesh, axis_name, len(args), mean)(args, n_valid)


def check_n_valid(where: str, n_valid: Any, n_walkers: int) -> None:
    """Raise ``CallError`` unless ``n_valid`` is ``None``, traced, or in ``1..n_walkers``."""
    if n_walkers < 1:
        raise CallError(
            message(where, "there are no walkers (the walker axis has size 0).", fix="pass at least one walker.")
        )
    if n_valid is None or isinstance(n_valid, jax.core.Tracer):
        return
    dtype = getattr(n_valid, "dtype", None)
    integral = isinstance(n_valid, int) if dtype is None else jnp.issubdtype(dtype, jnp.integer)
    if isinstance(n_valid, bool) or not integral or getattr(n_valid, "shape", ()) != ():
        raise CallError(
            message(
                where,
                "n_valid must be one integer, the number of real walkers.",
                got=f"{type(n_valid).__name__} {dtype or ''}{list(getattr(n_valid, 'shape', ()))}",
                fix="pass a Python int or an integer scalar array (the count returned by sv.pad_walker).",
            )
        )
    value = int(n_valid)
    if not 1 <= value <= n_walkers:
        raise CallError(
            message(
                where,
                f"n_valid={value} is outside 1..{n_walkers}, the number of walkers passed.",
                fix="pass the count returned by sv.pad_walker (the real walkers come first), or omit n_valid.",
            )
        )


def _sum_local(mask: Any, x: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: masked_sum(leaf, mask), x)


def _jtj_local(mask: Any, jac: jax.Array) -> jax.Array:
    rows = _masked(jac, mask)  # both factors: 0 * inf in a padding row would be NaN
    return rows.T @ rows


def _jtv_local(mask: Any, jac: jax.Array, v: jax.Array) -> jax.Array:
    return _masked(jac, mask).T @ _masked(v, mask)


def _masked(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Zero the rows of ``x`` where ``mask`` is false (``None``: keep all)."""
    if mask is None:
        return x
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


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
    return _reduce("walker_sum", _sum_local, (x,), n_valid, mesh, axis_name)


def walker_mean(x: Any, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers") -> Any:
    """Mean of a sharded per-walker pytree over its valid walkers, replicated everywhere.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> float(sv.walker_mean(jnp.arange(8.0), n_valid=3))
        1.0
    """
    return _reduce("walker_mean", _sum_local, (x,), n_valid, mesh, axis_name, mean=True)


def jtj(jac: jax.Array, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers") -> jax.Array:
    """``J^T J`` summed over the valid walkers, for ``J`` of shape ``(n_walkers, P)``.

    The curvature of stochastic reconfiguration and Gauss-Newton (divide by the walker
    count for the mean, and centre ``J`` first for the covariance). Each device
    multiplies its own rows and one all-reduce adds the ``(P, P)`` results: ``J`` is
    never gathered.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> sv.jtj(jnp.ones((8, 2))).tolist()
        [[8.0, 8.0], [8.0, 8.0]]
    """
    _check_rank("jtj", "J", jac, 2, "(n_walkers, P): flatten the parameters, e.g. with jax.flatten_util.ravel_pytree")
    return _reduce("jtj", _jtj_local, (jac,), n_valid, mesh, axis_name)


def jtv(
    jac: jax.Array, v: jax.Array, n_valid: Any = None, *, mesh: Mesh | None = None, axis_name: str = "walkers"
) -> jax.Array:
    """``J^T v`` over the valid walkers, for ``J`` of shape ``(n_walkers, P)`` and ``v`` of ``(n_walkers,)``.

    The energy gradient of VMC is ``2 jtv(J - mean J, E_loc - mean E) / n``.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> sv.jtv(jnp.ones((8, 2)), jnp.arange(8.0)).tolist()
        [28.0, 28.0]
    """
    _check_rank("jtv", "J", jac, 2, "(n_walkers, P): flatten the parameters, e.g. with jax.flatten_util.ravel_pytree")
    _check_rank("jtv", "v", v, 1, "(n_walkers,): one value per walker")
    return _reduce("jtv", _jtv_local, (jac, v), n_valid, mesh, axis_name)


def _check_rank(where: str, name: str, x: Any, ndim: int, expected: str) -> None:
    if jnp.ndim(x) != ndim:
        raise CallError(
            message(
                where,
                f"{name} has {jnp.ndim(x)} dimensions, not {ndim}.",
                got=f"shape {jnp.shape(x)}",
                expected=f"shape {expected}",
            )
        )
