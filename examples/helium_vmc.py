"""Variational Monte Carlo of the helium atom on every device, written for one walker.

The trial function is the Slater-Jastrow (Pade-Jastrow) form

    psi(r1, r2) = exp(-alpha (r1 + r2)) * exp(r12 / (2 (1 + beta r12)))

with two parameters, optimised by stochastic reconfiguration (SR). Every piece of
per-walker physics (the Metropolis step, the local energy, the log-derivatives) is
written for ONE walker and made walker-parallel with ``sv.walker_parallel``; the
statistics come out of the kernels as ``Mean`` outputs and the SR update from
``sv.natural_gradient`` (dense SR on ``sv.jtj`` / ``sv.jtv``), so per-walker data never
leaves its device.

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
import folx
import jax
import jax.numpy as jnp
import numpy as np
import plumbing
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

import shardvmc as sv

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


@chex.dataclass
class Walker:
    """One walker: both electrons' positions and log|psi| there (for the current parameters)."""

    r: jax.Array  # (2, 3)
    log_psi: jax.Array  # ()


def log_psi(params: Params, r: jax.Array) -> jax.Array:
    """log|psi| of one configuration ``r`` of shape (2, 3)."""
    r1 = jnp.linalg.norm(r[0])
    r2 = jnp.linalg.norm(r[1])
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -params.alpha * (r1 + r2) + r12 / (2.0 * (1.0 + params.beta * r12))


def local_energy(params: Params, r: jax.Array) -> jax.Array:
    """E_loc = (H psi) / psi at ``r``, the kinetic part from ``folx.forward_laplacian``."""
    out = folx.forward_laplacian(lambda x: log_psi(params, x.reshape(2, 3)))(r.reshape(6))
    grad = out.jacobian.dense_array.reshape(-1)
    kinetic = -0.5 * (out.laplacian + jnp.sum(grad**2))
    r1 = jnp.linalg.norm(r[0])
    r2 = jnp.linalg.norm(r[1])
    r12 = jnp.linalg.norm(r[0] - r[1])
    potential = -2.0 / r1 - 2.0 / r2 + 1.0 / r12
    return kinetic + potential


def init_walker(key: jax.Array) -> Walker:
    """A walker at random positions around the nucleus (log_psi filled in later)."""
    return Walker(r=jax.random.normal(key, (2, 3)), log_psi=jnp.zeros(()))


# --8<-- [end:model]


# --8<-- [start:kernels]
@sv.walker_parallel
def metropolis_step(
    params: sv.Replicated[Params],
    walker: sv.PerWalker[Walker],
    key: sv.WalkerKey,
    step_size: sv.Static[float],
) -> tuple[sv.PerWalker[Walker], sv.Mean[jax.Array]]:
    """One Metropolis move of ONE walker; returns the new walker and the acceptance (averaged)."""
    k_move, k_accept = jax.random.split(key)
    proposal = walker.r + step_size * jax.random.normal(k_move, walker.r.shape)
    new_log_psi = log_psi(params, proposal)
    log_ratio = 2.0 * (new_log_psi - walker.log_psi)
    accept = jnp.log(jax.random.uniform(k_accept)) < log_ratio
    new = Walker(
        r=jnp.where(accept, proposal, walker.r),
        log_psi=jnp.where(accept, new_log_psi, walker.log_psi),
    )
    return new, accept.astype(walker.r.dtype)


@sv.walker_parallel
def refresh(params: sv.Replicated[Params], walker: sv.PerWalker[Walker]) -> sv.PerWalker[Walker]:
    """Recompute the cached log|psi| of one walker for new parameters."""
    return Walker(r=walker.r, log_psi=log_psi(params, walker.r))


@sv.walker_parallel
def measure(
    params: sv.Replicated[Params], walker: sv.PerWalker[Walker]
) -> tuple[
    sv.PerWalker[jax.Array],
    sv.PerWalker[jax.Array],
    sv.Mean[jax.Array],
    sv.Mean[jax.Array],
    sv.Mean[jax.Array],
]:
    """Local energy and log-derivatives of ONE walker.

    Returns the per-walker energy ``e`` and log-derivative row ``j`` (both stay sharded,
    for ``sv.natural_gradient``), and the means of ``e``, ``e**2`` and ``j``.
    """
    e = local_energy(params, walker.r)
    j = ravel_pytree(jax.grad(log_psi)(params, walker.r))[0]
    return e, j, e, e**2, j


# --8<-- [end:kernels]


# --8<-- [start:make_kernels]
class Kernels(NamedTuple):
    """The walker-parallel kernels of one run."""

    metropolis: sv.WalkerParallel
    refresh: sv.WalkerParallel
    measure: sv.WalkerParallel


def make_kernels(batch_size: int | None = None, mesh: Mesh | None = None) -> Kernels:
    """The three kernels with the run's options: the same per-walker functions.

    ``batch_size`` bounds the memory of each device; ``mesh=None`` runs on the
    ``sv.use_mesh`` mesh, else on all devices.
    """
    kernels = (metropolis_step, refresh, measure)
    return Kernels(*(k.with_options(mesh=mesh, batch_size=batch_size) for k in kernels))


# --8<-- [end:make_kernels]


# ---------------------------------------------------------------------------
# One step of the optimisation.
# ---------------------------------------------------------------------------


# --8<-- [start:step]
@functools.cache
def make_step(
    mesh: Mesh, batch_size: int | None, sweeps: int, step_size: float, learning_rate: float, max_norm: float
) -> Callable[..., Any]:
    """One jitted VMC step: ``sweeps`` Metropolis moves, a measurement, and an SR update.

    ``step(params, walkers, key, update, energies) -> (params, walkers, energies, [energy,
    variance, acceptance])``: with ``update`` the parameters change, else they stay and
    the walkers' local energies are added to ``energies`` (a ``sv.StatsAccumulator``).
    ``walkers`` is a ``sv.WalkerSet``: the kernels and ``sv.natural_gradient`` read its
    count, so padding never enters a statistic. Cached, so runs with the same settings
    (another seed, say) reuse the compiled step.
    """
    kernels = make_kernels(batch_size, mesh)

    def sample(params: Params, walkers: sv.WalkerSet, key: jax.Array) -> tuple[sv.WalkerSet, jax.Array]:
        def sweep(i: jax.Array, carry: tuple[sv.WalkerSet, jax.Array]) -> tuple[sv.WalkerSet, jax.Array]:
            ws, acc = carry
            ws, a = kernels.metropolis(params, ws, jax.random.fold_in(key, i), step_size)
            return ws, acc + a / sweeps

        return jax.lax.fori_loop(0, sweeps, sweep, (walkers, jnp.zeros(())))

    @jax.jit
    def step(params: Params, walkers: sv.WalkerSet, key: jax.Array, update: jax.Array, energies: Any) -> Any:
        walkers, acceptance = sample(params, walkers, key)
        e, j, e_mean, e2_mean, j_mean = kernels.measure(params, walkers)
        # --8<-- [start:sr]
        # SR: delta = (S + damping)^-1 g with S = <j j^T> - <j><j>^T and the energy gradient
        # g = 2 (<j e> - <j><e>). With P = 2 parameters the dense P x P solve is the one to use;
        # its S comes from sv.jtj (one all-reduce), so j is never gathered.
        natural, _ = sv.natural_gradient(j, e, damping=1e-4, method="dense", mesh=mesh)
        delta = 2.0 * natural
        # Trust region: the step's length in the SR metric, lr^2 delta.S.delta, is at most max_norm
        # (delta.S.delta is the variance of j.delta over the walkers).
        delta_s_delta = sv.walker_mean(jax.tree.map(lambda x: (x @ delta) ** 2, j)) - (j_mean @ delta) ** 2
        lr = jnp.minimum(learning_rate, jnp.sqrt(max_norm / delta_s_delta))
        # --8<-- [end:sr]
        flat, unravel = ravel_pytree(params)
        params = unravel(flat - jnp.where(update, lr, 0.0) * delta)
        params = params.replace(beta=jnp.maximum(params.beta, 0.05))  # keep the Jastrow free of poles
        walkers = kernels.refresh(params, walkers)
        energies = jax.lax.cond(update, lambda acc: acc, lambda acc: acc.update(e), energies)
        return params, walkers, energies, jnp.stack([e_mean, e2_mean - e_mean**2, acceptance])

    return step


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
            the key ``fold_in(fold_in(fold_in(key(seed), t + 1), m), i)``, whatever the
            device count (the last ``fold_in`` is ``WalkerKey``'s).
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
        walker_set = sv.initialize_walkers_sharded(init_walker, walkers, key=jax.random.fold_in(root, 0))
        params = sv.replicate(Params(alpha=jnp.asarray(1.6875), beta=jnp.asarray(1.0)))
        sv.distributed.check_consistent(params)  # every process starts from the same parameters
        walker_set = make_kernels(batch_size, mesh).refresh(params, walker_set)
        step = make_step(mesh, batch_size, sweeps, step_size, learning_rate, max_norm)

        # Every walker's local energy in the evaluation steps, accumulated on its device.
        energies = sv.StatsAccumulator.create(sv.WalkerSet(walker_set.data.log_psi, walker_set.n_valid))
        history = []
        for t in range(total):
            optimising = t < steps
            params, walker_set, energies, stats = step(params, walker_set, jax.random.fold_in(root, t + 1),
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
    plumbing.write_json(args.json, summary)
    if args.plot and lead:
        plumbing.plot(args.plot, summary["energies"], exact=EXACT, hf=HARTREE_FOCK, title="He", phases=args.steps)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
