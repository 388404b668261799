"""The platform a program is traced for: ``compiling_for``, ``traced_platform``.

Some of the library's code takes a different program per platform (the local energy's float32
rewrite on TPUs; DMC's resampling and a Cholesky solve, which stay with JAX's choice).
``jax.lax.platform_dependent`` chooses where the program is lowered, so it traces every
branch: on a CPU a local energy was traced twice, once as the TPU's program, and the
branches must agree on their dtypes even where only one of them will ever run. A kernel
knows its mesh, and so its platform, when it traces: it traces under
``compiling_for(platform)``, and code that reads :func:`traced_platform` (``_numerics.accurate``)
then traces that platform's branch alone. Without a known platform (a function called in the
user's own ``jax.jit`` outside any kernel) it is ``jax.lax.platform_dependent``, every branch.

Only code whose trace is keyed by the kernel's mesh may read the platform: the kernel's
body, not a ``jax.jit`` nested in it, whose trace JAX caches by its arguments' types alone
(a process with both a CPU and a TPU mesh would reuse one platform's trace on the other).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from jax.sharding import Mesh

__all__ = ["compiling_for", "mesh_platform", "traced_platform"]

_PLATFORM: ContextVar[str | None] = ContextVar("shardvmc_traced_platform", default=None)


def mesh_platform(mesh: Mesh) -> str:
    """The platform of a mesh's devices (``"cpu"``, ``"gpu"``, ``"tpu"``): one per mesh."""
    platform = mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Trace the enclosed code for ``platform`` (``None``: unknown, every branch as JAX does)."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def traced_platform() -> str | None:
    """The platform the current trace is for, where a kernel said so; else ``None``."""
    return _PLATFORM.get()
