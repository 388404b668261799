"""Variational Monte Carlo of the helium atom on every device, written for one walker.

The trial function is the Slater-Jastrow (Pade-Jastrow) form

    psi(r1, r2) = exp(-alpha (r1 + r2)) * exp(r12 / (2 (1 + beta r12)))

with two parameters, optimised by stochastic reconfiguration (SR). The wavefunction and
the potential are written for ONE walker; ``sv.mcmc.Metropolis`` samples ``|psi|^2`` and
``sv.hamiltonian.local_energy`` gives the local energy (folx's forward Laplacian), both
walker-parallel kernels; the measurement is one made with ``sv.walker_parallel``. The
statistics come out of the kernels as ``Mean`` outputs and the SR update from the optax
chain of ``shardvmc.optax`` (dense SR on ``sv.jtj`` / ``sv.jtv``), so per-walker data
never leaves its device.

Run it (8 fake CPU devices when there is no accelerator):

    python examples/helium_vmc.py
    python examples/helium_vmc.py --walkers 1000 --steps 100 --devices 4 --json out.json

Randomness depends only on the seed, the step and the global walker index, and the
statistics are reductions over the same walkers whatever the device count, so the
same seed gives the same energies on 1 and on 8 devices (to float64 round-off).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import plumbing
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

import shardvmc as sv
import shardvmc.optax as svx

EXACT = -2.903724
"""The exact non-relativistic ground-state energy of helium, in Hartree."""
HARTREE_FOCK = -2.8617


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


# --8<-- [start:make_kernels]
class Kernels(NamedTuple):
    """The walker-parallel pieces of one run."""

    sampler: sv.mcmc.Metropolis
    measure: sv.WalkerParallel


def make_kernels(batch_size: int | None = None, mesh: Mesh | None = None, sweeps: int = 10) -> Kernels:
    """The Metropolis sampler (``sweeps`` moves per call, a fixed width) and the measurement.

    ``batch_size`` bounds the memory of each device; ``mesh=None`` runs on the
    ``sv.use_mesh`` mesh, else on all devices.
    """
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=sweeps, adapt_rate=0.0, mesh=mesh, batch_size=batch_size)
    return Kernels(sampler, measure.with_options(mesh=mesh, batch_size=batch_size))


# --8<-- [end:make_kernels]


# ---------------------------------------------------------------------------
# One step of the optimisation.
# ---------------------------------------------------------------------------


# --8<-- [start:step]
@functools.cache
def make_step(
    mesh: Mesh, batch_size: int | None, sweeps: int, learning_rate: float, max_norm: float
) -> tuple[Kernels, optax.GradientTransformationExtraArgs, Callable[..., Any]]:
    """The kernels, the optimiser, and one jitted VMC step: Metropolis moves, a measurement, an SR update.

    ``step(params, opt, walkers, key, update, energies) -> (params, opt, walkers, energies,
    [energy, variance, acceptance])``: with ``update`` the parameters change, else they stay
    and the walkers' local energies are added to ``energies`` (a ``sv.StatsAccumulator``).
    ``walkers`` is the sampler's state, whose ``sv.WalkerSet`` the kernels and the natural
    gradient read the count of, so padding never enters a statistic. Cached, so runs with
    the same settings (another seed, say) reuse the compiled step.
    """
    kernels = make_kernels(batch_size, mesh, sweeps)
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
    def step(params: Params, opt: Any, walkers: Any, key: jax.Array, update: jax.Array, energies: Any) -> Any:
        walkers = kernels.sampler.step(params, walkers, key)  # recomputes log|psi| for the new params
        e, j, e_mean, e2_mean = kernels.measure(params, walkers.positions)
        updates, new_opt = optimiser.update(params, opt, params, jacobian=j, local_energies=e)
        new_params = optax.apply_updates(params, updates)
        new_params = new_params.replace(beta=jnp.maximum(new_params.beta, 0.05))  # no poles in the Jastrow
        keep = lambda new, old: jnp.where(update, new, old)  # noqa: E731
        params, opt = jax.tree.map(keep, (new_params, new_opt), (params, opt))
        energies = jax.lax.cond(update, lambda acc: acc, lambda acc: acc.update(e), energies)
        return params, opt, walkers, energies, jnp.stack([e_mean, e2_mean - e_mean**2, walkers.acceptance])

    return kernels, optimiser, step


# --8<-- [end:step]


# ---------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------


def run(
    walkers: int = 16000,
    steps: int = 200,
    seed: int = 0,
    batch_size: int | None = None,
    *,
    mesh: Mesh | None = None,
    eval_steps: int | None = None,
    sweeps: int = 10,
    step_size: float = 0.5,
    learning_rate: float = 0.2,
    max_norm: float = 1e-3,
    print_every: int | None = None,
    printer: Callable[[str], Any] = print,
    x64: bool = True,
) -> dict[str, Any]:
    """Optimise the helium trial function by SR, then estimate its energy.

    Args:
        walkers: number of walkers (any count; shardvmc pads it to the device count).
        steps: optimisation steps (each: ``sweeps`` Metropolis moves, a measurement,
            an SR update).
        seed: seeds every random number: move ``m`` of step ``t`` gives walker ``i``
            the key ``fold_in(fold_in(fold_in(key(seed), t + 1), i), m)``, whatever the
            device count (``fold_in(., i)`` is ``WalkerKey``'s).
        batch_size: walkers processed at a time per device (``None``: all at once).
        mesh: the devices to run on (default: every device).
        eval_steps: steps with fixed parameters whose local energies give the final
            energy and its error bar (default ``max(steps // 2, 32)``).
        sweeps: Metropolis moves between measurements.
        step_size: Metropolis proposal width (bohr).
        learning_rate: SR step.
        max_norm: largest step length in the SR metric (a trust region).
        print_every: progress line period in steps (default: about 10 lines); 0: none.
        printer: where progress lines go (``print``; pass a no-op to silence).
        x64: compute in float64 (the default). Round-off depends on the device
            count (vectorisation width, summation order of the reductions); in
            float32 it flips a Metropolis decision now and then, the optimisation's
            parameter feedback amplifies that, and 1 and 8 devices then agree only
            statistically (~1e-2 Ha). In float64 they agree to ~1e-12.

    Returns:
        A summary dict: ``energy``, ``error``, ``tau_corr``, ``R_hat``, ``variance``,
        ``acceptance``, ``parameters``, ``devices``, ``walkers``, ``seconds``, and the
        per-step ``energies`` of the optimisation and of the evaluation.
    """
    start = time.perf_counter()
    mesh = sv.create_mesh() if mesh is None else mesh
    eval_steps = max(steps // 2, 32) if eval_steps is None else eval_steps
    total = steps + eval_steps
    print_every = max(total // 10, 1) if print_every is None else print_every
    root = jax.random.key(seed)

    with jax.enable_x64(x64), sv.use_mesh(mesh):
        # A WalkerSet: `walkers` real walkers, padded to the device count; every kernel reads the count.
        positions = sv.initialize_walkers_sharded(init_walker, walkers, key=jax.random.fold_in(root, 0))
        params = sv.replicate(Params(alpha=jnp.asarray(1.6875), beta=jnp.asarray(1.0)))
        sv.distributed.check_consistent(params)  # every process starts from the same parameters
        kernels, optimiser, step = make_step(mesh, batch_size, sweeps, learning_rate, max_norm)
        walker_set = kernels.sampler.init(params, positions, width=step_size)
        opt = jax.jit(optimiser.init)(params)

        # Every walker's local energy in the evaluation steps, accumulated on its device.
        energies = sv.StatsAccumulator.create(sv.WalkerSet(walker_set.walkers.data.log_psi, positions.n_valid))
        history = []
        for t in range(total):
            optimising = t < steps
            params, opt, walker_set, energies, stats = step(params, opt, walker_set, jax.random.fold_in(root, t + 1),
                                                            jnp.asarray(optimising), energies)  # fmt: skip
            history.append(stats)
            if print_every and (t == 0 or (t + 1) % print_every == 0 or t + 1 == total):
                energy, variance, acceptance = (float(v) for v in stats)
                printer(
                    f"{'opt ' if optimising else 'eval'} step {t + 1:4d}  E = {energy:+.5f}  "
                    f"var = {variance:.4f}  acc = {acceptance:.3f}"
                )

        history = np.asarray(jax.device_get(jnp.stack(history)), dtype=np.float64)
        final = history[steps:] if eval_steps else history[-1:]
        # Over walkers and steps: the error bar accounts for the autocorrelation along each walker's chain.
        estimate = energies.statistics() if eval_steps else None
        alpha, beta = (float(v) for v in ravel_pytree(params)[0])
    return {
        "energy": float(estimate.mean) if estimate else float(final[-1, 0]),
        "error": float(estimate.error_of_mean) if estimate else None,
        "tau_corr": float(estimate.tau_corr) if estimate else None,
        "R_hat": float(estimate.R_hat) if estimate else None,
        "variance": float(final[:, 1].mean()),
        "acceptance": float(final[:, 2].mean()),
        "parameters": {"alpha": alpha, "beta": beta},
        "devices": int(mesh.devices.size),
        "platform": str(mesh.devices.flat[0].platform),
        "processes": int(jax.process_count()),
        "walkers": walkers,
        "steps": steps,
        "eval_steps": eval_steps,
        "seed": seed,
        "batch_size": batch_size,
        "dtype": "float64" if x64 else "float32",
        "seconds": time.perf_counter() - start,
        "energies": history[:, 0].tolist(),
        "exact": EXACT,
        "hf": HARTREE_FOCK,
    }


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of the example.

    Example:
        >>> args = parse_args(["--walkers", "1001", "--devices", "3"])
        >>> args.walkers, args.devices, args.steps
        (1001, 3, 200)
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--walkers", type=int, default=16000, help="number of walkers (any count)")
    p.add_argument("--steps", type=int, default=200, help="optimisation steps")
    p.add_argument("--eval-steps", type=int, default=None, help="evaluation steps (default: max(steps/2, 32))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="walkers per device processed at a time")
    p.add_argument("--float32", action="store_true", help="compute in float32 (device counts then agree statistically)")
    plumbing.add_arguments(p, checkpoints=False)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example from the command line; returns the summary."""
    # --8<-- [start:main]
    args = parse_args(argv)
    # `--devices` fake CPU devices without an accelerator (and XLA's CPU deadlock workaround), before JAX
    # starts its backend; under `python -m shardvmc.launch` it joins the other processes first.
    mesh = plumbing.start(args.devices)
    lead = plumbing.is_lead()  # only process 0 prints and writes
    # --8<-- [end:main]
    printer = print if lead else (lambda *_: None)
    summary = run(args.walkers, args.steps, args.seed, args.batch_size, mesh=mesh, eval_steps=args.eval_steps,
                  print_every=args.print_every, printer=printer, x64=not args.float32)  # fmt: skip
    if lead:
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
    plumbing.finish(args, summary, title="He", phases=args.steps)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
