"""Placing walkers and parameters on a mesh, padding them, and getting them back."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from . import _compat
from ._errors import CallError, message
from ._mesh import get_replicated_sharding, get_walker_sharding, traced_mesh_error, walker_mesh
from ._walkerset import split_walker_set, walker_count

__all__ = [
    "assemble_sharded",
    "gather_walkers",
    "pad_n_walkers",
    "pad_walker",
    "place_on",
    "replicate",
    "shard_walker",
    "slice_walkers",
]

_FIX_PAD = (
    "pad first: `tree, n_valid = sv.pad_walker(tree, sv.pad_n_walkers(n, mesh_size))`, then pass n_valid= to kernels."
)


def _is_scalar(x: Any) -> bool:
    return np.ndim(x) == 0


def _place(leaf: Any, sharding: NamedSharding) -> jax.Array:
    """Put one leaf onto ``sharding``; each process transfers only its own shards."""
    if isinstance(leaf, Tracer):  # under jit a placement can only be asked for
        mesh = sharding.mesh
        if _compat.context_mesh() is None and isinstance(mesh, Mesh):
            # Explicit types are resharded under a mesh context only: with none, as kernels do, asked for as Auto.
            sharding = NamedSharding(_compat.auto_axes_mesh(mesh), sharding.spec)
        return _compat.constrain(leaf, sharding)
    if isinstance(leaf, jax.Array) and leaf.is_fully_addressable == sharding.is_fully_addressable:
        # Both on this process's devices, or both across processes: JAX reshards. A private copy first:
        # device_put hands back the caller's buffer for the shard on the device it lives on (also with
        # may_alias=False, measured on JAX 0.10.2), which a step that donates its arguments (kfac-jax's does)
        # would then delete under the caller.
        return jax.device_put(jnp.array(leaf, copy=True), sharding)
    # Host data, or an array of this process bound for a mesh across processes (every process holds the same
    # values): each process builds only the shards on its own devices, so nothing crosses processes.
    host = np.asarray(leaf)
    if host.dtype == object:
        raise TypeError(f"leaf of type {type(leaf).__name__} is not an array")
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _place_tree(tree: Any, walker: NamedSharding | None, replicated: NamedSharding, where: str) -> Any:
    mesh = replicated.mesh
    assert isinstance(mesh, Mesh)

    def place(path: Any, leaf: Any) -> Any:
        elsewhere = traced_mesh_error(where, f"leaf {jax.tree_util.keystr(path) or '<root>'}", leaf, mesh)
        if elsewhere is not None:  # inside a trace, an array of another mesh cannot be moved (JAX's error: raw)
            raise elsewhere
        try:
            return _place(leaf, replicated if walker is None or _is_scalar(leaf) else walker)
        except TypeError as err:
            raise CallError(
                message(
                    where,
                    f"leaf {jax.tree_util.keystr(path) or '<root>'} cannot be placed on devices.",
                    got=f"{type(leaf).__name__}: {err}",
                    expected="arrays (numpy or jax) or numbers",
                    fix="keep non-array data out of the pytree, or make it a Static argument.",
                )
            ) from None

    return jax.tree_util.tree_map_with_path(place, tree)


def place_on(tree: Any, sharding: NamedSharding, where: str) -> Any:
    """Every leaf of ``tree`` with exactly ``sharding`` (scalar leaves replicated), no mesh resolved.

    For callers that own their mesh whatever the context, as ``shardvmc.kfac`` does (its
    loss names the mesh's axis); everything else follows the kernels' rule
    (:func:`shard_walker`, :func:`replicate`). Host data is sliced per device, as there.
    """
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    return _place_tree(tree, sharding if sharding.spec else None, get_replicated_sharding(mesh), where)


def shard_walker(tree: Any, mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "walkers") -> Any:
    """Place a pytree of walkers with its leading axis split over the mesh.

    Every non-scalar leaf is split along axis 0; scalar leaves are replicated. Host
    (numpy) input is sliced per device, so each device (and each process) transfers
    only its own walkers; arrays already on devices are resharded.

    Args:
        tree: any pytree whose non-scalar leaves share a leading walker axis.
        mesh: the mesh; by default the kernels' rule: the ``use_mesh`` one, else the current mesh
            (``jax.set_mesh``), split over all its axes when it has no ``axis_name``, else all devices.
        axis_name: the mesh axis to split over (or several, split over together).

    Returns:
        The same pytree with ``jax.Array`` leaves sharded ``P(axis_name)`` (under a current mesh
        without ``axis_name``, over all of its axes).

    Raises:
        CallError: (a ``ValueError``) naming the leaf when leading sizes differ or the
            mesh does not divide the walker count.

    Example:
        >>> import jax, numpy as np, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:2])
        >>> x = sv.shard_walker({"r": np.zeros((4, 2, 3)), "step": 0}, mesh)
        >>> x["r"].sharding.spec, x["step"].sharding.spec
        (P('walkers',), P())
    """
    mesh, axes = walker_mesh(mesh, axis_name, where="shard_walker")
    size = _compat.axis_size(mesh, axes)
    n = walker_count(tree, "shard_walker")
    if n % size:
        raise CallError(
            message(
                "shard_walker",
                f"{n} walkers cannot be split evenly over the {size} devices of the walker axes {axes!r}.",
                got=f"leading size {n}, mesh {dict(mesh.shape)}",
                expected=f"a multiple of {size} (next: {pad_n_walkers(n, size)})",
                fix=_FIX_PAD,
            )
        )
    return _place_tree(tree, get_walker_sharding(mesh, axes), get_replicated_sharding(mesh), "shard_walker")


def replicate(tree: Any, mesh: Mesh | None = None) -> Any:
    """Place a full copy of every leaf of ``tree`` on every device of the mesh.

    Any mesh will do, with or without a ``walkers`` axis: a replicated leaf is split
    over no axis. With no ``mesh``, the kernels' rule: the ``use_mesh`` one, else the
    current mesh (``jax.set_mesh``), else all devices; under a current mesh of the same
    devices as the ``use_mesh`` one, the current mesh, where the kernels compute. In a
    multi-process run every process must pass the same values.

    Example:
        >>> import shardvmc as sv
        >>> p = sv.replicate({"alpha": 1.7}, sv.create_mesh())
        >>> p["alpha"].sharding.spec
        P()
    """
    mesh, _ = walker_mesh(mesh, (), where="replicate")  # no walker axis: any mesh will do
    return _place_tree(tree, None, get_replicated_sharding(mesh), "replicate")


def pad_n_walkers(n_walkers: int, n_devices: int) -> int:
    """Smallest multiple of ``n_devices`` that is at least ``n_walkers``.

    Args:
        n_walkers: the walker count.
        n_devices: the devices the walkers are split over, the size of the mesh's walker
            axis (``mesh.shape["walkers"]``); in a multi-process run not ``sv.n_devices()``,
            which counts this process's devices only.

    Example:
        >>> import shardvmc as sv
        >>> sv.pad_n_walkers(10, 4), sv.pad_n_walkers(8, 4), sv.pad_n_walkers(1, 4)
        (12, 8, 4)
    """
    if n_devices < 1:
        raise CallError(message("pad_n_walkers", f"n_devices must be at least 1, got {n_devices}."))
    return -(-int(n_walkers) // n_devices) * n_devices


def pad_walker(tree: Any, target_n_walkers: int) -> tuple[Any, int]:
    """Pad every non-scalar leaf along axis 0 to ``target_n_walkers`` walkers.

    The padding repeats walker 0, so padded walkers are valid inputs (no NaN from a
    zero configuration); pass the returned count as ``n_valid=`` to kernels so they
    never enter a statistic. Scalar leaves are left alone; numpy leaves stay numpy.

    Args:
        tree: any pytree of walkers.
        target_n_walkers: the walker count wanted; a smaller one changes nothing.

    Returns:
        ``(padded_tree, n_original)``.

    Example:
        >>> import numpy as np, shardvmc as sv
        >>> padded, n = sv.pad_walker({"r": np.arange(3.0)}, 4)
        >>> padded["r"].tolist(), n
        ([0.0, 1.0, 2.0, 0.0], 3)
    """
    n = walker_count(tree, "pad_walker")
    extra = int(target_n_walkers) - n
    if extra <= 0:
        return tree, n

    def pad(leaf: Any) -> Any:
        if _is_scalar(leaf):
            return leaf
        xp = np if isinstance(leaf, np.ndarray) else jnp
        return _on_rows(leaf, lambda x: xp.concatenate([x, xp.repeat(x[:1], extra, axis=0)], axis=0), n + extra)

    return jax.tree_util.tree_map(pad, tree), n


def slice_walkers(tree: Any, start: int, end: int) -> Any:
    """Walkers ``start:end`` of every non-scalar leaf; scalar leaves unchanged.

    Example:
        >>> import numpy as np, shardvmc as sv
        >>> sv.slice_walkers({"r": np.arange(5), "t": 1.0}, 1, 3)
        {'r': array([1, 2]), 't': 1.0}
    """

    def part(x: Any) -> Any:
        if _is_scalar(x):
            return x
        return _on_rows(x, lambda x: x[start:end], len(range(*slice(start, end).indices(np.shape(x)[0]))))

    return jax.tree_util.tree_map(part, tree)


def _on_rows(leaf: Any, op: Any, n_rows: int) -> Any:
    """``op(leaf)``, an indexing of the walker axis (a slice, the padding), also for walkers split over Explicit axes.

    JAX refuses to index an axis split over Explicit mesh axes without an output sharding
    (``ShardingTypeError``), and walkers placed on an Explicit mesh (``mesh=``, or under a
    ``jax.set_mesh`` context of one) are so split. ``op`` runs on an Auto view of the same
    devices (``jax.sharding.auto_axes`` inside a trace), and the result is split like
    ``leaf`` when the mesh divides its ``n_rows``, else replicated on the same mesh.
    """
    sharding = getattr(jax.typeof(leaf), "sharding", None) if isinstance(leaf, jax.Array) else None
    first = sharding.spec[0] if isinstance(sharding, NamedSharding) and sharding.spec else None
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    if not isinstance(sharding, NamedSharding) or not axes or not _compat.has_explicit_axes(sharding.mesh, axes):
        return op(leaf)
    size = math.prod(sharding.mesh.shape[a] for a in axes)
    out = PartitionSpec(first) if n_rows % size == 0 else PartitionSpec()
    if isinstance(leaf, Tracer):  # the abstract mesh of the leaf's type: there may be no mesh context in a trace
        assert isinstance(sharding.mesh, AbstractMesh)
        with jax.sharding.use_abstract_mesh(sharding.mesh):
            return jax.sharding.auto_axes(op, out_sharding=out)(leaf)
    placed = leaf.sharding
    assert isinstance(placed, NamedSharding) and isinstance(placed.mesh, Mesh)  # (a concrete array of that type)
    mesh = placed.mesh
    auto = _compat.auto_axes_mesh(mesh)
    with jax.set_mesh(auto):  # (also under a jax.set_mesh context of the Explicit mesh)
        rows = op(jax.device_put(leaf, NamedSharding(auto, placed.spec)))
    return jax.device_put(rows, NamedSharding(mesh, out))


def _local_mesh_devices(mesh: Mesh) -> list[Any]:
    me = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == me]


def assemble_sharded(
    local_pytrees: Sequence[Any], mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "walkers"
) -> Any:
    """Build one globally sharded pytree from one pytree per local device.

    Args:
        local_pytrees: one pytree per device of ``mesh`` that this process addresses,
            in mesh order, each holding that device's walkers.
        mesh: the mesh; by default the kernels' rule: the ``use_mesh`` one, else the current mesh
            (``jax.set_mesh``), split over all its axes when it has no ``axis_name``, else all devices.
        axis_name: the walker axis of ``mesh`` (or several).

    Returns:
        A pytree of global arrays sharded ``P(axis_name)``; scalar leaves are
        replicated (taken from the first local pytree).

    Example:
        >>> import jax, numpy as np, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:2])
        >>> x = sv.assemble_sharded([np.zeros((2, 3)), np.ones((2, 3))], mesh)
        >>> x.shape, x.sharding.spec
        ((4, 3), P('walkers',))
    """
    mesh, axes = walker_mesh(mesh, axis_name, where="assemble_sharded")
    devices = _local_mesh_devices(mesh)
    if len(local_pytrees) != len(devices):
        raise CallError(
            message(
                "assemble_sharded",
                "the number of local pytrees differs from the devices this process addresses in the mesh.",
                got=f"{len(local_pytrees)} pytrees",
                expected=f"{len(devices)} (one per local device, in mesh order)",
            )
        )
    structure = jax.tree_util.tree_structure(local_pytrees[0])
    flat = []
    for i, tree in enumerate(local_pytrees):
        leaves, tree_def = jax.tree_util.tree_flatten(tree)
        if tree_def != structure:
            raise CallError(
                message(
                    "assemble_sharded",
                    f"local pytree {i} has another structure than pytree 0.",
                    got=str(tree_def),
                    expected=str(structure),
                )
            )
        flat.append(leaves)
    per_device = walker_count(local_pytrees[0], "assemble_sharded", "local pytree 0")
    for i, tree in enumerate(local_pytrees[1:], 1):
        count = walker_count(tree, "assemble_sharded", f"local pytree {i}")
        if count != per_device:
            raise CallError(
                message(
                    "assemble_sharded",
                    f"local pytree {i} holds another number of walkers than pytree 0.",
                    got=f"{count} vs {per_device}",
                    fix="give every device the same number of walkers (pad with sv.pad_walker).",
                )
            )
    walker = get_walker_sharding(mesh, axes)
    replicated = get_replicated_sharding(mesh)
    size = _compat.axis_size(mesh, axes)
    out = []
    for k, first in enumerate(flat[0]):
        if _is_scalar(first):
            out.append(_place(first, replicated))
            continue
        shards = [jax.device_put(leaves[k], d) for leaves, d in zip(flat, devices)]
        shape = (per_device * size, *np.shape(first)[1:])
        out.append(jax.make_array_from_single_device_arrays(shape, walker, shards))
    return jax.tree_util.tree_unflatten(structure, out)


def gather_walkers(tree: Any) -> Any:
    """Bring every leaf back to the host as numpy, the full walker set on every process.

    For logging and checkpoints; arrays sharded over several processes are
    all-gathered, so call it on every process.

    Example:
        >>> import numpy as np, shardvmc as sv
        >>> x = sv.shard_walker(np.arange(8.0), sv.create_mesh())
        >>> type(sv.gather_walkers(x)).__name__
        'ndarray'
    """
    split_walker_set(tree, "gather_walkers")  # a set whose count no longer fits its data is refused

    def fetch(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(fetch, tree)
