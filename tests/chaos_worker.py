"""One process of the chaos test (``tests/test_chaos.py``): a VMC training run that fails where it is told to.

Not a test module itself: the test launches it as

    python -m shardvmc.launch --processes P --devices-per-process D -- \\
        python tests/chaos_worker.py DIR --steps N --every K --name NAME [--fault KIND --at STEP --process I]

It trains helium's ground state with a small neural Jastrow factor in float64: 13 walkers (a count that 3, 4
and 8 devices do not divide) as a ``sv.WalkerSet`` of ``sv.mcmc`` walkers, minSR through
``shardvmc.optax.natural_gradient``. Every ``K`` steps it saves the whole state asynchronously with
``sv.Checkpointer`` (``DIR/state``), and it starts from the newest intact step there, on whatever layout it runs
on. Step ``t`` draws from ``fold_in(key, t)``, so a resumed run continues the uninterrupted one.

The fault comes after step ``STEP`` (after its save, if any, has started), or after the first step of a run
resumed past it:

``kill``
    process ``I`` sends itself SIGKILL;
``raise``
    process ``I`` raises an exception;
``term``
    every process waits until its last save is committed, then sends itself SIGTERM, a preemption notice (SLURM
    sends one to every task): once ``sv.distributed.reached_preemption`` says so, the run saves that step and
    exits with ``sv.distributed.PREEMPTED_EXIT_CODE``.

Each process writes ``DIR/records/<NAME>_<process>.json`` once it has restored (the step, the warnings of the
restore) and again when it leaves on its own; the times in it are (seconds since ``main`` started, CPU seconds
of the process). At step ``N`` process 0 writes ``DIR/result.npz``: the parameters, the optimiser's state, the
valid walkers, the proposal width and every step's energy.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardvmc as sv
import shardvmc.optax as svx

N_WALKERS = 13
HIDDEN = 6  # the Jastrow network's width
SWEEPS = 2  # Metropolis moves per step
SEED = 7
FAULTS = ("kill", "raise", "term")
TERM_WAIT_S = 2.0  # after a SIGTERM, per step: JAX's notifier looks for it every second, then tells every process

OPTIMISER = optax.chain(
    svx.natural_gradient(damping=1e-3, method="minsr"),
    svx.clip_by_fisher_norm(0.05, 0.05),
    optax.scale_by_learning_rate(0.05),
)


def log_psi(params: dict[str, Any], r: jax.Array) -> jax.Array:
    """log|psi| of ONE helium walker ``r`` (2, 3): hydrogen-like orbitals, the cusp, a neural Jastrow factor."""
    r1, r2 = jnp.linalg.norm(r[0]), jnp.linalg.norm(r[1])
    r12 = jnp.linalg.norm(r[0] - r[1])
    features = jnp.stack([r1 + r2, (r1 - r2) ** 2, r12])  # symmetric in the two electrons
    hidden = jnp.tanh(features @ params["w1"] + params["b1"])
    cusp = r12 / (2.0 * (1.0 + params["b"] ** 2 * r12))
    return -params["z"] * (r1 + r2) + cusp + hidden @ params["w2"]


@sv.walker_parallel
def measure(
    params: sv.Replicated[Any], r: sv.PerWalker[jax.Array]
) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[Any], sv.Mean[jax.Array]]:
    """The local energy of ONE walker, its row of ``J = d log|psi| / d params``, and the mean energy."""
    potential = sv.hamiltonian.coulomb(r, charges=(2.0,), coords=((0.0, 0.0, 0.0),))
    e = sv.hamiltonian.kinetic_energy(log_psi, params, r, laplacian="jvp") + potential
    return e, jax.grad(log_psi)(params, r), e


def init_params(key: jax.Array) -> dict[str, Any]:
    k1, k2 = jax.random.split(key)
    return {
        "z": jnp.asarray(1.7, jnp.float64),
        "b": jnp.asarray(1.0, jnp.float64),
        "w1": 0.3 * jax.random.normal(k1, (3, HIDDEN), jnp.float64),
        "b1": jnp.zeros(HIDDEN, jnp.float64),
        "w2": 0.1 * jax.random.normal(k2, (HIDDEN,), jnp.float64),
    }


@functools.cache
def sampler(mesh: Any) -> sv.mcmc.Metropolis:
    return sv.mcmc.Metropolis(log_psi, n_steps=SWEEPS, mesh=mesh)


@functools.cache
def make_train(mesh: Any) -> Any:
    """``train(state) -> state``: Metropolis moves, the local energies, one minSR step (one jitted program)."""
    measure_ = measure.with_options(mesh=mesh)

    @jax.jit
    def step(params: Any, opt: Any, walkers: Any, key: jax.Array) -> tuple[Any, Any, Any, jax.Array]:
        walkers = sampler(mesh).step(params, walkers, key)
        e, j, energy = measure_(params, walkers.positions)
        updates, opt = OPTIMISER.update(params, opt, params, jacobian=j, local_energies=e)
        return optax.apply_updates(params, updates), opt, walkers, energy

    def train(state: dict[str, Any]) -> dict[str, Any]:
        t = state["step"]
        key = jax.random.fold_in(jax.random.key(SEED), t)
        params, opt, walkers, energy = step(state["params"], state["opt"], state["sampler"], key)
        energies = state["energies"].copy()
        energies[t] = float(np.asarray(energy.addressable_data(0)))  # replicated: this process's copy
        return {"params": params, "opt": opt, "sampler": walkers, "step": t + 1, "energies": energies}

    return train


def initial_state(mesh: Any, steps: int) -> dict[str, Any]:
    """The state at step 0: the same values on every layout (walker ``i`` drawn from ``fold_in(key, i)``)."""
    root = jax.random.key(SEED)
    params = sv.replicate(jax.jit(init_params)(jax.random.fold_in(root, 2**31)), mesh)
    positions = sv.initialize_walkers_sharded(
        lambda k: jax.random.normal(k, (2, 3), jnp.float64), N_WALKERS, mesh, key=jax.random.fold_in(root, 2**31 + 1)
    )
    return {
        "params": params,
        "opt": sv.replicate(jax.jit(OPTIMISER.init)(params), mesh),
        "sampler": sampler(mesh).init(params, positions, 0.5),
        "step": 0,
        "energies": np.zeros(steps, np.float64),
    }


def write_result(path: Path, state: dict[str, Any]) -> None:
    """Process 0 writes the final state (the walkers are gathered: call it on every process)."""
    walkers = sv.gather_walkers(state["sampler"].walkers.data)
    arrays = {}
    for name in ("params", "opt"):
        for p, leaf in jax.tree_util.tree_flatten_with_path(state[name])[0]:
            arrays[name + jax.tree_util.keystr(p)] = np.asarray(leaf.addressable_data(0))
    arrays["walkers.r"] = walkers.r[:N_WALKERS]
    arrays["walkers.log_psi"] = walkers.log_psi[:N_WALKERS]
    arrays["width"] = np.asarray(state["sampler"].width.addressable_data(0))
    arrays["energies"] = state["energies"]
    if jax.process_index() == 0:
        np.savez(path, **arrays)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--fault", choices=FAULTS)
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--process", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()

    def now() -> tuple[float, float]:
        return round(time.monotonic() - started, 2), round(time.process_time(), 2)

    sv.distributed.initialize()  # a failing process ends the run (fail_fast, the default)
    jax.config.update("jax_enable_x64", True)
    me = jax.process_index()
    mesh = sv.create_mesh()
    train = make_train(mesh)
    (args.directory / "records").mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"layout": [jax.process_count(), jax.local_device_count()], "times": {}}

    def write_record(**items: Any) -> None:
        record.update(items)
        (args.directory / "records" / f"{args.name}_{me}.json").write_text(json.dumps(record))

    record["times"]["initialized"] = now()
    like = jax.eval_shape(lambda: initial_state(mesh, args.steps))  # the structure alone: nothing compiles
    with sv.Checkpointer(args.directory / "state", keep=3) as ckpt:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state, _ = ckpt.restore(like, mesh=mesh)
                restored = state["step"]
            except sv.CheckpointNotFoundError:
                state, restored = initial_state(mesh, args.steps), None
        record["times"]["restored"] = now()
        write_record(restored=restored, warnings=[f"{w.category.__name__}: {w.message}" for w in caught])
        signalled = fired = False
        while state["step"] < args.steps:
            state = train(state)
            t = state["step"]
            record["times"].setdefault("first_step", now())
            if signalled:
                time.sleep(TERM_WAIT_S)  # (not a race: a notice that takes longer only stops the run later)
            preempted = sv.distributed.reached_preemption(t)
            if preempted or t % args.every == 0 or t == args.steps:
                ckpt.save(t, state, metadata={"step": t})
            if preempted:
                ckpt.wait()
                write_record(left="preempted", step=t)
                sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
            due = args.fault is not None and t >= args.at and not fired
            fired = fired or due
            if due and args.fault == "term":  # after reached_preemption, which handed SIGTERM to JAX's notifier
                ckpt.wait()  # the notice comes once the last save is committed (and finalised)
                os.kill(os.getpid(), signal.SIGTERM)
                signalled = True
            if due and me == args.process and args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if due and me == args.process and args.fault == "raise":
                raise RuntimeError(f"chaos: the planned failure of process {me} at step {t}")
    write_result(args.directory / "result.npz", state)
    record["times"]["end"] = now()
    write_record(left="finished", step=state["step"], notice_ignored=signalled)


if __name__ == "__main__":
    main(sys.argv[1:])
