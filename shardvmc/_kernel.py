"""The kernel engine: from a per-walker function and its layout to one jittable computation.

Every kernel shardvmc builds goes through :func:`build`: the decorators, the functional
vmaps, walker initialisation and the reductions. The computation pads the walkers to
the mesh, runs the function on each device's walkers inside ``shard_map`` (under the
one engine rule of ``_compat``), vmapped, chunked with ``folx.batched_vmap`` or as a
block, derives walker ``i``'s key as ``fold_in(key, i)``, reduces every ``Mean``/``Sum``
output over the valid walkers with one all-reduce, and un-pads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import chex
import folx
import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat
from ._errors import CallError, describe, message, warn_at_user
from ._markers import Kind, Layout, Param
from ._mesh import traced_mesh_error
from ._placement import pad_n_walkers, pad_walker
from ._stats import Body, body_context, current_body, local_indices, masked, mean_of, psum_tree, row_sum
from ._walkerset import common_count

__all__ = [
    "BODY_NOTE",
    "LOCAL_AXIS",
    "TRACED",
    "Options",
    "PaddingWarning",
    "build",
    "call_with",
    "check_inputs",
    "combine",
    "argument_mesh_error",
    "inside_kernel",
    "output_shardings",
    "partition",
    "raised_in_body",
    "signature_of",
    "spec",
]

LOCAL_AXIS = "_shardvmc_walker"
"""The name of the vmap axis of a per-walker body (for in-body statistics)."""

TRACED = "traced"
"""The valid count of a call whose ``n_valid`` is a tracer (known only when the program runs)."""

BODY_NOTE = "shardvmc: raised in the body of walker-parallel kernel"
"""How the note that the engine adds to an error of the user's own body begins."""


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


# ------------------------------------------------------------------------------------------------
# Model containers: the arrays of a Replicated/PerWalker argument are traced, the rest is compiled in.


class _Hole:
    """Where an array sat in the static part of a partitioned argument."""

    def __repr__(self) -> str:
        return "<array>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hole)

    def __hash__(self) -> int:
        return 0


_HOLE = _Hole()
_SCALARS = (int, float, complex, bool)


def _is_array(leaf: Any) -> bool:
    """Whether JAX can trace ``leaf`` (the equinox filter convention, Python numbers and abstract arrays included)."""
    return isinstance(leaf, (jax.Array, Tracer, jax.ShapeDtypeStruct, _SCALARS)) or hasattr(leaf, "__array__")


def partition(tree: Any) -> tuple[Any, tuple[Any, tuple[Any, ...]] | None]:
    """Split ``tree`` into its traced part and its compiled-in part, as ``equinox.filter_jit`` does.

    Returns ``(tree, None)`` when every leaf is an array (the common case, no copy);
    otherwise ``(tree with None for each non-array leaf, (treedef, static leaves))``,
    whose second element is hashable when the non-array leaves are (functions,
    settings), so it keys the compilation by equality.
    """
    if isinstance(tree, jax.Array):
        return tree, None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if all(_is_array(x) for x in leaves):
        return tree, None
    dynamic = [x if _is_array(x) else None for x in leaves]
    static = tuple(_HOLE if _is_array(x) else x for x in leaves)
    return jax.tree_util.tree_unflatten(treedef, dynamic), (treedef, static)


def combine(dynamic: Any, part: tuple[Any, tuple[Any, ...]] | None) -> Any:
    """The inverse of :func:`partition`: the traced part with the compiled-in leaves put back."""
    if part is None:
        return dynamic
    treedef, static = part
    traced = jax.tree_util.tree_flatten(dynamic, is_leaf=lambda x: x is None)[0]
    return jax.tree_util.tree_unflatten(treedef, [d if s is _HOLE else s for d, s in zip(traced, static)])


# ------------------------------------------------------------------------------------------------
# Checks


def check_inputs(qualname: str, layout: Layout, dyn: tuple[Any, ...], params: tuple[Param, ...]) -> int:
    """Trace-time checks of the inputs; returns the walker count."""

    def per_walker_shapes() -> Iterator[tuple[str, tuple[int, ...]]]:
        for p, arg in zip(params, dyn):
            for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
                if p.kind is Kind.KEY:
                    _check_key(qualname, p.name, leaf)
                if p.kind is not Kind.PER_WALKER:
                    continue
                shape = jnp.shape(leaf)
                if not shape:
                    raise CallError(
                        message(
                            qualname,
                            f"PerWalker parameter {p.name!r}{jax.tree_util.keystr(path)} is a scalar (no walker axis).",
                            got=f"shape {shape}",
                            fix="give it a leading walker axis (a Python list is a pytree of scalars: convert it "
                            "with jnp.asarray), or mark the parameter Replicated.",
                        )
                    )
                yield f"{p.name!r}{jax.tree_util.keystr(path)}", shape

    first = common_count(
        per_walker_shapes(),
        qualname,
        lambda a, b: f"PerWalker arguments {a} and {b} have different walker counts.",
        expected="one leading walker size for every PerWalker leaf",
        fix="pass the same walkers to every PerWalker parameter, walker axis first.",
    )
    if first is None:
        raise CallError(
            message(
                qualname,
                "no PerWalker argument, so the number of walkers is unknown.",
                fix="mark at least one parameter PerWalker[...].",
            )
        )
    if first[1] == 0:
        raise CallError(
            message(qualname, f"PerWalker argument {first[0]} holds zero walkers.", fix="pass at least one walker.")
        )
    return first[1]


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


def argument_mesh_error(qualname: str, params: tuple[Param, ...], dyn: tuple[Any, ...], mesh: Mesh) -> CallError | None:
    """The shardvmc error behind JAX refusing a kernel's arguments, or ``None``.

    Concrete arguments: a leaf that is no JAX type (a string, an object array), or an
    array committed to devices other than those of ``mesh`` (looked at only after a call
    failed outside the user's body, so the happy path pays nothing). Traced arguments
    (checked while the kernel traces): JAX types a committed array's tracer with the mesh
    it lives on, without its devices; one of another size than ``mesh`` cannot meet it in
    one program, whose devices are one set.
    """
    devices = set(mesh.devices.flat)
    for p, arg in zip(params, dyn):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            where = f"{p.kind.value} parameter {p.name!r}{jax.tree_util.keystr(path)}"
            if isinstance(leaf, Tracer):
                traced = traced_mesh_error(qualname, where, leaf, mesh)
                if traced is not None:
                    return traced
                continue
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


def raised_in_body(err: BaseException) -> bool:
    """Whether ``err`` came out of the user's own function (the engine noted it on its way out)."""
    return any(str(note).startswith(BODY_NOTE) for note in getattr(err, "__notes__", ()))


def _note_body_error(err: BaseException, qualname: str, params: tuple[Param, ...], args: tuple[Any, ...]) -> None:
    """Add where the error happened and what the body saw; the error itself stays the user's."""
    if raised_in_body(err):
        return
    mode = inside_kernel()
    seen = "one walker" if mode == "walker" else "a block of walkers" if mode == "block" else "a chunk of walkers"
    shapes = ", ".join(f"{p.name}: {describe(a)}" for p, a in zip(params, args) if p.kind is not Kind.STATIC)
    err.add_note(f"{BODY_NOTE} {qualname}, which sees {seen}; its arguments there: {shapes}")


# Keys whose draws under vmap depend on the batch size: walker streams would depend on the device count.
_BATCH_DEPENDENT_KEYS = ("rbg", "unsafe_rbg")


def _check_key(qualname: str, name: str, key: Any) -> None:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key))
        if key.ndim == 0 and impl not in _BATCH_DEPENDENT_KEYS:
            return
        if key.ndim == 0:
            raise CallError(
                message(
                    qualname,
                    f"WalkerKey parameter {name!r} is a key of the {impl} implementation, whose draws under vmap "
                    "depend on how many walkers a device holds, so the walkers' random streams would change with "
                    "the device count.",
                    fix="pass a threefry key (jax.random.key(seed), the default): walker i then draws from "
                    "fold_in(key, i) on any number of devices.",
                )
            )
    elif key.dtype == jnp.uint32 and tuple(key.shape) == (2,):
        return
    raise CallError(
        message(
            qualname,
            f"WalkerKey parameter {name!r} is not a single PRNG key.",
            got=describe(key),
            expected="one key: jax.random.key(seed) (typed, shape ()) or jax.random.PRNGKey(seed) (uint32[2])",
            fix="pass ONE key; shardvmc derives walker i's key as fold_in(key, i).",
        )
    )


def call_with(fn: Callable[..., Any], layout: Layout, args: tuple[Any, ...]) -> Any:
    """Call ``fn`` with its arguments in parameter order, keyword-only ones as keywords."""
    kw_only = layout.keyword_only
    if not kw_only:
        return fn(*args)
    n = len(args) - len(kw_only)
    return fn(*args[:n], **dict(zip(kw_only, args[n:])))


def _output_kinds(layout: Layout, out: Any, qualname: str) -> tuple[Kind, ...]:
    if isinstance(layout.output, Kind):
        return (layout.output,)
    if not isinstance(out, tuple) or len(out) != len(layout.output):
        raise CallError(
            message(
                qualname,
                f"the return annotation marks a tuple of {len(layout.output)} outputs, but the function returned "
                f"{f'a tuple of {len(out)}' if isinstance(out, tuple) else 'no tuple'}.",
                got=describe(out),
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


def axes_of(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    """The walker axis name(s) as a tuple."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _walker_keys(key: jax.Array, indices: jax.Array) -> jax.Array:
    """One key per walker: ``fold_in(key, i)`` for each global walker index ``i``.

    Depending only on the global index, not on the device, makes every random stream
    independent of the number of devices.
    """
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, indices)


def _map(
    call: Callable[..., Any], in_axes: tuple[int | None, ...], options: Options, count: Any, axes: tuple[str, ...]
) -> Callable[..., Any]:
    """How the body runs on one device's walkers: ``mapped(valid, *dyn)``."""
    if options.batched:

        def block(valid: Any, *dyn: Any) -> Any:
            with body_context(Body("block", axes, valid, count)):
                return call(*dyn)

        return block
    if options.batch_size:
        # batch_size="auto" is resolved to a chunk by the plan before the engine builds.
        assert isinstance(options.batch_size, int)

        def chunk(*dyn: Any) -> Any:
            with body_context(Body("chunk", axes, None, count)):
                return call(*dyn)

        chunked = folx.batched_vmap(chunk, options.batch_size, in_axes=in_axes)
        return lambda valid, *dyn: chunked(*dyn)

    def walker(valid: Any, *dyn: Any) -> Any:
        with body_context(Body("walker", (LOCAL_AXIS, *axes), valid, count)):
            return call(*dyn)

    return jax.vmap(walker, in_axes=(0, *in_axes), axis_name=LOCAL_AXIS)


def _harmless(dyn: tuple[Any, ...], kinds: tuple[Kind, ...], mask: jax.Array, real_here: Any) -> tuple[Any, ...]:
    """The inputs with non-finite padding walkers made harmless to every derivative.

    A padding walker's value never enters a statistic, but its computation runs, and
    under differentiation its zero cotangent meets its partial derivatives: with a NaN
    or inf in the walker, ``0 * inf`` is NaN, which would reach every replicated
    parameter's gradient. So a padding walker holding a non-finite value is evaluated
    at a copy (under ``stop_gradient``) of the first finite walker of its device; a
    finite padding walker is evaluated as it is, exactly as ``jax.vmap`` would. On a
    device that holds no real and no finite walker, the cotangents of the replicated
    inputs are zeroed (:func:`_gate`) before they leave it. No collective is involved.
    """
    per_walker = [x for x, k in zip(dyn, kinds) if k is Kind.PER_WALKER]
    finite = jnp.ones(mask.shape, bool)
    for leaf in jax.tree_util.tree_leaves(per_walker):
        if _differentiable(leaf):
            finite &= jnp.all(jnp.isfinite(leaf), axis=tuple(range(1, leaf.ndim)))
    source = jnp.argmax(finite)  # the device's first finite walker (0 when there is none)
    replace = ~mask & ~finite
    keep_gradients = real_here | jnp.any(finite)
    out = []
    for x, kind in zip(dyn, kinds):
        if kind is Kind.PER_WALKER:

            def swap(v: jax.Array) -> jax.Array:
                rows = replace.reshape(replace.shape + (1,) * (v.ndim - 1))
                return jnp.where(rows, jax.lax.stop_gradient(v[source][None]), v)

            x = jax.tree_util.tree_map(swap, x)
        elif kind is Kind.REPLICATED and real_here is not True:
            x = jax.tree_util.tree_map(lambda v: _gate(v, keep_gradients) if _differentiable(v) else v, x)
        out.append(x)
    return tuple(out)


def _differentiable(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


@jax.custom_jvp
def _gate(x: jax.Array, keep: jax.Array) -> jax.Array:
    """The identity, whose derivative is zero where ``keep`` is false (also in reverse mode, by transposition)."""
    return x


@_gate.defjvp
def _gate_jvp(primals: tuple[Any, Any], tangents: tuple[Any, Any]) -> tuple[Any, Any]:
    x, keep = primals
    return x, jnp.where(keep, tangents[0], jnp.zeros_like(tangents[0]))


def _replicated_agree(outs: tuple[Any, ...], kinds: tuple[Kind, ...], axes: tuple[str, ...]) -> jax.Array:
    """For each ``Replicated`` output: whether every device holds the same bits (one all-reduce)."""
    words = []
    for out, kind in zip(outs, kinds):
        if kind is not Kind.REPLICATED:
            continue
        bits = [_as_words(x).reshape(-1) for x in jax.tree_util.tree_leaves(out)]
        words.append(jnp.concatenate(bits) if bits else jnp.zeros((0,), jnp.uint32))
    flat = jnp.concatenate(words)
    # max over devices of (w, ~w) gives the largest word and the complement of the smallest at once.
    top = jax.lax.pmax(jnp.concatenate([flat, ~flat]), axes)
    same = top[: flat.size] == ~top[flat.size :]
    agree, start = [], 0
    for w in words:
        agree.append(jnp.all(same[start : start + w.size]))
        start += w.size
    return jnp.stack(agree)


def _as_words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words (NaN payloads and signed zeros included)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def build(
    fn: Callable[..., Any],
    layout: Layout,
    statics: tuple[Any, ...],
    mesh: Mesh,
    options: Options,
    qualname: str,
    *,
    n: int,
    count: int | str | None,
    parts: tuple[Any, ...] | None = None,
    check_vma: bool = False,
    verify_replicated: bool = False,
) -> Callable[..., Any]:
    """The computation ``run(dynamic_args, n_valid)`` for one mesh, set of statics and walker count.

    Args:
        fn, layout, statics, mesh, options, qualname: the kernel.
        n: the number of walkers passed (the leading size of the PerWalker arguments).
        count: the valid count: ``None`` (all ``n``), an int (compiled in), or
            :data:`TRACED` (the ``n_valid`` argument of ``run``, a traced int scalar).
        parts: per dynamic parameter, the compiled-in part from :func:`partition` (``None``:
            nothing compiled in).
        check_vma: trace ``shard_map`` with JAX's varying-axes check (only to ask JAX
            whether ``Replicated`` outputs are replicated; never run).
        verify_replicated: also return, as a last output, whether each ``Replicated``
            output holds the same bits on every device.

    ``dynamic_args`` are the non-static arguments in parameter order (walker data, not
    ``WalkerSet``s), partitioned as ``parts`` says.
    """
    axis = options.axis_name
    axes = axes_of(axis)
    size = _compat.axis_size(mesh, axis)
    explicit = _compat.has_explicit_axes(mesh, axes)
    dyn_params = tuple(p for p in layout.params if p.kind is not Kind.STATIC)
    kinds = tuple(p.kind for p in dyn_params)
    parts = parts or (None,) * len(dyn_params)
    order = [p.kind is Kind.STATIC for p in layout.params]
    in_axes = tuple(0 if k in (Kind.PER_WALKER, Kind.KEY) else None for k in kinds)
    in_specs = tuple(spec(k, axis) for k in kinds)
    out_kinds = layout.output if isinstance(layout.output, tuple) else (layout.output,)
    out_specs = tuple(spec(k, axis) for k in out_kinds)
    if verify_replicated:
        out_specs += (PartitionSpec(),)
    n_pad = pad_n_walkers(n, size)
    n_local = n_pad // size
    traced = count == TRACED
    valid = n if count is None or traced else int(count)
    masked_call = traced or valid < n_pad
    # Padding the caller made (a WalkerSet's, n_valid=) may hold anything; the engine's own is walker 0.
    foreign_padding = traced or valid < n
    # Whether every device holds a real walker (its first walker then is one), known for a compiled-in count.
    every_device_real = not traced and valid > (size - 1) * n_local

    def call(*dyn: Any) -> Any:
        dyn = tuple(combine(a, part) for a, part in zip(dyn, parts))
        it_dyn, it_static = iter(dyn), iter(statics)
        args = tuple(next(it_static) if is_static else next(it_dyn) for is_static in order)
        try:
            out = call_with(fn, layout, args)
        except Exception as err:
            _note_body_error(err, qualname, layout.params, args)
            raise
        if options.checks:
            _check_outputs(qualname, out)
        return out

    def body(dyn: tuple[Any, ...], count_arg: Any) -> Any:
        indices = local_indices(axes, n_local)
        count_now = count_arg if traced else valid
        mask = indices < count_now if masked_call else None  # None: no padding, nothing to mask (and no copy)
        if foreign_padding and mask is not None:  # foreign padding is masked: valid < n <= n_pad
            dyn = _harmless(dyn, kinds, mask, True if every_device_real else indices[0] < count_now)
        dyn = tuple(_walker_keys(a, indices) if k is Kind.KEY else a for a, k in zip(dyn, kinds))
        out = _map(call, in_axes, options, count_now, axes)(mask, *dyn)
        _output_kinds(layout, out, qualname)
        outs = (out,) if isinstance(layout.output, Kind) else tuple(out)
        reduced = [i for i, k in enumerate(out_kinds) if k in (Kind.MEAN, Kind.SUM)]
        if options.checks and options.batched:
            for i, k in enumerate(out_kinds):
                if k is not Kind.REPLICATED:
                    _check_block_rows(qualname, k, outs[i], n_local)
        # Every Mean/Sum output of the call in one all-reduce.
        totals = psum_tree([row_sum(masked_rows(outs[i], mask)) for i in reduced], axes)
        results = list(outs)
        for i, total in zip(reduced, totals):
            results[i] = total if out_kinds[i] is Kind.SUM else mean_of(total, count_now)
        if verify_replicated:
            results.append(_replicated_agree(outs, out_kinds, axes))
        return tuple(results)

    def run(dyn: tuple[Any, ...], n_valid: Any) -> Any:
        if options.checks:
            check_inputs(qualname, layout, dyn, dyn_params)
        if n_pad != n:
            if not check_vma:  # (that trace only asks JAX a question, and the call's own trace follows: warned once)
                _warn_padding(qualname, layout, n, n_pad, size, axis)
            # An uneven count cannot be sharded, so these inputs are replicated: pad them replicated and
            # shard_map slices locally (left free, XLA sharded the padding and all-gathered it back). On
            # Explicit axes the sharding is part of the type, which shard_map's in_specs must match.
            replicated = NamedSharding(mesh, PartitionSpec())
            dyn = tuple(
                _compat.constrain(pad_walker(a, n_pad)[0], replicated) if k is Kind.PER_WALKER else a
                for a, k in zip(dyn, kinds)
            )
        if explicit:
            dyn = tuple(_compat.constrain(a, NamedSharding(mesh, s)) for a, s in zip(dyn, in_specs))
        if traced:
            kernel = _compat.shard_map(
                body, mesh, in_specs=(in_specs, PartitionSpec()), out_specs=out_specs, check_vma=check_vma
            )
            outs = kernel(dyn, jnp.asarray(n_valid, jnp.int32))
        else:
            kernel = _compat.shard_map(
                lambda d: body(d, None), mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=check_vma
            )
            outs = kernel(dyn)
        agree = outs[-1] if verify_replicated else None
        outs = outs[: len(out_kinds)]
        if n_pad != n:
            outs = tuple(_unpad(o, n, mesh, explicit) if k is Kind.PER_WALKER else o for o, k in zip(outs, out_kinds))
        result = outs[0] if isinstance(layout.output, Kind) else tuple(outs)
        return (result, agree) if verify_replicated else result

    return run


def masked_rows(tree: Any, mask: Any) -> Any:
    """``tree`` with the rows of padding walkers zeroed (``where``: a NaN in padding cannot leak)."""
    return jax.tree_util.tree_map(lambda x: masked(x, mask), tree)


def _check_block_rows(qualname: str, kind: Kind, out: Any, n_local: int) -> None:
    try:
        chex.assert_tree_shape_prefix(out, (n_local,))
    except AssertionError as err:
        raise CallError(
            message(
                qualname,
                f"with batched=True, every {kind.value} output needs the walker axis first.",
                got=f"block of {n_local} walkers, outputs {describe(out)} ({err})",
                fix="return one row per walker of the block.",
            )
        ) from None


def _warn_padding(qualname: str, layout: Layout, n: int, n_pad: int, size: int, axis: Any) -> None:
    has_per_walker = Kind.PER_WALKER in (layout.output if isinstance(layout.output, tuple) else (layout.output,))
    consequence = (
        f"per-walker outputs of {n} walkers cannot stay evenly sharded"
        if has_per_walker
        else "the inputs were replicated to pad them"
    )
    warn_at_user(
        f"{qualname}: {n} walkers do not split evenly over the {size} devices of mesh axis {axis!r}; they were "
        f"padded to {n_pad} inside the kernel, and {consequence}. Keep a padded walker set instead: "
        f"`walkers = sv.WalkerSet(*sv.pad_walker(walkers, sv.pad_n_walkers({n}, {size})))` "
        "(or initialise with sv.initialize_walkers_sharded, which pads for you).",
        PaddingWarning,
    )


def _unpad(tree: Any, n: int, mesh: Mesh, explicit: bool) -> Any:
    # An Explicit axis refuses a slice that leaves the walker dimension uneven: gather it first.
    if explicit:
        tree = _compat.constrain(tree, NamedSharding(mesh, PartitionSpec()))
    return jax.tree_util.tree_map(lambda x: x[:n], tree)


def signature_of(dyn: tuple[Any, ...]) -> tuple[Any, ...]:
    """The abstract signature (structure, shapes, dtypes) of a kernel's dynamic arguments."""
    leaves, tree = jax.tree_util.tree_flatten(dyn)
    return (tree, tuple((jnp.shape(x), getattr(x, "dtype", type(x))) for x in leaves))
