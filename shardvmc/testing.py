"""chex-style assertions for users' own tests of sharded walker code."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._mesh import resolve_mesh

__all__ = ["assert_replicated", "assert_walker_sharded"]


def _arrays(tree: Any, where: str) -> list[tuple[str, jax.Array]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path) or "<root>"
        if isinstance(leaf, jax.core.Tracer):
            raise AssertionError(
                f"{where}: leaf {name} is a tracer; shardings can only be checked on concrete arrays "
                "(call it outside jit)."
            )
        if not isinstance(leaf, jax.Array):
            raise AssertionError(f"{where}: leaf {name} is a {type(leaf).__name__}, not a jax.Array on devices.")
        out.append((name, leaf))
    return out


def assert_walker_sharded(tree: Any, mesh: Mesh | None = None, axis_name: str = "walkers") -> None:
    """Assert that every non-scalar leaf is split over the walker axis of ``mesh``.

    Lists every leaf that is not, with its sharding, in one ``AssertionError``.

    Example:
        >>> import numpy as np, shardvmc as sv
        >>> from shardvmc.testing import assert_walker_sharded
        >>> mesh = sv.create_mesh()
        >>> assert_walker_sharded(sv.shard_walker(np.zeros((8, 3)), mesh), mesh)
    """
    mesh = resolve_mesh(mesh, axis_name, where="assert_walker_sharded")
    expected = NamedSharding(mesh, PartitionSpec(axis_name))
    bad = []
    for name, leaf in _arrays(tree, "assert_walker_sharded"):
        if leaf.ndim == 0:
            continue
        if not leaf.sharding.is_equivalent_to(expected, leaf.ndim):
            bad.append(f"  {name}: shape {leaf.shape}, sharding {leaf.sharding}")
    if bad:
        raise AssertionError(
            f"assert_walker_sharded: {len(bad)} leaves are not sharded P({axis_name!r}) over mesh "
            f"{dict(mesh.shape)}:\n" + "\n".join(bad)
        )


def assert_replicated(tree: Any) -> None:
    """Assert that every leaf holds a full copy on each of its devices.

    Example:
        >>> import shardvmc as sv
        >>> from shardvmc.testing import assert_replicated
        >>> assert_replicated(sv.replicate({"w": 1.0}))
    """
    bad = [
        f"  {name}: shape {leaf.shape}, sharding {leaf.sharding}"
        for name, leaf in _arrays(tree, "assert_replicated")
        if not leaf.sharding.is_fully_replicated
    ]
    if bad:
        raise AssertionError(f"assert_replicated: {len(bad)} leaves are not replicated:\n" + "\n".join(bad))
