"""How long a run lasts after one of its processes fails: the table of docs/cluster.md ("When a process fails").

    python benchmarks/failfast.py                      # every kind, with and without the launcher, 3 runs each
    python benchmarks/failfast.py --load 2             # the same with 2 busy loops loading the CPU
    python benchmarks/failfast.py --where launcher --kinds exit,SIGKILL --reps 5
    python benchmarks/failfast.py --hold 45 --heartbeat 4 --load 2   # healthy runs: the heartbeat goes on

Each run is a group of 2 processes of 1 fake CPU device running ``tests/mp_fail_worker.py``
(the program of the fail-fast tests) with ``sv.distributed.initialize()``'s defaults. Process
1 fails, once both processes computed: ``exit`` (``sys.exit(3)``, process 0 sleeping), ``raise``
(an uncaught exception, process 0 computing), ``SIGKILL`` and ``SIGTERM`` (sent by this script,
process 0 computing). ``launcher``: the group runs under ``python -m shardvmc.launch``, and
the time is from the failure to the launcher's exit. ``bare``: the processes are started
without a launcher (as under a scheduler that does not stop the others), and the time is
from the failure to the end of the last process: the peer is ended by JAX's coordination
service once process 1's heartbeats stop (each process's own end is printed too). The
failure's time is the one process 1 prints just before it fails, or when this script sends
the signal. Figures: median and range
over ``--reps`` runs, in seconds, with the exit codes seen.

``--hold S``: healthy runs instead, under the launcher, whose processes each hold the
interpreter lock for ``S`` seconds in one call (a regular-expression match that
backtracks) before they meet (an all-gather) and succeed, with ``--heartbeat`` as the
heartbeat timeout: exit code 0 shows that the heartbeats, sent by a thread of JAX's
runtime, went on meanwhile.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mp_fail_worker.py"
# the worker's HOW and PEER for each kind of failure of process 1
KINDS = {
    "exit": ("exit", "sleep"),
    "raise": ("raise", "compute"),
    "SIGKILL": ("wait", "compute"),
    "SIGTERM": ("wait", "compute"),
}
LIMIT_S = 400.0  # a run that lasts longer is stopped and reported as such (JAX's barrier alone takes 300 s)


class _Group:
    """The processes of one run, their output read by threads, every process group killed on close."""

    def __init__(self, where: str, kind: str, env: dict[str, str]) -> None:
        from shardvmc.launch import free_port, process_env

        how, peer = KINDS[kind]
        command = [sys.executable, str(WORKER), how, peer]
        self.outputs: list[list[str]] = []
        self.procs: list[subprocess.Popen[str]] = []
        if where == "launcher":
            launcher = [sys.executable, "-m", "shardvmc.launch", "-n", "2", "--devices-per-process", "1", "--"]
            self._start(launcher + command, env)
        else:
            coordinator = f"127.0.0.1:{free_port()}"
            for i in range(2):
                self._start(command, process_env(env, coordinator, 2, i, devices_per_process=1))

    def _start(self, command: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines: list[str] = []
        assert proc.stdout is not None
        threading.Thread(target=lambda out=proc.stdout: lines.extend(iter(out.readline, "")), daemon=True).start()
        self.procs.append(proc)
        self.outputs.append(lines)

    def text(self) -> str:
        return "".join(line for lines in self.outputs for line in list(lines))

    def ready_pid(self) -> int | None:
        """Process 1's pid, once both processes said they are ready (``ready <pid>``)."""
        if len(self.procs) == 2:  # without the launcher: one output per process
            ready = all(any(line.startswith("ready ") for line in list(lines)) for lines in self.outputs)
            return self.procs[1].pid if ready else None
        pids = {}
        for line in self.text().splitlines():  # the launcher's: each line prefixed with its process
            words = line.split()
            if words[1:2] == ["ready"]:
                pids[words[0]] = int(words[2])
        return pids.get("[1]") if len(pids) == 2 else None

    def close(self) -> None:
        """End what is left: SIGTERM first (a launcher then stops its processes), then SIGKILL to each group."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def run_once(where: str, kind: str, env: dict[str, str]) -> tuple[list[float | None], list[int | None]]:
    """When each process (the launcher, or each process of the group) ended, seconds after process 1's failure
    (``None``: not within ``LIMIT_S``), and their exit codes."""
    group = _Group(where, kind, env)
    try:
        deadline = time.monotonic() + LIMIT_S
        while (pid := group.ready_pid()) is None:
            if time.monotonic() > deadline or any(p.poll() is not None for p in group.procs):
                raise RuntimeError(f"the processes did not start:\n{group.text()}")
            time.sleep(0.05)
        if kind.startswith("SIG"):
            failed_at = time.time()
            os.kill(pid, getattr(signal, kind))
        else:
            while "failing at " not in group.text():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"process 1 did not fail:\n{group.text()}")
                time.sleep(0.01)
            failed_at = float(group.text().split("failing at ")[1].split()[0])
        ends: list[float | None] = [None] * len(group.procs)
        while None in ends and time.monotonic() < deadline:
            for i, p in enumerate(group.procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.time() - failed_at
            time.sleep(0.01)
        return ends, [p.poll() for p in group.procs]
    finally:
        group.close()


def run_hold(env: dict[str, str], hold: float, heartbeat: int | None) -> tuple[int, list[float]]:
    """A healthy run whose processes hold the interpreter lock ``hold`` seconds: its exit code, the seconds held."""
    env = {**env, **({"MP_FAIL_WORKER_HEARTBEAT_S": str(heartbeat)} if heartbeat else {})}
    launcher = [sys.executable, "-m", "shardvmc.launch", "-n", "2", "--devices-per-process", "1"]
    command = [*launcher, "--timeout", str(LIMIT_S), "--", sys.executable, str(WORKER), "hold", str(hold)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S + 60)
    held = [float(line.split(" for ")[1].split()[0]) for line in done.stdout.splitlines() if "held the" in line]
    if done.returncode != 0:
        print(done.stdout + done.stderr, flush=True)
    return done.returncode, held


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, among " + ", ".join(KINDS))
    parser.add_argument("--where", default="launcher,bare", help="launcher, bare, or both")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--load", type=int, default=0, help="busy Python loops loading the CPU meanwhile")
    parser.add_argument(
        "--hold", type=float, default=None, metavar="S", help="instead: healthy runs holding the interpreter lock S s"
    )
    parser.add_argument("--heartbeat", type=int, default=None, metavar="H", help="with --hold: heartbeat timeout")
    args = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDVMC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # clean up (finally) on SIGTERM too
    loads = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    rows = []
    try:
        if args.hold is not None:
            for _ in range(args.reps):
                code, held = run_hold(env, args.hold, args.heartbeat)
                print(f"held the lock for {held} s with a heartbeat timeout of {args.heartbeat} s: exit code {code}")
            return
        for where in args.where.split(","):
            for kind in args.kinds.split(","):
                times, codes = [], []
                for _ in range(args.reps):
                    ends, got = run_once(where, kind, env)
                    times.append(None if None in ends else max(e for e in ends if e is not None))
                    codes.append(got)
                    shown = ", ".join("-" if e is None else f"{e:.2f}" for e in ends)
                    print(f"{where:8} {kind:8} ended after {shown} s, codes {got}", flush=True)
                done = [t for t in times if t is not None]
                figure = f"{statistics.median(done):.1f} [{min(done):.1f}, {max(done):.1f}]" if done else "-"
                if len(done) < len(times):
                    figure += f" ({len(times) - len(done)} not within {LIMIT_S:g} s)"
                seen = sorted({tuple(c) for c in codes}, key=str)
                rows.append(f"| {kind} | {where} | {figure} | {', '.join(str(list(c)) for c in seen)} |")
    finally:
        for load in loads:
            load.kill()
            load.wait()
    took = f"median [min, max] of {args.reps} runs, {args.load} busy loops"
    print(f"\nFrom the failure to the run's end, seconds, {took}:\n")
    print("| failure of process 1 | where | seconds | exit codes |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
