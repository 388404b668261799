"""Variational Monte Carlo of the helium atom on every device, written for one walker.

The trial function is the Slater-Jastrow (Pade-Jastrow) form

    psi(r1, r2) = exp(-alpha (r1 + r2)) * exp(r12 / (2 (1 + beta r12)))

with two parameters, optimised by stochastic reconfiguration (SR). The wavefunction and
the potential are written for ONE walker; ``sv.mcmc.Metropolis`` samples ``|psi|^2`` and
``sv.hamiltonian.local_energy`` gives the local energy (folx's forward Laplacian), both
walker-parallel kernels; the measurement is one made with ``sv.walker_parallel``. The
statistics come out of the kernels as ``Mean`` outputs and the SR update from the optax
chain of ``shardvmc.optax`` (dense SR: one all-reduce of ``Jc^H Jc`` and ``Jc^H ec``), so per-walker data
never leaves its device. ``sv.driver.run`` runs the optimisation (progress, logs,
checkpoints) and ``sv.driver.expect`` estimates the energy at the optimised parameters.

Run it (8 fake CPU devices when there is no accelerator):

    python examples/helium_vmc.py
    python examples/helium_vmc.py --walkers 1000 --steps 100 --devices 4 --json out.json

Randomness depends only on the seed, the step and the global walker index, and the
statistics are reductions over the same walkers whatever the device count, so the
same seed gives the same energies on 1 and on 8 devices (to float64 round-off).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
import plumbing
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

import shardvmc as sv
import shardvmc.optax as svx

EXACT = -2.903724
"""The exact non-relativistic ground-state energy of helium, in Hartree."""
HARTREE_FOCK = -2.8617


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run."""

    walkers: int = 16000  # any count: shardvmc pads it to the device count
    steps: int = 200  # optimisation steps: `sweeps` Metropolis moves, a measurement, an SR update
    eval_steps: int | None = None  # steps at fixed parameters for the energy and its error bar (max(steps/2, 32))
    seed: int = 0
    batch_size: int | None = None  # walkers processed at a time per device (None: all at once)
    sweeps: int = 10  # Metropolis moves per step
    step_size: float = 0.5  # the Metropolis proposal width (bohr)
    learning_rate: float = 0.2
    max_norm: float = 1e-3  # the largest step length in the SR metric (a trust region)
    dtype: str = "auto"  # float64 where the platform has it, float32 on TPUs (sv.precision_policy); in float32 the
    # device counts agree only statistically (~1e-2 Ha)


# ---------------------------------------------------------------------------
# The model: parameters, walkers, and the per-walker physics.
# ---------------------------------------------------------------------------


# --8<-- [start:model]
@chex.dataclass
class Params:
    """Variational parameters: orbital exponent ``alpha`` and Jastrow ``beta``."""

    alpha: jax.Array
    beta: jax.Array


def log_psi(params: Params, r: jax.Array) -> jax.Array:
    """log|psi| of one configuration ``r`` of shape (2, 3)."""
    r1 = jnp.linalg.norm(r[0])
    r2 = jnp.linalg.norm(r[1])
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -params.alpha * (r1 + r2) + r12 / (2.0 * (1.0 + params.beta * r12))


def potential(r: jax.Array) -> jax.Array:
    """The Coulomb energy of the two electrons and the nucleus (charge 2) at the origin."""
    return sv.hamiltonian.coulomb(r, charges=[2.0], coords=[[0.0, 0.0, 0.0]])


# E_loc = (H psi) / psi, the kinetic part from folx's forward Laplacian of log|psi|: a walker-parallel kernel,
# and the local energy of the walker when called inside another kernel's body (as `measure` does).
local_energy = sv.hamiltonian.local_energy(log_psi, potential)


def init_walker(key: jax.Array) -> jax.Array:
    """A walker (both electrons' positions) at random around the nucleus."""
    return jax.random.normal(key, (2, 3))


# --8<-- [end:model]


# --8<-- [start:kernels]
@sv.walker_parallel
def measure(
    params: sv.Replicated[Params], r: sv.PerWalker[jax.Array]
) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[jax.Array], sv.Mean[jax.Array], sv.Mean[jax.Array]]:
    """Local energy and log-derivatives of ONE walker.

    Returns the per-walker energy ``e`` and log-derivative row ``j`` (both stay sharded,
    for the natural gradient), and the means of ``e`` and ``e**2``.
    """
    e = local_energy(params, r)
    j = ravel_pytree(jax.grad(log_psi)(params, r))[0]
    return e, j, e, e**2


# --8<-- [end:kernels]


# ---------------------------------------------------------------------------
# One step of the optimisation.
# ---------------------------------------------------------------------------


class State(NamedTuple):
    """What a step carries: the parameters, the optimiser's state, the sampler's state (walkers, width)."""

    params: Params
    opt: Any
    walkers: sv.mcmc.SamplerState


# --8<-- [start:step]
@functools.cache
def make_step(
    mesh: Mesh, batch_size: int | None, sweeps: int, learning_rate: float, max_norm: float
) -> tuple[sv.mcmc.Metropolis, optax.GradientTransformationExtraArgs, Callable[..., Any]]:
    """The sampler, the optimiser, and one jitted VMC step: Metropolis moves, a measurement, an SR update.

    ``step(state, key) -> (state, stats)``, the protocol of ``sv.driver.run``. ``state.walkers``
    is the sampler's state, whose ``sv.WalkerSet`` the kernels and the natural gradient read
    the count of, so padding never enters a statistic. Cached, so runs with the same settings
    (another seed, say) reuse the compiled step.
    """
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=sweeps, adapt_rate=0.0, mesh=mesh, batch_size=batch_size)
    measure_ = measure.with_options(mesh=mesh, batch_size=batch_size)
    # --8<-- [start:sr]
    # SR: delta = (S + damping)^-1 g with S = <j j^T> - <j><j>^T and the energy gradient
    # g = 2 (<j e> - <j><e>) (the natural-gradient transform solves against <j e> - <j><e>: hence the 2).
    # With P = 2 parameters the dense P x P solve is the one to use; its S comes from sv.jtj (one
    # all-reduce), so j is never gathered. Trust region: the step's length in the SR metric,
    # lr^2 delta.S.delta, is at most max_norm.
    optimiser = optax.chain(
        svx.natural_gradient(damping=1e-4, method="dense", mesh=mesh),
        optax.scale(2.0),
        svx.clip_by_fisher_norm(max_norm, learning_rate, mesh=mesh),
        optax.scale_by_learning_rate(learning_rate),
    )
    # --8<-- [end:sr]

    @jax.jit
    def step(state: State, key: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        walkers = sampler.step(state.params, state.walkers, key)  # recomputes log|psi| for the new params
        e, j, e_mean, e2_mean = measure_(state.params, walkers.positions)
        updates, opt = optimiser.update(state.params, state.opt, state.params, jacobian=j, local_energies=e)
        params = optax.apply_updates(state.params, updates)
        params = params.replace(beta=jnp.maximum(params.beta, 0.05))  # no poles in the Jastrow
        variance = jnp.maximum(e2_mean - e_mean**2, 0.0)  # not below 0 by round-off
        stats = {"energy": e_mean, "error": jnp.sqrt(variance / e.n_valid), "variance": variance,
                 "acceptance": walkers.acceptance}  # fmt: skip
        return State(params, opt, walkers), stats

    return sampler, optimiser, step


# --8<-- [end:step]


# ---------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------


# --8<-- [start:run]
def run(config: Config, mesh: Mesh | None = None, *, print_every: int = 0, checkpoint: str | None = None,
        checkpoint_every: int = 100) -> dict[str, Any]:  # fmt: skip
    """Optimise the trial function by SR (``sv.driver.run``), then estimate its energy (``sv.driver.expect``).

    Keys: the walkers start from ``fold_in(key(seed), 0)``; optimisation step ``t`` is
    ``fold_in(fold_in(key(seed), 1), t)`` (``sv.driver.run``'s), in which walker ``i`` moves
    with ``fold_in(., i)`` (``WalkerKey``'s), whatever the device count. ``print_every``: a
    progress line every so many steps (a progress bar shows on a terminal anyway).

    Returns:
        A summary dict: ``energy``, ``error``, ``tau_corr``, ``R_hat``, ``variance`` (of the
        evaluation), ``acceptance``, ``parameters``, ``devices``, ``walkers``, ``seconds``, and
        the optimisation's ``energies``, one per step.
    """
    start = time.perf_counter()
    mesh = sv.create_mesh() if mesh is None else mesh
    root = jax.random.key(config.seed)
    policy = sv.precision_policy(config.dtype, mesh=mesh)  # float64, or float32 on a TPU
    with policy.context(), sv.use_mesh(mesh):
        # A WalkerSet: `walkers` real walkers, padded to the device count; every kernel reads the count.
        key = jax.random.fold_in(root, 0)
        positions = sv.initialize_walkers_sharded(init_walker, config.walkers, key=key)
        params = sv.replicate(Params(alpha=jnp.asarray(1.6875), beta=jnp.asarray(1.0)))
        sv.distributed.check_consistent(params)  # every process starts from the same parameters
        sampler, optimiser, step = make_step(mesh, config.batch_size, config.sweeps, config.learning_rate,
                                             config.max_norm)  # fmt: skip
        walkers = sampler.init(params, positions, config.step_size)
        state = State(params, jax.jit(optimiser.init)(params), walkers)
        lines = sv.driver.PrintLog(print_every) if print_every else None
        result = sv.driver.run(step, state, config.steps, key=jax.random.fold_in(root, 1), out=lines,
                               checkpoint=checkpoint, checkpoint_every=checkpoint_every)  # fmt: skip
        params = result.state.params
        # Over walkers and steps: the error bar accounts for the autocorrelation along each walker's chain.
        eval_steps = max(config.steps // 2, 32) if config.eval_steps is None else config.eval_steps
        estimate = None
        if eval_steps:
            estimate = sv.driver.expect(sampler, local_energy, params, result.state.walkers, eval_steps,
                                        key=jax.random.fold_in(root, 2))  # fmt: skip
        alpha, beta = (float(v) for v in ravel_pytree(params)[0])
    # --8<-- [end:run]
    history = result.history
    return {
        "energy": float(estimate.mean) if estimate else float(history["energy"][-1]),
        "error": float(estimate.error_of_mean) if estimate else None,
        "tau_corr": float(estimate.tau_corr) if estimate else None,
        "R_hat": float(estimate.R_hat) if estimate else None,
        "variance": float(estimate.variance) if estimate else float(history["variance"][-1]),
        "acceptance": float(history["acceptance"][-10:].mean()),
        "parameters": {"alpha": alpha, "beta": beta},
        "devices": int(mesh.devices.size),
        "platform": str(mesh.devices.flat[0].platform),
        "processes": int(jax.process_count()),
        **dataclasses.asdict(config),
        "eval_steps": eval_steps,
        "dtype": policy.dtype.name,
        "seconds": time.perf_counter() - start,
        "energies": history["energy"].tolist(),
        "exact": EXACT,
        "hf": HARTREE_FOCK,
    }


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example from the command line; returns the summary.

    Example:
        >>> args, config = plumbing.parse_args(["--walkers", "1001", "--devices", "3"], Config, __doc__)
        >>> config.walkers, args.devices, config.steps
        (1001, 3, 200)
    """
    # --8<-- [start:main]
    args, config = plumbing.parse_args(argv, Config, __doc__)
    # `--devices` fake CPU devices without an accelerator (and XLA's CPU deadlock workaround), before JAX
    # starts its backend; under `python -m shardvmc.launch` it joins the other processes first.
    mesh = plumbing.start(args.devices)
    plumbing.announce(mesh, config.dtype)  # the header: devices and precision
    summary = run(config, mesh, print_every=args.print_every, checkpoint=args.checkpoint,
                  checkpoint_every=args.checkpoint_every)  # fmt: skip
    # --8<-- [end:main]
    if jax.process_index() == 0:  # only process 0 prints and writes
        s = summary
        print(
            f"{s['walkers']} walkers on {s['devices']} {s['platform']} devices, alpha = {s['parameters']['alpha']:.4f},"
            f" beta = {s['parameters']['beta']:.4f}, {s['seconds']:.1f} s"
        )
        if s["error"] is None:
            print(f"E = {s['energy']:.5f} Ha at the last step (no evaluation steps: no error bar; exact {EXACT})")
        else:
            print(f"E = {s['energy']:.5f} +- {s['error']:.5f} Ha (exact {EXACT}), autocorrelation {s['tau_corr']:.1f} "
                  f"steps, R_hat {s['R_hat']:.3f}")  # fmt: skip
    plumbing.finish(args, summary, "He")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
