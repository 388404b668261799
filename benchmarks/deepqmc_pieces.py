"""Two pieces of the DeepQMC comparison, one CPU device, DeepQMC's LiH ansatz of ``deepqmc.py``, 64 walkers.

``sampler``: DeepQMC's own sampler step and shardvmc's on the same ansatz: is the gap JAX's version? Run it
with each interpreter (shardvmc's side needs JAX >= 0.10.2; DeepQMC's runs on both, with
``jax.device_put_replicated`` written out where JAX 0.10 removed it).

``kfac``: where shardvmc's KFAC step (DeepQMC's clipping) spends its time: the step, the step without
inverting the curvature, the step with kfac-jax's own (per-device) curvature, the loss and its gradient,
the local energy.

    export XLA_FLAGS=--xla_force_host_platform_device_count=1
    python benchmarks/deepqmc_pieces.py sampler
    ~/venvs/deepqmc-1.2/bin/python benchmarks/deepqmc_pieces.py sampler
    python benchmarks/deepqmc_pieces.py kfac

Prints one JSON line (``@@`` first) of median times (ms).
"""

import contextlib
import importlib.util
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
WALKERS = 64


def load_benchmark() -> Any:
    """This folder's ``deepqmc.py`` as a module (its ansatz, Hamiltonian and settings)."""
    spec = importlib.util.spec_from_file_location("dqbench", os.path.join(HERE, "deepqmc.py"))
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def timeit(fn: Any, reps: int = 15) -> float:
    """The median of ``reps`` calls in ms, after two."""
    import jax

    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return round(1e3 * sorted(ts)[len(ts) // 2], 2)


def shardvmc_side(bench: Any, hamil: Any, ansatz: Any) -> tuple[Any, Any, Any]:
    """``log_psi`` of one walker, its local energy, and 64 walkers, for shardvmc."""
    import jax
    import jax.numpy as jnp
    from deepqmc.types import PhysicalConfiguration

    import shardvmc as sv

    coords, charges = hamil.mol.coords, hamil.mol.charges

    def log_psi(p: Any, r: Any) -> Any:
        return ansatz.apply(p, PhysicalConfiguration(coords, r, jnp.array(0))).log

    energy = sv.hamiltonian.local_energy(log_psi, lambda r: sv.hamiltonian.coulomb(r, charges, coords))
    walkers = sv.initialize_walkers_sharded(lambda k: hamil.init_sample(k, coords, 1).r[0], WALKERS,
                                            key=jax.random.key(0))  # fmt: skip
    return log_psi, energy, walkers


def sampler(bench: Any, hamil: Any, ansatz: Any, params0: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from deepqmc.parallel import pmap, replicate_on_devices, split_rng_key_to_devices
    from deepqmc.sampling import initialize_sampler_state
    from deepqmc.utils import tree_stack
    from hydra.utils import instantiate

    if jax.__version__ >= "0.10":  # removed in JAX 0.10: the same, by hand
        jax.device_put_replicated = lambda x, devices: jax.tree_util.tree_map(
            lambda y: jnp.stack([jnp.asarray(y)] * len(devices)), x
        )
    out: dict[str, Any] = {}
    task = bench.deepqmc_task(WALKERS)
    rng = jax.random.PRNGKey(0)
    idx, dq_sampler = instantiate(task["sampler_factory"], _recursive_=True, _convert_="all")(
        rng, hamil, ansatz, [hamil.mol], 1, 1
    )
    # Each device's copy on its device, as DeepQMC's training holds them (replicate_on_devices leaves the stacked
    # copies on device 0: pmap would then send them to the devices at every call, 2.5 times the sampler's time)
    params = pmap(lambda p: p)(replicate_on_devices(tree_stack([params0]), globally=True))
    keys = split_rng_key_to_devices(rng)
    state = initialize_sampler_state(keys, dq_sampler, params, WALKERS, [hamil.mol])
    sample, mol = pmap(dq_sampler.sample), idx.sample()
    out["deepqmc_sampler_ms"] = timeit(lambda: sample(keys, state, params, mol)[0])
    try:
        import shardvmc as sv
    except ImportError as err:  # DeepQMC's own interpreter (JAX 0.4)
        out["shardvmc_error"] = f"{type(err).__name__}: {err}"[:300]
        return out
    log_psi, _, walkers = shardvmc_side(bench, hamil, ansatz)
    ours = sv.mcmc.Metropolis(log_psi, n_steps=bench.DECORRELATION, target_acceptance=bench.ACCEPTANCE)
    p = sv.replicate(params0)
    sv_state, step = ours.init(p, walkers, width=1.0), jax.jit(ours.step)
    out["shardvmc_sampler_ms"] = timeit(lambda: step(p, sv_state, jax.random.key(1)).walkers.data.r)
    return out


def kfac(bench: Any, hamil: Any, ansatz: Any, params0: Any) -> dict[str, Any]:
    import jax

    import shardvmc as sv
    import shardvmc.kfac as svk
    from shardvmc import _kfac_compat

    log_psi, energy, walkers = shardvmc_side(bench, hamil, ansatz)
    params, key = sv.replicate(params0), jax.random.key(2)
    loss = svk.energy_loss(log_psi, energy, sv.loss.ClipLogSqueeze())
    settings = dict(value_func_has_aux=True, value_func_has_rng=True, learning_rate_schedule=lambda t: 0.05,
                    norm_constraint=1e-3, num_burnin_steps=0, estimation_mode="fisher_exact",
                    damping_schedule=lambda t: 1e-3, momentum_schedule=lambda t: 0.0)  # fmt: skip

    def step_ms(extra: dict[str, Any]) -> float:
        opt = svk.Optimizer(loss, 0.0, **settings, **extra)
        state = opt.init(params, jax.random.key(1), walkers)
        return timeit(lambda: opt.step(params, state, key, batch=walkers)[0], reps=9)

    out = {"step": step_ms({}), "no inversion": step_ms({"inverse_update_period": 10**6})}
    exact = _kfac_compat.valid_walker_curvature
    _kfac_compat.valid_walker_curvature = lambda *a: contextlib.nullcontext()  # kfac-jax's own curvature
    try:
        out["step, kfac-jax's own curvature"] = step_ms({})
    finally:
        _kfac_compat.valid_walker_curvature = exact

    @sv.walker_parallel(batched=True)
    def gradient(p: sv.Replicated, r: sv.PerWalker) -> sv.Replicated:  # the loss and its gradient, as in the step
        return jax.tree.map(lambda x: jax.lax.pmean(x, "walkers"), loss(p, key, r)[1])

    out["loss and gradient"] = timeit(lambda: gradient(params, walkers), reps=9)
    out["local energy"] = timeit(lambda: energy(params, walkers), reps=9)
    return out


def main() -> None:
    import jax

    what = sys.argv[1] if len(sys.argv) > 1 else "sampler"
    bench = load_benchmark()
    hamil, ansatz = bench.deepqmc_model(bench.deepqmc_task(WALKERS))
    params0 = bench.initial_params(hamil, ansatz)
    out = {"jax": jax.__version__, "flags": os.environ.get("XLA_FLAGS", ""), "devices": jax.device_count()}
    out.update({"sampler": sampler, "kfac": kfac}[what](bench, hamil, ansatz, params0))
    print("@@" + json.dumps(out))


if __name__ == "__main__":
    main()
