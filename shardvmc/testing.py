"""Fake CPU devices and chex-style assertions for users' own tests of sharded walker code."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _internals
from ._compiler import SCHEDULER_FLAG
from ._mesh import walker_mesh

__all__ = ["CPU_SCHEDULER_FLAG", "assert_replicated", "assert_walker_sharded", "cpu_environment", "set_cpu_devices"]

CPU_SCHEDULER_FLAG = SCHEDULER_FLAG
"""The XLA flag that keeps XLA's CPU runtime from deadlocking on larger programs.

With jaxlib 0.10.2, a compiled VMC step holding a folx local energy, a per-walker
Jacobian and a linear solve runs its first call, then deadlocks on the second (every
thread idle, the call never returns); the concurrency-optimised scheduler is the cause.
Importing shardvmc sets it when JAX's backend has not started yet.
"""


_COUNT = "--xla_force_host_platform_device_count"


def cpu_environment(env: MutableMapping[str, str], n: int | None = None, *, replace: bool = False) -> None:
    """Write into ``env`` the settings of a CPU run on ``n`` fake devices: the one place they are made.

    Sets, in ``XLA_FLAGS``, the device count (``--xla_force_host_platform_device_count``;
    kept when one is there, unless ``replace``: ``n=None`` with ``replace`` removes it) and
    :data:`CPU_SCHEDULER_FLAG` (XLA's CPU runtime in jaxlib 0.10.2 deadlocks on larger
    programs without it: every thread idles on a futex and the call never returns). With
    more than one fake device it also sets ``OPENBLAS_NUM_THREADS=1`` unless set: jaxlib's
    CPU LAPACK kernels (Cholesky, triangular solves, ``eigh``) call scipy's OpenBLAS, and
    when every fake device runs its own call at once, OpenBLAS's worker threads spin on
    the shared cores (a 512 x 512 Cholesky replicated on 8 fake devices took 100 times as
    long as one; see ``benchmarks/RESULTS.md``). On accelerators the flags only affect
    the host platform.

    Args:
        env: the environment to edit: ``os.environ`` (before JAX starts its backend, see
            :func:`set_cpu_devices`) or a child process's.
        n: the number of fake CPU devices; ``None``: leave the count alone (or, with
            ``replace``, remove it).
        replace: set the count even when ``XLA_FLAGS`` has one (a launcher's choice for
            its children); otherwise the count already there wins.

    Example:
        >>> from shardvmc.testing import cpu_environment
        >>> env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        >>> cpu_environment(env, 2, replace=True)
        >>> env["XLA_FLAGS"].split()[0], env["OPENBLAS_NUM_THREADS"]
        ('--xla_force_host_platform_device_count=2', '1')
    """
    flags = env.get("XLA_FLAGS", "").split()
    if replace:
        flags = [f for f in flags if not f.startswith(_COUNT)]
    if n is not None and not any(f.startswith(_COUNT) for f in flags):
        flags.append(f"{_COUNT}={int(n)}")
    if not any(f.startswith(CPU_SCHEDULER_FLAG.split("=")[0]) for f in flags):
        flags.append(CPU_SCHEDULER_FLAG)
    env["XLA_FLAGS"] = " ".join(flags)
    counts = [f.split("=", 1)[1] for f in flags if f.startswith(f"{_COUNT}=")]
    if counts and counts[-1].isdigit() and int(counts[-1]) > 1:
        env.setdefault("OPENBLAS_NUM_THREADS", "1")


def set_cpu_devices(n: int | None = None) -> None:
    """Configure this process's CPU backend: ``n`` fake CPU devices and the deadlock workaround.

    Call it before anything starts JAX's backend (importing ``jax`` and ``shardvmc`` is
    fine; creating an array is not). It edits ``os.environ`` with
    :func:`cpu_environment`: the device count unless one is already set (so a launcher's
    or user's choice wins), :data:`CPU_SCHEDULER_FLAG`, and one OpenBLAS thread with
    several fake devices (which takes effect only if scipy's OpenBLAS has not been loaded
    yet; JAX loads it when its backend starts).

    Args:
        n: the number of fake CPU devices; ``None`` sets only the scheduler flag.

    Raises:
        RuntimeError: when JAX's backend has already started (the flags would be ignored).

    Example:
        >>> from shardvmc.testing import set_cpu_devices
        >>> set_cpu_devices(8)  # doctest: +SKIP
    """
    if _internals.backends_initialized():
        raise RuntimeError(
            "set_cpu_devices: JAX's backend has already started, so XLA_FLAGS would be ignored; call it first "
            "thing in the program, before any JAX array is created."
        )
    cpu_environment(os.environ, n)


def _arrays(tree: Any, where: str) -> list[tuple[str, jax.Array]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path) or "<root>"
        if isinstance(leaf, Tracer):
            raise AssertionError(
                f"{where}: leaf {name} is a tracer; shardings can only be checked on concrete arrays "
                "(call it outside jit)."
            )
        if not isinstance(leaf, jax.Array):
            raise AssertionError(f"{where}: leaf {name} is a {type(leaf).__name__}, not a jax.Array on devices.")
        out.append((name, leaf))
    return out


def assert_walker_sharded(tree: Any, mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "walkers") -> None:
    """Assert that every non-scalar leaf is split over the walker axis of ``mesh``.

    Lists every leaf that is not, with its sharding, in one ``AssertionError``.

    Example:
        >>> import numpy as np, shardvmc as sv
        >>> from shardvmc.testing import assert_walker_sharded
        >>> mesh = sv.create_mesh()
        >>> assert_walker_sharded(sv.shard_walker(np.zeros((8, 3)), mesh), mesh)
    """
    mesh, axes = walker_mesh(mesh, axis_name, where="assert_walker_sharded")  # where shard_walker puts them
    expected = NamedSharding(mesh, PartitionSpec(axes))
    bad = []
    for name, leaf in _arrays(tree, "assert_walker_sharded"):
        if leaf.ndim == 0:
            continue
        if not leaf.sharding.is_equivalent_to(expected, leaf.ndim):
            bad.append(f"  {name}: shape {leaf.shape}, sharding {leaf.sharding}")
    if bad:
        raise AssertionError(
            f"assert_walker_sharded: {len(bad)} leaves are not sharded P({axes!r}) over mesh "
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
