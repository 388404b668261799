"""``WalkerSet``: walkers that carry their own valid count."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import CallError, message

__all__ = ["WalkerSet", "check_n_valid", "split_walker_set"]


@jax.tree_util.register_pytree_node_class
class WalkerSet:
    """A walker pytree with its valid count: walkers at index ``>= n_valid`` are padding.

    ``data`` holds the walkers, walker axis first on every leaf; ``n_valid`` is a
    Python int carried in the pytree structure (not a leaf), so ``jax.tree.map``,
    ``jax.jit`` and ``jax.grad`` see only the walker data, and every shardvmc function
    that takes walkers reads the count from here: a ``Mean`` over a ``WalkerSet`` can
    never average padding in. Kernels return their ``PerWalker`` outputs as
    ``WalkerSet``s with the same count, so ``walkers = step(params, walkers, key)``
    loops without any bookkeeping.

    Args:
        data: the walkers, any pytree of arrays with the walker axis first.
        n_valid: the number of real walkers (the first ones); ``None``: all of them.

    Raises:
        CallError: when ``n_valid`` is not an integer in ``1..n_walkers``, or the leaves
            hold different numbers of walkers.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> walkers = sv.WalkerSet(jnp.zeros((8, 2, 3)), n_valid=6)
        >>> walkers.n_walkers, walkers.n_valid
        (8, 6)
        >>> jax.tree.map(lambda r: r + 1, walkers).n_valid
        6
    """

    __slots__ = ("data", "n_valid")
    data: Any
    n_valid: int

    def __init__(self, data: Any, n_valid: int | None = None) -> None:
        if isinstance(data, WalkerSet):
            raise CallError(
                message(
                    "WalkerSet",
                    "data is already a WalkerSet.",
                    fix="pass walkers.data, or use walkers.replace(n_valid=...) to change the count.",
                )
            )
        n = _walker_count(data)
        if n_valid is None:
            if n is None:
                raise CallError(
                    message(
                        "WalkerSet",
                        "data has no array leaf with a walker axis, so the count is unknown.",
                        got=str(jax.tree_util.tree_structure(data)),
                        fix="pass arrays of shape (n_walkers, ...).",
                    )
                )
            n_valid = n
        if isinstance(n_valid, bool) or not isinstance(n_valid, (int, np.integer)):
            if hasattr(n_valid, "shape") and np.shape(n_valid) == () and not isinstance(n_valid, jax.core.Tracer):
                n_valid = int(n_valid)
            else:
                raise CallError(
                    message(
                        "WalkerSet",
                        "n_valid must be a Python int (it is part of the pytree structure, not a traced value).",
                        got=type(n_valid).__name__,
                        fix="pass int(n_valid).",
                    )
                )
        n_valid = int(n_valid)
        if n is not None and not 1 <= n_valid <= n:
            raise CallError(
                message(
                    "WalkerSet",
                    f"n_valid={n_valid} is outside 1..{n}, the number of walkers in data.",
                    fix="the real walkers come first; pass their count.",
                )
            )
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "n_valid", n_valid)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("WalkerSet is immutable; use .replace(data=..., n_valid=...).")

    @property
    def n_walkers(self) -> int:
        """The number of walkers held, padding included (the leading size of ``data``)."""
        n = _walker_count(self.data)
        return self.n_valid if n is None else n

    @property
    def n_padding(self) -> int:
        """How many of the held walkers are padding."""
        return self.n_walkers - self.n_valid

    def replace(self, *, data: Any = None, n_valid: int | None = None) -> WalkerSet:
        """A copy with new ``data`` and/or ``n_valid`` (checked like the constructor).

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> sv.WalkerSet(jnp.zeros((4, 3))).replace(n_valid=2).n_valid
            2
        """
        return WalkerSet(self.data if data is None else data, self.n_valid if n_valid is None else n_valid)

    def tree_flatten(self) -> tuple[tuple[Any], int]:
        return (self.data,), self.n_valid

    @classmethod
    def tree_unflatten(cls, n_valid: int, children: tuple[Any, ...]) -> WalkerSet:
        # JAX unflattens with placeholders (None, object()) as leaves: no checks here.
        obj = object.__new__(cls)
        object.__setattr__(obj, "data", children[0])
        object.__setattr__(obj, "n_valid", n_valid)
        return obj

    def __repr__(self) -> str:
        leaves = jax.tree_util.tree_map(
            lambda x: f"{getattr(x, 'dtype', type(x).__name__)}{list(np.shape(x))}", self.data
        )
        return f"WalkerSet(n_valid={self.n_valid}, data={leaves})"


def _walker_count(data: Any) -> int | None:
    """Leading size of the first leaf that has one (``None``: no such leaf)."""
    for leaf in jax.tree_util.tree_leaves(data):
        shape = getattr(leaf, "shape", None)
        if shape:
            return int(shape[0])
    return None


def split_walker_set(x: Any) -> tuple[Any, int | None]:
    """``(data, n_valid)`` of a ``WalkerSet``; ``(x, None)`` for anything else."""
    if isinstance(x, WalkerSet):
        return x.data, x.n_valid
    return x, None


def check_n_valid(where: str, n_valid: Any, n_walkers: int) -> None:
    """Raise ``CallError`` unless ``n_valid`` is ``None``, traced, or an integer in ``1..n_walkers``.

    Accepts Python and NumPy integers and integer scalar arrays (NumPy or JAX), the same
    everywhere a count is taken.
    """
    if n_walkers < 1:
        raise CallError(
            message(where, "there are no walkers (the walker axis has size 0).", fix="pass at least one walker.")
        )
    if n_valid is None or isinstance(n_valid, jax.core.Tracer):
        return
    dtype = getattr(n_valid, "dtype", None)
    integral = isinstance(n_valid, int) if dtype is None else jnp.issubdtype(dtype, jnp.integer)
    if isinstance(n_valid, bool) or not integral or np.shape(n_valid) != ():
        raise CallError(
            message(
                where,
                "n_valid must be one integer, the number of real walkers.",
                got=f"{type(n_valid).__name__} {dtype or ''}{list(np.shape(n_valid))}",
                fix="pass a Python int or an integer scalar array, or pass a sv.WalkerSet that carries its count.",
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
