"""A small training loop with whole-state checkpoints, and the processes of the multi-process state tests.

Not a test module itself: ``tests/test_checkpoint.py`` imports it (the state, the
training step, the loop) and launches it as

    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python tests/mp_state_worker.py MODE DIR

``save``: every process builds :func:`make_state` (13 walkers on 4 devices, a
parameter dict, an optax Adam state, the step, a typed key, a NumPy array), a
:class:`sv.Checkpointer` saves it as step 1 and waits; process 0 writes the walkers
it saw (gathered) to ``DIR/saved.json``; then a larger state is saved as step 2 and
process 1 kills itself (SIGKILL) as soon as that asynchronous save returns, while its
part is being written.
``train``: :func:`run` trains until preempted, saving every 5 steps; each process
writes ``DIR/ready_<process>.json`` (its pid) once it is stepping, and, when
:func:`sv.distributed.reached_preemption` says so, saves the step, waits for the
write, writes ``DIR/preempted_<process>.json`` and exits with
``sv.distributed.PREEMPTED_EXIT_CODE``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardvmc as sv

N_VALID = 13  # walkers: padded to 16 on 4 devices, to 15 on 3
EVERY = 5  # steps between periodic saves
ADAM = optax.adam(0.05)


def _init_walker(key: jax.Array) -> dict[str, Any]:
    position, walker_key = jax.random.split(key)
    return {"r": jax.random.normal(position, (2, 3), jnp.float64), "key": walker_key}


@jax.jit
def _params_and_optimiser() -> tuple[dict[str, jax.Array], Any]:
    """The parameters and an Adam state with non-zero moments and count, as in a running optimisation."""
    params = {"a": jnp.array([0.8], jnp.float64), "b": jnp.array([0.1, -0.2, 0.05], jnp.float64)}
    opt = ADAM.init(params)
    for k in range(2):
        _, opt = ADAM.update(jax.tree.map(lambda p: jnp.sin(p + k), params), opt, params)
    return params, opt


def make_state(mesh: Any, n_valid: int = N_VALID) -> dict[str, Any]:
    """A deterministic training state on ``mesh`` (needs jax_enable_x64): every kind of leaf a VMC run holds."""
    walkers = sv.initialize_walkers_sharded(_init_walker, n_valid, mesh, key=jax.random.key(11))
    params, opt = sv.replicate(_params_and_optimiser(), mesh)
    return {
        "walkers": walkers,
        "params": params,
        "opt": opt,
        "step": 0,
        "key": jax.random.key(5),
        "energies": np.zeros(4, np.float64),  # the last few energies (host data)
    }


def _log_psi(params: Any, r: jax.Array) -> jax.Array:
    return -params["a"][0] * jnp.sum(r**2) + jnp.sum(params["b"] * r.sum(0))


@functools.cache
def make_train_step(mesh: Any) -> Any:
    """``step(state) -> (state, energy)``: a Metropolis move, the mean local energy, one Adam step (jitted)."""

    @sv.walker_parallel(mesh=mesh)
    def move(params: sv.Replicated[Any], walker: sv.PerWalker[dict], key: sv.WalkerKey) -> sv.PerWalker[dict]:
        r = walker["r"]
        proposal = r + 0.4 * jax.random.normal(key, r.shape, r.dtype)
        log_u = jnp.log(jax.random.uniform(jax.random.fold_in(key, 1), dtype=r.dtype))
        accept = log_u < 2.0 * (_log_psi(params, proposal) - _log_psi(params, r))
        return {"r": jnp.where(accept, proposal, r), "key": jax.random.fold_in(walker["key"], 3)}

    @sv.walker_parallel(mesh=mesh)
    def energy(params: sv.Replicated[Any], walker: sv.PerWalker[dict]) -> sv.Mean[jax.Array]:
        r = walker["r"]
        grad = jax.grad(_log_psi, argnums=1)(params, r)
        laplacian = jnp.trace(jax.hessian(_log_psi, argnums=1)(params, r).reshape(r.size, r.size))
        return -0.5 * (laplacian + jnp.sum(grad**2)) + 0.5 * jnp.sum(r**2)

    @jax.jit
    def step(state: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
        key, sub = jax.random.split(state["key"])
        walkers = move(state["params"], state["walkers"], sub)
        e, grads = jax.value_and_grad(lambda p: energy(p, walkers))(state["params"])
        updates, opt = ADAM.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "walkers": walkers, "params": params, "opt": opt, "key": key}, e

    def train_step(state: dict[str, Any]) -> tuple[dict[str, Any], float]:
        new, e = step({k: v for k, v in state.items() if k not in ("step", "energies")})
        energy_value = float(np.asarray(e.addressable_data(0)))
        energies = np.roll(state["energies"], 1)
        energies[0] = energy_value
        return {**new, "step": state["step"] + 1, "energies": energies}, energy_value

    return train_step


def run(
    directory: str | os.PathLike[str],
    mesh: Any,
    *,
    until: int,
    preemption: bool = False,
    record: Path | None = None,
    pace_s: float = 0.0,
) -> dict[str, Any]:
    """Train until step ``until`` (resuming from the latest checkpoint in ``directory``); returns the state.

    With ``preemption``, checks :func:`sv.distributed.reached_preemption` at every
    step and, when it fires, saves that step and exits with ``PREEMPTED_EXIT_CODE``.
    """
    state = make_state(mesh)
    train_step = make_train_step(mesh)
    me = jax.process_index()
    with sv.Checkpointer(directory, keep=3) as ckpt:
        if ckpt.latest_step() is not None:
            state, _ = ckpt.restore(state, mesh=mesh)
        started = state["step"]
        while state["step"] < until:
            state, e = train_step(state)
            t = state["step"]
            preempted = preemption and sv.distributed.reached_preemption(t)
            if preempted or t % EVERY == 0:
                ckpt.save(t, state, metadata={"energy": e, "preempted": bool(preempted)})
            if preempted:
                ckpt.wait()
                if record is not None:
                    (record / f"preempted_{me}.json").write_text(json.dumps({"step": t, "started": started}))
                sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)
            if record is not None and t == started + 2:  # stepping (and JAX's SIGTERM notifier in place)
                (record / f"ready_{me}.json").write_text(json.dumps({"pid": os.getpid(), "step": t}))
            time.sleep(pace_s)
    return state


def save(directory: str) -> None:
    mesh = sv.create_mesh()
    state = make_state(mesh)
    path = Path(directory) / "state"
    with sv.Checkpointer(path, keep=2) as ckpt:
        ckpt.save(1, state, metadata={"version": 1})
        ckpt.wait()
        walkers = sv.gather_walkers(
            {"r": state["walkers"].data["r"], "key": jax.random.key_data(state["walkers"].data["key"])}
        )
        if jax.process_index() == 0:
            (Path(directory) / "saved.json").write_text(
                json.dumps({k: v.tolist() for k, v in walkers.items()} | {"n_walkers": state["walkers"].n_walkers})
            )
        # A larger state (64 MiB of walkers more), saved as step 2; process 1 dies while writing its part of it.
        big = sv.initialize_walkers_sharded(
            lambda k: jax.random.normal(k, (512, 8), jnp.float64), 2048, mesh, key=jax.random.key(1)
        )
        ckpt.save(2, {**state, "big": big}, metadata={"version": 2})
        if jax.process_index() == 1:  # the save returned: its 32 MiB of this process are being written
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
    print("the second save completed", flush=True)  # never reached: process 1 is gone, the group is stopped


def train(directory: str) -> None:
    run(Path(directory) / "state", sv.create_mesh(), until=10**6, preemption=True, record=Path(directory), pace_s=0.05)
    print("never preempted", flush=True)


def main(argv: list[str]) -> None:
    mode, directory = argv
    sv.distributed.initialize()
    jax.config.update("jax_enable_x64", True)
    {"save": save, "train": train}[mode](directory)


if __name__ == "__main__":
    main(sys.argv[1:])
