"""Try a multi-process (multi-host) run on one machine: ``python -m shardvmc.launch``.

Starts ``--processes`` copies of a command, each one JAX process of one group, with a
coordinator on a free loopback port::

    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python examples/helium_vmc.py

Each process finds the group in its environment (``SHARDVMC_COORDINATOR_ADDRESS``,
``SHARDVMC_NUM_PROCESSES``, ``SHARDVMC_PROCESS_ID``), so the program joins it with
``if sv.distributed.is_launched(): sv.distributed.initialize()``. With
``--devices-per-process N`` every process runs on CPU with ``N`` fake devices
(``JAX_PLATFORMS=cpu``, ``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

Every output line is prefixed with its process index (``[0] ...``). The launcher exits
with the first failing process's code (``128 + signal`` for a signal) and stops the
others at once, or with 124 when ``--timeout`` seconds pass; 0 when all succeed.
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
from collections.abc import Mapping, Sequence
from typing import IO

from .distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = ["TIMEOUT_EXIT_CODE", "free_port", "launch", "main", "process_env"]

TIMEOUT_EXIT_CODE = 124
"""Exit code of the launcher when ``--timeout`` ran out (as with coreutils' ``timeout``)."""

_GRACE_S = 3.0  # from SIGTERM to SIGKILL when stopping processes
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


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
    (replacing any device count already in ``XLA_FLAGS``).

    Example:
        >>> from shardvmc.launch import process_env
        >>> env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, "127.0.0.1:5000", 2, 1, 2)
        >>> env["SHARDVMC_PROCESS_ID"], env["XLA_FLAGS"], env["JAX_PLATFORMS"]
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
        flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _forward(index: int, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed ``[index] ``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"[{index}] {line}\n")
            out.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every running process group, then SIGKILL what is left after a grace period."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
    for p in running:
        try:
            p.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
            pass


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(
    command: Sequence[str],
    processes: int,
    devices_per_process: int | None = None,
    timeout: float | None = None,
    *,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``command`` as ``processes`` processes of one JAX group; return the exit code.

    Args:
        command: the program and its arguments, e.g. ``["python", "train.py"]``.
        processes: how many processes to start.
        devices_per_process: fake CPU devices per process; ``None`` leaves the
            platform and ``XLA_FLAGS`` as they are.
        timeout: seconds after which every process is stopped (exit code 124).
        env: the base environment (default: this process's).
        stdout: where the prefixed output lines go (default: ``sys.stdout``).
        stderr: where the launcher's own messages go (default: ``sys.stderr``).

    Returns:
        0 when every process succeeded; else the first failing process's exit code
        (``128 + signal`` for a signal), or 124 on timeout.

    Example:
        >>> import io, sys
        >>> from shardvmc.launch import launch
        >>> out = io.StringIO()
        >>> launch([sys.executable, "-c", "import os; print(os.environ['SHARDVMC_PROCESS_ID'])"], 2, stdout=out)
        0
        >>> sorted(out.getvalue().splitlines())
        ['[0] 0', '[1] 1']
    """
    if processes < 1:
        raise ValueError(f"launch: processes must be at least 1, got {processes}.")
    if not command:
        raise ValueError("launch: no command given; put it after `--`.")
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    coordinator = f"127.0.0.1:{free_port()}"
    base = os.environ if env is None else env
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []

    def say(text: str) -> None:
        with lock:
            err.write(f"[launch] {text}\n")
            err.flush()

    try:
        for i in range(processes):
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
            thread = threading.Thread(target=_forward, args=(i, proc.stdout, out, lock), daemon=True)
            thread.start()
            threads.append(thread)
        deadline = None if timeout is None else time.monotonic() + timeout
        code = 0
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, c = failed[0]
                code = _exit_code(c)
                if any(c is None for c in codes):
                    say(f"process {i} exited with code {code}; stopping the others.")
                else:
                    say(f"process {i} exited with code {code}.")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                say(f"timeout after {timeout:g} s; stopping every process.")
                code = TIMEOUT_EXIT_CODE
                break
            time.sleep(0.05)
    except BaseException:
        _stop(procs)
        raise
    _stop(procs)
    for thread in threads:
        thread.join(timeout=_GRACE_S)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m shardvmc.launch --processes N [options] -- COMMAND ...``.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code of :func:`launch`; 130 when interrupted.

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
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, after `--`")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given; put it after `--`, e.g. `-- python train.py`.")
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}.")

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_signal) if main_thread else None
    try:
        return launch(command, args.processes, args.devices_per_process, args.timeout)
    except KeyboardInterrupt:
        return 130
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
