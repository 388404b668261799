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
from typing import Any, NamedTuple, Protocol

import jax
from jax.sharding import Mesh

__all__ = [
    "CONTEXT_MESH",
    "Jaxpr",
    "NO_CONTEXT_MESH",
    "SignalDisposition",
    "backends_initialized",
    "closed_jaxpr_parts",
    "is_jaxpr",
    "literal_value",
    "distributed_settings",
    "gloo_host",
    "pin_gloo_host",
    "set_signal_disposition",
    "signal_disposition",
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


# ----------------------------------------------------------------------------- jaxprs
#
# What: ``jax.extend.core``'s ``Jaxpr``, ``ClosedJaxpr`` and ``Literal``, as a traced program's parts.
# Why: ``_numerics.accurate`` evaluates a traced program with some operations replaced (JAX has no
# public interpreter that substitutes primitives). ``jax.extend.core`` is JAX's public home for
# these types; JAX 0.12 merged ``ClosedJaxpr`` into ``Jaxpr`` (which then carries its ``consts``),
# hence the duck typing.
# When it can go: when JAX offers a primitive-substituting interpreter, or a per-op accuracy policy
# (``lax.exp(x, accuracy=...)`` is per call, and XLA's TPU compiler rejected some of those ops).

from jax.extend import core as _jex_core  # noqa: E402

Jaxpr = _jex_core.Jaxpr
_ClosedJaxpr: Any = getattr(_jex_core, "ClosedJaxpr", _jex_core.Jaxpr)


def is_jaxpr(value: Any) -> bool:
    """Whether ``value`` (an equation's parameter) is a program: a ``Jaxpr`` or ``ClosedJaxpr``."""
    return isinstance(value, (_jex_core.Jaxpr, _ClosedJaxpr))


def closed_jaxpr_parts(program: Any) -> tuple[Any, Any]:
    """``(jaxpr, consts)`` of a ``ClosedJaxpr`` (or of a ``Jaxpr``: its ``consts``, if it has them, else none)."""
    if isinstance(program, _ClosedJaxpr) and hasattr(program, "jaxpr") and program.jaxpr is not program:
        return program.jaxpr, program.consts
    return program, tuple(getattr(program, "consts", ()))


def literal_value(atom: Any) -> tuple[Any] | None:
    """``(value,)`` when ``atom`` (an equation's input) is a literal constant, else ``None`` (a variable)."""
    return (atom.val,) if isinstance(atom, _jex_core.Literal) else None


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
# it settled on (auto-detection included).
# Why: a second ``sv.distributed.initialize`` is compared with the first; the public
# ``jax.process_count()``/``jax.process_index()`` would start the backend, and the coordinator
# address has no public getter.
# When it can go: when JAX exposes the settings; then read those.


def distributed_settings() -> dict[str, Any]:
    """``coordinator_address``, ``num_processes`` and ``process_id`` of JAX's distributed runtime.

    Values JAX does not hold (or a JAX of another layout) come back as ``None``.
    """
    names = ("coordinator_address", "num_processes", "process_id")
    try:
        from jax._src.distributed import global_state
    except ImportError:  # pragma: no cover
        return dict.fromkeys(names)
    return {name: getattr(global_state, name, None) for name in names}


# ----------------------------------------------------------------------------- JAX's SIGTERM notifier
#
# What: ``jax.distributed.initialize`` starts JAX's preemption notifier (XLA's ``SigtermNotifier``,
# while ``jax_enable_preemption_service`` is on, its default), which replaces the process's
# SIGTERM disposition at the C level (``std::signal``) with a handler that only records the signal
# for ``multihost_utils.reached_preemption_sync_point``: from then on SIGTERM no longer ends the
# process, and ``signal.signal`` cannot put JAX's handler back once it is replaced (Python sees a C
# handler as ``None``). So the disposition is saved and set as the operating system holds it
# (``sigaction`` through ``ctypes``), as opaque bytes.
# Why: ``sv.distributed.initialize`` (``fail_fast``) gives SIGTERM back its disposition from before
# the call, so that a program that does not take SIGTERM as a preemption notice ends on it (and the
# run with it), and hands it to JAX's notifier at the first ``sv.distributed.reached_preemption``.
# JAX (0.10.2, 0.12) has no option to start the notifier later or to leave SIGTERM alone.
# When it can go: when JAX can start its notifier on demand (or takes a signal disposition option);
# then use that.

_SIGACTION_BYTES = 1024  # more than any libc's struct sigaction (152 bytes on glibc x86-64, 16 on macOS)


class SignalDisposition(NamedTuple):
    """A signal's disposition as the operating system holds it: its handler's address and the whole record.

    Compare dispositions by ``handler`` (0 is ``SIG_DFL``): libc leaves unused bytes of the
    record as they were on its stack, and adds its own flags to what it sets.
    """

    handler: int
    raw: bytes


def _sigaction(number: int, new: bytes | None) -> SignalDisposition | None:
    """The disposition of signal ``number``, after setting it to ``new`` when given."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sigaction
    except (OSError, AttributeError):  # pragma: no cover - no POSIX sigaction (Windows)
        return None
    old = ctypes.create_string_buffer(_SIGACTION_BYTES)
    act = None if new is None else ctypes.create_string_buffer(new, _SIGACTION_BYTES)
    if call(number, act, old) != 0:  # pragma: no cover - an invalid signal number
        return None
    handler = ctypes.c_void_p.from_buffer_copy(old.raw).value or 0  # the first member on Linux and macOS
    return SignalDisposition(handler, old.raw)


def signal_disposition(number: int) -> SignalDisposition | None:
    """What signal ``number`` does now, as the operating system holds it (C handlers included).

    ``None`` where ``sigaction`` is not available.
    """
    return _sigaction(number, None)


def set_signal_disposition(number: int, disposition: SignalDisposition) -> bool:
    """Put back a disposition read by :func:`signal_disposition`; ``False`` where that cannot be done."""
    return _sigaction(number, disposition.raw) is not None


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
