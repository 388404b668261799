"""A program that gets a preemption notice while it starts, for ``tests/test_preemption_at_startup.py``.

``python startup_worker.py`` with ``STARTUP_WORKER_STAGE`` and ``STARTUP_WORKER_READY`` in its environment (run by
the docs' batch script as ``vmc.py``, alone or in every process of a launched group). It imports shardvmc (the run
loop with it), then, at the stage named, appends ``<pid> <stage>`` to the file ``STARTUP_WORKER_READY`` and stays
in that stage until the test's signal ends it:

- ``imports``: inside an import (of a module whose loader waits), between ``import shardvmc`` and the program's
  next import;
- ``compile``: after joining the group (``sv.distributed.initialize()`` when launched) and building the walkers, in
  the first compilation of its state (a Metropolis sampler's ``init``), then compiling new programs.

Neither takes preemption notices yet (no ``sv.driver.run``, no ``reached_preemption``): the signal ends the process,
as in any program. A process that outlives ``WAIT_S`` exits with 3, which the test reports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from types import ModuleType

WAIT_S = 300.0  # a bound against a signal that never comes; the test signals within seconds of the report
SLOW_MODULE = "_startup_worker_slow_import"


def _report(stage: str) -> None:
    with open(os.environ["STARTUP_WORKER_READY"], "a") as ready:  # one short line: written in one append
        ready.write(f"{os.getpid()} {stage}\n")


class _WaitingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The loader of ``SLOW_MODULE``: reports the stage from inside the import and waits there for the signal."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name == SLOW_MODULE else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        _report("imports")
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)


def main() -> None:  # not at import: pytest's doctest collection imports every module of tests/
    stage = os.environ["STARTUP_WORKER_STAGE"]
    import shardvmc as sv  # the run loop (sv.driver) with it

    if stage == "imports":
        sys.meta_path.insert(0, _WaitingImport())
        importlib.import_module(SLOW_MODULE)  # (reports, then waits inside the import)
        sys.exit(3)

    if sv.distributed.is_launched():
        sv.distributed.initialize()
    import jax
    import jax.numpy as jnp

    walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 16, key=jax.random.key(0))
    sampler = sv.mcmc.Metropolis(lambda a, r: -a * jnp.sum(r**2))
    _report("compile")
    sampler.init(jnp.float32(0.5), walkers)  # the first compilation of the program's state
    deadline = time.monotonic() + WAIT_S
    x = jnp.ones((64, 64))
    k = 0
    while time.monotonic() < deadline:  # then new programs, one after another: compiling until the signal
        k += 1
        jax.jit(lambda y, k=k: jnp.tanh(y @ y.T + k)).lower(x).compile()
    sys.exit(3)


if __name__ == "__main__":
    main()
