"""A launched program one of whose processes fails, for the fail-fast tests of ``tests/test_multiprocess.py``.

``python mp_fail_worker.py HOW PEER [FILE]`` in every process of a group (launched, or started with
``shardvmc.launch.process_env``). Each process joins with ``sv.distributed.initialize()`` (its
defaults), computes once with the others (an all-gather), prints ``ready <pid>``, then:

- ``exit``: process 1 calls ``sys.exit(3)``;
- ``raise``: process 1 raises an uncaught exception;
- ``wait``: process 1 sleeps, for the test to signal it (SIGKILL, SIGTERM);
- ``coordinator``: process 0, the coordination service's host, calls ``sys.exit(3)``;
- ``ok``: process 1 returns at once, process 0 three seconds later; both succeed;
- ``hold``: every process holds the interpreter lock in one call for ``PEER`` seconds or
  more, then meets the others (an all-gather) and succeeds: the heartbeats, sent by JAX's
  runtime, go on meanwhile (``MP_FAIL_WORKER_HEARTBEAT_S`` sets the heartbeat timeout).

The other processes do ``PEER`` meanwhile: ``sleep``, or ``compute`` (a Python and JAX loop that
holds the interpreter). The failing process writes a line to ``FILE``, if given, and leaves the
file open, then prints ``failing at <time>``. In ``ok`` each process prints when it left JAX's
shutdown barrier (an exit handler registered before JAX's runs after it).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import sys
import time


def main() -> None:  # not at import: pytest's doctest collection imports every module of tests/
    # an exit handler registered before JAX is imported runs after JAX's (``ok``: after the shutdown barrier)
    how, peer = sys.argv[1:3]
    if how == "ok":
        atexit.register(lambda: print(f"left the barrier at {time.time()!r}", flush=True))

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    import shardvmc as sv

    heartbeat = os.environ.get("MP_FAIL_WORKER_HEARTBEAT_S")  # benchmarks/failfast.py --hold: another timeout
    sv.distributed.initialize(**({"heartbeat_timeout_seconds": int(heartbeat)} if heartbeat else {}))
    me = jax.process_index()
    x = multihost_utils.process_allgather(jnp.arange(4.0).sum())  # a collective: every process got here
    print(f"ready {os.getpid()} {x.tolist()}", flush=True)

    if how == "hold":  # hold the interpreter lock in one call for PEER seconds or more, then meet the others
        t, n = time.monotonic(), 18
        re.match(r"(a+)+$", "a" * n + "b")  # backtracks: twice the time for each "a" more, never releasing the lock
        n += max(0, math.ceil(math.log2(float(peer) / max(time.monotonic() - t, 1e-3))))
        t = time.monotonic()
        re.match(r"(a+)+$", "a" * n + "b")
        held = time.monotonic() - t
        print(
            f"held the interpreter lock for {held:.1f} s; {multihost_utils.process_allgather(x).tolist()}", flush=True
        )
        sys.exit(0)

    failing = 0 if how == "coordinator" else 1
    if me == failing and how in ("exit", "raise", "coordinator"):
        if len(sys.argv) > 3:  # a file the program leaves open and unflushed, as a log often is
            log = open(sys.argv[3], "w")
            log.write("written before the failure\n")
        print(f"failing at {time.time()!r}", flush=True)
        if how == "raise":
            raise RuntimeError(f"process {me} fails")
        sys.exit(3)
    if how == "ok":
        time.sleep(3 if me == 0 else 0)
        print(f"finished at {time.time()!r}", flush=True)
    elif peer == "sleep" or me == failing:
        time.sleep(600)
    else:
        y = jnp.ones((64, 64))
        while True:  # computes until it is ended: a Python loop and small local JAX computations
            y = (y @ y / 64.0).block_until_ready()
            sum(i * i for i in range(10_000))


if __name__ == "__main__":
    main()
