"""One process of the chaos test (``tests/test_chaos.py``): a VMC or DMC run that fails where it is told to.

Not a test module itself: the test launches it as

    python -m shardvmc.launch --processes P --devices-per-process D -- \\
        python tests/chaos_worker.py DIR --method {vmc,dmc} --steps N --every K --name NAME \\
        [--fault KIND --at STEP --process I]

Both runs are of helium in float64 with 13 walkers (a count that 3, 4 and 8 devices do not divide) in a
``sv.WalkerSet``, save the whole state asynchronously every ``K`` steps (``DIR/state``) and start from the newest
intact step there, on whatever layout they run on; step ``t`` draws from ``fold_in(key, t)``, so a resumed run
continues the uninterrupted one.

``vmc``
    trains a small neural Jastrow factor with ``sv.mcmc`` walkers and minSR (``shardvmc.optax.natural_gradient``)
    in a loop of its own with ``sv.Checkpointer`` and ``sv.distributed.reached_preemption``.
``dmc``
    is fixed-node DMC (``sv.dmc.DMC``, ``tau = 0.05``, a nodeless trial function: the exact cusps and a Pade
    Jastrow factor; the jvp Laplacian) through ``sv.driver.run`` with ``checkpoint=DIR``, ``checkpoint_every=K``
    and the default ``ahead``: the driver restores, saves, reads the preemption notice and keeps every step's
    statistics (``DIR/log.jsonl``). The fault comes from the step function the driver calls (``DMC.step``
    wrapped) when the driver asks for the step after step ``STEP``: the same point as in the VMC loop, with up
    to ``ahead`` steps in flight.

The fault comes after step ``STEP`` (after its save, if any, has started), or after the first step of a run
resumed past it:

``kill``
    process ``I`` sends itself SIGKILL;
``raise``
    process ``I`` raises an exception;
``term``
    every process waits until its last save is committed, then sends itself SIGTERM, a preemption notice (SLURM
    sends one to every task): once ``sv.distributed.reached_preemption`` says so (for DMC: in the driver), the
    run saves that step and exits with ``sv.distributed.PREEMPTED_EXIT_CODE``.

Each process writes ``DIR/records/<NAME>_<process>.json`` once it has restored (the step, the warnings of the
restore) and again when it leaves on its own; the times in it are (seconds since ``main`` started, CPU seconds
of the process). At step ``N`` process 0 writes ``DIR/result.npz``: for VMC the parameters, the optimiser's
state, the valid walkers, the proposal width and every step's energy; for DMC the valid walkers (positions,
``log|psi|``, sign, drift, local energy, weight), the rest of the ``sv.dmc.DMCState`` (trial energy, the sums of
the effective time step, the step count, the parameters) and every step's statistics as the driver's history
gives them (``energies`` and ``history.<name>``; not ``step_time``).
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


class Record:
    """``DIR/records/<NAME>_<process>.json``: what the test reads of this process (written as it goes)."""

    def __init__(self, path: Path, started: float, layout: list[int]) -> None:
        self.path, self.started = path, started
        self.items: dict[str, Any] = {"layout": layout, "times": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def time(self, name: str, again: bool = True) -> None:
        """Note (seconds since ``main`` started, CPU seconds of the process) as the time of ``name``."""
        if again or name not in self.items["times"]:
            self.items["times"][name] = (round(time.monotonic() - self.started, 2), round(time.process_time(), 2))

    def write(self, **items: Any) -> None:
        self.items.update(items)
        self.path.write_text(json.dumps(self.items))


# ---------------------------------------------------------------- VMC: minSR in a loop of its own

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


def run_vmc(args: argparse.Namespace, mesh: Any, record: Record) -> None:
    """The VMC run: a loop of its own with ``sv.Checkpointer`` and ``sv.distributed.reached_preemption``."""
    me = jax.process_index()
    train = make_train(mesh)
    like = jax.eval_shape(lambda: initial_state(mesh, args.steps))  # the structure alone: nothing compiles
    with sv.Checkpointer(args.directory / "state", keep=3) as ckpt:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state, _ = ckpt.restore(like, mesh=mesh)
                restored = state["step"]
            except sv.CheckpointNotFoundError:
                state, restored = initial_state(mesh, args.steps), None
        record.time("restored")
        record.write(restored=restored, warnings=[f"{w.category.__name__}: {w.message}" for w in caught])
        signalled = fired = False
        while state["step"] < args.steps:
            state = train(state)
            t = state["step"]
            record.time("first_step", again=False)
            if signalled:
                time.sleep(TERM_WAIT_S)  # (not a race: a notice that takes longer only stops the run later)
            preempted = sv.distributed.reached_preemption(t)
            if preempted or t % args.every == 0 or t == args.steps:
                ckpt.save(t, state, metadata={"step": t})
            if preempted:
                ckpt.wait()
                record.write(left="preempted", step=t)
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
    record.time("end")
    record.write(left="finished", step=state["step"], notice_ignored=signalled)


# ---------------------------------------------------------------- DMC: sv.dmc.DMC through sv.driver.run

TIME_STEP = 0.05  # hartree^-1
DMC_KEY = 11


def dmc_log_psi(b: jax.Array, r: jax.Array) -> jax.Array:
    """log|psi| of ONE helium walker ``r`` (2, 3), nodeless: the exact cusps and a Pade Jastrow factor."""
    r1, r2 = jnp.linalg.norm(r, axis=-1)
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -2.0 * (r1 + r2) + r12 / (2.0 * (1.0 + b * r12))


def helium_potential(r: jax.Array) -> jax.Array:
    return sv.hamiltonian.coulomb(r, charges=(2.0,), coords=((0.0, 0.0, 0.0),))


def dmc_initial_state(dmc: sv.dmc.DMC, mesh: Any) -> sv.dmc.DMCState:
    """The DMC state at step 0: the same values on every layout (walker ``i`` drawn from ``fold_in(key, i)``)."""
    positions = sv.initialize_walkers_sharded(
        lambda k: 0.7 * jax.random.normal(k, (2, 3), jnp.float64), N_WALKERS, mesh, key=jax.random.key(SEED)
    )
    return dmc.init(jnp.float64(0.3), positions)


class Faults:
    """The planned fault, brought by the step ``sv.driver.run`` calls, and the record of the restore.

    :meth:`step` wraps ``DMC.step``: the driver calls it to dispatch each step once it has dealt with the step
    before (asked for a notice, read the statistics where due, started the save if any). The fault comes when it
    asks for the step after step ``at`` (after the save of ``at`` steps, if any, has started), or after the first
    step of a run resumed past it, as in the VMC loop; up to ``ahead`` steps are in flight then. As a callback,
    the object writes the record of the restore in :meth:`start`, which the driver calls once it has restored (or
    found nothing to restore).
    """

    def __init__(self, dmc: sv.dmc.DMC, args: argparse.Namespace, record: Record, caught: list[Any]) -> None:
        self.dmc, self.fault, self.at, self.process = dmc, args.fault, args.at, args.process
        self.record, self.caught = record, caught
        self.first = self.t = 0  # the step the run started at; the steps done before the one asked for next
        self.fired = self.signalled = False

    def start(self, step: int) -> None:
        self.first = self.t = step
        self.record.time("restored")
        self.record.write(restored=step or None, warnings=[f"{w.category.__name__}: {w.message}" for w in self.caught])

    def __call__(self, step: int, stats: dict[str, float]) -> None:
        self.record.time("first_step", again=False)  # (the first step's statistics read)

    def step(self, state: sv.dmc.DMCState, key: jax.Array) -> tuple[sv.dmc.DMCState, dict[str, jax.Array]]:
        t, self.t = self.t, self.t + 1
        due = self.fault is not None and t >= max(self.at, self.first + 1) and not self.fired
        self.fired = self.fired or due
        me = jax.process_index()
        if due and self.fault == "term":  # after a reached_preemption, which handed SIGTERM to JAX's notifier
            sv.wait_for_saves()  # the notice comes once the last save is committed (and finalised)
            os.kill(os.getpid(), signal.SIGTERM)
            self.signalled = True
        if due and me == self.process and self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if due and me == self.process and self.fault == "raise":
            raise RuntimeError(f"chaos: the planned failure of process {me} at step {t}")
        if self.signalled:  # before the driver's next reached_preemption, as in the VMC loop
            time.sleep(TERM_WAIT_S)  # (not a race: a notice that takes longer only stops the run later)
        return self.dmc.step(state, key)


def write_dmc_result(path: Path, result: sv.driver.RunResult) -> None:
    """Process 0 writes the final DMC state and the history (the walkers are gathered: call it on every process)."""
    state: sv.dmc.DMCState = result.state
    walkers = sv.gather_walkers(state.walkers.data)
    arrays: dict[str, Any] = {f"walkers.{k}": np.asarray(v)[:N_WALKERS] for k, v in walkers._asdict().items()}
    for name in ("params", "trial_energy", "accepted_r2", "proposed_r2", "steps"):
        arrays[name] = np.asarray(getattr(state, name).addressable_data(0))
    for name, values in result.history.items():
        if name != "step_time":  # (wall-clock time)
            arrays["energies" if name == "energy" else f"history.{name}"] = values
    if jax.process_index() == 0:
        np.savez(path, **arrays)


def run_dmc(args: argparse.Namespace, mesh: Any, record: Record) -> None:
    """The DMC run: ``sv.driver.run`` restores, saves, takes the notice; :class:`Faults` brings the fault."""
    # (the jvp Laplacian, as the VMC run's: it compiles in less time than folx's, the default)
    dmc = sv.dmc.DMC(dmc_log_psi, helium_potential, time_step=TIME_STEP, laplacian="jvp")
    saved = args.directory / "state"
    if saved.is_dir() and any(p.name.isdigit() for p in saved.iterdir()):  # a committed step: the run resumes
        # the structure alone, nothing compiles (the test leaves an intact step whenever it damages one)
        start = jax.eval_shape(lambda: dmc_initial_state(dmc, mesh))
    else:
        start = dmc_initial_state(dmc, mesh)
    with warnings.catch_warnings(record=True) as caught:  # (the restore's, read by Faults.start)
        warnings.simplefilter("always")
        faults = Faults(dmc, args, record, caught)
        result = sv.driver.run(
            faults.step,
            start,
            args.steps,
            key=jax.random.key(DMC_KEY),
            checkpoint=args.directory,
            checkpoint_every=args.every,
            keep=3,
            callbacks=[sv.driver.StopOnNonFinite(), faults],
            metadata={"walkers": N_WALKERS, "time_step": TIME_STEP},
            progress=False,
            on_preemption="return",
            mesh=mesh,  # (where the checkpoint is restored: start may be a structure without placement)
        )
    if result.preempted:  # saved, and committed: the driver waits for its saves
        record.write(left="preempted", step=result.step)
        sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
    assert result.status == "finished", result
    write_dmc_result(args.directory / "result.npz", result)
    record.time("end")
    record.write(left="finished", step=result.step, notice_ignored=faults.signalled)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--method", choices=("vmc", "dmc"), default="vmc")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--fault", choices=FAULTS)
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--process", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    sv.distributed.initialize()  # a failing process ends the run (fail_fast, the default)
    jax.config.update("jax_enable_x64", True)
    path = args.directory / "records" / f"{args.name}_{jax.process_index()}.json"
    record = Record(path, started, [jax.process_count(), jax.local_device_count()])
    record.time("initialized")
    (run_vmc if args.method == "vmc" else run_dmc)(args, sv.create_mesh(), record)


if __name__ == "__main__":
    main(sys.argv[1:])
