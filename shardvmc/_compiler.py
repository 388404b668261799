"""The XLA options of a step's program, per platform: ``compiler_options``, ``platform_jit``.

On CPUs, JAX 0.10's XLA hands small matrix products, and the operations around them, to
YNNPACK fusions. For the few walkers per device of a VMC step they can be far slower than
XLA's own code (docs/faq.md, "A CPU run much slower on JAX 0.10"). And where a process has
at least as many CPU devices as cores (fake devices on a workstation), every device already
runs its program on a thread of its own: Eigen's thread pool, which XLA's matrix products
share, then adds only hand-offs between threads (a quarter of DeepQMC's sampler step on 8
devices and 2 cores). And XLA's concurrency-optimised scheduler can deadlock a large CPU
program (a FermiNet-size local energy never returned, every thread idle on a futex): importing
shardvmc turns it off in ``XLA_FLAGS`` while JAX's backend has not started
(:func:`guard_cpu_runtime`; the compiler option alone did not stop that hang). So the steps
the library compiles itself (``sv.driver.VMC.step``, ``sv.dmc.DMC``'s step), called at the top
level as ``sv.driver.run`` calls them, are compiled for CPUs without the fusions and without
that scheduler, and with single-threaded products where the devices fill the cores;
``jax.jit(step, compiler_options=sv.compiler_options())`` does the same for a step of your
own. XLA takes compiler options from the outermost program only (JAX refuses them on a
nested ``jax.jit``): a kernel or step called inside your ``jax.jit`` follows yours.
``XLA_FLAGS`` that name an option win: the library then does not pass that one. Other
platforms get none.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

from ._caches import bounded
from ._internals import backends_initialized, tracing

__all__ = ["SCHEDULER_FLAG", "compiler_options", "guard_cpu_runtime", "platform_jit"]

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

_Option = tuple[str, str | bool]
_NO_YNN: _Option = ("xla_cpu_experimental_ynn_fusion_type", "")  # an empty list of fusion types: none
_ONE_THREAD: _Option = ("xla_cpu_multi_thread_eigen", False)
# XLA's concurrency-optimised scheduler of CPU programs can deadlock a large one (every thread idle on a futex,
# the call never returns: a FermiNet-size local energy on its first call, a step with a Jacobian and a solve on its
# second; jaxlib 0.10.2). Without it the same programs ran in the same time.
_NO_CONCURRENT_SCHEDULER: _Option = (SCHEDULER_FLAG.split("=")[0].removeprefix("--"), False)  # the flag, per compile


@bounded(8)
def _accepted(option: _Option) -> bool:
    """Whether this JAX's CPU compiler knows ``option`` (an experimental flag a later XLA may rename)."""
    try:
        one = jax.device_put(1.0, jax.devices("cpu")[0])  # compiled for a CPU whatever the default backend
        jax.jit(lambda x: x + 1, compiler_options=dict([option])).lower(one).compile()
    except Exception:  # "No such compile option": compile as JAX does
        return False
    return True


def guard_cpu_runtime() -> None:
    """Turn XLA's concurrency-optimised CPU scheduler off for the process, while JAX's backend has not started.

    Called when shardvmc is imported. The compiler option alone (:func:`compiler_options`) did
    not stop the deadlock on jaxlib 0.10.2: the templates' network at FermiNet's size, N2's local
    energy for 64 walkers on one CPU device, compiled with it and still never returned from its
    first call, while with the flag in ``XLA_FLAGS`` five calls took 44 s. XLA reads the flags
    once, when the backend starts; a flag that ``XLA_FLAGS`` names already is left as it is.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG.split("=")[0] not in flags and not backends_initialized():
        os.environ["XLA_FLAGS"] = f"{flags} {SCHEDULER_FLAG}".strip()


def _cores() -> int:
    """The cores this process may run on (its affinity: what a job scheduler gave it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def compiler_options(platform: str | None = None) -> dict[str, str | bool]:
    """The XLA compiler options of the library's steps on ``platform`` (default: JAX's default backend).

    On CPUs: no YNNPACK fusions (slow for the few walkers per device of a VMC step on
    JAX 0.10), no concurrency-optimised scheduler (it can deadlock a large program); and,
    where this process has at least as many CPU devices as cores, single-threaded matrix
    products (each device already holds a core). An option that
    ``XLA_FLAGS`` names is left to the flags, and one this JAX does not know is left
    out. Elsewhere: none. Pass them to the ``jax.jit`` of your own outermost step; a
    nested ``jax.jit`` takes no options.

    Args:
        platform: ``"cpu"``, ``"gpu"``, ``"tpu"``...; ``None`` for ``jax.default_backend()``.

    Returns:
        A dict for ``jax.jit(..., compiler_options=...)``, empty where there is nothing to set.

    Example:
        >>> import jax, shardvmc as sv
        >>> step = jax.jit(lambda x: x @ x.T, compiler_options=sv.compiler_options())
        >>> sv.compiler_options("tpu")
        {}
    """
    platform = jax.default_backend() if platform is None else platform
    if platform != "cpu":
        return {}
    options: list[_Option] = [_NO_YNN, _NO_CONCURRENT_SCHEDULER]
    # Each device runs its program on a thread of its own: with a device on every core, a product split over
    # Eigen's pool only waits for threads the other devices hold.
    if jax.local_device_count("cpu") >= _cores():
        options.append(_ONE_THREAD)
    flags = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in options if name not in flags and _accepted((name, value))}


class platform_jit:  # noqa: N801  # stands in for jax.jit
    """``jax.jit(fn, **kwargs)``, called at the top level with :func:`compiler_options` of JAX's default backend.

    Inside a trace (your ``jax.jit``, ``lax.scan``...) it is the plain jit: JAX takes
    compiler options on the outermost program only. Building it touches no device (a step
    made before ``jax.distributed.initialize`` stays valid); ``lower``, ``trace`` and
    ``eval_shape`` are the top-level jit's.
    """

    __slots__ = ("__wrapped__", "__weakref__", "_kwargs", "_nested", "_top")  # jax.jit holds its function weakly

    def __init__(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        self.__wrapped__, self._kwargs = fn, kwargs
        self._nested = jax.jit(fn, **kwargs)  # touches no device
        self._top: Any = None

    def _top_level(self) -> Any:
        if self._top is None:
            options = compiler_options()
            self._top = jax.jit(self.__wrapped__, compiler_options=options, **self._kwargs) if options else self._nested
        return self._top

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            return self._nested(*args, **kwargs)
        return (self._top or self._top_level())(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._top_level(), name)
