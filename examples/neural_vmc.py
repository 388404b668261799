"""A FermiNet-style neural-network wavefunction for atoms and small molecules, on every device.

The real workload: a permutation-equivariant network (one- and two-electron streams,
K determinants with exponential envelopes, a cusp Jastrow; the corpus model
``examples/models/ferminet.py``) trained by variational Monte Carlo with the natural
gradient. Every per-walker piece is written for ONE walker and made walker-parallel
with ``sv.walker_parallel``:

- ``metropolis``: several all-electron Gaussian moves per step with a ``WalkerKey``
  (an adaptive step size, kept near 50 % acceptance; the acceptance is a ``Mean``);
- ``measure``: the local energy by ``folx.forward_laplacian`` and the walker's row of
  the Jacobian ``J = d log|psi| / d params`` (flattened), chunked by ``batch_size``;
- ``clip``: FermiNet's energy clipping for the gradient (local energies clipped to
  mean +- 5 mean absolute deviations, the window from ``sv.all_walkers`` under
  ``stop_gradient``). It is a kernel of its own because ``sv.all_walkers`` cannot see
  across the chunks of a ``batch_size`` kernel;
- ``refresh``: log|psi| of each walker for new parameters.

The update is ``sv.natural_gradient`` (minSR by default, or SPRING, dense SR, CG) with
damping 1e-3, a learning rate ``lr / (1 + t / decay)`` and a norm constraint (the step's
length in the Fisher metric, ``lr^2 d.S.d``, at most ``--max-norm``); J never leaves
its device. After the optimisation an evaluation phase with fixed parameters gives the
energy and its error bar (``sv.statistics``). Walkers live in a ``sv.WalkerSet``.

Systems (atoms and charges as data, ``examples/models/systems.py``): Li (exact -7.47806,
HF -7.43273), LiH at 3.015 bohr (exact -8.07050), Be (exact -14.66736, HF -14.57302).

Run it (8 fake CPU devices when there is no accelerator; float64 by default):

    python examples/neural_vmc.py --system Li
    python examples/neural_vmc.py --system Be --steps 3000 --json be.json --plot be.png
    python examples/neural_vmc.py --quick --devices 1              # seconds: a smoke test
    python examples/neural_vmc.py --checkpoint run.ckpt --checkpoint-every 50     # kill it ...
    python examples/neural_vmc.py --checkpoint run.ckpt --checkpoint-every 50 --resume --devices 4
    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python examples/neural_vmc.py --quick

Checkpoints (``--checkpoint PATH`` every ``--checkpoint-every`` steps, written
atomically by ``sv.save_walkers``) hold the walkers with their count and cached
log|psi|, and in the JSON metadata the parameters, SPRING's previous update, the
Metropolis step size, the step, the seed, the settings and the history. JSON holds
floats exactly (shortest round-trip repr), so ``--resume`` continues bit-identically
in float64 on the same device count, and on another to round-off with a direct solver
(minsr, spring, dense; CG's tolerance, far above round-off, lets the chain drift apart
within some 20 steps); a run killed by SIGKILL resumes from its last checkpoint. The randomness of step ``t`` is
``fold_in(key(seed), t)`` and then the walker index, whatever the device count.

Measured (2 CPU cores, 8 fake devices, float64, 2026-11-30; ``docs/neural.md`` has the
details). The default Li run on the quiet machine (load average 1.4 to 4):

    python examples/neural_vmc.py --system Li                 # the defaults: 700 + 300 steps
        E = -7.47765 +- 0.00019 Ha (exact -7.47806, HF -7.43273): 99.1 % of the
        correlation energy, in 155 s (10 s of it compiling), 3,500 walkers/s
    python examples/neural_vmc.py --system Be                 # the defaults
        E = -14.66567 +- 0.00082 Ha (exact -14.66736): 98.2 %, in 217 s

and, while the machine was shared with four other engineers' jobs (load average 8 to
20; wall times inflated: the same default Li run took 703 s, with identical energies):
    python examples/neural_vmc.py --system Li --steps 1500 --eval-steps 400
        E = -7.47821 +- 0.00017 Ha, 100.3 % of the correlation energy, 1458 s;
        the 50-step running average reached -7.4765 at step 332
    python examples/neural_vmc.py --system Be --steps 1500 --eval-steps 400
        E = -14.66686 +- 0.00042 Ha, 99.5 %, 1937 s; -14.660 reached at step 421
    python examples/neural_vmc.py --system LiH --steps 1000 --eval-steps 200
        E = -8.07004 +- 0.00043 Ha (exact -8.07050), 1679 s
"""

from __future__ import annotations

import os

# XLA's CPU runtime (jaxlib 0.10.2) deadlocks on the second call of a compiled step that
# holds a folx local energy, a per-walker Jacobian and a linear solve (every thread idles
# on a futex) unless the concurrency-optimised scheduler is off. Set before JAX starts.
if "--xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from models import ferminet, hamiltonian, systems  # noqa: E402

import shardvmc as sv  # noqa: E402

SYSTEMS = {name: systems.SYSTEMS[name] for name in ("Li", "LiH", "Be")}
OPTIMISERS = ("minsr", "spring", "dense", "cg")
CHEMICAL_ACCURACY = 1.6e-3  # Hartree (1 kcal/mol)


# ---------------------------------------------------------------------------
# Settings.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run (hashable: the compiled steps are cached on it)."""

    system: str = "Li"
    walkers: int = 512
    steps: int = 700
    eval_steps: int = 300
    seed: int = 0
    hidden: int = 32
    hidden_two: int = 8
    layers: int = 2
    determinants: int = 4
    sweeps: int = 20
    burn_in: int = 100  # Metropolis moves before the first step (in steps of `sweeps`)
    step_size: float = 0.3
    optimiser: str = "minsr"
    damping: float = 1e-3
    momentum: float = 0.9
    lr: float = 0.1
    lr_decay: float = 2000.0
    max_norm: float = 0.05
    clip: float = 5.0
    batch_size: int | None = None
    x64: bool = True


QUICK = {"walkers": 64, "steps": 6, "eval_steps": 4, "hidden": 8, "hidden_two": 4, "layers": 1,
         "determinants": 1, "sweeps": 2, "burn_in": 4}  # fmt: skip
"""``--quick``: a few steps of a tiny network on few walkers (seconds; the tests' runs)."""


# ---------------------------------------------------------------------------
# The per-walker physics (the network and the Hamiltonian come from the corpus).
# ---------------------------------------------------------------------------


def make_log_psi(system: systems.System) -> Callable[[Any, jax.Array], jax.Array]:
    """``log_psi(params, r)`` of one walker ``r`` of shape ``(n_electrons, 3)``."""
    return functools.partial(_log_psi, system=system)


def _log_psi(params: Any, r: jax.Array, system: systems.System) -> jax.Array:
    return ferminet.log_psi(params, r, system)


def init_params(config: Config, dtype: Any) -> Any:
    """The network's parameters for ``config`` (a dict of arrays), from ``fold_in(key(seed), 10**6)``."""
    sizes = (config.hidden, config.hidden_two, config.layers, config.determinants)
    return _init_params(config.system, config.seed, sizes, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init_params(system: str, seed: int, sizes: tuple[int, int, int, int], dtype: Any) -> Any:
    """Jitted (one compilation, not one per small eager operation) on the settings it depends on."""
    hidden_one, hidden_two, layers, determinants = sizes
    return ferminet.init(
        jax.random.fold_in(jax.random.key(seed), 10**6),
        SYSTEMS[system],
        hidden_one=hidden_one,
        hidden_two=hidden_two,
        layers=layers,
        determinants=determinants,
        dtype=dtype,
    )


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
    log_psi = make_log_psi(system)

    def move(i: jax.Array, carry: tuple[dict, jax.Array]) -> tuple[dict, jax.Array]:
        w, accepted = carry
        k_move, k_accept = jax.random.split(jax.random.fold_in(key, i))
        proposal = w["r"] + step_size * jax.random.normal(k_move, w["r"].shape, w["r"].dtype)
        new_log_psi = log_psi(params, proposal)
        accept = jnp.log(jax.random.uniform(k_accept, dtype=w["r"].dtype)) < 2.0 * (new_log_psi - w["log_psi"])
        w = {
            "r": jnp.where(accept, proposal, w["r"]),
            "log_psi": jnp.where(accept, new_log_psi, w["log_psi"]),
        }
        return w, accepted + accept.astype(w["r"].dtype)

    walker, accepted = jax.lax.fori_loop(0, sweeps, move, (walker, jnp.zeros((), walker["r"].dtype)))
    return walker, accepted / sweeps


@sv.walker_parallel
def refresh(params: sv.Replicated[Any], walker: sv.PerWalker[dict], system: sv.Static[systems.System]) -> dict:
    """The walker with log|psi| recomputed for new parameters."""
    return {"r": walker["r"], "log_psi": make_log_psi(system)(params, walker["r"])}


@sv.walker_parallel
def measure(
    params: sv.Replicated[Any], walker: sv.PerWalker[dict], system: sv.Static[systems.System]
) -> tuple[sv.PerWalker[jax.Array], sv.PerWalker[jax.Array]]:
    """Local energy (folx forward Laplacian) and the flat log-derivative row of ONE walker."""
    log_psi = make_log_psi(system)
    e = hamiltonian.make_local_energy(log_psi, system, method="folx")(params, walker["r"])
    flat, unravel = ravel_pytree(params)
    j = jax.grad(lambda p: log_psi(unravel(p), walker["r"]))(flat)
    return e, j


@sv.walker_parallel
def energy(
    params: sv.Replicated[Any], walker: sv.PerWalker[dict], system: sv.Static[systems.System]
) -> sv.PerWalker[jax.Array]:
    """Local energy of ONE walker only (the evaluation phase needs no gradient)."""
    return hamiltonian.make_local_energy(make_log_psi(system), system, method="folx")(params, walker["r"])


@sv.walker_parallel
def clip(
    e: sv.PerWalker[jax.Array], width: sv.Static[float]
) -> tuple[sv.PerWalker[jax.Array], sv.Mean[jax.Array], sv.Mean[jax.Array]]:
    """FermiNet's clipping: ``e`` clipped to mean +- ``width`` mean absolute deviations.

    The window is a statistic over all valid walkers (``sv.all_walkers``), held constant
    (``stop_gradient``); also returns the means of the unclipped ``e`` and ``e**2``.
    """
    mean = jax.lax.stop_gradient(sv.all_walkers.mean(e))
    mad = jax.lax.stop_gradient(sv.all_walkers.mean(jnp.abs(e - mean)))
    return jnp.clip(e, mean - width * mad, mean + width * mad), e, e**2


# --8<-- [end:kernels]


class Kernels(NamedTuple):
    """The walker-parallel kernels of one run (on one mesh, with one ``batch_size``)."""

    metropolis: sv.WalkerParallel
    refresh: sv.WalkerParallel
    measure: sv.WalkerParallel
    energy: sv.WalkerParallel
    clip: sv.WalkerParallel


@functools.cache
def make_kernels(mesh: Mesh, batch_size: int | None) -> Kernels:
    """The kernels on ``mesh``; ``batch_size`` chunks the expensive ones (not ``clip``)."""
    chunked = sv.walker_parallel(mesh=mesh, batch_size=batch_size)
    whole = sv.walker_parallel(mesh=mesh)
    return Kernels(
        chunked(metropolis.__wrapped__),
        chunked(refresh.__wrapped__),
        chunked(measure.__wrapped__),
        chunked(energy.__wrapped__),
        whole(clip.__wrapped__),
    )


# ---------------------------------------------------------------------------
# Statistics.
# ---------------------------------------------------------------------------


def clip_reference(e: np.ndarray, width: float = 5.0) -> np.ndarray:
    """NumPy reference of :func:`clip`: ``e`` clipped to mean +- ``width`` mean absolute deviations.

    Example:
        >>> float(clip_reference(np.array([0.0] * 19 + [100.0])).max())  # mean 5 + 5 x 9.5
        52.5
    """
    mean = e.mean()
    mad = np.abs(e - mean).mean()
    return np.clip(e, mean - width * mad, mean + width * mad)


# ---------------------------------------------------------------------------
# The optimisation step and the evaluation step.
# ---------------------------------------------------------------------------


class State(NamedTuple):
    """Everything that changes from step to step (besides the walkers)."""

    params: Any  # the network's parameters (replicated)
    previous: jax.Array  # SPRING's previous update (flat; zeros for the other optimisers)
    step_size: jax.Array  # the Metropolis proposal width (adapted)


def _adapt(step_size: jax.Array, acceptance: jax.Array) -> jax.Array:
    """Nudge the proposal width towards 50 % acceptance (acceptance is a count over walkers: exact)."""
    factor = jnp.where(acceptance > 0.55, 1.05, jnp.where(acceptance < 0.45, 1 / 1.05, 1.0))
    return jnp.clip(step_size * factor, 0.02, 2.0)


# --8<-- [start:step]
@functools.cache
def make_steps(config: Config, mesh: Mesh) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The jitted optimisation step and evaluation step of ``config`` on ``mesh``.

    ``train(state, walkers, key, t) -> (state, walkers, stats)`` samples, measures, clips,
    solves for the natural gradient and updates the parameters; ``evaluate(state,
    walkers, key)`` only samples and measures. ``stats`` = [energy, variance, acceptance,
    step size, learning rate].
    """
    kernels = make_kernels(mesh, config.batch_size)
    system = SYSTEMS[config.system]

    def sample(state: State, walkers: sv.WalkerSet, key: jax.Array) -> tuple[sv.WalkerSet, jax.Array]:
        return kernels.metropolis(state.params, walkers, key, state.step_size, system, config.sweeps)

    @jax.jit
    def train(state: State, walkers: sv.WalkerSet, key: jax.Array, t: jax.Array) -> Any:
        walkers, acceptance = sample(state, walkers, key)
        e, j = kernels.measure(state.params, walkers, system)
        e_clipped, e_mean, e2_mean = kernels.clip(e, config.clip)
        spring = config.optimiser == "spring"
        update, _ = sv.natural_gradient(
            j,
            e_clipped,
            damping=config.damping,
            method=config.optimiser,
            momentum=config.momentum if spring else 0.0,
            previous=state.previous if spring else None,
            mesh=mesh,
        )
        # Norm constraint: the step's squared length in the Fisher metric, lr^2 u.S.u (the
        # variance of J.u over the walkers), is at most max_norm; lr decays as lr / (1 + t / decay).
        ju = jax.tree.map(lambda x: x @ update, j)
        u_s_u = sv.walker_mean(jax.tree.map(lambda x: x**2, ju)) - sv.walker_mean(ju) ** 2
        lr = jnp.minimum(config.lr / (1.0 + t / config.lr_decay), jnp.sqrt(config.max_norm / jnp.maximum(u_s_u, 1e-30)))
        flat, unravel = ravel_pytree(state.params)
        params = unravel(flat - lr * update)
        walkers = kernels.refresh(params, walkers, system)
        new = State(params, update if spring else state.previous, _adapt(state.step_size, acceptance))
        return new, walkers, jnp.stack([e_mean, e2_mean - e_mean**2, acceptance, state.step_size, lr])

    @jax.jit
    def evaluate(state: State, walkers: sv.WalkerSet, key: jax.Array) -> Any:
        walkers, acceptance = sample(state, walkers, key)
        e = kernels.energy(state.params, walkers, system)
        _, e_mean, e2_mean = kernels.clip(e, config.clip)
        stats = jnp.stack([e_mean, e2_mean - e_mean**2, acceptance, state.step_size, jnp.zeros_like(e_mean)])
        return State(state.params, state.previous, _adapt(state.step_size, acceptance)), walkers, stats

    return train, evaluate


# --8<-- [end:step]


# ---------------------------------------------------------------------------
# Checkpoints.
# ---------------------------------------------------------------------------


def host(x: Any) -> np.ndarray:
    """This process's copy of a replicated array (also in multi-process runs), as NumPy."""
    if isinstance(x, jax.Array):
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def save_checkpoint(path: str, config: Config, state: State, walkers: sv.WalkerSet, step: int, history: list) -> None:
    """Write walkers (with their count) and, as JSON metadata, everything else; atomically.

    JSON writes each float as its shortest round-trip repr, so the parameters come back
    bit-identical. Called on every process (a collective); process 0 commits.
    """
    flat = host(ravel_pytree(state.params)[0])
    metadata = {
        "step": step,
        "config": dataclasses.asdict(config),
        "params": flat.tolist(),
        "dtype": str(flat.dtype),
        "previous": host(state.previous).tolist(),
        "step_size": float(host(state.step_size)),
        "history": [list(map(float, h)) for h in history],
    }
    sv.save_walkers(path, walkers, metadata=metadata)


def load_checkpoint(path: str, config: Config, mesh: Mesh, like: State) -> tuple[State, sv.WalkerSet, int, list]:
    """Read a checkpoint of :func:`save_checkpoint` onto ``mesh`` (any device count)."""
    dtype = ravel_pytree(like.params)[0].dtype
    walker_like = {"r": jnp.zeros((1, SYSTEMS[config.system].n_electrons, 3), dtype), "log_psi": jnp.zeros((1,), dtype)}
    walkers, _, meta = sv.load_walkers(path, walker_like, mesh)
    saved = Config(**meta["config"])
    differing = {
        k
        for k in dataclasses.asdict(config)
        if getattr(config, k) != getattr(saved, k) and k not in ("steps", "eval_steps", "batch_size")
    }
    if differing:
        raise SystemExit(f"{path} was written with other settings: {sorted(differing)}; pass the same options")
    _, unravel = ravel_pytree(like.params)
    state = State(
        params=sv.replicate(unravel(jnp.asarray(np.asarray(meta["params"], dtype))), mesh),
        previous=sv.replicate(jnp.asarray(np.asarray(meta["previous"], dtype)), mesh),
        step_size=sv.replicate(jnp.asarray(meta["step_size"], dtype), mesh),
    )
    return state, walkers, int(meta["step"]), [list(h) for h in meta["history"]]


# ---------------------------------------------------------------------------
# Progress display.
# ---------------------------------------------------------------------------


class Progress:
    """A tqdm bar when tqdm is installed (and ``bar``), else a line every ``every`` steps."""

    def __init__(self, total: int, start: int, walkers: int, printer: Callable[[str], Any], every: int, bar: bool):
        self.total, self.walkers, self.printer, self.every = total, walkers, printer, every
        self.start_step, self.t0 = start, None
        self.bar = None
        if bar:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, t: int, phase: str, stats: np.ndarray) -> None:
        """Report step ``t`` (0-based, just finished) with its statistics."""
        now = time.perf_counter()
        if self.t0 is None:  # the first step compiles: rates count from its end
            self.t0, self.start_step = now, t + 1
        done = t + 1 - self.start_step
        rate = done / (now - self.t0) if done and now > self.t0 else float("nan")
        eta = (self.total - t - 1) / rate if rate == rate and rate > 0 else float("nan")
        energy, variance, acceptance = stats[0], stats[1], stats[2]
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{phase} E={energy:+.5f} var={variance:.3f} acc={acceptance:.2f} walkers/s={rate * self.walkers:.0f}"
            )
            self.bar.update(1)
        elif self.every and (t + 1 == self.start_step or (t + 1) % self.every == 0 or t + 1 == self.total):
            self.printer(
                f"{phase} step {t + 1:5d}/{self.total}  E = {energy:+.5f}  var = {variance:.4f}  "
                f"acc = {acceptance:.3f}  walkers/s = {rate * self.walkers:7.0f}  ETA {_duration(eta)}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    if seconds != seconds:
        return "--:--"
    seconds = int(seconds)
    return (
        f"{seconds // 60:02d}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds // 60 % 60:02d}"
    )


def plot(path: str, summary: dict[str, Any], printer: Callable[[str], Any] = print) -> bool:
    """Energy against step with the exact and Hartree-Fock lines; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        printer("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[examples]'); no plot written")
        return False
    energies = np.asarray(summary["energies"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, energies.size + 1), energies, lw=0.6, label="E (per step)")
    window = 50
    if energies.size >= window:
        avg = np.convolve(energies, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window, energies.size + 1), avg, lw=1.5, label=f"{window}-step average")
    ax.axhline(summary["exact"], color="k", ls="--", label=f"exact {summary['exact']}")
    if summary.get("hf") is not None:
        ax.axhline(summary["hf"], color="r", ls=":", label=f"Hartree-Fock {summary['hf']}")
    ax.axvline(summary["steps"], color="gray", lw=0.5)
    low = summary["exact"] - 0.02
    ax.set_ylim(low, max(summary.get("hf") or summary["exact"], summary["exact"]) + 0.1)
    ax.set_xlabel("step")
    ax.set_ylabel("energy (Ha)")
    ax.set_title(f"{summary['system']}: {summary['energy']:.5f} +- {summary['error']:.5f} Ha")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------


def run(
    config: Config,
    *,
    mesh: Mesh | None = None,
    checkpoint: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    stop_after: int | None = None,
    print_every: int | None = None,
    printer: Callable[[str], Any] = print,
    bar: bool = False,
) -> dict[str, Any]:
    """Optimise the network for ``config.steps`` steps, then evaluate for ``config.eval_steps``.

    Args:
        config: the settings.
        mesh: the devices (default: all).
        checkpoint: where to write checkpoints (and read them with ``resume``).
        checkpoint_every: write one every this many steps (0: only at the end).
        resume: continue from ``checkpoint`` when it exists.
        stop_after: stop after this step (a checkpoint is written there): an
            interrupted run, for tests.
        print_every: progress line period in steps (default about 20 lines; 0: none).
        printer: where progress lines go.
        bar: show a tqdm bar when tqdm is installed.

    Returns:
        A summary dict (``energy``, ``error``, ``variance``, ``acceptance``,
        ``energies`` per step, ``seconds``, ...).
    """
    start_time = time.perf_counter()
    mesh = sv.create_mesh() if mesh is None else mesh
    system = SYSTEMS[config.system]
    total = config.steps + config.eval_steps
    print_every = max(total // 20, 1) if print_every is None else print_every
    root = jax.random.key(config.seed)

    with jax.enable_x64(config.x64), sv.use_mesh(mesh):
        dtype = jnp.float64 if config.x64 else jnp.float32
        params = sv.replicate(init_params(config, dtype), mesh)
        n_params = int(ravel_pytree(params)[0].size)
        state = State(
            params,
            sv.replicate(jnp.zeros((n_params,), dtype), mesh),
            sv.replicate(jnp.asarray(config.step_size, dtype), mesh),
        )
        history: list = []
        start = 0
        train, evaluate = make_steps(config, mesh)
        if resume and checkpoint and Path(checkpoint).exists():
            state, walkers, start, history = load_checkpoint(checkpoint, config, mesh, state)
            printer(f"resumed from {checkpoint} at step {start}")
        else:

            def init_walker(key: jax.Array) -> dict:
                r = systems.init_walkers(key, system, 1, dtype)[0]
                return {"r": r, "log_psi": jnp.zeros((), dtype)}

            walkers = sv.initialize_walkers_sharded(init_walker, config.walkers, key=jax.random.fold_in(root, 0))
            walkers = make_kernels(mesh, config.batch_size).refresh(state.params, walkers, system)
            # Burn-in: the walkers equilibrate in the initial wavefunction, and the step size adapts, by
            # evaluation steps (moves and energies, no update; the same compiled step as later).
            for i in range(-(-config.burn_in // config.sweeps)):
                state, walkers, _ = evaluate(state, walkers, jax.random.fold_in(root, 2**31 + i))
        sv.distributed.check_consistent(state.params)  # every process holds the same parameters

        end = total if stop_after is None else min(total, stop_after)
        progress = Progress(total, start, config.walkers, printer, print_every, bar)
        compile_seconds = None
        for t in range(start, end):
            key = jax.random.fold_in(root, t + 1)
            t0 = time.perf_counter()
            if t < config.steps:
                state, walkers, stats = train(state, walkers, key, jnp.asarray(t, dtype))
            else:
                state, walkers, stats = evaluate(state, walkers, key)
            stats = host(stats)
            if compile_seconds is None:
                compile_seconds = time.perf_counter() - t0
            history.append(stats.tolist())
            progress.update(t, "opt " if t < config.steps else "eval", stats)
            if not np.isfinite(stats[0]):
                raise FloatingPointError(f"the energy is {stats[0]} at step {t + 1}")
            if checkpoint and ((checkpoint_every and (t + 1) % checkpoint_every == 0) or t + 1 == end):
                save_checkpoint(checkpoint, config, state, walkers, t + 1, history)
        progress.close()
        walker_seconds = time.perf_counter() - start_time

        hist = np.asarray(history, dtype=np.float64).reshape(-1, 5)
        final = hist[config.steps :] if len(hist) > config.steps else hist[-min(50, len(hist)) :]
        # The per-step means over all walkers: one chain, whose error bar accounts for its autocorrelation
        # (a few numbers, on a local device).
        stats = sv.statistics(final[None, :, 0], mesh=sv.create_mesh(jax.local_devices()[:1]))
        energy, error = float(stats.mean), float(stats.error_of_mean)
        flat = ravel_pytree(state.params)[0]
    hf = system.hf_energy
    return {
        "system": config.system,
        "energy": energy,
        "error": error,
        "variance": float(final[:, 1].mean()),
        "acceptance": float(final[:, 2].mean()),
        "exact": system.exact_energy,
        "hf": hf,
        "correlation_fraction": None if hf is None else (hf - energy) / (hf - system.exact_energy),
        "running_average_50": float(hist[: config.steps, 0][-50:].mean()) if config.steps else None,
        "devices": int(mesh.devices.size),
        "platform": str(mesh.devices.flat[0].platform),
        "processes": int(jax.process_count()),
        "walkers": config.walkers,
        "n_params": n_params,
        "steps": config.steps,
        "eval_steps": config.eval_steps,
        "steps_done": len(history),
        "config": dataclasses.asdict(config),
        "dtype": str(flat.dtype),
        "seconds": walker_seconds,
        "compile_seconds": compile_seconds,
        "walkers_per_second": (
            config.walkers * (len(history) - start - 1) / max(walker_seconds - (compile_seconds or 0), 1e-9)
            if len(history) - start > 1
            else None
        ),
        "energies": hist[:, 0].tolist(),
        "variances": hist[:, 1].tolist(),
        "acceptances": hist[:, 2].tolist(),
    }


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of the example."""
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--system", choices=sorted(SYSTEMS), default=d.system)
    p.add_argument("--walkers", type=int, default=None, help=f"number of walkers (default {d.walkers})")
    p.add_argument("--steps", type=int, default=None, help=f"optimisation steps (default {d.steps})")
    p.add_argument("--eval-steps", type=int, default=None, help=f"evaluation steps (default {d.eval_steps})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--hidden", type=int, default=None, help=f"one-electron width (default {d.hidden})")
    p.add_argument("--layers", type=int, default=None, help=f"layers (default {d.layers})")
    p.add_argument("--determinants", type=int, default=None, help=f"determinants (default {d.determinants})")
    p.add_argument("--sweeps", type=int, default=None, help=f"Metropolis moves per step (default {d.sweeps})")
    p.add_argument(
        "--optimiser",
        choices=OPTIMISERS,
        default=None,
        help="sv.natural_gradient method (default: minsr on accelerators; on CPU cg, the same\n"
        "update solved matrix-free: minSR solves its N x N system on every device, and 8 fake\n"
        "devices share the host's cores, so it costs 8 solves)",
    )
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate at step 0")
    p.add_argument("--lr-decay", type=float, default=d.lr_decay, help="lr / (1 + t / decay)")
    p.add_argument("--damping", type=float, default=d.damping)
    p.add_argument("--max-norm", type=float, default=d.max_norm, help="largest lr^2 u.S.u of a step")
    p.add_argument("--batch-size", type=int, default=None, help="walkers per device processed at a time")
    p.add_argument("--quick", action="store_true", help="a few steps of a tiny network (a smoke test)")
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help="CPU devices when there is no accelerator: created as fake devices unless XLA_FLAGS\n"
        "already sets a count (then the first N); ignored on accelerators and under shardvmc.launch",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="write a JSON summary here")
    p.add_argument("--plot", metavar="PNG", default=None, help="plot energy vs step (needs matplotlib)")
    p.add_argument("--checkpoint", metavar="PATH", default=None, help="checkpoint file")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")
    p.add_argument("--print-every", type=int, default=None, help="progress line period without tqdm")
    p.add_argument("--no-bar", action="store_true", help="progress lines even when tqdm is installed")
    p.add_argument("--float32", action="store_true", help="compute in float32")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` of a command line (``--quick`` first, then explicit options)."""
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    values.update(system=args.system, seed=args.seed, lr=args.lr, lr_decay=args.lr_decay)
    values["optimiser"] = args.optimiser or ("cg" if jax.devices()[0].platform == "cpu" else "minsr")
    values.update(damping=args.damping, max_norm=args.max_norm, batch_size=args.batch_size, x64=not args.float32)
    for name in ("walkers", "steps", "eval_steps", "hidden", "layers", "determinants", "sweeps"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return Config(**values)


def request_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host devices, unless ``XLA_FLAGS`` already sets a count (before JAX starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example from the command line; returns the summary."""
    args = parse_args(argv)
    request_cpu_devices(args.devices)
    if sv.distributed.is_launched():  # started by `python -m shardvmc.launch`: join the other processes
        sv.distributed.initialize()
    devices = jax.devices()
    if devices[0].platform == "cpu" and jax.process_count() == 1:
        devices = devices[: args.devices]
    lead = jax.process_index() == 0
    printer = print if lead else (lambda *_: None)
    config = config_from_args(args)
    summary = run(
        config,
        mesh=sv.create_mesh(devices),
        checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        stop_after=args.stop_after,
        print_every=args.print_every,
        printer=printer,
        bar=lead and not args.no_bar,
    )
    if lead:
        s = summary
        printer(
            f"{s['system']}: {s['walkers']} walkers on {s['devices']} {s['platform']} devices, "
            f"{s['n_params']} parameters, {s['seconds']:.1f} s"
        )
        if s["correlation_fraction"] is not None:
            printer(f"correlation energy recovered: {100 * s['correlation_fraction']:.1f} %")
        printer(f"E = {s['energy']:.5f} +- {s['error']:.5f} Ha (exact {s['exact']})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        if args.plot:
            plot(args.plot, summary, printer)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
