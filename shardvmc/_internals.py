"""The one place that touches other libraries' internals: JAX's private modules and JAX's error texts.

Every use of a private JAX API (``jax._src...``) and every reading of the text of an
error another library raised sits behind one function here. Each has a test in
``tests/test_internals.py`` that fails when the internal changes (so a new JAX breaks a
named test, not a user's run), and a comment saying when it can go. Other modules call
these functions and never reach into ``jax._src`` themselves.

kfac-jax's internals live in ``_kfac_compat`` (kfac-jax is an optional dependency, so
they cannot be imported from here).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

__all__ = [
    "CONTEXT_MESH",
    "NO_CONTEXT_MESH",
    "backends_initialized",
    "detach_distributed_runtime",
    "distributed_settings",
    "gloo_host",
    "pin_gloo_host",
    "tracing",
    "vma_check_verdict",
]


# ----------------------------------------------------------------------------- the current mesh
#
# What: ``jax._src.mesh.device_context`` (``jax._src.config.device_context`` on JAX 0.10), the
# config state behind ``jax.set_mesh``: its ``value`` is the context mesh, or ``None`` (JAX 0.10)
# or ``jax._src.mesh.empty_concrete_mesh`` (JAX 0.11+) when none is set.
# Why: the engine reads it at every kernel call, so every 0.1 us counts: ``CONTEXT_MESH.value``
# costs 0.03 to 0.1 us, the private ``get_concrete_mesh()`` 0.1 us more, and the public
# ``jax.sharding.get_mesh`` 0.8 us and raises inside ``jax.jit``, where kernels are also called.
# ``NO_CONTEXT_MESH`` lets the engine test "no mesh" by identity (``Mesh.empty`` costs 0.09 us).
# When it can go: once the public getter works while tracing and costs about the same; then use it
# (``jax.sharding.get_mesh``) and delete this and its test.


class _ContextMeshState(Protocol):
    @property
    def value(self) -> Mesh | None: ...


class _PublicContextMesh:  # pragma: no cover - another JAX layout: the public getter (slower, refuses tracing)
    @property
    def value(self) -> Mesh | None:
        return getattr(jax.sharding, "get_mesh", lambda: None)()


def _context_mesh_state() -> tuple[_ContextMeshState, Mesh | None]:
    try:
        from jax._src import config as jax_config
        from jax._src import mesh as jax_mesh
    except ImportError:  # pragma: no cover - another JAX layout
        return _PublicContextMesh(), None
    # JAX 0.11+ keeps the state in jax._src.mesh, JAX 0.10 in jax._src.config.
    state = getattr(jax_mesh, "device_context", None) or getattr(jax_config, "device_context", None)
    if state is None:  # pragma: no cover - another JAX layout
        return _PublicContextMesh(), None
    return state, getattr(jax_mesh, "empty_concrete_mesh", None)


CONTEXT_MESH, NO_CONTEXT_MESH = _context_mesh_state()
"""``CONTEXT_MESH.value``: JAX's current mesh (``jax.set_mesh``), or ``None`` or ``NO_CONTEXT_MESH``."""


# ----------------------------------------------------------------------------- tracing or not
#
# What: ``jax._src.core.trace_state_clean``, whether code runs at the top level or inside a trace
# (``jax.jit``, ``grad``, ``vmap``, ``lax.scan``...).
# Why: a kernel whose own mesh spans other devices than the context mesh runs there when called
# eagerly, and on the context mesh inside a trace (one traced program runs on one set of devices,
# which its caller fixed). ``jax.set_mesh`` asks the same question to refuse tracing; JAX has no
# public spelling in JAX 0.10.2 or 0.12, and a tracer among the arguments does not tell it (a
# kernel may be traced with constant arguments only).
# When it can go: when JAX offers a public spelling; then call that.

try:
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - another JAX layout: assume a trace (the context mesh is used)

    def _trace_state_clean() -> bool:
        return False


def tracing() -> bool:
    """Whether the caller runs inside a JAX trace (``jax.jit``, a transformation, a control-flow body)."""
    return not _trace_state_clean()


# ----------------------------------------------------------------------------- the backend
#
# What: ``jax._src.xla_bridge.backends_are_initialized``.
# Why: ``sv.distributed.initialize`` and ``sv.testing.set_cpu_devices`` must refuse to run once a
# backend has started (JAX would ignore them, or fail with a message that does not name the fix),
# and JAX has no public way to ask without starting one.
# When it can go: when JAX offers a public spelling (none in JAX 0.12).


def backends_initialized() -> bool:
    """Whether a JAX backend has started in this process (``False`` when JAX's layout is unknown)."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - then JAX's own error speaks
        return False
    # the attribute is read at each call, so a test that replaces it is seen
    is_initialized = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(is_initialized()) if is_initialized is not None else False


# ----------------------------------------------------------------------------- gloo's host
#
# What: JAX's CPU client builds its cross-process collectives with
# ``jax._src.xla_bridge._jax.make_gloo_tcp_collectives(distributed_client=...)``; the one factory
# is wrapped to add ``hostname=``.
# Why: left alone, gloo binds to the address the machine's name resolves to, which sandboxes and
# CI runners may not route, although a group whose coordinator is on loopback lives on one
# machine. JAX (0.10.2 and 0.12) has no option or environment variable for gloo's host or
# interface, and gloo reads none.
# When it can go: when JAX passes a host or interface of its own (a config option or an argument
# of ``jax.distributed.initialize``); then set that instead.


class _OnHost:
    """JAX's gloo factory with ``hostname=host`` where the caller names neither a host nor an interface."""

    def __init__(self, make: Callable[..., Any], host: str) -> None:
        self.__wrapped__ = make
        self.shardvmc_host = host

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("hostname") is None and kwargs.get("interface") is None:
            kwargs["hostname"] = self.shardvmc_host
        return self.__wrapped__(*args, **kwargs)


def _gloo_module() -> Any:
    from jax._src import xla_bridge

    # the module xla_bridge calls the factory from, which it imports without re-exporting it
    return xla_bridge._jax  # pyright: ignore[reportPrivateImportUsage]


def pin_gloo_host(host: str) -> bool:
    """Make gloo listen and connect on ``host``; ``False`` (nothing changed) when JAX's layout is unknown.

    A host or interface that someone else passes to the factory is kept. Calling it
    again replaces the host (the factory is wrapped once).
    """
    try:
        module = _gloo_module()
        make = module.make_gloo_tcp_collectives
    except (ImportError, AttributeError):  # pragma: no cover - another JAX layout: keep its default
        return False
    make = getattr(make, "__wrapped__", make)
    module.make_gloo_tcp_collectives = _OnHost(make, host)
    return True


def gloo_host() -> str | None:
    """The host :func:`pin_gloo_host` set, or ``None``."""
    try:
        return getattr(_gloo_module().make_gloo_tcp_collectives, "shardvmc_host", None)
    except (ImportError, AttributeError):  # pragma: no cover
        return None


# ----------------------------------------------------------------------------- the distributed runtime
#
# What: ``jax._src.distributed.global_state``: the coordinator address, process count and index
# it settled on (auto-detection included), and the runtime objects JAX's exit handler shuts down.
# Why, settings: a second ``sv.distributed.initialize`` is compared with the first; the public
# ``jax.process_count()``/``jax.process_index()`` would start the backend, and the coordinator
# address has no public getter.
# Why, detaching: ``sv.distributed.initialize(fail_fast=True)`` lets a failing process leave
# without JAX's shutdown barrier. JAX's exit handler calls ``jax.distributed.shutdown()``, whose
# client waits (up to ``shutdown_timeout_seconds``, 300 s) for every process, and so does the
# client's destructor at interpreter teardown (measured when this was written: a failing process
# whose peer sleeps ends only when the peer does); JAX 0.10.2 and 0.12 have no public way to leave without waiting (the
# public ``shutdown_timeout_seconds`` is process 0's service setting and bounds successful exits
# too). So the objects are taken out of JAX's state and never released (``Py_IncRef`` through
# ``ctypes``): no destructor runs, and the operating system closes their connections when the
# process ends.
# When it can go: when ``jax.distributed.shutdown`` (or the client) takes a "do not wait" option or
# JAX exposes the settings; then call that instead.

_RUNTIME_OBJECTS = ("preemption_sync_manager", "client", "service")  # shut down in this order by JAX


def _global_state() -> Any:
    from jax._src.distributed import global_state

    return global_state


def distributed_settings() -> dict[str, Any]:
    """``coordinator_address``, ``num_processes`` and ``process_id`` of JAX's distributed runtime.

    Values JAX does not hold (or a JAX of another layout) come back as ``None``.
    """
    names = ("coordinator_address", "num_processes", "process_id")
    try:
        state = _global_state()
    except ImportError:  # pragma: no cover
        return dict.fromkeys(names)
    return {name: getattr(state, name, None) for name in names}


def detach_distributed_runtime() -> bool:
    """Take JAX's runtime objects out of its state and keep them alive until the process ends.

    Afterwards ``jax.distributed.is_initialized()`` is ``False`` and JAX's exit handler finds
    nothing to shut down, so this process leaves without waiting for its peers. Only for a
    process about to exit. ``False`` when JAX's layout is unknown (then its barrier waits).
    """
    try:
        state = _global_state()
    except ImportError:  # pragma: no cover
        return False
    for name in _RUNTIME_OBJECTS:
        obj = getattr(state, name, None)
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # never released: its destructor would wait
            setattr(state, name, None)
    return True


# ----------------------------------------------------------------------------- the varying-axes verdict
#
# What: the text of the ``ValueError`` JAX raises when ``shard_map(check_vma=True)`` cannot prove an
# output of ``out_specs`` ``P()`` replicated: "... out_specs[i] is P() ... can't be statically
# inferred ...", read for the positions ``i``; and a ``SystemExit`` caught while tracing.
# Why: the engine asks JAX whether a kernel's ``Replicated`` outputs are replicated, to name the
# output that is not; JAX reports the position only in the message. folx 0.2.30's sparse
# Laplacian calls ``exit()`` (``folx/interpreter.py``) when an eager evaluation fails, which it
# does under the check; that is only a body the check cannot judge.
# When it can go: the text, when JAX's error carries the positions as attributes (or offers the
# check as a function); the ``SystemExit``, when folx no longer calls ``exit()``.

_NOT_REPLICATED = re.compile(r"out_specs\[(\d+)\] is P\(\)")
_CANNOT_INFER = "can't be statically inferred"


def vma_check_verdict(trace: Callable[[], Any]) -> list[int] | None:
    """Run ``trace`` (a trace under ``shard_map(check_vma=True)``) and read JAX's verdict.

    Returns ``[]`` when it traces (JAX proves every ``P()`` output replicated), the
    positions in ``out_specs`` of the outputs JAX found varying over the mesh, or ``None``
    when the body does not trace under the check (then JAX cannot tell).
    """
    try:
        trace()
    except ValueError as err:
        text = str(err)
        found = _NOT_REPLICATED.findall(text)
        if _CANNOT_INFER not in text or not found:
            return None
        return sorted({int(i) for i in found})
    except (Exception, SystemExit):  # the body does not trace under the check (folx may even call exit())
        return None
    return []
