"""``walker_parallel`` and ``replicated_args``: per-walker functions to distributed kernels."""

from __future__ import annotations

import functools
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any, overload

import jax
import numpy as np
from jax.sharding import Mesh

from ._errors import CallError, DecorationError, ShardvmcError, UnhashableStaticError, message
from ._kernel import Options, build, explain_call_error, inside_kernel, leading_count, output_shardings
from ._markers import Kind, Layout, missing_markers_error, parse
from ._mesh import resolve_mesh
from ._reductions import check_n_valid

__all__ = ["WalkerParallel", "replicated_args", "walker_parallel"]


def _picker(indices: tuple[int, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A fast ``lambda args: tuple(args[i] for i in indices)``."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


class WalkerParallel:
    """A per-walker function turned into one jitted, sharded, padded kernel.

    Built by :func:`walker_parallel`; call it like the original function but with
    walker sets in place of single walkers, plus an optional ``n_valid=`` keyword.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        layout: Layout | None,
        *,
        mesh: Mesh | None,
        options: Options,
        replicated: frozenset[str] = frozenset(),
        nested: Callable[..., Any] | None = None,
    ) -> None:
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn)
        self._qualname = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self._mesh = mesh
        self._options = options
        self._replicated = replicated
        self._nested = fn if nested is None else nested
        self._missing: list[str] = []
        self._cache: dict[tuple[Mesh, tuple[Any, ...], bool], Callable[..., Any]] = {}  # mesh, statics, even
        if layout is None:
            layout, self._missing = parse(fn, self._qualname, replicated)
            if self._missing and not _replicated_args_pending():
                raise missing_markers_error(self._qualname, self._missing)
        self._set_layout(layout)

    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self._n_params = len(layout.signature.parameters) if not self._missing else -1
        self._static_idx = tuple(i for i, p in enumerate(layout.params) if p.kind is Kind.STATIC)
        self._dyn_idx = tuple(i for i, p in enumerate(layout.params) if p.kind is not Kind.STATIC)
        self._statics_of = _picker(self._static_idx)
        self._dyn_of = _picker(self._dyn_idx)
        self._first_walker_idx = next(
            (j for j, i in enumerate(self._dyn_idx) if layout.params[i].kind is Kind.PER_WALKER), None
        )

    @property
    def layout(self) -> Layout:
        """The parameter and output markers, as read from the annotations."""
        return self._layout

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if self._missing:
            raise missing_markers_error(self._qualname, self._missing)
        try:
            bound = self._layout.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self._qualname}: {err}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _kernel(self, args: tuple[Any, ...], dyn: tuple[Any, ...]) -> Callable[..., Any]:
        axis = self._options.axis_name
        mesh = resolve_mesh(self._mesh, axis, where=self._qualname)
        statics = self._statics_of(args)
        n = self._walker_count(dyn)
        key = (mesh, statics, n is None or n % mesh.shape[axis] == 0)
        try:
            return self._cache[key]
        except KeyError:
            pass
        except TypeError:
            self._raise_unhashable(statics)
        # Only an evenly divisible walker count can keep its sharding on the way out.
        shardings = output_shardings(self._layout, mesh, axis) if key[2] else None
        run = jax.jit(
            build(self.__wrapped__, self._layout, statics, mesh, self._options, self._qualname), out_shardings=shardings
        )
        self._cache[key] = run
        return run

    def _walker_count(self, dyn: tuple[Any, ...]) -> int | None:
        """Leading size of the first PerWalker leaf (``None`` if there is none: run() explains)."""
        return None if self._first_walker_idx is None else leading_count(dyn[self._first_walker_idx])

    def _raise_unhashable(self, statics: tuple[Any, ...]) -> None:
        for i, value in zip(self._static_idx, statics):
            try:
                hash(value)
            except TypeError:
                name = self._layout.params[i].name
                raise UnhashableStaticError(
                    message(
                        self._qualname,
                        f"Static parameter {name!r} received an unhashable value, which cannot key the compilation.",
                        got=f"{type(value).__name__}",
                        fix="pass a hashable value (a tuple instead of a list, a frozen dataclass), or mark the "
                        "parameter Replicated if it holds arrays.",
                    )
                ) from None

    def _n_valid(self, n_valid: Any, dyn: tuple[Any, ...]) -> Any:
        if isinstance(n_valid, jax.core.Tracer):
            return n_valid
        n = self._walker_count(dyn)
        if n is not None:
            check_n_valid(self._qualname, n_valid, n)
        if not isinstance(n_valid, (int, np.integer, jax.Array)) or isinstance(n_valid, bool):
            raise CallError(message(self._qualname, "n_valid must be an integer.", got=type(n_valid).__name__))
        return np.int32(n_valid)

    def __call__(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> Any:
        if inside_kernel():
            return self._nested(*args, **kwargs)
        if kwargs or len(args) != self._n_params:
            args = self._arguments(args, kwargs)
        dyn = self._dyn_of(args)
        run = self._kernel(args, dyn)
        if n_valid is not None:
            n_valid = self._n_valid(n_valid, dyn)
        try:
            return run(dyn, n_valid)
        except (TypeError, ValueError) as err:
            self._explain(err, dyn)
            raise

    def _explain(self, err: Exception, dyn: tuple[Any, ...]) -> None:
        """Replace JAX's refusal of the arguments by the shardvmc error that names the parameter."""
        if isinstance(err, ShardvmcError):
            return
        params = tuple(self._layout.params[i] for i in self._dyn_idx)
        mesh = resolve_mesh(self._mesh, self._options.axis_name, where=self._qualname)
        error = explain_call_error(self._qualname, params, dyn, mesh)
        if error is not None:
            raise error from None

    def lower(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> jax.stages.Lowered:
        """Lower the kernel for these arguments, like ``jax.jit(f).lower``.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> @sv.walker_parallel
            ... def square(r: sv.PerWalker) -> sv.Mean:
            ...     return r**2
            >>> "all-reduce" in square.lower(jnp.ones(8)).compile().as_text()
            True
        """
        args = self._arguments(args, kwargs)
        dyn = self._dyn_of(args)
        if n_valid is not None:
            n_valid = self._n_valid(n_valid, dyn)
        try:
            return self._kernel(args, dyn).lower(dyn, n_valid)
        except (TypeError, ValueError) as err:
            self._explain(err, dyn)
            raise

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<walker_parallel {self._qualname}>"

    def _with_replicated(self, names: frozenset[str]) -> WalkerParallel:
        return WalkerParallel(
            self.__wrapped__, None, mesh=self._mesh, options=self._options, replicated=self._replicated | names
        )


@overload
def walker_parallel(fn: Callable[..., Any], /) -> WalkerParallel: ...
@overload
def walker_parallel(
    fn: None = None,
    /,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
    batch_size: int | None = None,
    batched: bool = False,
    checks: bool = True,
) -> Callable[[Callable[..., Any]], WalkerParallel]: ...
def walker_parallel(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
    batch_size: int | None = None,
    batched: bool = False,
    checks: bool = True,
) -> WalkerParallel | Callable[[Callable[..., Any]], WalkerParallel]:
    """Turn a function of ONE walker into a jitted kernel over all walkers on all devices.

    Parameters are marked ``PerWalker[...]`` (walker axis first; the body sees one
    walker), ``Replicated[...]`` (the same on every device), ``WalkerKey`` (one key from
    the caller; walker ``i`` sees ``fold_in(key, i)``) or ``Static[...]`` (hashable,
    compiled in). The return is ``PerWalker`` (default; sharded over the mesh),
    ``Mean`` or ``Sum`` (over the valid walkers; replicated), or a tuple of those.

    The call pads the walkers to the mesh, runs the body under ``shard_map`` with
    replicated inputs cast to varying (so per-walker gradients with respect to them are
    that walker's own), reduces, and un-pads, all in one jitted computation. Every
    decorated function also takes ``n_valid=``: walkers at index ``>= n_valid`` are
    padding and never enter ``Mean``/``Sum``.

    Args:
        fn: the per-walker function (or a block function with ``batched=True``).
        mesh: the mesh; ``None`` resolves it at each call (``use_mesh``, else all devices).
        axis_name: the walker axis of the mesh.
        batch_size: process each device's walkers this many at a time
            (``folx.batched_vmap``), bounding memory by ``batch_size``.
        batched: ``fn`` already takes a block of walkers (axis 0); ``WalkerKey`` then
            arrives as a block of keys and ``Mean``/``Sum`` outputs are per-walker values.
        checks: check shapes at trace time (free at run time).

    Returns:
        A :class:`WalkerParallel` (or a decorator, when called with options only).

    Raises:
        DecorationError: a parameter without a marker, a misplaced marker, a parameter
            named ``n_valid``, or an unresolvable annotation.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel
        ... def energy(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        ...     return alpha * jnp.sum(r**2)
        >>> float(energy(jnp.float32(0.5), jnp.ones((10, 2, 3))))
        3.0
    """
    options = Options(axis_name=axis_name, batch_size=batch_size, batched=batched, checks=checks)
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"walker_parallel: batch_size must be a positive int or None, got {batch_size!r}.")

    def decorate(f: Callable[..., Any]) -> WalkerParallel:
        if not callable(f):
            raise DecorationError(
                message(
                    "walker_parallel",
                    f"expected a function of one walker, got a {type(f).__name__}.",
                    fix="decorate a function (`@sv.walker_parallel` or `@sv.walker_parallel(batch_size=...)`).",
                )
            )
        if isinstance(f, WalkerParallel):
            raise TypeError(f"walker_parallel: {f!r} is already walker-parallel.")
        if isinstance(f, _ReplicatedFn):
            return WalkerParallel(f.__wrapped__, None, mesh=mesh, options=options, replicated=f.names)
        return WalkerParallel(f, None, mesh=mesh, options=options)

    return decorate if fn is None else decorate(fn)


class _ReplicatedFn:
    """A plain function with the parameter names ``replicated_args`` gave it."""

    def __init__(self, fn: Callable[..., Any], names: frozenset[str]) -> None:
        self.__wrapped__ = fn
        self.names = names
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)


# ``replicated_args(...)`` decorators created but not yet applied. When one is stacked
# above ``walker_parallel``, Python evaluates it first and applies it last; while one is
# pending, ``walker_parallel`` lets parameters without markers wait for it (the error,
# if none comes, is raised at the first call instead of at decoration).
_PENDING: weakref.WeakSet[_ReplicatedArgs] = weakref.WeakSet()


def _replicated_args_pending() -> bool:
    return len(_PENDING) > 0


class _ReplicatedArgs:
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        _PENDING.add(self)

    def __call__(self, fn: Callable[..., Any]) -> Any:
        _PENDING.discard(self)
        if isinstance(fn, WalkerParallel):
            return fn._with_replicated(self.names)
        if isinstance(fn, _ReplicatedFn):
            return _ReplicatedFn(fn.__wrapped__, fn.names | self.names)
        if not callable(fn):
            raise TypeError(f"replicated_args: expected a function, got {type(fn).__name__}.")
        parse(fn, getattr(fn, "__qualname__", repr(fn)), self.names)  # report unknown names now
        return _ReplicatedFn(fn, self.names)


def replicated_args(*names: str) -> Callable[[Any], Any]:
    """Mark parameters ``Replicated`` by name; the other unannotated ones become ``PerWalker``.

    For existing or third-party functions whose signatures you cannot annotate. Stacks
    above or below :func:`walker_parallel`.

    Args:
        *names: names of the parameters that hold the same value on every device.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> def energy(params, r):
        ...     return params["a"] * jnp.sum(r**2)
        >>> energy_all = sv.walker_parallel(sv.replicated_args("params")(energy))
        >>> energy_all({"a": 2.0}, jnp.ones((8, 3))).shape
        (8,)
    """
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"replicated_args: parameter names must be strings, got {name!r}.")
    return _ReplicatedArgs(frozenset(names))
