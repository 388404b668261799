"""Multi-process (multi-host) runs on JAX's distributed runtime.

One process per GPU or per node, all running the same program: call
:func:`initialize` first, before anything touches a device, and every shardvmc
function then works on the global mesh of all processes' devices. Importing
shardvmc and decorating functions touch no device, so the call may come after them.

Example:
    >>> import shardvmc as sv
    >>> if sv.distributed.is_launched():  # started by `python -m shardvmc.launch`
    ...     sv.distributed.initialize()
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _internals
from ._errors import CallError, describe, message

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "PREEMPTED_EXIT_CODE",
    "PREEMPTION_SIGNALS",
    "check_consistent",
    "initialize",
    "is_launched",
    "reached_preemption",
]

ENV_COORDINATOR = "SHARDVMC_COORDINATOR_ADDRESS"
"""Environment variable the launcher sets to the coordinator's ``host:port``."""
ENV_NUM_PROCESSES = "SHARDVMC_NUM_PROCESSES"
"""Environment variable the launcher sets to the number of processes."""
ENV_PROCESS_ID = "SHARDVMC_PROCESS_ID"
"""Environment variable the launcher sets to this process's index (``0 .. n-1``)."""

# What this module passed to jax.distributed.initialize, to compare a second call with.
_SETTINGS: dict[str, Any] | None = None


def is_launched() -> bool:
    """Whether this process was started by ``python -m shardvmc.launch``.

    True when the launcher's environment variables (``SHARDVMC_COORDINATOR_ADDRESS``,
    ``SHARDVMC_NUM_PROCESSES``, ``SHARDVMC_PROCESS_ID``) are all set. Touches no device.

    Example:
        >>> import shardvmc as sv
        >>> sv.distributed.is_launched()  # a plain test process
        False
    """
    return all(os.environ.get(name) for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))


def _launched_settings() -> tuple[str, int, int]:
    values = {name: os.environ[name] for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)}
    try:
        return values[ENV_COORDINATOR], int(values[ENV_NUM_PROCESSES]), int(values[ENV_PROCESS_ID])
    except ValueError:
        raise CallError(
            message(
                "shardvmc.distributed.initialize",
                "the launcher's environment variables are not integers where they should be.",
                got=", ".join(f"{k}={v!r}" for k, v in values.items()),
                fix="start the program with `python -m shardvmc.launch`, or unset the SHARDVMC_* variables.",
            )
        ) from None


def _loopback_host(coordinator_address: str | None) -> str | None:
    """The loopback address of a coordinator on this machine's loopback, else ``None``."""
    if not coordinator_address or ":" not in coordinator_address:
        return None
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost" or host.startswith("127."):
        return "127.0.0.1"
    return "::1" if host == "::1" else None


def _select_cpu_collectives(coordinator_address: str | None) -> None:
    """Give the CPU client cross-process collectives: gloo unless the program chose an implementation.

    JAX's own default is gloo; only an explicit ``None`` leaves the CPU client without
    cross-process collectives, and then every computation across processes on CPU arrays
    fails. No platform is guessed: the CPU collectives serve CPU arrays only, and on a GPU
    or TPU run gloo is what JAX sets up for its CPU client by default anyway, while a guess
    from installed plugins (a CUDA plugin on a machine without a GPU, where JAX runs on
    CPU) would leave the CPU run without them. ``mpi`` and ``megascale`` are kept as chosen.
    """
    # jax.config makes its options attributes at run time, which a type checker cannot see (hence the ignores)
    if jax.config.jax_cpu_collectives_implementation is None:  # pyright: ignore[reportAttributeAccessIssue]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    loopback = _loopback_host(coordinator_address)
    collectives = jax.config.jax_cpu_collectives_implementation  # pyright: ignore[reportAttributeAccessIssue]
    if loopback is not None and collectives == "gloo":
        # A group on loopback lives on one machine; left alone, gloo binds to the address of the machine's
        # name, which sandboxes and CI runners may not route, and JAX has no option for it (see _internals).
        _internals.pin_gloo_host(loopback)


def _exit_code(status: Any) -> int:
    """The process exit code Python gives ``sys.exit(status)``."""
    if status is None:
        return 0
    if not isinstance(status, int):
        return 1  # sys.exit("message") prints the message and exits with 1
    return status & 0xFF  # a bool too: sys.exit(False) exits with 0


def _interactive() -> bool:
    """An interactive session, where ``sys.last_value`` holds every error shown at the prompt."""
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


class _ExitWatch:
    """What ``initialize(fail_fast=True)`` set up to recognise a failing exit (once per process).

    Python offers no way to read the exit code at exit, so the two ways a program fails
    are recognised as follows. An uncaught exception: Python sets ``sys.last_value``
    before calling ``sys.excepthook``, so no hook is replaced and a hook the program
    installs later (``rich.traceback.install()``) changes nothing. ``sys.exit(code)`` in
    the main thread: ``SystemExit`` is handled in C, out of Python's sight, so ``sys.exit``
    is wrapped (the wrapper records the code and calls the ``sys.exit`` it found); the
    wrapper is removed again at exit.
    """

    def __init__(self) -> None:
        self.active = False
        self.status = 0  # the code of the last sys.exit in the main thread
        self.found_exit: Any = None
        self.wrapper: Any = None
        self.shown_before: BaseException | None = None  # an error already shown before initialize

    def start(self) -> None:
        if self.active:
            return
        found = sys.exit

        @functools.wraps(found)
        def exit_(*args: Any) -> None:
            if threading.current_thread() is threading.main_thread():
                self.status = _exit_code(args[0] if args else None)  # the last call counts
            found(*args)

        self.found_exit, self.wrapper, self.status = found, exit_, 0
        self.shown_before = getattr(sys, "last_value", None)
        sys.exit = exit_
        self.active = True

    def failing_code(self) -> int | None:
        """This process's exit code if it is failing, else ``None``; ``-n``: it ends by signal ``n``."""
        uncaught = getattr(sys, "last_value", None)
        if uncaught is not None and uncaught is not self.shown_before and not _interactive():
            # Python ends a process whose KeyboardInterrupt was not caught with SIGINT, any other error with 1
            return -int(signal.SIGINT) if isinstance(uncaught, KeyboardInterrupt) else 1
        return self.status or None

    def stop(self) -> None:
        if sys.exit is self.wrapper:
            sys.exit = self.found_exit
        self.active = False


_EXIT_WATCH = _ExitWatch()


def _flush_before_leaving() -> None:
    """Flush what a normal exit would have flushed: log handlers, then every open file (text layers first)."""
    import gc
    import io
    import logging

    try:
        logging.shutdown()
    except Exception:  # pragma: no cover - a broken handler must not keep the process from leaving
        pass
    # open() makes these (C types: testing them is quick, where the io.IOBase ABC costs 0.4 s in a JAX process)
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)
    files = [obj for obj in gc.get_objects() if isinstance(obj, kinds)] + [sys.stdout, sys.stderr]
    files.sort(key=lambda f: not isinstance(f, io.TextIOWrapper))  # a text file flushes into its binary buffer
    for f in files:
        try:
            if f is not None and not f.closed and f.writable():
                f.flush()
        except Exception:  # a file in any state (detached, a closed pipe): flush what can be flushed
            pass


def _leave_after_a_failure() -> None:
    """Exit handler: after a failure, leave at once with the process's own code, skipping JAX's shutdown barrier.

    Registered when shardvmc is imported, after JAX registered its own exit handler
    (``jax.distributed.shutdown()``, whose barrier waits for every process): exit handlers
    run last-registered first, so this one runs after those the program registered later
    and before JAX's. It does nothing unless ``initialize(fail_fast=True)`` set up the
    watch and the process is failing; then it flushes the files and leaves with
    ``os._exit`` (JAX has no public way to leave without the barrier, and a client
    destroyed at interpreter teardown waits in it too).
    """
    if not _EXIT_WATCH.active:
        return
    _EXIT_WATCH.stop()
    code = _EXIT_WATCH.failing_code()
    if code is None or not jax.distributed.is_initialized():
        return  # a successful exit waits for the peers in JAX's barrier, as JAX's own does
    _flush_before_leaving()
    if code < 0:  # as Python does after an uncaught KeyboardInterrupt: end by the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # (not reached: the signal ended the process)
    os._exit(code)


atexit.register(_leave_after_a_failure)


# JAX's SIGTERM disposition (its preemption notifier), kept aside by initialize until the first
# reached_preemption, and the disposition initialize left SIGTERM with.
_JAX_SIGTERM: _internals.SignalDisposition | None = None
_LEFT_SIGTERM: _internals.SignalDisposition | None = None


def _keep_sigterm(before: _internals.SignalDisposition | None) -> None:
    """After ``jax.distributed.initialize``: give SIGTERM back the disposition it had before, keeping JAX's aside."""
    global _JAX_SIGTERM, _LEFT_SIGTERM
    jax_notifier = _internals.signal_disposition(signal.SIGTERM)
    if before is None or jax_notifier is None or jax_notifier.handler == before.handler:
        return  # no sigaction here, or JAX installed no notifier (its preemption service off)
    if _internals.set_signal_disposition(signal.SIGTERM, before):
        _JAX_SIGTERM, _LEFT_SIGTERM = jax_notifier, _internals.signal_disposition(signal.SIGTERM)


def _give_sigterm_to_jax() -> None:
    """Hand SIGTERM to JAX's notifier, unless the program installed its own handler since ``initialize``."""
    global _JAX_SIGTERM, _LEFT_SIGTERM
    if _JAX_SIGTERM is None:
        return
    now = _internals.signal_disposition(signal.SIGTERM)
    if now is not None and _LEFT_SIGTERM is not None and now.handler == _LEFT_SIGTERM.handler:
        _internals.set_signal_disposition(signal.SIGTERM, _JAX_SIGTERM)
    _JAX_SIGTERM = _LEFT_SIGTERM = None


def _check_same(requested: dict[str, Any]) -> None:
    """A second call: nothing to do if it asks for what is set up, else a clear error."""
    current = {k: v for k, v in (_SETTINGS or {}).items() if v is not None}
    if "num_processes" not in current or "process_id" not in current:  # initialised by JAX directly
        current.update(num_processes=jax.process_count(), process_id=jax.process_index())
    differ = {k: (current[k], v) for k, v in requested.items() if v is not None and k in current and current[k] != v}
    if differ:
        raise CallError(
            message(
                "shardvmc.distributed.initialize",
                "the distributed runtime is already initialised with other settings.",
                got=", ".join(f"{k}={new!r}" for k, (_, new) in differ.items()),
                expected=", ".join(f"{k}={old!r}" for k, (old, _) in differ.items()),
                fix="call initialize once per process, first thing in the program; to change the group, "
                "start new processes.",
            )
        )


def _positive_seconds(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise CallError(
            message(
                "shardvmc.distributed.initialize",
                f"{name} must be a whole number of seconds, at least 1.",
                got=repr(value),
                fix=f"pass {name}=<seconds> as an int (JAX's setting takes whole seconds).",
            )
        )
    return int(value)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    fail_fast: bool = True,
    heartbeat_timeout_seconds: int = 10,
    shutdown_timeout_seconds: int = 300,
    **kwargs: Any,
) -> None:
    """Join this process to a multi-process JAX run (wraps ``jax.distributed.initialize``).

    With no arguments it joins the group started by ``python -m shardvmc.launch``
    when the launcher's ``SHARDVMC_*`` variables are set, and otherwise uses JAX's own
    cluster auto-detection (SLURM, Open MPI, Kubernetes, Cloud TPU). Unless the
    program chose a CPU collectives implementation (``jax_cpu_collectives_implementation``),
    it selects gloo, JAX's default, for cross-process computations on CPU arrays, on any
    platform (they serve CPU arrays only). Call it in every process before anything
    touches a device (``jax.devices()``, any computation); it may follow
    ``import shardvmc`` and the decoration of functions.

    Calling it again is a no-op when the settings asked for are the ones in place.

    A failure ends the run (``fail_fast=True``, the default). A process that fails, by
    ``sys.exit(code)`` with a non-zero code in the main thread or by an uncaught
    exception, does not wait for its peers in JAX's shutdown barrier: the exit handlers
    the program registered after ``import shardvmc`` run, log handlers and open files
    are flushed, and it exits with its own code (``os._exit``). The other processes
    learn of a process that is gone, however it ended (a failure, SIGKILL, a crash),
    from JAX's coordination service once its heartbeats stop, within
    ``heartbeat_timeout_seconds``, and JAX ends them (exit code 134), unless the
    launcher or the scheduler stopped them first. A SIGTERM ends the process, as in
    any program, until the first :func:`reached_preemption` hands it to JAX's
    preemption notifier (which catches it from ``jax.distributed.initialize`` on
    otherwise). A successful exit still waits for the other processes, up to
    ``shutdown_timeout_seconds``. ``fail_fast=False`` leaves the exit as JAX makes it:
    a failing process waits for its peers in the barrier, and JAX's notifier catches
    SIGTERM from the start. See ``docs/cluster.md``, "When a process fails", for the
    measured times and what ``sys.exit`` wrapping does not see (``raise SystemExit``).

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: the number of processes.
        process_id: this process's index, ``0 .. num_processes - 1``.
        local_device_ids: the local accelerators this process uses (e.g. ``[0]``).
        fail_fast: a failing process leaves without JAX's shutdown barrier, and an
            unhandled SIGTERM ends the process (above); ``False``: JAX's exit as it is.
        heartbeat_timeout_seconds: a process silent this long is declared dead and the
            others are ended (JAX's setting; JAX's default is 100). Its heartbeats come
            from a thread of JAX's runtime, every half of this, whatever Python computes.
        shutdown_timeout_seconds: how long a process that ends waits for the others at
            exit before JAX ends all of them (JAX's setting, the same default).
        **kwargs: passed on to ``jax.distributed.initialize`` (for example
            ``cluster_detection_method``, ``initialization_timeout``).

    Raises:
        CallError: a second call with other settings, a call after a device was
            touched (JAX can no longer join the group then), or a timeout that is not
            a whole number of seconds.

    Example:
        The usual first lines of a program that may run under the launcher:

        >>> import shardvmc as sv
        >>> if sv.distributed.is_launched():  # false in this (single) test process
        ...     sv.distributed.initialize()

        Two processes by hand, one per shell (skipped here: a process joins one group
        for its lifetime, and the test process must stay a single process):

        >>> import jax
        >>> sv.distributed.initialize("127.0.0.1:12345", num_processes=2, process_id=0)  # doctest: +SKIP
        >>> jax.process_count(), jax.device_count() > jax.local_device_count()  # doctest: +SKIP
        (2, True)
    """
    global _SETTINGS
    heartbeat = _positive_seconds("heartbeat_timeout_seconds", heartbeat_timeout_seconds)
    shutdown = _positive_seconds("shutdown_timeout_seconds", shutdown_timeout_seconds)
    if is_launched():
        launched = _launched_settings()
        coordinator_address = launched[0] if coordinator_address is None else coordinator_address
        num_processes = launched[1] if num_processes is None else num_processes
        process_id = launched[2] if process_id is None else process_id
        kwargs.setdefault("cluster_detection_method", "deactivate")
    requested = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if jax.distributed.is_initialized():
        _check_same(requested)
        return
    if _internals.backends_initialized():
        raise CallError(
            message(
                "shardvmc.distributed.initialize",
                "a JAX backend is already running in this process, so it can no longer join a multi-process group.",
                got="a call such as jax.devices(), jnp.zeros(...), sv.create_mesh() or a kernel ran before initialize",
                fix="call sv.distributed.initialize() first thing in the program, before anything touches a device.",
            )
        )
    _select_cpu_collectives(coordinator_address)
    sigterm_before = _internals.signal_disposition(signal.SIGTERM) if fail_fast else None
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=shutdown,
        **kwargs,
    )
    if fail_fast:
        _keep_sigterm(sigterm_before)
        _EXIT_WATCH.start()
    settled = _internals.distributed_settings()  # what auto-detection settled on (no public spelling)
    _SETTINGS = {k: v if settled.get(k) is None else settled[k] for k, v in requested.items()}


def _local_copy(leaf: Any) -> np.ndarray:
    """This process's copy of a replicated leaf as host data (typed keys as their key data)."""
    if isinstance(leaf, jax.Array):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if not leaf.is_fully_addressable:
            leaf = leaf.addressable_data(0)  # one device's full copy: no transfer between processes
    return np.ascontiguousarray(np.asarray(leaf))


def _digest(*parts: bytes | np.ndarray) -> np.ndarray:
    """A 64-bit checksum of ``parts`` (SHA-1, truncated) as two int32, what every collective carries."""
    h = hashlib.sha1(usedforsecurity=False)  # a checksum, not security; faster here than BLAKE2b
    for part in parts:
        data = part.reshape(-1).view(np.uint8).data if isinstance(part, np.ndarray) else part  # no copy
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return np.frombuffer(h.digest()[:8], dtype=np.int32).copy()


def _differing(column: np.ndarray) -> str:
    """Which processes hold which value: ``processes [0, 2] vs [1]`` (by checksum)."""
    groups: dict[bytes, list[int]] = {}
    for process, row in enumerate(column):
        groups.setdefault(row.tobytes(), []).append(process)
    return "processes " + " vs ".join(str(g) for g in sorted(groups.values()))


def check_consistent(tree: Any, *, what: str = "params") -> None:
    """Check that every process holds the same values of a replicated pytree.

    Each process computes a 64-bit checksum (SHA-1 of the bytes; dtypes and shapes are
    compared too) of its own copy of every leaf, and only these checksums travel
    between processes (one all-gather of two int32 per process, then one of two int32
    per leaf and process); no leaf is gathered. Bitwise equality is checked: processes that diverged by one
    rounding step are reported. Cheap enough to run every few hundred steps; in a
    single process it returns at once. Call it on every process (a collective).

    Args:
        tree: a pytree meant to be identical on every process (parameters, optimiser
            state, a shared key): replicated ``jax.Array``s, host arrays or numbers.
        what: the name of ``tree`` in the error message.

    Raises:
        CallError: naming the leaves (pytree paths) that differ and which processes
            hold which value, or the processes whose pytree has another structure,
            shapes or dtypes; also for a leaf sharded over the walker axis, which is
            not replicated.

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> sv.distributed.check_consistent({"w": jnp.ones(3), "b": 0.5})  # one process: nothing to compare
    """
    where = "shardvmc.distributed.check_consistent"
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [jax.tree_util.keystr(path) or "<root>" for path, _ in flat]
    for name, (_, leaf) in zip(names, flat):
        if isinstance(leaf, jax.Array) and not leaf.sharding.is_fully_replicated:
            raise CallError(
                message(
                    where,
                    f"leaf {name} of {what} is sharded ({leaf.sharding}), so processes hold different parts of it.",
                    got=describe(leaf),
                    expected="replicated leaves (sv.replicate) or host values",
                    fix=f"pass only the replicated part of {what}; per-walker data differs between processes.",
                )
            )
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    local = [_local_copy(leaf) for _, leaf in flat]
    layout = repr([(name, str(x.dtype), x.shape) for name, x in zip(names, local)]).encode()
    layouts = np.asarray(multihost_utils.process_allgather(_digest(layout)))
    if len({row.tobytes() for row in layouts}) > 1:
        raise CallError(
            message(
                where,
                f"{what} has another structure, shape or dtype on some processes.",
                got=_differing(layouts) + f"; this is process {jax.process_index()} with {len(local)} leaves",
                expected="the same pytree of the same shapes and dtypes on every process",
                fix=f"build {what} the same way on every process (same config, same code version).",
            )
        )
    if not local:
        return
    sums = np.stack([_digest(x) for x in local])
    every = np.asarray(multihost_utils.process_allgather(sums))  # (processes, leaves, 2)
    bad = [i for i in range(len(local)) if len({row.tobytes() for row in every[:, i]}) > 1]
    if bad:
        shown = "; ".join(f"{names[i]}: {_differing(every[:, i])}" for i in bad[:8])
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        raise CallError(
            message(
                where,
                f"{what} differ between processes in {len(bad)} of {len(local)} leaves: "
                f"{', '.join(names[i] for i in bad[:8])}{more}.",
                got=shown + more,
                expected=f"bitwise identical {what} on every process",
                fix=f"create {what} from the same seed on every process, or make them equal with "
                "jax.experimental.multihost_utils.broadcast_one_to_all(...); updates must use only "
                "all-reduced (Mean/Sum) quantities, never per-process ones.",
            )
        )


PREEMPTED_EXIT_CODE = 75
"""Exit code of a run that stopped at a preemption notice with its state saved: "run me again".

75 is ``EX_TEMPFAIL`` of ``sysexits.h`` (a temporary failure; retrying may succeed).
A batch script requeues the job on it (see the SLURM script in ``docs/cluster.md``);
``python -m shardvmc.launch`` exits with it too when its processes do.
"""

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
"""The signals :func:`reached_preemption` takes as a preemption notice by default."""

_PREEMPTED = threading.Event()  # a notice arrived (a process without JAX's distributed runtime)
_HANDLED: set[int] = set()  # the signals this module handles


def _signal_numbers(signals: Sequence[str | int], where: str) -> list[int]:
    numbers = []
    for sig in signals:
        try:
            number = int(getattr(signal, sig) if isinstance(sig, str) else sig)
            signal.Signals(number)
        except (AttributeError, ValueError, TypeError):
            raise CallError(
                message(
                    where,
                    f"{sig!r} is not a signal of this platform.",
                    fix='name signals as the signal module does, e.g. signals=("SIGTERM", "SIGUSR1").',
                )
            ) from None
        numbers.append(number)
    return numbers


def _on_notice(number: int, frame: Any) -> None:
    _PREEMPTED.set()


def _forward_to_jax(number: int, frame: Any) -> None:
    # JAX's preemption notifier (C++, installed by jax.distributed.initialize) listens for
    # SIGTERM only: another notice signal is handed on to it as a SIGTERM of this process.
    signal.raise_signal(signal.SIGTERM)


def _watch_preemption(signals: Sequence[str | int] = PREEMPTION_SIGNALS, where: str = "") -> bool:
    """Take ``signals`` as preemption notices from now on (what the first :func:`reached_preemption` does).

    :func:`shardvmc.driver.run` calls it before it restores and compiles, so that a notice that arrives
    before the first step is recorded (and answered by a save and the requeue exit) rather than ending the
    process. Returns whether JAX's distributed runtime is up (its notifier then takes SIGTERM).
    """
    where = where or "shardvmc.distributed.reached_preemption"
    numbers = _signal_numbers(signals, where)
    with_runtime = jax.distributed.is_initialized()
    if with_runtime:
        _give_sigterm_to_jax()  # kept aside by initialize(fail_fast=True) until the program takes notices
    wanted = [n for n in numbers if n not in _HANDLED and not (with_runtime and n == signal.SIGTERM)]
    if wanted:
        if threading.current_thread() is not threading.main_thread():
            raise CallError(
                message(
                    where,
                    "the first call must come from the main thread, the only one that can install signal handlers.",
                    got=f"called from thread {threading.current_thread().name!r}",
                    fix="call it from the training loop in the main thread.",
                )
            )
        for number in wanted:
            signal.signal(number, _forward_to_jax if with_runtime else _on_notice)
            _HANDLED.add(number)
    return with_runtime


def reached_preemption(step: int, *, signals: Sequence[str | int] = PREEMPTION_SIGNALS) -> bool:
    """Whether the run should save its state and stop now: a preemption notice arrived.

    Call it at every step, on every process, with increasing steps. Once any process
    has received one of ``signals`` (SLURM sends SIGTERM before it ends a job, or the
    signal chosen with ``--signal``), it returns ``True`` on every process at the same
    step; then save the state at that step (:meth:`sv.Checkpointer.save
    <shardvmc.Checkpointer.save>`), wait for the write, and exit with
    :data:`PREEMPTED_EXIT_CODE`.

    In a multi-process run (after :func:`initialize`) this is JAX's preemption sync
    point (``jax.experimental.multihost_utils.reached_preemption_sync_point``): JAX's
    notifier catches SIGTERM from the first call on (from ``jax.distributed.initialize``
    on with ``initialize(fail_fast=False)``; before, SIGTERM ends the process), so
    SIGTERM counts whatever ``signals`` says; the notice travels through the coordination service,
    the processes agree on the next step after the furthest one, and it returns
    ``True`` at exactly that step on all of them. The other signals named are handed
    on to that notifier. In a single process without JAX's distributed runtime (where
    JAX's sync point never fires), the first call installs handlers for ``signals``
    that record the notice, and it returns ``True`` from the next call on.

    The handlers replace those the program had for these signals, so a notice no
    longer ends the process: the loop must call this function and stop.

    Args:
        step: the training step (an int, increasing from call to call).
        signals: the signals taken as a notice, by name or number.

    Returns:
        ``True`` when the run should save and stop at this step.

    Raises:
        CallError: for an unknown signal, a call outside the main thread (signal
            handlers can only be installed there), or JAX's preemption service turned
            off (``jax_enable_preemption_service``).

    Example:
        >>> import shardvmc as sv
        >>> sv.distributed.reached_preemption(0, signals=())  # (no handler here: the test process keeps its own)
        False

        A training loop::

            with sv.Checkpointer("run/checkpoints") as ckpt:
                for step in range(start, steps):
                    state = train_step(state)
                    preempted = sv.distributed.reached_preemption(step)
                    if preempted or step % 100 == 0:
                        ckpt.save(step, state)
                    if preempted:
                        ckpt.wait()
                        sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
    """
    where = "shardvmc.distributed.reached_preemption"
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise CallError(message(where, "step must be an int.", got=repr(step), fix="pass the training step, int(t)."))
    with_runtime = _watch_preemption(signals, where)
    if not with_runtime:
        return _PREEMPTED.is_set()
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    except RuntimeError as err:
        raise CallError(
            message(
                where,
                "JAX's preemption service is off, so processes cannot agree on a step to stop at.",
                got=str(err),
                fix="leave jax_enable_preemption_service on (its default) when calling jax.distributed.initialize.",
            )
        ) from None
