"""Meshes: building them, the default one, and the ``use_mesh`` context."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat, _internals
from ._errors import CallError, message

__all__ = [
    "CHOSEN_MESH",
    "create_mesh",
    "get_replicated_sharding",
    "get_walker_sharding",
    "is_multi_gpu",
    "n_devices",
    "call_mesh",
    "walker_mesh",
    "entered_mesh",
    "traced_mesh_error",
    "mesh_of_arrays",
    "onto_mesh",
    "resolve_mesh",
    "use_mesh",
    "use_mesh_is_set",
]

# The mesh of sv.use_mesh (None: none). Read by the kernels' call path (_decorator) as well as here.
CHOSEN_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("shardvmc_mesh", default=None)


def create_mesh(devices: Sequence[Any] | None = None, axis_name: str = "walkers") -> Mesh:
    """Create a 1-D mesh of Auto axis type for walker-parallel sharding.

    ``jax.make_mesh`` defaults to Explicit axes since JAX 0.10, under which plain
    ``jax.vmap`` over sharded walkers fails; this builds the ``Mesh`` directly.

    Args:
        devices: the devices to span, in order. Defaults to every device of every
            process (``jax.devices()``), so a multi-host run gets one global mesh.
        axis_name: name of the walker axis.

    Returns:
        A ``jax.sharding.Mesh`` with one axis, ``axis_name``.

    Example:
        >>> import jax, shardvmc as sv
        >>> mesh = sv.create_mesh(jax.devices()[:2])
        >>> dict(mesh.shape)
        {'walkers': 2}
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise CallError(message("create_mesh", "no devices were given.", fix="pass at least one device."))
    return Mesh(np.array(devs), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,))


@functools.cache
def _default_mesh(axis_name: str | tuple[str, ...]) -> Mesh:
    if not isinstance(axis_name, str):
        raise CallError(
            message(
                "shardvmc",
                f"no mesh was given, and the default mesh has one axis, so the walker axes {axis_name!r} need a mesh.",
                fix="build a mesh with those axes (e.g. jax.sharding.Mesh(devices.reshape(hosts, local), "
                f"{axis_name!r})) and pass mesh= or use sv.use_mesh(mesh).",
            )
        )
    return create_mesh(axis_name=axis_name)


def resolve_mesh(mesh: Mesh | None, axis_name: str | tuple[str, ...] = "walkers", *, where: str = "shardvmc") -> Mesh:
    """The mesh to use: ``mesh`` if given, else the ``use_mesh`` one, else JAX's current mesh, else all devices.

    JAX's current mesh is the one set with ``jax.set_mesh``; it is used as it is, Explicit
    axes included (shardvmc reshards the inputs of such a mesh itself).

    Raises:
        CallError: when the resolved mesh has no axis called ``axis_name``.
    """
    if mesh is None:
        mesh = CHOSEN_MESH.get() or _compat.context_mesh()
        if mesh is None:
            return _default_mesh(axis_name)
    if not isinstance(mesh, Mesh):
        raise CallError(
            message(
                where,
                "mesh is not a jax.sharding.Mesh.",
                got=type(mesh).__name__,
                fix="build one with sv.create_mesh(devices), e.g. sv.create_mesh(jax.devices()[:4]).",
            )
        )
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not all(name in mesh.shape for name in names):
        raise CallError(
            message(
                where,
                f"the mesh has no axis named {axis_name!r}.",
                got=f"mesh axes {dict(mesh.shape)}",
                expected=f"a mesh with a {axis_name!r} axis",
                fix=f"build the mesh with sv.create_mesh(axis_name={axis_name!r}) or pass axis_name= one of "
                f"{tuple(mesh.axis_names)}.",
            )
        )
    return mesh


Axes = str | tuple[str, ...]
_CallMesh = tuple[Mesh, "str | tuple[str, ...]", "Mesh | None"]


def walker_mesh(mesh: Mesh | None, axis_name: Axes = "walkers", *, where: str = "shardvmc") -> tuple[Mesh, Axes]:
    """Where walkers live: ``(mesh, the axes they split over)``, the one rule of kernels and placement alike.

    JAX types every array of a traced computation by the mesh of its context (``jax.set_mesh``,
    ``jax.sharding.set_mesh``), and ``shard_map`` refuses a mesh other than the context's.
    So walkers go to:

    - the context mesh when one is set and no mesh is chosen (``mesh=``, ``sv.use_mesh``):
      split over ``axis_name`` when the context mesh has it, else over all of its axes, as on
      a mesh set by another library, such as NetKet's ``("S",)``;
    - the context mesh when the chosen mesh spans the same devices in the same order: the
      walkers land on the same devices, split over all of the context mesh's axes;
    - the chosen mesh otherwise, outside a trace (a kernel enters it with ``jax.set_mesh``);
      inside a trace (the caller's ``jax.jit``, ``grad``, ``scan``...), the context mesh, as
      with no mesh chosen: one traced program runs on one set of devices, which its caller
      fixed, and JAX refuses a ``shard_map`` or a sharding on others there;
    - with no context mesh, the chosen mesh as it is (Explicit axes included), else all devices.

    A chosen mesh must have the walker axes. ``axis_name=()`` asks for a mesh for replicated
    data (no walker axes): any chosen mesh will do, and with nothing chosen anywhere it is all
    devices.
    """
    chosen = mesh if mesh is not None else CHOSEN_MESH.get()
    context = _compat.context_mesh()
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if chosen is not None:
        chosen = resolve_mesh(chosen, axis_name, where=where)
        if context is None or chosen == context:
            return chosen, axis_name
        # The walkers (or a replicated copy) land on the same devices: the same placement as the context's axes.
        spans = not names or _compat.axis_size(chosen, axis_name) == chosen.size
        if spans and tuple(chosen.devices.flat) == tuple(context.devices.flat):
            return context, tuple(context.axis_names)
        if not _internals.tracing():
            return chosen, axis_name
    elif context is None:
        return _default_mesh(axis_name if names else "walkers"), axis_name
    assert context is not None  # (chosen is None, or a trace under a context of other devices)
    if all(name in context.shape for name in names):
        return context, axis_name
    return context, tuple(context.axis_names)


def call_mesh(mesh: Mesh | None, axis_name: Axes, where: str) -> _CallMesh:
    """Where a kernel call computes: ``(mesh, walker axes, mesh to enter around the call or None)``.

    The mesh and axes of :func:`walker_mesh`; with no context mesh, with Auto axes (an Explicit
    mesh's types would need a mesh context for the cotangents of an eager ``jax.grad``). A
    chosen mesh of other devices than the context mesh is entered with ``jax.set_mesh``
    around the (eager) call.

    A kernel keeps the answer per call context (``WalkerParallel.__call__``), so a repeated
    call does not come here.
    """
    found, axes = walker_mesh(mesh, axis_name, where=where)
    context = _compat.context_mesh()
    if context is None:
        return _compat.auto_axes_mesh(found), axes, None
    return found, axes, None if found == context else found


def mesh_of_arrays(tree: Any, axis_name: str | tuple[str, ...]) -> Mesh | None:
    """The mesh the arrays of ``tree`` live on, when no mesh is chosen otherwise (``use_mesh``, ``jax.set_mesh``).

    For functions that take arrays another kernel made (J, walkers): they run where those
    live, instead of moving them to all devices. ``None`` when nothing is to be read (a
    tracer, an array without a mesh, a chosen mesh, a mesh without the walker axes).
    """
    if CHOSEN_MESH.get() is not None or _compat.context_mesh() is not None:
        return None
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves or not isinstance(leaves[0], jax.Array) or isinstance(leaves[0], Tracer):
        return None
    sharding = leaves[0].sharding
    if not isinstance(sharding, NamedSharding) or not leaves[0].committed:
        return None
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    mesh = sharding.mesh
    return mesh if isinstance(mesh, Mesh) and all(n in mesh.shape for n in names) else None


def traced_mesh_error(qualname: str, what: str, leaf: Any, mesh: Mesh) -> CallError | None:
    """The ``CallError`` for a tracer whose type says its array lives on a mesh of another size than ``mesh``.

    JAX types a committed array's tracer with its mesh (an ``AbstractMesh``: axis sizes, no
    devices). Inside a trace, one program runs on one set of devices: an argument of another
    mesh size cannot meet ``mesh`` there. ``None`` for concrete values and same-size meshes
    (whose devices are not known).
    """
    if not isinstance(leaf, Tracer):
        return None
    other = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
    if other is None or other.empty or other.size == mesh.size:
        return None
    return CallError(
        message(
            qualname,
            f"{what} lives on a mesh of {other.size} devices, inside a traced computation that runs on a mesh of "
            f"{mesh.size}; one traced program runs on one set of devices.",
            got=f"mesh {dict(other.shape)} ({other.size} devices)",
            expected=f"devices {[d.id for d in mesh.devices.flat]} (mesh {dict(mesh.shape)})",
            fix="place it on that mesh outside the traced function (sv.shard_walker(x, mesh) for walker data, "
            "sv.replicate(x, mesh) otherwise), or trace the function under jax.set_mesh(mesh) of the mesh the "
            "arrays live on.",
        )
    )


def onto_mesh(mesh: Mesh, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Arrays committed to other devices than ``mesh``'s (made under the caller's mesh), replicated onto it.

    Only for a kernel whose own mesh is not the caller's mesh context (see ``_mesh.call_mesh``);
    the kernel shards them as its markers say.
    """
    devices = set(mesh.devices.flat)
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def move(x: Any) -> Any:
        if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.sharding.device_set != devices:
            return jax.device_put(x, target)
        return x

    return tuple(jax.tree_util.tree_map(move, a) for a in args)


@contextlib.contextmanager
def entered_mesh(mesh: Mesh | None) -> Iterator[None]:
    """``jax.set_mesh(mesh)`` around an eager call of a kernel whose own mesh is not the caller's (``None``: nothing).

    Never inside a trace: ``call_mesh`` returns no mesh to enter there.
    """
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh):
        yield


def use_mesh_is_set() -> bool:
    """Whether a :func:`use_mesh` context is active (JAX's own mesh contexts are not counted)."""
    return CHOSEN_MESH.get() is not None


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make ``mesh`` the default for every shardvmc function called with ``mesh=None``.

    The setting is held in a context variable, so it is restored on exit even when an
    exception is raised, and threads or async tasks do not see each other's meshes.

    Example:
        >>> import jax, shardvmc as sv
        >>> with sv.use_mesh(sv.create_mesh(jax.devices()[:1])):
        ...     x = sv.shard_walker(jax.numpy.zeros((4, 3)))
        >>> len(x.sharding.mesh.devices)
        1
    """
    token = CHOSEN_MESH.set(mesh)
    try:
        yield mesh
    finally:
        CHOSEN_MESH.reset(token)


def n_devices() -> int:
    """Number of devices local to this process (not the global count).

    The walkers of a kernel are split over the devices along its mesh's walker axis
    instead (``mesh.shape["walkers"]``), which a multi-process mesh spreads over processes.

    Example:
        >>> import shardvmc as sv
        >>> sv.n_devices() >= 1
        True
    """
    return jax.local_device_count()


def is_multi_gpu() -> bool:
    """Whether this process has more than one local device.

    Example:
        >>> import shardvmc as sv
        >>> sv.is_multi_gpu() == (sv.n_devices() > 1)
        True
    """
    return n_devices() > 1


def get_walker_sharding(mesh: Mesh, axis_name: str | tuple[str, ...] = "walkers") -> NamedSharding:
    """``NamedSharding`` that splits the leading (walker) axis over ``axis_name``.

    Example:
        >>> import shardvmc as sv
        >>> sv.get_walker_sharding(sv.create_mesh()).spec
        P('walkers',)
    """
    return NamedSharding(mesh, PartitionSpec(axis_name))


def get_replicated_sharding(mesh: Mesh) -> NamedSharding:
    """``NamedSharding`` that holds a full copy on every device of ``mesh``.

    Example:
        >>> import shardvmc as sv
        >>> sv.get_replicated_sharding(sv.create_mesh()).spec
        P()
    """
    return NamedSharding(mesh, PartitionSpec())
