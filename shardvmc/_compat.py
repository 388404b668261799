"""Everything that depends on the JAX version lives here and nowhere else.

shardvmc is tested against JAX 0.10.2. Older versions kept ``shard_map`` in
``jax.experimental.shard_map`` with a ``check_rep`` flag, and spelled the
replicated-to-varying cast ``jax.lax.pvary``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

__all__ = ["axis_size", "shard_map", "to_varying"]

if hasattr(jax, "shard_map"):
    _shard_map = jax.shard_map
    _CHECK_FLAG = "check_vma"
else:  # pragma: no cover - JAX < 0.7
    from jax.experimental.shard_map import shard_map as _shard_map

    _CHECK_FLAG = "check_rep"


def shard_map(fn: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``shard_map`` with replication checking on, whatever the JAX version calls it."""
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK_FLAG: True})


def to_varying(tree: Any, axis_name: str) -> Any:
    """Cast every leaf of ``tree`` that is replicated over ``axis_name`` to varying.

    Inside ``shard_map`` with ``check_vma=True`` a replicated input used by per-walker
    code is implicitly cast to varying, and that cast transposes to a ``psum``: a
    gradient taken inside the kernel with respect to the replicated input would come
    out summed over devices. Casting explicitly first makes per-walker gradients that
    walker's own, and leaves gradients of reduced outputs unchanged.
    """
    if hasattr(jax.lax, "pcast"):

        def cast(x: Any) -> Any:
            if axis_name in getattr(jax.typeof(x), "vma", frozenset()):
                return x
            return jax.lax.pcast(x, axis_name, to="varying")
    else:  # pragma: no cover - JAX < 0.8

        def cast(x: Any) -> Any:
            return jax.lax.pvary(x, axis_name)

    return jax.tree_util.tree_map(cast, tree)


def axis_size(mesh: Mesh, axis_name: str) -> int:
    """Number of devices along ``axis_name`` of ``mesh``."""
    return int(mesh.shape[axis_name])
