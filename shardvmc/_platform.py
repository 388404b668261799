"""The platform a program is traced for: ``compiling_for``, ``traced_platform``, ``platform_dependent``.

Some of the library's code takes a different algorithm per platform (the local energy's
Laplacian and its float32 rewrite on TPUs, DMC's resampling, a Cholesky solve).
``jax.lax.platform_dependent`` chooses where the program is lowered, so it traces every
branch: on a CPU a local energy was traced twice, once as the TPU's program, and the
branches must agree on their dtypes even where only one of them will ever run. A kernel
knows its mesh, and so its platform, when it traces: it traces under
``compiling_for(platform)``, and :func:`platform_dependent` then traces that platform's
branch alone. Without a known platform (a function called in the user's own ``jax.jit``
outside any kernel) it is ``jax.lax.platform_dependent``.

Only code whose trace is keyed by the kernel's mesh may read the platform: the kernel's
body, not a ``jax.jit`` nested in it, whose trace JAX caches by its arguments' types alone
(a process with both a CPU and a TPU mesh would reuse one platform's trace on the other).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from jax import lax
from jax.sharding import Mesh

__all__ = ["compiling_for", "mesh_platform", "platform_dependent", "traced_platform"]

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


def platform_dependent(
    *args: Any, tpu: Callable[..., Any], default: Callable[..., Any], cpu: Callable[..., Any] | None = None
) -> Any:
    """``jax.lax.platform_dependent(*args, tpu=..., cpu=..., default=...)``, one branch traced where it is known."""
    platform = _PLATFORM.get()
    if platform is not None:
        branch = tpu if platform == "tpu" else cpu if platform == "cpu" and cpu is not None else default
        return branch(*args)
    branches = {"tpu": tpu} if cpu is None else {"tpu": tpu, "cpu": cpu}
    return lax.platform_dependent(*args, default=default, **branches)
