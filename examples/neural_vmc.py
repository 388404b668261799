"""A FermiNet-style neural-network wavefunction for atoms and small molecules, trained on every device.

Variational Monte Carlo with the natural gradient (minSR, SPRING, dense SR, CG) or
kfac-jax's KFAC. Every per-walker piece is written for ONE walker and made
walker-parallel with ``sv.walker_parallel``: the Metropolis moves, the local energy
(``folx.forward_laplacian``) with the walker's row of ``J = d log|psi| / d params``,
FermiNet's energy clipping, the evaluation. The optimisers are optax chains
(``shardvmc.optax``) or ``shardvmc.kfac.Optimizer`` with FermiNet's own loss. The whole
training state (walkers, parameters, optimiser state) is checkpointed by
``sv.Checkpointer``; a preemption notice saves it and exits with code 75.

The network and the Hamiltonian are in ``examples/models`` (copy that folder and
``plumbing.py`` with this file). Figures and the commands that measured them are in
``docs/neural.md``.

    python examples/neural_vmc.py --system Li                      # minSR; 8 fake CPU devices
    python examples/neural_vmc.py --system Li --optimiser kfac
    python examples/neural_vmc.py --quick --devices 1              # a smoke test: seconds
    python examples/neural_vmc.py --checkpoint run --checkpoint-every 50             # kill it, then:
    python examples/neural_vmc.py --checkpoint run --checkpoint-every 50 --resume --devices 4
    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python examples/neural_vmc.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import plumbing
from jax.flatten_util import ravel_pytree
from models import hamiltonian, kfac_loss, systems

import shardvmc as sv
import shardvmc.optax as svx

SYSTEMS = {name: systems.SYSTEMS[name] for name in ("Li", "LiH", "Be")}
OPTIMISERS = ("minsr", "spring", "dense", "cg", "kfac")
CHEMICAL_ACCURACY = 1.6e-3  # Hartree (1 kcal/mol)


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
    damping: float = 1e-3
    momentum: float = 0.9  # SPRING's
    lr: float = 0.1
    lr_decay: float = 2000.0  # lr / (1 + t / lr_decay)
    max_norm: float = 0.05  # the largest lr^2 d.S.d of a step
    clip: float = 5.0  # local energies clipped to mean +- clip mean absolute deviations
    batch_size: int | None = None
    x64: bool = True


QUICK = {"walkers": 64, "steps": 6, "eval_steps": 4, "hidden": 8, "hidden_two": 4, "layers": 1,
         "determinants": 1, "sweeps": 2, "burn_in": 4}  # fmt: skip
"""``--quick``: a few steps of a tiny network on few walkers (a smoke test, and the tests' runs)."""


# ---------------------------------------------------------------------------------------------------------------------
# The wavefunction and the per-walker kernels
# ---------------------------------------------------------------------------------------------------------------------


def log_psi(params: Any, r: jax.Array, system: systems.System) -> jax.Array:
    """log|psi| of ONE walker ``r`` (n_electrons, 3): FermiNet's streams, K determinants, a cusp Jastrow."""
    return kfac_loss.log_psi(params, r, system)


def init_params(config: Config) -> Any:
    """The network's parameters, from ``fold_in(key(seed), 10**6)``."""
    sizes = {"hidden_one": config.hidden, "hidden_two": config.hidden_two, "layers": config.layers,
             "determinants": config.determinants, "dtype": _dtype(config)}  # fmt: skip
    init = jax.jit(lambda key: kfac_loss.init(key, SYSTEMS[config.system], jastrow=True, **sizes))  # one compilation
    return init(jax.random.fold_in(jax.random.key(config.seed), 10**6))


def _dtype(config: Config) -> Any:
    return jnp.float64 if config.x64 else jnp.float32


# --8<-- [start:kernels]
@sv.walker_parallel
def metropolis(
    params: sv.Replicated[Any],
    walker: sv.PerWalker[dict],
    key: sv.WalkerKey,
    step_size: sv.Replicated[jax.Array],
    system: sv.Static[systems.System],
    sweeps: sv.Static[int],
) -> tuple[sv.PerWalker[dict], sv.Mean[jax.Array]]:
    """``sweeps`` all-electron Metropolis moves of ONE walker; the acceptance is averaged."""

    def move(i: jax.Array, carry: tuple[dict, jax.Array]) -> tuple[dict, jax.Array]:
        w, accepted = carry
        k_move, k_accept = jax.random.split(jax.random.fold_in(key, i))
        proposal = w["r"] + step_size * jax.random.normal(k_move, w["r"].shape, w["r"].dtype)
        new_log_psi = log_psi(params, proposal, system)
        log_ratio = 2.0 * (new_log_psi - w["log_psi"])
        accept = jnp.log(jax.random.uniform(k_accept, dtype=w["r"].dtype)) < log_ratio
        w = {
            "r": jnp.where(accept, proposal, w["r"]),
            "log_psi": jnp.where(accept, new_log_psi, w["log_psi"]),
        }
        return w, accepted + accept.astype(w["r"].dtype)

    walker, accepted = jax.lax.fori_loop(0, sweeps, move, (walker, jnp.zeros((), walker["r"].dtype)))
    return walker, accepted / sweeps


@sv.walker_parallel
def refresh(
    params: sv.Replicated[Any],
    walker: sv.PerWalker[dict],
    system: sv.Static[systems.System],
) -> dict:
    """The walker with log|psi| recomputed for new parameters."""
    return {"r": walker["r"], "log_psi": log_psi(params, walker["r"], system)}


@sv.walker_parallel
def measure(
    params: sv.Replicated[Any], walker: sv.PerWalker[dict], system: sv.Static[systems.System]
) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[jax.Array]]:
    """The local energy (folx forward Laplacian) and the flat log-derivative row of ONE walker."""
    local_energy = hamiltonian.make_local_energy(lambda p, r: log_psi(p, r, system), system, method="folx")
    e = local_energy(params, walker["r"])
    flat, unravel = ravel_pytree(params)
    return e, jax.grad(lambda p: log_psi(unravel(p), walker["r"], system))(flat)


@sv.walker_parallel
def energy(
    params: sv.Replicated[Any], walker: sv.PerWalker[dict], system: sv.Static[systems.System]
) -> sv.PerWalker[jax.Array]:
    """The local energy of ONE walker (the evaluation needs no gradient)."""
    local_energy = hamiltonian.make_local_energy(lambda p, r: log_psi(p, r, system), system, method="folx")
    return local_energy(params, walker["r"])


@sv.walker_parallel
def clip(
    e: sv.PerWalker[jax.Array], width: sv.Static[float]
) -> tuple[sv.PerWalker[jax.Array], sv.Mean[jax.Array], sv.Mean[jax.Array]]:
    """FermiNet's clipping: ``e`` clipped to mean +- ``width`` mean absolute deviations.

    Returns the clipped energies and the means of ``e`` and ``e**2``.

    The window is a statistic over all valid walkers (``sv.all_walkers``), held constant.
    A kernel of its own: ``sv.all_walkers`` cannot see across the chunks of a ``batch_size`` kernel.
    """
    mean = jax.lax.stop_gradient(sv.all_walkers.mean(e))
    mad = jax.lax.stop_gradient(sv.all_walkers.mean(jnp.abs(e - mean)))
    return jnp.clip(e, mean - width * mad, mean + width * mad), e, e**2


# --8<-- [end:kernels]


def clip_reference(e: np.ndarray, width: float = 5.0) -> np.ndarray:
    """NumPy reference of :func:`clip`.

    Example:
        >>> float(clip_reference(np.array([0.0] * 19 + [100.0])).max())  # mean 5 + 5 x 9.5
        52.5
    """
    mean = e.mean()
    mad = np.abs(e - mean).mean()
    return np.clip(e, mean - width * mad, mean + width * mad)


# ---------------------------------------------------------------------------------------------------------------------
# The optimisers and the steps
# ---------------------------------------------------------------------------------------------------------------------


class State(NamedTuple):
    """What changes from step to step besides the walkers (replicated)."""

    params: Any
    opt: Any  # the optax or kfac-jax state
    step_size: jax.Array  # the Metropolis proposal width, adapted towards 50 % acceptance


def make_optimiser(config: Config, mesh: Any) -> Any:
    """An optax chain (natural gradient, Fisher-norm step constraint, learning-rate schedule), or KFAC.

    KFAC takes FermiNet's settings (``base_config.py``) except the step: the same schedule
    and norm constraint as the natural gradient (FermiNet's lr 0.05 and norm 1e-3 are for
    1e5 steps; in 700 they do not reach chemical accuracy here, see ``docs/neural.md``).
    """

    def schedule(t: jax.Array) -> jax.Array:  # FermiNet's inverse-time decay (optax has none): an optax schedule
        return config.lr / (1.0 + t / config.lr_decay)

    if config.optimiser == "kfac":
        from shardvmc import kfac as svk  # loads kfac-jax and scipy: only when asked for (see kfac_loss.make_loss)

        loss = kfac_loss.make_loss(SYSTEMS[config.system], clip=config.clip, method="folx", network=log_psi)
        return svk.Optimizer(
            jax.value_and_grad(loss, has_aux=True), l2_reg=0.0, mesh=mesh, pmap_axis_name=kfac_loss.AXIS,
            value_func_has_aux=True, value_func_has_rng=True, learning_rate_schedule=schedule,
            norm_constraint=config.max_norm, estimation_mode="fisher_exact", inverse_update_period=1,
            curvature_ema=0.95, min_damping=1e-4, num_burnin_steps=0,
        )  # fmt: skip
    spring = config.optimiser == "spring"
    return optax.chain(
        svx.natural_gradient(damping=config.damping, method=config.optimiser, momentum=config.momentum * spring),
        svx.clip_by_fisher_norm(config.max_norm, schedule),
        optax.scale_by_learning_rate(schedule),
    )


def _adapt(step_size: jax.Array, acceptance: jax.Array) -> jax.Array:
    factor = jnp.where(acceptance > 0.55, 1.05, jnp.where(acceptance < 0.45, 1 / 1.05, 1.0))
    return jnp.clip(step_size * factor, 0.02, 2.0)


# --8<-- [start:step]
@functools.cache  # one compilation per setting and mesh (runs that differ only in their seed share it)
def make_steps(config: Config, mesh: Any) -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """The optimiser, ``train(state, walkers, key)`` and ``evaluate(state, walkers, key)``.

    Both steps return ``(state, walkers, stats)``, ``stats`` = [energy, variance,
    acceptance]. ``train`` samples, measures, clips, and updates the parameters;
    ``evaluate`` samples and measures.
    """
    system, optimiser = SYSTEMS[config.system], make_optimiser(config, mesh)
    chunked = {"mesh": mesh, "batch_size": config.batch_size}
    metropolis_, refresh_ = metropolis.with_options(**chunked), refresh.with_options(**chunked)
    measure_, energy_ = measure.with_options(**chunked), energy.with_options(**chunked)
    clip_ = clip.with_options(mesh=mesh)

    @jax.jit
    def sample(state: State, walkers: sv.WalkerSet, key: jax.Array) -> tuple[sv.WalkerSet, jax.Array]:
        return metropolis_(state.params, walkers, key, state.step_size, system, config.sweeps)

    @jax.jit
    def train_natural_gradient(state: State, walkers: sv.WalkerSet, key: jax.Array) -> Any:
        walkers, acceptance = sample(state, walkers, key)
        e, j = measure_(state.params, walkers, system)
        e_clipped, e_mean, e2_mean = clip_(e, config.clip)
        updates, opt = optimiser.update(
            state.params,
            state.opt,
            state.params,
            jacobian=j,
            local_energies=e_clipped,
        )
        params = optax.apply_updates(state.params, updates)
        walkers = refresh_(params, walkers, system)
        return (
            State(params, opt, _adapt(state.step_size, acceptance)),
            walkers,
            jnp.stack([e_mean, e2_mean - e_mean**2, acceptance]),
        )

    def train_kfac(state: State, walkers: sv.WalkerSet, key: jax.Array) -> Any:
        # FermiNet's loss computes, clips and differentiates the energy itself, on the walkers' positions.
        walkers, acceptance = sample(state, walkers, key)
        positions = sv.WalkerSet(walkers.data["r"], walkers.n_valid)
        params, opt, stats = optimiser.step(
            state.params,
            state.opt,
            jax.random.fold_in(key, 1),
            batch=positions,
            momentum=0.0,
            damping=config.damping,
        )
        walkers = refresh_(params, walkers, system)
        return (
            State(params, opt, _adapt(state.step_size, acceptance)),
            walkers,
            jnp.stack([stats["loss"], stats["aux"]["variance"], acceptance]),
        )

    @jax.jit
    def evaluate(state: State, walkers: sv.WalkerSet, key: jax.Array) -> Any:
        walkers, acceptance = sample(state, walkers, key)
        _, e_mean, e2_mean = clip_(energy_(state.params, walkers, system), config.clip)
        stats = jnp.stack([e_mean, e2_mean - e_mean**2, acceptance])
        return state._replace(step_size=_adapt(state.step_size, acceptance)), walkers, stats

    return optimiser, (train_kfac if config.optimiser == "kfac" else train_natural_gradient), evaluate


# --8<-- [end:step]


def initial_state(config: Config, mesh: Any, *, equilibrate: bool = True) -> tuple[State, sv.WalkerSet]:
    """Parameters, optimiser state and walkers, equilibrated in the initial wavefunction (:func:`burn_in`)."""
    system, dtype, root = SYSTEMS[config.system], _dtype(config), jax.random.key(config.seed)
    optimiser, _, _ = make_steps(config, mesh)
    params = sv.replicate(init_params(config), mesh)

    def init_walker(key: jax.Array) -> dict:
        return {"r": systems.init_walkers(key, system, 1, dtype)[0], "log_psi": jnp.zeros((), dtype)}

    walkers = sv.initialize_walkers_sharded(init_walker, config.walkers, mesh, key=jax.random.fold_in(root, 0))
    walkers = refresh.with_options(mesh=mesh, batch_size=config.batch_size)(params, walkers, system)
    if config.optimiser == "kfac":
        positions = sv.WalkerSet(walkers.data["r"], walkers.n_valid)
        opt = optimiser.init(params, jax.random.fold_in(root, 10**6 + 1), positions)
    else:
        opt = jax.jit(optimiser.init)(params)
    state = State(params, opt, sv.replicate(jnp.asarray(config.step_size, dtype), mesh))
    return burn_in(config, mesh, state, walkers) if equilibrate else (state, walkers)


def burn_in(config: Config, mesh: Any, state: State, walkers: sv.WalkerSet) -> tuple[State, sv.WalkerSet]:
    """``config.burn_in`` Metropolis moves with the parameters fixed (and the step size adapting)."""
    _, _, evaluate = make_steps(config, mesh)
    root = jax.random.key(config.seed)
    for i in range(-(-config.burn_in // config.sweeps)):  # the same compiled step as the evaluation's
        state, walkers, _ = evaluate(state, walkers, jax.random.fold_in(root, 2**31 + i))
    return state, walkers


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------


def run(
    config: Config,
    mesh: Any,
    *,
    checkpoint: str | None = None,
    checkpoint_every: int = 100,
    resume: bool = False,
    stop_after: int | None = None,
    print_every: int | None = None,
    printer: Callable[[str], Any] = print,
    bar: bool = False,
) -> dict[str, Any]:
    """Optimise for ``config.steps`` steps, then evaluate for ``config.eval_steps``; a summary dict.

    With ``checkpoint`` (a directory), the state is saved every ``checkpoint_every`` steps
    and at the end; ``resume`` continues from its latest step (on any mesh). A
    preemption notice (SIGTERM) saves the state and returns with ``status="preempted"``;
    ``stop_after`` stops after that step (``status="stopped"``).
    """
    start_time = time.perf_counter()
    total = config.steps + config.eval_steps
    end = total if stop_after is None else min(total, stop_after)
    root = jax.random.key(config.seed)
    saves = plumbing.Checkpoints(checkpoint, checkpoint_every, ("energy", "variance", "acceptance"))
    with jax.enable_x64(config.x64), sv.use_mesh(mesh):
        _, train, evaluate = make_steps(config, mesh)
        state, walkers = initial_state(config, mesh, equilibrate=False)  # a resume needs only its structure
        history: list[list[float]] = []
        restored = saves.restore({"state": state, "walkers": walkers}, mesh) if resume else None
        if restored is not None:
            saved, metadata, history = restored
            differ = {k for k, v in metadata["config"].items() if k not in ("steps", "eval_steps", "batch_size")
                      and getattr(config, k) != v}  # fmt: skip
            if differ:
                raise SystemExit(f"{checkpoint} was written with other settings: {sorted(differ)}")
            state, walkers = saved["state"], saved["walkers"]
            printer(f"resumed from {checkpoint} at step {metadata['step']}")
        else:
            state, walkers = burn_in(config, mesh, state, walkers)
        sv.distributed.check_consistent(state.params)  # every process holds the same parameters

        first = len(history)
        progress = plumbing.Progress(total, first, config.walkers, printer, max(total // 20, 1) if print_every is None
                                     else print_every, bar)  # fmt: skip
        status, compile_seconds = "finished" if end == total else "stopped", None
        metadata = {"config": dataclasses.asdict(config)}
        for t in range(first, end):
            t0 = time.perf_counter()
            step = train if t < config.steps else evaluate
            state, walkers, stats = step(state, walkers, jax.random.fold_in(root, t + 1))
            history.append([float(v) for v in plumbing.to_host(stats)])
            compile_seconds = time.perf_counter() - t0 if compile_seconds is None else compile_seconds
            progress.update(t, "opt " if t < config.steps else "eval", *history[-1])
            if not np.isfinite(history[-1][0]):
                raise FloatingPointError(f"the energy is {history[-1][0]} at step {t + 1}")
            saves.record(history)
            if saves.after_step(t + 1, lambda: {"state": state, "walkers": walkers}, metadata, last=t + 1 == end):
                status = "preempted"
                break
        progress.close()
        saves.close()
        n_params = int(ravel_pytree(state.params)[0].size)
    return summarise(config, history, status, mesh, n_params, time.perf_counter() - start_time, compile_seconds)


def summarise(
    config: Config, history: list[list[float]], status: str, mesh: Any, n_params: int, seconds: float,
    compile_seconds: float | None,
) -> dict[str, Any]:  # fmt: skip
    """The run's summary: the evaluation's energy with its error bar (``sv.statistics``) when there is one."""
    system = SYSTEMS[config.system]
    h = np.asarray(history, dtype=np.float64).reshape(-1, 3)
    evaluation = h[config.steps :, 0]
    energy = error = fraction = None
    if status == "finished" and evaluation.size:
        # The per-step means over all walkers: one chain, whose error bar accounts for its autocorrelation.
        with jax.enable_x64(True):  # the float64 history, whatever the run computed in
            stats = sv.statistics(evaluation[None], mesh=sv.create_mesh(jax.local_devices()[:1]))
        energy, error = float(stats.mean), float(stats.error_of_mean)
        if system.hf_energy is not None:
            fraction = (system.hf_energy - energy) / (system.hf_energy - system.exact_energy)
    optimisation = h[: config.steps, 0]
    average = np.convolve(optimisation, np.ones(50) / 50, mode="valid") if optimisation.size >= 50 else np.zeros(0)
    reached = np.flatnonzero(average <= system.exact_energy + CHEMICAL_ACCURACY)
    return {
        "system": config.system, "optimiser": config.optimiser, "status": status, "steps_done": len(h),
        "energy": energy, "error": error, "exact": system.exact_energy, "hf": system.hf_energy,
        "correlation_fraction": fraction,
        "best_average_50": float(average.min()) if average.size else None,
        "chemical_accuracy_step": int(reached[0]) + 50 if reached.size else None,
        "devices": int(mesh.devices.size), "platform": str(mesh.devices.flat[0].platform),
        "processes": int(jax.process_count()), "walkers": config.walkers, "n_params": n_params,
        "seconds": seconds, "compile_seconds": compile_seconds, "config": dataclasses.asdict(config),
        "energies": h[:, 0].tolist(), "variances": h[:, 1].tolist(), "acceptances": h[:, 2].tolist(),
    }  # fmt: skip


def report(summary: dict[str, Any], quick: bool) -> list[str]:
    """What the run says at its end: an energy only for a finished run; no correlation percentage for a smoke test."""
    s = summary
    lines = [
        f"{s['system']}, {s['optimiser']}: {s['walkers']} walkers on {s['devices']} {s['platform']} devices, "
        f"{s['n_params']} parameters, {s['steps_done']} steps in {s['seconds']:.1f} s"
    ]
    total = s["config"]["steps"] + s["config"]["eval_steps"]
    if s["status"] != "finished":
        lines.append(f"{s['status']} after step {s['steps_done']} of {total}: continue it with --resume")
    elif s["energy"] is not None:
        lines.append(f"E = {s['energy']:.5f} +- {s['error']:.5f} Ha (exact {s['exact']})")
        if quick:
            lines.append("a --quick smoke test: a tiny network after a few steps, not a converged energy")
        elif s["correlation_fraction"] is not None:
            lines.append(f"correlation energy recovered: {100 * s['correlation_fraction']:.1f} %")
    if not quick and s["best_average_50"] is not None:
        target = s["exact"] + CHEMICAL_ACCURACY
        when = s["chemical_accuracy_step"]
        lines.append(
            f"50-step average: best {s['best_average_50']:.5f} Ha; "
            + (f"reached {target:.4f} at step {when}" if when else f"did not reach {target:.4f}")
        )
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--system", choices=sorted(SYSTEMS), default=d.system)
    p.add_argument("--optimiser", choices=OPTIMISERS, default=d.optimiser, help=f"(default {d.optimiser})")
    for name in ("walkers", "steps", "eval_steps", "hidden", "layers", "determinants", "sweeps", "batch_size"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"(default {getattr(d, name)})")
    for name in ("lr", "lr_decay", "max_norm", "damping"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None, help=f"(default {getattr(d, name)})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quick", action="store_true", help="a few steps of a tiny network (a smoke test)")
    p.add_argument("--float32", action="store_true", help="compute in float32")
    plumbing.add_arguments(p)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` of a command line: the defaults, ``--quick``'s, then the options given."""
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for field in dataclasses.fields(Config):
        if getattr(args, field.name, None) is not None:
            values[field.name] = getattr(args, field.name)
    return Config(**values, x64=not args.float32)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example from the command line; returns the summary."""
    args = parse_args(argv)
    mesh = plumbing.start(args.devices)
    config = config_from_args(args)
    lead = plumbing.is_lead()
    printer = print if lead else (lambda *_: None)
    summary = run(config, mesh, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                  resume=args.resume, stop_after=args.stop_after, print_every=args.print_every, printer=printer,
                  bar=lead and not args.no_bar)  # fmt: skip
    for line in report(summary, args.quick):
        printer(line)
    plumbing.write_json(args.json, summary)
    if args.plot and lead:
        plumbing.plot(args.plot, summary["energies"], exact=summary["exact"], hf=summary["hf"],
                      title=f"{config.system}, {config.optimiser}", phases=config.steps)  # fmt: skip
    if summary["status"] == "preempted":
        sys.exit(sv.distributed.PREEMPTED_EXIT_CODE)  # the batch system requeues; --resume continues
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
