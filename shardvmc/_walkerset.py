"""``WalkerSet``: walkers that carry their own valid count, and the operations that keep it right."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ._errors import CallError, describe, message

__all__ = ["WalkerSet", "check_n_valid", "common_count", "first_count", "split_walker_set", "walker_count"]


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

    ``jax.tree.map`` over a set maps the data and keeps the count as it is: right for
    maps that keep the walker axis (a Metropolis move, a change of dtype), wrong for
    maps that change which walkers are held. Slice, concatenate and split sets with
    ``walkers[a:b]``, :meth:`concatenate` and :meth:`split`, which keep the count
    right; :meth:`valid` gives the real walkers alone. A set whose count no longer fits
    its data (more valid walkers than rows) is refused by every shardvmc entry point.

    Args:
        data: the walkers, any pytree of arrays with the walker axis first.
        n_valid: the number of real walkers (the first ones); ``None``: all of them.

    Raises:
        CallError: when ``n_valid`` is not an integer in ``1..n_walkers``, or the leaves
            hold different numbers of walkers (scalar leaves, which are left alone, apart).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
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
        _check_arrays(data)
        n = walker_count(data, "WalkerSet", "data")
        if n_valid is None:
            n_valid = n
        if isinstance(n_valid, bool) or not isinstance(n_valid, (int, np.integer)):
            if hasattr(n_valid, "shape") and np.shape(n_valid) == () and not isinstance(n_valid, Tracer):
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
        if not 1 <= n_valid <= n:
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
        n = first_count(self.data)
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

    def valid(self) -> WalkerSet:
        """The real walkers alone: the first ``n_valid``, as a set without padding.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> sv.WalkerSet(jnp.arange(8.0), n_valid=5).valid().data.tolist()
            [0.0, 1.0, 2.0, 3.0, 4.0]
        """
        return self[: self.n_valid]

    def __getitem__(self, index: slice) -> WalkerSet:
        """Walkers ``start:stop`` (step 1); the count is the number of real walkers among them.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> part = sv.WalkerSet(jnp.arange(16.0), n_valid=13)[8:16]
            >>> part.n_walkers, part.n_valid
            (8, 5)
        """
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise CallError(
                message(
                    "WalkerSet",
                    "a walker set is indexed by a slice of walkers with step 1 (`walkers[a:b]`).",
                    got=repr(index),
                    fix="index walkers.data for anything else, and build a new WalkerSet with the count you mean.",
                )
            )
        start, stop, _ = index.indices(self.n_walkers)
        stop = max(start, stop)
        n_valid = min(stop, self.n_valid) - start
        if n_valid < 1:
            raise CallError(
                message(
                    "WalkerSet",
                    f"walkers[{start}:{stop}] holds no real walker (the first {self.n_valid} of {self.n_walkers} are "
                    "real), and a walker set holds at least one.",
                    fix="slice inside the real walkers, e.g. walkers.valid()[a:b].",
                )
            )
        return WalkerSet(_rows(self.data, lambda x: x[start:stop]), n_valid)

    @staticmethod
    def concatenate(sets: Sequence[WalkerSet]) -> WalkerSet:
        """One set of the walkers of ``sets``: every set's real walkers in order, then every set's padding.

        The real walkers must come first in a set, so the padding of each part moves to
        the end; the walker count is the sum of the parts' (so it stays a multiple of the
        device count when every part's is).

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> a = sv.WalkerSet(jnp.array([1.0, 2.0, 0.0]), n_valid=2)
            >>> b = sv.WalkerSet(jnp.array([3.0, 4.0, 5.0]))
            >>> both = sv.WalkerSet.concatenate([a, b])
            >>> both.data.tolist(), both.n_valid
            ([1.0, 2.0, 3.0, 4.0, 5.0, 0.0], 5)
        """
        sets = list(sets)
        if not sets or not all(isinstance(s, WalkerSet) for s in sets):
            raise CallError(
                message(
                    "WalkerSet.concatenate",
                    "expects a non-empty sequence of WalkerSets.",
                    got=", ".join(type(s).__name__ for s in sets) or "nothing",
                )
            )
        structure = jax.tree_util.tree_structure(sets[0].data)
        for i, s in enumerate(sets[1:], 1):
            if jax.tree_util.tree_structure(s.data) != structure:
                raise CallError(
                    message(
                        "WalkerSet.concatenate",
                        f"set {i} holds another pytree than set 0.",
                        got=describe(s.data),
                        expected=describe(sets[0].data),
                    )
                )
        parts = [s.data for s in sets]

        def join(*leaves: Any) -> Any:
            if np.ndim(leaves[0]) == 0:
                return leaves[0]
            xp = np if all(isinstance(x, np.ndarray) for x in leaves) else jnp
            real = [x[: s.n_valid] for x, s in zip(leaves, sets)]
            padding = [x[s.n_valid :] for x, s in zip(leaves, sets) if s.n_padding]
            return xp.concatenate(real + padding, axis=0)

        return WalkerSet(jax.tree_util.tree_map(join, *parts), sum(s.n_valid for s in sets))

    def split(self, counts: Sequence[int]) -> list[WalkerSet]:
        """The real walkers cut into consecutive sets of ``counts`` walkers (no padding in the parts).

        ``counts`` must add up to ``n_valid``. Pad a part for a mesh with :meth:`pad_to`.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> a, b = sv.WalkerSet(jnp.arange(8.0), n_valid=5).split([2, 3])
            >>> a.data.tolist(), b.data.tolist()
            ([0.0, 1.0], [2.0, 3.0, 4.0])
        """
        counts = [int(c) for c in counts]
        if sum(counts) != self.n_valid or any(c < 1 for c in counts):
            raise CallError(
                message(
                    "WalkerSet.split",
                    "the counts must be positive and add up to the number of real walkers.",
                    got=f"counts {counts} (sum {sum(counts)})",
                    expected=f"positive counts adding up to n_valid={self.n_valid}",
                )
            )
        bounds = np.cumsum([0, *counts])
        return [self[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]

    def pad_to(self, n_walkers: int) -> WalkerSet:
        """The same set padded to ``n_walkers`` walkers with copies of walker 0 (a valid configuration).

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> w = sv.WalkerSet(jnp.array([1.0, 2.0, 3.0])).pad_to(sv.pad_n_walkers(3, 4))
            >>> w.data.tolist(), w.n_valid
            ([1.0, 2.0, 3.0, 1.0], 3)
        """
        extra = int(n_walkers) - self.n_walkers
        if extra <= 0:
            return self

        def pad(x: Any) -> Any:
            xp = np if isinstance(x, np.ndarray) else jnp
            return xp.concatenate([x, xp.repeat(x[:1], extra, axis=0)], axis=0)

        return WalkerSet(_rows(self.data, pad), self.n_valid)

    def tree_flatten(self) -> tuple[tuple[Any], int]:
        return (self.data,), self.n_valid

    @classmethod
    def tree_unflatten(cls, n_valid: int, children: tuple[Any, ...]) -> WalkerSet:
        # JAX unflattens with placeholders (None, object()) as leaves: no checks here. Entry points check
        # that the count still fits the data (split_walker_set).
        obj = object.__new__(cls)
        object.__setattr__(obj, "data", children[0])
        object.__setattr__(obj, "n_valid", n_valid)
        return obj

    def __repr__(self) -> str:
        return f"WalkerSet(n_valid={self.n_valid}, data={describe(self.data)})"


def first_count(tree: Any) -> int | None:
    """The walker count of ``tree``, unchecked: the leading size of its first non-scalar leaf (``None``: none).

    On the per-call path: walker data that is one array costs one attribute lookup.
    :func:`walker_count` (or the engine's trace-time check) is what says the other leaves agree.
    """
    shape = getattr(tree, "shape", None)
    if shape:
        return int(shape[0])
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = getattr(leaf, "shape", None)
        if shape:
            return int(shape[0])
    return None


def common_count(
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    where: str,
    problem: Callable[[str, str], str],
    *,
    expected: str,
    fix: str,
) -> tuple[str, int] | None:
    """The one rule of a walker count: every shape with an axis has the same leading size.

    ``shapes`` are ``(name, shape)`` pairs; scalars carry no walker axis and are passed
    over. Returns the first name and its leading size (``None``: no shape has an axis).

    Raises:
        CallError: naming the first two leaves that disagree (``problem(first, other)``).
    """
    first: tuple[str, int] | None = None
    for name, shape in shapes:
        if not shape:
            continue
        if first is None:
            first = (name, int(shape[0]))
        elif int(shape[0]) != first[1]:
            raise CallError(
                message(
                    where,
                    problem(first[0], name),
                    got=f"{first[0]} has {first[1]} walkers (leading axis), {name} has {shape[0]}",
                    expected=expected,
                    fix=fix,
                )
            )
    return first


def walker_count(tree: Any, where: str, what: str = "walkers") -> int:
    """The walker count of ``tree``: the leading size its non-scalar leaves share.

    Scalar leaves (a step counter beside the walkers) carry no walker axis and are left
    alone, as ``sv.shard_walker`` replicates them.

    Raises:
        CallError: naming the pytree paths when two leaves disagree, or when no leaf
            has a leading axis.
    """
    shapes = ((jax.tree_util.keystr(path) or "<root>", np.shape(leaf)) for path, leaf in _leaves(tree))
    first = common_count(
        shapes,
        where,
        lambda a, b: f"the leaves of {what} hold different numbers of walkers.",
        expected="every non-scalar leaf to have the walker axis first, of one size",
        fix="put the walker axis first in every leaf, or move per-run constants out of the walker pytree.",
    )
    if first is None:
        raise CallError(
            message(
                where,
                f"{what} has no array leaf with a leading walker axis, so the walker count is unknown.",
                got=f"{jax.tree_util.tree_structure(tree)}",
                fix="pass arrays of shape (n_walkers, ...).",
            )
        )
    return first[1]


def _leaves(tree: Any) -> list[tuple[Any, Any]]:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _check_arrays(data: Any) -> None:
    """A ``CallError`` naming the first leaf of ``data`` that is neither an array nor a number."""
    for path, leaf in _leaves(data):
        if not (hasattr(leaf, "shape") or isinstance(leaf, (int, float, complex))):
            raise CallError(
                message(
                    "WalkerSet",
                    f"leaf {jax.tree_util.keystr(path) or '<root>'} of data is not an array.",
                    got=type(leaf).__name__,
                    expected="arrays with the walker axis first",
                    fix="keep settings out of the walker data (pass them as Replicated or Static arguments).",
                )
            )


def _rows(tree: Any, rows: Callable[[Any], Any]) -> Any:
    """``rows(x)`` on every leaf with a walker axis; scalar leaves unchanged."""
    return jax.tree_util.tree_map(lambda x: x if np.ndim(x) == 0 else rows(x), tree)


def split_walker_set(x: Any, where: str = "shardvmc") -> tuple[Any, int | None]:
    """``(data, n_valid)`` of a ``WalkerSet``; ``(x, None)`` for anything else.

    Refuses a set whose count no longer fits its data, as ``jax.tree.map`` can leave one
    (``lambda a: a[:8]`` on a set of 16 with 13 valid).
    """
    if not isinstance(x, WalkerSet):
        return x, None
    n = first_count(x.data)
    if n is not None and x.n_valid > n:
        raise CallError(
            message(
                where,
                f"a WalkerSet carries n_valid={x.n_valid} but holds {n} walkers: its count no longer fits its data.",
                got=f"WalkerSet(n_valid={x.n_valid}, data={describe(x.data)})",
                fix="jax.tree.map keeps a set's count; slice, concatenate and split sets with walkers[a:b], "
                "sv.WalkerSet.concatenate and walkers.split, which keep it right, or set it with "
                "walkers.replace(n_valid=...).",
            )
        )
    return x.data, x.n_valid


def check_n_valid(where: str, n_valid: Any, n_walkers: int) -> None:
    """Raise ``CallError`` unless ``n_valid`` is ``None``, traced, or an integer in ``1..n_walkers``.

    Accepts Python and NumPy integers and integer scalar arrays (NumPy or JAX), the same
    everywhere a count is taken.
    """
    if n_walkers < 1:
        raise CallError(
            message(where, "there are no walkers (the walker axis has size 0).", fix="pass at least one walker.")
        )
    if n_valid is None or isinstance(n_valid, Tracer):
        return
    if type(n_valid) is int:  # the usual count (pad_walker's), on the per-call path: np.shape costs 2 us
        value = n_valid
    else:
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
