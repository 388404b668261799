"""Two pieces of the DeepQMC comparison, DeepQMC's LiH ansatz of ``deepqmc.py``, 64 walkers.

``sampler``: DeepQMC's own sampler step and shardvmc's on the same ansatz, in one process (the same JAX),
interleaved (``harness.interleaved``): DeepQMC's ``sample``, its ``sample`` then ``update`` (what its
training step runs, and ``deepqmc.py``'s sampler piece times: ``update`` recomputes ``psi`` at the new
parameters), shardvmc's step as ``deepqmc.py`` jits it (``refresh=True``: the recomputation inside),
without the recomputation and, where ``sv.compiler_options()`` makes matrix products single-threaded
(the devices fill the cores), with Eigen's multi-threaded products. Each time is the median over the
rounds, each ratio the median of the per-round ratios to DeepQMC's ``sample`` [quartiles]. Also the
operations of each program's move loop (the largest loop of the compiled program: its instructions by
kind, and the loops inside it, the threefry hashes that ``jax.random`` lowers to loops on CPUs). Run
it with each interpreter: shardvmc's side needs JAX >= 0.10.2; DeepQMC's runs on both, with
``jax.device_put_replicated`` written out where JAX 0.10 removed it.

``kfac``: where shardvmc's KFAC step (DeepQMC's clipping) spends its time: the step, the step without
inverting the curvature, the step with kfac-jax's own (per-device) curvature, the loss and its gradient,
the local energy (ms, the median over interleaved rounds).

    export XLA_FLAGS=--xla_force_host_platform_device_count=8   # or 1
    python benchmarks/deepqmc_pieces.py sampler
    ~/venvs/deepqmc-1.2/bin/python benchmarks/deepqmc_pieces.py sampler
    python benchmarks/deepqmc_pieces.py kfac

Prints one JSON line (``@@`` first).
"""

import collections
import contextlib
import importlib.util
import json
import os
import re
import statistics
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# before load_benchmark(): deepqmc.py takes this folder off sys.path (its name is DeepQMC's package's)
from harness import interleaved, ratio  # noqa: E402

WALKERS = 64
ROUNDS = 41
MULTI_THREAD = "xla_cpu_multi_thread_eigen"  # sv.compiler_options() turns it off where the CPU devices fill the cores


def load_benchmark() -> Any:
    """This folder's ``deepqmc.py`` as a module (its ansatz, Hamiltonian and settings)."""
    spec = importlib.util.spec_from_file_location("dqbench", os.path.join(HERE, "deepqmc.py"))
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def medians_ms(times: dict[str, list[float]]) -> dict[str, float]:
    """The median of each thunk's rounds of an :func:`harness.interleaved` measurement, in ms."""
    return {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (?:\(.*?\)|\S+) ([a-z][\w\-]*)\(")  # a tuple shape has spaces
_BODY = re.compile(r"body=%?([\w.\-]+)")
_FREE = {"get-tuple-element", "tuple", "parameter", "constant", "bitcast"}  # no work for the runtime


def move_loop(hlo: str) -> dict[str, Any]:
    """The instructions of a compiled program's largest loop body by kind, and the loops inside it.

    ``get-tuple-element``, ``tuple``, ``parameter``, ``constant`` and ``bitcast`` are left out. ``inner loops``
    gives the instructions of each loop the body runs, counted the same way (a loop's condition is not counted).
    """
    ops: dict[str, collections.Counter] = {}
    calls: dict[str, list[str]] = {}
    name = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
            ops[name], calls[name] = collections.Counter(), []
        elif name and (m := _INSTRUCTION.match(line)):
            if m.group(1) not in _FREE:
                ops[name][m.group(1)] += 1
            calls[name] += _BODY.findall(line)
    loops = {b for body in calls.values() for b in body if b in ops}
    if not loops:
        return {}
    largest = max(loops, key=lambda b: sum(ops[b].values()))
    return {
        "instructions": dict(ops[largest].most_common()),
        "inner loops": [sum(ops[b].values()) for b in calls[largest] if b in ops],
    }


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
    sample, update, mol = pmap(dq_sampler.sample), pmap(dq_sampler.update), idx.sample()
    thunks = {
        "deepqmc sample": lambda: sample(keys, state, params, mol)[0],
        # fit_wf's train_step: sample_wf, the optimiser's step, then update_sampler at the new parameters
        "deepqmc sample + update": lambda: update(sample(keys, state, params, mol)[0], params),
    }
    out["move loop"] = {"deepqmc": move_loop(sample.lower(keys, state, params, mol).compile().as_text() or "")}
    try:
        import shardvmc as sv
    except ImportError as err:  # DeepQMC's own interpreter (JAX 0.4)
        out["shardvmc_error"] = f"{type(err).__name__}: {err}"[:300]
    else:
        log_psi, _, walkers = shardvmc_side(bench, hamil, ansatz)
        ours = sv.mcmc.Metropolis(log_psi, n_steps=bench.DECORRELATION, target_acceptance=bench.ACCEPTANCE)
        p, key = sv.replicate(params0), jax.random.key(1)
        sv_state = ours.init(p, walkers, width=1.0)
        options = sv.compiler_options()
        step = jax.jit(ours.step, static_argnames="refresh", compiler_options=options)  # as deepqmc.py
        thunks["shardvmc step"] = lambda: step(p, sv_state, key).walkers.data.r
        thunks["shardvmc step, refresh=False"] = lambda: step(p, sv_state, key, refresh=False).walkers.data.r
        if options.pop(MULTI_THREAD, True) is False:  # the devices fill the cores: the step with Eigen's pool too
            pooled = jax.jit(ours.step, static_argnames="refresh", compiler_options=options)
            thunks["shardvmc step, multi-threaded products"] = lambda: pooled(p, sv_state, key).walkers.data.r
        out["move loop"]["shardvmc"] = move_loop(step.lower(p, sv_state, key).compile().as_text() or "")
    times = interleaved(thunks, reps=ROUNDS)
    out["ms"] = medians_ms(times)
    out["/ deepqmc sample"] = {name: str(ratio(times, name, "deepqmc sample")) for name in list(times)[1:]}
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

    def step(extra: dict[str, Any]) -> Any:
        opt = svk.Optimizer(loss, 0.0, **settings, **extra)
        state = opt.init(params, jax.random.key(1), walkers)
        return lambda: opt.step(params, state, key, batch=walkers)[0]

    thunks = {"step": step({}), "no inversion": step({"inverse_update_period": 10**6})}
    exact = _kfac_compat.valid_walker_curvature
    _kfac_compat.valid_walker_curvature = lambda *a: contextlib.nullcontext()  # kfac-jax's own curvature
    try:
        thunks["step, kfac-jax's own curvature"] = step({})
        jax.block_until_ready(thunks["step, kfac-jax's own curvature"]())  # traced and compiled under the patch
    finally:
        _kfac_compat.valid_walker_curvature = exact

    @sv.walker_parallel(batched=True)
    def gradient(p: sv.Replicated, r: sv.PerWalker) -> sv.Replicated:  # the loss and its gradient, as in the step
        return jax.tree.map(lambda x: jax.lax.pmean(x, "walkers"), loss(p, key, r)[1])

    thunks["loss and gradient"] = lambda: gradient(params, walkers)
    thunks["local energy"] = lambda: energy(params, walkers)
    return medians_ms(interleaved(thunks, reps=9))


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
