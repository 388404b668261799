"""Diffusion Monte Carlo: exact energies extrapolated in the time step, a DMC step against a VMC step, its traffic.

Three parts, each printed as a markdown table:

- **energies**: fixed-node DMC (``sv.dmc.DMC``, float64) of three nodeless ground states, helium,
  Hooke's atom (two electrons in a trap of frequency 1/2) and H2 at R = 1.4 bohr, with the trial
  functions of ``tests/test_dmc.py`` (the exact cusps and a Pade Jastrow factor; bonding 1s orbitals
  for H2), at two time steps, each run's energy from ``sv.dmc.energy`` (the first 20 % of the steps
  discarded) and the two extrapolated to ``tau = 0`` with ``sv.dmc.extrapolate``, against the exact
  energies (-2.903724, 2, -1.174476 Ha).
- **timing**: one DMC step against one ``sv.driver.VMC`` step with the same local energy
  (``sv.hamiltonian.local_energy``, folx) and the same walkers (helium), the VMC step's sampler
  ``sv.mcmc.Metropolis(n_steps=1)`` (one move per step, as DMC's one drift-diffusion move) and the
  default (10 moves); ``--timing-system li``: the neural template's Li network
  (``examples/network.py``) with its sign (the nodes) and ``tau = 0.01``. Interleaved blocks of
  ``--block`` steps (the variants in turn, the order reversed every other round, after two warm-up
  blocks each); the figure is the median over ``--rounds`` of the per-round ratio DMC / VMC, with its
  quartiles.
- **traffic**: what a DMC step communicates, from the compiled step on a mesh of 8 devices (the
  collectives by kind, their messages and bytes per device, every step and in the all-gather fallback
  only), and how often the fallback ran in ``--traffic-steps`` steps of helium on that mesh (the
  ``fallback`` statistic).
- **bias** (only with ``--only bias``): the time-step and population biases of helium, drawn. At the
  time steps ``--bias-time-steps`` with ``--bias-walkers`` walkers, runs of ``--bias-hartree``
  hartree^-1 of imaginary time (``steps = hartree / tau``): E against tau, with the weighted linear fit
  of ``sv.dmc.extrapolate`` and its intercept; at ``tau = --bias-population-tau`` with each population
  of ``--bias-populations``, runs of ``--bias-population-hartree`` hartree^-1: E against 1 / population,
  with UNR's correction of the population control (``sv.dmc.energy``'s default) and without it
  (``population_steps=0``). The first 20 % of each run is discarded. ``--plot`` saves the two panels.

Usage (from the repository root)::

    python benchmarks/dmc.py                       # every part but bias (minutes on 2 CPU cores)
    python benchmarks/dmc.py --only timing --devices 8 --timing-walkers 4096
    python benchmarks/dmc.py --only timing --timing-system li --timing-walkers 512   # the neural network's
    python benchmarks/dmc.py --only bias --plot docs/img/dmc-bias.png   # about 5 minutes on 2 cores
    python benchmarks/dmc.py --quick               # a smoke run of seconds: tiny sizes
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

from comm import step_collectives  # this folder is on sys.path when run as a script
from harness import count_collectives, examples_on_path, interleaved, ratio
from harness import fmt_error as fmt

from shardvmc.testing import set_cpu_devices  # imports jax; starts no backend

EXACT = {"helium": -2.903724377, "hooke": 2.0, "H2": -1.174475714}
COMM_DEVICES = 8  # the mesh the traffic part compiles the step for
DEFAULTS = {"walkers": 2000, "steps": 3000, "timing_walkers": 4096, "rounds": 15, "block": 5, "traffic_steps": 200}
QUICK = {"walkers": 16, "steps": 12, "timing_walkers": 16, "rounds": 2, "block": 1, "traffic_steps": 3}
PARTS = ("energies", "timing", "traffic")
OPTIONAL_PARTS = ("bias",)  # only when named in --only
BIAS = {"time_steps": "0.1,0.05,0.02", "walkers": 2000, "hartree": 300.0, "populations": "4,8,16",
        "population_tau": 0.1, "population_hartree": 3000.0}  # fmt: skip
BIAS_QUICK = {"time_steps": "0.1,0.05", "walkers": 16, "hartree": 1.0, "populations": "8,16", "population_tau": 0.1,
              "population_hartree": 1.0}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (a smoke run)")
    parser.add_argument("--devices", type=int, default=1, help="devices of the energy and timing runs (default 1)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS + OPTIONAL_PARTS}")
    types = {"time_steps": str, "walkers": int, "hartree": float, "populations": str, "population_tau": float,
             "population_hartree": float}  # fmt: skip
    for name, default in BIAS.items():
        flag = "--bias-" + name.replace("_", "-")
        parser.add_argument(flag, type=types[name], help=f"bias part (default {default}; --quick: {BIAS_QUICK[name]})")
    parser.add_argument("--plot", default="", help="bias part: save the plot to this PNG file")
    parser.add_argument("--time-steps", default="0.1,0.05", help="the time steps of the energy runs")
    parser.add_argument("--systems", default=None, help=f"of {tuple(EXACT)} (default all; --quick: helium)")
    for name, default in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, help=f"(default {default}; --quick: {QUICK[name]})")
    parser.add_argument("--timing-system", default="helium", choices=("helium", "li"),
                        help="timing part: helium's Slater-Jastrow function, or Li's network (examples/)")  # fmt: skip
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    args.systems = (args.systems or ("helium" if args.quick else ",".join(EXACT))).split(",")
    if set(args.systems) - set(EXACT):
        parser.error(f"unknown systems {sorted(set(args.systems) - set(EXACT))}; choose from {tuple(EXACT)}")
    for name, default in BIAS.items():
        if getattr(args, "bias_" + name) is None:
            setattr(args, "bias_" + name, BIAS_QUICK[name] if args.quick else default)
    args.bias_time_steps = [float(t) for t in str(args.bias_time_steps).split(",")]
    args.bias_populations = [int(n) for n in str(args.bias_populations).split(",")]
    args.only = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = set(args.only) - set(PARTS + OPTIONAL_PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS + OPTIONAL_PARTS}")
    args.time_steps = [float(t) for t in args.time_steps.split(",")]
    return args


# --------------------------------------------------------------------------------------------
# The systems (as tests/test_dmc.py's): log|psi| of one walker, the potential, the parameter, the start


def systems() -> dict[str, dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    def jastrow(b: jax.Array, r: jax.Array) -> jax.Array:
        r12 = jnp.linalg.norm(r[0] - r[1])
        return r12 / (2.0 * (1.0 + b * r12))

    def helium(b: jax.Array, r: jax.Array) -> jax.Array:
        return -2.0 * jnp.sum(jnp.linalg.norm(r, axis=-1)) + jastrow(b, r)

    def hooke(b: jax.Array, r: jax.Array) -> jax.Array:
        return -jnp.sum(r**2) / 4.0 + jastrow(b, r)

    nuclei = jnp.array([[0.0, 0.0, -0.7], [0.0, 0.0, 0.7]])

    def h2(b: jax.Array, r: jax.Array) -> jax.Array:
        d = jnp.linalg.norm(r[:, None, :] - nuclei[None], axis=-1)  # (electron, nucleus)
        orbital = jax.nn.logsumexp(-d, axis=1)  # log(exp(-|r - A|) + exp(-|r - B|)): the bonding 1s orbital
        return jnp.sum(orbital) + jastrow(b, r)

    return {
        "helium": {
            "log_psi": helium,
            "potential": lambda r: sv.hamiltonian.coulomb(r, charges=[2.0], coords=[[0.0, 0.0, 0.0]]),
            "b": 0.3,
            "scale": 0.7,
        },
        "hooke": {
            "log_psi": hooke,
            "potential": lambda r: jnp.sum(r**2) / 8.0 + sv.hamiltonian.coulomb(r),
            "b": 0.5,
            "scale": 1.5,
        },
        "H2": {
            "log_psi": h2,
            "potential": lambda r: sv.hamiltonian.coulomb(r, charges=[1.0, 1.0], coords=nuclei),
            "b": 0.3,
            "scale": 1.0,
        },
    }


def walkers_of(system: dict[str, Any], n: int, mesh: Any, seed: int = 0) -> Any:
    import jax

    import shardvmc as sv

    scale = system["scale"]
    init = lambda k: scale * jax.random.normal(k, (2, 3))  # noqa: E731
    return sv.initialize_walkers_sharded(init, n, mesh, key=jax.random.key(seed))


# --------------------------------------------------------------------------------------------
# The parts


def energies(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    """Every system at every time step, and the extrapolation; with the runs' branching statistics."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import shardvmc as sv

    out: dict[str, Any] = {}
    for name, system in systems().items():
        if name not in args.systems:
            continue
        runs = {}
        for tau in args.time_steps:
            dmc = sv.dmc.DMC(system["log_psi"], system["potential"], time_step=tau, mesh=mesh)
            state = dmc.init(jnp.float64(system["b"]), walkers_of(system, args.walkers, mesh))
            start = time.perf_counter()
            result = sv.driver.run(dmc.step, state, args.steps, key=jax.random.key(1), progress=False)
            seconds = time.perf_counter() - start
            if result.status != "finished":
                raise RuntimeError(f"{name} at tau = {tau}: the run {result.status}: {result.reason}")
            e = sv.dmc.energy(result, discard=0.2)
            history = result.history
            runs[tau] = {
                "energy": float(e.mean),
                "error": float(e.error_of_mean),
                "tau_corr": float(e.tau_corr),
                "acceptance": float(np.mean(history["acceptance"])),
                "tau_eff": float(history["tau_eff"][-1]),
                "nonfinite": int(np.sum(history["nonfinite"])),
                "node_crossings": int(np.sum(history["node_crossings"])),
                "effective_walkers": float(np.mean(history["effective_walkers"])),
                "seconds": seconds,
            }
            print(f"  {name} tau={tau}: {e.mean:.5f} +- {e.error_of_mean:.5f} ({seconds:.0f} s)", flush=True)
        taus = list(runs)
        e0, err0 = sv.dmc.extrapolate(taus, [(runs[t]["energy"], runs[t]["error"]) for t in taus])
        out[name] = {"runs": {str(t): run for t, run in runs.items()}, "extrapolated": [e0, err0]}
    return out


def energies_table(data: dict[str, Any], args: argparse.Namespace) -> str:
    taus = args.time_steps
    head = " | ".join(f"tau = {t:g}" for t in taus)
    lines = [
        f"DMC energies (Ha), {args.walkers} walkers x {args.steps} steps per time step, float64, the first 20 % "
        f"discarded; error bars from sv.dmc.energy:\n",
        f"| system | {head} | extrapolated to tau = 0 | exact | (E_0 - exact) / error |",
        "|---|" + "---|" * len(taus) + "---|---|---|",
    ]
    for name, item in data.items():
        cells = [fmt(item["runs"][str(t)]["energy"], item["runs"][str(t)]["error"]) for t in taus]
        e0, err0 = item["extrapolated"]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {fmt(e0, err0)} | {EXACT[name]:.6f} | "
            f"{(e0 - EXACT[name]) / err0:+.1f} |"
        )
    return "\n".join(lines)


def timing(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    """Seconds per step of DMC and of VMC (1 and 10 Metropolis moves), interleaved; their ratios."""
    import jax
    import optax

    import shardvmc as sv

    log_psi, potential, sign, params, walkers = timing_workload(args.timing_system, args.timing_walkers, mesh)
    dmc = sv.dmc.DMC(log_psi, potential, time_step=0.05 if sign is None else 0.01, sign=sign, mesh=mesh)
    energy = sv.hamiltonian.local_energy(log_psi, potential)
    states: dict[str, Any] = {"DMC": dmc.init(params, walkers)}
    steps: dict[str, Any] = {"DMC": dmc.step}
    for label, sampler in (
        ("VMC, 1 move", sv.mcmc.Metropolis(log_psi, n_steps=1, mesh=mesh)),
        ("VMC, 10 moves (default)", None),
    ):
        vmc = sv.driver.VMC(log_psi, optax.sgd(1e-3), local_energy=energy, sampler=sampler, mesh=mesh)
        states[label] = vmc.init(params, walkers)
        steps[label] = vmc.step
    key = jax.random.key(2)

    def thunk(label: str) -> Any:
        def run() -> Any:
            state, stats = states[label], None
            for _ in range(args.block):
                state, stats = steps[label](state, key)
            states[label] = state
            return stats

        return run

    times = interleaved({label: thunk(label) for label in states}, args.rounds)
    per_step = {label: sorted(t)[len(t) // 2] / args.block for label, t in times.items()}
    ratios = {label: ratio(times, "DMC", label) for label in states if label != "DMC"}
    return {
        "walkers": args.timing_walkers,
        "devices": mesh.devices.size,
        "seconds_per_step": per_step,
        "ratios": {label: [r.median, r.q25, r.q75, r.reps] for label, r in ratios.items()},
    }


def timing_workload(name: str, n: int, mesh: Any) -> tuple[Any, ...]:
    """``(log_psi, potential, sign, params, walkers)`` of the timing part: helium's Slater-Jastrow function, or the
    neural template's network for Li (``examples/network.py``, its default sizes, initial parameters) with its sign.
    """
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    if name == "helium":
        system = systems()["helium"]
        return system["log_psi"], system["potential"], None, jnp.float64(system["b"]), walkers_of(system, n, mesh)
    examples_on_path()
    import network

    li = network.LI
    params = sv.replicate(network.init(jax.random.key(0), li, 32, 8, 2, 4, jnp.float64), mesh)
    walkers = sv.initialize_walkers_sharded(lambda k: network.init_walker(k, li, jnp.float64), n, mesh,
                                            key=jax.random.key(1))  # fmt: skip
    potential = functools.partial(sv.hamiltonian.coulomb, charges=li.charges, coords=li.coords)
    psi, sign = (functools.partial(f, system=li) for f in (network.log_psi, network.sign))
    return psi, potential, sign, params, walkers


def timing_table(data: dict[str, Any], args: argparse.Namespace) -> str:
    what = "helium" if args.timing_system == "helium" else "Li, the neural template's network with its sign"
    lines = [
        f"A DMC step against a VMC step with the same local energy and walkers ({what}, {data['walkers']} walkers, "
        f"float64, {data['devices']} device{'s' if data['devices'] > 1 else ''}; {args.rounds} interleaved rounds "
        f"of {args.block} steps each):\n",
        "| DMC step / ... | ratio, median [quartiles] | ms per step (median): DMC, the other |",
        "|---|---|---|",
    ]
    dmc_ms = data["seconds_per_step"]["DMC"] * 1e3
    for label, (median, q25, q75, _) in data["ratios"].items():
        other = data["seconds_per_step"][label] * 1e3
        lines.append(f"| {label} | {median:.3f} [{q25:.3f}, {q75:.3f}] | {dmc_ms:.3g}, {other:.3g} |")
    return "\n".join(lines)


def traffic(args: argparse.Namespace, devices: list[Any]) -> dict[str, Any]:
    """The collectives of the compiled DMC step on ``devices`` (``comm.step_collectives``), and a short run there."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import shardvmc as sv

    mesh = sv.create_mesh(devices)
    system = systems()["helium"]
    walkers = args.timing_walkers
    dmc = sv.dmc.DMC(system["log_psi"], system["potential"], time_step=0.05, mesh=mesh)
    state = dmc.init(jnp.float64(system["b"]), walkers_of(system, walkers, mesh))
    compiled = dmc._step.lower(state, jax.random.key(0), mesh=mesh).compile()
    rows = step_collectives(compiled.as_text())
    counts = count_collectives(compiled)
    step = lambda state, key: compiled(state, key)  # noqa: E731  (the program counted above)
    result = sv.driver.run(step, state, args.traffic_steps, key=jax.random.key(3), progress=False)
    history = result.history
    per_device = -(-walkers // len(devices))
    return {
        "walkers": walkers,
        "devices": len(devices),
        "per_device": per_device,
        "halo": min(32, per_device),
        "collectives": rows,
        "counts": counts,
        "steps": int(len(history["fallback"])),
        "fallback_steps": int(np.sum(history["fallback"])),
        "resampled_steps": int(np.sum(history["resampled"])),
        "effective_walkers": float(np.mean(history["effective_walkers"])),
    }


def traffic_table(data: dict[str, Any]) -> str:
    lines = [
        f"What a DMC step communicates (helium, {data['walkers']} walkers on {data['devices']} devices: "
        f"{data['per_device']} per device, a halo of {data['halo']}; from the compiled step; bytes: each "
        "collective's result on one device):\n",
        "| when | collective | messages | bytes per device |",
        "|---|---|---|---|",
    ]
    for where, kinds in data["collectives"].items():
        for kind, (n, nbytes) in sorted(kinds.items()):
            lines.append(f"| {where} | {kind} | {n} | {nbytes} |")
    lines.append(
        f"\nIn {data['steps']} steps of that run (tau = 0.05, from the trial function's walkers): the comb ran "
        f"{data['resampled_steps']} times, the fallback {data['fallback_steps']} times; the weights' mean "
        f"effective count {data['effective_walkers']:.1f} of {data['walkers']}."
    )
    return "\n".join(lines)


def runs_table(data: dict[str, Any]) -> str:
    lines = [
        "The energy runs (acceptance: the mean over the steps; tau_eff: at the end; tau_corr: of the steps' "
        "series, in steps):\n",
        "| system | tau | acceptance | tau_eff | tau_corr | mean effective walkers | nonfinite | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, item in data.items():
        for tau, run in item["runs"].items():
            lines.append(
                f"| {name} | {tau} | {run['acceptance']:.4f} | {run['tau_eff']:.4f} | {run['tau_corr']:.1f} | "
                f"{run['effective_walkers']:.1f} | {run['nonfinite']} | {run['seconds']:.0f} |"
            )
    return "\n".join(lines)


def _helium_run(tau: float, walkers: int, hartree: float, mesh: Any, seed: int) -> tuple[Any, float]:
    """One helium run of ``hartree`` hartree^-1 at time step ``tau``: its result and its seconds."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    system = systems()["helium"]
    dmc = sv.dmc.DMC(system["log_psi"], system["potential"], time_step=tau, mesh=mesh)
    state = dmc.init(jnp.float64(system["b"]), walkers_of(system, walkers, mesh, seed=seed))
    steps = max(int(round(hartree / tau)), 10)
    start = time.perf_counter()
    result = sv.driver.run(dmc.step, state, steps, key=jax.random.key(seed + 1), progress=False)
    if result.status != "finished":
        raise RuntimeError(f"helium at tau = {tau}, {walkers} walkers: the run {result.status}: {result.reason}")
    return result, time.perf_counter() - start


def bias(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    """Helium's energy against the time step, and against the population (with and without UNR's correction)."""
    import shardvmc as sv

    out: dict[str, Any] = {"time_steps": {}, "populations": {}}
    for i, tau in enumerate(args.bias_time_steps):
        row = out["time_steps"][str(tau)] = _bias_row(*_helium_run(tau, args.bias_walkers, args.bias_hartree,
                                                                   mesh, seed=10 + i))  # fmt: skip
        print(f"  helium tau={tau}, {args.bias_walkers} walkers: {row['energy']:.5f} +- {row['error']:.5f} "
              f"({row['seconds']:.0f} s)", flush=True)  # fmt: skip
    taus = args.bias_time_steps
    runs = [out["time_steps"][str(t)] for t in taus]
    out["extrapolated"] = list(sv.dmc.extrapolate(taus, [(r["energy"], r["error"]) for r in runs]))
    for i, walkers in enumerate(args.bias_populations):
        tau = args.bias_population_tau
        row = out["populations"][str(walkers)] = _bias_row(*_helium_run(tau, walkers, args.bias_population_hartree,
                                                                        mesh, seed=20 + i))  # fmt: skip
        print(f"  helium tau={tau}, {walkers} walkers: {row['energy']:.5f} +- {row['error']:.5f} "
              f"(uncorrected {row['uncorrected']:.5f}; {row['seconds']:.0f} s)", flush=True)  # fmt: skip
    return out


def _bias_row(result: Any, seconds: float) -> dict[str, float]:
    """A run's mixed estimate with the population control undone (``energy``) and without it (``uncorrected``)."""
    import shardvmc as sv

    fixed = sv.dmc.energy(result, discard=0.2)
    raw = sv.dmc.energy(result, discard=0.2, population_steps=0)
    return {"energy": float(fixed.mean), "error": float(fixed.error_of_mean), "uncorrected": float(raw.mean),
            "uncorrected_error": float(raw.error_of_mean), "seconds": seconds}  # fmt: skip


def bias_table(data: dict[str, Any], args: argparse.Namespace) -> str:
    e0, err0 = data["extrapolated"]
    lines = [
        f"Helium's DMC energy (Ha) against the time step ({args.bias_walkers} walkers, {args.bias_hartree:g} "
        f"hartree^-1 per run) and the population (tau = {args.bias_population_tau}, {args.bias_population_hartree:g} "
        f"hartree^-1 per run); the first 20 % of each run discarded; exact {EXACT['helium']:.6f}:\n",
        "| run | E | E - exact |",
        "|---|---|---|",
    ]
    for tau, run in data["time_steps"].items():
        lines.append(f"| tau = {tau} | {fmt(run['energy'], run['error'])} | {run['energy'] - EXACT['helium']:+.5f} |")
    lines.append(f"| extrapolated to tau = 0 | {fmt(e0, err0)} | {e0 - EXACT['helium']:+.5f} |")
    for walkers, run in data["populations"].items():
        lines.append(
            f"| {walkers} walkers | {fmt(run['energy'], run['error'])} (uncorrected "
            f"{fmt(run['uncorrected'], run['uncorrected_error'])}) | {run['energy'] - EXACT['helium']:+.5f} |"
        )
    return "\n".join(lines)


def bias_plot(data: dict[str, Any], args: argparse.Namespace, path: str) -> None:
    """Two panels: E against tau (error bars, the weighted fit and its intercept), E against 1 / population."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    exact = EXACT["helium"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    taus = np.array([float(t) for t in data["time_steps"]])
    e = np.array([r["energy"] for r in data["time_steps"].values()])
    err = np.array([r["error"] for r in data["time_steps"].values()])
    e0, err0 = data["extrapolated"]
    slope = np.polyfit(taus, e, 1, w=1 / err)[0]  # the same weighted fit as sv.dmc.extrapolate
    line = np.linspace(0.0, taus.max() * 1.05, 50)
    left.errorbar(taus, e, yerr=err, fmt="o", capsize=3, label=f"DMC, {args.bias_walkers} walkers")
    left.plot(line, e0 + slope * line, "-", color="C0", lw=1, label="weighted linear fit (sv.dmc.extrapolate)")
    left.errorbar([0.0], [e0], yerr=[err0], fmt="s", color="C0", mfc="white", capsize=3,
                  label=f"extrapolated: {fmt(e0, err0)}")  # fmt: skip
    left.axhline(exact, color="grey", lw=0.8, ls="--", label=f"exact {exact:.5f}")
    left.set_xlabel("time step tau (1/Ha)")
    left.set_ylabel("energy (Ha)")
    left.set_title(f"Time-step bias ({args.bias_walkers} walkers, {args.bias_hartree:g} / Ha per run)")
    left.legend(fontsize=8)
    populations = dict(data["populations"])
    if str(args.bias_population_tau) in data["time_steps"]:  # the time-step series' run at that tau: the largest
        populations[str(args.bias_walkers)] = data["time_steps"][str(args.bias_population_tau)]
    pops = np.array([int(n) for n in populations])
    runs = list(populations.values())
    for key, error, label, style in (
        ("uncorrected", "uncorrected_error", "no correction (population_steps=0)", "^"),
        ("energy", "error", "UNR's correction (the default)", "o"),
    ):
        right.errorbar(1.0 / pops, [r[key] for r in runs], yerr=[r[error] for r in runs], fmt=style, capsize=3,
                       label=label)  # fmt: skip
    right.axhline(exact, color="grey", lw=0.8, ls="--", label="exact")
    right.set_xlabel("1 / population")
    right.set_ylabel("energy (Ha)")
    right.set_title(
        f"Population bias (tau = {args.bias_population_tau}, {args.bias_population_hartree:g} / Ha per run)"
    )
    right.legend(fontsize=8)
    fig.suptitle("Helium, fixed-population DMC (sv.dmc), float64; the first 20 % of each run discarded")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_cpu_devices(max(args.devices, COMM_DEVICES if "traffic" in args.only else 1))
    import jax

    import shardvmc as sv

    jax.config.update("jax_enable_x64", True)
    mesh = sv.create_mesh(jax.devices()[: args.devices])
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}}
    if args.quick:
        print("smoke run (--quick): tiny sizes, the figures mean nothing\n")
    if "energies" in args.only:
        report["energies"] = energies(args, mesh)
        print(energies_table(report["energies"], args), end="\n\n")
        print(runs_table(report["energies"]), end="\n\n", flush=True)
    if "timing" in args.only:
        report["timing"] = timing(args, mesh)
        print(timing_table(report["timing"], args), end="\n\n", flush=True)
    if "traffic" in args.only:
        report["traffic"] = traffic(args, jax.devices()[:COMM_DEVICES])
        print(traffic_table(report["traffic"]), flush=True)
    if "bias" in args.only:
        report["bias"] = bias(args, mesh)
        print(bias_table(report["bias"], args), flush=True)
        if args.plot:
            bias_plot(report["bias"], args, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
