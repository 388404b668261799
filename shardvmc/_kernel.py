"""The kernel engine: from a per-walker function and its layout to one jittable computation.

The computation pads the walkers to the mesh, runs the function on each device's
walkers inside ``shard_map`` (vmapped, chunked with ``folx.batched_vmap``, or as a
block), reduces ``Mean``/``Sum`` outputs over the valid walkers, and un-pads.
"""

from __future__ import annotations

import contextvars
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import chex
import folx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat
from ._errors import CallError, message
from ._markers import Kind, Layout, Param
from ._placement import pad_n_walkers, pad_walker, walker_keys
from ._reductions import masked_sum, mean_of

__all__ = ["Options", "build", "explain_call_error", "inside_kernel", "leading_count", "output_shardings"]

_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("shardvmc_inside_kernel", default=False)


class PaddingWarning(UserWarning):
    """A walker count the mesh does not divide was padded inside the kernel."""


def inside_kernel() -> bool:
    """Whether we are tracing the body of a walker-parallel kernel."""
    return _INSIDE.get()


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of ``walker_parallel`` that shape the kernel."""

    axis_name: str = "walkers"
    batch_size: int | None = None
    batched: bool = False
    checks: bool = True


def _describe(tree: Any) -> str:
    return str(jax.tree_util.tree_map(lambda x: f"{getattr(x, 'dtype', type(x).__name__)}{list(jnp.shape(x))}", tree))


def _check_inputs(qualname: str, layout: Layout, dyn: tuple[Any, ...], params: tuple[Any, ...]) -> int:
    """Trace-time checks of the inputs; returns the walker count."""
    first: tuple[str, str, int] | None = None
    for p, arg in zip(params, dyn):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if not hasattr(leaf, "shape"):
                raise CallError(
                    message(
                        qualname,
                        f"parameter {p.name!r}{jax.tree_util.keystr(path)} is not an array.",
                        got=type(leaf).__name__,
                        fix="pass arrays, or mark the parameter Static.",
                    )
                )
            if p.kind is Kind.KEY:
                _check_key(qualname, p.name, leaf)
            if p.kind is not Kind.PER_WALKER:
                continue
            if leaf.ndim == 0:
                raise CallError(
                    message(
                        qualname,
                        f"PerWalker parameter {p.name!r}{jax.tree_util.keystr(path)} is a scalar (no walker axis).",
                        got=f"shape {tuple(leaf.shape)}",
                        fix="give it a leading walker axis (a Python list is a pytree of scalars: convert it with "
                        "jnp.asarray), or mark the parameter Replicated.",
                    )
                )
            where = f"{p.name!r}{jax.tree_util.keystr(path)}"
            if first is None:
                first = (where, p.name, leaf.shape[0])
            elif leaf.shape[0] != first[2]:
                raise CallError(
                    message(
                        qualname,
                        f"PerWalker arguments {first[0]} and {where} have different walker counts.",
                        got=f"{first[0]} has {first[2]} walkers (leading axis), {where} has {leaf.shape[0]}",
                        expected="one leading walker size for every PerWalker leaf",
                        fix="pass the same walkers to every PerWalker parameter, walker axis first.",
                    )
                )
    if first is None:
        raise CallError(
            message(
                qualname,
                "no PerWalker argument, so the number of walkers is unknown.",
                fix="mark at least one parameter PerWalker[...].",
            )
        )
    if first[2] == 0:
        raise CallError(
            message(qualname, f"PerWalker argument {first[0]} holds zero walkers.", fix="pass at least one walker.")
        )
    return int(first[2])


def _check_outputs(qualname: str, out: Any) -> None:
    """Trace-time check that every output leaf is an array (or a number)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        try:
            jax.typeof(leaf)
        except TypeError:
            raise CallError(
                message(
                    qualname,
                    f"output{jax.tree_util.keystr(path)} is not an array.",
                    got=type(leaf).__name__,
                    fix="return arrays or numbers only; keep other results out of walker-parallel functions.",
                )
            ) from None


def explain_call_error(qualname: str, params: tuple[Param, ...], dyn: tuple[Any, ...], mesh: Mesh) -> CallError | None:
    """The shardvmc error behind JAX rejecting a kernel's arguments, or ``None``.

    Runs only after ``jax.jit`` refused the arguments, so the happy path pays nothing:
    finds a leaf that is no JAX type (a string, an object array), or an array committed
    to devices other than those of ``mesh``.
    """
    devices = set(mesh.devices.flat)
    for p, arg in zip(params, dyn):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            where = f"{p.kind.value} parameter {p.name!r}{jax.tree_util.keystr(path)}"
            try:
                jax.typeof(leaf)
            except TypeError as err:
                return CallError(
                    message(
                        qualname,
                        f"{where} is not an array.",
                        got=f"{type(leaf).__name__} ({err})",
                        fix="pass arrays or numbers, or mark the parameter Static if it holds a hashable setting.",
                    )
                )
            if isinstance(leaf, jax.Array) and leaf.committed and leaf.sharding.device_set != devices:
                return CallError(
                    message(
                        qualname,
                        f"{where} lives on other devices than the mesh of the call.",
                        got=f"devices {sorted(d.id for d in leaf.sharding.device_set)}",
                        expected=f"devices {sorted(d.id for d in devices)} (mesh {dict(mesh.shape)})",
                        fix="place it on the call's mesh (sv.shard_walker(x, mesh) for PerWalker, sv.replicate(x, "
                        "mesh) otherwise), or call under sv.use_mesh(mesh) with the mesh the arrays live on.",
                    )
                )
    return None


def _check_key(qualname: str, name: str, key: Any) -> None:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.ndim == 0:
            return
    elif key.dtype == jnp.uint32 and key.ndim == 1:
        return
    raise CallError(
        message(
            qualname,
            f"WalkerKey parameter {name!r} is not a single PRNG key.",
            got=f"{key.dtype}{list(key.shape)}",
            expected="one key: jax.random.key(seed) (typed, shape ()) or jax.random.PRNGKey(seed) (uint32[2])",
            fix="pass ONE key; shardvmc derives walker i's key as fold_in(key, i).",
        )
    )


def _output_kinds(layout: Layout, out: Any, qualname: str) -> tuple[Kind, ...] | None:
    if isinstance(layout.output, Kind):
        return None
    if not isinstance(out, tuple) or len(out) != len(layout.output):
        raise CallError(
            message(
                qualname,
                f"the return annotation marks a tuple of {len(layout.output)} outputs, but the function returned "
                f"{f'a tuple of {len(out)}' if isinstance(out, tuple) else 'no tuple'}.",
                got=_describe(out),
                fix="return a tuple matching the annotation.",
            )
        )
    return layout.output


def _spec(kind: Kind, axis_name: str) -> PartitionSpec:
    """``P(axis_name)`` for per-walker data; everything else is replicated."""
    return PartitionSpec(axis_name) if kind is Kind.PER_WALKER else PartitionSpec()


def _per_output(layout: Layout, of: Callable[[Kind], Any]) -> Any:
    """``of(kind)`` for the one output kind, or a tuple of them for a tuple output."""
    return of(layout.output) if isinstance(layout.output, Kind) else tuple(of(k) for k in layout.output)


def output_shardings(layout: Layout, mesh: Mesh, axis_name: str) -> Any:
    """The shardings of the outputs: ``P(axis_name)`` per walker, replicated for ``Mean``/``Sum``.

    Given to ``jax.jit`` as ``out_shardings`` so that the walker sharding is kept
    literally, also on a one-device mesh (where XLA would otherwise report ``P()``).
    """
    return _per_output(layout, lambda kind: NamedSharding(mesh, _spec(kind, axis_name)))


def build(
    fn: Callable[..., Any],
    layout: Layout,
    statics: tuple[Any, ...],
    mesh: Mesh,
    options: Options,
    qualname: str,
) -> Callable[[tuple[Any, ...], Any], Any]:
    """The computation ``run(dynamic_args, n_valid)`` for one mesh and one set of statics.

    ``dynamic_args`` are the non-static arguments in parameter order; ``n_valid`` is
    ``None`` (all walkers valid) or an int scalar (array or tracer).
    """
    axis = options.axis_name
    size = _compat.axis_size(mesh, axis)
    dyn_params = tuple(p for p in layout.params if p.kind is not Kind.STATIC)
    kinds = tuple(p.kind for p in dyn_params)
    order = [p.kind is Kind.STATIC for p in layout.params]
    in_axes = tuple(0 if k in (Kind.PER_WALKER, Kind.KEY) else None for k in kinds)
    out_specs = _per_output(layout, lambda kind: _spec(kind, axis))

    def call(*dyn: Any) -> Any:
        it_dyn, it_static = iter(dyn), iter(statics)
        out = fn(*(next(it_static) if is_static else next(it_dyn) for is_static in order))
        if options.checks:
            _check_outputs(qualname, out)
        return out

    if options.batched:
        mapped = call
    elif options.batch_size:
        mapped = folx.batched_vmap(call, options.batch_size, in_axes=in_axes)
    else:
        mapped = jax.vmap(call, in_axes=in_axes)

    def run(dyn: tuple[Any, ...], n_valid: Any) -> Any:
        n = _check_inputs(qualname, layout, dyn, dyn_params) if options.checks else _walker_count(dyn, kinds)
        n_pad = pad_n_walkers(n, size)
        n_local = n_pad // size
        if n_pad != n:
            code = getattr(fn, "__code__", None)
            warnings.warn_explicit(
                f"{qualname}: {n} walkers do not split evenly over the {size} devices of mesh axis {axis!r}; "
                f"they were padded to {n_pad} inside the kernel, and per-walker outputs of {n} walkers cannot stay "
                "evenly sharded. Keep a padded walker set instead: `walkers, n_valid = sv.pad_walker(walkers, "
                f"sv.pad_n_walkers({n}, {size}))` and call with n_valid=n_valid.",
                PaddingWarning,
                filename=code.co_filename if code else "<shardvmc>",
                lineno=code.co_firstlineno if code else 0,
                module=getattr(fn, "__module__", None),
            )
            # An uneven count cannot be sharded, so these inputs are replicated: pad them replicated and
            # shard_map slices locally (left free, XLA sharded the padding and all-gathered it back).
            replicated = NamedSharding(mesh, PartitionSpec())
            dyn = tuple(
                jax.lax.with_sharding_constraint(pad_walker(a, n_pad)[0], replicated) if k is Kind.PER_WALKER else a
                for a, k in zip(dyn, kinds)
            )
        masked = n_valid is not None or n_pad != n
        count = n if n_valid is None else n_valid

        def body(dyn: tuple[Any, ...], count: Any) -> Any:
            first = jax.lax.axis_index(axis) * n_local
            indices = first + jnp.arange(n_local)
            dyn = tuple(
                walker_keys(a, indices) if k is Kind.KEY else _compat.to_varying(a, axis) if k is Kind.REPLICATED else a
                for a, k in zip(dyn, kinds)
            )
            token = _INSIDE.set(True)
            try:
                out = mapped(*dyn)
            finally:
                _INSIDE.reset(token)
            mask = indices < count if masked else None
            per_output = _output_kinds(layout, out, qualname)
            if per_output is None:
                return _finish(out, layout.output, mask, count, n_local)
            return tuple(_finish(o, k, mask, count, n_local) for o, k in zip(out, per_output))

        def _finish(out: Any, kind: Kind, mask: Any, count: Any, n_local: int) -> Any:
            if options.checks and options.batched:
                try:
                    chex.assert_tree_shape_prefix(out, (n_local,))
                except AssertionError as err:
                    raise CallError(
                        message(
                            qualname,
                            f"with batched=True, every {kind.value} output needs the walker axis first.",
                            got=f"block of {n_local} walkers, outputs {_describe(out)} ({err})",
                            fix="return one row per walker of the block.",
                        )
                    ) from None
            if kind is Kind.PER_WALKER:
                return out
            total = jax.tree_util.tree_map(lambda x: jax.lax.psum(masked_sum(x, mask), axis), out)
            if kind is Kind.SUM:
                return total
            return mean_of(total, count)

        kernel = _compat.shard_map(
            body, mesh, in_specs=(tuple(_spec(k, axis) for k in kinds), PartitionSpec()), out_specs=out_specs
        )
        out = kernel(dyn, jnp.asarray(count, jnp.int32))
        if n_pad == n:
            return out
        if isinstance(layout.output, Kind):
            return _unpad(out, n) if layout.output is Kind.PER_WALKER else out
        return tuple(_unpad(o, n) if k is Kind.PER_WALKER else o for o, k in zip(out, layout.output))

    return run


def _unpad(tree: Any, n: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x[:n], tree)


def leading_count(arg: Any) -> int | None:
    """Leading size of the first leaf of a PerWalker argument, unchecked (``None``: no axis).

    On the per-call path: an argument that is one array costs one attribute lookup.
    """
    shape = getattr(arg, "shape", None)
    if shape is None:
        leaves = jax.tree_util.tree_leaves(arg)
        shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape else None


def _walker_count(dyn: tuple[Any, ...], kinds: tuple[Kind, ...]) -> int:
    """The walker count without the checks (``checks=False``)."""
    for a, k in zip(dyn, kinds):
        n = leading_count(a) if k is Kind.PER_WALKER else None
        if n is not None:
            return n
    raise CallError("no PerWalker argument, so the number of walkers is unknown.")
