"""The package's caches of kernels and compiled programs: bounded, and one function that clears them all.

shardvmc keeps, per process, the kernels its functions build (a reduction per mesh, a
solver per configuration) and, in each kernel, its plans and its ``jax.jit`` per mesh.
Each module-level cache is a bounded LRU (``bounded``), so a program that varies meshes
or shapes does not keep every program it ever compiled; :func:`clear_caches` empties
them all and JAX's own caches, as ``equinox.clear_caches`` does.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax

__all__ = ["bounded", "clear_caches", "register_kernel"]

_F = TypeVar("_F", bound=Callable[..., Any])
_CLEARS: list[Callable[[], None]] = []


class _Clearable(Protocol):
    def clear_cache(self) -> None: ...


_KERNELS: weakref.WeakSet[Any] = weakref.WeakSet()


def bounded(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache(maxsize)``, registered with :func:`clear_caches`."""

    def wrap(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _CLEARS.append(cached.cache_clear)
        return cached  # pyright: ignore[reportReturnType]  # lru_cache keeps the signature

    return wrap


def register_kernel(kernel: _Clearable) -> None:
    """Let :func:`clear_caches` empty this kernel's plans and programs (held weakly)."""
    _KERNELS.add(kernel)


def clear_caches() -> None:
    """Empty shardvmc's caches of kernels and compiled programs, and JAX's.

    Use it between independent jobs in one process (a sweep over system sizes, say) to
    release the memory of programs that will not run again; the next call of a kernel
    traces and compiles anew. Like ``equinox.clear_caches``.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel
        ... def energy(r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
        ...     return jnp.sum(r**2)
        >>> before = float(energy(jnp.ones((8, 3))))
        >>> sv.clear_caches()
        >>> float(energy(jnp.ones((8, 3)))) == before
        True
    """
    for clear in _CLEARS:
        clear()
    for kernel in list(_KERNELS):
        kernel.clear_cache()
    jax.clear_caches()
