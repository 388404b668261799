"""One process of the multi-process tests (started by ``python -m shardvmc.launch``).

Not a test module itself: ``tests/test_multiprocess.py`` launches it as

    python -m shardvmc.launch --processes 2 --devices-per-process 2 -- python tests/mp_worker.py MODE OUT_DIR

and reads ``OUT_DIR/result_<process>.json``. ``checks(mesh)`` is the same code the test
runs in one process on 4 devices, so the two sets of results can be compared entry by
entry. Importing this module touches no device.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import shardvmc as sv
from shardvmc import _internals  # to see where gloo was pinned

N_WALKERS = 8  # divisible by the 4 devices of the global mesh
N_UNEVEN = 10  # not divisible: padded to 12


def host_walkers(n: int = N_WALKERS) -> np.ndarray:
    """Host data every process holds: walkers of shape (n, 2, 3)."""
    return np.random.default_rng(0).normal(size=(n, 2, 3)).astype(np.float32)


def host_jacobian(n: int = N_WALKERS) -> tuple[np.ndarray, np.ndarray]:
    """A per-walker Jacobian (n, 3) and vector (n,), the same on every process."""
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n,)).astype(np.float32)


def init_walker(key: jax.Array) -> dict[str, jax.Array]:
    return {"r": jax.random.normal(key, (2, 3)), "w": jax.random.uniform(key)}


def log_psi(alpha: jax.Array, r: jax.Array) -> jax.Array:
    return -alpha * jnp.sum(jnp.linalg.norm(r, axis=-1))


@sv.walker_parallel
def energy(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.Mean[jax.Array]:
    return alpha * jnp.sum(r**2)


@sv.walker_parallel
def per_walker(alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array], key: sv.WalkerKey) -> sv.PerWalker:
    return alpha * jnp.sum(r) + jax.random.normal(key)


@sv.walker_parallel(batch_size=1)
def several(
    alpha: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array], scale: sv.Static[float]
) -> tuple[sv.PerWalker, sv.Mean, sv.Sum]:
    grad = jax.grad(log_psi)(alpha, r)  # per walker: this walker's own derivative
    return scale * grad, grad, jnp.sum(r, axis=0)


def _data(tree: Any) -> Any:
    """``tree`` with every ``WalkerSet`` replaced by its walkers (results are compared as plain data)."""
    is_set = lambda x: isinstance(x, sv.WalkerSet)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: x.data if is_set(x) else x, tree, is_leaf=is_set)


def _specs(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: str(x.sharding.spec), _data(tree))


def _host(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: np.asarray(x).tolist(), sv.gather_walkers(_data(tree)))


def checks(mesh: Any) -> dict[str, Any]:
    """Every toolkit function and kernel on ``mesh``; JSON-ready results, the same on any layout."""
    warnings.simplefilter("ignore", sv.PaddingWarning)
    out: dict[str, Any] = {}
    r = host_walkers()
    jac, vec = host_jacobian()

    x = sv.shard_walker({"r": r, "step": 3}, mesh)
    out["shard_walker"] = {"value": _host(x), "spec": _specs(x)}
    y = sv.shard_walker(jnp.asarray(r), mesh)  # from a process-local jax.Array
    out["shard_walker_jax"] = {"value": _host(y), "spec": _specs(y)}

    p = sv.replicate({"a": 1.5, "v": np.arange(3.0, dtype=np.float32)}, mesh)
    out["replicate"] = {
        "value": _host(p),
        "spec": _specs(p),
        "fully_replicated": [bool(v.sharding.is_fully_replicated) for v in jax.tree_util.tree_leaves(p)],
    }

    w = sv.initialize_walkers_sharded(init_walker, N_UNEVEN, mesh, key=jax.random.key(42))
    out["initialize_walkers_sharded"] = {"value": _host(w), "spec": _specs(w)}
    h = sv.initialize_walkers_sharded(None, N_UNEVEN, mesh, initial_walkers=np.arange(N_UNEVEN, dtype=np.float32))
    out["initialize_walkers_sharded_host"] = {"value": _host(h), "spec": _specs(h)}
    # Restarting from walkers already on the (global) mesh: sharded, and replicated needing padding.
    g = sv.initialize_walkers_sharded(None, N_WALKERS, mesh, initial_walkers=sv.shard_walker(r, mesh))
    out["initialize_walkers_sharded_global"] = {"value": _host(g), "spec": _specs(g)}
    u = sv.initialize_walkers_sharded(None, N_UNEVEN, mesh, initial_walkers=sv.replicate(host_walkers(N_UNEVEN), mesh))
    out["initialize_walkers_sharded_global_uneven"] = {"value": _host(u), "spec": _specs(u)}

    # One pytree per device this process addresses, holding its own walkers: the value
    # depends only on the device's position in the mesh, so any layout assembles the same.
    position = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    pytrees = [{"r": 10.0 * position[d.id] + np.arange(2.0, dtype=np.float32), "t": np.float32(7.0)} for d in local]
    a = sv.assemble_sharded(pytrees, mesh)
    out["assemble_sharded"] = {"value": _host(a), "spec": _specs(a)}

    xs = sv.shard_walker(r, mesh)
    js, vs = sv.shard_walker((jac, vec), mesh)
    reductions = {
        "walker_mean": sv.walker_mean(xs, n_valid=5, mesh=mesh),
        "walker_mean_tree": sv.walker_mean({"a": xs, "b": vs}, mesh=mesh),
        "walker_sum": sv.walker_sum(vs, mesh=mesh),
        "walker_sum_host_uneven": sv.walker_sum(np.arange(N_UNEVEN, dtype=np.float32), n_valid=7, mesh=mesh),
        "jtj": sv.jtj(js, n_valid=6, mesh=mesh),
        "jtv": sv.jtv(js, vs, n_valid=6, mesh=mesh),
    }
    out["reductions"] = {
        name: {
            "value": _host(v),
            "fully_replicated": all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(v)),
        }
        for name, v in reductions.items()
    }

    alpha = jnp.float32(0.7)
    key = jax.random.key(3)
    ru = host_walkers(N_UNEVEN)
    with sv.use_mesh(mesh):
        kernels = {
            "mean_host": energy(alpha, r),
            "mean_sharded_n_valid": energy(sv.replicate(alpha), xs, n_valid=5),
            "mean_uneven": energy(alpha, ru),
            "per_walker_key": per_walker(alpha, xs, key),
            "per_walker_key_uneven": per_walker(alpha, ru, key),
            "tuple_n_valid": several(alpha, xs, 2.0, n_valid=6),
            "shard_vmap": sv.shard_vmap(lambda r: jnp.sum(r**2), mesh=mesh)(xs),
        }
    out["kernels"] = {name: _host(v) for name, v in kernels.items()}
    out["kernel_specs"] = {
        "per_walker_key": _specs(kernels["per_walker_key"]),
        "mean_host": _specs(kernels["mean_host"]),
    }
    out["kfac"] = kfac_checks(mesh)
    out["dmc"] = dmc_checks(mesh)
    return out


def kfac_checks(mesh: Any) -> dict[str, Any]:
    """Two KFAC steps with FermiNet's and DeepQMC's losses, float64, 10 walkers; {} where kfac-jax cannot import.

    The network has a dense layer (a Kronecker-factored block) and a scalar outside it (a
    generic block), so both of shardvmc's curvature routes cross the processes.
    """
    try:
        import shardvmc.kfac as svk
    except ImportError:  # kfac-jax 0.0.8 on JAX >= 0.11
        return {}

    def psi(p: dict, r: jax.Array) -> jax.Array:
        return -p["a"] * jnp.sum(r**2) + jnp.sum(jnp.tanh(r.reshape(-1) @ p["w"] + p["b"])) / 4

    out = {}
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        params = {"w": rng.normal(size=(6, 4)) / 3, "b": np.zeros(4), "a": np.float64(0.4)}
        r = host_walkers(N_UNEVEN).astype(np.float64)  # host data, the same on every process
        energy = sv.hamiltonian.local_energy(psi, lambda x: 0.5 * jnp.sum(x**2))
        for name, clipping in (("ferminet", sv.loss.ClipMAD()), ("deepqmc", sv.loss.ClipLogSqueeze())):
            opt = svk.Optimizer(svk.energy_loss(psi, energy, clipping), 0.0, mesh=mesh, value_func_has_aux=True,
                                value_func_has_rng=True, learning_rate_schedule=lambda t: 0.1, norm_constraint=1e-2,
                                num_burnin_steps=0, estimation_mode="fisher_exact")  # fmt: skip
            state = opt.init(params, jax.random.key(0), r)
            p = params
            for t in range(2):
                p, state, stats = opt.step(p, state, jax.random.key(t), batch=r, momentum=0.0, damping=1e-3)
            out[name] = {"params": _host(p), "energy": float(stats["aux"]["energy"]), "n": int(stats["batch_size"])}
    return out


def dmc_checks(mesh: Any, n_steps: int = 4) -> dict[str, Any]:
    """A few DMC steps of two particles in a 3-D oscillator, float64, 13 walkers (padded on 4 devices).

    Each step's statistics and the final walkers. The trial function ``exp(-0.2 r^2)`` is far from the ground
    state's ``exp(-0.5 r^2)`` and the walkers start spread out, so the weights differ a lot: with a halo of one
    walker the copies of some steps reach past it, and both of the comb's routes (the neighbours' halos, and
    the all-gather fallback) cross the processes.
    """
    with jax.enable_x64(True):
        r = 2.0 * host_walkers(13).astype(np.float64)  # host data, the same on every process
        walkers = sv.initialize_walkers_sharded(None, 13, mesh, initial_walkers=r)
        dmc = sv.dmc.DMC(lambda a, x: -a * jnp.sum(x**2), lambda x: 0.5 * jnp.sum(x**2), time_step=0.1, halo=1)
        state = dmc.init(np.float64(0.2), walkers)
        steps = []
        for t in range(n_steps):
            state, stats = dmc.step(state, jax.random.fold_in(jax.random.key(5), t))
            steps.append(_host(stats))
        final = _host(state.walkers)
        return {
            "steps": {name: [s[name] for s in steps] for name in steps[0]},
            "walkers": {name: value[:13] for name, value in final._asdict().items()},
        }


def local_facts(mesh: Any) -> dict[str, Any]:
    """What only this process sees: its shards and devices."""
    x = sv.shard_walker(host_walkers(), mesh)
    w = sv.initialize_walkers_sharded(init_walker, N_UNEVEN, mesh, key=jax.random.key(42)).data
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": len(jax.devices()),
        "local_devices": jax.local_device_count(),
        "n_devices": sv.n_devices(),
        "mesh_processes": [d.process_index for d in mesh.devices.flat],
        "fully_addressable": bool(x.is_fully_addressable),
        # Rows held by this process's devices, and their values.
        "shard_rows": sorted(s.index[0].indices(N_WALKERS)[:2] for s in x.addressable_shards),
        "shard_ok": all(np.array_equal(np.asarray(s.data), host_walkers()[s.index]) for s in x.addressable_shards),
        "init_rows": sorted(s.index[0].indices(12)[:2] for s in w["r"].addressable_shards),
        "collectives": jax.config.jax_cpu_collectives_implementation,
        "gloo_host": _internals.gloo_host(),
    }


def _initialize_twice() -> dict[str, Any]:
    sv.distributed.initialize()  # joins the launched group
    try:
        sv.distributed.initialize()  # the same settings again: a no-op
        same_again: Any = (jax.process_count(), jax.process_index()) == (2, int(os.environ["SHARDVMC_PROCESS_ID"]))
    except Exception as err:  # the test shows what went wrong
        same_again = f"{type(err).__name__}: {err}"
    try:
        sv.distributed.initialize(num_processes=3)
    except sv.CallError as err:
        return {"same_again": same_again, "different": str(err)}
    return {"same_again": same_again, "different": None}


def _users_exit_hooks() -> None:
    """What a user's program may set up before ``initialize``: an exit handler (a logger, a checkpoint
    writer) and its own ``sys.exit``; both must still work when the process fails after ``initialize``."""
    real_exit = sys.exit

    def users_exit(status: Any = None) -> None:
        print(f"user sys.exit({status})", flush=True)
        real_exit(status)

    def exit_handler() -> None:
        print("exit handler registered before initialize ran", flush=True)

    atexit.register(exit_handler)
    sys.exit = users_exit


def main(argv: list[str]) -> None:
    mode, out_dir = argv
    if mode == "crash":
        _users_exit_hooks()
    # Switch the CPU collectives off: initialize() must select gloo again, or the
    # cross-process all-reduces below fail.
    jax.config.update("jax_cpu_collectives_implementation", None)
    facts = {"launched": sv.distributed.is_launched(), "initialize": _initialize_twice()}
    mesh = sv.create_mesh()
    if mode == "crash":
        if jax.process_index() == 1:
            print(f"crashing at {time.time()!r}", flush=True)
            sys.exit(3)  # exits at once, not after JAX's shutdown barrier waited for process 0
        time.sleep(600)  # process 0 is busy (or hangs in a collective) while its peer dies
    result = {"facts": {**facts, **local_facts(mesh)}, "checks": checks(mesh)}
    with open(os.path.join(out_dir, f"result_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
