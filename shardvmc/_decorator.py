"""``walker_parallel`` and ``replicated_args``: per-walker functions to distributed kernels."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh

from . import _compat
from ._caches import bounded, register_kernel
from ._compat import CONTEXT_MESH, NO_CONTEXT_MESH
from ._errors import ArgumentsError, CallError, DecorationError, ShardvmcError, UnhashableStaticError, message
from ._internals import tracing
from ._kernel import (
    TRACED,
    Options,
    argument_mesh_error,
    call_with,
    check_inputs,
    inside_kernel,
    partition,
    raised_in_body,
)
from ._markers import Kind, Layout, missing_markers_error, parse
from ._mesh import CHOSEN_MESH, call_mesh, entered_mesh, mesh_of_arrays, onto_mesh
from ._plan import KernelSpec, Plan, PlanKey, auto_signature, make_plan, pinned_out_shardings, raise_if_disagree
from ._platform import compiling_for, mesh_platform
from ._stats import BODY_VAR
from ._walkerset import WalkerSet, check_n_valid, first_count, split_walker_set

if TYPE_CHECKING:
    from ._explain import Explanation

__all__ = ["WalkerParallel", "kernel_of", "replicated_args", "walker_parallel"]

# Argument types seen to be arrays (or tracers, numbers): nothing to split off, no flattening on the per-call
# path. Learnt as arguments arrive (building a jax.Array here would start a backend at import).
_ARRAY_TYPES: set[type] = {np.ndarray, float, int, complex, bool}


def _is_leaf_type(x: Any) -> bool:
    kind = type(x)
    if kind in _ARRAY_TYPES:
        return True
    if isinstance(x, (jax.Array, np.generic)):
        _ARRAY_TYPES.add(kind)
        return True
    return False


# Set on an exception that left the fast path's trace: the engine or the user's function raised it, already explained.
_TRACED_ERROR = "_shardvmc_traced"
_ELSEWHERE = "_shardvmc_elsewhere"  # arguments on a mesh of another size: eagerly, _recover may run them there


@bounded(64)
def _count_scalar(n_valid: int) -> np.int32:
    """``n_valid`` as one int32 for every count's program (NumPy's conversion costs 0.3 us per call)."""
    return np.int32(n_valid)


def _n_valid_conflict(qualname: str, n_valid: Any, count: int) -> CallError:
    return CallError(
        message(
            qualname,
            "n_valid= disagrees with the count the WalkerSet argument carries.",
            got=f"n_valid={n_valid!r}, WalkerSet.n_valid={count}",
            fix="drop n_valid= (the WalkerSet knows its count), or pass walkers.replace(n_valid=...).",
        )
    )


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
        self._plans: dict[tuple[Any, ...], Plan] = {}  # by PlanKey, held as a plain tuple (cheaper to build)
        self._jits: dict[tuple[Mesh, Any], Any] = {}  # the kernel's jax.jit per (mesh, walker axes)
        self._calls: dict[Any, tuple[Any, Mesh, Mesh | None]] = {}  # call_mesh's answer and its jit (__call__)
        register_kernel(self)
        if layout is None:
            # Unmarked parameters are reported at the first call: a replicated_args(...) stacked above may
            # still name them (Python applies it after this decorator).
            layout, self._missing = parse(fn, self._qualname, replicated)
        self._layout = layout
        self._spec = KernelSpec.of(fn, layout, options, self._qualname)
        self._no_parts: tuple[None, ...] = (None,) * len(self._spec.dyn_idx)
        self._auto = options.batch_size == "auto"
        self._walker_args = tuple(self._spec.dyn_idx[j] for j in self._spec.walker_idx)  # positions of PerWalker
        # A call with every argument positional skips Signature.bind (the common case). -1 matches no call: with a
        # missing marker, or keyword-only parameters, every call goes through _arguments.
        positional = all(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in layout.signature.parameters.values()
        )
        self._n_params = len(layout.signature.parameters) if positional and not self._missing else -1
        outputs_ = layout.output if isinstance(layout.output, tuple) else (layout.output,)
        # Whether the program also returns the cross-device comparison of Replicated outputs (see Plan).
        self._verify = options.batched and options.checks and Kind.REPLICATED in outputs_
        outputs = layout.output if isinstance(layout.output, tuple) else (layout.output,)
        if Kind.REPLICATED in outputs and not options.batched:
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

    @property
    def chosen_batch_sizes(self) -> dict[Any, int | None]:
        """With ``batch_size="auto"``: the chunk chosen for each argument signature (``None``: all at once)."""
        return {p.key.signature: p.batch_size for p in self._plans.values() if p.key.signature is not None}

    def with_options(self, **options: Any) -> WalkerParallel:
        """The same function as a kernel with other options (those of :func:`walker_parallel`).

        Example:
            >>> import jax, jax.numpy as jnp, shardvmc as sv
            >>> @sv.walker_parallel
            ... def energy(r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
            ...     return jnp.sum(r**2)
            >>> chunked = energy.with_options(batch_size=2)
            >>> float(chunked(jnp.ones((16, 3)))) == float(energy(jnp.ones((16, 3))))
            True
        """
        current = {"mesh": self._mesh, **dataclasses.asdict(self._options)}
        unknown = set(options) - set(current)
        if unknown:
            raise DecorationError(f"{self._qualname}.with_options: unknown options {sorted(unknown)}.")
        current.update(options)
        mesh = current.pop("mesh")
        return walker_parallel(mesh=mesh, **current)(
            _ReplicatedFn(self.__wrapped__, self._replicated) if self._replicated else self.__wrapped__
        )

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The call's arguments in parameter order (keyword-only and positional-only ones included)."""
        if self._missing:
            raise missing_markers_error(self._qualname, self._missing)
        try:
            bound = self._layout.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise ArgumentsError(
                message(
                    self._qualname,
                    f"the arguments do not match the function's signature: {err}.",
                    got=f"{len(args)} positional argument(s), keywords {sorted(kwargs)}",
                    expected=f"the parameters {self._layout.signature} (plus the kernel's own keyword n_valid=)",
                    fix="call the kernel with the function's own parameters, walker arguments with a walker axis.",
                )
            ) from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _prepare(
        self,
        args: tuple[Any, ...],
        n_valid: Any,
        mesh: Mesh,
        axis: str | tuple[str, ...],
        parts: tuple[Any, ...] | None,
    ) -> tuple[Plan, tuple[Any, ...], Any, int | None]:
        """The plan of this call, its traced arguments, the traced ``n_valid`` (or None) and the set count.

        Runs while the call traces (and for ``explain``): JAX's cache of the kernel's jit
        decides when a call needs it.
        """
        spec = self._spec
        dyn = spec.dyn_of(args)
        wrap = None
        for j in spec.walker_idx:
            if type(dyn[j]) is WalkerSet:
                dyn, n_valid, wrap = self._walker_sets(dyn, n_valid)
                break
        if parts is None:
            parts = self._no_parts
        # The unchecked count keys the plan; the trace-time checks (checks=True) say whether every PerWalker leaf
        # agrees with it.
        n = first_count(dyn[spec.walker_idx[0]]) if spec.walker_idx else None
        if n is None:
            n = check_inputs(spec.qualname, spec.layout, dyn, spec.dyn_params)
        # A WalkerSet's count is part of its pytree structure: compiled in. An explicit n_valid= is data: one
        # program serves every value.
        key_count: int | str | None = None
        if wrap is not None:
            key_count, n_valid = (None if n_valid == n else n_valid), None
        elif n_valid is not None:
            key_count = TRACED
        key = (
            mesh,
            axis,
            spec.statics_of(args),
            parts,
            n,
            key_count,
            auto_signature(spec, dyn) if self._auto else None,
        )
        try:
            plan = self._plans[key]
        except KeyError:
            plan = self._plans[key] = make_plan(spec, PlanKey(*key), dyn, n_valid)
        return plan, dyn, n_valid, wrap

    def _partition(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """Model containers: their arrays stay traced, their other leaves key the program (``equinox`` style).

        ``None`` when no argument holds a non-array leaf.
        """
        spec = self._spec
        parts: list[Any] = [None] * len(spec.dyn_idx)
        out = list(args)
        found = False
        for j in spec.container_idx:
            i = spec.dyn_idx[j]
            if _is_leaf_type(args[i]):
                continue
            out[i], parts[j] = partition(args[i])
            found = found or parts[j] is not None
        return (tuple(out), tuple(parts)) if found else None

    def _walker_sets(self, dyn: tuple[Any, ...], n_valid: Any) -> tuple[tuple[Any, ...], Any, int | None]:
        """Unwrap ``WalkerSet`` arguments: ``(walker data, the valid count, count to wrap outputs)``."""
        count: int | None = None
        for j in self._spec.walker_idx:
            arg = dyn[j]
            if not isinstance(arg, WalkerSet):
                continue
            data, here = split_walker_set(arg, self._qualname)
            if count is not None and here != count:
                raise CallError(
                    message(
                        self._qualname,
                        "two WalkerSet arguments carry different valid counts.",
                        got=f"n_valid {count} and {here}",
                        fix="pass walker sets of the same walkers (one count).",
                    )
                )
            count = here
            dyn = (*dyn[:j], data, *dyn[j + 1 :])
        if count is None:
            return dyn, n_valid, None
        if n_valid is not None:
            raise _n_valid_conflict(self._qualname, n_valid, count)
        return dyn, count, count

    def _unhashable(self, args: tuple[Any, ...], parts: Any) -> CallError | None:
        """The error for a value that cannot key the compilation, or ``None`` when every value can."""
        for p, value in zip(self._spec.static_params, self._spec.statics_of(args)):
            try:
                hash(value)
            except TypeError:
                return UnhashableStaticError(
                    message(
                        self._qualname,
                        f"Static parameter {p.name!r} received an unhashable value, which cannot key the compilation.",
                        got=f"{type(value).__name__}",
                        fix="pass a hashable value (a tuple instead of a list, a frozen dataclass), or mark the "
                        "parameter Replicated if it holds arrays.",
                    )
                )
        for p, part in zip(self._spec.dyn_params, parts or ()):
            if part is None:
                continue
            treedef, static = cast(tuple[Any, tuple[Any, ...]], part)
            paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(
                jax.tree_util.tree_unflatten(treedef, list(static)))[0]]  # fmt: skip
            for path, leaf in zip(paths, static):
                try:
                    hash(leaf)
                except TypeError:
                    return UnhashableStaticError(
                        message(
                            self._qualname,
                            f"{p.kind.value} parameter {p.name!r}{path} holds a {type(leaf).__name__}, which is no "
                            "array, so it is compiled in and keys the compilation by equality; it is unhashable.",
                            fix="store settings as hashable values (tuples, frozen dataclasses, equinox's "
                            "eqx.field(static=True)), or as arrays if they should be traced.",
                        )
                    )
        return None

    def __call__(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> Any:
        # The one call path: everything below is a few lookups, then one jax.jit of the kernel per mesh, whose
        # C++ dispatch checks a repeated signature. The plan (checks, padding, chunking, the program) is made
        # while that jit traces (_traced), so it runs once per signature, eager or inside any transform.
        body = BODY_VAR.get()
        if body is not None:
            return self._nested_call(body.mode, args, kwargs)
        if kwargs or len(args) != self._n_params:
            args = self._arguments(args, kwargs)
        # Where the call computes (call_mesh) depends on the chosen mesh, the context mesh and, under a context
        # of other devices, whether the call is traced: kept per those, so a repeated call skips call_mesh.
        context = CONTEXT_MESH.value
        chosen = self._mesh if self._mesh is not None else CHOSEN_MESH.get()
        if context is None or context is NO_CONTEXT_MESH or context.empty:  # _compat.context_mesh(), inlined
            key = chosen
        else:
            key = (chosen, context, tracing())
        try:
            jitted, mesh, enter = self._calls[key]
        except (KeyError, TypeError):  # TypeError: no mesh at all (a list of devices, say): call_mesh explains
            jitted, mesh, enter = self._resolve(key)
        if n_valid is not None:
            n_valid = self._n_valid_argument(args, n_valid)
        try:
            if enter is None:
                out = jitted(*args) if n_valid is None else jitted(*args, n_valid=n_valid)
            else:
                args = onto_mesh(enter, args)
                with entered_mesh(enter):
                    out = jitted(*args) if n_valid is None else jitted(*args, n_valid=n_valid)
        except Exception as err:
            out = self._recover(err, jitted, args, n_valid, mesh, enter)
        if self._verify:
            out, agree = out
            if agree is not None and not isinstance(agree, Tracer):
                raise_if_disagree(self._spec, agree)
        return out

    def clear_cache(self) -> None:
        """Forget this kernel's plans and programs (``sv.clear_caches`` calls it for every kernel)."""
        self._plans.clear()
        self._jits.clear()
        self._calls.clear()

    def _resolve(self, key: Any) -> tuple[Any, Mesh, Mesh | None]:
        """The jit, mesh and mesh to enter of a call (``call_mesh``), kept under ``key`` when it is hashable."""
        mesh, axis, enter = call_mesh(self._mesh, self._options.axis_name, self._qualname)
        found = (self._jits.get((mesh, axis)) or self._jit_for(mesh, axis), mesh, enter)
        if len(self._calls) > 64:  # meshes and contexts are few; a program that builds many keeps this bounded
            self._calls.clear()
        with contextlib.suppress(TypeError):
            self._calls[key] = found
        return found

    def _jit_for(self, mesh: Mesh, axis: str | tuple[str, ...]) -> Any:
        """The kernel's ``jax.jit`` on ``mesh`` (one per mesh and walker axes; built at their first call)."""
        shardings = pinned_out_shardings(self._layout, mesh, axis)
        if shardings is not None and self._verify:
            shardings = (shardings, None)
        jitted = jax.jit(
            functools.partial(self._traced, mesh, axis),
            static_argnums=self._spec.static_idx,
            static_argnames=("parts",),
            out_shardings=shardings,
        )
        self._jits[(mesh, axis)] = jitted
        return jitted

    def _traced(
        self, mesh: Mesh, axis: str | tuple[str, ...], *args: Any, n_valid: Any = None, parts: Any = None
    ) -> Any:
        """What the kernel's jit traces: the plan of the call, and its program."""
        # This jit is the mesh's own (one per mesh): its trace takes the mesh's platform's branches alone.
        try:
            if n_valid is not None:  # one type for every count (a caller's traced int is weakly typed)
                n_valid = jnp.asarray(n_valid, jnp.int32)
            with compiling_for(mesh_platform(mesh)):
                plan, dyn, n_valid, count = self._prepare(args, n_valid, mesh, axis, parts)
                elsewhere = argument_mesh_error(self._qualname, self._spec.dyn_params, dyn, mesh)
                if elsewhere is not None:
                    setattr(elsewhere, _ELSEWHERE, True)
                    raise elsewhere
                out, agree = plan.traced_call(dyn, n_valid)
        except Exception as err:
            setattr(err, _TRACED_ERROR, True)
            if not isinstance(err, ShardvmcError) and not raised_in_body(err):
                err.add_note(f"shardvmc: raised while tracing walker-parallel kernel {self._qualname} on mesh "
                             f"{dict(mesh.shape)}")  # fmt: skip
            raise
        if count is not None:
            out = self._wrap(out, count)
        return (out, agree) if self._verify else out

    def _recover(
        self, err: Exception, jitted: Any, args: tuple[Any, ...], n_valid: Any, mesh: Mesh, enter: Mesh | None
    ) -> Any:
        """A call that failed before or after its trace: explain it, or run the arguments jax.jit refused.

        Errors raised while tracing (the engine's, the user's function's) surface as they are.
        jax.jit refuses arguments before tracing: non-array leaves of model containers (then the
        call runs with them split off, as ``equinox.filter_jit`` does), unhashable ``Static``
        values; lowering refuses arrays on other devices than the mesh. Nothing compiles twice.
        """
        elsewhere = getattr(err, _ELSEWHERE, False)
        if (getattr(err, _TRACED_ERROR, False) or isinstance(err, ShardvmcError)) and not elsewhere:
            raise err
        split = self._partition(args) if isinstance(err, TypeError) else None
        unhashable = self._unhashable(args, split[1] if split else None)
        if unhashable is not None:
            raise unhashable from None
        if split is not None:
            dyn_args, parts = split
            with entered_mesh(enter):
                return jitted(*dyn_args, parts=parts) if n_valid is None else jitted(*dyn_args, n_valid=n_valid,
                                                                                   parts=parts)  # fmt: skip
        if elsewhere or isinstance(err, (TypeError, ValueError)):
            error = argument_mesh_error(self._qualname, self._spec.dyn_params, self._spec.dyn_of(args), mesh)
            if error is not None:
                # Walkers that another kernel left on its mesh, with no mesh chosen for this one: it runs there.
                home = mesh_of_arrays([args[i] for i in self._walker_args], self._options.axis_name)
                if self._mesh is None and home is not None and home != mesh:
                    return self._call_on(home, args, n_valid)
                raise error from (None if elsewhere else err)  # elsewhere: the same finding, seen while tracing
        err.add_note(f"shardvmc: raised while running walker-parallel kernel {self._qualname} on mesh "
                     f"{dict(mesh.shape)}")  # fmt: skip
        raise err

    def _call_on(self, mesh: Mesh, args: tuple[Any, ...], n_valid: Any) -> Any:
        """The call on ``mesh`` (where its walkers live), its other arrays moved there."""
        mesh = _compat.auto_axes_mesh(mesh)
        jitted = self._jits.get((mesh, self._options.axis_name)) or self._jit_for(mesh, self._options.axis_name)
        args = onto_mesh(mesh, args)
        return jitted(*args) if n_valid is None else jitted(*args, n_valid=n_valid)

    def _n_valid_argument(self, args: tuple[Any, ...], n_valid: Any) -> Any:
        """``n_valid=`` as the program takes it: checked and traced (an int32 scalar), or dropped for a WalkerSet.

        A concrete count is checked here, against the walker count of the arguments; a traced
        one (inside the caller's jit) is taken as it is. On the per-call path, so a Python int
        (the usual count) is checked without NumPy and converted once per value.
        """
        if isinstance(n_valid, Tracer):
            return n_valid
        walker_args = self._walker_args
        for i in walker_args:
            if type(args[i]) is WalkerSet:
                count = args[i].n_valid
                if isinstance(n_valid, (int, np.integer)) and int(n_valid) == count:
                    return None  # the set carries the same count
                raise _n_valid_conflict(self._qualname, n_valid, count)
        n = first_count(args[walker_args[0]]) if walker_args else None
        # An unknown count (the walkers are abstract, say) leaves the range to the program's own masking.
        check_n_valid(self._qualname, n_valid, sys.maxsize if n is None else n)
        return _count_scalar(n_valid) if type(n_valid) is int else np.int32(int(n_valid))

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
            return jax.tree_util.tree_map(lambda x: x[0], call_with(self.__wrapped__, self._layout, tuple(block)))
        # a per-walker function called with a block: map it over the block's walkers
        static = [p.kind is Kind.STATIC for p in self._layout.params]
        dyn = [a for a, s in zip(args, static) if not s]
        in_axes = [0 if w else None for w, s in zip(walker_axis, static) if not s]

        def one(*d: Any) -> Any:
            it, st = iter(d), iter(a for a, s in zip(args, static) if s)
            return call_with(self.__wrapped__, self._layout, tuple(next(st) if s else next(it) for s in static))

        return jax.vmap(one, in_axes=in_axes)(*dyn)

    def _plan_for(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> tuple[Plan, tuple[Any, ...], Any]:
        """The plan these arguments run with, its traced arguments and traced ``n_valid`` (for ``explain``)."""
        args = self._arguments(args, kwargs)
        mesh, axis, _ = call_mesh(self._mesh, self._options.axis_name, self._qualname)
        if n_valid is not None:
            n_valid = self._n_valid_argument(args, n_valid)
        split = self._partition(args)
        parts = None
        if split is not None:
            args, parts = split
        plan, dyn, n_valid, _ = self._prepare(args, n_valid, mesh, axis, parts)
        return plan, dyn, n_valid

    def lower(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> jax.stages.Lowered:
        """Lower the kernel for these arguments, like ``jax.jit(f).lower`` (``jax.ShapeDtypeStruct``s work too).

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> @sv.walker_parallel
            ... def square(r: sv.PerWalker) -> sv.Mean:
            ...     return r**2
            >>> "all-reduce" in square.lower(jnp.ones(8)).compile().as_text()
            True
        """
        args = self._arguments(args, kwargs)
        mesh, axis, enter = call_mesh(self._mesh, self._options.axis_name, self._qualname)
        jitted = self._jits.get((mesh, axis)) or self._jit_for(mesh, axis)
        if n_valid is not None:
            n_valid = self._n_valid_argument(args, n_valid)
        split = self._partition(args)
        kw: dict[str, Any] = {} if n_valid is None else {"n_valid": n_valid}
        if split is not None:
            args, kw["parts"] = split
        with entered_mesh(enter):
            return jitted.lower(*args, **kw)

    def explain(self, *args: Any, n_valid: Any = None, **kwargs: Any) -> Explanation:
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

        if inside_kernel() is not None:
            raise CallError(
                message(
                    self._qualname,
                    "explain() was called inside a kernel body, where there is no separate program to explain.",
                    fix="call kernel.explain(...) outside, with the arguments of the outer call.",
                )
            )
        args = self._arguments(args, kwargs)
        plan, dyn, n_valid = self._plan_for(*args, n_valid=n_valid)
        _, _, enter = call_mesh(self._mesh, self._options.axis_name, self._qualname)
        with entered_mesh(enter):
            lowered = plan.lower(dyn, n_valid)
        return explain(plan, lowered, args, dyn, n_valid, warn_key=self)

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


def kernel_of(
    fn: Callable[..., Any],
    layout: Layout,
    *,
    mesh: Mesh | None,
    options: Options,
    qualname: str | None = None,
    nested: Callable[..., Any] | None = None,
) -> WalkerParallel:
    """The package's own factory of kernels with a layout it built (reductions, vmaps, solvers, samplers).

    ``nested``: what a call from inside another kernel's body runs instead of the function.
    """
    return WalkerParallel(fn, layout, mesh=mesh, options=options, qualname=qualname, nested=nested)


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
        raise DecorationError(
            message(
                "walker_parallel",
                f"batch_size must be a positive int, 'auto' or None, got {batch_size!r}.",
                fix="pass e.g. batch_size=64 (walkers per chunk on each device), 'auto', or None (all at once).",
            )
        )
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
            raise DecorationError(f"walker_parallel: {f!r} is already walker-parallel.")
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
            raise DecorationError(f"replicated_args: expected a function, got {type(fn).__name__}.")
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
            raise DecorationError(f"replicated_args: parameter names must be strings, got {name!r}.")
    return _ReplicatedArgs(frozenset(names))
