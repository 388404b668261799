"""A small VMC job on ``sv.driver`` for the run-loop tests, in this process or as a program.

Not a test module itself. ``tests/test_driver.py`` imports it (:func:`pieces`, :func:`job`) and starts it as

    python tests/driver_job.py DIR N_STEPS [--devices D] [--sigterm-at T] [--sigterm-while-compiling] [--print]
        [--no-checkpoint]

(also under ``python -m shardvmc.launch``): it runs :func:`job` with the checkpoint directory ``DIR``,
a JSON-lines log ``DIR/log.jsonl`` and, with ``--sigterm-at T``, a callback that sends this process SIGTERM
after step ``T`` (a preemption notice at a step fixed by the program, not by a race), with
``--sigterm-while-compiling`` a step that sends it while the first step is traced (before any step ran); the
result goes to ``DIR/result_<process>.json``. Hooke's atom with a two-parameter Jastrow factor, in float64.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import shardvmc as sv
import shardvmc.testing

WALKERS = 50


def log_psi(params: dict, r: jax.Array) -> jax.Array:
    """Hooke's atom (trap frequency 1/2): the trap's Gaussian and a Pade-Jastrow factor, ONE walker ``r`` (2, 3)."""
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -jnp.sum(r**2) / 4 + params["a"] * r12 / (1 + params["b"] * r12)


def potential(r: jax.Array) -> jax.Array:
    return jnp.sum(r**2) / 8 + sv.hamiltonian.coulomb(r)


@functools.cache  # one compilation of the step per mesh and optimiser, whatever the number of runs
def make_vmc(mesh: Any, optimiser: Any = None) -> Any:
    """The job's ``sv.driver.VMC``: the natural gradient (or ``optimiser``) on ``mesh``."""
    import optax

    import shardvmc.optax as svx

    if optimiser is None:
        optimiser = optax.chain(svx.natural_gradient(damping=1e-3), optax.scale_by_learning_rate(0.1))
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=5, mesh=mesh)
    return sv.driver.VMC(log_psi, optimiser, potential, sampler=sampler, mesh=mesh)


def pieces(mesh: Any, optimiser: Any = None) -> tuple[Any, Any]:
    """``(vmc, state)``: the job's ``sv.driver.VMC`` and its initial state on ``mesh``."""
    vmc = make_vmc(mesh, optimiser)
    walkers = sv.initialize_walkers_sharded(
        lambda k: jax.random.normal(k, (2, 3)), WALKERS, mesh, key=jax.random.key(1)
    )
    params = {"a": jnp.asarray(0.3), "b": jnp.asarray(0.5)}
    return vmc, vmc.init(params, walkers)


class SigtermAt:
    """A callback that sends this process SIGTERM after step ``at``: a preemption notice at a known step."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, step: int, stats: dict[str, float]) -> None:
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def sigterm_while_compiling(step: Any) -> Any:
    """``step`` in a jitted function that sends this process SIGTERM as it is traced: a notice before the first step."""

    def traced(state: Any, key: jax.Array) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # (Python runs the handler at once, in this thread, while tracing)
        return step(state, key)

    return jax.jit(traced)


def job(mesh: Any, directory: str | None, n_steps: int, wrap: Any = None, **options: Any) -> Any:
    """The run: ``sv.driver.run`` of the job's step (``wrap(step)`` if given), ``options`` passed on."""
    vmc, state = pieces(mesh)
    step = vmc.step if wrap is None else wrap(vmc.step)
    return sv.driver.run(step, state, n_steps, key=jax.random.key(2), checkpoint=directory, **options)


def params_of(result: Any) -> list[float]:
    params = result.state.params
    return [float(np.asarray(params["a"].addressable_data(0))), float(np.asarray(params["b"].addressable_data(0)))]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("n_steps", type=int)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--sigterm-at", type=int, default=None)
    parser.add_argument("--sigterm-while-compiling", action="store_true")
    parser.add_argument("--print", action="store_true", help="a PrintLog line per step on standard output")
    parser.add_argument("--no-checkpoint", action="store_true", help="no checkpoints (DIR holds the log alone)")
    args = parser.parse_args(argv)
    sv.testing.set_cpu_devices(args.devices)
    jax.config.update("jax_enable_x64", True)
    if sv.distributed.is_launched():
        sv.distributed.initialize()
    callbacks: list[Any] = [sv.driver.StopOnNonFinite()]
    if args.sigterm_at is not None:
        callbacks.append(SigtermAt(args.sigterm_at))
    out: list[Any] = [sv.driver.JsonLog(os.path.join(args.directory, "log.jsonl"))]
    if args.print:
        out.append(sv.driver.PrintLog(every=1))
    directory = None if args.no_checkpoint else args.directory
    wrap = sigterm_while_compiling if args.sigterm_while_compiling else None
    result = job(sv.create_mesh(), directory, args.n_steps, wrap, callbacks=callbacks, out=out, progress=False)
    summary = {"step": result.step, "status": result.status, "resumed_from": result.resumed_from,
               "energy": result.history["energy"].tolist(), "params": params_of(result)}  # fmt: skip
    with open(os.path.join(args.directory, f"result_{jax.process_index()}.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main(sys.argv[1:])
