"""NetKet and shardvmc side by side: the same VMC job in one process, step time as a ratio.

The job: Hooke's atom (two electrons in a 3-D harmonic trap of frequency 1/2, exact
ground-state energy 2 Ha), the same flax network and the same initial parameters on both
sides, Gaussian all-electron Metropolis moves of fixed width (10 per step, one sample per
chain per step), dense SR (natural gradient) with the same damping and the same step
length, float64, every device of the process (8 fake CPU devices by default).

- NetKet: ``nk.sampler.MetropolisGaussian``, ``nk.vqs.MCState``, ``KineticEnergy`` +
  ``PotentialEnergy``, ``nk.driver.VMC_SR(use_ntk=False)`` with ``optax.sgd``.
- shardvmc: ``sv.driver.VMC`` (``sv.mcmc.Metropolis``, ``sv.hamiltonian.local_energy``,
  ``shardvmc.optax.natural_gradient(method="dense")``) run by ``sv.driver.run``, evaluated by ``vmc.expect``.

Both sides are the whole job of ``docs/vmc.md``: the optimisation through the library's driver,
then the energy at fixed parameters (NetKet's ``vstate.expect(H)``, ``vmc.expect``).

NetKet's ``VMC_SR`` solves ``(S + shift) d = 2 cov(J, e)`` (the energy gradient), shardvmc's
natural gradient ``(S + damping) d = cov(J, e)``: NetKet's learning rate is half of
shardvmc's for the same step.

Timing, by the peer protocol of ``harness.py`` (``harness.measure``, ``harness.independent_runs``):
interleaved rounds (the order reversed every other round, after two warm-up blocks each), each
round ``calls`` blocks of ``--block`` steps of one side, then of the other; ``calls`` doubles
while the per-round ratio's quartiles lie more than ``--spread`` (0.1) from its median (checked
every ``--rounds`` rounds, up to ``--max-rounds``). The one-minute load average and the CPU that
other processes took are recorded at every round; ``--runs`` (3) independent runs, each a fresh
process, a run during which other processes took more than ``--max-load`` cores repeated; the
figure is the median of the runs' medians. The loop's own cost is measured in each run the same
way: blocks of ``sv.driver.run(vmc.step, ...)`` against blocks of the bare loop
``state, stats = vmc.step(state, key)`` (which never reads a statistic); the figure is the ratio
loop / bare step (goal <= 1.02; ``--no-loop`` leaves it out). Also printed:
the time to build each side (its objects and initial state), the first step (compilation
included), the energy of each side over the second half of its steps (``sv.statistics`` of
the per-step means), the evaluation's estimate (``expect``, over ``--eval-steps`` steps), and
the lines of user code of each side: the lines between the ``# user code`` markers of this
file, blank and comment lines left out (a ``# user code: both`` region, the model and the
potential, counts for each side).

Usage (from the repository root, with NetKet installed: ``pip install -e ".[bench]"``)::

    python benchmarks/netket.py                          # 2048 and 1001 walkers, blocks of 10 steps, 3 runs
    python benchmarks/netket.py --net mlp --walkers 2048 --block 5 --no-loop   # the 2-layer MLP Jastrow
    python benchmarks/netket.py --smoke                  # shardvmc's side only, tiny: no NetKet needed

``--net small`` (the default) is the Jastrow factor of ``r12`` through ``Dense(8)``, ``tanh``,
``Dense(1)``; ``--net mlp`` a 2-layer, 16-unit ``tanh`` MLP of two features, ``r12`` and the
hyperradius ``|x|`` (both times the trap's Gaussian).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# this folder is on sys.path when run as a script; harness starts no backend
from harness import (
    LoadMeter,
    add_protocol_args,
    fmt_run,
    fmt_runs,
    independent_runs,
    measure,
    median_of_runs,
    protocol_argv,
    protocol_of,
    run_load,
)
from userlines import user_lines

from shardvmc.testing import set_cpu_devices  # imports jax; starts no backend

# This file is benchmarks/netket.py: with its folder on sys.path, `import netket` would import it again, not NetKet.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

EXACT = 2.0  # Hooke's atom at trap frequency 1/2 (Taut 1993)
WIDTH = 0.5  # the Metropolis proposal width, fixed on both sides
SWEEP = 10  # Metropolis moves per optimisation step
DAMPING = 1e-3  # SR's diagonal shift
LEARNING_RATE = 0.05  # shardvmc's step length on cov(J, e); NetKet's is half of it on 2 cov(J, e)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walkers", default="2048,1001", help="walker (chain) counts, comma-separated")
    add_protocol_args(parser, batch=10)  # --rounds, --max-rounds, --spread, --runs, --max-load, ...
    parser.add_argument("--block", type=int, default=10, help="optimisation steps per call of a side's driver")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (default 8)")
    parser.add_argument("--net", choices=("small", "mlp"), default="small", help="the Jastrow network (see above)")
    parser.add_argument("--no-loop", action="store_true", help="leave out the loop against the bare jitted step")
    parser.add_argument("--eval-steps", type=int, default=50, help="steps of the evaluation at fixed parameters")
    parser.add_argument("--smoke", action="store_true", help="shardvmc's side only at tiny sizes, without NetKet")
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run of one walker count
    args = parser.parse_args(argv)
    if args.smoke:
        args.walkers, args.rounds, args.max_rounds, args.block, args.eval_steps = "13", 2, 2, 2, 4
        args.runs, args.extra_runs = 1, 0  # one run, kept whatever the load (the tests run it on a busy machine)
    args.walkers = [int(n) for n in args.walkers.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    """Each walker count: ``--runs`` independent runs (:func:`one_run`, a fresh process each); the table."""
    args = parse_args(argv)
    if args.child:
        return one_run(args)
    rows = []
    for n_walkers in args.walkers:
        log = lambda message: print(f"# {n_walkers} walkers, {message}", flush=True)  # noqa: E731
        result = independent_runs(lambda i: run_child(n_walkers, args), protocol_of(args), log)
        rows.append(combine(result))
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "lines": rows[0]["lines"]}, indent=1))
    return 0


def run_child(n_walkers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one walker count in a fresh process: its row."""
    cmd = [sys.executable, __file__, "--child", "--walkers", str(n_walkers), "--block", str(args.block)]
    cmd += ["--devices", str(args.devices), "--net", args.net, "--eval-steps", str(args.eval_steps)]
    cmd += [*protocol_argv(args), *(["--no-loop"] if args.no_loop else []), *(["--smoke"] if args.smoke else [])]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
    rows = [json.loads(line[2:]) for line in out.stdout.splitlines() if line.startswith("@@")]
    if out.returncode or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout[-3000:]}")
    return rows[-1]


def combine(result: dict[str, Any]) -> dict[str, Any]:
    """The row of the first counted run, its ratios and step times replaced by the medians over the counted runs,
    and every run taken under ``"runs"``."""
    counted = [result["runs"][i] for i in result["counted"]]
    row = {key: value for key, value in counted[0].items() if key not in ("step", "loop")}
    row["runs"] = []
    for i, run in enumerate(result["runs"]):
        rounds = run["step"]["rounds"]
        row["runs"].append({"counted": i in result["counted"], "load": run["load"], "ratio": run.get("ratio"),
                            "loop_over_bare_step": run.get("loop_over_bare_step"), "calls": run["step"]["calls"],
                            "rounds": len(rounds), "utc": [rounds[0]["utc"], rounds[-1]["utc"]],
                            "step": run["step"], "loop": run.get("loop")})  # fmt: skip
    row["above_load"] = result["above_load"]
    for key in ("ratio", "loop_over_bare_step"):
        if (combined := median_of_runs([run.get(key) for run in counted])) is not None:
            row[key] = combined
    for side in ("shardvmc", "netket"):
        if side in row:
            row[side] = {**row[side], "step_ms": statistics.median(run[side]["step_ms"] for run in counted)}
    return row


def one_run(args: argparse.Namespace) -> int:
    """Both sides for one walker count in this process, measured by the protocol; the row, as ``@@`` + JSON."""
    set_cpu_devices(args.devices)
    os.environ.setdefault("JAX_ENABLE_X64", "1")  # NetKet's default; the same precision on both sides

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import shardvmc as sv
    import shardvmc.optax as svx

    jax.config.update("jax_enable_x64", True)

    # user code: both
    class Net(nn.Module):  # log|psi| of the flat positions x = (x1, y1, z1, x2, y2, z2), any leading axes
        @nn.compact
        def __call__(self, x):
            r = x.reshape(*x.shape[:-1], 2, 3)
            r12 = jnp.linalg.norm(r[..., 0, :] - r[..., 1, :], axis=-1, keepdims=True)
            hidden = nn.tanh(nn.Dense(8, param_dtype=jnp.float64)(r12))
            return nn.Dense(1, param_dtype=jnp.float64)(hidden)[..., 0] - jnp.sum(x**2, axis=-1) / 4

    def potential(x):  # one configuration: the trap (frequency 1/2) and the electrons' repulsion
        r = x.reshape(2, 3)
        return jnp.sum(x**2) / 8 + 1 / jnp.linalg.norm(r[0] - r[1])

    # end of user code

    class MLP(nn.Module):  # --net mlp: 2 layers of 16 on (r12, |x|); not counted as user code (the same on both)
        @nn.compact
        def __call__(self, x):
            r = x.reshape(*x.shape[:-1], 2, 3)
            r12 = jnp.linalg.norm(r[..., 0, :] - r[..., 1, :], axis=-1, keepdims=True)
            h = jnp.concatenate([r12, jnp.linalg.norm(x, axis=-1, keepdims=True)], axis=-1)
            for _ in range(2):
                h = nn.tanh(nn.Dense(16, param_dtype=jnp.float64)(h))
            return nn.Dense(1, param_dtype=jnp.float64)(h)[..., 0] - jnp.sum(x**2, axis=-1) / 4

    model = MLP() if args.net == "mlp" else Net()
    variables = model.init(jax.random.key(0), jnp.zeros(6))  # the initial parameters of both sides

    def netket_side(n_walkers: int) -> dict[str, Any]:
        import netket as nk

        built = time.perf_counter()
        energies: list[Any] = []
        # user code: netket
        hilbert = nk.experimental.hilbert.Particle(N=2, geometry=nk.experimental.geometry.FreeSpace(d=3))
        hamiltonian = nk.operator.KineticEnergy(hilbert, mass=1.0) + nk.operator.PotentialEnergy(hilbert, potential)
        sampler = nk.sampler.MetropolisGaussian(hilbert, sigma=WIDTH, n_chains=n_walkers, sweep_size=SWEEP)
        vstate = nk.vqs.MCState(sampler, model, n_samples=n_walkers, n_discard_per_chain=0, seed=1)
        vstate.variables = variables
        driver = nk.driver.VMC_SR(
            hamiltonian, optax.sgd(LEARNING_RATE / 2), diag_shift=DAMPING, variational_state=vstate, use_ntk=False
        )

        def record(step, log, driver):
            energies.append(log["Energy"].mean)
            return True

        def run(n_steps):
            driver.run(n_steps, callback=record, show_progress=False)
            return vstate.parameters

        def evaluate(n_steps):
            vstate.n_samples = n_walkers * n_steps  # n_steps samples per chain
            return vstate.expect(hamiltonian)

        # end of user code
        built = time.perf_counter() - built
        return {"run": run, "evaluate": evaluate, "built": built, "energies": energies, "chains": sampler.n_chains}

    mesh = sv.create_mesh()

    def shardvmc_side(n_walkers: int) -> dict[str, Any]:
        built = time.perf_counter()
        energies: list[Any] = []
        # user code: shardvmc
        sampler = sv.mcmc.Metropolis(model.apply, n_steps=SWEEP, adapt_rate=0.0)
        opt = optax.chain(svx.natural_gradient(damping=DAMPING, method="dense"), optax.sgd(LEARNING_RATE))
        vmc = sv.driver.VMC(model.apply, opt, potential, sampler=sampler)
        walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (6,)), n_walkers, key=jax.random.key(1))
        state = vmc.init(variables, walkers, width=WIDTH)

        def run(n_steps):
            nonlocal state
            result = sv.driver.run(vmc.step, state, n_steps, key=jax.random.key(len(energies)), progress=False)
            state = result.state
            energies.extend(result.history["energy"])
            return state.params

        def evaluate(n_steps):
            return vmc.expect(state, n_steps, key=jax.random.key(-1), progress=False)

        # end of user code
        built = time.perf_counter() - built

        def bare(n_steps):
            """The bare jitted step, the loop's floor: the same steps, no statistic read, nothing recorded."""
            nonlocal state
            key = jax.random.key(10**6 + len(energies))
            for t in range(n_steps):
                state, _ = vmc.step(state, jax.random.fold_in(key, t))
            return state.params

        return {"run": run, "bare": bare, "evaluate": evaluate, "built": built, "energies": energies,
                "chains": n_walkers}  # fmt: skip

    def on_mesh(fn: Any) -> Any:
        """``fn`` under shardvmc's mesh: NetKet sets its own mesh (axis "S") for the whole process at import."""

        def wrapped(*a: Any) -> Any:
            with jax.set_mesh(mesh):
                return fn(*a)

        return wrapped

    def energy_of(series: list[Any]) -> Any:
        """``sv.statistics`` of the per-step mean energies of the second half of the run (one chain)."""
        tail = jnp.asarray([float(e) for e in series[len(series) // 2 :]])
        with jax.set_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore", sv.PaddingWarning)  # one chain, padded to the devices
            return sv.statistics(tail[None, :])

    sides = {"shardvmc": on_mesh(shardvmc_side)}
    if not args.smoke:
        sides = {**sides, "netket": netket_side}
    lines = user_lines(__file__)
    devices = jax.devices()
    protocol, meter = protocol_of(args), LoadMeter()
    (n_walkers,) = args.walkers
    row: dict[str, Any] = {"walkers": n_walkers, "block": args.block, "net": args.net, "lines": lines,
                           "machine": f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}), "
                                      f"jax {jax.__version__}"}  # fmt: skip
    jobs, first = {}, {}
    for name, make in sides.items():
        jobs[name] = make(n_walkers)
        run = on_mesh(jobs[name]["run"]) if name == "shardvmc" else jobs[name]["run"]
        jobs[name]["timed"] = run
        start = time.perf_counter()
        jax.block_until_ready(run(1))
        first[name] = time.perf_counter() - start

    def blocks(run: Any) -> Any:  # `calls` blocks of --block steps in a row: their seconds
        def timed(calls: int) -> float:
            start, out = time.perf_counter(), None
            for _ in range(calls):
                out = run(args.block)
            jax.block_until_ready(out)
            return time.perf_counter() - start

        return timed

    step = measure({name: blocks(job["timed"]) for name, job in jobs.items()}, protocol, meter)
    row["step"] = step
    measured = [step]
    if not args.no_loop:  # the loop against the bare jitted step: the same state carried on, blocks interleaved
        ours = jobs["shardvmc"]
        bare = on_mesh(ours["bare"])
        loop = measure({"loop": blocks(ours["timed"]), "bare": blocks(bare)}, protocol, meter)
        row["loop"], row["loop_over_bare_step"] = loop, loop.get("ratio")
        measured.append(loop)
    row["load"] = run_load(measured, protocol.max_load)
    for name, job in jobs.items():
        stats = energy_of(job["energies"])
        seconds = step["seconds"][name] / args.block
        evaluate = on_mesh(job["evaluate"]) if name == "shardvmc" else job["evaluate"]
        estimate = evaluate(args.eval_steps)
        row[name] = {
            "chains": job["chains"],
            "build_s": round(job["built"], 2),
            "first_step_s": round(first[name], 2),
            "step_ms": round(1e3 * seconds, 2),
            "steps": len(job["energies"]),
            "energy": float(stats.mean),
            "energy_error": float(stats.error_of_mean),
            "expect": float(estimate.mean.real),
            "expect_error": float(estimate.error_of_mean),
            "user_lines": lines[name],
        }
    if "ratio" in step:
        row["ratio"] = step["ratio"]
    print("@@" + json.dumps(row), flush=True)
    return 0


def fmt(r: dict[str, Any] | None) -> str:
    return fmt_runs(r) if r and "runs" in r else "-" if not r else f"{r['median']:.3f} [{r['q25']:.3f}, {r['q75']:.3f}]"


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"# Hooke's atom, network {args.net!r}, {rows[0]['machine']}; blocks of {args.block} steps")
    for row in rows:  # each run of the protocol
        for i, run in enumerate(row["runs"]):
            middle = (f"loop / bare {fmt(run['loop_over_bare_step'])}, {run['rounds']} rounds, {run['calls']} block(s) "
                      "per side per round")  # fmt: skip
            print(f"# {row['walkers']} walkers, " + fmt_run(i, run, fmt(run["ratio"]), middle))
    print()
    print("| walkers | step time shardvmc / NetKet | loop / bare step | step (ms) sv / nk | build (s) sv / nk "
          "| first step (s) sv / nk | expect sv | expect nk |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        sv_row, nk_row = row["shardvmc"], row.get("netket")
        energy = f"{sv_row['expect']:.5f} ± {sv_row['expect_error']:.5f}"
        loop = fmt(row.get("loop_over_bare_step"))
        if nk_row is None:
            print(f"| {row['walkers']} | - | {loop} | {sv_row['step_ms']:.2f} / - | {sv_row['build_s']} / - | "
                  f"{sv_row['first_step_s']} / - | {energy} | - |")  # fmt: skip
            continue
        print(
            f"| {row['walkers']} ({nk_row['chains']} NetKet chains) | {fmt(row.get('ratio'))} | {loop} | "
            f"{sv_row['step_ms']:.2f} / {nk_row['step_ms']:.2f} | {sv_row['build_s']} / {nk_row['build_s']} | "
            f"{sv_row['first_step_s']} / {nk_row['first_step_s']} | {energy} | "
            f"{nk_row['expect']:.5f} ± {nk_row['expect_error']:.5f} |"
        )
    print(f"\nlines of user code (model and potential included): {rows[0]['lines']}; exact energy {EXACT} Ha")


if __name__ == "__main__":
    sys.exit(main())
