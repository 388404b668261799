"""Where shardvmc's KFAC step spends its time (DeepQMC's LiH ansatz, 64 walkers): the whole step and its parts.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/kfac_parts.py

Prints one JSON line (``@@`` first) of median times (ms): the step, the step without inverting
the curvature, the step with kfac-jax's own (per-device) curvature, the loss and its gradient,
the local energy.
"""

import contextlib
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
from deepqmc.types import PhysicalConfiguration  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)

import shardvmc as sv  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)
import shardvmc.kfac as svk  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)
from shardvmc import _kfac_compat  # noqa: E402  (after this folder's deepqmc.py is loaded as a module)

W = 64
hamil, ansatz = bench.deepqmc_model(bench.deepqmc_task(W))
params0 = bench.initial_params(hamil, ansatz)
coords, charges = hamil.mol.coords, hamil.mol.charges


def log_psi(p, r):
    return ansatz.apply(p, PhysicalConfiguration(coords, r, jnp.array(0))).log


energy = sv.hamiltonian.local_energy(log_psi, lambda r: sv.hamiltonian.coulomb(r, charges, coords))
pos = sv.initialize_walkers_sharded(lambda k: hamil.init_sample(k, coords, 1).r[0], W, key=jax.random.key(0))
params = sv.replicate(params0)


def timeit(fn, reps=9):
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    ts.sort()
    return round(1e3 * ts[len(ts) // 2], 1)


out = {"devices": jax.device_count()}
loss = svk.energy_loss(log_psi, energy, sv.loss.ClipLogSqueeze())
base = dict(
    value_func_has_aux=True,
    value_func_has_rng=True,
    learning_rate_schedule=lambda t: 0.05,
    norm_constraint=1e-3,
    num_burnin_steps=0,
    estimation_mode="fisher_exact",
    damping_schedule=lambda t: 1e-3,
    momentum_schedule=lambda t: 0.0,
)
for name, extra in (("step", {}), ("no inversion", {"inverse_update_period": 10**6})):
    opt = svk.Optimizer(loss, 0.0, **base, **extra)
    st = opt.init(params, jax.random.key(1), pos)
    _, st, _ = opt.step(params, st, jax.random.key(2), batch=pos)
    out[name] = timeit(lambda: opt.step(params, st, jax.random.key(2), batch=pos)[0])
    if name == "step":
        real = _kfac_compat.valid_walker_curvature
        _kfac_compat.valid_walker_curvature = lambda *a: contextlib.nullcontext()
        opt2 = svk.Optimizer(loss, 0.0, **base)
        st2 = opt2.init(params, jax.random.key(1), pos)
        out["step, kfac-jax's own curvature"] = timeit(lambda: opt2.step(params, st2, jax.random.key(2), batch=pos)[0])
        _kfac_compat.valid_walker_curvature = real


# the loss and gradient alone, inside a kernel as in the step
@sv.walker_parallel(batched=True)
def vg(p: sv.Replicated, r: sv.PerWalker) -> sv.Replicated:
    (v, aux), g = loss(p, jax.random.key(0), r)
    return jax.tree.map(lambda x: jax.lax.pmean(x, "walkers"), g)


out["loss and gradient"] = timeit(lambda: vg(params, pos))
out["local energy"] = timeit(lambda: energy(params, pos))
print("@@" + json.dumps(out))
