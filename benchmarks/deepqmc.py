"""DeepQMC and shardvmc side by side: the same molecule trained by KFAC, step time as a ratio.

The job: LiH (DeepQMC's ``hamil/mol=LiH``, 4 electrons), DeepQMC's default ansatz
(``ansatz=default``: PauliNet-style GNN, envelopes, backflow, cusps) scaled down, float32,
the same initial parameters on both sides; DeepQMC's ``decorr_metropolis`` sampler (20
all-electron Gaussian moves per step, width adapted toward 57 % acceptance); DeepQMC's
KFAC settings (``task/opt=kfac``: learning rate ``0.05 / (1 + t / 10^4)``, norm
constraint 1e-3, damping 1e-3, ``fisher_exact``, inverse every step, no momentum) and its
energy clipping (``median_log_squeeze_and_mask``: the local energies squeezed
logarithmically beyond the 95 % quantile of their distance to the median, in the gradient
only).

- DeepQMC: its hydra configs composed with overrides, its own training loop
  (``deepqmc.fit.fit_wf``, what ``deepqmc.train.train`` runs after equilibration), on
  ``pmap`` over every device of its process.
- shardvmc: DeepQMC's haiku wavefunction as ``log_psi(params, r)`` of one walker,
  ``sv.mcmc.Metropolis``, ``sv.hamiltonian.local_energy`` (folx), DeepQMC's loss
  written FermiNet's way (a ``custom_jvp`` over one device's walkers, the clipping with
  ``all_gather``) and ``shardvmc.kfac.Optimizer``.

DeepQMC 1.2.0 (the newest release on Python 3.11; 1.3.0 needs Python >= 3.12 and pins
``jax<0.9``) cannot train on the JAX shardvmc needs (>= 0.10.2): its training calls
``jax.device_put_replicated`` and ``jax.tree_map`` (both removed), and its KFAC graph
patterns build ``kfac_jax.LayerTag(name, 1, 1)``, which kfac-jax 0.0.8 (the only
kfac-jax for JAX 0.10) no longer accepts. So DeepQMC's side runs in a worker process of
its own interpreter (``--deepqmc-python``, default ``$DEEPQMC_PYTHON``, else this one),
a venv with DeepQMC 1.2.0 on the JAX and kfac-jax it was released for::

    python3.11 -m venv ~/venvs/deepqmc-1.2
    printf 'jax==0.4.30\njaxlib==0.4.30\n' > /tmp/c.txt   # kfac-jax 0.0.6 fails on jax 0.4.38, what "jax<0.5" gives
    ~/venvs/deepqmc-1.2/bin/pip install -c /tmp/c.txt "deepqmc==1.2.0" "kfac-jax==0.0.6" "dm-haiku==0.0.12"

Both processes see the same number of fake CPU devices on the same cores; while one runs
a block of steps the other waits on a pipe. Timing follows the peer protocol of
``harness.py`` (``harness.measure``, ``harness.independent_runs``): each round runs ``calls``
blocks of ``--block`` steps of one side, then of the other (the order reversed every other
round, after two warm-up blocks); ``calls`` doubles while the per-round ratio shardvmc /
DeepQMC has a quartile more than ``--spread`` (0.1) from its median, checked every
``--rounds`` rounds, up to ``--max-rounds``; the pieces the same way (``--piece-reps``,
``--piece-max-rounds``; each of a piece's calls waited for). The one-minute load average
and the CPU that other processes took are recorded at every round. ``--runs`` (3)
independent runs, each a fresh process pair, a run during which other processes took more
than ``--max-load`` cores repeated (at most ``--extra-runs`` times); the figure is the
median of the runs' medians, printed with each run's median. Each side times its own
blocks (``time.perf_counter`` around the steps, the result waited for), so the pipe costs
nothing. Without a DeepQMC that trains, the table says why (the exact error) and compares
the pieces that run.

Also printed: the first step (compilation included), the energy of each side over the
second half of its steps (``sv.statistics`` of the per-step means), the peak resident
memory of each process, the lines of user code of each side (the regions between the
``# user code`` markers of this file, blank and comment lines left out), the time of each
piece (sampler step, local energy, gradient of ``log|psi|``, the optimiser's step) on
both sides, and whether shardvmc's trajectory is the same on 1, 3 and 8 devices for a
walker count 8 does not divide.

Usage (from the repository root, after ``pip install -e ".[bench]"``)::

    DEEPQMC_PYTHON=~/venvs/deepqmc-1.2/bin/python python benchmarks/deepqmc.py   # 1 and 8 devices
    DEEPQMC_PYTHON=... python benchmarks/deepqmc.py --devices 8 --trajectory ""   # the step and pieces, 3 runs
    python benchmarks/deepqmc.py --smoke     # shardvmc's side only, tiny, a stand-in network: no DeepQMC needed
    DEEPQMC_PYTHON=... python benchmarks/deepqmc.py --train 300 --trajectory "" --plot lih.png  # time to accuracy
    DEEPQMC_PYTHON=... python benchmarks/deepqmc.py --train 300 --trajectory "" --seed 3  # seeds 3, 4, 5

``--train N`` trains both sides N steps from the same parameters, one step of each in turn, every
step timed (the first with its compilation), and prints when each first reaches DeepQMC's final
energy (the mean of its last 20 % of steps; "reached" is the 20-step running mean at or below it):
shardvmc's time over DeepQMC's is the time-to-accuracy ratio; ``--plot`` draws both curves (of
the first counted run). By the protocol: ``--runs`` (3) independent runs, run i from seed
``--seed`` + i, the load and the other processes' CPU recorded at every step, a run taken above
``--max-load`` repeated with the next seed; the figure is the median of the counted runs'
ratios (a side that does not reach DeepQMC's final energy counted as the slowest).
"""

import argparse
import json
import os
import pickle
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from userlines import user_lines  # this folder is on sys.path when run as a script; standard library only

HERE = Path(__file__).resolve()
# This file is benchmarks/deepqmc.py: with its folder on sys.path, `import deepqmc` would import it again.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]

MOLECULE = "LiH"
WALKERS = 64  # DeepQMC's electron_batch_size (1000 by default), small: its KFAC step compiles for minutes
# DeepQMC's default ansatz (conf/ansatz/default.yaml) scaled down: 128 -> 32 wide, 3 -> 2 interactions,
# 16 -> 4 determinants, two-particle stream 32 -> 16.
ANSATZ = {
    "ansatz.omni_factory.embedding_dim": 32,
    "ansatz.omni_factory.gnn_factory.n_interactions": 2,
    "ansatz.n_determinants": 4,
    "ansatz.omni_factory.gnn_factory.two_particle_stream_dim": 16,
}
DECORRELATION = 20  # conf/task/sampler_factory/decorr_metropolis.yaml: 20 Metropolis moves per step
TAU = 1.0  # its initial proposal width
ACCEPTANCE = 0.57  # MetropolisSampler's default target_acceptance
LEARNING_RATE, DECAY = 0.05, 1e4  # conf/task/opt/kfac.yaml: InverseSchedule(0.05, 10000)
NORM_CONSTRAINT, DAMPING = 1e-3, 1e-3
BURN_IN = 10  # sampler calls at the initial parameters before training, on both sides
SEED = 0


def load_harness() -> None:
    """``benchmarks/harness.py`` as the module ``harness`` (this folder is off ``sys.path``, see above); it starts
    no backend."""
    if "harness" not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location("harness", HERE.parent / "harness.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["harness"] = module
        spec.loader.exec_module(module)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walkers", type=int, default=WALKERS, help="walkers (DeepQMC's electron_batch_size)")
    if "--worker" not in argv:  # the protocol is the parent's: DeepQMC's worker answers requests
        load_harness()
        from harness import add_protocol_args

        add_protocol_args(parser, batch=10)  # --rounds, --max-rounds, --spread, --runs, --max-load, ...
    parser.add_argument("--block", type=int, default=1, help="optimisation steps per side per call")
    parser.add_argument("--devices", default="1,8", help="fake CPU device counts, one process pair each")
    parser.add_argument("--piece-reps", type=int, default=10, help="rounds between checks of each piece's spread")
    parser.add_argument("--piece-max-rounds", type=int, default=40, help="timed rounds of each piece at most")
    parser.add_argument("--trajectory", default="1,3,8", help="device counts of the trajectory check ('' skips)")
    parser.add_argument("--trajectory-walkers", type=int, default=60, help="walkers of that check (8 must not divide)")
    parser.add_argument("--trajectory-steps", type=int, default=4, help="optimisation steps of that check")
    parser.add_argument("--deepqmc-python", default=os.environ.get("DEEPQMC_PYTHON", sys.executable))
    parser.add_argument("--smoke", action="store_true", help="shardvmc's side only, tiny, with a stand-in network")
    parser.add_argument("--train", type=int, default=0, help="time to accuracy: train both sides this many steps")
    parser.add_argument("--plot", default="", help="with --train: the energy against wall time, to this PNG")
    parser.add_argument("--seed", type=int, default=SEED, help="both sides' seed: initial parameters, samples")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    # internal: one device count (--child), DeepQMC's worker (--worker), one trajectory (--trajectory-child)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trajectory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.walkers, args.rounds, args.max_rounds, args.block, args.runs, args.extra_runs = 16, 2, 2, 1, 1, 0
        args.piece_reps, args.piece_max_rounds = 2, 2
        args.devices, args.trajectory, args.trajectory_walkers, args.trajectory_steps = "8", "1,3", 13, 2
    return args


def fake_devices(n: int) -> None:
    """Ask XLA for ``n`` fake CPU devices (before JAX starts its backend), one thread pool per process."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already (by harness): its platforms were read at import
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quartiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q25": q[0], "q75": q[2], "n": len(values)}


def fmt_energy(e: dict[str, float]) -> str:
    """``mean ± error``; the mean alone when the steps were too few for an error bar (a smoke run's one step)."""
    finite = e["error"] == e["error"] and e["error"] not in (float("inf"), float("-inf"))
    return f"{e['mean']:.4f} ± {e['error']:.4f}" if finite else f"{e['mean']:.4f} ({e['steps']} steps: no error bar)"


def fmt_ratio(r: dict[str, Any] | None) -> str:
    """One run's ratio, or the median of several runs' (with each run's median)."""
    if r and "runs" in r:
        load_harness()
        from harness import fmt_runs

        return fmt_runs(r)
    return "-" if not r else f"{r['median']:.3f} [{r['q25']:.3f}, {r['q75']:.3f}]"


# ================================================================================================
# The ansatz and the Hamiltonian, built from DeepQMC's hydra configs (both sides)


def deepqmc_task(walkers: int) -> dict[str, Any]:
    """DeepQMC's ``task`` config with this benchmark's overrides, as ``deepqmc task=train ...`` composes it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    # user code: both
    overrides = ["task=train", f"hamil/mol={MOLECULE}", "task/sampler_factory=decorr_metropolis", "task/opt=kfac"]
    overrides += [f"{key}={value}" for key, value in ANSATZ.items()]
    overrides += [
        f"task.electron_batch_size={walkers}",
        "task.pretrain_steps=0",
        f"task.seed={SEED}",
        "task.workdir=null",
    ]
    with initialize_config_module(version_base=None, config_module="deepqmc.conf"):
        cfg = compose(config_name="config", overrides=overrides)
    # end of user code
    return OmegaConf.to_object(cfg.task)  # type: ignore[return-value]


def deepqmc_model(task: dict[str, Any]) -> tuple[Any, Any]:
    """DeepQMC's Hamiltonian and its haiku-transformed ansatz (``ansatz.init``, ``ansatz.apply``)."""
    from deepqmc.app import instantiate_ansatz
    from hydra.utils import instantiate

    # user code: both
    hamil = instantiate(task["hamil"], _recursive_=True, _convert_="all")
    ansatz = instantiate_ansatz(hamil, instantiate(task["ansatz"], _recursive_=True, _convert_="all"))
    # end of user code
    return hamil, ansatz


def initial_params(hamil: Any, ansatz: Any) -> Any:
    """The initial parameters of both sides: DeepQMC's ``init_wf_params`` for one state, without its replication."""
    import jax

    rng_sample, rng_params = jax.random.split(jax.random.split(jax.random.PRNGKey(SEED))[1])
    phys_conf = hamil.init_sample(rng_sample, hamil.mol.coords, 1)[0]
    return ansatz.init(rng_params, phys_conf)


# ================================================================================================
# DeepQMC's side: a worker process in DeepQMC's own interpreter, driven over a pipe


def reply(payload: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(payload) + "\n")
    sys.stdout.flush()


def worker(args: argparse.Namespace) -> int:
    """DeepQMC's training and pieces; requests on stdin, each answered on stdout (``@@`` + JSON)."""
    fake_devices(args.worker)
    import importlib.metadata
    import traceback

    import jax
    import jax.numpy as jnp

    versions = {p: importlib.metadata.version(p) for p in ("deepqmc", "jax", "jaxlib", "kfac-jax", "dm-haiku")}
    task = deepqmc_task(args.walkers)
    hamil, ansatz = deepqmc_model(task)
    request = json.loads(sys.stdin.readline())
    with open(request["params"], "rb") as f:
        params0 = jax.tree_util.tree_map(jnp.asarray, pickle.load(f))
    from deepqmc.types import PhysicalConfiguration

    r_check = jnp.asarray(request["r_check"], jnp.float32)
    conf = lambda r: PhysicalConfiguration(hamil.mol.coords, r, jnp.array(0))  # noqa: E731
    log_check = jax.vmap(lambda r: ansatz.apply(params0, conf(r)).log)(r_check)
    ready: dict[str, Any] = {"versions": versions, "devices": jax.device_count(), "log_check": log_check.tolist()}
    energies: list[float] = []
    pieces: dict[str, Any] = {}
    run_block = None
    try:
        run_block, ready["first_step_s"], ready["walkers_per_device"] = deepqmc_training(
            task, hamil, ansatz, params0, args.walkers, energies, pieces
        )
    except Exception as err:  # DeepQMC's training does not run here: say exactly why, time what runs
        ready["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
        ready["traceback"] = traceback.format_exc()[-2500:]
    ready["pieces"] = sorted(pieces)
    reply(ready)
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "run":
            assert run_block is not None
            reply({"seconds": run_block(request["steps"])})
        elif request["cmd"] == "piece":  # `number` calls, each waited for (calls of the same inputs would overlap)
            fn = pieces[request["name"]]
            start = time.perf_counter()
            for _ in range(request.get("number", 1)):
                jax.block_until_ready(fn())
            reply({"seconds": time.perf_counter() - start})
        else:
            reply({"energies": energies, "peak_rss_mib": peak_rss_mib()})
            break
    return 0


def deepqmc_training(
    task: dict[str, Any], hamil: Any, ansatz: Any, params0: Any, walkers: int, energies: list, pieces: dict
) -> tuple[Any, float, int]:
    """DeepQMC's own training loop (``fit_wf``) from ``params0``: ``run_block(n)``, the first step's time, and the
    walkers per device; fills ``pieces`` with DeepQMC's sampler step, local energy, gradient and KFAC step."""
    import jax
    import jax.numpy as jnp
    from deepqmc.fit import fit_wf
    from deepqmc.observable import default_observable_monitors
    from deepqmc.parallel import pmap, replicate_on_devices, split_on_devices, split_rng_key_to_devices
    from deepqmc.sampling import initialize_sampler_state
    from deepqmc.types import PhysicalConfiguration, TrainState
    from deepqmc.utils import tree_stack
    from hydra.utils import instantiate

    mols = [hamil.mol]
    kept: dict[str, Any] = {}

    def keep(factory: Any) -> Any:  # the optimiser fit_wf builds, kept for the optimiser-step piece
        def make(loss_and_grad: Any) -> Any:
            kept["opt"] = factory(loss_and_grad)
            return kept["opt"]

        return make

    # user code: deepqmc
    opt = instantiate(task["opt"], _recursive_=True, _convert_="all")
    sampler_factory = instantiate(task["sampler_factory"], _recursive_=True, _convert_="all")
    loss_function_factory = instantiate(task["loss_function_factory"], _recursive_=True, _convert_="all")
    rng = jax.random.PRNGKey(SEED)
    rng, rng_smpl = jax.random.split(rng)
    molecule_idx_sampler, sampler = sampler_factory(rng_smpl, hamil, ansatz, mols, 1, 1)
    params = replicate_on_devices(tree_stack([params0]), globally=True)  # what init_wf_params returns
    rng = split_rng_key_to_devices(rng)
    rng, rng_eq, rng_init = split_on_devices(rng, 3)
    smpl_state = initialize_sampler_state(rng_init, sampler, params, walkers, mols)
    sample = pmap(sampler.sample)
    for _ in range(BURN_IN):  # the burn-in (train() equilibrates until its criterion holds)
        rng_eq, key = split_on_devices(rng_eq, 2)
        smpl_state = sample(key, smpl_state, params, molecule_idx_sampler.sample())[0]
    monitors = [monitor.finalize(hamil, ansatz.apply) for monitor in default_observable_monitors()]
    train_state = TrainState(smpl_state, params, None)
    training = fit_wf(
        rng, hamil, ansatz, keep(opt), molecule_idx_sampler, sampler, iter(int, 1), train_state,
        loss_function_factory, observable_monitors=monitors,
    )  # fmt: skip

    def run(n_steps):  # train()'s loop body without its logs: a step, its NaN check, the energy
        for _ in range(n_steps):
            step, train_state, mol_idxs, stats, samples = next(training)
            if jnp.isnan(samples["psi/samples"]["log"]).any():
                raise FloatingPointError(f"NaN at step {step}")
            energies.append(float(stats["local_energy/mean"].ravel()[0]))
        return train_state

    # end of user code
    start = time.perf_counter()
    last = {"state": jax.block_until_ready(run(1))}
    first = time.perf_counter() - start

    def run_block(n_steps: int) -> float:
        start = time.perf_counter()
        last["state"] = jax.block_until_ready(run(n_steps))
        return time.perf_counter() - start

    # The pieces, at the trained state of the first step (fit_wf's own objects are local to it: built as it builds
    # them). A sampler step is what fit_wf's train_step runs of the sampler: sample_wf, and update_sampler (psi at the
    # parameters of the optimiser's step: shardvmc's sampler step does the same, refresh=True). The KFAC step is its
    # opt.step (the loss, its gradient, the curvature and the update: everything of a training step but the sampling).
    n_dev = jax.device_count()
    state = last["state"]
    keys = jax.random.split(jax.random.PRNGKey(2), n_dev)
    mol_idxs = jnp.zeros((n_dev, 1), jnp.int32)
    smpl_state, phys_conf, _ = sample(keys, state.sampler, state.params, mol_idxs)
    update = pmap(sampler.update)
    pieces["sampler step"] = lambda: update(sample(keys, state.sampler, state.params, mol_idxs)[0], state.params)
    one = jax.tree_util.tree_map(lambda x: x[:, 0], state.params)  # the one electronic state, per device
    r = phys_conf.r[:, 0, 0]  # (devices, walkers per device, electrons, 3)
    conf = lambda x: PhysicalConfiguration(hamil.mol.coords, x, jnp.array(0))  # noqa: E731
    local_energy = hamil.local_energy(ansatz.apply)
    energy = pmap(lambda p, x: jax.vmap(lambda y: local_energy(None, p, conf(y))[0])(x))
    pieces["local energy"] = lambda: energy(one, r)
    grad = pmap(lambda p, x: jax.vmap(jax.grad(lambda q, y: ansatz.apply(q, conf(y)).log), (None, 0))(p, x))
    pieces["gradient of log|psi|"] = lambda: grad(one, r)
    # fit_wf's own optimiser (compiled already); it donates its state, so the piece carries the state on from the
    # last training step's (the pieces run after the training rounds)
    data = {"energy_ewm": replicate_on_devices(jnp.zeros((1, 1))), "std_ewm": replicate_on_devices(jnp.zeros((1, 1)))}
    batch = (phys_conf, jnp.ones(phys_conf.batch_shape), data)
    kfac_keys = split_on_devices(keys, 1)[0]
    opt_box: dict[str, Any] = {}

    def kfac_step() -> Any:
        now = last["state"]
        params, opt_box["state"], *_ = kept["opt"].step(kfac_keys, now.params, opt_box.get("state", now.opt), batch)
        return params

    pieces["optimiser step (KFAC)"] = kfac_step
    return run_block, first, int(smpl_state["elec"]["r"].shape[-3])


def start_worker(args: argparse.Namespace, devices: int, params_path: str, r_check: Any) -> Any:
    """DeepQMC's worker on ``devices`` fake devices in ``--deepqmc-python``: ``(process, its ready message)``."""
    cmd = [args.deepqmc_python, str(HERE), "--worker", str(devices), "--walkers", str(args.walkers)]
    cmd += ["--seed", str(args.seed)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}  # its own packages
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return proc, ask(proc, params=params_path, r_check=r_check)


def ask(proc: Any, **request: Any) -> dict[str, Any]:
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise RuntimeError(f"DeepQMC's worker ended (exit {proc.wait()}) without answering")


# ================================================================================================
# shardvmc's side, in this process


def shardvmc_job(walkers: int, smoke: bool) -> dict[str, Any]:
    """shardvmc's training of the same ansatz from the same parameters: ``start()``, ``run(n)``, the pieces."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv
    import shardvmc.kfac as svk

    if smoke:  # no DeepQMC: the examples' FermiNet-style network of LiH stands in for DeepQMC's ansatz
        sys.path.insert(0, str(HERE.parents[1] / "examples"))
        import network

        system = network.SYSTEMS["LiH"]
        coords, charges = jnp.asarray(system.coords), jnp.asarray(system.charges)
        params0 = network.init(jax.random.key(SEED), system, 8, 4, 1, 1, jnp.float32)
        log_psi = lambda params, r: network.log_psi(params, r, system)  # noqa: E731
        one_walker = lambda key: network.init_walker(key, system, jnp.float32)  # noqa: E731
    else:
        from deepqmc.types import PhysicalConfiguration

        hamil, ansatz = deepqmc_model(deepqmc_task(walkers))
        params0 = initial_params(hamil, ansatz)
        one_walker = lambda key: hamil.init_sample(key, hamil.mol.coords, 1).r[0]  # noqa: E731
        # user code: shardvmc
        coords, charges = hamil.mol.coords, hamil.mol.charges

        def log_psi(params, r):  # DeepQMC's ansatz for ONE walker: r of shape (electrons, 3)
            return ansatz.apply(params, PhysicalConfiguration(coords, r, jnp.array(0))).log

        # end of user code
    energies: list[float] = []
    # user code: shardvmc
    local_energy = sv.hamiltonian.local_energy(log_psi, lambda r: sv.hamiltonian.coulomb(r, charges, coords))
    sampler = sv.mcmc.Metropolis(log_psi, n_steps=DECORRELATION, target_acceptance=ACCEPTANCE)
    kfac = svk.KFAC(learning_rate=lambda t: LEARNING_RATE / (1 + t / DECAY), damping=DAMPING,
                    norm_constraint=NORM_CONSTRAINT)  # fmt: skip
    clipping = sv.loss.ClipLogSqueeze()  # DeepQMC's median_log_squeeze_and_mask
    vmc = sv.driver.VMC(log_psi, kfac, local_energy=local_energy, sampler=sampler, clipping=clipping)
    # end of user code
    sample = jax.jit(sampler.step, compiler_options=sv.compiler_options())  # docs/faq.md: a jit of your own
    positions = sv.initialize_walkers_sharded(one_walker, walkers, key=jax.random.key(SEED))
    box: dict[str, Any] = {"state": vmc.init(sv.replicate(params0), positions, width=TAU)}
    for t in range(BURN_IN):  # the burn-in at the initial parameters
        state, key = box["state"], jax.random.fold_in(jax.random.key(2 + 100 * SEED), t)
        box["state"] = state._replace(sampler=sample(state.params, state.sampler, key))

    def run(n_steps: int) -> Any:
        for _ in range(n_steps):
            key = jax.random.fold_in(jax.random.key(3 + 100 * SEED), len(energies))
            box["state"], stats = vmc.step(box["state"], key)
            energies.append(float(stats["energy"]))
        return box["state"].params

    @sv.walker_parallel
    def gradient(params: sv.Replicated[Any], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[Any]:
        return jax.grad(log_psi)(params, r)  # one walker's d log|psi| / d params

    key = jax.random.key(4)
    jvp_energy = sv.hamiltonian.local_energy(
        log_psi, lambda r: sv.hamiltonian.coulomb(r, charges, coords), laplacian="jvp"
    )
    opt = kfac.vmc_optimizer(log_psi, local_energy, clipping, None)  # the one vmc.step runs (the same arguments)
    now = lambda: box["state"]  # noqa: E731
    pieces = {
        "sampler step": lambda: sample(now().params, now().sampler, key),
        "local energy": lambda: local_energy(now().params, now().sampler.walkers),
        "local energy, jvp Laplacian (DeepQMC's method)": lambda: jvp_energy(now().params, now().sampler.walkers),
        "gradient of log|psi|": lambda: gradient(now().params, now().sampler.walkers.data.r),
        "optimiser step (KFAC)": lambda: opt.step(now().params, now().opt, key, batch=now().sampler.positions)[0],
    }
    return {"run": run, "energies": energies, "box": box, "pieces": pieces, "params0": params0, "log_psi": log_psi}


# ================================================================================================
# One device count (a child process), the trajectory check, and the table


def energy_stats(series: list[float]) -> dict[str, float]:
    """Mean and error of the per-step mean energies of the second half of a run (``sv.statistics``, one chain)."""
    import warnings

    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    tail = jnp.asarray(series[len(series) // 2 :])
    with jax.set_mesh(sv.create_mesh()), warnings.catch_warnings():
        warnings.simplefilter("ignore", sv.PaddingWarning)  # one chain, padded to the devices
        stats = sv.statistics(tail[None, :])
    return {"mean": float(stats.mean), "error": float(stats.error_of_mean), "steps": len(series)}


def child(args: argparse.Namespace) -> int:
    """Both sides on ``args.child`` fake devices: first step, interleaved rounds, the pieces; one JSON row.

    The step and each piece are measured by ``harness.measure`` (the peer protocol: rounds lengthened until the
    ratio's quartiles lie within ``--spread`` of its median, the load recorded at every round)."""
    fake_devices(args.child)
    import dataclasses

    import jax
    import numpy as np

    load_harness()
    from harness import LoadMeter, measure, protocol_of, run_load, utc_now

    protocol = protocol_of(args)
    pieces_protocol = dataclasses.replace(protocol, batch=args.piece_reps,
                                          max_rounds=max(args.piece_reps, args.piece_max_rounds))  # fmt: skip
    meter = LoadMeter()
    row: dict[str, Any] = {"devices": args.child, "walkers": args.walkers, "block": args.block}
    sv_job = shardvmc_job(args.walkers, args.smoke)
    proc = None
    if not args.smoke:
        r_check = np.asarray(sv_job["box"]["state"].sampler.walkers.data.r[:4])
        mine = np.asarray(jax.vmap(lambda r: sv_job["log_psi"](sv_job["params0"], r))(r_check))
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            pickle.dump(jax.tree_util.tree_map(np.asarray, sv_job["params0"]), f)
        proc, ready = start_worker(args, args.child, f.name, r_check.tolist())
        os.unlink(f.name)
        row["deepqmc"] = ready
        row["same_ansatz_max_diff"] = float(np.max(np.abs(np.asarray(ready["log_check"]) - mine)))
    try:
        start = time.perf_counter()
        jax.block_until_ready(sv_job["run"](1))
        row["shardvmc"] = {"first_step_s": time.perf_counter() - start}
        trains = proc is not None and not row["deepqmc"].get("error")
        if args.train:  # time to accuracy: one step of each side in turn, every step timed, no pieces
            sides = {"shardvmc": lambda: timed(lambda: sv_job["run"](args.block))}
            if trains:
                sides["deepqmc"] = lambda: ask(proc, cmd="run", steps=args.block)["seconds"]
            assert proc is None or trains, row["deepqmc"].get("error")
            args.block, args.piece_reps = 1, 0
            first = {"shardvmc": row["shardvmc"]["first_step_s"], "deepqmc": (row.get("deepqmc") or {}).get(
                "first_step_s", 0.0)}  # fmt: skip
            readings: list[dict[str, Any]] = []  # the load at every step (a round: one step of each side)
            seconds = alternate(sides, args.train - 1, warm_up=0, after_round=lambda: readings.append(
                {**meter.reading(), "utc": utc_now()}))  # fmt: skip
            row["train"] = {name: [first[name], *t] for name, t in seconds.items()}
            row["train_rounds"] = readings
            times = {k: v[1:] for k, v in row["train"].items()}
            row["shardvmc"]["step_ms"] = 1e3 * statistics.median(times["shardvmc"]) / args.block
            if trains:
                row["deepqmc"]["step_ms"] = 1e3 * statistics.median(times["deepqmc"]) / args.block
                row["ratio"] = quartiles([a / b for a, b in zip(times["shardvmc"], times["deepqmc"])])
        else:  # the step: blocks of --block steps, `calls` blocks of each side in a row per round
            steps: dict[str, Any] = {"shardvmc": lambda n: timed(lambda: sv_job["run"](args.block * n))}
            if trains:
                steps["deepqmc"] = lambda n: ask(proc, cmd="run", steps=args.block * n)["seconds"]
            step = measure(steps, protocol, meter)
            row["step"] = step
            row["shardvmc"]["step_ms"] = 1e3 * step["seconds"]["shardvmc"] / args.block
            if trains:
                row["deepqmc"]["step_ms"] = 1e3 * step["seconds"]["deepqmc"] / args.block
                row["ratio"] = step["ratio"]
        # the pieces, measured the same way (`calls` calls of each side per round, each waited for)
        row["pieces"] = {}
        measured = [row["step"]] if "step" in row else [{"rounds": row["train_rounds"]}] if args.train else []
        for name, fn in sv_job["pieces"].items() if not args.train else ():
            theirs = PARTNER.get(name, name) if proc is not None else None  # DeepQMC's piece that does the same
            theirs = theirs if proc is not None and theirs in row["deepqmc"]["pieces"] else None
            piece: dict[str, Any] = {"shardvmc": lambda n, fn=fn: timed_calls(fn, n)}
            if theirs:
                piece["deepqmc"] = lambda n, name=theirs: ask(proc, cmd="piece", name=name, number=n)["seconds"]
            t = measure(piece, pieces_protocol, meter)
            measured.append(t)
            entry: dict[str, Any] = {"shardvmc_ms": 1e3 * t["seconds"]["shardvmc"], "calls": t["calls"],
                                     "rounds": t["rounds_at_length"]}  # fmt: skip
            if theirs:
                entry["deepqmc_ms"] = 1e3 * t["seconds"]["deepqmc"]
                entry["ratio"] = t["ratio"]
            row["pieces"][name] = entry
        row["load"] = run_load(measured, protocol.max_load)
        row["shardvmc"].update(energy=energy_stats(sv_job["energies"]), peak_rss_mib=peak_rss_mib())
        if args.train:
            row["shardvmc"]["energies"] = sv_job["energies"]
        if proc is not None:
            done = ask(proc, cmd="finish")
            row["deepqmc"]["peak_rss_mib"] = done["peak_rss_mib"]
            if done["energies"]:
                row["deepqmc"]["energy"] = energy_stats(done["energies"])
                if args.train:
                    row["deepqmc"]["energies"] = done["energies"]
    finally:
        if proc is not None:
            proc.stdin.close()
            proc.wait(timeout=120)
    reply(row)
    return 0


# shardvmc's local energy with DeepQMC's Laplacian method against DeepQMC's local energy (its default, jvp)
PARTNER = {"local energy, jvp Laplacian (DeepQMC's method)": "local energy"}


def timed(fn: Any) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def timed_calls(fn: Any, number: int) -> float:
    """Seconds of ``number`` calls of ``fn``, each waited for: a piece's calls take the same inputs, and calls in
    flight together would overlap on the fake devices' threads (a throughput, not a piece's time)."""
    import jax

    start = time.perf_counter()
    for _ in range(number):
        jax.block_until_ready(fn())
    return time.perf_counter() - start


def alternate(sides: dict[str, Any], rounds: int, warm_up: int = 2, after_round: Any = None) -> dict[str, list[float]]:
    """Seconds of each side per round, the sides in turn (order reversed every other round), after warm-ups;
    ``after_round()`` after each round."""
    names = list(sides)
    for _ in range(warm_up):
        for name in names:
            sides[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(sides[name]())
        if after_round is not None:
            after_round()
    return times


def trajectory_child(args: argparse.Namespace) -> int:
    """shardvmc's job on ``args.trajectory_child`` devices: the per-step energies and the final parameters."""
    fake_devices(args.trajectory_child)
    import jax
    import numpy as np

    job = shardvmc_job(args.trajectory_walkers, args.smoke)
    params = job["run"](args.trajectory_steps)
    flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(params)])
    reply({"energies": job["energies"], "params": flat.tolist(), "devices": jax.device_count()})
    return 0


def run_child(flag: str, devices: int, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    load_harness()
    from harness import protocol_argv

    cmd = [sys.executable, str(HERE), flag, str(devices), "--walkers", str(args.walkers), *protocol_argv(args)]
    cmd += ["--block", str(args.block), "--piece-reps", str(args.piece_reps), "--deepqmc-python", args.deepqmc_python]
    cmd += ["--piece-max-rounds", str(args.piece_max_rounds)]
    cmd += ["--trajectory-walkers", str(args.trajectory_walkers), "--trajectory-steps", str(args.trajectory_steps)]
    cmd += ["--train", str(args.train), "--seed", str(args.seed)]
    cmd += [*extra, *(["--smoke"] if args.smoke else [])]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
    rows = [json.loads(line[2:]) for line in out.stdout.splitlines() if line.startswith("@@")]
    if out.returncode or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout[-3000:]}")
    return rows[-1]


def device_count(devices: int, args: argparse.Namespace) -> dict[str, Any]:
    """One device count. With ``--train`` one run; else ``--runs`` independent runs (a fresh process pair each, a
    run taken above ``--max-load`` repeated): the row of the first counted run, its step and piece ratios and
    times replaced by the medians over the counted runs, and every run taken under ``"runs"``."""
    if args.train:
        return train_runs(devices, args)
    load_harness()
    from harness import independent_runs, median_of_runs, protocol_of

    log = lambda message: print(f"# {devices} devices, {message}", flush=True)  # noqa: E731

    def run_once(i: int) -> dict[str, Any]:
        run = run_child("--child", devices, args)
        pieces = "; ".join(f"{name} {fmt_ratio(p.get('ratio'))}" for name, p in run["pieces"].items())
        log(f"run {i + 1}, pieces: {pieces}")
        return run

    result = independent_runs(run_once, protocol_of(args), log)
    counted = [result["runs"][i] for i in result["counted"]]
    row = {key: value for key, value in counted[0].items() if key != "step"}
    row["runs"] = []
    for i, run in enumerate(result["runs"]):
        rounds, sides = run["step"]["rounds"], ("shardvmc", "deepqmc")
        row["runs"].append({
            "counted": i in result["counted"], "load": run["load"], "ratio": run.get("ratio"),
            "calls": run["step"]["calls"], "rounds": len(rounds), "utc": [rounds[0]["utc"], rounds[-1]["utc"]],
            "step_ms": {side: run[side]["step_ms"] for side in sides if run.get(side, {}).get("step_ms")},
            "pieces": {name: piece.get("ratio") for name, piece in run["pieces"].items()}, "step": run["step"],
        })  # fmt: skip
    row["above_load"] = result["above_load"]
    if (combined := median_of_runs([run.get("ratio") for run in counted])) is not None:
        row["ratio"] = combined
    for side in ("shardvmc", "deepqmc"):
        if "step_ms" in row.get(side, {}):
            row[side]["step_ms"] = statistics.median(run[side]["step_ms"] for run in counted)
    for name, piece in row["pieces"].items():
        for key in ("shardvmc_ms", "deepqmc_ms"):
            if key in piece:
                piece[key] = statistics.median(run["pieces"][name][key] for run in counted)
        if (combined := median_of_runs([run["pieces"][name].get("ratio") for run in counted])) is not None:
            piece["ratio"] = combined
    return row


def train_runs(devices: int, args: argparse.Namespace) -> dict[str, Any]:
    """Time to accuracy by the protocol: ``--runs`` independent runs, run i from seed ``--seed`` + i (both sides'
    initial parameters and random numbers), the load recorded at every step; a run during which other processes
    took more than ``--max-load`` cores is kept, marked and followed by one more (``--extra-runs`` at most). The
    row is the first counted run's (its curves are the plot's), with every run under ``"train_runs"`` and the
    median over the counted runs of the time-to-accuracy ratio (a side that does not reach: the slowest)."""
    load_harness()
    from harness import independent_runs, protocol_of

    def run_once(i: int) -> dict[str, Any]:
        run = run_child("--child", devices, argparse.Namespace(**{**vars(args), "seed": args.seed + i}))
        run["seed"], run["reached"] = args.seed + i, accuracy_times(run)
        run["step_ratio"] = run.pop("ratio", None)  # the per-step quartiles, not a settled protocol's ratio
        utc = [run["train_rounds"][0]["utc"], run["train_rounds"][-1]["utc"]] if run["train_rounds"] else ["-"] * 2
        run["utc"] = utc
        print(f"# {devices} devices, seed {run['seed']}, {utc[0]}-{utc[1]} UTC: {fmt_reached(run['reached'])}",
              flush=True)  # fmt: skip
        return run

    result = independent_runs(run_once, protocol_of(args), lambda m: print(f"# {devices} devices, {m}", flush=True))
    counted = [result["runs"][i] for i in result["counted"]]
    row = dict(counted[0], ratio=counted[0]["step_ratio"])
    row["train_runs"] = [
        {"seed": run["seed"], "counted": i in result["counted"], "load": run["load"], "utc": run["utc"],
         "reached": run["reached"], "step_ratio": run["step_ratio"]}
        for i, run in enumerate(result["runs"])
    ]  # fmt: skip
    ratios = [run["reached"]["ratio"] for run in counted if run["reached"]]
    row["time_ratio"] = statistics.median(ratios) if ratios else None
    row["above_load"] = result["above_load"]
    return row


def accuracy_times(row: dict[str, Any]) -> dict[str, Any] | None:
    """DeepQMC's final energy (the mean of its last 20 % of steps), when each side first reaches it (s; ``None``:
    not reached) and their ratio (``inf`` where shardvmc does not reach, ``0`` where only DeepQMC does not)."""
    if "train" not in row or "deepqmc" not in row["train"]:
        return None
    energies = {"shardvmc": row["shardvmc"]["energies"], "deepqmc": row["deepqmc"]["energies"]}
    tail = energies["deepqmc"][-max(1, len(energies["deepqmc"]) // 5) :]
    target = sum(tail) / len(tail)
    when = {side: reached(energies[side], row["train"][side], target) for side in energies}
    sv_t, dq_t = when["shardvmc"], when["deepqmc"]
    ratio = sv_t / dq_t if sv_t and dq_t else float("inf") if not sv_t else 0.0
    return {"target": target, "shardvmc": sv_t, "deepqmc": dq_t, "ratio": ratio, "steps": len(energies["deepqmc"])}


def fmt_when(seconds: float | None, unit: str = "") -> str:
    """When a side reached DeepQMC's final energy (:func:`accuracy_times`), or that it did not."""
    return f"{seconds:.0f}{unit}" if seconds else "not reached"


def fmt_reached(r: dict[str, Any] | None) -> str:
    if not r:
        return "no DeepQMC side"
    return (f"DeepQMC's final energy {r['target']:.4f}, reached: shardvmc {fmt_when(r['shardvmc'], ' s')}, DeepQMC "
            f"{fmt_when(r['deepqmc'], ' s')}, ratio {r['ratio']:.3f}")  # fmt: skip


def trajectories(args: argparse.Namespace) -> dict[str, Any]:
    """shardvmc's trajectory on each device count of ``--trajectory``, against the first: largest differences."""
    import numpy as np

    counts = [int(n) for n in args.trajectory.split(",") if n]
    result: dict[str, Any] = {"walkers": args.trajectory_walkers, "steps": args.trajectory_steps, "runs": {}}
    for optimiser in ("kfac",):  # KFAC with DeepQMC's clipping, a walker count the devices do not divide
        runs = {n: run_child("--trajectory-child", n, args) for n in counts}
        base = runs[counts[0]]
        table = {}
        for n, got in runs.items():
            if "error" in got:
                table[n] = {"error": got["error"]}
                continue
            table[n] = {
                "energy_max_diff": float(np.max(np.abs(np.subtract(got["energies"], base["energies"])))),
                "params_max_diff": float(np.max(np.abs(np.subtract(got["params"], base["params"])))),
                "final_energy": got["energies"][-1],
            }
        result["runs"][optimiser] = table
    return result


def main(argv: list[str] | None = None) -> int:
    global SEED
    args = parse_args(argv)
    SEED = args.seed  # read by the model's and both sides' random numbers (0: the figures recorded so far)
    if args.worker:
        return worker(args)
    if args.child:
        return child(args)
    if args.trajectory_child:
        return trajectory_child(args)
    started = time.perf_counter()
    rows = [device_count(int(n), args) for n in args.devices.split(",")]
    traj = trajectories(args) if args.trajectory else None
    lines = user_lines(HERE)
    if args.json:  # first: the figures are kept whatever the report (the plot needs matplotlib) does
        Path(args.json).write_text(json.dumps({"rows": rows, "trajectory": traj, "lines": lines}, indent=1))
    report(rows, traj, lines, args)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    return 0


def report(rows: list[dict], traj: dict | None, lines: dict[str, int], args: argparse.Namespace) -> None:
    print(f"# {MOLECULE}, {args.walkers} walkers, DeepQMC's default ansatz scaled down ({ANSATZ}), float32")
    for row in rows:
        dq = row.get("deepqmc")
        if dq:
            print(f"# {row['devices']} devices: DeepQMC side {dq['versions']}; same ansatz: log|psi| differs by "
                  f"{row['same_ansatz_max_diff']:.2e}; walkers per device {dq.get('walkers_per_device')}")  # fmt: skip
            if dq.get("error"):
                print(f"# DeepQMC's training does not run in {args.deepqmc_python}: {dq['error']}")
    print()
    print("| devices | step time shardvmc / DeepQMC | step (ms) sv / dq | first step (s) sv / dq | E sv | E dq "
          "| peak RSS (MiB) sv / dq |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sv_, dq = row["shardvmc"], row.get("deepqmc") or {}
        e_sv = fmt_energy(sv_["energy"])
        e_dq = fmt_energy(dq["energy"]) if "energy" in dq else "-"
        step_dq = f"{dq['step_ms']:.0f}" if "step_ms" in dq else "-"
        first_dq = f"{dq['first_step_s']:.1f}" if dq.get("first_step_s") else "-"
        print(f"| {row['devices']} | {fmt_ratio(row.get('ratio'))} | {sv_['step_ms']:.0f} / {step_dq} | "
              f"{sv_['first_step_s']:.1f} / {first_dq} | {e_sv} | {e_dq} | {sv_['peak_rss_mib']:.0f} / "
              f"{dq.get('peak_rss_mib', 0):.0f} |")  # fmt: skip
    load_harness()
    from harness import fmt_run

    for row in rows:  # each run of the protocol
        for i, run in enumerate(row.get("runs", ())):
            per_round = f"{run['rounds']} rounds, {run['calls']} call(s) of {args.block} step(s) per side per round"
            print(f"# {row['devices']} devices, " + fmt_run(i, run, fmt_ratio(run["ratio"]), per_round))
    print()
    print("| devices | piece | shardvmc / DeepQMC | ms sv / dq |")
    print("|---|---|---|---|")
    for row in rows:
        for name, p in row["pieces"].items():
            dq_ms = f"{p['deepqmc_ms']:.1f}" if "deepqmc_ms" in p else "-"
            print(f"| {row['devices']} | {name} | {fmt_ratio(p.get('ratio'))} | {p['shardvmc_ms']:.1f} / {dq_ms} |")
    if traj:
        print(f"\nshardvmc's trajectory, {traj['walkers']} walkers, {traj['steps']} steps, against the first count:")
        for optimiser, table in traj["runs"].items():
            for n, t in table.items():
                what = t.get("error") or (f"energies differ by {t['energy_max_diff']:.2e}, parameters by "
                                          f"{t['params_max_diff']:.2e}")  # fmt: skip
                print(f"  {optimiser}, {n} devices: {what}")
    print(f"\nlines of user code (the ansatz's config counted for both): {lines}")
    if any("train" in row for row in rows):
        time_to_accuracy(rows, args.plot)


def reached(energies: list[float], seconds: list[float], target: float, window: int = 20) -> float | None:
    """The wall time at which the ``window``-step running mean of ``energies`` first reaches ``target``."""
    total = 0.0
    for i, (e, t) in enumerate(zip(energies, seconds)):
        total += t
        if i + 1 >= window and sum(energies[i + 1 - window : i + 1]) / window <= target:
            return total
    return None


def time_to_accuracy(rows: list[dict], plot: str) -> None:
    """Each run's DeepQMC final energy (the mean of its last 20 % of steps) and when each side first reaches it;
    the median ratio over a device count's counted runs."""
    print("\n| devices | seed | DeepQMC's final energy | reached: shardvmc (s) | DeepQMC (s) | ratio | load average, "
          "other processes (cores) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    curves = []
    for row in rows:
        if "train" not in row or "deepqmc" not in row["train"]:
            continue
        for run in row["train_runs"]:
            r, load = run["reached"], run["load"]
            mark = "" if run["counted"] else " (not counted: above the load limit)"
            print(
                f"| {row['devices']} | {run['seed']}{mark} | {r['target']:.4f} | {fmt_when(r['shardvmc'])} | "
                f"{fmt_when(r['deepqmc'])} | {r['ratio']:.3f} | {load['load'][0]}-{load['load'][1]}, {load['others']} |"
            )
        if row["time_ratio"] is not None:
            print(f"| {row['devices']} | **median of the counted runs** | | | | **{row['time_ratio']:.3f}** | |")
        energies = {"shardvmc": row["shardvmc"]["energies"], "deepqmc": row["deepqmc"]["energies"]}
        curves.append((row["devices"], energies, row["train"], row["reached"]["target"]))
    if plot and curves:
        import itertools

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for devices, energies, seconds, target in curves:
            for side, style in (("shardvmc", "-"), ("deepqmc", "--")):
                t = list(itertools.accumulate(seconds[side]))
                e = energies[side]
                mean = [sum(e[max(0, i - 19) : i + 1]) / len(e[max(0, i - 19) : i + 1]) for i in range(len(e))]
                ax.plot(t, mean, style, label=f"{side}, {devices} device{'s' * (devices > 1)} (20-step mean)")
            ax.axhline(target, color="grey", lw=0.8)
        ax.set_xlabel("wall time (s, first step's compilation included)")
        ax.set_ylabel("energy (Ha)")
        ax.set_title(f"{MOLECULE}: KFAC, DeepQMC's settings and clipping, both sides")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")


if __name__ == "__main__":
    sys.exit(main())
