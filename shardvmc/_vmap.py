"""The functional kernels over the same engine as ``walker_parallel``: vmaps and walker initialisation."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import folx
import jax
import numpy as np
from jax.sharding import Mesh

from . import _compat
from ._decorator import WalkerParallel, kernel_of
from ._errors import CallError, message
from ._kernel import Options, inside_kernel, signature_of
from ._markers import Kind, Layout, Param
from ._mesh import walker_mesh
from ._placement import pad_n_walkers, pad_walker, shard_walker
from ._walkerset import WalkerSet, walker_count

__all__ = ["get_vmap_fn", "initialize_walkers_sharded", "shard_map_wrap", "shard_vmap", "sharded_batched_vmap"]

AxisSpec = int | None | Sequence[int | None]


def shard_map_wrap(fn: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``shard_map`` under the engine rule of every shardvmc kernel, on any supported JAX.

    The rule: varying-manual-axes checking (``check_vma``) is off, so folx's forward
    Laplacian and jvp-of-grad Laplacians run on real networks, and a gradient taken
    inside ``fn`` with respect to a replicated input is each walker's own. ``fn`` places
    its collectives itself (``jax.lax.psum`` for a replicated output); see
    ``docs/concepts.md``.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = sv.create_mesh()
        >>> f = sv.shard_map_wrap(lambda x: jax.lax.psum(x.sum(), "walkers"), mesh, P("walkers"), P())
        >>> float(f(jnp.ones(8)))
        8.0
    """
    return _compat.shard_map(fn, mesh, in_specs, out_specs)


def _axis_leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)


def _check_axis(ax: Any, what: str, where: str) -> None:
    if ax not in (0, None) or isinstance(ax, bool):
        raise CallError(
            f"{where}: {what} is {ax!r}; only 0 (walker axis first) and None (replicated) are supported. "
            "Move the walker axis first with jnp.moveaxis."
        )


def _kinds(in_axes: AxisSpec, n_args: int, where: str) -> tuple[Any, ...]:
    """One entry per argument, as ``jax.vmap`` reads ``in_axes``: a Kind, or the argument's prefix pytree of 0/None.

    ``in_axes`` is 0 or None for every argument, or a tuple (a list is taken as one)
    with one entry per argument; an entry is 0, None, or a pytree prefix of that
    argument whose leaves are 0 (per walker) or None (replicated), e.g.
    ``FermiNetData(positions=0, spins=0, atoms=None, charges=None)``.
    """
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if in_axes is None or (isinstance(in_axes, int) and not isinstance(in_axes, bool)):
        _check_axis(in_axes, "in_axes", where)
        return (Kind.PER_WALKER if in_axes == 0 else Kind.REPLICATED,) * n_args
    if type(in_axes) is not tuple:
        raise CallError(
            f"{where}: in_axes must be 0, None, or a tuple with one entry per argument (as for jax.vmap), got "
            f"{in_axes!r}; for one argument write in_axes=(entry,)."
        )
    if len(in_axes) != n_args:
        raise CallError(f"{where}: in_axes has {len(in_axes)} entries for {n_args} arguments.")
    kinds: list[Any] = []
    for i, ax in enumerate(in_axes):
        for leaf in _axis_leaves(ax):
            _check_axis(leaf, f"in_axes[{i}]" if leaf is ax else f"a leaf of in_axes[{i}]", where)
        if ax is None or isinstance(ax, int):
            kinds.append(Kind.PER_WALKER if ax == 0 else Kind.REPLICATED)
        else:
            kinds.append(ax)
    return tuple(kinds)


def _signature(names: Sequence[str]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])


def _leaf_axes(prefix: Any, arg: Any, where: str, i: int) -> list[int | None]:
    """The axis (0 or None) of each leaf of ``arg``, from its ``in_axes`` prefix (broadcast as ``jax.vmap`` does)."""
    try:
        per_leaf = jax.tree_util.tree_map(
            lambda ax, sub: [ax] * len(jax.tree_util.tree_leaves(sub)), prefix, arg, is_leaf=lambda x: x is None
        )
    except ValueError as err:
        raise CallError(f"{where}: in_axes[{i}] is not a prefix of argument {i}'s pytree structure ({err}).") from None
    return _axis_leaves(per_leaf)  # the lists flatten into their entries, one per leaf of arg


def _split(kinds: tuple[Any, ...], args: tuple[Any, ...], where: str) -> tuple[tuple[Param, ...], tuple[Any, ...], Any]:
    """Engine parameters for arguments whose ``in_axes`` entry is a pytree: each splits into its per-walker
    leaves and its replicated leaves (the engine lays out one kind per parameter).

    Returns the parameters, their values, and ``rebuild(*values) -> args``.
    """
    params: list[Param] = []
    values: list[Any] = []
    plan: list[Any] = []  # per argument: ("whole", index) or ("split", treedef, axes, walker index, shared index)
    for i, (kind, arg) in enumerate(zip(kinds, args)):
        if isinstance(kind, Kind):
            plan.append(("whole", len(values)))
            params.append(Param(f"arg{i}", kind))
            values.append(arg)
            continue
        if isinstance(arg, WalkerSet):
            raise CallError(
                message(
                    where,
                    f"argument {i} is a WalkerSet, and its in_axes entry is a pytree.",
                    fix="give a WalkerSet the entry 0 (all its leaves are per walker), or pass its .data.",
                )
            )
        axes = _leaf_axes(kind, arg, where, i)
        leaves, treedef = jax.tree_util.tree_flatten(arg)
        slots = []
        for name, want in (("walkers", 0), ("shared", None)):
            part = [leaf for leaf, ax in zip(leaves, axes) if ax == want]
            slots.append(len(values) if part else None)
            if part:
                params.append(Param(f"arg{i}_{name}", Kind.PER_WALKER if want == 0 else Kind.REPLICATED))
                values.append(part)
        plan.append(("split", treedef, axes, *slots))

    def rebuild(*vals: Any) -> tuple[Any, ...]:
        out = []
        for entry in plan:
            if entry[0] == "whole":
                out.append(vals[entry[1]])
                continue
            _, treedef, axes, walkers, shared = entry
            parts = {0: iter(vals[walkers] if walkers is not None else ()),
                     None: iter(vals[shared] if shared is not None else ())}  # fmt: skip
            out.append(jax.tree_util.tree_unflatten(treedef, [next(parts[ax]) for ax in axes]))
        return tuple(out)

    return tuple(params), tuple(values), rebuild


def _out_layout(out_axes: Any) -> tuple[Kind | tuple[Kind, ...], bool]:
    """The engine's output kinds for ``out_axes``, and whether some output leaf is unmapped (None)."""
    unmapped = any(ax is None for ax in _axis_leaves(out_axes))
    if unmapped and type(out_axes) is tuple:
        return (Kind.PER_WALKER,) * len(out_axes), True
    return Kind.PER_WALKER, unmapped


def _unmap(out: Any, out_axes: Any) -> Any:
    """Per-walker outputs whose ``out_axes`` leaf is None replaced by walker 0's value (the same for every walker).

    An output holding such a leaf is no longer a walker set: it comes back as a plain
    pytree (per element, for a tuple ``out_axes``).
    """

    def one(o: Any, axes: Any) -> Any:
        if all(ax == 0 for ax in _axis_leaves(axes)):
            return o
        data = o.data if isinstance(o, WalkerSet) else o
        return jax.tree_util.tree_map(
            lambda ax, sub: sub if ax == 0 else jax.tree_util.tree_map(lambda x: x[0], sub),
            axes,
            data,
            is_leaf=lambda x: x is None,
        )

    if type(out_axes) is tuple:
        return tuple(one(o, ax) for o, ax in zip(out, out_axes))
    return one(out, out_axes)


def _sharded(
    fn: Callable[..., Any], mesh: Mesh | None, in_axes: AxisSpec, out_axes: Any, batch_size: int | None, where: str
) -> Callable[..., Any]:
    for ax in _axis_leaves(out_axes):
        if ax not in (0, None) or isinstance(ax, bool):
            raise CallError(
                f"{where}: out_axes leaves must be 0 (per-walker outputs stay sharded) or None (the same for every "
                f"walker), got {out_axes!r}."
            )
    output, unmapped = _out_layout(out_axes)
    in_axes = tuple(in_axes) if isinstance(in_axes, list) else in_axes
    vmap_out = out_axes if unmapped else 0
    local = (
        jax.vmap(fn, in_axes=in_axes, out_axes=vmap_out)
        if batch_size is None
        else folx.batched_vmap(fn, batch_size, in_axes=in_axes, out_axes=vmap_out)
    )
    # Entries that are pytrees split their arguments by leaf, so the kernel depends on the arguments' structure.
    structured = type(in_axes) is tuple and any(not (ax is None or isinstance(ax, int)) for ax in in_axes)
    by_structure: dict[Any, tuple[WalkerParallel, Any]] = {}
    checked: set[Any] = set()
    options = Options(batch_size=batch_size)

    def build(args: tuple[Any, ...]) -> tuple[WalkerParallel, Any]:
        kinds = _kinds(in_axes, len(args), where)
        if all(isinstance(k, Kind) for k in kinds):
            names = [f"arg{i}" for i in range(len(args))]
            layout = Layout(tuple(Param(n, k) for n, k in zip(names, kinds)), output, _signature(names))
            return kernel_of(fn, layout, mesh=mesh, options=options, nested=local), None
        params, _, rebuild = _split(kinds, args, where)
        layout = Layout(params, output, _signature([p.name for p in params]))
        body = functools.wraps(fn)(lambda *vals: fn(*rebuild(*vals)))
        qualname = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        return kernel_of(body, layout, mesh=mesh, options=options, qualname=qualname), kinds

    @functools.wraps(fn)
    def mapped(*args: Any) -> Any:
        if inside_kernel() is not None:  # inside another kernel's body: a plain (chunked) vmap there
            return local(*args)
        key = (len(args), jax.tree_util.tree_structure(args) if structured else None)
        try:
            kernel, kinds = by_structure[key]
        except KeyError:
            kernel, kinds = by_structure[key] = build(args)
        if unmapped:  # like jax.vmap, refuse an out_axes None output that differs between walkers
            plain = tuple(a.data if isinstance(a, WalkerSet) else a for a in args)
            signature = signature_of(plain)
            if signature not in checked:
                jax.eval_shape(jax.vmap(fn, in_axes=in_axes, out_axes=out_axes), *plain)
                checked.add(signature)
        out = kernel(*args) if kinds is None else kernel(*_split(kinds, args, where)[1])
        return _unmap(out, out_axes) if unmapped else out

    return mapped


def shard_vmap(
    fn: Callable[..., Any], mesh: Mesh | None = None, in_axes: AxisSpec = 0, out_axes: Any = 0
) -> Callable[..., Any]:
    """``jax.vmap`` whose mapped axis is split over the devices of the mesh.

    Per-walker outputs stay sharded on the walker axis (nothing is all-gathered),
    walker counts the mesh does not divide are padded inside, and gradients taken
    inside ``fn`` with respect to ``in_axes=None`` arguments are per walker.

    Args:
        fn: the function of one walker.
        mesh: the mesh; ``None`` resolves it at each call.
        in_axes: as for ``jax.vmap``, with leaves ``0`` (walker axis first) or ``None``
            (replicated): one for all arguments, or a tuple with one entry per
            argument, each 0, None or a pytree prefix of that argument, e.g.
            ``(None, FermiNetData(positions=0, spins=0, atoms=None, charges=None))``.
        out_axes: as for ``jax.vmap``, with leaves ``0`` (per walker, sharded) or
            ``None`` (the same for every walker, returned once; an output holding
            such a leaf is returned as a plain pytree, not a ``WalkerSet``).

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> f = sv.shard_vmap(lambda w, r: w * r.sum(), in_axes=(None, 0))
        >>> f(2.0, jnp.ones((8, 3))).sharding.spec
        P('walkers',)
        >>> g = sv.shard_vmap(lambda d: d["r"].sum() * d["z"], in_axes=({"r": 0, "z": None},))
        >>> g({"r": jnp.ones((8, 3)), "z": 2.0}).shape
        (8,)
    """
    return _sharded(fn, mesh, in_axes, out_axes, None, "shard_vmap")


def sharded_batched_vmap(
    fn: Callable[..., Any], max_batch_size: int, mesh: Mesh | None = None, in_axes: AxisSpec = 0, out_axes: Any = 0
) -> Callable[..., Any]:
    """:func:`shard_vmap` that runs ``folx.batched_vmap`` inside each device's shard.

    Each device processes its walkers ``max_batch_size`` at a time, so peak memory per
    device is bounded by ``max_batch_size`` walkers, and the result stays sharded.
    ``in_axes`` and ``out_axes`` are as for :func:`shard_vmap`.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> f = sv.sharded_batched_vmap(lambda r: (r**2).sum(), 2)
        >>> y = f(jnp.ones((16, 3)))
        >>> y.shape, float(y[0])
        ((16,), 3.0)
    """
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise CallError(f"sharded_batched_vmap: max_batch_size must be a positive int, got {max_batch_size!r}.")
    return _sharded(fn, mesh, in_axes, out_axes, max_batch_size, "sharded_batched_vmap")


def get_vmap_fn(max_vmap_batch_size: int = 0, mesh: Mesh | None = None) -> Callable[..., Callable[..., Any]]:
    """The vmap to use, chosen as pytc chose it, with the sharding defects fixed.

    With a mesh given, or several devices in total: :func:`shard_vmap`, or
    :func:`sharded_batched_vmap` when ``max_vmap_batch_size > 0``. On one device:
    ``jax.vmap``, or ``folx.batched_vmap`` when ``max_vmap_batch_size > 0``.

    Returns:
        ``vmap_fn(fn, in_axes=0, out_axes=0)``, with ``in_axes`` and ``out_axes`` as for ``jax.vmap``
        (leaves 0 or None; see :func:`shard_vmap`).

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> vmap = sv.get_vmap_fn(4)
        >>> vmap(lambda r: r.sum())(jnp.ones((8, 3))).shape
        (8,)
    """
    sharded = mesh is not None or jax.device_count() > 1
    if max_vmap_batch_size > 0:
        if sharded:
            return functools.partial(sharded_batched_vmap, max_batch_size=max_vmap_batch_size, mesh=mesh)
        return functools.partial(folx.batched_vmap, max_batch_size=max_vmap_batch_size)
    if sharded:
        return functools.partial(shard_vmap, mesh=mesh)
    return jax.vmap


def initialize_walkers_sharded(
    init_fn: Callable[[jax.Array], Any],
    n_walkers: int,
    mesh: Mesh | None = None,
    *,
    key: jax.Array | None = None,
    initial_walkers: Any = None,
    axis_name: str | tuple[str, ...] = "walkers",
) -> WalkerSet:
    """Create walkers on the devices that own them, reproducibly for any device count.

    Walker ``i`` is ``init_fn(jax.random.fold_in(key, i))``, computed on its own
    device inside one ``shard_map``: the full set is never built on one device, and in
    a multi-process run each process computes only its own devices' walkers. The same
    key gives the same walkers on 1, 3 or 8 devices.

    Args:
        init_fn: ``init_fn(key) -> one walker`` (any pytree).
        n_walkers: the number of walkers wanted.
        mesh: the mesh; by default the kernels' rule: the ``use_mesh`` one, else the current mesh
            (``jax.set_mesh``), split over all its axes when it has no ``axis_name``, else all devices.
        key: a PRNG key (raw or typed). Required unless ``initial_walkers`` is given.
        initial_walkers: a pytree of ``n_walkers`` walkers to place instead of
            calling ``init_fn`` (``key`` is then unused): host arrays, or jax.Arrays
            already on devices (also the global arrays of a multi-process run).
        axis_name: the walker axis of ``mesh`` (or several).

    Returns:
        A :class:`WalkerSet` of ``pad_n_walkers(n_walkers, mesh size)`` walkers sharded
        ``P(axis_name)`` with ``n_valid=n_walkers``: the first ``n_walkers`` are the
        requested ones, and every kernel and reduction that takes the set leaves the
        padding out of its statistics.

    Example:
        >>> import jax, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:4])
        >>> r = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 10, mesh,
        ...                                   key=jax.random.key(0))
        >>> r.n_valid, r.data.shape, r.data.sharding.spec
        (10, (12, 2, 3), P('walkers',))
    """
    mesh, axes = walker_mesh(mesh, axis_name, where="initialize_walkers_sharded")
    size = _compat.axis_size(mesh, axes)
    if int(n_walkers) < 1:
        raise CallError(message("initialize_walkers_sharded", f"n_walkers must be at least 1, got {n_walkers}."))
    n_pad = pad_n_walkers(n_walkers, size)
    if initial_walkers is not None:
        # jax.Arrays stay on devices: a multi-process (global) array cannot be fetched to one host.
        host = jax.tree_util.tree_map(lambda x: x if isinstance(x, jax.Array) else np.asarray(x), initial_walkers)
        n = walker_count(host, "initialize_walkers_sharded", "initial_walkers")
        if n != n_walkers:
            raise CallError(
                message(
                    "initialize_walkers_sharded",
                    "initial_walkers holds another number of walkers than n_walkers.",
                    got=f"{n} walkers",
                    expected=f"{n_walkers}",
                )
            )
        return WalkerSet(shard_walker(pad_walker(host, n_pad)[0], mesh, axes), int(n_walkers))
    if key is None:
        raise CallError(
            message(
                "initialize_walkers_sharded",
                "no key was given (shardvmc never seeds from the clock).",
                fix="pass key=jax.random.key(seed), or initial_walkers=.",
            )
        )
    # The engine derives walker i's key as fold_in(key, i); the zero-width slots only carry the walker count.
    slots = WalkerSet(np.zeros((n_pad, 0), np.int8), int(n_walkers))
    return _init_kernel(init_fn, mesh, axes)(key, slots)


# One kernel per initialisation function and mesh, dropped with the function: a fresh lambda per call
# (as in the README) must not pin a compiled kernel for the life of the process.
_INIT_KERNELS: weakref.WeakKeyDictionary[Any, dict[tuple[Mesh, Any], WalkerParallel]] = weakref.WeakKeyDictionary()


def _init_kernel(init_fn: Callable[[jax.Array], Any], mesh: Mesh, axis_name: Any) -> WalkerParallel:
    try:
        by_mesh = _INIT_KERNELS.setdefault(init_fn, {})
        ref = weakref.ref(init_fn)  # held weakly: a strong reference from the cached kernel would keep it alive

        def one(key: jax.Array, slot: Any) -> Any:
            fn = ref()
            assert fn is not None  # alive while its kernel is reachable through the key
            return fn(key)

    except TypeError:  # not weakly referenceable (e.g. some builtins): not cached
        by_mesh = {}

        def one(key: jax.Array, slot: Any) -> Any:
            return init_fn(key)

    try:
        return by_mesh[mesh, axis_name]
    except KeyError:
        pass
    layout = Layout(
        (Param("key", Kind.KEY), Param("slot", Kind.PER_WALKER)), Kind.PER_WALKER, _signature(("key", "slot"))
    )
    qualname = f"initialize_walkers_sharded({getattr(init_fn, '__qualname__', repr(init_fn))})"
    kernel = kernel_of(one, layout, mesh=mesh, options=Options(axis_name=axis_name), qualname=qualname)
    by_mesh[mesh, axis_name] = kernel
    return kernel
