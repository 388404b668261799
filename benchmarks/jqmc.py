"""jQMC and shardvmc side by side: fixed-node DMC of the same trial function, the biases extrapolated away.

The peer: jQMC 0.2.2 (``pip install jqmc``), lattice-regularised DMC (LRDMC) in JAX, its
``jqmc.jqmc_gfmc.GFMC_n`` driver (what ``jqmc`` runs for ``job_type = "lrdmc-bra"``: a fixed
number of lattice projections between two branchings, the trial energy ``E_scf`` updated on
the fly, the population-control bias undone over ``num_gfmc_collect_steps`` branchings).

- **The trial function**, built in jQMC from its own data classes (``Structure_data``,
  ``AOs_sphe_data``, ``MOs_data``, ``Geminal_data``, ``Jastrow_data``, ``Hamiltonian_data``)
  and written again as a per-walker ``log_psi(params, r)`` for shardvmc with the same numbers:
  one s orbital per nucleus, a contraction of four normalised s Gaussians (exponents and
  coefficients fitted once, by weighted least squares, to ``exp(-Z r) / exp(J1(r))``, so that
  the product is close to the 1s orbital ``exp(-Z r)``); the molecular orbital their sum; the
  one determinant of one up and one down electron (a 1 x 1 geminal); jQMC's one-body Jastrow
  factor (``exp`` form: ``-(2Z)^(3/4) (1 - exp(-a (2Z)^(1/4) r)) / (2a)`` per electron and
  nucleus, which gives the exact nuclear cusp) and its two-body one (Pade:
  ``r12 / (2 (1 + b r12))``, the exact electron-electron cusp). The check: jQMC's
  ``evaluate_ln_wavefunction`` and shardvmc's ``log_psi`` at the same random configurations
  must differ by one constant (jQMC's orbital normalisation) to round-off.
- **The systems**: helium (exact -2.903724 Ha) and H2 at R = 1.4 bohr (exact -1.174476 Ha).
  Both ground states are nodeless, so fixed-node DMC is exact for any trial function: each
  code must reach the exact energy once its own bias is extrapolated away.
- **jQMC**: ``GFMC_n`` at the lattice spacings ``--alats``, ``--projections`` lattice
  projections between branchings, ``--branchings`` branchings at ``a = 0.3`` and
  ``(0.3 / a)^2`` times as many at ``a`` (a projection advances the imaginary time by about
  ``a^2 / 3`` hartree^-1 here, so every run covers about the same imaginary time), the first
  ``--warmup`` (a fraction, at least jQMC's 25 branchings) discarded, the energy and its error
  from ``GFMC_n.get_E`` (binned jackknife, ``--bins`` bins); the energies extrapolated to
  ``a = 0`` linearly in ``a^2`` (``sv.dmc.extrapolate`` applied to ``a^2``; LRDMC's bias is
  ``O(a^2)``). Its timings are its own log's: ``Pre-compilation time`` and ``Net GFMC time
  without pre-compilations``. Each run compiles its programs again (they are closures made in
  ``GFMC_n.run``); JAX's persistent cache, in the worker's temporary folder, spares the
  compilation proper from the second run of a system on, not the tracing.
- **shardvmc**: ``sv.dmc.DMC`` (UNR's drift-diffusion, Metropolis acceptance, a fixed
  population by stochastic reconfiguration) at the time steps ``--time-steps``, ``--hartree``
  hartree^-1 of imaginary time per run, the same fraction discarded, ``sv.dmc.energy`` and
  ``sv.dmc.extrapolate`` (linear in ``tau``). Compilation is timed apart (a run of 3 steps before the run).

The same number of walkers (``--walkers``) on both sides, float64, one CPU device each (one
MPI rank for jQMC, no ``mpirun``), one process at a time. The two projectors differ (a
lattice move of one electron per projection against a continuous move of every electron per
step), so their steps are not comparable one by one: the table gives each run's cost per
walker-step and, the figure of merit of a QMC run, the seconds one would need for an error
bar of 1 mHa (``seconds x (error / 1 mHa)^2``), and the extrapolated energies against the exact.

**The peer protocol** (``benchmarks/harness.py``): ``--runs`` (3) independent runs, each a fresh process of
this script (``--child``) from seed ``--seed`` + i, jQMC's side first in runs 1, 3, ... and shardvmc's in
runs 2, 4, ...; the load average and the CPU of processes outside the benchmark sampled every few seconds; a run during
which other processes took more than ``--max-load`` cores on average is repeated (``--extra-runs`` at most).
Per system, two figures of shardvmc over jQMC: the cost of a walker-step (all runs' seconds over their
steps; the same walkers on both sides) and the seconds for a 1 mHa error bar on the extrapolated energy; the
result is the median of the counted runs' figures. Whole DMC runs are the rounds here: their quartiles are
not the step ratio's of the other peers' protocol, so each run's figure is given beside the median.

jQMC pins ``jax < 0.8`` and shardvmc needs ``jax >= 0.10.2``, so jQMC runs in a worker process
of its own interpreter (``--jqmc-python``, default ``$JQMC_PYTHON``, else
``/tmp/venvjqmc/bin/python``): this file with ``--worker DIR``, under ``python -P`` (else this
file, ``jqmc.py``, would shadow the ``jqmc`` package). jQMC imports ``mpi4py``, which needs an MPI
library: ``pip install mpich`` in its venv gives one::

    python3.11 -m venv /tmp/venvjqmc
    /tmp/venvjqmc/bin/pip install jqmc==0.2.2 mpich

Usage (from the repository root)::

    python benchmarks/jqmc.py                     # helium and H2, three runs (about 8 minutes a run, 2 idle cores)
    python benchmarks/jqmc.py --systems helium --walkers 1024 --runs 1 --json he.json
    python benchmarks/jqmc.py --quick             # tiny sizes; not seconds: jQMC compiles for a minute per system
    python benchmarks/jqmc.py --markdown /tmp/jqmc_results.md   # also write the tables and the facts there
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
EXACT = {"helium": -2.903724377, "H2": -1.174475714}

# The trial functions: one s orbital per nucleus, four normalised s Gaussians (exponents, coefficients) fitted to
# exp(-Z r) / exp(J1(r)) with weight r exp(-Z r) for r < 10 bohr; jQMC's J1 (exp form) and J2 (Pade) parameters.
SYSTEMS: dict[str, dict[str, Any]] = {
    "helium": {
        "nuclei": [[0.0, 0.0, 0.0]],
        "charges": [2.0],
        "symbols": ["He"],
        "exponents": [0.3, 0.75, 1.875, 4.6875],
        "coefficients": [0.47683, 0.9305, 0.22758, 0.02844],
        "j1": 1.0,
        "j2": 0.3,
        "e_scf": -2.9,  # jQMC's first trial energy (updated on the fly from the 20th branching)
        "scale": 0.7,  # shardvmc's first walkers: normal with this width around the nuclei
    },
    "H2": {
        "nuclei": [[0.0, 0.0, -0.7], [0.0, 0.0, 0.7]],
        "charges": [1.0, 1.0],
        "symbols": ["H", "H"],
        "exponents": [0.075, 0.225, 0.675, 2.025],
        "coefficients": [0.89272, 2.11702, 0.63686, 0.06039],
        "j1": 1.0,
        "j2": 0.3,
        "e_scf": -1.17,
        "scale": 1.0,
    },
}
DEFAULTS = {"walkers": 512, "branchings": 300, "bins": 20, "hartree": 150.0, "check_points": 10}
QUICK = {"walkers": 16, "branchings": 40, "bins": 10, "hartree": 1.0, "check_points": 4}
A_REF = 0.3  # --branchings are those at this lattice spacing; at a, (A_REF / a)^2 times as many
JQMC_COLLECT = 5  # branchings over which GFMC_n undoes the population control (jQMC's minimum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run; the figures mean nothing)")
    parser.add_argument("--systems", default=",".join(EXACT), help=f"of {tuple(EXACT)} (default both)")
    parser.add_argument("--alats", default=None, help="jQMC's lattice spacings (bohr; default 0.4,0.3,0.2)")
    parser.add_argument("--projections", type=int, default=20, help="jQMC's projections between branchings (20)")
    parser.add_argument("--time-steps", default=None, help="shardvmc's time steps (default 0.1,0.05,0.025)")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of each run discarded (default 0.2)")
    for name, default in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(default), help=f"(default {default}; --quick: {QUICK[name]})")
    python = os.environ.get("JQMC_PYTHON", "/tmp/venvjqmc/bin/python")
    parser.add_argument("--jqmc-python", default=python, help=f"the interpreter with jQMC (default {python})")
    parser.add_argument("--seed", type=int, default=1, help="the first run's seed; run i's is this + i")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (the figures: their median)")
    parser.add_argument("--extra-runs", type=int, default=3, help="repeats of runs above --max-load, at most")
    parser.add_argument("--max-load", type=float, default=0.5,
                        help="other processes' CPU (cores) during a run above which it is repeated")  # fmt: skip
    parser.add_argument("--child", choices=("jqmc", "shardvmc"), default="", help=argparse.SUPPRESS)  # side first
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--markdown", default="", help="also write the tables, the commands and the facts here")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)  # jQMC's side, in its own interpreter
    args = parser.parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    args.systems = [s for s in args.systems.split(",") if s]
    if set(args.systems) - set(EXACT):
        parser.error(f"unknown systems {sorted(set(args.systems) - set(EXACT))}; choose from {tuple(EXACT)}")
    alats, time_steps = ("0.4,0.3", "0.1,0.05") if args.quick else ("0.4,0.3,0.2", "0.1,0.05,0.025")
    args.alats = [float(a) for a in (args.alats or alats).split(",")]
    args.time_steps = [float(t) for t in (args.time_steps or time_steps).split(",")]
    return args


# --------------------------------------------------------------------------------------------
# jQMC's side: runs in jQMC's interpreter (``--worker DIR``: DIR/spec.json in, DIR/result.json out)


def jqmc_hamiltonian(system: dict[str, Any]) -> Any:
    """The trial function and the Hamiltonian as jQMC's data classes."""
    import numpy as np
    from jqmc.atomic_orbital import AOs_sphe_data
    from jqmc.coulomb_potential import Coulomb_potential_data
    from jqmc.determinant import Geminal_data
    from jqmc.hamiltonians import Hamiltonian_data
    from jqmc.jastrow_factor import Jastrow_data, Jastrow_one_body_data, Jastrow_two_body_data
    from jqmc.molecular_orbital import MOs_data
    from jqmc.structure import Structure_data
    from jqmc.wavefunction import Wavefunction_data

    n_atoms, n_prim = len(system["charges"]), len(system["exponents"])
    structure = Structure_data(
        positions=np.array(system["nuclei"], dtype=np.float64),
        pbc_flag=False,
        atomic_numbers=tuple(int(z) for z in system["charges"]),
        element_symbols=tuple(system["symbols"]),
        atomic_labels=tuple(f"{s}{i}" for i, s in enumerate(system["symbols"])),
    )
    aos = AOs_sphe_data(  # one contracted s AO per nucleus, the same contraction on each
        structure_data=structure,
        nucleus_index=tuple(range(n_atoms)),
        num_ao=n_atoms,
        num_ao_prim=n_atoms * n_prim,
        orbital_indices=tuple(i for i in range(n_atoms) for _ in range(n_prim)),
        exponents=np.tile(np.array(system["exponents"], dtype=np.float64), n_atoms),
        coefficients=np.tile(np.array(system["coefficients"], dtype=np.float64), n_atoms),
        angular_momentums=(0,) * n_atoms,
        magnetic_quantum_numbers=(0,) * n_atoms,
    )
    mos = MOs_data(num_mo=1, aos_data=aos, mo_coefficients=np.ones((1, n_atoms)))  # the sum of the AOs
    geminal = Geminal_data(
        num_electron_up=1, num_electron_dn=1, orb_data_up_spin=mos, orb_data_dn_spin=mos, lambda_matrix=np.ones((1, 1))
    )
    jastrow = Jastrow_data(
        jastrow_one_body_data=Jastrow_one_body_data.init_jastrow_one_body_data(
            jastrow_1b_param=system["j1"], structure_data=structure, core_electrons=(0.0,) * n_atoms
        ),
        jastrow_two_body_data=Jastrow_two_body_data.init_jastrow_two_body_data(jastrow_2b_param=system["j2"]),
    )
    hamiltonian = Hamiltonian_data(
        structure_data=structure,
        coulomb_potential_data=Coulomb_potential_data(structure_data=structure, ecp_flag=False),
        wavefunction_data=Wavefunction_data(jastrow_data=jastrow, geminal_data=geminal),
    )
    hamiltonian.sanity_check()
    return hamiltonian


class _Records:
    """A logging handler that keeps jQMC's log lines (its timings are there)."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        handler = logging.Handler(level=logging.INFO)
        handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("jqmc")
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)

    def number(self, prefix: str) -> float:
        """The number after ``prefix`` in the last log line that holds it."""
        line = next(line for line in reversed(self.lines) if prefix in line)
        return float(line.split(prefix)[1].split()[0].rstrip("%"))


def jqmc_run(hamiltonian: Any, system: dict[str, Any], run: dict[str, Any], spec: dict[str, Any], log: Any) -> dict:
    """One LRDMC run (``GFMC_n``) at one lattice spacing: its energy, error and timings."""
    from jqmc.jqmc_gfmc import GFMC_n

    log.lines.clear()
    start = time.perf_counter()
    gfmc = GFMC_n(
        hamiltonian_data=hamiltonian,
        num_walkers=spec["walkers"],
        num_mcmc_per_measurement=run["projections"],
        num_gfmc_collect_steps=JQMC_COLLECT,
        mcmc_seed=spec["seed"],
        E_scf=system["e_scf"],
        alat=run["alat"],
        non_local_move="tmove",  # jQMC's default; all-electron, so unused
    )
    gfmc.run(num_mcmc_steps=run["branchings"])
    warmup = max(25, int(run["branchings"] * spec["warmup"]))  # jQMC's minimum warm-up: 25 branchings
    energy, error, variance, _ = gfmc.get_E(num_mcmc_warmup_steps=warmup, num_mcmc_bin_blocks=spec["bins"])
    wall = time.perf_counter() - start
    steps = run["branchings"] * run["projections"]
    return {
        **run,
        "steps": steps,
        "warmup": warmup,
        "energy": float(energy),
        "error": float(error),
        "variance": float(variance),
        "wall_s": wall,
        "compile_s": log.number("Pre-compilation time for GFMC ="),
        "seconds": log.number("Net GFMC time without pre-compilations ="),
        "projection_ms_per_branching": log.number("Projection between branching ="),
        "survived_percent": log.number("Survived walkers ratio ="),
    }


def worker(folder: str) -> None:
    """jQMC's side: the trial function's values at the check points, then every LRDMC run of the spec."""
    from importlib.metadata import version

    import jax
    import numpy as np
    from jqmc.wavefunction import evaluate_ln_wavefunction

    os.chdir(folder)  # GFMC_n.run writes its control file (external_control_gfmc.toml) in the working directory
    # Every run of a system compiles the same programs (the lattice spacing is an argument, not a constant of them):
    # JAX's persistent cache lets the second and later runs read them back instead of compiling them again.
    jax.config.update("jax_compilation_cache_dir", str(Path(folder) / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    spec = json.loads(Path("spec.json").read_text())
    log = _Records()
    out: dict[str, Any] = {"versions": {"python": platform.python_version(), "jax": jax.__version__,
                                        "jqmc": version("jqmc"), "devices": str(jax.devices())}}  # fmt: skip
    for name in spec["systems"]:
        system = SYSTEMS[name]
        hamiltonian = jqmc_hamiltonian(system)
        points = np.array(spec["points"])
        ln_psi = [float(evaluate_ln_wavefunction(hamiltonian.wavefunction_data, r[:1], r[1:])) for r in points]
        runs = []
        for run in spec["runs"]:
            runs.append(jqmc_run(hamiltonian, system, run, spec, log))
            print(f"  jQMC {name} a={run['alat']}: {runs[-1]['energy']:.5f} +- {runs[-1]['error']:.5f} "
                  f"({runs[-1]['wall_s']:.0f} s)", flush=True)  # fmt: skip
        out[name] = {"ln_psi": ln_psi, "runs": runs}
        Path("result.json").write_text(json.dumps(out))


def jqmc_side(args: argparse.Namespace, points: Any) -> dict[str, Any]:
    """Every jQMC run, in a worker process of ``--jqmc-python``."""
    runs = [{"alat": a, "projections": args.projections, "branchings": max(round(args.branchings * (A_REF / a) ** 2),
             args.bins + JQMC_COLLECT + 25)} for a in args.alats]  # fmt: skip
    spec = {"systems": args.systems, "points": points.tolist(), "runs": runs, "walkers": args.walkers,
            "seed": args.seed, "warmup": args.warmup, "bins": args.bins}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="jqmc-") as folder:
        (Path(folder) / "spec.json").write_text(json.dumps(spec))
        cmd = [args.jqmc_python, "-P", str(HERE), "--worker", folder]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS")}
        env["JAX_PLATFORMS"] = "cpu"
        output: list[str] = []
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:  # the worker's progress lines as they come; the rest kept for an error
                output.append(line)
                if line.startswith("  jQMC "):
                    print(line, end="", flush=True)
        result = Path(folder) / "result.json"
        if proc.returncode or not result.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{''.join(output)[-4000:]}")
        return {"command": " ".join(cmd), **json.loads(result.read_text())}


# --------------------------------------------------------------------------------------------
# shardvmc's side


def trial(name: str) -> tuple[Any, Any, dict[str, Any]]:
    """shardvmc's ``log_psi(params, r)`` (one walker, ``r``: (2, 3), up then down), the potential, the parameters."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    system = SYSTEMS[name]
    nuclei = jnp.array(system["nuclei"])
    charges = jnp.array(system["charges"])
    exponents = jnp.array(system["exponents"])
    # jQMC's normalised s primitive: c (2 alpha / pi)^(3/4) exp(-alpha r^2) (its Y_00 and solid harmonic cancel)
    log_weights = jnp.log(jnp.array(system["coefficients"]) * (2 * exponents / jnp.pi) ** 0.75)
    params = {"j1": jnp.float64(system["j1"]), "j2": jnp.float64(system["j2"])}

    def log_psi(p: dict[str, Any], r: jax.Array) -> jax.Array:
        d = jnp.linalg.norm(r[:, None, :] - nuclei[None], axis=-1)  # (electron, nucleus)
        # the orbital: the sum over nuclei and primitives of the weighted Gaussians, as one logsumexp
        orbital = jax.nn.logsumexp(log_weights[None, None, :] - exponents * d[..., None] ** 2, axis=(1, 2))
        two_z = 2.0 * charges
        j1 = -(two_z**0.75) / (2 * p["j1"]) * (1 - jnp.exp(-p["j1"] * two_z**0.25 * d))
        r12 = jnp.linalg.norm(r[0] - r[1])
        return jnp.sum(orbital) + jnp.sum(j1) + r12 / (2 * (1 + p["j2"] * r12))

    def potential(r: jax.Array) -> jax.Array:
        return sv.hamiltonian.coulomb(r, charges=charges, coords=nuclei)

    return log_psi, potential, params


def shardvmc_side(args: argparse.Namespace, points: Any) -> dict[str, Any]:
    """The trial function's values at the check points, and every DMC run."""
    import jax
    import numpy as np

    import shardvmc as sv

    out: dict[str, Any] = {}
    for name in args.systems:
        log_psi, potential, params = trial(name)
        ln_psi = [float(log_psi(params, jax.numpy.asarray(r))) for r in points]
        system = SYSTEMS[name]
        nuclei = np.array(system["nuclei"])

        def init(key: jax.Array) -> jax.Array:
            k1, k2 = jax.random.split(key)
            centre = jax.numpy.asarray(nuclei)[jax.random.randint(k1, (2,), 0, len(nuclei))]
            return centre + system["scale"] * jax.random.normal(k2, (2, 3))

        runs = []
        for i, tau in enumerate(args.time_steps):
            dmc = sv.dmc.DMC(log_psi, potential, time_step=tau)
            walkers = sv.initialize_walkers_sharded(init, args.walkers, key=jax.random.key(args.seed + i))
            state = dmc.init(params, walkers)
            start = time.perf_counter()  # compiles the step and the driver's own programs: 3 steps, thrown away
            sv.driver.run(dmc.step, state, 3, key=jax.random.key(10**6), progress=False)
            compile_s = time.perf_counter() - start
            steps = max(int(round(args.hartree / tau)), 10)
            start = time.perf_counter()
            result = sv.driver.run(dmc.step, state, steps, key=jax.random.key(args.seed + 100 + i), progress=False)
            seconds = time.perf_counter() - start
            if result.status != "finished":
                raise RuntimeError(f"{name} at tau = {tau}: the run {result.status}: {result.reason}")
            e = sv.dmc.energy(result, discard=args.warmup)
            runs.append({
                "tau": tau, "steps": steps, "energy": float(e.mean), "error": float(e.error_of_mean),
                "variance": float(e.variance), "tau_corr": float(e.tau_corr), "seconds": seconds,
                "compile_s": compile_s, "acceptance": float(np.mean(result.history["acceptance"])),
            })  # fmt: skip
            print(f"  shardvmc {name} tau={tau}: {e.mean:.5f} +- {e.error_of_mean:.5f} ({seconds:.0f} s)", flush=True)
        out[name] = {"ln_psi": ln_psi, "runs": runs}
    return out


# --------------------------------------------------------------------------------------------
# The comparison


def random_points(n: int, seed: int) -> Any:
    """``n`` configurations of two electrons (up, down) near the nuclei: the trial functions are compared there."""
    import numpy as np

    return np.random.default_rng(seed).normal(scale=1.0, size=(n, 2, 3))


def extrapolated(x: list[float], runs: list[dict[str, Any]]) -> tuple[float, float]:
    """The weighted linear fit ``E_0 + b x`` at ``x = 0`` (``sv.dmc.extrapolate``)."""
    import shardvmc as sv

    return sv.dmc.extrapolate(x, [(r["energy"], r["error"]) for r in runs])


def compare(args: argparse.Namespace, jq: dict[str, Any], sv_out: dict[str, Any]) -> dict[str, Any]:
    """Per system: the trial functions' difference, both codes' runs and their extrapolations."""
    import numpy as np

    out: dict[str, Any] = {}
    for name in args.systems:
        diff = np.array(sv_out[name]["ln_psi"]) - np.array(jq[name]["ln_psi"])
        jruns, sruns = jq[name]["runs"], sv_out[name]["runs"]
        out[name] = {
            "ln_psi_constant": float(np.mean(diff)),
            "ln_psi_spread": float(np.max(np.abs(diff - np.mean(diff)))),
            "jqmc": {"runs": jruns, "extrapolated": extrapolated([r["alat"] ** 2 for r in jruns], jruns)},
            "shardvmc": {"runs": sruns, "extrapolated": extrapolated([r["tau"] for r in sruns], sruns)},
        }
    return out


def tables(args: argparse.Namespace, data: dict[str, Any]) -> str:
    from harness import fmt_error as fmt  # (this folder is on the path on shardvmc's side, not in jQMC's worker)

    lines = [
        f"The trial functions (jQMC's evaluate_ln_wavefunction against shardvmc's log_psi at {args.check_points} "
        "random configurations; the difference is one constant, the orbital normalisation):\n",
        "| system | constant difference | max deviation from it |",
        "|---|---|---|",
    ]
    for name, item in data.items():
        lines.append(f"| {name} | {item['ln_psi_constant']:+.12f} | {item['ln_psi_spread']:.1e} |")
    lines += [
        "",
        f"Fixed-node DMC energies (Ha), {args.walkers} walkers, float64, one CPU device each; the first "
        f"{args.warmup:.0%} of each run discarded. 'seconds': the run without compilation (compiled: its "
        "compilation, apart); 'us / walker-step': seconds / (steps x walkers); 's for 1 mHa': "
        "seconds x (error / 0.001 Ha)^2, the run's cost for an error bar of 1 mHa (extrapolated rows: of all the runs, "
        "with the extrapolation's error):\n",
        "| system | code | run | steps | E | E - exact | seconds | compiled (s) | us / walker-step | s for 1 mHa |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, item in data.items():
        for code, label, key in (("jqmc", "a", "alat"), ("shardvmc", "tau", "tau")):
            for run in item[code]["runs"]:
                per = run["seconds"] / (run["steps"] * args.walkers) * 1e6
                cost = run["seconds"] * (run["error"] / 1e-3) ** 2
                extra = f", {run['projections']} proj./branching" if code == "jqmc" else ""
                lines.append(
                    f"| {name} | {code} | {label} = {run[key]:g}{extra} | {run['steps']} | "
                    f"{fmt(run['energy'], run['error'])} | {run['energy'] - EXACT[name]:+.5f} | {run['seconds']:.1f} | "
                    f"{run['compile_s']:.1f} | {per:.2f} | {cost:.0f} |"
                )
            e0, err0 = item[code]["extrapolated"]
            to = "a^2 -> 0" if code == "jqmc" else "tau -> 0"
            seconds = sum(run["seconds"] for run in item[code]["runs"])  # the runs it took, and their compilations
            compiled = sum(run["compile_s"] for run in item[code]["runs"])
            lines.append(
                f"| {name} | {code} | **extrapolated, {to}** | | **{fmt(e0, err0)}** | {e0 - EXACT[name]:+.5f} "
                f"({(e0 - EXACT[name]) / err0:+.1f} sigma) | {seconds:.1f} (all runs) | {compiled:.1f} | | "
                f"{seconds * (err0 / 1e-3) ** 2:.0f} |"
            )
    return "\n".join(lines)


def facts(args: argparse.Namespace, report: dict[str, Any]) -> str:
    import jax

    import shardvmc as sv

    jv = report["jqmc_versions"]
    return "\n".join([
        f"- date: {report['date']}; machine: {platform.machine()}, {os.cpu_count()} CPU cores visible "
        f"({platform.platform()}); load average (1, 5, 15 min) at the start {report['load_start']}, "
        f"at the end {report['load_end']}",
        f"- shardvmc {sv.__version__}: Python {platform.python_version()}, jax {jax.__version__}, devices "
        f"{[str(d) for d in jax.devices()]}",
        f"- jQMC {jv.get('jqmc')}: Python {jv.get('python')}, jax {jv.get('jax')}, devices {jv.get('devices')}, "
        "one MPI rank (mpich from PyPI), no mpirun",
        f"- wall time of the whole script: {report['wall_s']:.0f} s",
    ])  # fmt: skip


# --------------------------------------------------------------------------------------------
# The protocol: independent runs, each a child process of this script


def figures(systems: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per system, shardvmc over jQMC: a walker-step's cost, and the seconds for 1 mHa on the extrapolated energy."""

    def per_step(runs: list[dict[str, Any]]) -> float:
        return sum(run["seconds"] for run in runs) / sum(run["steps"] for run in runs)

    def for_one_mha(side: dict[str, Any]) -> float:
        return sum(run["seconds"] for run in side["runs"]) * (side["extrapolated"][1] / 1e-3) ** 2

    return {
        name: {
            "walker_step": per_step(item["shardvmc"]["runs"]) / per_step(item["jqmc"]["runs"]),
            "one_mha": for_one_mha(item["shardvmc"]) / for_one_mha(item["jqmc"]),
        }
        for name, item in systems.items()
    }


def child_argv(args: argparse.Namespace, run: int, out: str) -> list[str]:
    """This script's options for run ``run``: one comparison, seed ``--seed`` + run, sides in turn first."""
    argv = ["--systems", ",".join(args.systems), "--alats", ",".join(map(str, args.alats)), "--projections",
            str(args.projections), "--time-steps", ",".join(map(str, args.time_steps)), "--warmup",
            str(args.warmup), "--jqmc-python", args.jqmc_python, "--seed", str(args.seed + run), "--json", out,
            "--child", ("jqmc", "shardvmc")[run % 2]]  # fmt: skip
    for name in DEFAULTS:
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv + (["--quick"] if args.quick else [])


def one_run(args: argparse.Namespace, run: int, meter: Any = None, every: float = 5.0) -> dict[str, Any]:
    """Run ``run`` in a child process, the load sampled every ``every`` seconds while it runs."""
    from harness import LoadMeter, load_summary, utc_now

    meter = meter or LoadMeter()  # the child's processes are this process's tree: they are not "others"
    with tempfile.TemporaryDirectory(prefix="jqmc-run-") as folder:
        out = str(Path(folder) / "run.json")
        start, readings = utc_now(), []
        meter.reading()
        # a session of its own, so that an interrupt here can end the run and jQMC's worker under it together
        command = [sys.executable, str(HERE), *child_argv(args, run, out)]
        with subprocess.Popen(command, start_new_session=True) as proc:
            try:
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=every)
                    except subprocess.TimeoutExpired:
                        pass
                    readings.append(meter.reading())
            except BaseException:  # an interrupt: the run does not outlive this process
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        if proc.returncode:
            raise RuntimeError(f"run {run + 1} failed (exit {proc.returncode}); its output is above")
        report = json.loads(Path(out).read_text())
    return {
        "seed": args.seed + run, "first": ("jqmc", "shardvmc")[run % 2], "utc": [start, utc_now()],
        "rounds": readings, "load": load_summary(readings, args.max_load), "report": report,
        "figures": figures(report["systems"]),
    }  # fmt: skip


def protocol_table(taken: dict[str, Any], systems: list[str]) -> tuple[str, dict[str, dict[str, float]]]:
    """One row per run (counted or not) and the counted runs' medians; returns the text and the medians."""
    import statistics

    counted, keys = set(taken["counted"]), ("walker_step", "one_mha")
    header = "| run | seed | first | UTC | load average | other processes (cores) | counted |"
    for name in systems:
        header += f" {name}: walker-step sv / jq | {name}: s for 1 mHa sv / jq |"
    lines = [header, "|---" * (7 + 2 * len(systems)) + "|"]
    for i, run in enumerate(taken["runs"]):
        load = run["load"]
        cells = [f"{run['figures'][n][k]:.3f}" for n in systems for k in keys]
        lines.append(f"| {i + 1} | {run['seed']} | {run['first']} | {run['utc'][0]}-{run['utc'][1]} | "
                     f"{load['load'][0]}-{load['load'][1]} | {load['others']} (at most {load['others_max']}) | "
                     f"{'yes' if i in counted else 'no'} | " + " | ".join(cells) + " |")  # fmt: skip
    medians = {
        n: {k: statistics.median(taken["runs"][i]["figures"][n][k] for i in counted) for k in keys} for n in systems
    }
    cells = [f"**{medians[n][k]:.3f}**" for n in systems for k in keys]
    lines.append(f"| median of the {len(counted)} counted | | | | | | | " + " | ".join(cells) + " |")
    if taken["above_load"]:
        lines.append(f"\n{taken['above_load']} counted run(s) taken above the load limit (no repeat left).")
    return "\n".join(lines), medians


def run_protocol(args: argparse.Namespace, argv: list[str] | None) -> None:
    """``--runs`` independent runs by the peer protocol; the first counted run's tables and the protocol's."""
    from harness import Protocol, independent_runs

    p = Protocol(runs=args.runs, extra_runs=args.extra_runs, max_load=args.max_load)
    start = time.perf_counter()
    taken = independent_runs(lambda i: one_run(args, i), p)
    first = taken["runs"][taken["counted"][0]]["report"]
    text, medians = protocol_table(taken, args.systems)
    text = (f"{tables(args, first['systems'])}\n\n(The tables above: run {taken['counted'][0] + 1}.) "
            f"shardvmc over jQMC by run, and the median of the counted runs:\n\n{text}")  # fmt: skip
    facts_text = facts(args, {**first, "wall_s": time.perf_counter() - start})
    print("\n" + text + "\n\n" + facts_text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": first["args"], "medians": medians, **taken}, indent=1))
    if args.markdown:
        command = " ".join(["python", "benchmarks/jqmc.py", *(sys.argv[1:] if argv is None else argv)])
        Path(args.markdown).write_text(
            f"# jQMC and shardvmc side by side\n\nCommand: `{command}`\n\n{text}\n\n{facts_text}\n"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    if not args.child:
        sys.path.insert(0, str(HERE.parent))  # harness.py
        run_protocol(args, argv)
        return
    from shardvmc.testing import set_cpu_devices  # imports jax; starts no backend

    set_cpu_devices(1)
    import jax

    jax.config.update("jax_enable_x64", True)
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_start": [round(x, 2) for x in os.getloadavg()],
    }
    start = time.perf_counter()
    if args.quick:
        print("smoke run (--quick): tiny sizes, the figures mean nothing\n")
    points = random_points(args.check_points, args.seed)
    # one heavy process at a time; which side goes first alternates between the protocol's runs
    if args.child == "shardvmc":
        sv_out = shardvmc_side(args, points)
    jq = jqmc_side(args, points)
    report["jqmc_command"] = jq["command"]
    report["jqmc_versions"] = jq["versions"]
    if args.child == "jqmc":
        sv_out = shardvmc_side(args, points)
    report["systems"] = compare(args, jq, sv_out)
    report["load_end"] = [round(x, 2) for x in os.getloadavg()]
    report["wall_s"] = time.perf_counter() - start
    text = tables(args, report["systems"])
    print("\n" + text + "\n\n" + facts(args, report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        command = " ".join(["python", "benchmarks/jqmc.py", *(sys.argv[1:] if argv is None else argv)])
        Path(args.markdown).write_text(
            f"# jQMC and shardvmc side by side\n\nCommand: `{command}`\n\n{text}\n\n{facts(args, report)}\n"
        )


if __name__ == "__main__":
    main()
