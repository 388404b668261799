"""Everything that depends on the JAX version, and the one rule for how shardvmc calls ``shard_map``.

shardvmc requires JAX 0.10.2 or newer (``jax.shard_map`` with its ``check_vma`` flag).

The engine rule (see ``docs/concepts.md``): every kernel shardvmc builds runs its body
under ``shard_map`` with varying-manual-axes checking OFF. shardvmc places every
collective itself (the ``psum`` of a ``Mean``/``Sum``, the reductions, the in-body
statistics), so the check has nothing to protect, while turning it on breaks real
per-walker programs: folx's forward Laplacian re-evaluates jaxprs holding the ``pvary``
that JAX inserts where a constant (``jnp.eye(n)``) meets walker data, outside
``shard_map``'s context, and a jvp-of-grad Laplacian over constant tangents is rejected
as "inconsistent with the original primal values". With the check off, a gradient
taken inside the body with respect to a replicated input is that walker's own, and
gradients of a ``psum``'d mean taken outside are right; both are tested.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from ._caches import bounded
from ._internals import CONTEXT_MESH, NO_CONTEXT_MESH  # the cheap reading of the context mesh (see _internals)

__all__ = [
    "CHECK_VMA",
    "CONTEXT_MESH",
    "NO_CONTEXT_MESH",
    "auto_axes_mesh",
    "axis_size",
    "constrain",
    "context_mesh",
    "has_explicit_axes",
    "shard_map",
]

CHECK_VMA = False
"""Whether shardvmc's kernels type-check varying manual axes (the engine rule above)."""


def shard_map(
    fn: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any, *, check_vma: bool = CHECK_VMA
) -> Callable[..., Any]:
    """``shard_map`` under the engine rule.

    ``check_vma=True`` is only for asking JAX, at trace time, whether an output is
    replicated (the engine's check of ``Replicated`` outputs); such a trace never runs.
    """
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


def axis_size(mesh: Mesh, axis_name: str | tuple[str, ...]) -> int:
    """Number of devices along ``axis_name`` (one mesh axis or several) of ``mesh``."""
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    size = 1
    for name in names:
        size *= int(mesh.shape[name])
    return size


def has_explicit_axes(mesh: Mesh | AbstractMesh, axes: tuple[str, ...]) -> bool:
    """Whether any of ``axes`` is an Explicit axis of ``mesh`` (``jax.make_mesh``'s default)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return any(types.get(a) == jax.sharding.AxisType.Explicit for a in axes)


def constrain(tree: Any, sharding: jax.sharding.NamedSharding) -> Any:
    """Give every leaf of ``tree`` this sharding inside ``jit``, on Auto and Explicit axes alike.

    Explicit axes carry the sharding in the array's type and take ``jax.sharding.reshard``;
    Auto axes take ``with_sharding_constraint``.
    """
    if has_explicit_axes(sharding.mesh, tuple(sharding.mesh.axis_names)):
        return jax.tree_util.tree_map(lambda x: jax.sharding.reshard(x, sharding), tree)
    return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def context_mesh() -> Mesh | None:
    """JAX's current mesh (``jax.set_mesh``, also inside a trace), or ``None`` when none is set."""
    mesh = CONTEXT_MESH.value
    return None if mesh is None or mesh is NO_CONTEXT_MESH or mesh.empty else mesh


@bounded(64)
def auto_axes_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of Auto type (the same devices, names and shape)."""
    if all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
