"""A FermiNet-style neural-network wavefunction for atoms and small molecules, trained on every device.

Variational Monte Carlo with the natural gradient (minSR, SPRING, dense SR or CG: an optax chain of
``shardvmc.optax``; ``kfac_vmc.py`` trains the same network with KFAC), the Metropolis moves of ``sv.mcmc``,
and kernels written for ONE walker: the local energy (``sv.hamiltonian``) with the walker's row of
``J = d log|psi| / d params``, and FermiNet's energy clipping. ``sv.driver.run`` runs the training (progress,
logs, checkpoints; a preemption notice saves the state and exits with 75; the same command resumes) and
``sv.driver.expect`` the evaluation. Copy it with ``network.py`` and ``plumbing.py``; see ``docs/neural.md``.

    python examples/neural_vmc.py --system Li                      # minSR; 8 fake CPU devices
    python examples/neural_vmc.py --quick --devices 1              # a smoke test: seconds
    python examples/neural_vmc.py --system N2 --size ferminet      # FermiNet's network; refused if it cannot fit
    python examples/neural_vmc.py --checkpoint run --checkpoint-every 50 [--devices 4]   # again: goes on from there
    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python examples/neural_vmc.py --quick
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import plumbing
from network import SYSTEMS, System, init, init_walker, log_psi

import shardvmc as sv
import shardvmc.optax as svx

OPTIMISERS = ("minsr", "spring", "dense", "cg")
CHEMICAL_ACCURACY = 1.6e-3  # Hartree (1 kcal/mol)
MEMORY_FIX = ("here: fewer --walkers, more --devices (or chips), or KFAC: examples/kfac_vmc.py; "
              "--batch-size bounds the local energy's memory, not J's")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run."""

    system: str = "Li"
    walkers: int = 512
    steps: int = 700
    eval_steps: int = 300
    seed: int = 0
    hidden: int = 32
    hidden_two: int = 8
    layers: int = 2
    determinants: int = 4
    sweeps: int = 20  # Metropolis moves per step
    burn_in: int = 100  # Metropolis moves before the first step
    step_size: float = 0.3
    optimiser: str = "minsr"
    damping: float = 1e-2
    momentum: float = 0.9  # SPRING's
    lr: float = 0.5
    lr_decay: float = 2000.0  # lr / (1 + t / lr_decay)
    max_norm: float = 0.005  # the largest lr^2 d.S.d of a step
    clip: float = 5.0  # local energies clipped to mean +- clip mean absolute deviations
    batch_size: int | None = None
    dtype: str = "auto"  # float64 where the platform has it, float32 on TPUs (sv.precision_policy)
    memory_budget: int | None = None  # bytes per device; None: the device's (sv.natural_gradient_memory)

    def schedule(self, t: jax.Array) -> jax.Array:
        """FermiNet's inverse-time decay of the learning rate (optax has none), an optax schedule."""
        return self.lr / (1.0 + t / self.lr_decay)


QUICK = {"walkers": 64, "steps": 6, "eval_steps": 4, "hidden": 8, "hidden_two": 4, "layers": 1,
         "determinants": 1, "sweeps": 2, "burn_in": 4}  # fmt: skip  # --quick: a tiny network (a smoke test)
# --size: the network's widths; FermiNet's default network (Pfau et al. 2020): 4 layers of 256/32 units, 16 determinants
SIZES = {"examples": {}, "ferminet": {"hidden": 256, "hidden_two": 32, "layers": 4, "determinants": 16}}


# --8<-- [start:kernels]
def local_energy(params: Any, r: jax.Array, system: System) -> jax.Array:
    """The local energy of ONE walker ``r``: kinetic energy (folx's Laplacian) plus Coulomb potential."""
    kinetic = sv.hamiltonian.kinetic_energy(functools.partial(log_psi, system=system), params, r)
    return kinetic + sv.hamiltonian.coulomb(r, system.charges, system.coords)


@sv.walker_parallel
def measure(
    params: sv.Replicated[Any], r: sv.PerWalker[jax.Array], system: sv.Static[System]
) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[Any]]:
    """The local energy of ONE walker and its log-derivatives ``d log|psi| / d params`` (its row of ``J``)."""
    return local_energy(params, r, system), jax.grad(log_psi)(params, r, system)


@sv.walker_parallel
def clip(
    e: sv.PerWalker[jax.Array], width: sv.Static[float]
) -> tuple[sv.PerWalker[jax.Array], sv.Mean[jax.Array], sv.Mean[jax.Array]]:
    """FermiNet's clipping: ``e`` clipped to mean +- ``width`` mean absolute deviations; ``<e>``, ``<e**2>``.

    The window is over all valid walkers (``sv.all_walkers``, which cannot see across the
    chunks of a ``batch_size`` kernel: hence a kernel of its own), held constant.
    """
    mean = jax.lax.stop_gradient(sv.all_walkers.mean(e))
    mad = jax.lax.stop_gradient(sv.all_walkers.mean(jnp.abs(e - mean)))
    return jnp.clip(e, mean - width * mad, mean + width * mad), e, e**2


# --8<-- [end:kernels]


class State(NamedTuple):
    """The training state: parameters, the optimiser's state, the sampler's (walkers and proposal width)."""

    params: Any
    opt: Any
    sampler: sv.mcmc.SamplerState


class Steps(NamedTuple):
    """A training method: ``init(params, positions, key)`` (the optimiser's state), ``train(state, key)``."""

    init: Callable[..., Any]
    train: Callable[..., Any]


@functools.cache
def make_sampler(config: Config, mesh: Any) -> sv.mcmc.Metropolis:
    """``config.sweeps`` all-electron Gaussian moves per call, the width adapted towards 50 % acceptance."""
    psi = functools.partial(log_psi, system=SYSTEMS[config.system])
    return sv.mcmc.Metropolis(psi, n_steps=config.sweeps, mesh=mesh, batch_size=config.batch_size)


def network_sizes(config: Config, mesh: Any) -> tuple[Any, ...]:
    """``init``'s arguments after the system: the widths, layers, determinants and the dtype of the mesh's platform."""
    dtype = sv.precision_policy(config.dtype, mesh=mesh).dtype
    return config.hidden, config.hidden_two, config.layers, config.determinants, dtype


@functools.cache  # the same function for the same system: sv.driver.expect then reuses its compiled evaluation
def energy_of(system: str) -> Callable[[Any, jax.Array], jax.Array]:
    """The local energy of ONE walker of ``system``, ``energy(params, r)``: the evaluation's observable."""
    return functools.partial(local_energy, system=SYSTEMS[system])


def step_stats(e_mean: jax.Array, e2_mean: jax.Array, n: int, acceptance: jax.Array) -> dict[str, jax.Array]:
    """What a training step reports: the mean local energy, its error bar over the walkers, the variance, acceptance."""
    variance = jnp.maximum(e2_mean - e_mean**2, 0.0)  # not below 0 by round-off
    return {"energy": e_mean, "error": jnp.sqrt(variance / n), "variance": variance, "acceptance": acceptance}


# --8<-- [start:step]
@functools.cache  # one compilation per setting and mesh (runs that differ only in their seed share it)
def make_steps(config: Config, mesh: Any) -> Steps:
    """The natural gradient: an optax chain of the direction, the Fisher-norm bound, the learning rate.

    Before anything compiles, each device's rows of ``J`` and the solver must fit its memory (the parameters'
    shapes from ``jax.eval_shape``); a run that cannot is refused with the bytes it needs and what would fit.
    """
    system, sampler = SYSTEMS[config.system], make_sampler(config, mesh)
    shapes = jax.eval_shape(lambda: init(jax.random.key(0), system, *network_sizes(config, mesh)))
    memory = sv.natural_gradient_memory(config.walkers, shapes, method=config.optimiser,
                                        devices=mesh.devices.size,
                                        memory_budget=config.memory_budget)  # fmt: skip
    memory.check(MEMORY_FIX)  # refused before anything compiles: the bytes it needs, and what would fit
    optimiser = optax.chain(
        svx.natural_gradient(damping=config.damping, method=config.optimiser, chunks=memory.chunks,
                             momentum=config.momentum * (config.optimiser == "spring"),
                             memory_budget=config.memory_budget),
        svx.clip_by_fisher_norm(config.max_norm, config.schedule),
        optax.scale_by_learning_rate(config.schedule),
    )  # fmt: skip

    @jax.jit
    def train(state: State, key: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        walkers = sampler.step(state.params, state.sampler, key)  # refreshes log|psi| for the new params
        measure_ = measure.with_options(mesh=mesh, batch_size=config.batch_size)
        e, j = measure_(state.params, walkers.positions, system)
        e_clipped, e_mean, e2_mean = clip.with_options(mesh=mesh)(e, config.clip)
        p = state.params
        updates, opt = optimiser.update(p, state.opt, p, jacobian=j, local_energies=e_clipped)
        state = State(optax.apply_updates(state.params, updates), opt, walkers)
        return state, step_stats(e_mean, e2_mean, e.n_valid, walkers.acceptance)

    # The optimiser's state on the mesh, as the step returns it (else the step's second call compiles again).
    return Steps(lambda p, positions, key: sv.replicate(jax.jit(optimiser.init)(p), mesh), train)


# --8<-- [end:step]


def initial_state(config: Config, mesh: Any, steps: Steps) -> State:
    """Parameters, optimiser state and walkers after ``config.burn_in`` moves at the initial parameters."""
    system, root, sizes = SYSTEMS[config.system], jax.random.key(config.seed), network_sizes(config, mesh)
    params = sv.replicate(jax.jit(lambda key: init(key, system, *sizes))(jax.random.fold_in(root, 10**6)), mesh)
    dtype = sizes[-1]
    positions = sv.initialize_walkers_sharded(lambda key: init_walker(key, system, dtype), config.walkers, mesh,
                                              key=jax.random.fold_in(root, 0))  # fmt: skip
    sampler = make_sampler(config, mesh)
    walkers = sampler.init(params, positions, config.step_size)
    burn_in = jax.jit(functools.partial(sampler.step, refresh=False))
    for i in range(-(-config.burn_in // config.sweeps)):
        walkers = burn_in(params, walkers, jax.random.fold_in(root, 2**31 + i))
    return State(params, steps.init(params, walkers.positions, jax.random.fold_in(root, 10**6 + 1)), walkers)


# --8<-- [start:run]
def train(config: Config, mesh: Any, *, make: Callable[[Config, Any], Steps] = make_steps,
          checkpoint: str | None = None, checkpoint_every: int = 100, stop_after: int | None = None,
          print_every: int = 0) -> sv.driver.RunResult:  # fmt: skip
    """Train ``config.steps`` steps (the method ``make`` builds): ``sv.driver.run``'s result (state, history).

    ``checkpoint``: a directory to save in every ``checkpoint_every`` steps, at the end and on a
    preemption notice (then the process exits with 75); the same call goes on from there, on any
    mesh (a finished run's checkpoint gives its state at once). ``stop_after``: end the training
    there (a checkpoint is saved), to go on later.
    """
    with sv.precision_policy(config.dtype, mesh=mesh).context(), sv.use_mesh(mesh):
        steps = make(config, mesh)  # refuses a run whose optimiser cannot fit, before anything compiles
        state = initial_state(config, mesh, steps)
        sv.distributed.check_consistent(state.params)  # every process holds the same parameters
        # A checkpoint of other settings is refused; the step counts, batch size and memory budget may change.
        settings = dataclasses.asdict(dataclasses.replace(config, steps=0, eval_steps=0, batch_size=None,
                                                          memory_budget=None))  # fmt: skip
        n = config.steps if stop_after is None else min(config.steps, stop_after)
        lines = sv.driver.PrintLog(print_every) if print_every else None
        key = jax.random.fold_in(jax.random.key(config.seed), 1)
        return sv.driver.run(steps.train, state, n, key=key, out=lines,
                             metadata=settings, checkpoint=checkpoint,
                             checkpoint_every=checkpoint_every)  # fmt: skip


def run(config: Config, mesh: Any, *, stop_after: int | None = None, **options: Any) -> dict[str, Any]:
    """Train (``train``, with its ``options``), evaluate ``config.eval_steps`` steps: the run's summary."""
    start_time = time.perf_counter()
    result = train(config, mesh, stop_after=stop_after, **options)
    finished = result.status == "finished" and len(result.history["energy"]) == config.steps
    estimate = evaluate(config, mesh, result.state) if finished and config.eval_steps else None
    n_params = sum(x.size for x in jax.tree.leaves(result.state.params))
    seconds = time.perf_counter() - start_time
    status = "finished" if finished else "stopped"
    return summarise(config, result.history, estimate, status, mesh, n_params, seconds)


def evaluate(config: Config, mesh: Any, state: State) -> sv.Stats:
    """The trained network's energy: ``config.eval_steps`` steps of sampling, fixed parameters."""
    key = jax.random.fold_in(jax.random.key(config.seed), 2)
    with sv.precision_policy(config.dtype, mesh=mesh).context(), sv.use_mesh(mesh):
        return sv.driver.expect(make_sampler(config, mesh), energy_of(config.system), state.params,
                                state.sampler, config.eval_steps, key=key)  # fmt: skip


# --8<-- [end:run]


def summarise(config: Config, history: Mapping[str, Any], estimate: sv.Stats | None, status: str, mesh: Any,
              n_params: int, seconds: float) -> dict[str, Any]:  # fmt: skip
    """The run's summary: the evaluation's energy with its error bar (``sv.driver.expect``) when there is one."""
    system, energies = SYSTEMS[config.system], np.asarray(history["energy"], dtype=np.float64)
    energy = error = fraction = None
    if estimate is not None:
        energy, error = float(estimate.mean), float(estimate.error_of_mean)
        if system.hf_energy is not None:
            fraction = (system.hf_energy - energy) / (system.hf_energy - system.exact_energy)
    average = np.convolve(energies, np.ones(50) / 50, mode="valid") if energies.size >= 50 else np.zeros(0)
    reached = np.flatnonzero(average <= system.exact_energy + CHEMICAL_ACCURACY)
    return {
        "system": config.system, "optimiser": config.optimiser, "status": status, "steps_done": len(energies),
        "energy": energy, "error": error, "exact": system.exact_energy, "hf": system.hf_energy,
        "correlation_fraction": fraction, "best_average_50": float(average.min()) if average.size else None,
        "chemical_accuracy_step": int(reached[0]) + 50 if reached.size else None,
        "devices": int(mesh.devices.size), "platform": str(mesh.devices.flat[0].platform),
        "processes": jax.process_count(), "walkers": config.walkers, "n_params": n_params, "seconds": seconds,
        "compile_seconds": float(history["step_time"][0]) if len(energies) else None,
        "config": dataclasses.asdict(config), "energies": energies.tolist(),
        "variances": np.asarray(history["variance"]).tolist(),
        "acceptances": np.asarray(history["acceptance"]).tolist(),
    }  # fmt: skip


def report(s: dict[str, Any], quick: bool) -> list[str]:
    """What the run says at its end: an energy only for a finished run; no correlation percentage for a smoke test."""
    lines = [f"{s['system']}, {s['optimiser']}: {s['walkers']} walkers on {s['devices']} {s['platform']} devices, "
             f"{s['n_params']} parameters, {s['steps_done']} steps in {s['seconds']:.1f} s"]  # fmt: skip
    if s["status"] != "finished":
        lines.append(f"{s['status']} after step {s['steps_done']} of {s['config']['steps']}: the same command goes on")
    elif s["energy"] is not None:
        lines.append(f"E = {s['energy']:.5f} +- {s['error']:.5f} Ha (exact {s['exact']})")
        if quick:
            lines.append("a --quick smoke test: a tiny network after a few steps, not a converged energy")
        elif s["correlation_fraction"] is not None:
            lines.append(f"correlation energy recovered: {100 * s['correlation_fraction']:.1f} %")
    if not quick and s["best_average_50"] is not None:
        target, when = s["exact"] + CHEMICAL_ACCURACY, s["chemical_accuracy_step"]
        reached = f"reached {target:.4f} at step {when}" if when else f"did not reach {target:.4f}"
        lines.append(f"50-step average: best {s['best_average_50']:.5f} Ha; {reached}")
    return lines


def main(argv: Sequence[str] | None = None, make: Callable[[Any, Any], Steps] = make_steps,
         config_class: type = Config, optimisers: Sequence[str] = OPTIMISERS) -> dict[str, Any]:  # fmt: skip
    """Run the example from the command line (the training method ``make``, settings ``config_class``)."""
    choices = {"system": sorted(SYSTEMS), "optimiser": optimisers}
    args, config = plumbing.parse_args(argv, config_class, __doc__, quick=QUICK, choices=choices, sizes=SIZES)
    mesh = plumbing.start(args.devices)
    plumbing.announce(mesh, config.dtype)  # the header: devices and precision
    summary = run(config, mesh, make=make, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                  print_every=args.print_every)  # fmt: skip
    if jax.process_index() == 0:  # only process 0 prints and writes
        print("\n".join(report(summary, args.quick)))
    plumbing.finish(args, summary, f"{config.system}, {config.optimiser}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
