"""``walker_parallel`` and ``replicated_args``: per-walker functions to distributed kernels."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import types
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from . import _compat
from ._errors import CallError, DecorationError, ShardvmcError, UnhashableStaticError, message
from ._kernel import Options, build, explain_call_error, inside_kernel, leading_count, output_shardings, signature_of
from ._markers import Kind, Layout, missing_markers_error, parse
from ._mesh import resolve_mesh
from ._walkerset import WalkerSet, check_n_valid

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
        qualname: str | None = None,
    ) -> None:
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn)
        self._qualname = qualname or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self._mesh = mesh
        self._options = options
        self._replicated = replicated
        self._nested = nested
        self._missing: list[str] = []
        self.chosen_batch_sizes: dict[Any, int | None] = {}
        """With ``batch_size="auto"``: the chunk chosen for each argument signature (``None``: all at once)."""
        self._cache: dict[tuple[Mesh, tuple[Any, ...], bool], Callable[..., Any]] = {}  # mesh, statics, even
        if layout is None:
            # Unmarked parameters are reported at the first call: a replicated_args(...) stacked above may
            # still name them (Python applies it after this decorator).
            layout, self._missing = parse(fn, self._qualname, replicated)
        self._set_layout(layout)

    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self._n_params = len(layout.signature.parameters) if not self._missing else -1
        self._static_idx = tuple(i for i, p in enumerate(layout.params) if p.kind is Kind.STATIC)
        self._dyn_idx = tuple(i for i, p in enumerate(layout.params) if p.kind is not Kind.STATIC)
        self._statics_of = _picker(self._static_idx)
        self._dyn_of = _picker(self._dyn_idx)
        self._walker_idx = tuple(j for j, i in enumerate(self._dyn_idx) if layout.params[i].kind is Kind.PER_WALKER)
        if layout.output is Kind.REPLICATED or (isinstance(layout.output, tuple) and Kind.REPLICATED in layout.output):
            if not self._options.batched:
                raise DecorationError(
                    message(
                        self._qualname,
                        "the return is marked Replicated, which only a batched=True function can produce.",
                        fix="mark it Mean[...] (a per-walker function returning sv.all_walkers.mean(x) gives that "
                        "value), or decorate with batched=True.",
                    )
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

    def _kernel(self, mesh: Mesh, args: tuple[Any, ...], dyn: tuple[Any, ...], n_valid: Any) -> Callable[..., Any]:
        axis = self._options.axis_name
        statics = self._statics_of(args)
        n = self._walker_count(dyn)
        key: tuple[Any, ...] = (mesh, statics, n is None or n % _compat.axis_size(mesh, axis) == 0)
        auto = self._options.batch_size == "auto"
        if auto:  # the chunk is chosen per shape: the arguments' abstract signature keys the kernel too
            key += (signature_of(dyn), n_valid is None)
        try:
            return self._cache[key]
        except KeyError:
            pass
        except TypeError:
            self._raise_unhashable(statics)
        # shard_map's out_specs give per-walker outputs P(axis) on a mesh of several devices. On one device XLA
        # reports P() instead, so the spec is pinned with out_shardings there only: on more devices, pinned
        # shardings become the required shardings of the cotangents when a caller differentiates eagerly.
        shardings = output_shardings(self._layout, mesh, axis) if key[2] and mesh.size == 1 else None

        def jitted(options: Options) -> Callable[..., Any]:
            return jax.jit(
                build(self.__wrapped__, self._layout, statics, mesh, options, self._qualname), out_shardings=shardings
            )

        if auto:
            run, chosen = _largest_fitting_chunk(self, jitted, mesh, dyn, n_valid)
            self.chosen_batch_sizes[key[3]] = chosen
        else:
            run = jitted(self._options)
        self._cache[key] = run
        return run

    def _walker_count(self, dyn: tuple[Any, ...]) -> int | None:
        """Leading size of the first PerWalker leaf (``None`` if there is none: run() explains)."""
        return leading_count(dyn[self._walker_idx[0]]) if self._walker_idx else None

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

    def _walker_sets(self, dyn: tuple[Any, ...], n_valid: Any) -> tuple[tuple[Any, ...], Any, int | None]:
        """Unwrap ``WalkerSet`` arguments: ``(walker data, n_valid for the kernel, count to wrap outputs)``."""
        count: int | None = None
        for j in self._walker_idx:
            arg = dyn[j]
            if not isinstance(arg, WalkerSet):
                continue
            if count is not None and arg.n_valid != count:
                raise CallError(
                    message(
                        self._qualname,
                        "two WalkerSet arguments carry different valid counts.",
                        got=f"n_valid {count} and {arg.n_valid}",
                        fix="pass walker sets of the same walkers (one count).",
                    )
                )
            count = arg.n_valid
            dyn = (*dyn[:j], arg.data, *dyn[j + 1 :])
        if count is None:
            return dyn, self._n_valid(n_valid, dyn), None
        if n_valid is not None and (isinstance(n_valid, jax.core.Tracer) or int(n_valid) != count):
            raise CallError(
                message(
                    self._qualname,
                    "n_valid= disagrees with the count the WalkerSet argument carries.",
                    got=f"n_valid={n_valid!r}, WalkerSet.n_valid={count}",
                    fix="drop n_valid= (the WalkerSet knows its count), or pass walkers.replace(n_valid=...).",
                )
            )
        n = self._walker_count(dyn)
        return dyn, (None if count == n else np.int32(count)), count

    def _n_valid(self, n_valid: Any, dyn: tuple[Any, ...]) -> Any:
        if n_valid is None or isinstance(n_valid, jax.core.Tracer):
            return n_valid
        n = self._walker_count(dyn)
        check_n_valid(self._qualname, n_valid, n if n is not None else int(n_valid))
        return np.int32(n_valid)

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], n_valid: Any) -> tuple[Any, ...]:
        if kwargs or len(args) != self._n_params:
            args = self._arguments(args, kwargs)
        dyn, n_valid, count = self._walker_sets(self._dyn_of(args), n_valid)
        mesh = resolve_mesh(self._mesh, self._options.axis_name, where=self._qualname)
        return mesh, self._kernel(mesh, args, dyn, n_valid), dyn, n_valid, count

    def __call__(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> Any:
        mode = inside_kernel()
        if mode is not None:
            return self._nested_call(mode, args, kwargs)
        mesh, run, dyn, n_valid, count = self._prepare(args, kwargs, n_valid)
        try:
            if _compat.context_mesh_differs(mesh):
                with jax.set_mesh(mesh):
                    out = run(dyn, n_valid)
            else:
                out = run(dyn, n_valid)
        except (TypeError, ValueError) as err:
            self._explain(err, mesh, dyn)
            raise
        return out if count is None else self._wrap(out, count)

    def _wrap(self, out: Any, count: int) -> Any:
        """Per-walker outputs as ``WalkerSet``s carrying ``count``."""
        output = self._layout.output
        if isinstance(output, Kind):
            return WalkerSet.tree_unflatten(count, (out,)) if output is Kind.PER_WALKER else out
        return tuple(WalkerSet.tree_unflatten(count, (o,)) if k is Kind.PER_WALKER else o for o, k in zip(out, output))

    def _nested_call(self, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call from inside another kernel's body: run the function there, at the body's granularity."""
        if self._nested is not None:
            return self._nested(*args, **kwargs)
        if (mode == "block") == self._options.batched:
            return self.__wrapped__(*args, **kwargs)
        args = self._arguments(args, kwargs)
        walker_axis = [p.kind in (Kind.PER_WALKER, Kind.KEY) for p in self._layout.params]
        if self._options.batched:  # a block function called for one walker: a block of one
            block = [
                jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), a) if w else a
                for a, w in zip(args, walker_axis)
            ]
            return jax.tree_util.tree_map(lambda x: x[0], self.__wrapped__(*block))
        # a per-walker function called with a block: map it over the block's walkers
        static = [p.kind is Kind.STATIC for p in self._layout.params]
        dyn = [a for a, s in zip(args, static) if not s]
        in_axes = [0 if w else None for w, s in zip(walker_axis, static) if not s]

        def one(*d: Any) -> Any:
            it, st = iter(d), iter(a for a, s in zip(args, static) if s)
            return self.__wrapped__(*(next(st) if s else next(it) for s in static))

        return jax.vmap(one, in_axes=in_axes)(*dyn)

    def _explain(self, err: Exception, mesh: Mesh, dyn: tuple[Any, ...]) -> None:
        """Replace JAX's refusal of the arguments by the shardvmc error that names the parameter."""
        if isinstance(err, ShardvmcError):
            return
        params = tuple(self._layout.params[i] for i in self._dyn_idx)
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
        mesh, run, dyn, n_valid, _ = self._prepare(self._arguments(args, kwargs), {}, n_valid)
        try:
            with jax.set_mesh(mesh) if _compat.context_mesh_differs(mesh) else contextlib.nullcontext():
                return run.lower(dyn, n_valid)
        except (TypeError, ValueError) as err:
            self._explain(err, mesh, dyn)
            raise

    def explain(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> Any:
        """What the kernel will do with these arguments, as text (``str(...)``) and as data.

        Resolves the mesh, every parameter leaf's marker and PartitionSpec, the padding
        decision and valid count and the chunking, and reads the collectives and the
        per-device argument/output/temporary bytes from the compiled program. Warns
        (``sv.CommunicationWarning``, once per kernel) when the program holds an
        all-gather or all-to-all that the markers did not ask for.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> @sv.walker_parallel
            ... def square(r: sv.PerWalker) -> sv.Mean:
            ...     return r**2
            >>> square.explain(jnp.ones(8)).collectives
            {'all-reduce': 1}
        """
        from ._explain import explain

        return explain(self, args, kwargs, n_valid)

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


def _largest_fitting_chunk(
    kernel: WalkerParallel, jitted: Callable[[Options], Any], mesh: Mesh, dyn: tuple[Any, ...], n_valid: Any
) -> tuple[Callable[..., Any], int | None]:
    """``batch_size="auto"``: the largest chunk whose compiled per-device bytes fit the budget.

    Candidates are all walkers of a device at once, then powers of two below that; the
    compiled memory grows with the chunk, so a bisection needs a few compilations at most
    (one when everything fits at once).
    """
    from ._memory import compiled_memory, device_memory_budget, format_bytes

    options = kernel._options
    n = kernel._walker_count(dyn) or 1
    size = _compat.axis_size(mesh, options.axis_name)
    per_device = -(-n // size)
    budget = options.memory_budget or device_memory_budget(mesh.devices.flat[0])
    candidates: list[int | None] = [1 << k for k in range(max(per_device - 1, 1).bit_length()) if 1 << k < per_device]
    candidates.append(None)  # ascending: 1, 2, 4, ..., then every walker at once
    tried: dict[int | None, tuple[Any, int]] = {}

    def needs(bs: int | None) -> int:
        if bs not in tried:
            run = jitted(dataclasses.replace(options, batch_size=bs))
            with jax.set_mesh(mesh) if _compat.context_mesh_differs(mesh) else contextlib.nullcontext():
                compiled = run.lower(dyn, n_valid).compile()
            tried[bs] = (run, compiled_memory(compiled).total_bytes)
        return tried[bs][1]

    if needs(None) <= budget:
        return tried[None][0], None
    lo, hi = -1, len(candidates) - 1  # candidates[lo] fits (-1: none known yet); candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if needs(candidates[mid]) <= budget else (lo, mid)
    if lo < 0:
        raise CallError(
            message(
                kernel._qualname,
                "batch_size='auto' found no chunk that fits the per-device memory budget: even one walker at a time "
                "needs more.",
                got=f"{format_bytes(needs(candidates[0]))} per device for batch_size={candidates[0]}, "
                f"{format_bytes(needs(None))} for all {per_device} walkers of a device at once",
                expected=f"at most {format_bytes(budget)} per device (memory_budget)",
                fix="spread the walkers over more devices, shrink the per-walker work, or raise memory_budget=.",
            )
        )
    return tried[candidates[lo]][0], candidates[lo]


@overload
def walker_parallel(fn: Callable[..., Any], /) -> WalkerParallel: ...
@overload
def walker_parallel(
    fn: None = None,
    /,
    *,
    mesh: Mesh | None = None,
    axis_name: str | tuple[str, ...] = "walkers",
    batch_size: int | str | None = None,
    batched: bool = False,
    checks: bool = True,
    memory_budget: int | None = None,
) -> Callable[[Callable[..., Any]], WalkerParallel]: ...
def walker_parallel(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    mesh: Mesh | None = None,
    axis_name: str | tuple[str, ...] = "walkers",
    batch_size: int | str | None = None,
    batched: bool = False,
    checks: bool = True,
    memory_budget: int | None = None,
) -> WalkerParallel | Callable[[Callable[..., Any]], WalkerParallel]:
    """Turn a function of ONE walker into a jitted kernel over all walkers on all devices.

    Parameters are marked ``PerWalker[...]`` (walker axis first; the body sees one
    walker), ``Replicated[...]`` (the same on every device), ``WalkerKey`` (one key from
    the caller; walker ``i`` sees ``fold_in(key, i)``) or ``Static[...]`` (hashable,
    compiled in). The return is ``PerWalker`` (default; sharded over the mesh),
    ``Mean`` or ``Sum`` (over the valid walkers; replicated), or a tuple of those.

    The call pads the walkers to the mesh, runs the body under ``shard_map`` (per-walker
    gradients with respect to replicated inputs are that walker's own), reduces, and
    un-pads, all in one jitted computation. Walkers may come as a :class:`WalkerSet`,
    whose count every ``Mean``/``Sum`` then uses and whose count the ``PerWalker``
    outputs carry back; plain arrays take ``n_valid=`` instead: walkers at index
    ``>= n_valid`` are padding and never enter ``Mean``/``Sum``. Inside the body,
    :data:`all_walkers` gives statistics over all valid walkers.

    Parameters without a marker are reported when the kernel is first called (a
    ``replicated_args`` stacked above may still name them).

    Args:
        fn: the per-walker function (or a block function with ``batched=True``).
        mesh: the mesh; ``None`` resolves it at each call (``sv.use_mesh``, else JAX's
            ``jax.set_mesh`` context, else all devices).
        axis_name: the walker axis of the mesh, or a tuple of axes that the walkers are
            split over together (e.g. ``("hosts", "local")``).
        batch_size: process each device's walkers this many at a time
            (``folx.batched_vmap``), bounding memory by ``batch_size``. ``"auto"``: the
            largest chunk (all walkers at once, or a power of two) whose compiled
            per-device bytes fit ``memory_budget``, chosen once per argument shape when
            the kernel compiles and recorded in ``chosen_batch_sizes``.
        batched: ``fn`` already takes a block of walkers (axis 0); ``WalkerKey`` then
            arrives as a block of keys, ``Mean``/``Sum`` outputs are per-walker rows, and
            a ``Replicated`` output is returned as the block function computed it (for
            results of :data:`all_walkers`). Not combinable with ``batch_size``.
        checks: check shapes at trace time (free at run time).
        memory_budget: bytes per device for ``batch_size="auto"``; default: what JAX
            reports for the device, or a share of host RAM for CPU devices.

    Returns:
        A :class:`WalkerParallel` (or a decorator, when called with options only).

    Raises:
        DecorationError: a misplaced marker, a parameter named ``n_valid``, an
            unresolvable annotation, ``batched=True`` with ``batch_size``, or a
            ``Replicated`` return without ``batched=True`` (a parameter without a marker:
            at the first call).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel
        ... def energy(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        ...     return alpha * jnp.sum(r**2)
        >>> float(energy(jnp.float32(0.5), jnp.ones((10, 2, 3))))
        3.0
    """
    options = Options(
        axis_name=axis_name, batch_size=batch_size, batched=batched, checks=checks, memory_budget=memory_budget
    )
    if batch_size not in (None, "auto") and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
    ):
        raise ValueError(f"walker_parallel: batch_size must be a positive int, 'auto' or None, got {batch_size!r}.")
    if memory_budget is not None and batch_size != "auto":
        raise DecorationError(
            message(
                "walker_parallel",
                "memory_budget= is given without batch_size='auto', the only option that reads it.",
                fix="add batch_size='auto', or drop memory_budget.",
            )
        )
    if batched and batch_size is not None:
        raise DecorationError(
            message(
                "walker_parallel",
                f"batched=True with batch_size={batch_size}: a batched function takes each device's whole block, "
                "so there is nothing for batch_size to chunk.",
                fix="drop batch_size (chunk inside the block function yourself, e.g. with jax.lax.map), or write "
                "the function for one walker and keep batch_size.",
            )
        )
    if not isinstance(axis_name, str) and not (
        isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name)
    ):
        raise DecorationError(
            message(
                "walker_parallel",
                "axis_name must be a mesh axis name or a tuple of them.",
                got=repr(axis_name),
                fix='pass e.g. axis_name="walkers", or axis_name=("hosts", "local") to split walkers over both.',
            )
        )

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


class _ReplicatedArgs:
    """What ``replicated_args(...)`` returns: applies its names to any number of functions."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def __call__(self, fn: Callable[..., Any]) -> Any:
        if isinstance(fn, WalkerParallel):
            return fn._with_replicated(self.names)
        if isinstance(fn, _ReplicatedFn):
            return _ReplicatedFn(fn.__wrapped__, fn.names | self.names)
        if not callable(fn):
            raise TypeError(f"replicated_args: expected a function, got {type(fn).__name__}.")
        parse(fn, getattr(fn, "__qualname__", repr(fn)), self.names)  # report unknown names now
        return _ReplicatedFn(fn, self.names)

    def __repr__(self) -> str:
        return f"replicated_args({', '.join(map(repr, sorted(self.names)))})"


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
