"""Try a multi-process (multi-host) run on one machine: ``python -m shardvmc.launch``.

Starts ``--processes`` copies of a command, each one JAX process of one group, with a
coordinator on a free loopback port::

    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python examples/helium_vmc.py

Each process finds the group in its environment (``SHARDVMC_COORDINATOR_ADDRESS``,
``SHARDVMC_NUM_PROCESSES``, ``SHARDVMC_PROCESS_ID``), so the program joins it with
``if sv.distributed.is_launched(): sv.distributed.initialize()``. With
``--devices-per-process N`` every process runs on CPU with ``N`` fake devices
(``JAX_PLATFORMS=cpu``, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and the XLA CPU
deadlock workaround ``shardvmc.testing.CPU_SCHEDULER_FLAG``).

Every output line is prefixed with its process index (``[0] ...``). The CPU collectives'
connection messages (``[Gloo] Rank 0 is connected to 3 peer ranks. ...``, one per device
and group, also when short of peers or merged by two threads) are left out unless
``--verbose``. The launcher exits with the code of the first process that failed
(``128 + signal`` for a signal), naming it, or with 124 when ``--timeout`` seconds pass; 0
when all succeed. What the other processes then print as JAX's runtime aborts them (log
lines, C++ stack traces) is left out and summarised, unless ``--verbose``.

Stopping is bounded whatever the processes do: each process runs in its own session
(process group), and stopping sends SIGTERM to every group, then SIGKILL to what is
left after ``--grace`` seconds (once a program took preemption notices, JAX's notifier
catches SIGTERM and carries on, so the SIGKILL is what ends a busy or hung JAX process).
The same happens when the launcher itself gets SIGINT (Ctrl-C) or SIGTERM: it exits with
``128 + signal`` and leaves no process of its groups behind. A process that fails with
``sys.exit(code)`` or an uncaught exception after ``sv.distributed.initialize()`` leaves
without waiting in JAX's shutdown barrier for its peers (see
:func:`shardvmc.distributed.initialize`), so the launcher sees the failure at once.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from ._errors import CallError, message
from .distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from .testing import cpu_environment

__all__ = ["DEFAULT_GRACE_S", "TIMEOUT_EXIT_CODE", "free_port", "launch", "main", "process_env"]

TIMEOUT_EXIT_CODE = 124
"""Exit code of the launcher when ``--timeout`` ran out (as with coreutils' ``timeout``)."""

DEFAULT_GRACE_S = 3.0
"""Seconds from SIGTERM to SIGKILL when the launcher stops the processes (``--grace``)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now.

    Example:
        >>> from shardvmc.launch import free_port
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_env(
    base: Mapping[str, str],
    coordinator: str,
    num_processes: int,
    process_id: int,
    devices_per_process: int | None = None,
) -> dict[str, str]:
    """The environment of process ``process_id`` of a launched group.

    Sets the ``SHARDVMC_*`` variables that ``sv.distributed.initialize()`` reads, binds
    the coordinator to the loopback address only, keeps proxies away from it, and,
    with ``devices_per_process``, gives the process that many fake CPU devices
    (replacing any device count already in ``XLA_FLAGS``) and the XLA CPU deadlock workaround.

    Example:
        >>> from shardvmc.launch import process_env
        >>> env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, "127.0.0.1:5000", 2, 1, 2)
        >>> env["SHARDVMC_PROCESS_ID"], env["XLA_FLAGS"].split()[0], env["JAX_PLATFORMS"]
        ('1', '--xla_force_host_platform_device_count=2', 'cpu')
    """
    env = dict(base)
    host, port = coordinator.rsplit(":", 1)
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{host}:{port}"  # JAX's default binds every interface
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    if any("proxy" in name.lower() and not name.lower().startswith("no_") for name in env):
        for name in ("no_proxy", "NO_PROXY"):  # keep a configured proxy away from the loopback coordinator
            env[name] = ",".join(filter(None, [env.get(name, ""), host, "localhost"]))
    if devices_per_process is not None:
        cpu_environment(env, devices_per_process, replace=True)
        env["JAX_PLATFORMS"] = "cpu"
    return env


# The gloo that jaxlib 0.10.2 bundles prints, to stdout, for every device of every new group of
# devices, unconditionally (gloo has since made it an INFO log under GLOO_LOG_LEVEL:
# https://github.com/pytorch/gloo/pull/466):
#     [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3
# and, when the count is short, "[Gloo] Rank 1 is NOT connected to: [2]". Two things make these
# lines vary. The count is read right after the connections were started, and gloo's TCP pairs
# connect asynchronously, so on a busy machine it is often short of the peers that connect a moment
# later (a connection that really fails raises an error in the computation, which is shown). And
# std::cout writes the message in pieces (the literals below are separate strings in the library),
# so the messages of two devices of one process, printed at the same time from two threads, can
# merge: one line holds the pieces of both, and the line after it the rest of the other (a number,
# or nothing); a message can also end a line that the program was writing (Python's print writes
# the text and its newline separately). Every such line is left out: a line made only of these
# pieces, numbers and the list's punctuation, after a merged line the lines that complete it, and
# the message at the end of a program's line (the program's text is kept, its newline joined to it).
_GLOO_START = "[Gloo] Rank "
_GLOO_PIECES = (
    _GLOO_START,
    " is connected to ",
    " peer ranks. ",
    "Expected number of connected peer ranks is : ",
    " is NOT connected to: [",
)
_GLOO_REST = re.compile(r"[\d\s,\]]*")  # the numbers and the list's punctuation between the pieces


class _GlooMessages:
    """Takes gloo's connection messages out of one process's output, merged ones included."""

    def __init__(self) -> None:
        self.unfinished = 0  # messages begun on a merged line and not ended by a newline yet
        self.newline_owed = False  # a message ended a line of the program, whose own newline comes next

    @staticmethod
    def _only_gloo(text: str) -> bool:
        for piece in _GLOO_PIECES:
            text = text.replace(piece, "")
        return _GLOO_REST.fullmatch(text) is not None

    def __call__(self, line: str) -> str | None:
        """``line`` without gloo's messages; ``None`` when nothing of it is left to write."""
        owed, self.newline_owed = self.newline_owed, False
        if owed and not line:
            return None  # the newline of the program's line that a message ended
        start = line.find(_GLOO_START)
        if start < 0 and not self.unfinished:
            return line
        if self._only_gloo(line):
            self.unfinished = max(0, self.unfinished + line.count(_GLOO_START) - 1)  # each line ends one
            return None
        if start > 0 and self._only_gloo(line[start:]):
            # the program wrote a line in two writes (Python's print: the text, then its newline) and gloo's
            # message came between them: the program's text, and its newline on the next line
            self.unfinished = max(0, line.count(_GLOO_START) - 1)
            self.newline_owed = True
            return line[:start]
        self.unfinished = 0
        return line


# What JAX's runtime writes: absl log lines (severity I, W, E, F), the stack trace of a fatal one,
# C++'s terminate. After another process failed, these are the consequences in the others (the
# coordination service aborting them, JAX's notifier catching the launcher's SIGTERM).
_RUNTIME_LOG = re.compile(
    r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] |\*\*\* Check failure stack trace: \*\*\*|terminate called "
)
# JAX's runtime ending a process because another one is gone (heartbeats stopped, the coordinator
# unreachable, the shutdown barrier failed): its fatal message says "Terminating process because ...".
_TERMINATED_BY_RUNTIME = "Terminating process because"
_HOLD_S = 2.0  # how long a running process's runtime warnings and errors wait for a failure elsewhere


class _Output:
    """The processes' output, as the forwarding threads read it: prefixed, filtered, written to ``out``.

    A process's runtime warning or error (a ``_RUNTIME_LOG`` line but an info) is held back, with the lines
    after it, until it is clear whose it is: written if the process keeps running (after
    ``_HOLD_S``), succeeds, or is the one that failed first. Once a process failed, every line
    of the others is held until they end; then what JAX's runtime wrote is left out and
    counted: from its first line on in a process that the runtime terminated (a
    consequence), its log lines alone in the others. ``verbose`` writes every line at once.
    """

    def __init__(self, processes: int, out: IO[str], lock: threading.Lock, verbose: bool) -> None:
        self.out, self.lock, self.verbose = out, lock, verbose
        self.gloo = [_GlooMessages() for _ in range(processes)]
        self.held: list[list[str]] = [[] for _ in range(processes)]
        self.held_since = [0.0] * processes
        self.terminated = [False] * processes  # JAX's runtime said it ends this process
        self.left_out = [0] * processes
        self.failed: set[int] = set()  # processes that failed before the launcher stopped anyone
        self.cause: int | None = None

    def _write(self, index: int, lines: Sequence[str]) -> None:
        for line in lines:
            self.out.write(f"[{index}] {line}\n")
        if lines:
            self.out.flush()

    def line(self, index: int, line: str) -> None:
        """A line of process ``index`` (without its newline)."""
        with self.lock:
            if self.verbose:
                self._write(index, [line])
                return
            kept = self.gloo[index](line)
            if kept is None:
                return
            self.terminated[index] = self.terminated[index] or _TERMINATED_BY_RUNTIME in kept
            after_a_failure = bool(self.failed) and index not in self.failed
            trouble = _RUNTIME_LOG.match(kept) is not None and not kept.startswith("I")
            if self.held[index] or after_a_failure or trouble:
                if not self.held[index]:
                    self.held_since[index] = time.monotonic()
                self.held[index].append(kept)
            else:
                self._write(index, [kept])

    def _leave_out_runtime(self, index: int, lines: list[str]) -> list[str]:
        """A consequence's lines without the runtime's: all from its first in a process the runtime ended."""
        first = next((i for i, line in enumerate(lines) if _RUNTIME_LOG.match(line)), len(lines))
        kept = lines[:first] if self.terminated[index] else [line for line in lines if not _RUNTIME_LOG.match(line)]
        self.left_out[index] += len(lines) - len(kept)
        return kept

    def settle(self, ended: Mapping[int, int], final: bool = False) -> None:
        """Write held lines whose owner is clear now (``final``: every process has ended or been stopped)."""
        with self.lock:
            now = time.monotonic()
            for index, lines in enumerate(self.held):
                if not lines or (self.failed and self.cause is None and not final):
                    continue  # nothing held, or the launcher has yet to name the failure that came first
                if self.failed and index != self.cause:
                    if index not in ended and not final:
                        continue  # it is being stopped: its last lines may yet come
                    lines = self._leave_out_runtime(index, lines)
                elif not (index in ended or index == self.cause or final or now - self.held_since[index] > _HOLD_S):
                    continue
                self._write(index, lines)
                self.held[index] = []


def _forward(index: int, stream: IO[bytes], output: _Output) -> None:
    """Copy ``stream`` (one process's output) to ``output`` line by line."""
    for raw in iter(stream.readline, b""):
        output.line(index, raw.decode(errors="replace").rstrip("\r\n"))
    stream.close()


class _Interrupt:
    """The signal the launcher got (SIGINT, SIGTERM), or ``None``.

    Its handler only records the signal; it never raises. An exception raised from a
    handler lands wherever the main thread happens to be: between the launcher's
    "stopping the others" message and the start of the stopping it left a pending
    exception while the grace period was waited out in full, and inside the SIGKILL loop
    it would skip the groups after it. The launcher's waits poll this instead (a plain
    attribute: a handler that took a lock could deadlock on one the main thread holds).
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None


_POLL_S = 0.05  # how often the launcher's waits look at the processes and at a signal


def _wait_until(done: Callable[[], bool], timeout: float, interrupt: _Interrupt) -> None:
    """Poll ``done`` until it holds, ``timeout`` seconds pass, or a signal arrives."""
    deadline = time.monotonic() + timeout
    while not done() and not interrupt and time.monotonic() < deadline:
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace: float, interrupt: _Interrupt) -> None:
    """SIGTERM every running process group, then SIGKILL every group after ``grace`` seconds.

    Every group is killed at the end, even when its leader has exited: a child the
    leader started lives on in the group otherwise. A signal to the launcher during the
    grace period (Ctrl-C) cuts it short: the SIGKILL is sent anyway.
    """
    try:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            _signal_group(p, signal.SIGTERM)
        _wait_until(lambda: all(p.poll() is not None for p in running), grace, interrupt)
    finally:  # also on a KeyboardInterrupt when launch() is called from Python
        for p in procs:
            _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=max(grace, 1.0))
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
            pass


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _ending(returncode: int, short: bool = False) -> str:
    """How a process ended: ``exited with code 3``, ``was killed by SIGKILL (code 137)``; short: ``code 3``..."""
    code = _exit_code(returncode)
    if returncode >= 0:
        return f"code {code}" if short else f"exited with code {code}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGABRT:
        return f"aborted, code {code}" if short else f"aborted ({name}, code {code})"
    return f"killed by {name}, code {code}" if short else f"was killed by {name} (code {code})"


def _first_failure(failed: set[int], ended_at: Mapping[int, float], terminated: Sequence[bool]) -> int:
    """The process whose failure came first: the earliest to end, not counting those JAX's runtime ended."""
    order = sorted(failed, key=lambda i: (ended_at.get(i, float("inf")), i))
    own = [i for i in order if not terminated[i]]  # a runtime abort follows another process's failure
    return (own or order)[0]


def _watch_exit(index: int, proc: subprocess.Popen[bytes], ended: Callable[[int, int | None], None]) -> None:
    """Report ``proc``'s end the moment it happens, with its code, without reaping it (the launcher polls)."""
    code: int | None = None
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        if info is not None:
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    except ChildProcessError:  # already reaped by the launcher's poll
        code = proc.returncode
    ended(index, code)


def launch(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    timeout: float | None = None,
    *,
    grace: float = DEFAULT_GRACE_S,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: bool = False,
) -> int:
    """Run ``command`` as ``processes`` processes of one JAX group; return the exit code.

    Args:
        command: the program and its arguments, e.g. ``["python", "train.py"]``.
        processes: how many processes to start.
        devices_per_process: fake CPU devices per process; ``None`` leaves the
            platform and ``XLA_FLAGS`` as they are.
        timeout: seconds after which every process is stopped (exit code 124).
        grace: seconds between SIGTERM and SIGKILL when stopping the processes.
        env: the base environment (default: this process's).
        stdout: where the prefixed output lines go (default: ``sys.stdout``).
        stderr: where the launcher's own messages go (default: ``sys.stderr``).
        verbose: keep every line: the CPU collectives' connection messages (gloo's
            ``[Gloo] Rank i is connected to ...``) and what JAX's runtime writes in the
            other processes after one failed, which are left out by default.

    Returns:
        0 when every process succeeded; else the exit code of the process that failed
        first (``128 + signal`` for a signal; a process that JAX's runtime aborted
        because another failed is not the first), or 124 on timeout.

    Example:
        >>> import io, sys
        >>> from shardvmc.launch import launch
        >>> out = io.StringIO()
        >>> launch([sys.executable, "-c", "import os; print(os.environ['SHARDVMC_PROCESS_ID'])"], 2, stdout=out)
        0
        >>> sorted(out.getvalue().splitlines())
        ['[0] 0', '[1] 1']
    """
    return _launch(command, processes, devices_per_process, timeout, grace, env, stdout, stderr, _Interrupt(), verbose)


def _launch(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None,
    timeout: float | None,
    grace: float,
    env: Mapping[str, str] | None,
    stdout: IO[str] | None,
    stderr: IO[str] | None,
    interrupt: _Interrupt,
    verbose: bool = False,
) -> int:
    """:func:`launch`, stopping early when ``interrupt`` is set (by :func:`main`'s signal handler)."""
    if processes < 1:
        raise CallError(message("launch", f"processes must be at least 1, got {processes}.", fix="pass 1 or more."))
    if not command:
        raise CallError(message("launch", "no command given.", fix="put the command after `--`."))
    if not grace >= 0:
        raise CallError(message("launch", f"grace must be at least 0 seconds, got {grace}.", fix="pass 0 or more."))
    err = sys.stderr if stderr is None else stderr
    coordinator = f"127.0.0.1:{free_port()}"
    base = os.environ if env is None else env
    lock = threading.Lock()
    output = _Output(processes, sys.stdout if stdout is None else stdout, lock, verbose)
    procs: list[subprocess.Popen[bytes]] = []
    readers: list[threading.Thread] = []
    ended_at: dict[int, float] = {}  # when each process ended, as its watcher saw it
    codes: dict[int, int] = {}  # the exit codes the launcher collected
    stopping = False  # from here on the launcher ends the processes: their ends are no failures

    def say(text: str) -> None:
        with lock:
            err.write(f"[launch] {text}\n")
            err.flush()

    def ended(index: int, code: int | None) -> None:
        with lock:
            ended_at.setdefault(index, time.monotonic())
            if code and not stopping:
                output.failed.add(index)

    def finished(indices: Sequence[int], wait: float) -> None:
        """Give the readers of these processes up to ``wait`` seconds to read their last lines."""
        deadline = time.monotonic() + wait
        for i in indices:
            readers[i].join(max(0.0, deadline - time.monotonic()))

    code = 0
    cause: int | None = None
    try:
        for i in range(processes):
            if interrupt:
                break
            proc = subprocess.Popen(
                list(command),
                env=process_env(base, coordinator, processes, i, devices_per_process),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopping it stops its children too
            )
            procs.append(proc)
            assert proc.stdout is not None
            readers.append(threading.Thread(target=_forward, args=(i, proc.stdout, output), daemon=True))
            readers[-1].start()
            if hasattr(os, "waitid"):
                threading.Thread(target=_watch_exit, args=(i, proc, ended), daemon=True).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not interrupt:
            for i, p in enumerate(procs):
                if i not in codes and (c := p.poll()) is not None:
                    codes[i] = c
                    ended(i, c)
            failed = {i for i, c in codes.items() if c != 0}
            if failed:
                if len(failed) > 1:  # which came first also depends on what they wrote last
                    finished(sorted(failed), 1.0)
                with lock:
                    output.failed |= failed
                    cause = output.cause = _first_failure(failed, ended_at, output.terminated)
                code = _exit_code(codes[cause])
                others = "; stopping the others" if len(codes) < len(procs) else ""
                say(f"process {cause} {_ending(codes[cause])}{others}.")
                break
            if len(codes) == len(procs):
                break
            if deadline is not None and time.monotonic() > deadline:
                say(f"timeout after {timeout:g} s; stopping every process.")
                code = TIMEOUT_EXIT_CODE
                break
            output.settle(codes)
            time.sleep(_POLL_S)
    finally:  # also on a KeyboardInterrupt when launch() is called from Python
        with lock:
            stopping = True
        _stop(procs, grace, interrupt)
    finished(range(len(readers)), max(grace, 1.0))  # the last lines
    for i, p in enumerate(procs):
        if i not in codes and p.returncode is not None:
            codes[i] = p.returncode
    output.settle(codes, final=True)
    if cause is not None and not verbose:
        _say_consequences(say, output, cause, codes)
    return code


def _say_consequences(say: Callable[[str], None], output: _Output, cause: int, codes: Mapping[int, int]) -> None:
    """One line for each other process that ended by itself after the failure, one for the lines left out."""
    for i in sorted(output.failed - {cause}):
        if i not in codes:  # pragma: no cover - not reaped: a process SIGKILL did not end
            continue
        if output.terminated[i]:
            say(f"process {i} ended as a consequence ({_ending(codes[i], short=True)}).")
        else:
            say(f"process {i} also failed: it {_ending(codes[i])}.")
    noisy = [i for i, n in enumerate(output.left_out) if n]
    if noisy:
        which = ", ".join(str(i) for i in noisy)
        say(
            f"left out {sum(output.left_out)} lines JAX's runtime wrote in process(es) {which} after process "
            f"{cause} failed (--verbose)."
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m shardvmc.launch --processes N [options] -- COMMAND ...``.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code of :func:`launch`; ``128 + signal`` when the launcher got SIGINT
        (130) or SIGTERM (143), after stopping every process.

    Example:
        >>> import sys
        >>> from shardvmc.launch import main
        >>> main(["--processes", "2", "--timeout", "60", "--", sys.executable, "-c", "pass"])
        0
    """
    parser = argparse.ArgumentParser(
        prog="python -m shardvmc.launch",
        description="Run COMMAND as N processes of one JAX distributed group on this machine "
        "(coordinator on a free loopback port). The program joins with "
        "`if sv.distributed.is_launched(): sv.distributed.initialize()`.",
    )
    parser.add_argument("--processes", "-n", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="N",
        help="run on CPU with N fake devices per process (sets JAX_PLATFORMS=cpu and XLA_FLAGS)",
    )
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="stop everything after S seconds")
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help=f"seconds from SIGTERM to SIGKILL when stopping the processes (default {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep every line: the CPU collectives' connection messages ([Gloo] Rank i is connected to ...) and "
        "what JAX's runtime writes in the other processes after one failed, left out by default",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, after `--`")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given; put it after `--`, e.g. `-- python train.py`.")
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}.")
    if not args.grace >= 0:
        parser.error(f"--grace must be at least 0, got {args.grace}.")

    interrupt = _Interrupt()

    def on_signal(signum: int, frame: object) -> None:
        if interrupt.signum is None:  # the first signal names the exit code
            interrupt.signum = signum

    handled = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in handled} if main_thread else {}
    code = 0
    try:
        code = _launch(
            command,
            args.processes,
            args.devices_per_process,
            args.timeout,
            args.grace,
            None,
            None,
            None,
            interrupt,
            args.verbose,
        )
    except KeyboardInterrupt:  # not the main thread: no handler of ours, Python's own
        interrupt.signum = signal.SIGINT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupt.signum is None:
        return code
    print(f"[launch] got {signal.Signals(interrupt.signum).name}; stopped every process.", file=sys.stderr, flush=True)
    return 128 + interrupt.signum


if __name__ == "__main__":
    sys.exit(main())
