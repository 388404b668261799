"""One process of the chaos test (``tests/test_chaos.py``): a VMC training run that fails where it is told to.

Not a test module itself: the test launches it as

    python -m shardvmc.launch --processes P --devices-per-process D -- \\
        python tests/chaos_worker.py DIR --steps N --every K [--fault KIND --at STEP --process I] --segment NAME

and it trains helium's ground state with a small neural Jastrow factor: 13 walkers (a count that 3, 4 and 8
devices do not divide) as a ``sv.WalkerSet`` of ``sv.mcmc`` walkers, minSR through
``shardvmc.optax.natural_gradient``, float64. Every ``K`` steps it saves the whole state asynchronously with
``sv.Checkpointer`` (``DIR/state``); it starts from the newest step there, on whatever layout it runs on. The
random key of step ``t`` is ``fold_in(seed, t)``: a resumed run continues the uninterrupted one.

The fault, at step ``STEP`` (after that step's save has started):

``kill``
    process ``I`` sends itself SIGKILL;
``raise``
    process ``I`` raises an exception;
``term``
    every process sends itself SIGTERM (a preemption notice, as SLURM sends one to every task): from then on
    ``sv.distributed.reached_preemption`` says when to save, and the run exits with
    ``sv.distributed.PREEMPTED_EXIT_CODE``;

Each process writes ``DIR/records/<NAME>_<process>.json`` once it has restored (the step it resumed from, the
warnings the restore gave) and again when it leaves on its own. At step ``N``, process 0 writes
``DIR/result.npz``: the parameters, the optimiser's state, the walkers (the valid ones), the sampler's width and
every step's energy.
"""

from __future__ import annotations

import time

START = time.time()

import argparse
import functools
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardvmc as sv
import shardvmc.optax as svx

N_WALKERS = 13  # 3, 4 and 8 devices hold padding walkers
HIDDEN = 6
SWEEPS = 2  # Metropolis moves per step
SEED = 7
FAULTS = ("kill", "raise", "term")
TERM_WAIT_S = 2.0  # after the SIGTERM: time for the notice to reach every process before the next step


def log_psi(params: dict[str, Any], r: jax.Array) -> jax.Array:
    """log|psi| of ONE helium walker ``r`` (2, 3): hydrogen-like orbitals times a neural Jastrow factor."""
    r1, r2 = jnp.linalg.norm(r[0]), jnp.linalg.norm(r[1])
    r12 = jnp.linalg.norm(r[0] - r[1])
    features = jnp.stack([r1 + r2, (r1 - r2) ** 2, r12])  # symmetric in the two electrons
    hidden = jnp.tanh(features @ params["w1"] + params["b1"])
    cusp = r12 / (2.0 * (1.0 + params["b"] ** 2 * r12))
    return -params["z"] * (r1 + r2) + cusp + hidden @ params["w2"]


def potential(r: jax.Array) -> jax.Array:
    return sv.hamiltonian.coulomb(r, charges=(2.0,), coords=((0.0, 0.0, 0.0),))


@sv.walker_parallel
def measure(
    params: sv.Replicated[Any], r: sv.PerWalker[jax.Array]
) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[Any], sv.Mean[jax.Array]]:
    """The local energy of ONE walker, its row of ``J = d log|psi| / d params``, and the mean energy."""
    e = sv.hamiltonian.kinetic_energy(log_psi, params, r, laplacian="jvp") + potential(r)
    return e, jax.grad(log_psi)(params, r), e


def init_params(key: jax.Array) -> dict[str, Any]:
    k1, k2 = jax.random.split(key)
    return {
        "z": jnp.asarray(1.7, jnp.float64),
        "b": jnp.asarray(1.0, jnp.float64),
        "w1": 0.3 * jax.random.normal(k1, (3, HIDDEN)),
        "b1": jnp.zeros(HIDDEN),
        "w2": 0.1 * jax.random.normal(k2, (HIDDEN,)),
    }


OPTIMISER = optax.chain(
    svx.natural_gradient(damping=1e-3, method="minsr"),
    svx.clip_by_fisher_norm(0.05, 0.05),
    optax.scale_by_learning_rate(0.05),
)


@functools.cache
def make_train(mesh: Any) -> Any:
    """``train(state, t) -> state``: Metropolis moves, the local energies, one minSR step (one jitted program)."""
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=SWEEPS, mesh=mesh)
    measure_ = measure.with_options(mesh=mesh)

    @jax.jit
    def step(params: Any, opt: Any, walkers: Any, key: jax.Array) -> tuple[Any, Any, Any, jax.Array]:
        walkers = sampler.step(params, walkers, key)
        e, j, energy = measure_(params, walkers.positions)
        updates, opt = OPTIMISER.update(params, opt, params, jacobian=j, local_energies=e)
        return optax.apply_updates(params, updates), opt, walkers, energy

    root = jax.random.key(SEED)

    def train(state: dict[str, Any]) -> dict[str, Any]:
        t = state["step"]
        params, opt, walkers, energy = step(state["params"], state["opt"], state["sampler"], jax.random.fold_in(root, t))
        energies = state["energies"].copy()
        energies[t] = float(np.asarray(energy.addressable_data(0)))  # replicated: this process's copy
        return {"params": params, "opt": opt, "sampler": walkers, "step": t + 1, "energies": energies}

    return train, sampler


def initial_state(mesh: Any, steps: int) -> dict[str, Any]:
    """The state at step 0: the same values on every layout (walker ``i`` drawn from ``fold_in(key, i)``)."""
    _, sampler = make_train(mesh)
    root = jax.random.key(SEED)
    params = sv.replicate(jax.jit(init_params)(jax.random.fold_in(root, 2**31)), mesh)
    positions = sv.initialize_walkers_sharded(
        lambda k: jax.random.normal(k, (2, 3), jnp.float64), N_WALKERS, mesh, key=jax.random.fold_in(root, 2**31 + 1)
    )
    return {
        "params": params,
        "opt": sv.replicate(jax.jit(OPTIMISER.init)(params), mesh),
        "sampler": sampler.init(params, positions, 0.5),
        "step": 0,
        "energies": np.zeros(steps, np.float64),
    }


def placed(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """The state on the shardings the training step returns, so that the step compiles once per layout."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    walker_sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("walkers"))
    sampler = state["sampler"]
    return {
        **state,
        "params": jax.device_put(state["params"], replicated),
        "opt": jax.device_put(state["opt"], replicated),
        "sampler": sampler._replace(
            walkers=jax.device_put(sampler.walkers, walker_sharded),
            width=jax.device_put(sampler.width, replicated),
            acceptance=jax.device_put(sampler.acceptance, replicated),
        ),
    }


def write_result(path: Path, state: dict[str, Any]) -> None:
    """Process 0 writes the final state (gathered: call it on every process)."""
    walkers = sv.gather_walkers(state["sampler"].walkers.data)
    host = jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_data(0)), (state["params"], state["opt"]))
    arrays = {
        f"params{jax.tree_util.keystr(p)}": v for p, v in jax.tree_util.tree_flatten_with_path(host[0])[0]
    } | {f"opt{jax.tree_util.keystr(p)}": v for p, v in jax.tree_util.tree_flatten_with_path(host[1])[0]}
    arrays |= {
        "walkers.r": walkers.r[:N_WALKERS],
        "walkers.log_psi": walkers.log_psi[:N_WALKERS],
        "width": np.asarray(state["sampler"].width.addressable_data(0)),
        "energies": state["energies"],
    }
    if jax.process_index() == 0:
        np.savez(path, **arrays)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--segment", required=True)
    parser.add_argument("--fault", choices=FAULTS)
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--process", type=int, default=0)
    args = parser.parse_args(argv)

    times = {"imported": (round(time.time() - START, 2), round(time.process_time(), 2))}
    sv.distributed.initialize(fail_fast=True)
    jax.config.update("jax_enable_x64", True)
    me = jax.process_index()
    mesh = sv.create_mesh()
    train, _ = make_train(mesh)
    records = args.directory / "records"
    records.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "layout": [jax.process_count(), jax.local_device_count()],
        "pid": os.getpid(),
    }

    def write_record(**items: Any) -> None:
        record.update(items)
        (records / f"{args.segment}_{me}.json").write_text(json.dumps(record))

    times["initialized"] = (round(time.time() - START, 2), round(time.process_time(), 2))
    like = jax.eval_shape(lambda: initial_state(mesh, args.steps))  # the structure alone: nothing compiles
    times["state"] = (round(time.time() - START, 2), round(time.process_time(), 2))
    with sv.Checkpointer(args.directory / "state", keep=3) as ckpt:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state, _ = ckpt.restore(like, mesh=mesh)
                restored = state["step"]
            except sv.CheckpointNotFoundError:
                state, restored = initial_state(mesh, args.steps), None
        times["restored"] = (round(time.time() - START, 2), round(time.process_time(), 2))
        write_record(restored=restored, warnings=[str(w.message) for w in caught], times=times)
        state = placed(state, mesh)
        signalled = fired = False
        while state["step"] < args.steps:
            state = train(state)
            t = state["step"]
            times.setdefault("first_step", (round(time.time() - START, 2), round(time.process_time(), 2)))
            due = args.fault is not None and t >= args.at and not fired  # (a resumed run may start past STEP)
            fired = fired or due
            if due and args.fault == "term":
                os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier takes it
                signalled = True
            if signalled:
                time.sleep(TERM_WAIT_S)  # let the notice reach every process: they then stop at this step
            preempted = sv.distributed.reached_preemption(t)
            if preempted or t % args.every == 0 or t == args.steps:
                ckpt.save(t, state, metadata={"step": t})
            if preempted:
                ckpt.wait()
                write_record(left="preempted", step=t)
                sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
            if due and me == args.process and args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if due and me == args.process and args.fault == "raise":
                raise RuntimeError(f"chaos: the planned failure of process {me} at step {t}")
        ckpt.wait()
    write_result(args.directory / "result.npz", state)
    times["end"] = (round(time.time() - START, 2), round(time.process_time(), 2))
    write_record(left="finished", step=state["step"], times=times)


if __name__ == "__main__":
    main(sys.argv[1:])
