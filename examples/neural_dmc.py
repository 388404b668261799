"""Fixed-node diffusion Monte Carlo from the neural template's trained network: the energy below VMC's.

Trains the FermiNet-style network as ``neural_vmc.py`` does (or takes the trained state from its
checkpoint), then runs fixed-node DMC (``sv.dmc``; the network's sign gives the nodes) from the trained
walkers at a few time steps, each a run of ``sv.driver.run`` on every device, and extrapolates the energy
to zero time step: what is left above the exact energy is the network's fixed-node error. See
``docs/dmc.md``.

    python examples/neural_dmc.py --system Li                  # 8 fake CPU devices
    python examples/neural_dmc.py --quick --devices 1          # a smoke test: seconds
    python examples/neural_dmc.py --checkpoint run             # DIR/vmc: the training; DIR/dmc-<tau>: each DMC run
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import neural_vmc as vmc
import plumbing
from network import SYSTEMS, log_psi, sign

import shardvmc as sv


@dataclasses.dataclass(frozen=True)
class Config(vmc.Config):
    """The training's settings (``neural_vmc.Config``), then the DMC runs'."""

    time_steps: str = "0.02,0.01,0.005"  # hartree^-1, comma-separated: one DMC run each
    projection_time: float = 20.0  # each run's imaginary time (hartree^-1): time / tau steps
    equilibration_time: float = 2.0  # left out at each run's start (hartree^-1)


QUICK = {**vmc.QUICK, "time_steps": "0.02,0.01", "projection_time": 0.4, "equilibration_time": 0.1}


# --8<-- [start:dmc]
def dmc_run(config: Config, mesh: Any, trained: vmc.State, tau: float,
            checkpoint: str | None) -> tuple[sv.Stats, list[float]]:  # fmt: skip
    """A fixed-node DMC run at time step ``tau`` from the trained state: its energy, each step's estimate."""
    system = SYSTEMS[config.system]
    dmc = sv.dmc.DMC(
        functools.partial(log_psi, system=system),
        functools.partial(sv.hamiltonian.coulomb, charges=system.charges, coords=system.coords),
        time_step=tau,
        sign=functools.partial(sign, system=system),  # the fixed-node constraint: a move may not change it
    )
    settings = {**dataclasses.asdict(config), "time_step": tau}  # a checkpoint of other settings is refused
    key = jax.random.fold_in(jax.random.key(config.seed), 3)
    with sv.precision_policy(config.dtype, mesh=mesh).context(), sv.use_mesh(mesh):
        result = sv.driver.run(dmc.step, dmc.init(trained), round(config.projection_time / tau), key=key,
                               metadata=settings, checkpoint=checkpoint)  # fmt: skip
    energy = sv.dmc.energy(result, discard=round(config.equilibration_time / tau))
    return energy, list(result.history["energy"])


# --8<-- [end:dmc]


def run(config: Config, mesh: Any, checkpoint: str | None = None) -> dict[str, Any]:
    """Train (or restore) the network, evaluate it, then DMC at every time step and the extrapolation: a summary."""
    start, system = time.perf_counter(), SYSTEMS[config.system]
    training = vmc.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(vmc.Config)})
    trained = vmc.train(training, mesh, checkpoint=checkpoint and f"{checkpoint}/vmc").state
    variational = vmc.evaluate(training, mesh, trained)
    taus = [float(t) for t in config.time_steps.split(",")]
    runs = []
    for tau in taus:
        t0 = time.perf_counter()
        e, energies = dmc_run(config, mesh, trained, tau, checkpoint and f"{checkpoint}/dmc-{tau}")
        runs.append({"time_step": tau, "steps": len(energies), "energy": float(e.mean),
                     "error": float(e.error_of_mean), "seconds": time.perf_counter() - t0})  # fmt: skip
    e0, error = sv.dmc.extrapolate(taus, [(r["energy"], r["error"]) for r in runs]) if len(taus) > 1 else (None, None)
    fixed_node = None if e0 is None else e0 - system.exact_energy  # the network's nodes' error (tau -> 0)
    return {
        "system": config.system, "walkers": config.walkers, "devices": int(mesh.devices.size),
        "platform": str(mesh.devices.flat[0].platform), "vmc_energy": float(variational.mean),
        "vmc_error": float(variational.error_of_mean), "dmc": runs, "energy": e0, "error": error,
        "exact": system.exact_energy, "hf": system.hf_energy, "fixed_node_error": fixed_node,
        "seconds": time.perf_counter() - start, "config": dataclasses.asdict(config),
        "energies": energies,  # the last (smallest) time step's, per step (--plot)
    }  # fmt: skip


def report(s: dict[str, Any]) -> list[str]:
    """The energies: VMC's, DMC's at each time step, the extrapolation and the fixed-node error."""
    lines = [f"{s['system']}: {s['walkers']} walkers on {s['devices']} {s['platform']} devices, {s['seconds']:.0f} s",
             f"VMC  E = {s['vmc_energy']:.5f} +- {s['vmc_error']:.5f} Ha"]  # fmt: skip
    lines += [f"DMC  tau = {r['time_step']}: E = {r['energy']:.5f} +- {r['error']:.5f} Ha ({r['steps']} steps, "
              f"{r['seconds']:.0f} s)" for r in s["dmc"]]  # fmt: skip
    if s["energy"] is not None:
        lines.append(f"DMC  tau -> 0: E = {s['energy']:.5f} +- {s['error']:.5f} Ha (exact {s['exact']}; fixed-node "
                     f"error {1e3 * s['fixed_node_error']:.2f} +- {1e3 * s['error']:.2f} mHa)")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example from the command line."""
    choices = {"system": sorted(SYSTEMS), "optimiser": vmc.OPTIMISERS}
    args, config = plumbing.parse_args(argv, Config, __doc__, quick=QUICK, choices=choices, sizes=vmc.SIZES)
    mesh = plumbing.start(args.devices)
    plumbing.announce(mesh, config.dtype)  # the header: devices and precision
    summary = run(config, mesh, checkpoint=args.checkpoint)
    if jax.process_index() == 0:  # only process 0 prints and writes
        print("\n".join(report(summary)))
    plumbing.finish(args, summary, f"{config.system}, DMC")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
