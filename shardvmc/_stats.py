"""Statistics over the valid walkers of all devices, from inside a kernel's body.

The engine publishes, while it traces a body, where the body runs: the axes that hold
the walkers (the named ``vmap`` axis of a per-walker body, and the mesh axes), which
walkers are valid, and the valid count. :data:`all_walkers` reads it; the engine's own
``Mean``/``Sum`` outputs and the reductions (``walker_mean``, ``jtj``, ...) use the same
two functions, :func:`masked` and :func:`reduce_blocks`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import CallError, message

__all__ = [
    "BODY_VAR",
    "Body",
    "all_walkers",
    "body_context",
    "current_body",
    "local_indices",
    "masked",
    "mean_of",
    "psum_tree",
    "reduce_blocks",
    "rmatvec",
    "row_sum",
]

Mode = Literal["walker", "block", "chunk"]


@dataclasses.dataclass(frozen=True)
class Body:
    """Where a kernel body runs, as the engine tells it to the statistics.

    Attributes:
        mode: ``"walker"`` (vmapped: the body sees one walker), ``"block"``
            (``batched=True``: the body sees this device's block of walkers) or
            ``"chunk"`` (``batch_size=``: chunks that cannot see each other).
        axes: the axes to sum over: the named vmap axis (walker mode) and the mesh axes.
        valid: whether this walker is valid (walker mode, a scalar) or which rows of the
            block are (block mode, a vector); ``None`` when every walker is (no padding).
        count: the number of valid walkers of all devices.
    """

    mode: Mode
    axes: tuple[str, ...]
    valid: Any
    count: Any


_BODY: contextvars.ContextVar[Body | None] = contextvars.ContextVar("shardvmc_body", default=None)


BODY_VAR = _BODY
"""The context variable of the body being traced (read directly on the kernels' per-call path)."""


def current_body() -> Body | None:
    """The body being traced, or ``None`` outside every kernel."""
    return _BODY.get()


@contextlib.contextmanager
def body_context(body: Body) -> Iterator[None]:
    """Publish ``body`` while a kernel body is traced."""
    token = _BODY.set(body)
    try:
        yield
    finally:
        _BODY.reset(token)


def local_indices(axes: str | tuple[str, ...], n_local: int) -> jax.Array:
    """Inside ``shard_map``: the global walker indices of this device's ``n_local`` walkers.

    Walker ``j`` of the device at position ``d`` along ``axes`` is walker ``d * n_local + j``;
    it is valid when that index is below the valid count.
    """
    return jax.lax.axis_index(axes) * n_local + jnp.arange(n_local)


def rmatvec(jac: jax.Array, v: jax.Array) -> jax.Array:
    """``jac^H v`` without forming the conjugate transpose of ``jac`` (no copy of the rows), at ``HIGHEST``.

    Gradients and SR's right-hand sides are such sums; a TPU's default precision (one
    bfloat16 pass) would leave them 1e-3 off.
    """
    return jnp.conj(jnp.matmul(jnp.conj(v), jac, precision=jax.lax.Precision.HIGHEST))


def masked(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Zero the rows of ``x`` where ``mask`` is false (``None``: keep all).

    ``where`` rather than a product, so a NaN or inf in a padding walker cannot leak in.
    """
    if mask is None:
        return x
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x, jnp.zeros((), x.dtype))


def reduce_blocks(local: Callable[..., Any], blocks: tuple[Any, ...], mask: Any, axes: tuple[str, ...]) -> Any:
    """``psum`` over ``axes`` of ``local(*blocks)`` with the invalid rows of every block zeroed.

    Every walker statistic of shardvmc is this: one local product of this device's valid
    rows and one all-reduce (:func:`psum_tree`).
    """
    rows = tuple(jax.tree_util.tree_map(lambda x: masked(x, mask), b) for b in blocks)
    return psum_tree(local(*rows), axes)


# Beyond this many devices, two 16-bit halves of an int32 no longer add up exactly in float32
# (a sum of D halves needs 16 + log2(D) bits of float32's 24-bit significand).
_MAX_DEVICES_FOR_HALVES = 256


def psum_tree(tree: Any, axes: tuple[str, ...]) -> Any:
    """``psum`` of every leaf of ``tree`` over ``axes`` in ONE all-reduce, whatever the dtypes.

    JAX gives each dtype its own all-reduce; a step that reduces a float energy and an
    integer acceptance count would pay two latencies. The leaves are packed into one
    real buffer of the widest float present (at least float32; float64 when integers
    meet x64), summed, and unpacked. Integers travel exactly: as float64 while sums stay
    below 2**53, else as two 16-bit halves in float32, exact up to 256 devices (beyond,
    integer leaves get their own all-reduce). Complex leaves travel as real and
    imaginary parts.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if len(leaves) <= 1 or jax.lax.axis_size(axes) == 1:  # nothing to pack (on one device, not even copies)
        return jax.tree_util.tree_map(lambda y: jax.lax.psum(y, axes), tree)
    if len({jnp.result_type(x) for x in leaves}) == 1:
        return jax.tree_util.tree_unflatten(treedef, _psum_same(leaves, axes))
    floats = [jnp.finfo(x.dtype).dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    has_ints = len(floats) < len(leaves)
    buffer = jnp.result_type(jnp.float32, *floats)
    if has_ints and jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64:  # x64 on
        buffer = jnp.dtype(jnp.float64)
    halves = has_ints and buffer != jnp.float64
    if halves and jax.lax.axis_size(axes) > _MAX_DEVICES_FOR_HALVES:
        ints = [i for i, x in enumerate(leaves) if not jnp.issubdtype(x.dtype, jnp.inexact)]
        rest = [i for i in range(len(leaves)) if i not in ints]
        out = list(leaves)
        for group in (ints, rest):
            for i, y in zip(group, psum_tree([leaves[i] for i in group], axes)):
                out[i] = y
        return jax.tree_util.tree_unflatten(treedef, out)
    parts = [_encode(x, buffer, halves) for x in leaves]
    total = jax.lax.psum(jnp.concatenate([p.reshape(-1) for p in parts]), axes)
    out, start = [], 0
    for x, p in zip(leaves, parts):
        out.append(_decode(total[start : start + p.size].reshape(p.shape), x, halves))
        start += p.size
    return jax.tree_util.tree_unflatten(treedef, out)


def _psum_same(leaves: list[Any], axes: tuple[str, ...]) -> list[Any]:
    """One all-reduce of leaves of one dtype: flattened, joined, summed and cut apart again."""
    total = jax.lax.psum(jnp.concatenate([jnp.reshape(x, -1) for x in leaves]), axes)
    out, start = [], 0
    for x in leaves:
        size = int(np.prod(np.shape(x), dtype=np.int64))
        out.append(total[start : start + size].reshape(np.shape(x)))
        start += size
    return out


def _encode(x: jax.Array, buffer: Any, halves: bool) -> jax.Array:
    """``x`` as real numbers of dtype ``buffer`` that add up to the encoding of its sum."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([jnp.real(x), jnp.imag(x)]).astype(buffer)
    if jnp.issubdtype(x.dtype, jnp.inexact) or not halves:
        return jnp.asarray(x).astype(buffer)[None]
    wide = jnp.asarray(x).astype(jnp.int32)
    return jnp.stack([jnp.right_shift(wide, 16), jnp.bitwise_and(wide, 0xFFFF)]).astype(buffer)


def _decode(total: jax.Array, like: jax.Array, halves: bool) -> jax.Array:
    if jnp.issubdtype(like.dtype, jnp.complexfloating):
        return jax.lax.complex(total[0], total[1]).astype(like.dtype)
    if jnp.issubdtype(like.dtype, jnp.inexact):
        return total[0].astype(like.dtype)
    if not halves:
        return jnp.round(total[0]).astype(like.dtype)
    high, low = (jnp.round(total[i]).astype(jnp.int32) for i in (0, 1))
    return (jnp.left_shift(high, 16) + low).astype(like.dtype)


def mean_of(total: Any, count: Any) -> Any:
    """``total / count`` leaf by leaf; integer and boolean sums become the default float."""

    def divide(t: jax.Array) -> jax.Array:
        dtype = t.dtype if jnp.issubdtype(t.dtype, jnp.inexact) else jnp.result_type(float)
        return t.astype(dtype) / count

    return jax.tree_util.tree_map(divide, total)


def row_sum(tree: Any) -> Any:
    """Sum over the leading (walker) axis, leaf by leaf."""
    return jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), tree)


def _identity(tree: Any) -> Any:
    return tree


def _body(what: str) -> Body:
    body = _BODY.get()
    if body is None:
        raise CallError(
            message(
                f"all_walkers.{what}",
                "called outside a walker-parallel kernel, where there are no walkers to reduce over.",
                fix="call it inside a function decorated with @sv.walker_parallel; outside kernels use "
                "sv.walker_mean(x) / sv.walker_sum(x) on a sharded walker array or WalkerSet.",
            )
        )
    if body.mode == "chunk":
        raise CallError(
            message(
                f"all_walkers.{what}",
                "called in a kernel with batch_size=, whose chunks of walkers are processed one after another "
                "and cannot see each other's values.",
                fix="compute the statistic in a kernel without batch_size (e.g. a first kernel returning the "
                "per-walker values, then sv.walker_mean), or drop batch_size for this kernel.",
            )
        )
    return body


def _sum(body: Body, x: Any) -> Any:
    if body.mode == "walker":
        return reduce_blocks(_identity, (x,), body.valid, body.axes)
    return reduce_blocks(row_sum, (x,), body.valid, body.axes)


def _quantile(body: Body, x: jax.Array, q: float) -> jax.Array:
    """``jnp.quantile(valid values, q)`` from inside a body: gathered in walker order, padding sorted last."""
    x = jnp.asarray(x)
    if x.ndim != (0 if body.mode == "walker" else 1):
        raise CallError(
            message(
                "all_walkers.quantile",
                "takes one scalar per walker.",
                got=f"shape {x.shape} in a {'per-walker' if body.mode == 'walker' else 'batched'} body",
                fix="pass a per-walker scalar (e.g. the local energy).",
            )
        )
    valid = jnp.ones(x.shape, bool) if body.valid is None else jnp.broadcast_to(body.valid, x.shape)
    # Invalid values go to the end of the sort (and NaN energies of valid walkers too, as jnp.sort puts them).
    high = jnp.asarray(jnp.inf, x.dtype)
    values = jnp.where(valid, x, high)
    axes = body.axes
    if body.mode == "walker":  # this device's walkers first (the vmap axis), then the devices' blocks in order
        values, axes = jax.lax.all_gather(values, axes[0]), axes[1:]
    values = jnp.sort(jax.lax.all_gather(values, axes, tiled=True) if axes else values)
    position = jnp.asarray(q, values.dtype) * (jnp.asarray(body.count, values.dtype) - 1)
    low = jnp.floor(position)
    below = values[low.astype(jnp.int32)]
    above = values[jnp.minimum(low.astype(jnp.int32) + 1, jnp.asarray(body.count, jnp.int32) - 1)]
    return below + (position - low) * (above - below)


class _AllWalkers:
    """Statistics over all valid walkers of all devices, callable inside a kernel's body.

    Inside a per-walker function, ``x`` is this walker's value; inside a
    ``batched=True`` function, a block with the walker axis first. Padding walkers never
    enter. The result is the same for every walker and device. Differentiable: an outer
    gradient through it is the gradient of the global statistic; a per-walker gradient
    taken inside the body follows JAX's collective semantics (the gradient of the sum of
    all walkers' outputs), so wrap the statistic in ``jax.lax.stop_gradient`` when it
    should act as a constant, as energy clipping does.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel
        ... def clip(e: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        ...     mean = sv.all_walkers.mean(e)
        ...     mad = sv.all_walkers.mean(jnp.abs(e - mean))
        ...     return jnp.clip(e, mean - 5 * mad, mean + 5 * mad)
        >>> e = jnp.array([1.0] * 15 + [100.0])  # one outlier among 16 walkers
        >>> round(float(clip(e)[-1]), 3)
        65.195
    """

    def sum(self, x: Any) -> Any:
        """Sum of ``x`` over the valid walkers of all devices (a pytree, leaf by leaf)."""
        return _sum(_body("sum"), x)

    def mean(self, x: Any) -> Any:
        """Mean of ``x`` over the valid walkers of all devices (a pytree, leaf by leaf)."""
        body = _body("mean")
        return mean_of(_sum(body, x), body.count)

    def count(self) -> jax.Array:
        """The number of valid walkers of all devices (an int32 scalar)."""
        return jnp.asarray(_body("count").count, jnp.int32)

    def quantile(self, x: jax.Array, q: float) -> jax.Array:
        """The ``q`` quantile of a per-walker scalar over the valid walkers of all devices.

        ``jnp.quantile``'s default (linear) interpolation over exactly the valid values,
        so the result does not depend on the device count. Every device gathers every
        walker's value (one all-gather of one scalar per walker): meant for energies and
        other scalars, as DeepQMC's clipping uses its median and quantiles.
        """
        return _quantile(_body("quantile"), x, q)

    def median(self, x: jax.Array) -> jax.Array:
        """The median of a per-walker scalar over the valid walkers of all devices (see :meth:`quantile`)."""
        return _quantile(_body("median"), x, 0.5)

    def __repr__(self) -> str:
        return "shardvmc.all_walkers"


all_walkers = _AllWalkers()
"""Walker statistics inside a kernel body: ``all_walkers.mean(x)``, ``.sum(x)``, ``.count()``."""
