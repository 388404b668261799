"""DeepQMC's own sampler step and shardvmc's on the same ansatz, one CPU device: is the gap JAX's version?

Run it with each interpreter (shardvmc's side needs JAX >= 0.10.2; DeepQMC's runs on both,
with ``jax.device_put_replicated`` written out where JAX 0.10 removed it)::

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/sampler_versions.py
    XLA_FLAGS=--xla_force_host_platform_device_count=1 ~/venvs/deepqmc-1.2/bin/python benchmarks/sampler_versions.py

Prints one JSON line (``@@`` first): the JAX version, the flags, each sampler's median time (ms).
"""

import importlib.util
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
spec = importlib.util.spec_from_file_location("dqbench", os.path.join(HERE, "deepqmc.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
import jax  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)
import jax.numpy as jnp  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)

if not hasattr(jax, "device_put_replicated") or jax.__version__ >= "0.10":  # removed in JAX 0.10: the same, by hand
    jax.device_put_replicated = lambda x, devices: jax.tree_util.tree_map(
        lambda y: jnp.stack([jnp.asarray(y)] * len(devices)), x
    )
W = int(os.environ.get("WALKERS", "64"))
task = bench.deepqmc_task(W)
hamil, ansatz = bench.deepqmc_model(task)
params0 = bench.initial_params(hamil, ansatz)
from deepqmc.parallel import pmap, replicate_on_devices, split_rng_key_to_devices  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)
from deepqmc.sampling import initialize_sampler_state  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)
from deepqmc.utils import tree_stack  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)
from hydra.utils import instantiate  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)

out = {"jax": jax.__version__, "flags": os.environ.get("XLA_FLAGS", "")}


def timeit(fn, reps=15):
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 1e3 * ts[len(ts) // 2]


try:
    sampler_factory = instantiate(task["sampler_factory"], _recursive_=True, _convert_="all")
    rng = jax.random.PRNGKey(0)
    idx, sampler = sampler_factory(rng, hamil, ansatz, [hamil.mol], 1, 1)
    params = replicate_on_devices(tree_stack([params0]), globally=True)
    keys = split_rng_key_to_devices(rng)
    state = initialize_sampler_state(keys, sampler, params, W, [hamil.mol])
    sample = pmap(sampler.sample)
    mol = idx.sample()
    out["deepqmc_sampler_ms"] = timeit(lambda: sample(keys, state, params, mol)[0])
except Exception as err:
    out["deepqmc_error"] = f"{type(err).__name__}: {err}"[:300]
try:
    from deepqmc.types import PhysicalConfiguration

    import shardvmc as sv

    coords = hamil.mol.coords

    def log_psi(p, r):
        return ansatz.apply(p, PhysicalConfiguration(coords, r, jnp.array(0))).log

    for unroll in (1,):
        smp = sv.mcmc.Metropolis(log_psi, n_steps=bench.DECORRELATION, target_acceptance=bench.ACCEPTANCE)
        pos = sv.initialize_walkers_sharded(lambda k: hamil.init_sample(k, coords, 1).r[0], W, key=jax.random.key(0))
        p = sv.replicate(params0)
        st = smp.init(p, pos, width=1.0)
        step = jax.jit(smp.step)
        out["shardvmc_sampler_ms"] = timeit(lambda: step(p, st, jax.random.key(1)).walkers.data.r)
except Exception as err:
    out["shardvmc_error"] = f"{type(err).__name__}: {err}"[:300]
print("@@" + json.dumps(out))
