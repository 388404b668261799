"""The kernel engine: from a per-walker function and its layout to one jittable computation.

Every kernel shardvmc builds goes through :func:`build`: the decorators, the functional
vmaps, walker initialisation and the reductions. The computation pads the walkers to
the mesh, runs the function on each device's walkers inside ``shard_map`` (under the
one engine rule of ``_compat``), vmapped, chunked with ``folx.batched_vmap`` or as a
block, derives walker ``i``'s key as ``fold_in(key, i)``, reduces ``Mean``/``Sum``
outputs over the valid walkers with one all-reduce, and un-pads.
"""

from __future__ import annotations

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
from ._placement import pad_n_walkers, pad_walker
from ._stats import Body, body_context, current_body, local_indices, mean_of, reduce_blocks, row_sum

__all__ = [
    "LOCAL_AXIS",
    "Options",
    "PaddingWarning",
    "build",
    "explain_call_error",
    "inside_kernel",
    "leading_count",
    "output_shardings",
    "signature_of",
    "spec",
]

LOCAL_AXIS = "_shardvmc_walker"
"""The name of the vmap axis of a per-walker body (for in-body statistics)."""


class PaddingWarning(UserWarning):
    """A walker count the mesh does not divide was padded inside the kernel."""


def inside_kernel() -> str | None:
    """The mode of the kernel body being traced (``"walker"``, ``"block"``, ``"chunk"``), or ``None``."""
    body = current_body()
    return None if body is None else body.mode


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of ``walker_parallel`` that shape the kernel."""

    axis_name: str | tuple[str, ...] = "walkers"
    batch_size: int | str | None = None  # an int, None (all at once) or "auto" (chosen per shape)
    batched: bool = False
    checks: bool = True
    memory_budget: int | None = None  # bytes per device for batch_size="auto" (None: the device's)


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


def spec(kind: Kind, axis_name: str | tuple[str, ...]) -> PartitionSpec:
    """``P(axis_name)`` for per-walker data; everything else is replicated."""
    return PartitionSpec(axis_name) if kind is Kind.PER_WALKER else PartitionSpec()


def _per_output(layout: Layout, of: Callable[[Kind], Any]) -> Any:
    """``of(kind)`` for the one output kind, or a tuple of them for a tuple output."""
    return of(layout.output) if isinstance(layout.output, Kind) else tuple(of(k) for k in layout.output)


def output_shardings(layout: Layout, mesh: Mesh, axis_name: str | tuple[str, ...]) -> Any:
    """The shardings of the outputs: ``P(axis_name)`` per walker, replicated otherwise.

    Given to ``jax.jit`` as ``out_shardings`` so that the walker sharding is kept
    literally, also on a one-device mesh (where XLA would otherwise report ``P()``).
    """
    return _per_output(layout, lambda kind: NamedSharding(mesh, spec(kind, axis_name)))


def _axes(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _walker_keys(key: jax.Array, indices: jax.Array) -> jax.Array:
    """One key per walker: ``fold_in(key, i)`` for each global walker index ``i``.

    Depending only on the global index, not on the device, makes every random stream
    independent of the number of devices.
    """
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, indices)


def _map(
    call: Callable[..., Any], in_axes: tuple[int | None, ...], options: Options, count: Any, axes: tuple[str, ...]
):
    """How the body runs on one device's walkers: ``mapped(valid, *dyn)``."""
    if options.batched:

        def block(valid: Any, *dyn: Any) -> Any:
            with body_context(Body("block", axes, valid, count)):
                return call(*dyn)

        return block
    if options.batch_size:

        def chunk(*dyn: Any) -> Any:
            with body_context(Body("chunk", axes, None, count)):
                return call(*dyn)

        chunked = folx.batched_vmap(chunk, options.batch_size, in_axes=in_axes)
        return lambda valid, *dyn: chunked(*dyn)

    def walker(valid: Any, *dyn: Any) -> Any:
        with body_context(Body("walker", (LOCAL_AXIS, *axes), valid, count)):
            return call(*dyn)

    return jax.vmap(walker, in_axes=(0, *in_axes), axis_name=LOCAL_AXIS)


def build(
    fn: Callable[..., Any],
    layout: Layout,
    statics: tuple[Any, ...],
    mesh: Mesh,
    options: Options,
    qualname: str,
) -> Callable[[tuple[Any, ...], Any], Any]:
    """The computation ``run(dynamic_args, n_valid)`` for one mesh and one set of statics.

    ``dynamic_args`` are the non-static arguments in parameter order (walker data, not
    ``WalkerSet``s); ``n_valid`` is ``None`` (all walkers valid) or an int scalar (array
    or tracer).
    """
    axis = options.axis_name
    axes = _axes(axis)
    size = _compat.axis_size(mesh, axis)
    explicit = _compat.has_explicit_axes(mesh, axes)
    dyn_params = tuple(p for p in layout.params if p.kind is not Kind.STATIC)
    kinds = tuple(p.kind for p in dyn_params)
    order = [p.kind is Kind.STATIC for p in layout.params]
    in_axes = tuple(0 if k in (Kind.PER_WALKER, Kind.KEY) else None for k in kinds)
    in_specs = tuple(spec(k, axis) for k in kinds)
    out_specs = _per_output(layout, lambda kind: spec(kind, axis))

    def call(*dyn: Any) -> Any:
        it_dyn, it_static = iter(dyn), iter(statics)
        out = fn(*(next(it_static) if is_static else next(it_dyn) for is_static in order))
        if options.checks:
            _check_outputs(qualname, out)
        return out

    def run(dyn: tuple[Any, ...], n_valid: Any) -> Any:
        n = _check_inputs(qualname, layout, dyn, dyn_params) if options.checks else _walker_count(dyn, kinds)
        n_pad = pad_n_walkers(n, size)
        n_local = n_pad // size
        if n_pad != n:
            _warn_padding(fn, qualname, layout, n, n_pad, size, axis)
            # An uneven count cannot be sharded, so these inputs are replicated: pad them replicated and
            # shard_map slices locally (left free, XLA sharded the padding and all-gathered it back).
            replicated = NamedSharding(mesh, PartitionSpec())
            dyn = tuple(
                _compat.constrain(pad_walker(a, n_pad)[0], replicated) if k is Kind.PER_WALKER else a
                for a, k in zip(dyn, kinds)
            )
        elif explicit:
            dyn = tuple(_compat.constrain(a, NamedSharding(mesh, s)) for a, s in zip(dyn, in_specs))
        masked = n_valid is not None or n_pad != n
        count = n if n_valid is None else n_valid

        def body(dyn: tuple[Any, ...], count: Any) -> Any:
            indices = local_indices(axes, n_local)
            mask = indices < count if masked else None  # None: no padding, nothing to mask (and no copy)
            dyn = tuple(_walker_keys(a, indices) if k is Kind.KEY else a for a, k in zip(dyn, kinds))
            out = _map(call, in_axes, options, count, axes)(mask, *dyn)
            per_output = _output_kinds(layout, out, qualname)
            if per_output is None:
                return _finish(out, layout.output, mask, count)
            return tuple(_finish(o, k, mask, count) for o, k in zip(out, per_output))

        def _finish(out: Any, kind: Kind, mask: Any, count: Any) -> Any:
            if kind is Kind.REPLICATED:
                return out
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
            total = reduce_blocks(row_sum, (out,), mask, axes)
            return total if kind is Kind.SUM else mean_of(total, count)

        kernel = _compat.shard_map(body, mesh, in_specs=(in_specs, PartitionSpec()), out_specs=out_specs)
        out = kernel(dyn, jnp.asarray(count, jnp.int32))
        if n_pad == n:
            return out
        if isinstance(layout.output, Kind):
            return _unpad(out, n) if layout.output is Kind.PER_WALKER else out
        return tuple(_unpad(o, n) if k is Kind.PER_WALKER else o for o, k in zip(out, layout.output))

    return run


def _warn_padding(
    fn: Callable[..., Any], qualname: str, layout: Layout, n: int, n_pad: int, size: int, axis: Any
) -> None:
    code = getattr(fn, "__code__", None)
    has_per_walker = Kind.PER_WALKER in (layout.output if isinstance(layout.output, tuple) else (layout.output,))
    consequence = (
        f"per-walker outputs of {n} walkers cannot stay evenly sharded"
        if has_per_walker
        else "the inputs were replicated to pad them"
    )
    warnings.warn_explicit(
        f"{qualname}: {n} walkers do not split evenly over the {size} devices of mesh axis {axis!r}; they were "
        f"padded to {n_pad} inside the kernel, and {consequence}. Keep a padded walker set instead: "
        f"`walkers = sv.WalkerSet(*sv.pad_walker(walkers, sv.pad_n_walkers({n}, {size})))` "
        "(or initialise with sv.initialize_walkers_sharded, which pads for you).",
        PaddingWarning,
        filename=code.co_filename if code else "<shardvmc>",
        lineno=code.co_firstlineno if code else 0,
        module=getattr(fn, "__module__", None),
    )


def _unpad(tree: Any, n: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x[:n], tree)


def signature_of(dyn: tuple[Any, ...]) -> tuple[Any, ...]:
    """The abstract signature (structure, shapes, dtypes) of a kernel's dynamic arguments."""
    leaves, tree = jax.tree_util.tree_flatten(dyn)
    return (tree, tuple((jnp.shape(x), getattr(x, "dtype", type(x))) for x in leaves))


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
